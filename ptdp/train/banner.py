"""What `ptdp train` says at its start: the job's layout and model (the
banner), the attention kernel and context parallelism's blocks where they
apply, what --load took, and a zero-bubble schedule's placed exchanges."""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from ptdp.checkpoint.store import resolve
from ptdp.config import Config
from ptdp.config.megatron import reports_attention_kernel
from ptdp.parallel.block_attention import attention_kernel
from ptdp.parallel.context_attention import KERNEL_OPS, block_kernel
from ptdp.parallel.document_attention import document_kernel
from ptdp.schedules.split import stage_layer_counts
from ptdp.parallel.sharding import COPY_ATTR, logical_shape
from ptdp.perf.analytic.counts import active_parameter_count, parameter_count
from ptdp.plural import plural
from ptdp.train.resume import load_summary


def count_parameters(model: torch.nn.Module) -> int:
    """Logical (unsharded, unpadded) parameters of this pipeline stage."""
    return sum(math.prod(logical_shape(p)) for p in model.parameters()
               if not getattr(p, COPY_ATTR, False))


def print_banner(trainer, is_logger: bool) -> None:
    """The start-up lines (the logger prints them). Every rank calls it: the
    parameters are counted over the pipeline ranks."""
    config, ctx, device = trainer.config, trainer.ctx, trainer.device
    model_cfg, tr = config.model, config.train
    parameters = count_parameters(trainer.model)
    if ctx.pp_group is not None:
        total = torch.tensor([float(parameters)], device=device)
        dist.all_reduce(total, group=ctx.pp_group)
        parameters = int(total.item())
    described = f"{parameters:,} parameters"
    experts = ""
    if model_cfg.is_moe:  # a stage holds only its expert-parallel rank's experts: count them all
        described = (f"{parameter_count(model_cfg):,} parameters "
                     f"({active_parameter_count(model_cfg):,} active per token)")
        if (ctx.ep_size, ctx.etp_size) != (1, ctx.tp_size):
            experts = f", experts over EP={ctx.ep_size} × ETP={ctx.etp_size}"
    if is_logger:
        schedule = trainer.schedule
        context = f", c={ctx.cp_size} {trainer.config.parallel.cp_comm_type}" \
            if ctx.cp_size > 1 else ""
        print(f"ptdp: {plural(ctx.grid.world_size, 'process')} (t={ctx.tp_size}, p={ctx.pp_size}, "
              f"d={ctx.dp_size}{context}){experts} on {device.type}; {described}; vocabulary "
              f"{model_cfg.vocab_size} padded to {model_cfg.padded_vocab_size(ctx.tp_size)} (padding "
              f"is masked out of the loss); {plural(trainer.num_micro, 'microbatch')} of "
              f"{tr.micro_batch_size} per pipeline per iteration; {schedule.kind} schedule"
              + (f" with {schedule.v} chunks per rank" if schedule.v > 1 else "")
              + _split_note(config, ctx.pp_size, schedule) + _length_note(trainer)
              + f"; data: {trainer.data.description}", flush=True)
        if config.lora.enabled:
            print(lora_line(config), flush=True)
        if tr.sharding_strategy in SHARDED_WORDS and ctx.dp_size * ctx.cp_size > 1:
            print(sharding_line(config, ctx.dp_size * ctx.cp_size), flush=True)
        if reports_attention_kernel(config):  # --use-flash-attn / --attention-backend given
            print(f"ptdp: attention: {attention_kernel(config, device, trainer.dtype)}", flush=True)
        if config.data.sft or config.data.reset_attention_mask:
            kernel = "masked blocks across the context ranks" if ctx.cp_size > 1 else \
                document_kernel(device, model_cfg.attention_dropout)
            print(f"ptdp: attention: within each document of a packed sequence ({kernel})",
                  flush=True)
        if ctx.cp_size > 1:
            kernel = block_kernel(device, trainer.dtype, model_cfg.head_dim)
            print(f"ptdp: context parallelism: each sequence in {2 * ctx.cp_size} chunks, "
                  f"{model_cfg.seq_length // ctx.cp_size} positions per rank; attention "
                  f"{CP_COMM_WORDS[config.parallel.cp_comm_type]}, each block on {kernel} "
                  f"({KERNEL_OPS[kernel]})", flush=True)


SHARDED_WORDS = {
    "optim_grads": "ZeRO-2: gradients and optimizer state sharded",
    "optim_grads_params": "ZeRO-3: parameters, gradients and optimizer state sharded"}


