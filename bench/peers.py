"""ptdp against PyTorch's own parallelism, side by side in the same processes.

Each row starts one local gloo job (world = the layout's process count).
Every process builds both sides from the same logical weights:

- ours: ptdp's Trainer (the code `ptdp train` runs: pipeline executor,
  tensor-parallel layers, gradient buffer, optimizer);
- theirs: the same GPT written with plain PyTorch modules
  (bench/torch_reference.py), parallelised with PyTorch's own tools:
  `torch.distributed.pipelining` (ScheduleGPipe, Schedule1F1B,
  ScheduleInterleaved1F1B), DTensor `ColwiseParallel`/`RowwiseParallel` with
  `loss_parallel`, FSDP2 `fully_shard` on a DeviceMesh, torch.optim.AdamW.

Each row names what ptdp shards over the data-parallel ranks (`strategy`,
Megatron-LM's names: no_shard, optim, optim_grads, optim_grads_params).
PyTorch's side shards with FSDP2 whenever d > 1: `reshard_after_forward`
False (parameters kept gathered from a unit's forward to its backward, what
FSDP2 has closest to ZeRO-2) except under optim_grads_params, where it is
True (ZeRO-3). The "sharded" section compares the two at d = 2 and d = 4,
with the memory each side holds and its peak during a step
(bench/tensor_memory.py says how these are measured inside one process).
A row ptdp's configuration check refuses is skipped with its reason.

Both train on the same batches with the same optimizer settings (AdamW,
weight decay on matrices only, constant learning rate, no clipping, dropout
off). Iterations alternate between the two sides (ABBA order, a barrier
around each), so machine noise hits both alike; the median iteration time
of each side gives tokens/s and the ratio ours/theirs. Before any time
counts, the losses of every iteration must agree (relative 1e-4; the row
reports the largest difference) — a row whose losses differ fails.

Utilisation is the model FLOP/s (the paper's formula) of the whole job over
this machine's matmul peak, measured at the start of the run (fp32 GEMMs on
all cores). Scaling compares ours in each layout with the one-process model
on the same global batch, measured in the same run.

    python bench/peers.py                      # every section
    python bench/peers.py pipeline --iters 6   # one section
    python bench/peers.py sharded              # ptdp's ZeRO-2/3 against FSDP2
    python bench/peers.py --write              # append the tables to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from local_job import free_port  # noqa: E402
from results import cpu_name, publish  # noqa: E402
from peer_tables import SHARDED_NOTE, fmt_rate, peer_table, scaling_table, sharded_table  # noqa: E402
from torch_reference import TorchGPT, cross_entropy, load_logical  # noqa: E402
from tensor_memory import measure_sides  # noqa: E402

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from ptdp.config.base import ConfigError  # noqa: E402
from ptdp.config.checks import validate  # noqa: E402
from ptdp.schedules.split import LayerSplit, stage_layer_counts  # noqa: E402
from ptdp.perf.analytic.flops import configured_flops_per_iteration  # noqa: E402

HEADING = "## Peer benchmarks: ptdp against PyTorch's own parallelism"
LOSS_RTOL = 1e-4
# hidden >= 256 so that compute, not message latency, decides; V a multiple
# of 128·t so that neither side pads the vocabulary.
MODEL = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128,
                    vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0)

# For checking the harness in seconds (tests): its figures are not results.
TINY_MODEL = replace(MODEL, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)

# What ptdp shards over the data-parallel ranks (--data-parallel-sharding-strategy).
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
FSDP_STRATEGIES = ("optim_grads", "optim_grads_params")  # need --use-megatron-fsdp


@dataclass(frozen=True)
class Row:
    section: str
    t: int = 1
    p: int = 1
    d: int = 1
    v: int = 1
    schedule: str = "1f1b"          # gpipe | 1f1b (v > 1: interleaved) | zb-h1 | zbv (v = 2)
    micro_batch: int = 2
    global_batch: int = 16
    distributed_optimizer: bool = False  # the same as strategy="optim"
    peer: bool = True               # also run PyTorch's side
    split: LayerSplit = LayerSplit()  # layers per stage (both sides split alike)
    strategy: str = "no_shard"      # one of STRATEGIES
    memory: bool = False            # also measure each side's tensor memory (one more step)
    # ptdp's --ddp-bucket-size: one transformer layer's parameters, the
    # granularity of PyTorch's FSDP2 units here (False: ptdp's default)
    layer_buckets: bool = False

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Row strategy {self.strategy!r}: choose from {', '.join(STRATEGIES)}")
        if self.distributed_optimizer:
            if self.strategy not in ("no_shard", "optim"):
                raise ValueError(f"Row: distributed_optimizer is strategy='optim', not "
                                 f"{self.strategy!r}: give one of them")
            object.__setattr__(self, "strategy", "optim")

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's setting on PyTorch's side: True only for ZeRO-3."""
        return self.strategy == "optim_grads_params"

    @property
    def world(self) -> int:
        return self.t * self.p * self.d

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.d)

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("t", "p", "d") if getattr(self, k) > 1]
        if self.p > 1:
            parts.append(f"interleaved v={self.v}" if self.v > 1 and self.schedule == "1f1b"
                         else self.schedule)
        if self.strategy == "optim":
            parts.append("dist-opt")
        elif self.strategy != "no_shard":
            parts.append(self.strategy)
        if self.layer_buckets:
            parts.append("layer buckets")
        if not self.split.even:
            parts.append("layers " + ",".join(map(str, stage_layer_counts(
                MODEL.num_layers, self.p, self.v, "zbv" if self.schedule == "zbv" else
                "interleaved" if self.v > 1 else self.schedule, self.split))))
        return " ".join(parts) or "one process"

    def peer_name(self) -> str:
        names = []
        if self.p > 1:
            names.append(torch_schedule_name(self))
        if self.t > 1:
            names.append("DTensor Colwise/Rowwise")
        if self.d > 1:
            names.append(f"FSDP2 reshard_after_forward={self.reshard_after_forward}"
                         if self.section == "sharded" else "FSDP2")
        return " + ".join(names) or "plain module"


