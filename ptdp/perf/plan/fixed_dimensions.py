"""`ptdp plan`'s layout flags (ptdp.commands.plan adds them to its parser;
the functions here read them from the parsed arguments): each is `ptdp
train`'s flag of one dimension and fixes it; the search covers the others
(candidates.py). `--fix-all` prices exactly the given layout, every
dimension not given at `ptdp train`'s default (b at 1).

What each flag fixes:

  -t / --tensor-model-parallel-size       t
  -p / --pipeline-model-parallel-size     p
  --data-parallel-size                    d
  --context-parallel-size                 c  (--cp-comm-type: its comm type)
  --micro-batch-size                      b
  --num-layers-per-virtual-pipeline-stage v  (= l / (p·k))
  --pipeline-schedule                     the schedule
  --decoder-first/last-pipeline-num-layers,
  --account-for-embedding/loss-in-pipeline-split   the layer split
  --recompute-granularity                 recomputation (full or selective)
  --sequence-parallel                     sequence parallelism, on
  --use-distributed-optimizer             the sharding strategy: optim (ZeRO-1)
  --use-megatron-fsdp --data-parallel-sharding-strategy S
                                          the sharding strategy: S (Megatron-LM's
                                          flags; S defaults to optim_grads_params)
  --fsdp-reshard-after-forward / --no-... ZeRO-3's reshard policy
  --expert-model-parallel-size            EP  (MoE models)
  --expert-tensor-parallel-size           ETP (MoE models)

`ptdp train` (like Megatron-LM) has no flag for "no recomputation" or "no
sequence parallelism": those are its defaults, so they are fixed only by
--fix-all (or searched); no sharding is --use-megatron-fsdp
--data-parallel-sharding-strategy no_shard, or --fix-all without a sharding
flag. optim_grads_params (ZeRO-3) is refused, as `ptdp train` refuses it,
until ptdp.perf.layout.PARAMETER_SHARDING_TRAINS says it trains.
`--no-scatter-gather-tensors-in-pipeline`, `--recompute-method uniform` and
`--recompute-num-layers 1` are taken so that a printed `ptdp train` command
can be planned again as it is.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

from ptdp.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from ptdp.config.context import context_parallel_problems
from ptdp.config.train import TrainConfig
from ptdp.schedules.kinds import DEFAULT_SCHEDULE, KINDS, any_chunks_kind
from ptdp.schedules.split import LayerSplit
from ptdp.perf.layout import Layout, trained_strategies

# The dimensions, in the order the plan names them ("ep" and "etp" for MoE models only).
DIMENSIONS = ("t", "c", "p", "d", "ep", "etp", "b", "v", "schedule", "split", "recompute",
              "sequence-parallel", "sharding")


@dataclass
class FixedDimensions:
    """What the layout flags fix: `given` maps each fixed dimension to how
    the plan prints it ("t=8"); `restrictions` are candidate_layouts'."""
    given: dict[str, str] = field(default_factory=dict)
    restrictions: dict[str, Any] = field(default_factory=dict)
    fix_all: bool = False


def _split_of(args: Any) -> LayerSplit:
    return LayerSplit(first=args.decoder_first_pipeline_num_layers,
                      last=args.decoder_last_pipeline_num_layers,
                      embedding=args.account_for_embedding_in_pipeline_split,
                      loss=args.account_for_loss_in_pipeline_split)


