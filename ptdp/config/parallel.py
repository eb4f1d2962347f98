"""The parallel section: the layout (tensor, context, pipeline and data-parallel sizes),
the pipeline schedule and its model chunks, how layers split over the stages,
sequence parallelism, the device and the collectives' timeout. Its checks look
at these settings alone; the layout against the model and the batch is
ptdp.config.checks'."""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.base import finite_or_none, flag, positive_integer_problems
from ptdp.schedules.kinds import DEFAULT_SCHEDULE, FLAG_CHOICES, KINDS, any_chunks_kind, flag_help
from ptdp.schedules.split import LayerSplit


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = flag(1, "--tensor-model-parallel-size", "tensor-parallel size t",
                                           short="-t")
    pipeline_model_parallel_size: int = flag(1, "--pipeline-model-parallel-size",
                                             "pipeline-parallel size p", short="-p")
    data_parallel_size: int | None = flag(
        None, "--data-parallel-size",
        "data-parallel size d for local launches (under torchrun/SLURM: world size / (t·c·p))",
        short="-d")
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "--num-layers-per-virtual-pipeline-stage",
        "layers per model chunk; enables the interleaved 1F1B schedule")
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        None, "--num-virtual-stages-per-pipeline-rank",
        "model chunks v per pipeline rank (Megatron-LM's newer alternative to "
        "--num-layers-per-virtual-pipeline-stage: L / (p·v) layers per chunk); enables the "
        "interleaved 1F1B schedule")
    pipeline_schedule: str = flag(DEFAULT_SCHEDULE, "--pipeline-schedule", flag_help(),
                                  choices=FLAG_CHOICES)
    decoder_first_pipeline_num_layers: int | None = flag(
        None, "--decoder-first-pipeline-num-layers",
        "transformer layers on the first pipeline rank (it also computes the embedding); the "
        "other ranks split the rest evenly")
    decoder_last_pipeline_num_layers: int | None = flag(
        None, "--decoder-last-pipeline-num-layers",
        "transformer layers on the last pipeline rank (it also computes the output layer and "
        "the loss); the other ranks split the rest evenly")
    account_for_embedding_in_pipeline_split: bool = flag(
        False, "--account-for-embedding-in-pipeline-split",
        "count the embedding as one layer when splitting layers over the pipeline stages: the "
        "first stage builds one transformer layer fewer")
    account_for_loss_in_pipeline_split: bool = flag(
        False, "--account-for-loss-in-pipeline-split",
        "count the output layer with the loss as one layer when splitting layers over the "
        "pipeline stages: the last stage builds one transformer layer fewer")
    sequence_parallel: bool = flag(
        False, "--sequence-parallel",
        "split the activations outside the tensor-parallel regions (norms, dropout, residual "
        "adds) along the sequence over the t tensor ranks: s/t positions each, the same "
        "communication volume (all-gather and reduce-scatter instead of all-reduce); needs t > 1 "
        "and s divisible by t")
    scatter_gather_tensors_in_pipeline: bool = flag(
        True, "--no-scatter-gather-tensors-in-pipeline",
        "send whole boundary tensors between stages instead of 1/t slices all-gathered by the "
        "receiving tensor group", negate=True)
    context_parallel_size: int = flag(
        1, "--context-parallel-size",
        "context-parallel size c: each sequence cut into 2c chunks, context rank r holding "
        "chunks r and 2c-1-r (equal causal work), attention exchanging keys and values over "
        "the c ranks; parameters replicated, gradients reduced over data × context ranks; "
        "needs --seq-length divisible by 2c")
    cp_comm_type: str = flag(
        "p2p", "--cp-comm-type",
        "how attention reaches the other context ranks' keys and values: p2p (a ring passing "
        "key/value blocks, overlapped with attention), all_gather (gather them, then attend) or "
        "a2a (all-to-all trading the sequence split for a head split, DeepSpeed-Ulysses; needs "
        "heads and key/value groups per tensor rank divisible by c)",
        choices=("p2p", "all_gather", "a2a"))
    expert_model_parallel_size: int = flag(
        1, "--expert-model-parallel-size",
        "expert-parallel size EP: each MoE layer's experts split over EP ranks (E/EP each)")
    expert_tensor_parallel_size: int | None = flag(
        None, "--expert-tensor-parallel-size",
        "tensor-parallel size ETP of each expert's MLP (default --tensor-model-parallel-size)")
    device: str = flag("auto", "--device", "auto | cpu | cuda (auto: cuda with NCCL when there are "
                       "enough GPUs, else cpu with gloo)", choices=("auto", "cpu", "cuda"))
    distributed_timeout_minutes: float = flag(
        10.0, "--distributed-timeout-minutes",
        "a collective that waits longer than this fails instead of hanging")
    allow_oversubscribe: bool = flag(
        False, "--allow-oversubscribe",
        "start a local CPU launch's processes even when this machine cannot carry them: more "
        "than 16 per CPU core, or more than its memory holds at about 80 MiB each before the "
        "model (ptdp.perf.local_processes); refused otherwise, before anything starts")

    @property
    def dp(self) -> int:
        return self.data_parallel_size or 1

    @property
    def expert_tensor_size(self) -> int:
        """ETP: --expert-tensor-parallel-size, by default t."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def ranks_per_replica(self) -> int:
        """t·c·p: the ranks one data-parallel replica spans (Megatron-LM's
        total_model_size); the world is d of them."""
        return (self.tensor_model_parallel_size * self.context_parallel_size
                * self.pipeline_model_parallel_size)

    @property
    def world_size(self) -> int:
        return self.ranks_per_replica * self.dp

    @property
    def interleaved(self) -> bool:
        """Whether each pipeline rank's layers are in chunks of
        --num-layers-per-virtual-pipeline-stage under a schedule that does
        not keep its own chunks (interleaving; refused under one that cannot interleave)."""
        record = KINDS.get(self.pipeline_schedule)
        return (self.num_layers_per_virtual_pipeline_stage is not None and record is not None
                and record.flag and not record.keeps_its_chunks)

    @property
    def schedule_kind(self) -> str:
        record = KINDS.get(self.pipeline_schedule)
        if record is not None and record.keeps_its_chunks:
            return self.pipeline_schedule
        if self.num_layers_per_virtual_pipeline_stage is not None:
            return any_chunks_kind().name
        return self.pipeline_schedule

    @property
    def layer_split(self) -> LayerSplit:
        """How the layers are split over the stages (ptdp.schedules.split)."""
        return LayerSplit(self.decoder_first_pipeline_num_layers,
                          self.decoder_last_pipeline_num_layers,
                          self.account_for_embedding_in_pipeline_split,
                          self.account_for_loss_in_pipeline_split)

    def virtual_stages(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (v); 1 without interleaving, its own
        under a schedule that keeps its chunks (ScheduleKind.keeps_its_chunks)."""
        record = KINDS.get(self.pipeline_schedule)
        if record is not None and record.keeps_its_chunks:
            return record.chunks or 1
        k = self.num_layers_per_virtual_pipeline_stage
        if k is None:
            return 1
        return num_layers // (self.pipeline_model_parallel_size * k)


def parallel_count_problems(par: ParallelConfig) -> list[str]:
    """The layout's sizes that must be positive integers."""
    return positive_integer_problems(
        par, ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
              "context_parallel_size", "num_layers_per_virtual_pipeline_stage",
              "expert_model_parallel_size", "expert_tensor_parallel_size"),
        optional=("data_parallel_size", "num_layers_per_virtual_pipeline_stage",
                  "expert_tensor_parallel_size"))


def timeout_problems(par: ParallelConfig) -> list[str]:
    """--distributed-timeout-minutes."""
    problems = []
    if finite_or_none(par.distributed_timeout_minutes) and par.distributed_timeout_minutes <= 0:
        problems.append(f"--distributed-timeout-minutes={par.distributed_timeout_minutes} must be > 0")
    return problems