SECTIONS = {
    "pipeline": [Row("pipeline", p=p, schedule=schedule, v=v)
                 for p in (2, 4) for schedule, v in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2))],
    "tensor": [Row("tensor", t=t) for t in (2, 4)],
    "3d": [Row("3d", t=2, p=2, d=2), Row("3d", t=2, p=2, d=2, strategy="optim")],
    # ZeRO-2 against FSDP2 with parameters kept gathered, ptdp's buckets at
    # its default (here the whole model in one) and at one layer each,
    # FSDP2's unit; ZeRO-3 (whose buckets are its units, a layer each)
    # against FSDP2 resharding after forward. A row ptdp refuses is skipped.
    "sharded": [Row("sharded", d=d, strategy="optim_grads", memory=True, layer_buckets=layer)
                for d in (2, 4) for layer in (False, True)]
    + [Row("sharded", d=d, strategy="optim_grads_params", memory=True) for d in (2, 4)],
}
ALL_SECTIONS = ("pipeline", "tensor", "3d", "sharded", "scaling")
SCALING = [Row("scaling", **layout, peer=False) for layout in (
    dict(t=2), dict(p=2), dict(d=2), dict(t=2, p=2), dict(t=2, d=2), dict(p=2, d=2),
    dict(t=2, p=2, d=2))]


def balanced_rows(rows: list[Row], model: ModelConfig, profile) -> list[Row]:
    """For each pipeline row with one chunk per rank, the same row with the
    layer split the planner predicts fastest on `profile` (this machine's
    calibration), where that is not the even split: `ptdp plan`'s split
    candidates, each priced with cost.simulate."""
    from ptdp.perf.simulate.predict import simulate
    from ptdp.perf.layout import Layout, Workload
    from ptdp.perf.plan.planner import split_candidates

    workload = Workload(model, rows[0].global_batch if rows else 16, "fp32")
    balanced = []
    for row in rows:
        if row.p < 2 or row.v > 1:
            continue
        layout = Layout(p=row.p, b=row.micro_batch, schedule=row.schedule)
        splits = [split for split in split_candidates(layout, model.num_layers)
                  if not replace(layout, split=split).valid_for(model, workload.global_batch)]
        best = min([LayerSplit()] + splits, key=lambda split: simulate(
            workload, replace(layout, split=split), profile).iteration_seconds)
        if not best.even:
            balanced.append(replace(row, split=best))
    return balanced


