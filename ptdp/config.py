"""Typed configuration: model, parallel layout, training and data settings.

Every field that is a command-line flag carries its flag name (Megatron-LM's
where one exists) in its metadata; the CLI is generated from these dataclasses,
so a field, its flag, its config-file key and its help text live in one place.

`validate` checks every constraint before any process starts. It never adjusts
a value: each problem becomes a message naming the flag, the values and a
valid alternative, and all problems are reported together.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ptdp.plural import plural
from ptdp.parallel.pipeline.split import LayerSplit, split_problems


def flag(default: Any, name: str, help: str, **extra: Any) -> Any:
    """A dataclass field that is also the command-line flag `name`."""
    return field(default=default, metadata={"flag": name, "help": help, **extra})


@dataclass
class ModelConfig:
    num_layers: int = flag(4, "--num-layers", "transformer layers")
    hidden_size: int = flag(128, "--hidden-size", "hidden size h")
    num_attention_heads: int = flag(4, "--num-attention-heads", "attention heads a")
    ffn_hidden_size: int | None = flag(None, "--ffn-hidden-size", "MLP hidden size (default 4·h)")
    seq_length: int = flag(64, "--seq-length", "sequence length s")
    max_position_embeddings: int | None = flag(
        None, "--max-position-embeddings", "learned positions (default --seq-length)")
    vocab_size: int = flag(50257, "--vocab-size",
                           "vocabulary size before padding (GPT-2: 50257; with --tokenizer-type "
                           "NullTokenizer the data's ids are 0..N-1 and the model gets N + 1)")
    make_vocab_size_divisible_by: int = flag(
        128, "--make-vocab-size-divisible-by",
        "pad the vocabulary to a multiple of this × tensor-parallel size; padded entries never "
        "enter the loss")
    hidden_dropout: float = flag(0.1, "--hidden-dropout", "dropout on residual-branch outputs and embeddings")
    attention_dropout: float = flag(0.1, "--attention-dropout", "dropout on attention probabilities")
    init_method_std: float = flag(0.02, "--init-method-std", "std of the normal weight initialisation")
    layernorm_epsilon: float = flag(1e-5, "--layernorm-epsilon", "LayerNorm epsilon")
    bias_gelu_fusion: bool = flag(True, "--no-bias-gelu-fusion", "do not fuse bias + GeLU",
                                  negate=True)
    bias_dropout_fusion: bool = flag(True, "--no-bias-dropout-fusion",
                                     "do not fuse bias + dropout + residual add", negate=True)
    recompute_granularity: str | None = flag(
        None, "--recompute-granularity",
        "activation recomputation: full (store only layer inputs, recompute the layers in "
        "backward) or selective (recompute only the attention core)",
        choices=("full", "selective"))
    recompute_method: str = flag(
        "uniform", "--recompute-method",
        "with full recomputation: uniform (checkpoint groups of --recompute-num-layers layers) or "
        "block (checkpoint only the first --recompute-num-layers layers of each chunk)",
        choices=("uniform", "block"))
    recompute_num_layers: int = flag(1, "--recompute-num-layers",
                                     "layers per checkpointed group (uniform) or checkpointed "
                                     "layers per chunk (block)")
    recompute_activations: bool = flag(
        False, "--recompute-activations",
        "Megatron-LM's alias of --recompute-granularity selective")
    # The Llama family's options (Megatron-LM's flags). Their defaults are GPT-2.
    normalization: str = flag("LayerNorm", "--normalization",
                              "normalization layers: LayerNorm, or RMSNorm (no mean, no bias)",
                              choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float | None = flag(
        None, "--norm-epsilon",
        "epsilon of the normalization layers (Megatron-LM's newer name for --layernorm-epsilon; "
        "default: --layernorm-epsilon)")
    swiglu: bool = flag(False, "--swiglu",
                        "gated MLP: silu(x·W_gate) ⊙ (x·W_up), then W_down; --ffn-hidden-size is "
                        "the gated width (default as Megatron-LM: 4·h·2/3 rounded down to a "
                        "multiple of 64)")
    position_embedding_type: str = flag(
        "learned_absolute", "--position-embedding-type",
        "learned_absolute (a learned table added to the word embeddings) or rope (rotary "
        "embeddings applied to each head's queries and keys)", choices=("learned_absolute", "rope"))
    rotary_base: float = flag(10000.0, "--rotary-base",
                              "with rope: the base θ of the rotary frequencies")
    group_query_attention: bool = flag(
        False, "--group-query-attention",
        "grouped-query attention: --num-query-groups key/value heads, each shared by "
        "heads/groups query heads")
    num_query_groups: int | None = flag(None, "--num-query-groups",
                                        "with --group-query-attention: key/value heads G")
    untie_embeddings_and_output_weights: bool = flag(
        False, "--untie-embeddings-and-output-weights",
        "an output layer of its own instead of the word embedding's transpose")
    disable_bias_linear: bool = flag(False, "--disable-bias-linear",
                                     "no biases in the linear layers (normalization biases stay)")
    apply_layernorm_1p: bool = flag(
        False, "--apply-layernorm-1p",
        "zero-centred normalization scales: each norm stores w and scales by 1 + w (w starts at "
        "0), which keeps the scale's precision in bf16/fp16")
    kv_channels: int | None = flag(
        None, "--kv-channels",
        "width of each attention head (ptdp's heads are --hidden-size / --num-attention-heads "
        "wide; any other value is refused)")
    rotary_percent: float = flag(
        1.0, "--rotary-percent",
        "with rope: the fraction of each head's width that is rotated (ptdp rotates all of it: "
        "only 1.0)")
    attention_backend: str = flag(
        "auto", "--attention-backend",
        "Megatron-LM's choice of attention implementation; ptdp's is always PyTorch's "
        "scaled_dot_product_attention, which picks its kernel itself: any other value than auto "
        "makes the first rank report the kernel it picks", choices=("auto", "flash", "fused",
                                                                  "unfused", "local"))
    use_flash_attn: bool = flag(
        False, "--use-flash-attn",
        "older Megatron-LM's switch for flash attention; PyTorch's attention picks flash "
        "attention itself where it can: the first rank reports the kernel it picks")
    activations_checkpoint_method: str | None = flag(
        None, "--activations-checkpoint-method",
        "older Megatron-LM's name for full recomputation with --recompute-method METHOD",
        choices=("uniform", "block"))

    def __post_init__(self) -> None:
        # The alias sets what every consumer reads; with --recompute-granularity
        # full it is a contradiction that validate reports.
        if self.recompute_activations and self.recompute_granularity is None:
            self.recompute_granularity = "selective"
        # Older Megatron-LM's --activations-checkpoint-method alone turned full
        # recomputation on (what the paper's sc21 scripts rely on).
        if self.activations_checkpoint_method is not None and self.recompute_granularity is None:
            self.recompute_granularity = "full"
            self.recompute_method = self.activations_checkpoint_method

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Megatron-LM's default: the gated MLP's three matrices hold about
            # as many parameters as GPT's two at 4·h, kept a multiple of 64.
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    @property
    def epsilon(self) -> float:
        """The normalization layers' epsilon."""
        return self.layernorm_epsilon if self.norm_epsilon is None else self.norm_epsilon

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups under grouped-query attention, else one per head."""
        if self.group_query_attention and self.num_query_groups is not None:
            return self.num_query_groups
        return self.num_attention_heads

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def tied_output(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def bias(self) -> bool:
        """Whether the linear layers have biases."""
        return not self.disable_bias_linear

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = flag(1, "--tensor-model-parallel-size", "tensor-parallel size t",
                                           short="-t")
    pipeline_model_parallel_size: int = flag(1, "--pipeline-model-parallel-size",
                                             "pipeline-parallel size p", short="-p")
    data_parallel_size: int | None = flag(
        None, "--data-parallel-size",
        "data-parallel size d for local launches (under torchrun/SLURM: world size / (t·p))",
        short="-d")
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        None, "--num-layers-per-virtual-pipeline-stage",
        "layers per model chunk; enables the interleaved 1F1B schedule")
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        None, "--num-virtual-stages-per-pipeline-rank",
        "model chunks v per pipeline rank (Megatron-LM's newer alternative to "
        "--num-layers-per-virtual-pipeline-stage: L / (p·v) layers per chunk); enables the "
        "interleaved 1F1B schedule")
    pipeline_schedule: str = flag(
        "1f1b", "--pipeline-schedule",
        "gpipe (all forwards, then all backwards), 1f1b, or a zero-bubble schedule (backward "
        "split into input and weight gradients, the weight gradients filling the bubbles): zb-h1 "
        "(one chunk per rank, 1F1B's memory, needs m >= p microbatches) or zbv (two chunks per "
        "rank in a V, needs m >= 2p); --num-layers-per-virtual-pipeline-stage with 1f1b selects "
        "the interleaved 1F1B schedule",
        choices=("gpipe", "1f1b", "zb-h1", "zbv"))
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
        "context parallelism (the sequence split over ranks inside attention): ptdp has none, "
        "so only 1")
    device: str = flag("auto", "--device", "auto | cpu | cuda (auto: cuda with NCCL when there are "
                       "enough GPUs, else cpu with gloo)", choices=("auto", "cpu", "cuda"))
    distributed_timeout_minutes: float = flag(
        10.0, "--distributed-timeout-minutes",
        "a collective that waits longer than this fails instead of hanging")

    @property
    def dp(self) -> int:
        return self.data_parallel_size or 1

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.dp

    @property
    def schedule_kind(self) -> str:
        if self.pipeline_schedule in ("zb-h1", "zbv"):
            return self.pipeline_schedule
        if self.num_layers_per_virtual_pipeline_stage is not None:
            return "interleaved"
        return self.pipeline_schedule

    @property
    def layer_split(self) -> LayerSplit:
        """How the layers are split over the stages (ptdp.parallel.pipeline.split)."""
        return LayerSplit(self.decoder_first_pipeline_num_layers,
                          self.decoder_last_pipeline_num_layers,
                          self.account_for_embedding_in_pipeline_split,
                          self.account_for_loss_in_pipeline_split)

    def virtual_stages(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (v); 1 without interleaving, 2 under zbv."""
        if self.pipeline_schedule in ("zb-h1", "zbv"):
            return 2 if self.pipeline_schedule == "zbv" else 1
        k = self.num_layers_per_virtual_pipeline_stage
        if k is None:
            return 1
        return num_layers // (self.pipeline_model_parallel_size * k)


