"""What the performance model reasons about: a layout and a workload.

`Layout` is one way to run a model (the planner's unit of search);
`Workload` is what is being trained. Both are plain, hashable data shared by
the analytic model (analytic/), the simulator (simulate/predict.py) and
the planner (plan/).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, fields, is_dataclass
from functools import lru_cache

from ptdp.config import ModelConfig, ParallelConfig
from ptdp.config.context import context_parallel_problems
from ptdp.config.lora import TARGET_NAMES, LoRAConfig
from ptdp.config.moe import expert_parallel_problems
from ptdp.schedules.kinds import (DEFAULT_SCHEDULE, FLAG_CHOICES, KINDS, or_list, running_kind,
                                  virtual_stage_of)
from ptdp.schedules.split import LayerSplit, split_problems, stage_layer_counts

RECOMPUTE_KINDS = (None, "selective", "full")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")  # --cp-comm-type (ptdp.parallel.context_attention)
SCHEDULES = FLAG_CHOICES   # Layout.schedule: a --pipeline-schedule value (ptdp.schedules.kinds)
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
# What is sharded over the data-parallel (× context) replicas, Megatron-LM's
# --data-parallel-sharding-strategy values: nothing, the optimizer state
# (ZeRO-1, --use-distributed-optimizer), and the gradients (ZeRO-2,
# ptdp.parallel.sharded_grads), and the parameters (ZeRO-3).
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# `ptdp train`'s flags of the reshard policy under ZeRO-3 (on, off).
RESHARD_FLAGS = ("--fsdp-reshard-after-forward", "--no-fsdp-reshard-after-forward")
# Whether the planner proposes ZeRO-3 (optim_grads_params) and the memory
# check advises it: `ptdp train` runs it (ptdp.parallel.sharded_params); the
# switch stays so that a plan can be priced as before it existed (tests).
PARAMETER_SHARDING_TRAINS = True


def trained_strategies() -> tuple[str, ...]:
    """The SHARDING_STRATEGIES `ptdp train` runs now (see PARAMETER_SHARDING_TRAINS)."""
    if PARAMETER_SHARDING_TRAINS:
        return SHARDING_STRATEGIES
    return tuple(name for name in SHARDING_STRATEGIES if name != "optim_grads_params")


@dataclass(frozen=True)
class Layout:
    t: int = 1                      # tensor-parallel size
    p: int = 1                      # pipeline-parallel size
    d: int = 1                      # data-parallel size
    b: int = 1                      # microbatch size
    v: int = 1                      # chunks per pipeline rank (v > 1: interleaved 1F1B or a V)
    recompute: str | None = None    # None, "selective" or "full" (uniform, 1 layer per group)
    # A SHARDING_STRATEGIES value. (`distributed_optimizer`, a property, is
    # True under any of them but no_shard; Layout(distributed_optimizer=...)
    # and dataclasses.replace(layout, distributed_optimizer=...) still take
    # it: True keeps a sharded strategy or makes no_shard optim, False is no_shard.)
    sharding: str = "no_shard"
    # ZeRO-3 (sharding optim_grads_params) only: each unit's gathered
    # parameters are freed after its forward and gathered again for its
    # backward, per microbatch (True); or a stage keeps its gathered
    # parameters across its microbatches within an iteration (False).
    reshard_after_forward: bool = True
    scatter_gather: bool = True
    # A --pipeline-schedule value (ptdp.schedules.kinds): one of one chunk
    # per rank when v == 1; interleaved 1F1B when v > 1, unless the kind has
    # its own fixed v (the V placement, v = 2; zero-bubble kinds split the
    # backward into B and W, see ptdp.schedules.zero_bubble).
    schedule: str = DEFAULT_SCHEDULE
    # --sequence-parallel: the activations outside the tensor-parallel
    # regions split over the t ranks along the sequence (t > 1, s % t == 0).
    sequence_parallel: bool = False
    # How the layers are cut over the virtual stages (even by default; see
    # ptdp.schedules.split): Megatron-LM's first/last-rank layer
    # counts (v = 1 schedules) or the embedding/loss accounting flags.
    split: LayerSplit = LayerSplit()
    # Expert parallelism (MoE models): a stage's t·d ranks folded into
    # ETP × EP × EDP (ptdp.parallel.topology.RankGrid); each rank holds E/EP
    # routed experts split over ETP (None: t), their gradients reduced and,
    # with the distributed optimizer, sharded over EDP = t·d/(ETP·EP).
    ep: int = 1
    etp: int | None = None
    # Context parallelism (--context-parallel-size c, --cp-comm-type): each
    # sequence split over c ranks (s/c positions each, Megatron-Core's
    # rank = tp + t·(cp + c·(dp + d·pp))); parameters replicated over them,
    # gradients reduced (and the distributed optimizer sharded) over d·c.
    c: int = 1
    cp_comm: str = "p2p"

    @property
    def distributed_optimizer(self) -> bool:
        """The optimizer state is sharded (ZeRO-1 and up)."""
        return self.sharding != "no_shard"

    @property
    def shards_gradients(self) -> bool:
        """Gradients reduce-scattered per microbatch into a shard (ZeRO-2 and up)."""
        return self.sharding in ("optim_grads", "optim_grads_params")

    @property
    def shards_parameters(self) -> bool:
        """Parameters stored as shards, gathered per unit (ZeRO-3)."""
        return self.sharding == "optim_grads_params"

    @property
    def devices(self) -> int:
        return self.t * self.c * self.p * self.d

    @property
    def gradient_replicas(self) -> int:
        """Ranks holding the same dense parameters: d·c (data × context)."""
        return self.d * self.c

    @property
    def expert_tensor(self) -> int:
        """ETP: the ranks each routed expert is split over (t by default)."""
        return self.t if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """EDP: the replicas of one routed expert's shard, t·c·d/(ETP·EP)."""
        return self.t * self.c * self.d // (self.ep * self.expert_tensor)

    @property
    def schedule_kind(self) -> str:
        """The kind build_schedule takes: one with a fixed v > 1 as it is;
        the interleaved kind for any other schedule with v > 1."""
        return _running_kind(self.schedule, self.v)

    @property
    def zero_bubble(self) -> bool:
        """The backward is split into B (input gradient) and W (weight gradients)."""
        return _splits_backward(self.schedule, self.v)

    @property
    def splits_sequence(self) -> bool:
        """Sequence parallelism in effect (it means nothing with t = 1)."""
        return self.sequence_parallel and self.t > 1

    @property
    def sends_slices(self) -> bool:
        """Whether each tensor rank sends only 1/t of a stage boundary's
        activation: scatter/gather, or sequence parallelism (its own s/t
        positions, whatever scatter_gather says)."""
        return self.t > 1 and (self.scatter_gather or self.sequence_parallel)

    @property
    def gathers_received(self) -> bool:
        """Whether the receiving tensor group all-gathers what arrives:
        scatter/gather only; under sequence parallelism the slice is what the
        next stage computes on."""
        return self.t > 1 and self.scatter_gather and not self.sequence_parallel

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers of each virtual stage, in stage order."""
        return list(_stage_layers(num_layers, self.p, self.v, self.schedule_kind, self.split))

    def chunk_layers(self, num_layers: int, rank: int, chunk: int) -> int:
        """Transformer layers of (rank, chunk): those of its virtual stage."""
        stage = virtual_stage_of(self.schedule_kind, self.p, self.v, rank, chunk)
        return self.stage_layers(num_layers)[stage]

    def microbatches(self, global_batch: int) -> int:
        """m = B / (b·d) microbatches per pipeline per iteration."""
        return global_batch // (self.b * self.d)

    def valid_for(self, model: ModelConfig, global_batch: int) -> list[str]:
        """Why this layout cannot run `model` (empty when it can): the same
        divisibility rules `ptdp train` enforces."""
        problems = tensor_size_problems(model, self.t)
        m = self.microbatches(global_batch)
        problems += self._schedule_problems(model)
        if global_batch % (self.b * self.d):
            problems.append(f"b·d={self.b * self.d} does not divide the global batch {global_batch}")
        else:
            problems += self._microbatch_problems(m)
        if self.sequence_parallel:
            problems += sequence_parallel_problems(model, self.t)
        if self.recompute not in RECOMPUTE_KINDS:
            problems.append(f"unknown recomputation {self.recompute!r}")
        if self.sharding not in SHARDING_STRATEGIES:
            problems.append(f"unknown sharding strategy {self.sharding!r}: use one of "
                            f"{', '.join(SHARDING_STRATEGIES)}")
        if self.cp_comm not in CP_COMM_TYPES:
            problems.append(f"unknown --cp-comm-type {self.cp_comm!r}: use one of "
                            f"{', '.join(CP_COMM_TYPES)}")
        elif self.c < 1:
            problems.append(f"c={self.c}: the context-parallel size must be positive")
        elif self.c > 1:   # `ptdp train`'s own rules (sequence, a2a heads, dropout)
            problems += context_parallel_problems(model, self._parallel_config(), self.devices)
        if self.ep < 1 or self.expert_tensor < 1:
            problems.append(f"ep={self.ep} and etp={self.etp} must be positive (etp None: t)")
        elif model.is_moe or (self.ep, self.etp) != (1, None):   # `ptdp train`'s own rules
            problems += expert_parallel_problems(model, self._parallel_config(), self.devices)
        return problems

    def _schedule_problems(self, model: ModelConfig) -> list[str]:
        """The schedule's chunks, stages and layers (its record's rules)."""
        if self.schedule not in SCHEDULES:
            return [f"unknown schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}"]
        record, l = KINDS[self.schedule], model.num_layers
        fixed = record.fixed_chunks
        if fixed and self.v != fixed:
            return [f"{self.schedule} has v={fixed} chunks per rank{record.in_a_v}, not v={self.v}"]
        if fixed and self.p < record.fewest_stages:
            return [f"{self.schedule} needs p >= {record.fewest_stages} (it places "
                    f"{record.chunks_words}), not p={self.p}"]
        if not fixed and record.with_chunks is None and self.v != 1:
            return [f"{self.schedule} has one chunk per rank, not v={self.v}"]
        if not self.split.even:
            if KINDS[self.schedule_kind].chunks is None:
                plain = [k.name for k in KINDS.values() if k.flag and not k.fixed_chunks]
                fixed_names = [k.name for k in KINDS.values() if k.flag and k.fixed_chunks]
                return ["an uneven layer split (" + " ".join(self.split.flags())
                        + ") is not supported with the interleaved schedule: use v=1 "
                        f"({', '.join(sorted(plain, key=lambda n: n != DEFAULT_SCHEDULE))}) or "
                        f"{or_list(fixed_names)}"]
            return split_problems(l, self.p, self.v, self.schedule_kind, self.split)
        if fixed and l % (fixed * self.p):
            return [f"{self.schedule} needs {fixed}p={fixed * self.p} to divide the {l} layers"]
        if l % (self.p * self.v):
            return [f"p·v={self.p * self.v} does not divide the {l} layers"]
        return []

    def _microbatch_problems(self, m: int) -> list[str]:
        """m against the schedule's record (whole microbatches)."""
        record = KINDS.get(self.schedule)
        fewest = record.fewest_microbatches(self.p) if record is not None else 1
        if m < fewest:
            return [f"{self.schedule} needs m={m} to be at least {record.fewest_text}={fewest}"]
        running = KINDS.get(self.schedule_kind)
        if running is not None and running.microbatches_multiple_of_p and m % self.p:
            return [f"interleaving needs m={m} to be a multiple of p={self.p}"]
        return []

    def _parallel_config(self) -> ParallelConfig:
        """The parallel settings `ptdp train` checks the expert layout against."""
        return ParallelConfig(tensor_model_parallel_size=self.t,
                              pipeline_model_parallel_size=self.p, data_parallel_size=self.d,
                              sequence_parallel=self.sequence_parallel,
                              context_parallel_size=self.c, cp_comm_type=self.cp_comm,
                              expert_model_parallel_size=self.ep,
                              expert_tensor_parallel_size=self.etp)

    def train_flags(self, model: ModelConfig, global_batch: int) -> list[str]:
        """The `ptdp train` flags that select this layout."""
        flags = ["--tensor-model-parallel-size", str(self.t),
                 "--pipeline-model-parallel-size", str(self.p),
                 "--data-parallel-size", str(self.d),
                 "--micro-batch-size", str(self.b),
                 "--global-batch-size", str(global_batch)]
        if self.c > 1:
            flags += ["--context-parallel-size", str(self.c), "--cp-comm-type", self.cp_comm]
        if self.schedule != DEFAULT_SCHEDULE:   # a fixed v (a V) is implied by the schedule
            flags += ["--pipeline-schedule", self.schedule]
        elif self.v > 1:
            flags += ["--num-layers-per-virtual-pipeline-stage",
                      str(model.num_layers // (self.p * self.v))]
        if self.recompute == "full":
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]
        elif self.recompute == "selective":
            flags += ["--recompute-granularity", "selective"]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        flags += self.sharding_flags()
        if not self.scatter_gather:
            flags.append("--no-scatter-gather-tensors-in-pipeline")
        if self.ep != 1:
            flags += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp is not None:
            flags += ["--expert-tensor-parallel-size", str(self.etp)]
        return flags + self.split.flags()

    def sharding_flags(self) -> list[str]:
        """`ptdp train`'s flags of the sharding strategy: ZeRO-1 as
        --use-distributed-optimizer, ZeRO-2 and 3 as Megatron-FSDP's."""
        if self.sharding == "no_shard":
            return []
        if self.sharding == "optim":
            return ["--use-distributed-optimizer"]
        flags = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", self.sharding]
        if self.shards_parameters:
            flags.append(RESHARD_FLAGS[0 if self.reshard_after_forward else 1])
        return flags


def tensor_size_problems(model: ModelConfig, t: int) -> list[str]:
    """Why t tensor-parallel ranks cannot split `model` (Layout.valid_for's
    rule of t alone: the planner drops such a t before building its layouts)."""
    ffn = model.ffn_size
    if model.num_attention_heads % t or ffn % t:
        return [f"t={t} does not divide the heads ({model.num_attention_heads}) and the MLP ({ffn})"]
    if model.query_groups % t:
        return [f"t={t} does not divide the key/value groups ({model.query_groups})"]
    return []


def sequence_parallel_problems(model: ModelConfig, t: int) -> list[str]:
    """Why sequence parallelism cannot run at t (Layout.valid_for's rule of t alone)."""
    if t == 1:
        return ["sequence parallelism needs t > 1"]
    if model.seq_length % t:
        return [f"sequence parallelism needs t={t} to divide the sequence length "
                f"{model.seq_length}"]
    return []


_generated_init = Layout.__init__


def _layout_init(self, *args, distributed_optimizer: bool | None = None, **kwargs) -> None:
    """Layout's own __init__, also taking the `distributed_optimizer` of
    before the sharding strategies (see Layout.sharding)."""
    _generated_init(self, *args, **kwargs)
    if distributed_optimizer is not None and distributed_optimizer != self.distributed_optimizer:
        object.__setattr__(self, "sharding", "optim" if distributed_optimizer else "no_shard")


Layout.__init__ = _layout_init


# (a search asks a layout's kind a few times per candidate: cached by (schedule, v))
_running_kind = lru_cache(maxsize=256)(running_kind)


@lru_cache(maxsize=256)
def _splits_backward(schedule: str, v: int) -> bool:
    record = KINDS.get(_running_kind(schedule, v))
    return record is not None and record.splits_backward


@lru_cache(maxsize=65536)
def _stage_layers(num_layers: int, p: int, v: int, kind: str, split: LayerSplit) -> tuple[int, ...]:
    return tuple(stage_layer_counts(num_layers, p, v, kind, split))


@dataclass(frozen=True)
class LoRAWork:
    """What the performance model needs of --lora-* (ptdp.config.lora): the
    adapters' rank, the target patterns (which layers: ptdp.model.adapters),
    whether routed experts share one adapter per MoE layer and matrix, and
    whether the adapters' input is dropped out (its mask and copy are saved).
    The base model is frozen (ptdp.perf.analytic.lora prices what that saves)."""
    rank: int
    targets: tuple[str, ...] = TARGET_NAMES
    share_expert_adapters: bool = False
    dropout: bool = False

    @classmethod
    def of(cls, lora: LoRAConfig | None) -> "LoRAWork | None":
        """The settings of a config's `lora` section; None without adapters."""
        if lora is None or not lora.enabled:
            return None
        return cls(lora.lora_rank, tuple(lora.lora_target_modules),
                   lora.lora_share_expert_adapters, lora.lora_dropout > 0)

    def config(self) -> LoRAConfig:
        """A LoRAConfig with these settings (alpha does not change any cost)."""
        return LoRAConfig(lora_rank=self.rank, lora_target_modules=list(self.targets),
                          lora_share_expert_adapters=self.share_expert_adapters,
                          lora_dropout=0.1 if self.dropout else 0.0)


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int
    precision: str = "bf16"         # "bf16", "fp16" or "fp32": weights and activations
    lora: LoRAWork | None = None    # low-rank adapters on a frozen base (None: every weight trained)
    main_grads_bytes: int = 4       # a main gradient's bytes: 4 (fp32), 2 (--main-grads-dtype bf16)

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]


