"""The training loop of one rank, and the worker entry every launch path runs."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ptdp import device as devices
from ptdp.status import phase
from ptdp.checkpoint.lock import SaveLock
from ptdp.checkpoint.retention import Lineage, point_latest
from ptdp.checkpoint.snapshot import save_checkpoint
from ptdp.checkpoint.state import TrainingState
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.config import Config
from ptdp.data.batches import ConsumedSamples, GlobalBatches
from ptdp.data.loader import TrainingBatches, TrainingData, build_training_data
from ptdp.data.microbatch import MicrobatchSettings, carries_documents, to_microbatch
from ptdp.data.sft.template_files import tokenizer_side_files
from ptdp.data.sampler import microbatch_indices, training_microbatches
from ptdp.distributed import DistEnv, init_process_group
from ptdp.errors import DivergenceError
from ptdp.checkpoint.adapters import base_identity
from ptdp.model.gpt import build_chunks
from ptdp.model.mtp import mtp_logged, mtp_names
from ptdp.parallel.data_parallel import GradBuffer
from ptdp.parallel.sharded_grads import ShardedGradBuffer
from ptdp.parallel.sharded_params import ShardedParamBuffer
from ptdp.parallel.pipeline.executor import PipelineExecutor, average_loss
from ptdp.schedules.build import build_schedule
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train import lr_resume
from ptdp.train.banner import print_load, report_placement
from ptdp.train.evaluate import Evaluator, evaluate
from ptdp.train.housekeeping import Housekeeping
from ptdp.train.loss_range import RECORD as LOSS_RANGE, LossRange
from ptdp.train.moe_metrics import balancing_metrics, moe_layers, set_aux_loss_scale, \
    start_iteration as start_moe_iteration, update_expert_biases
from ptdp.train.lr_schedule import LRSchedule
from ptdp.train.optimizer import Optimizer, embedding_and_output_weights
from ptdp.train.peak_memory import job_fields as memory_fields, own_codes as memory_codes
from ptdp.train.resume import load_checkpoint
from ptdp.train.run_log import RunLog
from ptdp.train.saves import RunSaves
from ptdp.train.stopping import StopConditions


def worker(env: DistEnv, config: Config) -> list[dict[str, Any]]:
    """Join the job, build this rank's context and train. Same for local,
    torchrun and SLURM launches."""
    par = config.parallel
    kind = devices.resolve_kind(par.device, env.local_world_size)
    devices.configure_threads(kind, env.local_world_size)
    devices.configure_matmul(kind, config.train.disable_bf16_reduced_precision_matmul)
    device = devices.device_for(kind, env.local_rank)
    timeout = timedelta(minutes=par.distributed_timeout_minutes)
    init_process_group(env, devices.backend_for(kind), timeout)
    lock = None
    try:
        # One job at a time saves into --save (ptdp.checkpoint.lock): the first rank holds it.
        lock = SaveLock(config.train.save) if config.train.save and env.rank == 0 else None
        t, c, p = (par.tensor_model_parallel_size, par.context_parallel_size,
                   par.pipeline_model_parallel_size)
        grid = RankGrid(tp=t, cp=c, dp=env.world_size // (t * c * p), pp=p,
                        ep=par.expert_model_parallel_size, etp=par.expert_tensor_size)
        ctx = ParallelContext.build(grid, timeout=timeout)
        return train(config, ctx, device)
    finally:
        if lock is not None:
            lock.release()
        dist.destroy_process_group()


def _tied_accumulations(chunks: list, shared: bool) -> dict:
    """The word embedding, when this rank's lookup and the last chunk's use
    of it (a tied output layer, the MTP modules' lookups) accumulate its
    gradient in separate backward passes (zbv's two chunks on rank 0):
    twice per microbatch (see GradBuffer). `shared`: whether the last chunk
    uses it."""
    first = [c for c in chunks if c.pre_process]
    last = [c for c in chunks if c.post_process]
    if shared and first and last and first[0] is not last[0]:
        return {first[0].embedding.word_embeddings.weight: 2}
    return {}


class Trainer:
    """One rank's share of training: its model chunks, gradient buffer,
    optimizer, schedule and data. `step` runs one iteration."""

    def __init__(self, config: Config, ctx: ParallelContext, device: torch.device,
                 data: TrainingData | None = None, *, start: tuple[int, int] = (0, 0)):
        """`start`: (iteration, consumed samples) this run begins after (a
        resumed run's checkpoint); the data is read from there on."""
        model_cfg, par, tr = config.model, config.parallel, config.train
        self.start_iteration, self.start_consumed = start
        self.skipped_iterations = 0  # steps skipped for an inf/nan gradient, over the whole run
        # (iteration, skipped iterations) where the optimizer's state began:
        # its step count is the iterations since, less those skipped.
        self.optimizer_start: tuple[int, int] | None = (self.start_iteration, 0)
        self.loss_range = LossRange()  # which checkpoints are good (a load replaces it)
        # The run's place in the history of checkpoints, and what a fine-tune
        # started from (a load replaces both: ptdp.checkpoint.retention).
        self.checkpoint_lineage = Lineage.fresh()
        self.finetuned_from: dict | None = None
        # LoRA: the base the adapters train on (a load replaces it), as its
        # checkpoints record it (ptdp.checkpoint.adapters); else drawn from --seed.
        self.lora_base: dict | None = base_identity(None, None, config.train.seed) \
            if config.lora.enabled else None
        # What the run's checkpoints carry: its tokenizer.json (read once, at
        # --load or the first save: a later save may find the loaded
        # checkpoint pruned) and a loaded checkpoint's other Hugging Face files.
        self.carried_tokenizer: bytes | None = None
        self.carried_hf_files: dict[str, bytes] | None = None
        self.config, self.ctx, self.device = config, ctx, device
        p, d, b = ctx.pp_size, ctx.dp_size, tr.micro_batch_size
        self.num_chunks = par.virtual_stages(model_cfg.num_layers)
        self.global_batch, self.num_micro = tr.batch_size(d), tr.num_microbatches(d)
        # Each iteration's own global batch (a ramp-up grows it towards the
        # final one above, which evaluation uses), the run's length, and the
        # learning rate by samples: Megatron-LM's.
        self.batches = GlobalBatches(tr, d)
        self.train_iters = self.batches.train_iters
        self.consumed = ConsumedSamples(self.batches, *start)
        self.lr_schedule = LRSchedule.from_config(tr, self.global_batch)
        # --decoupled-lr: the word embedding's and output layer's own (else None).
        self.decoupled_lr_schedule = LRSchedule.decoupled_from_config(tr, self.global_batch)
        # Where the schedule stands (Megatron-LM's num_steps, in samples): the
        # steps taken, skipped ones left out; a load sets it (lr_resume.py).
        self.lr_steps = self.lr_schedule.position(*start)
        self._schedules: dict[int, Any] = {}  # m -> schedule, for the m of a ramp
        self.dtype = torch.bfloat16 if tr.bf16 else torch.float16 if tr.fp16 else torch.float32

        sequence_parallel = par.sequence_parallel and ctx.tp_size > 1
        self.schedule = build_schedule(par.schedule_kind, p, self.num_micro, self.num_chunks)
        self.measured_costs = None  # zero-bubble: what place_exchanges measured
        self.chunks = build_chunks(model_cfg, ctx, device, tr.seed, self.num_chunks,
                                   sequence_parallel=sequence_parallel, kind=par.schedule_kind,
                                   split=par.layer_split, cp_comm_type=par.cp_comm_type,
                                   lora=config.lora, compile=tr.compile)
        self.model = torch.nn.ModuleList(self.chunks)
        self.moe_layers = moe_layers(self.chunks)
        # --mtp-num-layers: the last stage's MTP losses, logged as Megatron-LM names them.
        self.mtp_names = mtp_names(model_cfg.mtp_depth)
        # The rank of the last virtual stage, which computes the loss (rank 0 under zbv).
        loss_rank = self.schedule.location(self.schedule.num_stages - 1)[0]
        self.holds_loss = loss_rank == ctx.pp_rank
        # The trained parameters: all, or with --lora-rank the adapters only,
        # the frozen base kept in the training precision outside the buffers.
        self.buffer = self._gradient_buffer(loss_rank)
        if tr.overlap_param_gather and tr.sharding_strategy in ("optim", "optim_grads"):
            # The updated weights' gathers wait in each unit's forward pre-hook
            # (ZeRO-3 always gathers a unit ahead: nothing to change there).
            self.buffer.overlap_param_gather([(module, unit) for chunk in self.chunks
                                              for module, unit, _ in chunk.sharding_units()])
        self.optimizer = Optimizer(self.buffer, ctx, tr,
                                   decoupled=embedding_and_output_weights(self.chunks))
        # Under sequence parallelism each tensor rank sends its own s/t
        # positions: the paper's scatter/gather without the gather. Each
        # context rank holds s/c of them.
        positions = model_cfg.seq_length // ctx.cp_size
        positions //= ctx.tp_size if sequence_parallel else 1
        # Packed sequences: every stage reads its microbatches' documents.
        documents = carries_documents(config)
        self.executor = PipelineExecutor(
            self.chunks, ctx, activation_shape=(positions, b, model_cfg.hidden_size),
            dtype=self.dtype, device=device,
            scatter_gather=par.scatter_gather_tensors_in_pipeline and not sequence_parallel,
            documents_on_every_stage=documents)
        self.data = data if data is not None else build_training_data(
            config, num_samples=(self.consumed_before(self.train_iters),
                                 tr.eval_iters * self.global_batch if tr.evaluates else 0, 0),
            is_builder=ctx.rank == 0,
            reads_tokens=ctx.is_first_stage or self.holds_loss or documents,
            barrier=dist.barrier if dist.is_initialized() else None)
        # --num-workers N: N processes read this run's microbatches ahead of the steps.
        self.train_batches = TrainingBatches(self.data.train, config, training_microbatches(
            self.consumed, self.start_iteration, self.train_iters, ctx.dp_rank,
            micro_batch_size=b, data_parallel_size=d))

    def _gradient_buffer(self, loss_rank: int) -> GradBuffer:
        """The trained parameters' flat buffers, sharded as the strategy says
        (ZeRO-1: optimizer state; ZeRO-2: gradients too; ZeRO-3: parameters
        too); with --lora-rank the adapters only, the frozen base kept in the
        training precision outside them."""
        config, ctx = self.config, self.ctx
        model_cfg, tr = config.model, config.train
        params = [param for param in self.model.parameters() if param.requires_grad]
        with torch.no_grad():
            for param in self.model.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(self.dtype)
        # The first and last stage's copies of a word embedding the last
        # stage uses too (a tied output layer, the MTP modules' lookups), whose
        # gradients are summed over the embedding group; none where one rank
        # holds both ends (under zbv rank 0's chunks share one parameter).
        shared = model_cfg.tied_output or bool(model_cfg.mtp_depth)
        tied = ({chunk.embedding.word_embeddings.weight for chunk in self.chunks
                 if hasattr(chunk, "embedding")}
                if ctx.embedding_group is not None and shared and loss_rank != 0
                else set())
        bf16_grads = tr.main_grads_dtype == "bf16"
        options = dict(param_dtype=self.dtype, bucket_size=tr.ddp_bucket_size,
                       shard=tr.sharding_strategy != "no_shard", tied=tied,
                       accumulations=_tied_accumulations(self.chunks, shared),
                       average=not tr.calculate_per_token_loss,
                       # bf16 main gradients are reduced in bf16 too (Megatron-LM's meaning)
                       reduce_dtype=torch.bfloat16 if tr.grad_reduce_in_bf16 or bf16_grads
                       else torch.float32,
                       grad_dtype=torch.bfloat16 if bf16_grads else torch.float32,
                       device=self.device)
        if tr.sharding_strategy not in ("optim_grads", "optim_grads_params"):
            return GradBuffer(params, ctx, **options)
        # ZeRO-2 and ZeRO-3: buckets of one unit (a layer) each, so that the
        # full gradients held at once are a few layers', not the model's.
        units, frozen, ends, seen = [], [], set(), set()
        for chunk in self.chunks:
            for module, unit, end in chunk.sharding_units():
                unit = [p for p in unit if id(p) not in seen]
                seen.update(id(p) for p in unit)
                if end:
                    ends.add(len(units))
                units.append((module, [p for p in unit if p.requires_grad]))
                frozen.append([p for p in unit if not p.requires_grad])  # LoRA's base
        if tr.sharding_strategy == "optim_grads":
            unit_of = {param: i for i, (_, unit) in enumerate(units) for param in unit}
            return ShardedGradBuffer(params, ctx, unit_of=unit_of, **options)
        return ShardedParamBuffer(params, ctx, units=units, ends=ends, frozen=frozen,
                                  reshard_after_forward=tr.reshard_after_forward(ctx.pp_size), **options)

    def schedule_for(self, num_micro: int):
        """The pipeline schedule of an iteration of `num_micro` microbatches:
        self.schedule for the final batch, one built (once) for each smaller
        batch of a ramp-up."""
        if num_micro == self.schedule.m:
            return self.schedule
        if num_micro not in self._schedules:
            s = self.schedule
            self._schedules[num_micro] = build_schedule(s.kind, s.p, num_micro, s.v,
                                                        self.measured_costs)
        return self._schedules[num_micro]

    def place_exchanges(self, stats, num_micro: int | None = None) -> None:
        """Rebuild the zero-bubble schedule with its exchanges placed for the
        F, B and W times `stats` measured per chunk (the slowest tensor and
        data-parallel replica of each pipeline rank; every rank gets the same
        table, so every rank builds the same schedule). The order of the
        computes, and so every number computed, does not change; only where
        ranks wait for transfers does (see ptdp.schedules.zero_bubble)."""
        ctx, schedule = self.ctx, self.schedule
        table = torch.zeros(ctx.pp_size, self.num_chunks, 3, dtype=torch.float64, device=self.device)
        for (op, chunk), seconds in stats.compute_seconds.items():
            table[ctx.pp_rank, chunk, "FBW".index(op)] = seconds / (num_micro or self.num_micro)
        if ctx.world_group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=ctx.world_group)
        measured = table.cpu().tolist()
        costs = tuple(((rank, chunk, op), measured[rank][chunk][k]) for rank in range(ctx.pp_size)
                      for chunk in range(self.num_chunks) for k, op in enumerate("FBW"))
        self.schedule = build_schedule(schedule.kind, schedule.p, schedule.m, schedule.v, costs)
        self.measured_costs = costs
        self._schedules.clear()  # a ramp's other m: rebuilt for these costs when next used

    def consumed_before(self, iteration: int) -> int:
        """Samples consumed before 0-based `iteration` runs."""
        return self.consumed.before(iteration)

    def batch_of(self, iteration: int) -> int:
        """The global batch of 0-based `iteration` (smaller during a ramp-up)."""
        return self.batches.size_at(self.consumed_before(iteration))

    def learning_rate(self, schedule: LRSchedule | None = None) -> float:
        """The rate the next iteration steps with: `schedule`'s (else the main
        one, --lr's) where the schedule stands. After an iteration it is the
        rate logged for it (Megatron-LM's order: see `step`)."""
        return (schedule or self.lr_schedule).lr(self.lr_steps)

    def save(self, directory: str, iteration: int):
        """Checkpoint after `iteration` iterations (every rank calls it); returns its directory."""
        return save_checkpoint(self.training_state(iteration), directory,
                               keep_last=self.config.train.keep_last)

    def training_state(self, iteration: int | None = None) -> TrainingState:
        """This rank's training state, as ptdp.checkpoint writes and reads it:
        after `iteration` iterations for a save (rank 0 then reads the
        tokenizer its checkpoints carry), or as the run starts (None) for a
        load, which fills its model and optimizer."""
        saving = iteration is not None
        iteration = self.start_iteration if iteration is None else iteration
        return TrainingState(
            ctx=self.ctx, config=self.config, chunks=self.chunks, num_chunks=self.num_chunks,
            buffer=self.buffer, optimizer=self.optimizer, device=self.device,
            iteration=iteration, consumed_samples=self.consumed_before(iteration),
            run_start=(self.start_iteration, self.start_consumed),
            optimizer_start=self.optimizer_start, skipped_iterations=self.skipped_iterations,
            lineage=self.checkpoint_lineage, loss_watch=self.loss_range,
            records={lr_resume.RECORD: lr_resume.record(self),
                     LOSS_RANGE: self.loss_range.record()},
            finetuned_from=self.finetuned_from, lora_base=self.lora_base,
            carried_tokenizer=self.tokenizer_to_carry() if saving and self.ctx.rank == 0 else None,
            carried_hf_files=self.hf_files_to_carry() if saving and self.ctx.rank == 0
            else self.carried_hf_files)

    def hf_files_to_carry(self) -> dict[str, bytes] | None:
        """The Hugging Face files the run's checkpoints carry beside its
        tokenizer.json: those of the checkpoint it loaded (where it trains
        with that tokenizer), else those beside the tokenizer.json it was
        given; --chat-template's file as the chat template."""
        data = self.config.data
        if self.tokenizer_to_carry() is None:
            return self.carried_hf_files
        files = dict(self.carried_hf_files or {})
        if not files:
            files = tokenizer_side_files(data.tokenizer_model)
        if data.sft and data.chat_template:
            files.pop("chat_template.json", None)
            files["chat_template.jinja"] = Path(data.chat_template).read_bytes()
        return files or self.carried_hf_files

    def tokenizer_to_carry(self) -> bytes | None:
        """The tokenizer.json the run's checkpoints carry: its own
        (HuggingFaceTokenizer), which may be the copy in the checkpoint it
        resumed from, so a chain of resumes keeps it. Read once, at --load
        or at the first save: a later save may find the loaded checkpoint pruned."""
        data = self.config.data
        if data.mock_data or data.tokenizer_type != "HuggingFaceTokenizer" or not data.tokenizer_model:
            return None
        if self.carried_tokenizer is None:
            self.carried_tokenizer = Path(data.tokenizer_model).read_bytes()
        return self.carried_tokenizer

    def load(self, directory: str) -> dict[str, Any]:
        """Weights, optimizer state and random streams from a checkpoint,
        resharded for this layout (every rank calls it); --finetune,
        --no-load-optim and --no-load-rng leave some out (load_checkpoint)."""
        return load_checkpoint(self, directory)

    def microbatch_fn(self, iteration: int):
        tr, ctx = self.config.train, self.ctx
        global_batch = self.batch_of(iteration)
        settings = MicrobatchSettings.from_config(self.config, self.data.eod)

        def microbatch(i: int) -> tuple[torch.Tensor, ...]:
            samples = self.train_batches.read(microbatch_indices(
                self.consumed_before(iteration), i, ctx.dp_rank, micro_batch_size=tr.micro_batch_size,
                global_batch_size=global_batch, data_parallel_size=ctx.dp_size))
            return to_microbatch(samples, settings, self.device)
        return microbatch

    def _mtp_record(self) -> dict[str, float]:
        """--mtp-num-layers: each depth's loss of the iteration as Megatron-LM
        logs it ("mtp_k loss"): the microbatches' mean, averaged over the
        data-parallel replicas (under context parallelism each rank's part
        summed, as the main loss's). Empty off the loss's stage."""
        losses = mtp_logged(self.chunks)
        if not self.holds_loss:
            return {}
        return {name: average_loss(list(depth), None, self.ctx.grad_reduce_group, self.ctx.cp_size)
                for name, depth in zip(self.mtp_names, zip(*(x.unbind() for x in losses)))}

    def step(self, iteration: int, record_timeline: bool = False) -> tuple[dict[str, Any], Any]:
        """Iteration `iteration` (0-based): forward and backward of every
        microbatch through the pipeline, gradient reduction, optimizer step."""
        ctx, tr = self.ctx, self.config.train
        start = time.perf_counter()
        self.model.train()
        global_batch = self.batch_of(iteration)
        num_micro = global_batch // self.batches.per_microbatch
        schedule = self.schedule_for(num_micro)
        self.buffer.start_iteration(num_micro)
        set_aux_loss_scale(self.moe_layers, self.optimizer.scaler.scale / num_micro)
        start_moe_iteration(self.moe_layers)
        on_batch_tokens = None
        if tr.calculate_per_token_loss and self.moe_layers:
            # The balancing losses count like the main loss's tokens: each
            # microbatch's weighs its b·s routed tokens over the global
            # batch's loss tokens (Megatron-LM's reading under this flag).
            routed = tr.micro_batch_size * self.config.model.seq_length

            def on_batch_tokens(total: torch.Tensor) -> None:
                set_aux_loss_scale(self.moe_layers,
                                   self.optimizer.scaler.scale * routed / total.item())
        # Zero-bubble: the run's second iteration (the first warms up) measures
        # what F, B and W take, and the exchanges are placed for that after it.
        measure = schedule.zero_bubble and iteration == self.start_iteration + 1
        stats = self.executor.run(schedule, self.microbatch_fn(iteration),
                                  record_timeline=record_timeline,
                                  loss_scale=self.optimizer.scaler.scale,
                                  synchronize=(lambda: devices.synchronize(self.device))
                                  if measure else None,
                                  per_token_loss=tr.calculate_per_token_loss,
                                  on_batch_tokens=on_batch_tokens)
        devices.synchronize(self.device)
        if measure:
            self.place_exchanges(stats, num_micro)
        forward_backward_done = time.perf_counter()

        self.buffer.finish()
        # (LoRA: the expert biases are the frozen base's, kept as loaded.)
        if self.config.model.moe_router_enable_expert_bias and not self.config.lora.enabled:
            update_expert_biases(self.moe_layers, self.config.model.moe_router_bias_update_rate, ctx)
        loss = None if not self.holds_loss else average_loss(
            stats.losses, stats.loss_tokens if tr.calculate_per_token_loss else None,
            ctx.grad_reduce_group, ctx.cp_size)
        devices.synchronize(self.device)
        reduce_done = time.perf_counter()

        # Megatron-LM's train_step: the optimizer steps with the rate where the
        # schedule stands before this iteration; then the schedule advances by
        # the iteration's samples unless the step was skipped, and the rate
        # logged is the one it holds then (the next iteration's).
        decoupled = self.decoupled_lr_schedule
        result = self.optimizer.step(self.learning_rate(),
                                     None if decoupled is None else self.learning_rate(decoupled))
        if not result.skipped:
            self.lr_steps += self.lr_schedule.increment(global_batch)
        lr = self.learning_rate()
        self.skipped_iterations += result.skipped
        devices.synchronize(self.device)
        end = time.perf_counter()

        elapsed = end - start
        record = {
            "iteration": iteration + 1,
            "consumed_samples": self.consumed_before(iteration + 1),
            "loss": loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "params_norm": result.params_norm,  # None unless --log-params-norm
            "num_zeros": result.num_zeros,      # None unless --log-num-zeros-in-grad
            "loss_scale": result.loss_scale,
            "skipped": result.skipped,
            "skipped_iterations": self.skipped_iterations,
            "iteration_ms": elapsed * 1e3,
            "forward_backward_ms": (forward_backward_done - start) * 1e3,
            "forward_ms": stats.forward_seconds * 1e3,
            "backward_ms": stats.backward_seconds * 1e3,
            "pipeline_transfer_ms": stats.transfer_seconds * 1e3,
            "grad_reduce_ms": (reduce_done - forward_backward_done) * 1e3,
            "optimizer_ms": (end - reduce_done) * 1e3,
            "tokens_per_s": global_batch * self.config.model.seq_length / elapsed,
            "peak_stored_activations": stats.peak_stored,
            "optimizer_state_bytes": self.optimizer.state_bytes,
        }
        if self.config.data.sft and stats.batch_tokens is not None:
            # Packing efficiency: the share of the batch's positions that train.
            tokens = int(stats.batch_tokens.item())
            record["loss_tokens"] = tokens
            record["loss_token_fraction"] = tokens / (global_batch * self.config.model.seq_length)
        record.update(self._mtp_record())  # (every rank takes its MTP losses)
        if self.config.model.is_moe:
            record.update(balancing_metrics(self.moe_layers, self.config.model, ctx, self.device))
        if tr.rampup_batch_size is not None:
            record["global_batch_size"] = global_batch
        if schedule.zero_bubble:
            # backward_ms includes W; what W took, and the activations held
            # until W (their inputs stay for the weight gradients).
            record["weight_grad_ms"] = stats.weight_grad_seconds * 1e3
            record["peak_awaiting_weight_grads"] = stats.peak_awaiting_weight_grads
        return record, stats


def train(config: Config, ctx: ParallelContext, device: torch.device) -> list[dict[str, Any]]:
    """Train on this rank; returns the per-iteration metrics (the loss only
    on the last pipeline stage, where it is computed)."""
    tr = config.train
    # One collective over every rank before any point-to-point transfer: NCCL
    # wants the world's communicator created by all ranks together.
    dist.barrier()
    metadata = read_metadata(resolve(tr.load)) if tr.load else None
    start = (0, 0)  # a fine-tune is a run of its own from iteration 0
    if metadata is not None and not tr.finetune:
        start = (int(metadata["iteration"]), int(metadata["consumed_samples"]))
    # --manual-gc, --empty-unused-memory-level, --profile; refuses a profile
    # this job cannot record before the model is built.
    housekeeping = Housekeeping(tr, device, rank=ctx.rank, world_size=ctx.grid.world_size,
                                start_iteration=start[0])
    trainer = Trainer(config, ctx, device, start=start)
    if tr.load:
        # Every rank reads its shards; rank 0 says so (a large checkpoint takes a while).
        with phase(f"loading the checkpoint {resolve(tr.load)}") if ctx.rank == 0 \
                else contextlib.nullcontext():
            trainer.load(tr.load)
    is_logger = trainer.holds_loss and ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.cp_rank == 0
    log = RunLog(trainer, is_logger)  # the metrics file, the banner, TensorBoard, the progress bar
    history: list[dict[str, Any]] = []
    stopper = StopConditions(tr, device, uses_loss_scaling=tr.fp16, rank=ctx.rank,
                             is_logger=is_logger)
    # Synchronous or --async-save; the newest checkpoint this run can name
    # (a fine-tune's loaded checkpoint is another run's, not one of its own).
    saves = RunSaves(trainer, stopper, is_logger=is_logger,
                     loaded=resolve(tr.load) if tr.load and not tr.finetune else None)
    evaluator, last = Evaluator(trainer, housekeeping, evaluate), trainer.train_iters
    try:
        if is_logger and tr.load:
            print_load(trainer, metadata)
        housekeeping.start_training()
        for iteration in range(trainer.start_iteration, last):
            done, began = iteration + 1, time.monotonic()
            record_timeline = bool(tr.timeline) and done == last
            record, stats, verdict = _step(trainer, iteration, record_timeline, housekeeping,
                                           stopper, log)
            record.update(saves.at_boundary())  # publishes an asynchronous save written by all
            log.warn(trainer.loss_range.observe(done, verdict.loss))
            try:
                stopper.check_divergence(record, verdict,
                                         lambda: _go_back_to(trainer, saves.settle()))
            except DivergenceError:
                log.report(record, force=True)
                raise
            exit_reason = stopper.stops_after(done, last, verdict)
            if evaluator.due(done, verdict):
                evaluator.run(record)
            history.append(record)
            log.iteration(done, record, force=done % tr.log_interval == 0 or exit_reason is not None)
            if record_timeline:
                log.timeline(iteration, stats)
            stopper.longest_iteration = max(stopper.longest_iteration, time.monotonic() - began)
            if saves.due(done, stopping=exit_reason is not None):
                # The run's last save is waited for, so the last line names it published.
                saves.save(done, last=done == last or exit_reason is not None)
            if exit_reason is not None:
                log.stopped(done, exit_reason, saves.newest)
                break
    finally:
        housekeeping.finish(history[-1]["iteration"] if history else None)
        stopper.close()
        trainer.train_batches.close()  # --num-workers' processes end with the run
        log.close()
    trainer.buffer.finish_param_gather()  # (--overlap-param-gather: the last step's)
    log.finish(history)
    return history


def _step(trainer: Trainer, iteration: int, record_timeline: bool, housekeeping, stopper,
          log: RunLog):
    """Iteration `iteration`'s step between its housekeeping, its record with
    the throughput and the job's peak memory, and the ranks' agreed verdict
    (stopping.Verdict)."""
    ctx, device = trainer.ctx, trainer.device
    if record_timeline:
        dist.barrier()  # align the ranks' clocks for the picture
    housekeeping.before_iteration(iteration)
    record, stats = trainer.step(iteration, record_timeline)
    housekeeping.after_iteration(iteration + 1)
    if log.is_logger and trainer.measured_costs is not None \
            and iteration == trainer.start_iteration + 1:
        report_placement(trainer)
    log.add_throughput(record, iteration)
    # The same on every rank; it carries the job's peak memory too (peak_memory.py).
    verdict = stopper.agree(record, memory_codes(device, ctx.rank, ctx.grid.world_size))
    record.update(memory_fields(verdict.memory, ctx.grid.world_size, device))
    return record, stats, verdict


def _go_back_to(trainer: Trainer, newest: str | None) -> str:
    """Which checkpoint a diverged run goes back to: the newest known good
    (loss_range.py). Said only when the run stops; rank 0 then points
    `latest` at it, so `--load SAVE` resumes from good weights."""
    tr, good = trainer.config.train, trainer.loss_range.good
    moved = bool(tr.save and good is not None and newest is not None and good != Path(newest)
                 and good.parent.resolve() == Path(tr.save).resolve() and good.is_dir())
    if moved and trainer.ctx.rank == 0:
        point_latest(Path(tr.save), good.name)
    return trainer.loss_range.after_divergence(None if newest is None else Path(newest), moved)