@dataclass
class TrainConfig:
    micro_batch_size: int = flag(2, "--micro-batch-size", "sequences per microbatch b")
    global_batch_size: int | None = flag(
        None, "--global-batch-size", "sequences per iteration B (default b·d: one microbatch)")
    train_iters: int | None = flag(None, "--train-iters",
                                   "optimizer steps (default 20, unless --train-samples is given)")
    train_samples: int | None = flag(
        None, "--train-samples",
        "the run's length in samples instead of --train-iters: as many iterations as Megatron-LM "
        "counts for it (whole global batches; with --rampup-batch-size the ramp's iterations, "
        "then whole batches of --global-batch-size)")
    rampup_batch_size: list[int] | None = flag(
        None, "--rampup-batch-size",
        "START INCREMENT SAMPLES: the global batch starts at START and grows by INCREMENT, evenly "
        "over the first SAMPLES samples, to --global-batch-size (with --train-samples as "
        "Megatron-LM; with --train-iters too, which Megatron-LM refuses)",
        metavar=("START", "INCREMENT", "SAMPLES"), nargs=3)
    lr: float = flag(1e-3, "--lr", "peak learning rate")
    min_lr: float = flag(0.0, "--min-lr", "learning rate at the end of the decay")
    lr_warmup_iters: int = flag(0, "--lr-warmup-iters", "iterations of linear warm-up to --lr")
    lr_warmup_samples: int = flag(0, "--lr-warmup-samples",
                                  "with --train-samples: samples of linear warm-up to --lr")
    lr_warmup_fraction: float | None = flag(
        None, "--lr-warmup-fraction",
        "warm up over this fraction of the decay length instead of --lr-warmup-iters/-samples")
    lr_decay_iters: int | None = flag(None, "--lr-decay-iters",
                                      "iteration at which the decay reaches --min-lr (default "
                                      "--train-iters)")
    lr_decay_samples: int | None = flag(
        None, "--lr-decay-samples",
        "with --train-samples: samples after which the decay reaches --min-lr (default "
        "--train-samples)")
    lr_decay_style: str = flag(
        "linear", "--lr-decay-style",
        "decay after the warm-up (Megatron-LM's schedules): constant, linear, cosine, "
        "inverse-square-root (--lr·sqrt(warm-up/steps), not below --min-lr) or WSD (warm-up, "
        "stable, then --lr-wsd-decay-iters/-samples of annealing at the end of the decay)",
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_wsd_decay_style: str = flag(
        "exponential", "--lr-wsd-decay-style", "with --lr-decay-style WSD: the annealing's shape",
        choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: int | None = flag(
        None, "--lr-wsd-decay-iters",
        "with --lr-decay-style WSD: iterations of annealing, the last of the decay length")
    lr_wsd_decay_samples: int | None = flag(
        None, "--lr-wsd-decay-samples",
        "with --lr-decay-style WSD and --train-samples: samples of annealing, the last of the "
        "decay length")
    weight_decay: float = flag(0.01, "--weight-decay", "AdamW weight decay")
    adam_beta1: float = flag(0.9, "--adam-beta1", "AdamW beta1")
    adam_beta2: float = flag(0.999, "--adam-beta2", "AdamW beta2")
    adam_eps: float = flag(1e-8, "--adam-eps", "AdamW epsilon")
    clip_grad: float = flag(1.0, "--clip-grad", "clip the global gradient norm to this (0: off)")
    use_distributed_optimizer: bool = flag(
        False, "--use-distributed-optimizer",
        "shard fp32 main weights and Adam states over the data-parallel ranks (ZeRO stage 1)")
    ddp_bucket_size: int = flag(
        40_000_000, "--ddp-bucket-size",
        "elements per gradient bucket; a bucket's data-parallel reduction starts as soon as its "
        "gradients are final, overlapping the rest of the backward")
    bf16: bool = flag(False, "--bf16", "bf16 weights and activations, fp32 main weights and "
                      "gradient accumulation")
    fp16: bool = flag(False, "--fp16", "fp16 weights and activations with dynamic loss scaling, "
                      "fp32 main weights and gradient accumulation")
    loss_scale: float | None = flag(None, "--loss-scale", "fp16: a fixed loss scale instead of "
                                    "dynamic scaling")
    initial_loss_scale: float = flag(2.0 ** 32, "--initial-loss-scale",
                                     "fp16: initial dynamic loss scale")
    min_loss_scale: float = flag(1.0, "--min-loss-scale", "fp16: the dynamic scale never falls "
                                 "below this")
    loss_scale_window: int = flag(1000, "--loss-scale-window",
                                  "fp16: double the scale after this many steps without overflow")
    hysteresis: int = flag(2, "--hysteresis", "fp16: overflows tolerated before the scale halves")
    decoupled_lr: float | None = flag(
        None, "--decoupled-lr",
        "a peak learning rate of their own for the word embedding and the output layer (one "
        "matrix when tied; the same warm-up and decay; default --lr)")
    decoupled_min_lr: float | None = flag(
        None, "--decoupled-min-lr",
        "with --decoupled-lr: their rate at the end of the decay (default --min-lr)")
    calculate_per_token_loss: bool = flag(
        False, "--calculate-per-token-loss",
        "average the loss over every counted token of the global batch, not per microbatch "
        "(they differ when --eod-mask-loss leaves a different number of tokens in each)")
    grad_reduce_in_bf16: bool = flag(
        False, "--grad-reduce-in-bf16",
        "with --bf16: reduce gradients over the data-parallel ranks in bf16 (half the bytes, "
        "less precise; accumulation stays fp32)")
    seed: int = flag(1234, "--seed", "seed of initialisation, data order and dropout")
    log_interval: int = flag(1, "--log-interval", "print a line every N iterations")
    log_throughput: bool = flag(
        False, "--log-throughput",
        "ptdp's log line always carries the model TFLOP/s per device; with --tensorboard-dir this "
        "also writes it under Megatron-LM's TensorBoard tag 'throughput'")
    tensorboard_log_interval: int = flag(
        1, "--tensorboard-log-interval",
        "with --tensorboard-dir: write the training scalars every N iterations (validation ones "
        "at every evaluation)")
    log_validation_ppl_to_tensorboard: bool = flag(
        False, "--log-validation-ppl-to-tensorboard",
        "with --tensorboard-dir: also write the validation perplexity, exp(validation loss), "
        "under Megatron-LM's tags 'lm loss validation ppl' (and '... vs samples'); ptdp's "
        "valid/perplexity is always written")
    log_timers_to_tensorboard: bool = flag(
        False, "--log-timers-to-tensorboard",
        "with --tensorboard-dir: also write each iteration's timers in seconds under Megatron-LM's "
        "tags (iteration-time, forward-backward-time, forward-compute-time, backward-compute-time, "
        "all-grads-sync-time, optimizer-time, and ptdp's pipeline-transfer-time); ptdp's time/*_ms "
        "are always written")
    manual_gc: bool = flag(
        False, "--manual-gc",
        "turn Python's automatic garbage collection off and collect at fixed points instead "
        "(before and after each evaluation, and every --manual-gc-interval iterations), so that "
        "no rank pauses while the others wait")
    manual_gc_interval: int = flag(
        0, "--manual-gc-interval", "with --manual-gc: collect every N iterations (0: never)")
    manual_gc_eval: bool = flag(
        True, "--no-manual-gc-eval",
        "with --manual-gc: do not collect around evaluations", negate=True)
    empty_unused_memory_level: int = flag(
        0, "--empty-unused-memory-level",
        "on CUDA, return cached unused device memory to the driver: 1 after each iteration, 2 also "
        "after each evaluation (0: never; costs time, helps a fragmented allocator)",
        choices=(0, 1, 2))
    profile: bool = flag(
        False, "--profile",
        "profile iterations --profile-step-start to --profile-step-end on --profile-ranks: with "
        "--use-pytorch-profiler a trace per rank under --tensorboard-dir, else (CUDA) a capture "
        "range for nsys --capture-range=cudaProfilerApi")
    use_pytorch_profiler: bool = flag(
        False, "--use-pytorch-profiler", "with --profile: record with torch.profiler")
    profile_step_start: int = flag(10, "--profile-step-start",
                                   "with --profile: profiling starts once this many iterations are "
                                   "done (the log's iteration N+1 is the first profiled)")
    profile_step_end: int = flag(12, "--profile-step-end",
                                 "with --profile: profiling stops once this many iterations are "
                                 "done (the last profiled)")
    profile_ranks: list[int] | None = flag(None, "--profile-ranks",
                                           "with --profile: the ranks profiled (default 0)",
                                           metavar="RANK")
    metrics_file: str | None = flag(None, "--metrics-file", "write one JSON line per iteration here",
                                    metavar="PATH")
    timeline: str | None = flag(None, "--timeline",
                                "draw the measured pipeline timeline of the last iteration to this "
                                "PNG file", metavar="PATH")
    save: str | None = flag(None, "--save", "write checkpoints to this directory", metavar="DIR")
    save_interval: int | None = flag(None, "--save-interval",
                                     "save every N iterations (and always at the end with --save)")
    load: str | None = flag(None, "--load",
                            "resume from the checkpoint in this directory (its `latest`, or one "
                            "iter_* directory), under any layout", metavar="DIR")
    finetune: bool = flag(
        False, "--finetune",
        "with --load: take only the weights, and start at iteration 0 with a fresh optimizer, "
        "learning-rate schedule, data order and random state (--seed's); its checkpoints are a "
        "run of their own, so --save must be another directory than the loaded checkpoint's")
    load_optim: bool = flag(
        True, "--no-load-optim",
        "with --load: do not load the optimizer state: Adam's moments start at zero (the fp32 "
        "main weights are the loaded weights) and, as in Megatron-LM, which keeps the "
        "learning-rate scheduler's state with the optimizer's, the learning-rate schedule starts "
        "again from its beginning (warm-up included) at the loaded iteration; the iteration and "
        "the data position resume", negate=True)
    load_rng: bool = flag(
        True, "--no-load-rng",
        "with --load: do not restore the random-number generators' states: dropout draws from "
        "--seed's streams as at the start of a fresh run", negate=True)
    use_checkpoint_args: bool = flag(
        False, "--use-checkpoint-args",
        "with --load: take the model's settings (layers, sizes, heads, query groups, vocabulary, "
        "positions, normalization and the other architecture options; sequence length and dropout "
        "where not given) from the checkpoint; an architecture flag given too must agree with it "
        "(the layout t, p, d is never taken)")
    keep_last: int | None = flag(None, "--keep-last",
                                  "keep only the newest N checkpoints of this run's lineage (the "
                                  "checkpoints it was resumed from and wrote); others are moved "
                                  "to SAVE/abandoned/, never deleted")
    eval_interval: int = flag(0, "--eval-interval",
                              "evaluate on the validation set every N iterations and after the "
                              "last (0: never)")
    eval_iters: int = flag(10, "--eval-iters", "global batches of validation samples per evaluation")
    tensorboard_dir: str | None = flag(None, "--tensorboard-dir", "write TensorBoard logs here",
                                       metavar="DIR")
    peak_tflops: float | None = flag(None, "--peak-tflops",
                                     "peak TFLOP/s of one device, for the %% of peak (default: by "
                                     "GPU model; none on CPU)")
    loss_curve: str | None = flag(None, "--loss-curve",
                                  "draw the training and validation loss to this PNG at the end",
                                  metavar="PATH")
    exit_signal_handler: bool = flag(
        True, "--exit-signal-handler",
        "on SIGTERM, SIGHUP, SIGUSR1 or --exit-signal, to any rank or to the launcher, every rank "
        "stops at the next iteration boundary, saves a checkpoint if --save is set and exits 0; a "
        "second signal stops at once (on by default; --no-exit-signal-handler: signals end the "
        "job at once)", off_flag="--no-exit-signal-handler")
    exit_signal: str = flag("SIGTERM", "--exit-signal",
                            "the scheduler's warning signal, handled like SIGTERM (e.g. SIGUSR2 "
                            "for SLURM's --signal=USR2@120)", metavar="NAME")
    exit_interval: int | None = flag(None, "--exit-interval",
                                     "stop (saving, with --save) after an iteration that is a "
                                     "multiple of N")
    exit_duration_in_mins: float | None = flag(
        None, "--exit-duration-in-mins",
        "stop (saving, with --save) before this many minutes of wall time have passed, allowing "
        "for one more iteration and the save")
    check_for_nan_in_loss_and_grad: bool = flag(
        True, "--no-check-for-nan-in-loss-and-grad",
        "run on through a non-finite loss or gradient norm in fp32/bf16 (by default the run stops "
        "with an error, saving nothing)", negate=True)
    max_consecutive_skipped_iterations: int = flag(
        100, "--max-consecutive-skipped-iterations",
        "fp16: stop with an error, saving nothing, after this many steps in a row skipped for an "
        "inf/nan gradient (the loss scale cannot recover; 0: never stop)")

    def __post_init__(self) -> None:
        # --train-iters defaults to 20 only when --train-samples does not set
        # the length: exactly one of the two is given (see validate).
        if self.train_iters is None and self.train_samples is None:
            self.train_iters = 20

    def batch_size(self, data_parallel_size: int) -> int:
        """B: --global-batch-size, after any ramp-up (ptdp.train.batches)."""
        return self.global_batch_size or self.micro_batch_size * data_parallel_size

    def num_microbatches(self, data_parallel_size: int) -> int:
        """m = B / (b·d): microbatches per pipeline per iteration."""
        return self.batch_size(data_parallel_size) // (self.micro_batch_size * data_parallel_size)


@dataclass
class DataConfig:
    """Where tokens come from. With neither --data-path nor --mock-data the
    model trains on the shipped demo corpus (Shakespeare)."""
    mock_data: bool = flag(False, "--mock-data", "train on generated, learnable sequences")
    data_path: list[str] | None = flag(
        None, "--data-path",
        "indexed dataset prefix(es) (PREFIX.bin/.idx, as `ptdp preprocess` or Megatron-LM write "
        "them), optionally weighted for blending: A, or 0.7 A 0.3 B", metavar="PATH")
    split: str = flag("949,50,1", "--split",
                      "train,valid,test proportions, taken as contiguous ranges of documents")
    tokenizer_type: str = flag(
        "GPT2BPETokenizer", "--tokenizer-type",
        "tokenizer; NullTokenizer (Megatron-LM's) is for --data-path files that are token ids "
        "already and needs --vocab-size N: the data's ids are 0..N-1, N is the end-of-document "
        "id, so the model's vocabulary is N + 1 (then padded); with --load and no tokenizer "
        "flags, the tokenizer the checkpoint carries",
        choices=("GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelTokenizer", "NullTokenizer"))
    vocab_file: str | None = flag(None, "--vocab-file", "GPT-2 style vocab.json (with --merge-file; "
                                  "default: GPT-2's own ranks, shipped)", metavar="PATH")
    merge_file: str | None = flag(None, "--merge-file", "GPT-2 style merges.txt", metavar="PATH")
    tokenizer_model: str | None = flag(None, "--tokenizer-model",
                                       "tokenizer.json for HuggingFaceTokenizer", metavar="PATH")
    data_cache_path: str | None = flag(
        None, "--data-cache-path",
        "directory for dataset indices and the tokenized demo corpus (default: index-cache/ "
        "next to the data; the demo corpus under $PTDP_CACHE or the user cache)", metavar="DIR")
    num_workers: int = flag(
        0, "--num-workers",
        "background processes that read and assemble the training batches ahead of the step "
        "(0: in the training process; Megatron-LM's default is 2)")
    mmap_bin_files: bool = flag(
        True, "--no-mmap-bin-files",
        "read each sample's tokens from the --data-path .bin files with file reads instead of "
        "memory-mapping them (for file systems where mapping large files performs badly)",
        negate=True)
    eod_mask_loss: bool = flag(False, "--eod-mask-loss",
                               "leave positions whose input is the end-of-document token out of the loss")

    @property
    def uses_demo_corpus(self) -> bool:
        return not self.mock_data and not self.data_path


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        # --num-virtual-stages-per-pipeline-rank v is L/(p·v) layers per chunk,
        # what every consumer reads; v = 1 is one chunk per rank (no
        # interleaving). validate reports values that do not divide.
        v, k = self.parallel.num_virtual_stages_per_pipeline_rank, \
            self.parallel.num_layers_per_virtual_pipeline_stage
        layers, p = self.model.num_layers, self.parallel.pipeline_model_parallel_size
        if k is None and all(_is_count(x, 1) for x in (v, layers, p)) and v > 1 \
                and layers % (p * v) == 0:
            self.parallel.num_layers_per_virtual_pipeline_stage = layers // (p * v)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, sections: dict[str, dict[str, Any]]) -> "Config":
        return cls(**{name: section_type(**sections.get(name, {}))
                      for name, section_type in SECTION_TYPES.items()})


SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig}


def flag_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section, field) for every field that is a flag, in declaration order."""
    return [(section, f) for section, cls in SECTION_TYPES.items()
            for f in dataclasses.fields(cls) if "flag" in f.metadata]


def flag_of(section: str, name: str) -> str:
    for f in dataclasses.fields(SECTION_TYPES[section]):
        if f.name == name:
            return f.metadata["flag"]
    raise KeyError(f"{section}.{name}")


class ConfigError(ValueError):
    """One or more invalid settings; the message lists each with a fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _nearest_multiple(value: int, multiple: int) -> int:
    """The multiple of `multiple` closest to `value` (at least `multiple`)."""
    return max(multiple, round(value / multiple) * multiple)