class ByValue:
    """A cache key for a dataclass that cannot be hashed (ModelConfig is
    mutable, so a Workload holding one is not hashable): equal to another
    when all their fields are, as they are when the key is made. A cached
    function that keeps the object takes it through `copy()`, so that a
    later change to the caller's object cannot change what the cache holds."""
    __slots__ = ("value", "_fields")

    def __init__(self, value):
        self.value = value
        self._fields = _snapshot(value)

    def copy(self):
        return deepcopy(self.value)

    def __hash__(self) -> int:
        return hash(self._fields)

    def __eq__(self, other) -> bool:
        return isinstance(other, ByValue) and other._fields == self._fields


class ByIdentity:
    """A cache key that compares by identity: hardware profiles hold dicts
    (not hashable), and one profile object is what a search prices with."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other) -> bool:
        return isinstance(other, ByIdentity) and other.value is self.value


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _snapshot(value):
    """The values of a dataclass's fields, nested dataclasses as tuples too
    (dataclasses.astuple without its copying, which a search calls too often)."""
    kind = type(value)
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(f.name for f in fields(kind))
    values = [getattr(value, name) for name in names]
    return (kind, *(item if type(item) in _SCALARS
                    else _snapshot(item) if is_dataclass(item)
                    else tuple(item) if type(item) is list  # (--recompute-modules)
                    else item for item in values))