def torch_schedule_name(row: Row) -> str:
    """The torch.distributed.pipelining schedule that runs `row`'s pipeline:
    zb-h1's peer is ScheduleInterleavedZeroBubble on one stage per rank (its
    ZB1P order, which is ZB-H1 there), zbv's is ScheduleZBVZeroBubble on the
    same V placement."""
    if row.schedule == "1f1b" and row.v > 1:
        return "ScheduleInterleaved1F1B"
    return {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
            "zbv": "ScheduleZBVZeroBubble"}[row.schedule]


def config_for(row: Row, model: ModelConfig) -> Config:
    sharding = (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=row.strategy,
                     fsdp_reshard_after_forward=row.reshard_after_forward)
                if row.strategy in FSDP_STRATEGIES
                else dict(use_distributed_optimizer=row.strategy == "optim"))
    return Config(
        model=model,
        parallel=ParallelConfig(
            tensor_model_parallel_size=row.t, pipeline_model_parallel_size=row.p,
            pipeline_schedule=row.schedule, device="cpu",
            num_layers_per_virtual_pipeline_stage=(model.num_layers // (row.p * row.v)
                                                   if row.v > 1 and row.schedule != "zbv"
                                                   else None),
            decoder_first_pipeline_num_layers=row.split.first,
            decoder_last_pipeline_num_layers=row.split.last,
            account_for_embedding_in_pipeline_split=row.split.embedding,
            account_for_loss_in_pipeline_split=row.split.loss),
        train=TrainConfig(micro_batch_size=row.micro_batch, global_batch_size=row.global_batch,
                          lr=1e-4, lr_decay_style="constant", weight_decay=0.01, clip_grad=0.0,
                          seed=1234, **sharding,
                          **({"ddp_bucket_size": layer_parameters(model)} if row.layer_buckets else {})),
        data=DataConfig(mock_data=True))


def layer_parameters(model: ModelConfig) -> int:
    """The parameters of one transformer layer (PyTorch's side's Block)."""
    from torch_reference import Block
    return sum(param.numel() for param in Block(model).parameters())


def refusal(row: Row, model: ModelConfig) -> str | None:
    """Why ptdp's configuration check refuses `row` (its ConfigError), or
    None: a row is skipped, not failed, for a strategy not built yet."""
    try:
        validate(config_for(row, model), world_size=row.world)
    except ConfigError as error:
        return str(error)
    return None


# ------------------------------------------------------------------------------------------
# PyTorch's side