def validate(config: Config, world_size: int | None = None) -> None:
    """Check every constraint; raise ConfigError listing all problems.

    `world_size` is the number of processes the job actually has (under
    torchrun or SLURM); for a local launch it is None and t·p·d processes will
    be started.
    """
    m, par, tr = config.model, config.parallel, config.train
    problems: list[str] = []

    def positive(section: str, name: str, value: Any, allow_none: bool = False) -> bool:
        if value is None and allow_none:
            return True
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{flag_of(section, name)}={value!r} must be a positive integer")
            return False
        return True

    ok = all([
        positive("model", "num_layers", m.num_layers),
        positive("model", "hidden_size", m.hidden_size),
        positive("model", "num_attention_heads", m.num_attention_heads),
        positive("model", "ffn_hidden_size", m.ffn_hidden_size, allow_none=True),
        positive("model", "seq_length", m.seq_length),
        positive("model", "max_position_embeddings", m.max_position_embeddings, allow_none=True),
        positive("model", "vocab_size", m.vocab_size),
        positive("model", "num_query_groups", m.num_query_groups, allow_none=True),
        positive("model", "make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        positive("parallel", "tensor_model_parallel_size", par.tensor_model_parallel_size),
        positive("parallel", "pipeline_model_parallel_size", par.pipeline_model_parallel_size),
        positive("parallel", "data_parallel_size", par.data_parallel_size, allow_none=True),
        positive("parallel", "num_layers_per_virtual_pipeline_stage",
                 par.num_layers_per_virtual_pipeline_stage, allow_none=True),
        positive("train", "micro_batch_size", tr.micro_batch_size),
        positive("train", "global_batch_size", tr.global_batch_size, allow_none=True),
        positive("train", "train_iters", tr.train_iters, allow_none=True),
        positive("train", "train_samples", tr.train_samples, allow_none=True),
        positive("train", "log_interval", tr.log_interval),
    ])
    # Every float setting must be a finite number (argparse's float() and
    # YAML both read nan and inf). Each range check below looks only at the
    # settings that pass, so a nan is reported once, as a nan.
    problems.extend(_float_problems(config))

    def finite(*values: Any) -> bool:
        return all(value is None or _is_finite_number(value) for value in values)

    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(m, name)
        if finite(p) and not 0.0 <= p < 1.0:
            problems.append(f"{flag_of('model', name)}={p} must be in [0, 1)")
    for section, f in flag_fields():
        choices = f.metadata.get("choices")
        value = getattr(getattr(config, section), f.name)
        if choices and value not in choices and not (value is None and "None" in f.type):
            problems.append(f"{f.metadata['flag']}={value!r} is not one of {', '.join(map(str, choices))}")
    if finite(par.distributed_timeout_minutes) and par.distributed_timeout_minutes <= 0:
        problems.append(f"--distributed-timeout-minutes={par.distributed_timeout_minutes} must be > 0")
    if finite(m.init_method_std) and m.init_method_std <= 0:
        problems.append(f"--init-method-std={m.init_method_std} must be > 0 (weights all equal at "
                        f"initialisation cannot learn different features; GPT-2 uses 0.02)")
    if finite(m.layernorm_epsilon) and m.layernorm_epsilon <= 0:
        problems.append(f"--layernorm-epsilon={m.layernorm_epsilon} must be > 0 (it keeps LayerNorm "
                        f"finite on a constant input; GPT-2 uses 1e-05)")
    problems.extend(_architecture_problems(m))
    if tr.bf16 and tr.fp16:
        problems.append("--bf16 and --fp16 exclude each other: choose one")
    if finite(tr.loss_scale) and tr.loss_scale is not None and tr.loss_scale <= 0:
        problems.append(f"--loss-scale={tr.loss_scale} must be > 0")
    if finite(tr.min_loss_scale, tr.initial_loss_scale) and (
            tr.min_loss_scale <= 0 or tr.initial_loss_scale < tr.min_loss_scale):
        problems.append(f"--initial-loss-scale {tr.initial_loss_scale} and --min-loss-scale "
                        f"{tr.min_loss_scale} must satisfy 0 < min <= initial")
    for name in ("loss_scale_window", "hysteresis", "ddp_bucket_size"):
        if not isinstance(getattr(tr, name), int) or getattr(tr, name) < 1:
            problems.append(f"{flag_of('train', name)}={getattr(tr, name)!r} must be a positive integer")
    # lr 0 is allowed: a run that must not change the weights (checking a setup).
    if finite(tr.lr, tr.min_lr) and (tr.lr < 0 or tr.min_lr < 0 or tr.min_lr > tr.lr):
        problems.append(f"--min-lr {tr.min_lr} and --lr {tr.lr} must satisfy 0 <= min-lr <= lr")
    if tr.lr_warmup_iters < 0:
        problems.append(f"--lr-warmup-iters={tr.lr_warmup_iters} must be >= 0")
    if tr.lr_decay_iters is not None and tr.lr_decay_iters <= tr.lr_warmup_iters:
        problems.append(f"--lr-decay-iters {tr.lr_decay_iters} must exceed --lr-warmup-iters "
                        f"{tr.lr_warmup_iters}")
    problems.extend(_run_length_problems(tr))
    if m.recompute_activations and m.recompute_granularity not in (None, "selective"):
        problems.append(f"--recompute-activations is Megatron-LM's alias of --recompute-granularity "
                        f"selective, so it contradicts --recompute-granularity "
                        f"{m.recompute_granularity}: give one of them")
    if not isinstance(m.recompute_num_layers, int) or m.recompute_num_layers < 1:
        problems.append(f"--recompute-num-layers={m.recompute_num_layers!r} must be a positive "
                        f"integer")
    if finite(tr.clip_grad) and tr.clip_grad < 0:
        problems.append(f"--clip-grad={tr.clip_grad} must be >= 0 (0 turns clipping off)")
    for name, default in (("adam_beta1", 0.9), ("adam_beta2", 0.999)):
        beta = getattr(tr, name)
        if finite(beta) and not 0.0 <= beta < 1.0:
            problems.append(f"{flag_of('train', name)}={beta} must be in [0, 1) (a moment's decay "
                            f"rate; the default is {default})")
    if finite(tr.adam_eps) and tr.adam_eps <= 0:
        problems.append(f"--adam-eps={tr.adam_eps} must be > 0 (it keeps Adam's update finite where "
                        f"the second moment is 0; the default is 1e-08)")
    if finite(tr.weight_decay) and tr.weight_decay < 0:
        problems.append(f"--weight-decay={tr.weight_decay} must be >= 0 (0 turns weight decay off)")
    problems.extend(_stopping_problems(tr))
    problems.extend(_megatron_shape_problems(config))
    problems.extend(_resume_control_problems(tr))
    problems.extend(_loss_and_rate_problems(config))
    problems.extend(_logging_problems(tr))
    problems.extend(_data_loading_problems(config.data))
    if not ok:  # the structural checks below would only repeat these problems
        raise ConfigError(problems)

    t, p, h, a, l, k = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                        m.hidden_size, m.num_attention_heads, m.num_layers,
                        par.num_layers_per_virtual_pipeline_stage)
    schedule = par.pipeline_schedule
    interleaved = k is not None and schedule in ("gpipe", "1f1b")

    # World size and the data-parallel size. Later checks use the d the job
    # will really have, so every problem shows up in this one report.
    if world_size is not None:
        if world_size % (t * p):
            problems.append(
                f"the job has {plural(world_size, 'process')}, not a multiple of --tensor-model-parallel-size "
                f"{t} × --pipeline-model-parallel-size {p} = {t * p}: choose t and p with t·p in "
                f"{_divisors(world_size)}")
            d = par.dp
        else:
            d = world_size // (t * p)
            if par.data_parallel_size is not None and par.data_parallel_size != d:
                problems.append(
                    f"the job has {plural(world_size, 'process')} but --tensor-model-parallel-size {t} × "
                    f"--pipeline-model-parallel-size {p} × --data-parallel-size "
                    f"{par.data_parallel_size} = {t * p * par.data_parallel_size}: use "
                    f"--data-parallel-size {d} or leave it out")
    else:
        d = par.dp

    def tp_fits_world(tp: int) -> bool:
        return world_size is None or world_size % (tp * p) == 0

    def heads_ok(heads: int) -> bool:
        return h % heads == 0 and heads % t == 0

    def nearest(candidates: list[int], target: int, count: int = 6) -> list[int]:
        return sorted(sorted(candidates, key=lambda c: (abs(c - target), c))[:count])

    # Attention heads, hidden size, MLP size.
    if h % a or a % t:
        head_options = nearest([x for x in range(t, 4 * a + t, t) if heads_ok(x)], a)
        head_hint = (f"--num-attention-heads in {head_options}" if head_options else
                     f"--hidden-size {_nearest_multiple(h, math.lcm(a, t))}")
    if h % a:
        problems.append(
            f"--hidden-size {h} is not divisible by --num-attention-heads {a}: use --hidden-size "
            f"{_nearest_multiple(h, a)} or {head_hint}")
    if a % t:
        tp_options = [x for x in _divisors(a) if tp_fits_world(x) and m.ffn_size % x == 0]
        problems.append(
            f"--num-attention-heads {a} is not divisible by --tensor-model-parallel-size {t}: use "
            + (f"--tensor-model-parallel-size in {tp_options} or " if tp_options else "") + head_hint)
    g = m.query_groups
    # (heads not divisible by the groups or by t: reported above)
    if g != a and not (a % g or a % t) and g % t:
        tp_options = [x for x in _divisors(g) if tp_fits_world(x) and m.ffn_size % x == 0]
        group_options = [x for x in _divisors(a) if x % t == 0]
        problems.append(
            f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size {t} (each "
            f"tensor rank holds whole key/value groups and the query heads that use them): use "
            f"--tensor-model-parallel-size in {tp_options}"
            + (f" or --num-query-groups in {group_options}" if group_options else ""))
    if m.ffn_size % t:
        problems.append(
            f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {t}: "
            f"use --ffn-hidden-size {_nearest_multiple(m.ffn_size, t)}")
    if par.sequence_parallel and t == 1:
        problems.append("--sequence-parallel splits the sequence over the tensor-parallel ranks and "
                        "needs --tensor-model-parallel-size > 1: drop --sequence-parallel or raise t")
    elif par.sequence_parallel and m.seq_length % t:
        tp_options = [x for x in _divisors(m.seq_length)
                      if x > 1 and m.query_groups % x == 0 and tp_fits_world(x)][:6]
        problems.append(
            f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
            f"--tensor-model-parallel-size {t} (each tensor rank holds s/t positions): use "
            f"--seq-length {_nearest_multiple(m.seq_length, t)}"
            + (f" or --tensor-model-parallel-size in {tp_options}" if tp_options else ""))
    if m.seq_length > m.max_positions:
        problems.append(
            f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_positions}: "
            f"use --max-position-embeddings {m.seq_length} or a shorter --seq-length")

    # Layers over pipeline stages and model chunks (k layers per chunk).
    chunk = k if interleaved else 1
    if schedule == "zb-h1" and k is not None:
        problems.append(
            f"--pipeline-schedule zb-h1 has one model chunk per rank, so "
            f"--num-layers-per-virtual-pipeline-stage {k} does not apply: drop it, or use "
            f"--pipeline-schedule zbv (two chunks per rank in a V)")
    split = par.layer_split
    if not split.even and interleaved:
        problems.append(
            "an uneven split (--decoder-first/last-pipeline-num-layers, --account-for-embedding/"
            "loss-in-pipeline-split) is not supported with the interleaved schedule "
            "(--num-layers-per-virtual-pipeline-stage fixes every chunk's size): drop one of them, "
            "or use --pipeline-schedule 1f1b, zb-h1 or zbv")
    elif not split.even:
        if k is not None:
            problems.append(
                f"--num-layers-per-virtual-pipeline-stage {k} fixes every chunk's size, which an "
                f"uneven split changes: drop it")
        if schedule == "zbv" and p < 2:
            problems.extend(_zbv_layer_problems(l, p, k))
        else:
            problems.extend(split_problems(l, p, 2 if schedule == "zbv" else 1, schedule, split))
    elif schedule == "zbv":
        problems.extend(_zbv_layer_problems(l, p, k))
    elif interleaved and p < 2:
        stage_options = [x for x in _divisors(l) if x >= 2 and (l // x) % chunk == 0][:6]
        problems.append(
            f"--num-layers-per-virtual-pipeline-stage {k} needs --pipeline-model-parallel-size "
            f">= 2 (interleaving splits each pipeline rank's layers into chunks): remove it"
            + (f" or use --pipeline-model-parallel-size in {stage_options}" if stage_options else ""))
    elif l % (p * chunk):
        stage_options = [x for x in _divisors(l) if (l // x) % chunk == 0 and x >= (2 if interleaved else 1)]
        if l % p:
            problems.append(
                f"--num-layers {l} is not divisible by --pipeline-model-parallel-size {p}: use "
                + (f"--pipeline-model-parallel-size in {stage_options} or " if stage_options else "")
                + f"--num-layers {_nearest_multiple(l, p * chunk)} (layers are never dropped or "
                f"added silently)")
        else:
            problems.append(
                f"--num-layers {l} is not divisible by --pipeline-model-parallel-size {p} × "
                f"--num-layers-per-virtual-pipeline-stage {k} = {p * k}: use "
                f"--num-layers-per-virtual-pipeline-stage in {_divisors(l // p)} or --num-layers "
                f"{_nearest_multiple(l, p * k)}")

    if interleaved and par.pipeline_schedule == "gpipe":
        problems.append(
            "--pipeline-schedule gpipe cannot be combined with --num-layers-per-virtual-pipeline-"
            "stage (interleaving uses the interleaved 1F1B schedule): drop one of them")

    # Batch sizes. The interleaved schedule also needs m, the microbatches per
    # pipeline, to be a multiple of p.
    b, B = tr.micro_batch_size, tr.batch_size(d)
    group = p if interleaved and p >= 2 else 1
    fewest = {"zb-h1": p, "zbv": 2 * p}.get(schedule, 1)  # zero-bubble: m >= p or 2p
    if fewest > 1 and B % (b * d) == 0 and B // (b * d) < fewest:
        problems.append(
            f"--pipeline-schedule {schedule} needs at least {fewest} microbatches per iteration "
            f"({'p' if schedule == 'zb-h1' else '2p'} with --pipeline-model-parallel-size {p}), "
            f"not --global-batch-size {B} / (--micro-batch-size {b} × d {d}) = {B // (b * d)}: use "
            f"--global-batch-size {fewest * b * d} or more"
            + (" or --pipeline-schedule 1f1b" if schedule == "zb-h1" else
               " or --pipeline-schedule zb-h1 (needs p)" if B // (b * d) >= p else ""))

    if tr.rampup_batch_size is not None and tr.train_samples is not None:  # (else: refused above)
        problems.extend(_rampup_problems(tr.rampup_batch_size, B, b, d, group, fewest, schedule, p))
    if tr.train_samples is not None and tr.rampup_batch_size is None and tr.train_samples < B:
        problems.append(f"--train-samples {tr.train_samples} is less than one global batch "
                        f"(--global-batch-size {B}), so no iteration would run: use --train-samples "
                        f"{B} or more")

    def micro_ok(micro: int) -> bool:
        return B % (micro * d) == 0 and (B // (micro * d)) % group == 0

    if not micro_ok(b):
        micro_options = [x for x in _divisors(B) if micro_ok(x)]
        alternative = (f" or --micro-batch-size in {micro_options}" if micro_options else "")
        valid_batch = _nearest_multiple(B, b * d * group)
        if B % (b * d):
            problems.append(
                f"--global-batch-size {B} is not divisible by --micro-batch-size {b} × data-parallel "
                f"size {d} = {b * d}: use --global-batch-size {valid_batch}{alternative}")
        else:
            problems.append(
                f"the interleaved schedule needs the number of microbatches (--global-batch-size "
                f"{B} / (--micro-batch-size {b} × d {d}) = {B // (b * d)}) to be a multiple of "
                f"--pipeline-model-parallel-size {p}: use --global-batch-size {valid_batch}"
                f"{alternative}")

    if problems:
        raise ConfigError(problems)


# ---------------------------------------------------------------- helpers of validate

def _zbv_layer_problems(l: int, p: int, k: int | None) -> list[str]:
    """zbv: two chunks per rank in a V, so p >= 2 and 2p equal chunks of layers."""
    if p < 2:
        return [f"--pipeline-schedule zbv places two model chunks per rank in a V across the "
                f"pipeline, so it needs --pipeline-model-parallel-size >= 2, not {p}: use "
                f"--pipeline-schedule zb-h1 (one chunk per rank) or a larger p"]
    if l % (2 * p):
        options = [x for x in _divisors(l) if x >= 2 and l % (2 * x) == 0]
        return [f"--pipeline-schedule zbv splits --num-layers {l} into 2p = {2 * p} equal chunks "
                f"(two per rank): use --num-layers {_nearest_multiple(l, 2 * p)}"
                + (f" or --pipeline-model-parallel-size in {options}" if options else "")]
    if k is not None and k * 2 * p != l:
        return [f"--pipeline-schedule zbv has two chunks per rank, {l // (2 * p)} layers each with "
                f"--num-layers {l} and --pipeline-model-parallel-size {p}, so "
                f"--num-layers-per-virtual-pipeline-stage {k} disagrees: drop it or use "
                f"{l // (2 * p)}"]
    return []


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _run_length_problems(tr: TrainConfig) -> list[str]:
    """The run's length (--train-iters or --train-samples) and the settings
    that must count in its unit, as Megatron-LM mixes them: iteration-based
    runs take only --lr-*-iters, sample-based ones only --lr-*-samples;
    --lr-warmup-fraction replaces either warm-up. (Megatron-LM refuses
    --rampup-batch-size with --train-iters, though its own 175B example once
    combined them; ptdp runs it: the ramp counts samples, the run iterations.)"""
    problems = []
    for name, least in (("lr_warmup_samples", 0), ("lr_decay_samples", 1),
                        ("lr_wsd_decay_iters", 0), ("lr_wsd_decay_samples", 0)):
        value = getattr(tr, name)
        if value is not None and not _is_count(value, least):
            problems.append(f"{flag_of('train', name)}={value!r} must be an integer >= {least}")
    fraction = tr.lr_warmup_fraction
    if _is_finite_number(fraction) and not 0.0 <= fraction < 1.0:
        problems.append(f"--lr-warmup-fraction={fraction} must be in [0, 1) (a fraction of the "
                        f"decay length, which the warm-up must not reach)")
    samples = tr.train_samples is not None
    if samples and tr.train_iters is not None:
        return problems + ["--train-iters and --train-samples both set the run's length: give one "
                           "of them"]
    if not samples and tr.train_iters is None:
        return problems + ["give the run's length: --train-iters N or --train-samples N"]
    unit, other = ("samples", "iters") if samples else ("iters", "samples")
    length = "--train-samples" if samples else "--train-iters"
    for name in ("lr_decay_" + other, "lr_warmup_" + other, "lr_wsd_decay_" + other):
        value = getattr(tr, name)
        unset = 0 if name.startswith("lr_warmup") else None  # the default: not given
        if value is not None and value != unset:
            mine = flag_of("train", name.replace(other, unit))
            problems.append(f"{flag_of('train', name)} counts {other.replace('iters', 'iterations')}, "
                            f"but the run's length is given in {unit.replace('iters', 'iterations')} "
                            f"({length}): use {mine}, or give the length as "
                            f"{'--train-iters' if samples else '--train-samples'}")
    warmup_name = "lr_warmup_" + unit
    if fraction is not None and getattr(tr, warmup_name) not in (0, None):
        problems.append(f"--lr-warmup-fraction and {flag_of('train', warmup_name)} both set the "
                        f"warm-up: give one of them")
    if samples and _is_count(tr.train_samples, 1) and _is_count(tr.lr_warmup_samples, 0) \
            and (tr.lr_decay_samples is None or _is_count(tr.lr_decay_samples, 1)):
        decay = tr.lr_decay_samples or tr.train_samples
        if decay <= tr.lr_warmup_samples:
            problems.append(f"--lr-warmup-samples {tr.lr_warmup_samples} must be less than the "
                            f"decay length, {decay} (--lr-decay-samples, default --train-samples)")
    # WSD: its annealing length, in the run's unit, and only with WSD.
    wsd_name = "lr_wsd_decay_" + unit
    wsd = getattr(tr, wsd_name)
    if tr.lr_decay_style == "WSD" and wsd is None:
        problems.append(f"--lr-decay-style WSD needs {flag_of('train', wsd_name)} N: the length of "
                        f"the annealing at the end of the decay")
    elif tr.lr_decay_style != "WSD" and wsd is not None:  # (the other unit's: reported above)
        problems.append(f"{flag_of('train', wsd_name)} only applies to --lr-decay-style WSD: add "
                        f"--lr-decay-style WSD or drop {flag_of('train', wsd_name)}")
    elif tr.lr_decay_style == "WSD" and _is_count(wsd, 0):
        decay = (tr.lr_decay_samples or tr.train_samples) if samples else \
            (tr.lr_decay_iters or tr.train_iters)
        if _is_count(decay, 1) and wsd > decay:
            decay_flags = ("--lr-decay-samples, default --train-samples" if samples
                           else "--lr-decay-iters, default --train-iters")
            problems.append(f"{flag_of('train', wsd_name)} {wsd} exceeds the decay length {decay} "
                            f"({decay_flags}), whose last part the annealing is: use at most "
                            f"{decay}")
    return problems


def _rampup_problems(ramp: Any, B: int, b: int, d: int, group: int, fewest: int, schedule: str,
                     p: int) -> list[str]:
    """--rampup-batch-size START INCREMENT SAMPLES against the batch settings:
    every global batch of the ramp whole microbatches on every data-parallel
    rank (Megatron-LM's rule), arriving at B exactly; and the pipeline
    schedule's own needs from the smallest batch on."""
    if not (isinstance(ramp, (list, tuple)) and len(ramp) == 3 and all(_is_count(x, 1) for x in ramp)):
        shown = " ".join(map(str, ramp)) if isinstance(ramp, (list, tuple)) else repr(ramp)
        return [f"--rampup-batch-size {shown} must be three positive integers: START INCREMENT "
                f"SAMPLES (e.g. 16 8 300000)"]
    start, increment, _ = ramp
    unit = b * d
    if start >= B:
        return [f"--rampup-batch-size starts at {start}, not below --global-batch-size {B}, so "
                f"there is nothing to ramp: use a START below {B} or drop --rampup-batch-size"]
    problems = []
    for name, value in (("START", start), ("INCREMENT", increment)):
        if value % unit:
            problems.append(
                f"--rampup-batch-size {name} {value} is not divisible by --micro-batch-size {b} × "
                f"data-parallel size {d} = {unit} (every global batch of the ramp must be whole "
                f"microbatches on every data-parallel rank): use {_nearest_multiple(value, unit)}")
    if (B - start) % increment:
        options = [x for x in _divisors(B - start) if x % unit == 0][:6]
        problems.append(
            f"--rampup-batch-size from {start} in steps of {increment} does not arrive at "
            f"--global-batch-size {B} ({B} - {start} = {B - start} is not a multiple of {increment})"
            + (f": use INCREMENT in {options}" if options else
               f": use a START with {B} - START a multiple of {unit}"))
    if problems:
        return problems
    first = start // unit
    if first < fewest:
        problems.append(
            f"--pipeline-schedule {schedule} needs at least {fewest} microbatches per iteration "
            f"({'p' if schedule == 'zb-h1' else '2p'} with --pipeline-model-parallel-size {p}), but "
            f"--rampup-batch-size starts at {start} / (--micro-batch-size {b} × d {d}) = {first}: "
            f"use START {fewest * unit} or more")
    if group > 1 and (first % group or (increment // unit) % group):
        problems.append(
            f"the interleaved schedule needs every iteration's microbatches to be a multiple of "
            f"--pipeline-model-parallel-size {p}, so --rampup-batch-size START {start} and "
            f"INCREMENT {increment} must be multiples of {p} × --micro-batch-size {b} × d {d} = "
            f"{group * unit}: use START {_nearest_multiple(start, group * unit)} and INCREMENT "
            f"{_nearest_multiple(increment, group * unit)}")
    return problems


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _architecture_problems(m: ModelConfig) -> list[str]:
    """The Llama-family options: each alone and against the shape."""
    problems = []
    if _is_finite_number(m.norm_epsilon) and m.norm_epsilon <= 0:
        problems.append(f"--norm-epsilon={m.norm_epsilon} must be > 0 (it keeps the normalization "
                        f"finite on a constant input; Llama uses 1e-05 or 1e-06)")
    default_epsilon = ModelConfig.layernorm_epsilon
    if (m.norm_epsilon is not None and m.layernorm_epsilon != default_epsilon
            and m.norm_epsilon != m.layernorm_epsilon):
        problems.append(f"--norm-epsilon {m.norm_epsilon} and --layernorm-epsilon "
                        f"{m.layernorm_epsilon} disagree (they are one setting): give one of them")
    if _is_finite_number(m.rotary_base) and m.rotary_base <= 0:
        problems.append(f"--rotary-base={m.rotary_base} must be > 0 (Llama 2 uses 10000, Llama 3 "
                        f"500000)")
    if m.rope and isinstance(m.hidden_size, int) and isinstance(m.num_attention_heads, int) \
            and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads == 0 \
            and m.head_dim % 2:
        problems.append(f"--position-embedding-type rope needs an even head dimension, but "
                        f"--hidden-size {m.hidden_size} / --num-attention-heads "
                        f"{m.num_attention_heads} = {m.head_dim}: choose heads that give an even "
                        f"quotient")
    groups = m.num_query_groups
    if groups is not None and (not isinstance(groups, int) or isinstance(groups, bool) or groups < 1):
        pass  # reported with the other positive integers
    elif groups is not None and not m.group_query_attention:
        problems.append(f"--num-query-groups {groups} is only used with --group-query-attention: "
                        f"add --group-query-attention or drop --num-query-groups")
    elif m.group_query_attention and groups is None:
        problems.append("--group-query-attention needs --num-query-groups G (the key/value heads; "
                        "G must divide --num-attention-heads)")
    elif groups is not None and isinstance(m.num_attention_heads, int) \
            and m.num_attention_heads % groups:
        heads = m.num_attention_heads
        problems.append(f"--num-query-groups {groups} does not divide --num-attention-heads {heads} "
                        f"(each key/value group serves the same number of query heads): use "
                        f"--num-query-groups in {_divisors(heads)}")
    if m.swiglu and m.ffn_hidden_size is None and isinstance(m.hidden_size, int) and m.ffn_size < 1:
        problems.append(f"--swiglu with --hidden-size {m.hidden_size} gives a default "
                        f"--ffn-hidden-size of 0 (4·h·2/3 rounded down to a multiple of 64): give "
                        f"--ffn-hidden-size, e.g. {max(1, round(8 * m.hidden_size / 3))}")
    return problems


def _float_problems(config: Config) -> list[str]:
    """A problem for each float setting that is not a finite number."""
    problems = []
    for section, f in flag_fields():
        if f.type.split("|")[0].strip() != "float":
            continue
        value = getattr(getattr(config, section), f.name)
        if (value is None and "None" in f.type) or _is_finite_number(value):
            continue
        what = "is not a finite number" if isinstance(value, float) else "is not a number"
        instead = (f"give a finite number or leave {f.metadata['flag']} out" if f.default is None
                   else f"give a finite number (the default is {f.default:g})")
        problems.append(f"{f.metadata['flag']}={value!r} {what}: {instead}")
    return problems


def _stopping_problems(tr: TrainConfig) -> list[str]:
    """--exit-interval, --exit-duration-in-mins, --max-consecutive-skipped-iterations, --exit-signal."""
    problems = []
    interval = tr.exit_interval
    if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool)
                                 or interval < 1):
        problems.append(f"--exit-interval={interval!r} must be a positive integer (or leave it out: "
                        f"no stop by iteration count)")
    minutes = tr.exit_duration_in_mins
    if _is_finite_number(minutes) and minutes <= 0:
        problems.append(f"--exit-duration-in-mins={minutes} must be > 0 (or leave it out: no time "
                        f"limit)")
    skipped = tr.max_consecutive_skipped_iterations
    if not isinstance(skipped, int) or isinstance(skipped, bool) or skipped < 0:
        problems.append(f"--max-consecutive-skipped-iterations={skipped!r} must be an integer >= 0 "
                        f"(0: never stop)")
    signal_problem = _exit_signal_problem(tr.exit_signal)
    if signal_problem:
        problems.append(signal_problem)
    return problems


# Signals a run cannot use as its graceful-exit signal, and why.
def signal_from_name(name: str):
    """SIGUSR2, USR2 or usr2 -> signal.SIGUSR2 (KeyError if this platform has none)."""
    import signal

    upper = name.strip().upper()
    return signal.Signals[upper if upper.startswith("SIG") else "SIG" + upper]


_UNUSABLE_EXIT_SIGNALS = {
    "SIGKILL": "no process can catch SIGKILL",
    "SIGSTOP": "no process can catch SIGSTOP",
    "SIGINT": "Ctrl-C (SIGINT) stops a run at once by design, without saving",
    "SIGCHLD": "SIGCHLD arrives whenever a child process ends, so every rank's exit would stop the run",
    "SIGSEGV": "SIGSEGV reports a crash of the process itself, not a request to stop",
    "SIGBUS": "SIGBUS reports a crash of the process itself, not a request to stop",
    "SIGFPE": "SIGFPE reports a crash of the process itself, not a request to stop",
    "SIGILL": "SIGILL reports a crash of the process itself, not a request to stop",
    "SIGABRT": "SIGABRT reports a crash of the process itself, not a request to stop",
}


def _exit_signal_problem(name: Any) -> str | None:
    """None if --exit-signal names a signal that this platform has and a run
    can handle (SIGUSR2, USR2 or usr2 alike), else what is wrong."""
    import difflib
    import signal

    advice = "use e.g. SIGUSR2 (SLURM: --signal=USR2@120) or SIGTERM"
    if not isinstance(name, str) or not name.strip():
        return f"--exit-signal={name!r} must name a signal: {advice}"
    try:
        canonical = signal_from_name(name).name  # aliases: SIGCLD is SIGCHLD, SIGIOT is SIGABRT
    except KeyError:
        upper = name.strip().upper()
        close = difflib.get_close_matches(upper if upper.startswith("SIG") else "SIG" + upper,
                                          list(signal.Signals.__members__), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        return f"--exit-signal={name!r} is not a signal of this platform{hint}: {advice}"
    if canonical in _UNUSABLE_EXIT_SIGNALS:
        return (f"--exit-signal={name!r} cannot be the exit signal: "
                f"{_UNUSABLE_EXIT_SIGNALS[canonical]}; {advice}")
    return None


def _megatron_shape_problems(config: Config) -> list[str]:
    """Megatron-LM's flags whose other values ptdp cannot honour, and the
    chunk count --num-virtual-stages-per-pipeline-rank."""
    m, par = config.model, config.parallel
    problems = []
    if m.kv_channels is not None and (not _is_count(m.kv_channels, 1) or (
            _is_count(m.num_attention_heads, 1) and m.kv_channels != m.head_dim)):
        problems.append(
            f"--kv-channels {m.kv_channels}: ptdp's attention heads are --hidden-size / "
            f"--num-attention-heads = {m.hidden_size} / {m.num_attention_heads} = {m.head_dim} "
            f"wide: use --kv-channels {m.head_dim} or leave it out")
    if _is_finite_number(m.rotary_percent) and m.rotary_percent != 1.0:  # (else: _float_problems)
        problems.append(f"--rotary-percent {m.rotary_percent}: ptdp rotates the whole of each head "
                        f"(partial rotary embeddings are not implemented): use 1.0 or leave it out")
    if par.context_parallel_size != 1:
        problems.append(
            f"--context-parallel-size {par.context_parallel_size}: ptdp has no context "
            f"parallelism; to split long sequences over the tensor-parallel ranks use "
            f"--sequence-parallel, or add data parallelism: use --context-parallel-size 1")
    if m.activations_checkpoint_method is not None and (
            m.recompute_granularity != "full" or m.recompute_method != m.activations_checkpoint_method):
        problems.append(
            f"--activations-checkpoint-method {m.activations_checkpoint_method} is older Megatron-LM's "
            f"name for --recompute-granularity full --recompute-method "
            f"{m.activations_checkpoint_method}, which --recompute-granularity/--recompute-method "
            f"contradict: give one of them")
    v, k = par.num_virtual_stages_per_pipeline_rank, par.num_layers_per_virtual_pipeline_stage
    layers, p = m.num_layers, par.pipeline_model_parallel_size
    if v is not None:
        if not _is_count(v, 1):
            problems.append(f"--num-virtual-stages-per-pipeline-rank={v!r} must be a positive integer")
        elif _is_count(layers, 1) and _is_count(p, 1):
            if layers % (p * v):
                options = [x for x in _divisors(layers // p) if layers % p == 0]
                problems.append(
                    f"--num-virtual-stages-per-pipeline-rank {v}: --num-layers {layers} is not "
                    f"divisible by --pipeline-model-parallel-size {p} × {v} chunks = {p * v}"
                    + (f": use a chunk count in {options}" if options else ""))
            elif k is not None and (v == 1 or k != layers // (p * v)):
                problems.append(
                    f"--num-virtual-stages-per-pipeline-rank {v} and "
                    f"--num-layers-per-virtual-pipeline-stage {k} both set the chunks: give one "
                    f"of them")
    return problems


def _resume_control_problems(tr: TrainConfig) -> list[str]:
    """--finetune, --no-load-optim, --no-load-rng, --use-checkpoint-args: each
    says what to take from --load's checkpoint, so each needs --load (with
    --finetune, the other two are implied and fine to give). A fine-tune is
    a new run from iteration 0: its --save must not be the directory of the
    checkpoint it loads, whose iter_* names and `latest` it would take over
    (the loaded run's checkpoints would be moved to SAVE/abandoned/)."""
    uses = [(tr.finetune, "--finetune", "the checkpoint whose weights to fine-tune"),
            (tr.load_optim is False, "--no-load-optim",
             "it leaves out the loaded checkpoint's optimizer state"),
            (tr.load_rng is False, "--no-load-rng",
             "it leaves out the loaded checkpoint's random states"),
            (tr.use_checkpoint_args, "--use-checkpoint-args",
             "the checkpoint whose model settings to take")]
    if not tr.load:
        return [f"{name} needs --load DIR ({what}): add --load or drop {name}"
                for given, name, what in uses if given]
    if tr.finetune and isinstance(tr.save, str) and isinstance(tr.load, str) \
            and _holds_checkpoint(tr.save, tr.load):
        return [f"--finetune with --save {tr.save}, the directory of --load {tr.load}: a fine-tune "
                f"starts a run of its own at iteration 0, whose checkpoints would take the loaded "
                f"run's iter_* names and `latest` there: give the fine-tune another --save "
                f"directory (to resume a fine-tune saved there, drop --finetune)"]
    return []


def _holds_checkpoint(save: str, load: str) -> bool:
    """Whether --load names --save or one iter_* directory in it (paths
    only: nothing is read)."""
    import re
    from pathlib import Path

    save_path, load_path = Path(save).resolve(), Path(load).resolve()
    return load_path == save_path or (load_path.parent == save_path
                                      and re.fullmatch(r"iter_\d{7}", load_path.name) is not None)


def _loss_and_rate_problems(config: Config) -> list[str]:
    """--calculate-per-token-loss, --decoupled-lr/--decoupled-min-lr, --grad-reduce-in-bf16.
    (A value that is not a finite number is _float_problems'.) Megatron-LM
    ignores --decoupled-min-lr without --decoupled-lr and --grad-reduce-in-bf16
    without --bf16; ptdp refuses them rather than drop a setting silently."""
    tr, problems = config.train, []
    peak, final = tr.decoupled_lr, tr.decoupled_min_lr
    for flag_name, value in (("--decoupled-lr", peak), ("--decoupled-min-lr", final)):
        if _is_finite_number(value) and value < 0:
            problems.append(f"{flag_name}={value} must be >= 0 (a learning rate)")
    if _is_finite_number(final) and peak is None:  # (a non-finite one: reported once, above)
        problems.append(f"--decoupled-min-lr {final} needs --decoupled-lr (the embedding's and "
                        f"output layer's peak rate; without it they follow --lr and --min-lr): "
                        f"give --decoupled-lr or leave --decoupled-min-lr out")
    if _is_finite_number(peak) and peak >= 0:
        end, end_flag = (final, "--decoupled-min-lr") if final is not None else (tr.min_lr, "--min-lr")
        if _is_finite_number(end) and 0 <= end and end > peak:
            problems.append(f"{end_flag} {end} is above --decoupled-lr {peak}: the embedding and "
                            f"output layer would end the decay above their peak rate; give "
                            f"--decoupled-min-lr <= {peak}")
    if tr.grad_reduce_in_bf16 and not tr.bf16:
        problems.append("--grad-reduce-in-bf16 reduces the gradients of a --bf16 run in bf16; "
                        "this run is " + ("--fp16" if tr.fp16 else "fp32") + ": add --bf16 or "
                        "leave --grad-reduce-in-bf16 out")
    return problems


def _logging_problems(tr: TrainConfig) -> list[str]:
    """The logging, TensorBoard, garbage-collection, memory and profiling flags.
    Megatron-LM ignores most of them silently without the flag they go with;
    here a flag that would do nothing says what to add. The profiled ranks'
    upper bound and the device are checked by each rank before training
    (ptdp.train.housekeeping), where the job's size and device are known."""
    problems: list[str] = []

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not is_int(tr.tensorboard_log_interval) or tr.tensorboard_log_interval < 1:
        problems.append(f"--tensorboard-log-interval={tr.tensorboard_log_interval!r} must be a "
                        f"positive integer (1: every iteration)")
    if not is_int(tr.manual_gc_interval) or tr.manual_gc_interval < 0:
        problems.append(f"--manual-gc-interval={tr.manual_gc_interval!r} must be 0 (collect only "
                        f"around evaluations) or a positive integer")
    start, end = tr.profile_step_start, tr.profile_step_end
    if not is_int(start) or start < 0:
        problems.append(f"--profile-step-start={start!r} must be a non-negative integer (the "
                        f"iterations done before profiling starts)")
    elif not is_int(end) or end <= start:
        problems.append(f"--profile-step-end={end!r} must be an integer greater than "
                        f"--profile-step-start {start} (profiling stops once it is done)")
    ranks = tr.profile_ranks
    if ranks is not None and (not isinstance(ranks, (list, tuple)) or not ranks
                              or not all(is_int(r) and r >= 0 for r in ranks)):
        problems.append(f"--profile-ranks={ranks!r} must be one or more ranks, non-negative "
                        f"integers (default 0)")

    def needs(given: bool, flag_given: str, required: bool, flag_needed: str, why: str) -> None:
        if given and not required:
            problems.append(f"{flag_given} {why}: add {flag_needed}")

    board = tr.tensorboard_dir is not None
    needs(tr.tensorboard_log_interval != 1, f"--tensorboard-log-interval "
          f"{tr.tensorboard_log_interval}", board, "--tensorboard-dir DIR", "has no TensorBoard log "
          "to pace")
    needs(tr.log_validation_ppl_to_tensorboard, "--log-validation-ppl-to-tensorboard", board,
          "--tensorboard-dir DIR", "writes to TensorBoard")
    needs(tr.log_timers_to_tensorboard, "--log-timers-to-tensorboard", board,
          "--tensorboard-dir DIR", "writes to TensorBoard")
    needs(tr.manual_gc_interval != 0, f"--manual-gc-interval {tr.manual_gc_interval}",
          tr.manual_gc, "--manual-gc", "paces manual garbage collection")
    needs(not tr.manual_gc_eval, "--no-manual-gc-eval", tr.manual_gc, "--manual-gc",
          "changes manual garbage collection")
    for given, name in ((tr.use_pytorch_profiler, "--use-pytorch-profiler"),
                        (start != 10, f"--profile-step-start {start}"),
                        (end != 12, f"--profile-step-end {end}"),
                        (ranks is not None, "--profile-ranks")):
        needs(given, name, tr.profile, "--profile", "only applies when profiling")
    needs(tr.profile and tr.use_pytorch_profiler, "--use-pytorch-profiler", board,
          "--tensorboard-dir DIR", "writes its trace under --tensorboard-dir")
    return problems


def _data_loading_problems(data: DataConfig) -> list[str]:
    """--num-workers, --no-mmap-bin-files."""
    problems = []
    workers = data.num_workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        problems.append(f"--num-workers={workers!r} must be 0 (read in the training process) or a "
                        "positive number of background processes")
    if not isinstance(data.mmap_bin_files, bool):
        problems.append(f"--no-mmap-bin-files: mmap_bin_files={data.mmap_bin_files!r} must be true "
                        "or false")
    return problems