def fixed_dimensions(args: Any, model: ModelConfig, devices: int) -> FixedDimensions:
    """The dimensions the flags fix, checked as far as they go alone
    (positive sizes, t·c·p·d against --gpus, c's own rules); ConfigError
    otherwise."""
    a = args
    sizes = {"t": a.tensor_model_parallel_size, "c": a.context_parallel_size,
             "p": a.pipeline_model_parallel_size, "d": a.data_parallel_size}
    flags = {"t": "--tensor-model-parallel-size", "c": "--context-parallel-size",
             "p": "--pipeline-model-parallel-size", "d": "--data-parallel-size",
             "b": "--micro-batch-size", "v": "--num-layers-per-virtual-pipeline-stage",
             "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size"}
    values = {**sizes, "b": a.micro_batch_size, "v": a.num_layers_per_virtual_pipeline_stage,
              "ep": a.expert_model_parallel_size, "etp": a.expert_tensor_parallel_size}
    problems = [f"{flags[name]} {value} must be positive" for name, value in values.items()
                if value is not None and value < 1]
    if problems:
        raise ConfigError(problems)
    product = 1
    for value in sizes.values():
        product *= value or 1
    if devices % product:
        given = [name for name in ("t", "c", "p", "d") if sizes[name] is not None]
        # (as before d could be given: t·p, or t·c·p with context parallelism)
        names = ("t·c·p" if sizes["c"] not in (None, 1) else "t·p") if sizes["d"] is None \
            else "·".join(given)
        raise ConfigError([f"--gpus {devices} is not a multiple of {names} = {product}"])
    fixed = FixedDimensions(fix_all=a.fix_all)
    given, restrictions = fixed.given, fixed.restrictions
    for name, key in (("t", "tensor_sizes"), ("p", "pipeline_sizes"), ("d", "data_sizes"),
                      ("b", "microbatch_sizes"), ("ep", "expert_sizes"),
                      ("etp", "expert_tensor_sizes")):
        if values[name] is not None:
            given[name] = f"{name}={values[name]}"
            restrictions[key] = (values[name],)
    restrictions.update(_context_restrictions(a, model, devices))
    if a.context_parallel_size is not None:
        given["c"] = f"c={a.context_parallel_size}" + (f" {a.cp_comm_type}" if a.cp_comm_type
                                                        else "")
    elif a.cp_comm_type is not None:   # c searched, with this comm type
        given["cp-comm"] = f"cp-comm-type {a.cp_comm_type}"
    if a.num_layers_per_virtual_pipeline_stage is not None:
        given["v"] = f"v ({a.num_layers_per_virtual_pipeline_stage} layers per chunk)"
        restrictions["layers_per_chunk"] = a.num_layers_per_virtual_pipeline_stage
    if a.pipeline_schedule is not None:
        given["schedule"] = f"schedule {a.pipeline_schedule}"
        restrictions["schedules"] = (a.pipeline_schedule,)
    split = _split_of(a)
    if not split.even:
        given["split"] = "split " + " ".join(split.flags())
        restrictions["splits"] = (split,)
    if a.recompute_granularity is not None:
        given["recompute"] = f"recompute {a.recompute_granularity}"
        restrictions["recompute"] = (a.recompute_granularity,)
    if a.sequence_parallel:
        given["sequence-parallel"] = "sequence-parallel"
        restrictions["sequence_parallel"] = (True,)
    strategy = sharding_of(a)
    if strategy is not None:
        given["sharding"] = f"sharding {strategy}"
        restrictions["sharding"] = (strategy,)
    if a.fsdp_reshard_after_forward is not None:
        given["reshard"] = ("reshard after forward" if a.fsdp_reshard_after_forward
                            else "no reshard after forward")
        restrictions["reshard_after_forward"] = (a.fsdp_reshard_after_forward,)
    if not a.scatter_gather:
        restrictions["scatter_gather"] = False
    return fixed


def sharding_of(args: Any) -> str | None:
    """The sharding strategy the flags give, as `ptdp train` reads them
    (TrainConfig.sharding_strategy), or None where none is given;
    ConfigError for a strategy `ptdp train` does not run yet or
    --data-parallel-sharding-strategy without --use-megatron-fsdp."""
    if args.use_megatron_fsdp:
        strategy = args.data_parallel_sharding_strategy or "optim_grads_params"
    elif args.data_parallel_sharding_strategy is not None:
        raise ConfigError([f"--data-parallel-sharding-strategy "
                           f"{args.data_parallel_sharding_strategy} is read only with "
                           "--use-megatron-fsdp (as Megatron-LM and `ptdp train` read it): "
                           "add --use-megatron-fsdp"])
    else:
        strategy = "optim" if args.use_distributed_optimizer else None
    if strategy is not None and strategy not in trained_strategies():
        raise ConfigError([f"--data-parallel-sharding-strategy {strategy} (ZeRO-3, sharded "
                           "parameters; also --use-megatron-fsdp's default) is not built yet, so "
                           "`ptdp train` would refuse it: give --data-parallel-sharding-strategy "
                           "optim_grads (gradients and optimizer state sharded, ZeRO-2) or optim "
                           "(--use-distributed-optimizer's ZeRO-1), or leave the sharding flags "
                           "out to search the strategies"])
    return strategy


def _context_restrictions(args: Any, model: ModelConfig,
                          devices: int) -> dict[str, Any]:
    """The search's context-parallel restrictions from --context-parallel-size
    and --cp-comm-type (checked against the rules that do not involve t)."""
    c, comm = args.context_parallel_size, args.cp_comm_type or "p2p"
    if c is None:
        return {"cp_comm": comm}
    problems = context_parallel_problems(model, ParallelConfig(context_parallel_size=c,
                                                               cp_comm_type=comm), devices)
    if problems:
        raise ConfigError(problems)
    return {"context_sizes": (c,), "cp_comm": comm}