class TorchSide:
    """One rank's share of the reference GPT under PyTorch's parallelism."""

    def __init__(self, row: Row, model: ModelConfig, logical: dict, ctx, microbatch_fn):
        from torch.distributed.device_mesh import init_device_mesh
        from ptdp.schedules.kinds import virtual_stage_of
        from ptdp.schedules.build import layers_of

        self.row, self.ctx, self.microbatch_fn = row, ctx, microbatch_fn
        mesh = init_device_mesh("cpu", (row.p, row.d, row.t), mesh_dim_names=("pp", "dp", "tp"))
        self.tp_mesh, self.dp_mesh, self.pp_mesh = mesh["tp"], mesh["dp"], mesh["pp"]
        stages = row.p * row.v
        placement = "zbv" if row.schedule == "zbv" else "interleaved"  # V, or looped
        self.modules = []
        for chunk in range(row.v):
            stage = virtual_stage_of(placement, row.p, row.v, ctx.pp_rank, chunk)
            module = load_logical(TorchGPT(model, layers_of(ctx.pp_rank, chunk, row.p, row.v,
                                                            model.num_layers, kind=placement,
                                                            split=row.split),
                                           pre_process=stage == 0, post_process=stage == stages - 1),
                                  logical)
            if row.t > 1:
                parallelize_tensor(module, self.tp_mesh)
            if row.d > 1:
                from torch.distributed.fsdp import fully_shard
                # Keep parameters gathered between a microbatch's forward and
                # backward (as torchtitan does with pipelining; FSDP2's ZeRO-2),
                # unless the row is ZeRO-3.
                reshard = row.reshard_after_forward
                for layer in module.layers.values():
                    fully_shard(layer, mesh=self.dp_mesh, reshard_after_forward=reshard)
                fully_shard(module, mesh=self.dp_mesh, reshard_after_forward=reshard)
            self.modules.append((stage, module))
        self.has_first = any(stage == 0 for stage, _ in self.modules)
        self.has_last = any(stage == stages - 1 for stage, _ in self.modules)
        params = [p for _, m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=1e-4, betas=(0.9, 0.999), eps=1e-8)
        self.schedule = None
        if row.p > 1:
            import torch.distributed.pipelining as pipelining
            group = self.pp_mesh.get_group()
            pipeline_stages = [pipelining.PipelineStage(m, stage, stages, torch.device("cpu"),
                                                        group=group)
                               for stage, m in self.modules]
            kind = getattr(pipelining, torch_schedule_name(row))
            multi = issubclass(kind, pipelining.schedules.PipelineScheduleMulti)
            self.schedule = kind(pipeline_stages if multi else pipeline_stages[0], row.microbatches,
                                 loss_fn=cross_entropy)

    def step(self, iteration: int) -> float | None:
        """One training iteration; the mean loss on a rank with the last stage."""
        row = self.row
        self.optimizer.zero_grad(set_to_none=True)
        batches = ([self.microbatch_fn(iteration)(i) for i in range(row.microbatches)]
                   if self.has_first or self.has_last else [])
        losses: list[torch.Tensor] = []
        parallel_loss = _loss_parallel() if row.t > 1 else contextlib.nullcontext()
        with parallel_loss:
            if self.schedule is None:
                _, module = self.modules[0]
                for tokens, labels in batches:
                    loss = cross_entropy(module(tokens), labels)
                    (loss / row.microbatches).backward()
                    losses.append(loss.detach())
            else:
                args = (torch.cat([b[0] for b in batches]),) if self.has_first else ()
                target = torch.cat([b[1] for b in batches]) if self.has_last else None
                self.schedule.step(*args, target=target, losses=losses if self.has_last else None)
        self._sum_tied_gradients()
        self.optimizer.step()
        if not self.has_last:
            return None
        return sum(_full(loss).item() for loss in losses) / len(losses)

    def _sum_tied_gradients(self) -> None:
        """The word embedding of the first stage and its copy on the last
        stage learn from both uses: sum their gradients (what a PyTorch user
        of a pipelined tied model has to add by hand)."""
        if self.row.p == 1:
            return
        tied = [w for _, m in self.modules for w in m.tied_weights()]
        if len(tied) == 2:  # both copies on this rank (the V placement's rank 0)
            total = _local(tied[0].grad) + _local(tied[1].grad)
            for w in tied:
                _local(w.grad).copy_(total)
        elif tied:
            dist.all_reduce(_local(tied[0].grad), group=self.ctx.embedding_group)


