"""What the performance model reasons about: a layout and a workload.

`Layout` is one way to run a model (the planner's unit of search);
`Workload` is what is being trained. Both are plain, hashable data shared by
the analytic model (analytic.py), the simulator (cost.py) and the planner
(plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config import ModelConfig

RECOMPUTE_KINDS = (None, "selective", "full")
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    t: int = 1                      # tensor-parallel size
    p: int = 1                      # pipeline-parallel size
    d: int = 1                      # data-parallel size
    b: int = 1                      # microbatch size
    v: int = 1                      # model chunks per pipeline rank (v > 1: interleaved 1F1B)
    recompute: str | None = None    # None, "selective" or "full" (uniform, 1 layer per group)
    distributed_optimizer: bool = False
    scatter_gather: bool = True
    schedule: str = "1f1b"          # "gpipe" or "1f1b" when v == 1; interleaved when v > 1
    # --sequence-parallel: the activations outside the tensor-parallel
    # regions split over the t ranks along the sequence (t > 1, s % t == 0).
    sequence_parallel: bool = False

    @property
    def devices(self) -> int:
        return self.t * self.p * self.d

    @property
    def schedule_kind(self) -> str:
        return "interleaved" if self.v > 1 else self.schedule

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

    def microbatches(self, global_batch: int) -> int:
        """m = B / (b·d) microbatches per pipeline per iteration."""
        return global_batch // (self.b * self.d)

    def valid_for(self, model: ModelConfig, global_batch: int) -> list[str]:
        """Why this layout cannot run `model` (empty when it can): the same
        divisibility rules `ptdp train` enforces."""
        problems = []
        ffn = model.ffn_size
        if model.num_attention_heads % self.t or ffn % self.t:
            problems.append(f"t={self.t} does not divide the heads ({model.num_attention_heads}) "
                            f"and the MLP ({ffn})")
        elif model.query_groups % self.t:
            problems.append(f"t={self.t} does not divide the key/value groups "
                            f"({model.query_groups})")
        if model.num_layers % (self.p * self.v):
            problems.append(f"p·v={self.p * self.v} does not divide the {model.num_layers} layers")
        if global_batch % (self.b * self.d):
            problems.append(f"b·d={self.b * self.d} does not divide the global batch {global_batch}")
        elif self.v > 1 and self.microbatches(global_batch) % self.p:
            problems.append(f"interleaving needs m={self.microbatches(global_batch)} to be a "
                            f"multiple of p={self.p}")
        if self.sequence_parallel and self.t == 1:
            problems.append("sequence parallelism needs t > 1")
        elif self.sequence_parallel and model.seq_length % self.t:
            problems.append(f"sequence parallelism needs t={self.t} to divide the sequence "
                            f"length {model.seq_length}")
        if self.recompute not in RECOMPUTE_KINDS:
            problems.append(f"unknown recomputation {self.recompute!r}")
        return problems

    def train_flags(self, model: ModelConfig, global_batch: int) -> list[str]:
        """The `ptdp train` flags that select this layout."""
        flags = ["--tensor-model-parallel-size", str(self.t),
                 "--pipeline-model-parallel-size", str(self.p),
                 "--data-parallel-size", str(self.d),
                 "--micro-batch-size", str(self.b),
                 "--global-batch-size", str(global_batch)]
        if self.v > 1:
            flags += ["--num-layers-per-virtual-pipeline-stage",
                      str(model.num_layers // (self.p * self.v))]
        elif self.schedule == "gpipe":
            flags += ["--pipeline-schedule", "gpipe"]
        if self.recompute == "full":
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]
        elif self.recompute == "selective":
            flags += ["--recompute-granularity", "selective"]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.distributed_optimizer:
            flags.append("--use-distributed-optimizer")
        if not self.scatter_gather:
            flags.append("--no-scatter-gather-tensors-in-pipeline")
        return flags


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    global_batch: int
    precision: str = "bf16"         # "bf16", "fp16" or "fp32": weights and activations

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]