def sharding_line(config: Config, replicas: int) -> str:
    """What --use-megatron-fsdp shards, over how many ranks, and when a
    ZeRO-3 layer is gathered."""
    tr = config.train
    experts = "; routed experts over their expert-data ranks" if config.model.is_moe else ""
    line = (f"ptdp: {tr.data_parallel_sharding_strategy} ({SHARDED_WORDS[tr.sharding_strategy]} "
            f"over the d·c = {replicas} data-parallel ranks{experts})")
    if tr.sharding_strategy == "optim_grads_params":
        line += ("; each layer gathered before its forward and again before its backward"
                 if tr.reshard_after_forward(config.parallel.pipeline_model_parallel_size) else
                 "; each layer gathered once per iteration and kept to its end "
                 "(--no-fsdp-reshard-after-forward)")
    return line


def lora_line(config: Config) -> str:
    """The adapters and the trainable and frozen parameters, counted over
    the whole model (logical shapes, every rank's share), not this rank's."""
    from ptdp.model.adapters import adapter_shapes, adapted_layers

    lora, model_cfg = config.lora, config.model
    shapes = adapter_shapes(model_cfg, lora)
    trainable = sum(math.prod(shape) for shape in shapes.values())
    frozen = parameter_count(model_cfg)
    layers = len(adapted_layers(model_cfg, lora))
    adapters = len(shapes) // 2
    shared = (f" ({plural(adapters, 'adapter')}: routed experts share one per layer and matrix)"
              if adapters != layers else "")
    return (f"ptdp: LoRA: rank {lora.lora_rank}, alpha {lora.lora_alpha:g}, "
            f"{plural(layers, 'adapted layer')}{shared} on {' '.join(lora.lora_target_modules)}; "
            f"trainable {_millions(trainable)} ({100 * trainable / (trainable + frozen):.2g} %), "
            f"frozen {_millions(frozen)}")


def _millions(count: int) -> str:
    return f"{count:,}" if count < 10**5 else f"{count / 1e6:.3g} M"


def print_load(trainer, metadata: dict) -> None:
    """The logger's lines on what --load took, and a warning when the loaded
    run's loss had left its normal range."""
    tr = trainer.config.train
    line = load_summary(tr, resolve(tr.load), metadata)
    base = (trainer.lora_base or {}).get("checkpoint")
    if trainer.config.lora.enabled and base is not None:
        if str(resolve(tr.load).absolute()) == base:  # --load is the base itself
            line = line.replace("ptdp: fine-tuning from", "ptdp: LoRA adapters on the frozen base",
                                1)
        else:
            line += f"; the adapters' frozen base: {base}"
    print(line, flush=True)
    warning = trainer.loss_range.load_warning(resolve(tr.load))
    if warning:
        print(warning, file=sys.stderr, flush=True)


CP_COMM_WORDS = {"p2p": "by a ring of key/value blocks (p2p)",
                 "all_gather": "over keys and values gathered from the group (all_gather)",
                 "a2a": "over all heads' whole sequences after an all-to-all (a2a)"}


def _length_note(trainer) -> str:
    """The run's length when --train-samples sets it, and a ramp-up's first batch."""
    tr, note = trainer.config.train, ""
    if tr.train_samples is not None:
        iterations = trainer.train_iters
        note += (f"; --train-samples {tr.train_samples:,} gives {iterations} "
                 f"iteration{'' if iterations == 1 else 's'}")
    if tr.rampup_batch_size is not None:
        first = trainer.batches.size_at(0)
        note += (f"; global batch ramped up from {first} ({first // trainer.batches.per_microbatch} "
                 f"microbatch(es)) to {trainer.global_batch} over {tr.rampup_batch_size[2]:,} "
                 f"samples")
    return note


def _split_note(config: Config, p: int, schedule) -> str:
    split = config.parallel.layer_split
    if split.even:
        return ""
    counts = stage_layer_counts(config.model.num_layers, p, schedule.v, schedule.kind, split)
    return f"; layers per virtual stage {', '.join(map(str, counts))}"


def report_placement(trainer) -> None:
    costs = dict(trainer.measured_costs)
    per_op = {op: max(seconds for (_, _, o), seconds in costs.items() if o == op) * 1e3
              for op in "FBW"}
    print(f"ptdp: {trainer.schedule.kind}: exchanges placed for the measured times per microbatch "
          f"and chunk (slowest: F {per_op['F']:.3g} ms, B {per_op['B']:.3g} ms, W {per_op['W']:.3g} "
          f"ms)", flush=True)