def parallelize_tensor(module: TorchGPT, tp_mesh) -> None:
    """Megatron's split with DTensor: query/key/value and the first MLP
    matrix by columns, the projections after them by rows, the embedding by
    vocabulary rows, the tied output layer by the same rows (logits split by
    vocabulary, for loss_parallel)."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    plan = {}
    if module.pre_process:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    for i in module.layers:
        for name in ("attn.query", "attn.key", "attn.value", "fc"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "out"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(module, tp_mesh, plan)
    if module.post_process:
        weight = (module.tok_embeddings.weight if module.pre_process else
                  nn.Parameter(distribute_tensor(module.output.weight.data, tp_mesh, [Shard(0)])))
        module.output.weight = weight
        module.output.register_forward_pre_hook(_replicated_input)


def _replicated_input(output_module, inputs):
    from torch.distributed.tensor import DTensor, Replicate

    (x,) = inputs
    return (DTensor.from_local(x, output_module.weight.device_mesh, [Replicate()]),)


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# ------------------------------------------------------------------------------------------
# One row: a local gloo job


def _logical_weights(model: ModelConfig, seed: int) -> dict:
    from ptdp.model.gpt import build_chunks
    from ptdp.parallel.topology import ParallelContext

    [full] = build_chunks(model, ParallelContext.single(), torch.device("cpu"), seed)
    return {name: tensor.detach() for name, tensor in full.state_dict().items()}


def _worker(rank: int, world: int, port: int, row: Row, model: ModelConfig, iters: int,
            warmup: int, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        gathered = run_sides(row, model, iters, warmup)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def run_sides(row: Row, model: ModelConfig, iters: int, warmup: int) -> list[dict]:
    """This rank's part of a row, in a process group of row.world ranks
    already started: every rank's times, losses and memory."""
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    ctx = ParallelContext.build(RankGrid(tp=row.t, dp=row.d, pp=row.p))
    config = config_for(row, model)
    ours = Trainer(config, ctx, torch.device("cpu"))
    theirs = None
    if row.peer:
        theirs = TorchSide(row, model, _logical_weights(model, config.train.seed), ctx,
                           ours.microbatch_fn)
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    cpu: dict[str, list[float]] = {"ours": [], "theirs": []}  # this process's CPU seconds
    losses: dict[str, list[float | None]] = {"ours": [], "theirs": []}

    def timed(side: str, iteration: int) -> None:
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        if side == "ours":
            loss = ours.step(iteration)[0]["loss"]
        else:
            loss = theirs.step(iteration)
        cpu_end = time.process_time()
        dist.barrier()
        elapsed = time.perf_counter() - start
        if iteration >= warmup:
            times[side].append(elapsed)
            cpu[side].append(cpu_end - cpu_start)
        losses[side].append(loss)

    sides = ["ours", "theirs"] if theirs is not None else ["ours"]
    for iteration in range(warmup + iters):
        for side in (sides if iteration % 2 == 0 else sides[::-1]):  # ABBA
            timed(side, iteration)
    memory = measure_sides(ours, theirs, warmup + iters, losses) if row.memory else None
    if theirs is not None and row.d > 1:
        # theirs reports its dp shard's loss: average over data-parallel ranks
        for i, value in enumerate(losses["theirs"]):
            if value is not None:
                mean = torch.tensor([value], dtype=torch.float64)
                dist.all_reduce(mean, group=ctx.dp_group)
                losses["theirs"][i] = mean.item() / row.d
    gathered = [None] * row.world
    dist.all_gather_object(gathered, {"times": times, "cpu": cpu, "losses": losses,
                                      "last": ctx.is_last_stage, "memory": memory})
    return gathered


def run_row(row: Row, model: ModelConfig, iters: int, warmup: int) -> dict:
    cores = os.cpu_count() or 1
    threads = max(1, cores // row.world)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(row.world, free_port(), row, model, iters, warmup,
                                          threads, out),
                           nprocs=row.world, join=True, start_method="spawn")
        ranks = json.loads(Path(out).read_text())
    return summarise(row, model, ranks, (load_before, os.getloadavg()))


def summarise(row: Row, model: ModelConfig, ranks: list[dict], load: tuple) -> dict:
    """A row's figures from every rank's run_sides; `load`: the load
    averages before and after it."""
    times = ranks[0]["times"]
    [last] = [r for r in ranks if r["last"]][:1]
    result = {"row": asdict(row), "layout": row.describe(), "peer": row.peer_name() if row.peer else None,
              "ours_s": statistics.median(times["ours"]), "load": load}
    if row.memory:
        # The most any rank holds, per side and figure.
        result["memory"] = {side: {key: max(r["memory"][side][key] for r in ranks)
                                   for key in ranks[0]["memory"][side]}
                            for side in ranks[0]["memory"]}
    tokens = row.global_batch * model.seq_length
    flops = configured_flops_per_iteration(model, row.global_batch, row.p * row.v)
    result["ours_tokens_per_s"] = tokens / result["ours_s"]
    result["ours_gflops"] = flops / result["ours_s"] / 1e9
    result["ours_losses"] = last["losses"]["ours"]
    if row.peer:
        result["theirs_s"] = statistics.median(times["theirs"])
        result["theirs_tokens_per_s"] = tokens / result["theirs_s"]
        result["theirs_gflops"] = flops / result["theirs_s"] / 1e9
        result["ratio"] = result["theirs_s"] / result["ours_s"]
        if all("cpu" in r for r in ranks):
            # every rank's CPU seconds together per iteration (median): the
            # work done, which other jobs on the machine barely change
            ours_cpu, theirs_cpu = (statistics.median(map(sum, zip(*(r["cpu"][side] for r in ranks))))
                                    for side in ("ours", "theirs"))
            result["cpu_ratio"] = theirs_cpu / ours_cpu
        result["theirs_losses"] = last["losses"]["theirs"]
        result["loss_max_rel_diff"] = loss_difference(result["ours_losses"], result["theirs_losses"])
        result["same_loss"] = result["loss_max_rel_diff"] <= LOSS_RTOL
    return result