def fix_all_layout(args: Any, model: ModelConfig, devices: int) -> Layout:
    """The one layout the flags give, every dimension not given at `ptdp
    train`'s default (b = 1, the plan's default)."""
    t = args.tensor_model_parallel_size or 1
    p = args.pipeline_model_parallel_size or 1
    c = args.context_parallel_size or 1
    schedule = args.pipeline_schedule or DEFAULT_SCHEDULE
    record = KINDS[schedule]
    fixed = record.fixed_chunks
    v = fixed or 1
    k = args.num_layers_per_virtual_pipeline_stage
    if k and fixed and k * fixed * p != model.num_layers:
        raise ConfigError([f"--pipeline-schedule {schedule} has {record.chunks_word} chunks per "
                           f"rank, so --num-layers-per-virtual-pipeline-stage {k} must be "
                           f"--num-layers / {fixed}p = {model.num_layers / (fixed * p):g}: drop it"])
    if k and not record.takes_layers_per_chunk:
        raise ConfigError([f"--pipeline-schedule {schedule} has one chunk per rank: drop "
                           f"--num-layers-per-virtual-pipeline-stage"])
    if k and not fixed:
        per = p * k
        if model.num_layers % per:
            raise ConfigError([f"--num-layers {model.num_layers} is not a multiple of p × "
                               f"--num-layers-per-virtual-pipeline-stage = {per}"])
        v = model.num_layers // per
    return Layout(t=t, p=p, d=args.data_parallel_size or devices // (t * c * p),
                  b=args.micro_batch_size or 1, v=v,
                  schedule=schedule, recompute=args.recompute_granularity,
                  sharding=sharding_of(args) or "no_shard",
                  reshard_after_forward=(p == 1 if args.fsdp_reshard_after_forward is None
                                         else args.fsdp_reshard_after_forward),  # (train's default)
                  sequence_parallel=args.sequence_parallel, split=_split_of(args), c=c,
                  cp_comm=(args.cp_comm_type or "p2p") if c > 1 else "p2p",
                  ep=args.expert_model_parallel_size or 1, etp=args.expert_tensor_parallel_size,
                  scatter_gather=args.scatter_gather)


def train_problems(model: ModelConfig, layout: Layout, global_batch: int, devices: int,
                   precision: str) -> list[str]:
    """What `ptdp train` says of this layout on `devices` processes (its own
    checks and messages; empty when it would start)."""
    interleaved = layout.schedule_kind == any_chunks_kind().name
    config = Config(
        model=dataclasses.replace(model, recompute_granularity=layout.recompute),
        parallel=ParallelConfig(
            tensor_model_parallel_size=layout.t, pipeline_model_parallel_size=layout.p,
            data_parallel_size=layout.d, context_parallel_size=layout.c,
            cp_comm_type=layout.cp_comm, pipeline_schedule=layout.schedule,
            num_layers_per_virtual_pipeline_stage=(
                model.num_layers // (layout.p * layout.v) if interleaved else None),
            decoder_first_pipeline_num_layers=layout.split.first,
            decoder_last_pipeline_num_layers=layout.split.last,
            account_for_embedding_in_pipeline_split=layout.split.embedding,
            account_for_loss_in_pipeline_split=layout.split.loss,
            sequence_parallel=layout.sequence_parallel,
            scatter_gather_tensors_in_pipeline=layout.scatter_gather,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp),
        train=TrainConfig(micro_batch_size=layout.b, global_batch_size=global_batch,
                          use_distributed_optimizer=layout.sharding == "optim",
                          use_megatron_fsdp=layout.sharding not in ("no_shard", "optim"),
                          data_parallel_sharding_strategy=layout.sharding,
                          bf16=precision == "bf16", fp16=precision == "fp16"))
    try:
        validate(config, world_size=devices)
    except ConfigError as error:
        return list(error.problems)
    return []


def dimensions_line(fixed: FixedDimensions, candidates: list[Layout], model: ModelConfig) -> str:
    """One line: which dimensions the flags fixed and which the search covered
    (those with one valid value here are named with it)."""
    names = [name for name in DIMENSIONS if model.is_moe or name not in ("ep", "etp")]
    given = ", ".join(fixed.given.values())
    if fixed.fix_all or len(candidates) == 1:
        why = ("the others at ptdp train's defaults (--fix-all)" if fixed.fix_all
               else "the only valid layout")
        return f"dimensions: fixed {given or 'none'}; {why}; searched none"
    searched, single = [], []
    for name in names:
        if name in fixed.given:
            continue
        values = _values(candidates, name)
        if len(values) > 1:
            searched.append(name)
        elif values:
            value = values.pop()
            why = (" (--attention-dropout: ptdp's context-parallel attention has no dropout yet)"
                   if name == "c" and value == 1 and model.attention_dropout > 0 else "")
            single.append(f"{name}={value}{why}")
    return (f"dimensions: fixed {given or 'none'}; searched {', '.join(searched) or 'none'}"
            + (f"; one value here: {', '.join(single)}" if single else ""))


def _values(layouts: list[Layout], name: str) -> set[Any]:
    """The values of dimension `name` among `layouts`, as the summary
    names them (each layout's attribute read once, in C: a search has tens
    of thousands)."""
    attribute = {"etp": "expert_tensor", "sequence-parallel": "sequence_parallel"}.get(name, name)
    raw = set(map(operator.attrgetter(attribute), layouts))
    said = {"split": lambda split: "even" if split.even else " ".join(split.flags()),
            "recompute": lambda kind: kind or "none",
            "sequence-parallel": lambda on: "on" if on else "off"}.get(name)
    return raw if said is None else set(map(said, raw))