def loss_difference(ours: list[float], theirs: list[float]) -> float:
    """Largest relative difference between the two sides' losses, iteration
    by iteration; inf when a loss is missing or not finite."""
    if not ours or len(ours) != len(theirs):
        return float("inf")
    worst = 0.0
    for a, b in zip(ours, theirs):
        if a is None or b is None or not (abs(a) < float("inf") and abs(b) < float("inf")):
            return float("inf")
        worst = max(worst, abs(a - b) / abs(b))
    return worst


# ------------------------------------------------------------------------------------------
# This machine's matmul peak


def matmul_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    """fp32 GEMM rate on every core: the best of a few n³ products."""
    torch.set_num_threads(os.cpu_count() or 1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e9


# ------------------------------------------------------------------------------------------
# Report


def run_peer_sections(rows: dict[str, list[Row]], sections: list[str], model: ModelConfig, iters: int,
                      warmup: int) -> tuple[list[dict], list[dict], list[tuple[Row, str]]]:
    """Every row of the chosen peer sections: the results of the pipeline,
    tensor and 3d rows, those of the sharded rows, and the rows skipped
    because ptdp refuses them (with its reason)."""
    peer_results: list[dict] = []
    sharded_results: list[dict] = []
    skipped: list[tuple[Row, str]] = []
    for section in ("pipeline", "tensor", "3d", "sharded"):
        if section not in sections:
            continue
        for row in rows[section]:
            reason = refusal(row, model)
            if reason is not None:
                skipped.append((row, reason))
                print(f"{section}: {row.describe()}: skipped, ptdp refuses it: {reason}",
                      file=sys.stderr)
                continue
            result = run_row(row, model, iters, warmup)
            (sharded_results if section == "sharded" else peer_results).append(result)
            print(f"{section}: {result['layout']}: ours {result['ours_s']:.3f} s, PyTorch "
                  f"{result['theirs_s']:.3f} s, ratio {result['ratio']:.2f}, losses agree "
                  f"{result['same_loss']}, load {result['load'][1][0]:.1f}"
                  + (f", memory {json.dumps(result['memory'])}" if row.memory else ""),
                  file=sys.stderr)
    return peer_results, sharded_results, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION",
                        help="pipeline, tensor, 3d, sharded, scaling (default: all)")
    parser.add_argument("--iters", type=int, default=6, help="timed iterations per side and row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--tiny", action="store_true",
                        help="a small model (seconds per row) for checking the harness")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--profile", metavar="PATH",
                        help="this machine's hardware profile for choosing the pipeline rows' "
                             "balanced layer splits (default: ptdp calibrate, in this run)")
    parser.add_argument("--no-balanced", action="store_true",
                        help="only the even layer splits in the pipeline section")
    parser.add_argument("--write", action="store_true", help="append the tables to bench/RESULTS.md")
    args = parser.parse_args(argv)
    unknown = [name for name in args.sections if name not in ALL_SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(ALL_SECTIONS)}")

    model = TINY_MODEL if args.tiny else MODEL
    explicit = bool(args.sections)
    args.sections = args.sections or list(ALL_SECTIONS)
    started = time.time()
    peak = matmul_peak_gflops()
    print(f"matmul peak of this machine: {peak:.1f} GFLOP/s (fp32, {os.cpu_count()} cores)",
          file=sys.stderr)
    scaling_results, baseline = [], []
    rows = {section: list(SECTIONS[section]) for section in SECTIONS}
    if "pipeline" in args.sections and not args.no_balanced:
        if args.profile:
            from ptdp.perf.price.profiles import load_profile
            profile = load_profile(args.profile)
        else:
            from ptdp.perf.calibrate.profile import calibrate
            profile = calibrate(quick=args.tiny, log=lambda line: print(f"calibrate: {line}",
                                                                        file=sys.stderr))
        # Each balanced row after its even one.
        even = rows["pipeline"]
        extra = {replace(row, split=LayerSplit()): row for row in balanced_rows(even, model, profile)}
        rows["pipeline"] = [r for row in even for r in ([row, extra[row]] if row in extra else [row])]
    peer_results, sharded_results, skipped = run_peer_sections(rows, args.sections, model, args.iters,
                                                               args.warmup)
    if "scaling" in args.sections:
        one = Row("scaling", peer=False)
        baseline.append(run_row(one, model, args.iters, args.warmup))
        for row in SCALING:
            scaling_results.append(run_row(row, model, args.iters, args.warmup))
            print(f"scaling: {scaling_results[-1]['layout']}: {scaling_results[-1]['ours_s']:.3f} s",
                  file=sys.stderr)
        baseline.append(run_row(one, model, args.iters, args.warmup))  # again: drift check

    date = datetime.date.today().isoformat()
    command = "python bench/peers.py" + (" " + " ".join(args.sections) if explicit else "")
    if args.tiny:
        command += " --tiny"
    if args.profile:
        command += " --profile PROFILE.json"
    if args.no_balanced:
        command += " --no-balanced"
    header = (f"### {date}: GPT l={model.num_layers}, h={model.hidden_size}, a={model.num_attention_heads}, "
              f"s={model.seq_length}, V={model.vocab_size}, fp32, global batch 16, micro batch 2\n\n"
              f"Command: `{command} --iters {args.iters} --warmup {args.warmup}`  \n"
              f"torch {torch.__version__}, gloo, {cpu_name()}, {os.cpu_count()} cores shared by "
              f"the processes; matmul peak {peak:.1f} GFLOP/s (fp32). Median of {args.iters} "
              f"iterations per side, alternating; ratio = PyTorch's time / ours (> 1: ours faster); "
              f"CPU time: the same ratio of every rank's CPU seconds together, the work done, "
              f"which other jobs on the machine barely change; "
              f"utilisation = model FLOP/s of the job / the machine's matmul peak.\n")
    blocks = [header]
    failed = [r for r in peer_results + sharded_results if not r["same_loss"]]
    if peer_results:
        blocks.append(peer_table(peer_results, peak))
    if sharded_results or skipped:
        blocks.append(SHARDED_NOTE + "\n\n" + sharded_table(sharded_results, [(row.describe(), row.peer_name(), why) for row, why in skipped]))
    if scaling_results:
        baseline_s = statistics.mean(b["ours_s"] for b in baseline)
        blocks.append(f"Scaling: one process {fmt_rate(16 * model.seq_length / baseline_s)} tokens/s "
                      f"(median {baseline[0]['ours_s']:.3f} s before the layouts, "
                      f"{baseline[1]['ours_s']:.3f} s after), utilisation "
                      f"{statistics.mean(b['ours_gflops'] for b in baseline) / peak:.1%}.\n\n"
                      + scaling_table(scaling_results, baseline_s, peak))
    blocks.append(f"Run time {time.time() - started:.0f} s.")
    peak_after = matmul_peak_gflops()
    if peak_after > 1.2 * peak:
        # The peak is a best-of-a-few at one moment; a busy moment understates it.
        blocks.append(f"Note: the matmul peak measured again at the end was {peak_after:.1f} GFLOP/s; "
                      f"the utilisation columns above, taken against {peak:.1f}, are overstated "
                      f"by up to {peak_after / peak:.2f}x.")
    publish(HEADING, "\n\n".join(blocks) + "\n", write=args.write)
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_gflops": peak, "peers": peer_results,
                                               "sharded": sharded_results,
                                               "skipped": [(asdict(row), why) for row, why in skipped],
                                               "scaling": scaling_results, "baseline": baseline},
                                              indent=1))
    if failed:
        print(f"losses differ in {len(failed)} row(s): {[r['layout'] for r in failed]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
