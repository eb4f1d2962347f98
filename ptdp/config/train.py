"""The train section: batch sizes and the run's length, the learning-rate
schedule, the optimizer and mixed precision, logging, profiling, checkpoints
and resuming, and the graceful stop. Its checks look at these settings alone;
the batch against the parallel layout is ptdp.config.checks'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ptdp.config.base import finite_or_none, flag, flag_in, is_count, is_finite_number, \
    positive_integer_problems
from ptdp.config.signals import exit_signal_problem


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
    lr_warmup_init: float = flag(
        0.0, "--lr-warmup-init", "the learning rate the linear warm-up starts from (Megatron-LM's "
        "OptimizerParamScheduler init_lr)")
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
    overlap_param_gather: bool = flag(
        False, "--overlap-param-gather",
        "optim (--use-distributed-optimizer, ZeRO-1) and optim_grads (ZeRO-2): start the "
        "all-gather of the updated weights after the optimizer step without waiting, each "
        "bucket's waited for just before the next forward's first module using it, so the "
        "gathers overlap that forward (without it they finish right after the step; the weights "
        "are the same); optim_grads_params (ZeRO-3) always gathers each layer one layer ahead, "
        "so it changes nothing there; needs --use-distributed-optimizer or --use-megatron-fsdp, "
        "as in Megatron-LM (no_shard gathers nothing)")
    use_megatron_fsdp: bool = flag(
        False, "--use-megatron-fsdp",
        "shard over the data-parallel ranks what --data-parallel-sharding-strategy says "
        "(Megatron-LM's Megatron-FSDP)")
    data_parallel_sharding_strategy: str = flag(
        "optim_grads_params", "--data-parallel-sharding-strategy",
        "with --use-megatron-fsdp: what is sharded over the data-parallel ranks: no_shard "
        "(nothing), optim (optimizer state: --use-distributed-optimizer's ZeRO-1), optim_grads "
        "(and gradients, reduce-scattered per microbatch as buckets complete: ZeRO-2), "
        "optim_grads_params (and parameters: ZeRO-3)",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    fsdp_reshard_after_forward: bool | None = flag(
        None, "--fsdp-reshard-after-forward",
        "optim_grads_params: let a unit's (a layer's) gathered parameters go after its forward and "
        "gather them again for its backward, per microbatch (the least memory); off "
        "(--no-fsdp-reshard-after-forward): keep each gathered from its first use to the "
        "iteration's end (one gather per unit and iteration, a stage's whole parameters held). "
        "Default: on without pipeline parallelism; off under it (a stage's 2m gathers per layer "
        "and iteration become one), unless by the memory model the stage's whole parameters "
        "would not fit",
        off_flag="--no-fsdp-reshard-after-forward")
    ddp_bucket_size: int = flag(
        40_000_000, "--ddp-bucket-size",
        "elements per gradient bucket; a bucket's data-parallel reduction starts as soon as its "
        "gradients are final, overlapping the rest of the backward")
    bf16: bool = flag(False, "--bf16", "bf16 weights and activations, fp32 main weights and "
                      "gradient accumulation (bf16 with --main-grads-dtype bf16)")
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
    calculate_per_token_loss: bool | None = flag(
        None, "--calculate-per-token-loss",
        "average the loss over every counted token of the global batch, not per microbatch "
        "(they differ when --eod-mask-loss or --sft's mask leaves a different number of tokens "
        "in each); the default with --sft, where --no-calculate-per-token-loss turns it off",
        off_flag="--no-calculate-per-token-loss")
    grad_reduce_in_bf16: bool = flag(
        False, "--grad-reduce-in-bf16",
        "with --bf16: reduce gradients over the data-parallel ranks in bf16 (half the bytes, "
        "less precise; accumulation stays fp32)")
    main_grads_dtype: str = flag(
        "fp32", "--main-grads-dtype",
        "with --bf16: the main gradients' dtype, the buffers microbatch gradients are added into "
        "and reduced in (bf16: half the bytes, accumulated and reduced in bf16 as in Megatron-LM; "
        "the optimizer reads them as fp32, its weights and moments stay fp32)",
        choices=("fp32", "bf16"))
    seed: int = flag(1234, "--seed", "seed of initialisation, data order and dropout")
    log_interval: int = flag(1, "--log-interval", "print a line every N iterations")
    log_params_norm: bool = flag(
        False, "--log-params-norm",
        "log the L2 norm of all weights after each step (Megatron-LM's 'params norm', "
        "TensorBoard 'params-norm'; one more reduction per iteration)")
    log_num_zeros_in_grad: bool = flag(
        False, "--log-num-zeros-in-grad",
        "log how many gradient elements are exactly zero (Megatron-LM's 'num zeros', "
        "TensorBoard 'num-zeros'; one more reduction per iteration)")
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
    compile: bool = flag(
        False, "--compile",
        "compile each transformer layer's element-wise work between its collectives with "
        "torch.compile (norms, residual adds, the rotation of q and k, the MLP's activation; the "
        "tensor- and sequence-parallel communication stays ptdp's): the same results within "
        "rounding, faster where the compiled kernels beat the eager ones (measured in "
        "docs/performance.md); the first iterations pay the compilation. Where the platform "
        "cannot compile (no C++ compiler on a CPU, no Triton on a GPU) the layers run eager, "
        "with a note")
    disable_bf16_reduced_precision_matmul: bool = flag(
        False, "--disable-bf16-reduced-precision-matmul",
        "on CUDA, bf16 matrix products accumulate without reduced-precision reductions "
        "(cuBLAS's allow_bf16_reduced_precision_reduction off), as Megatron-LM's flag does; "
        "nothing changes on a CPU")
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
    pretrained_checkpoint: str | None = flag(
        None, "--pretrained-checkpoint",
        "as Megatron-LM: when --load holds no checkpoint (or is not given), take the weights "
        "from this checkpoint as --load DIR --finetune does; when it holds one, resume that")
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
    override_opt_param_scheduler: bool = flag(
        False, "--override-opt_param-scheduler",
        "with --load: where this command line's learning-rate schedule (--lr, --min-lr, the warm-up, "
        "the decay style and length, --decoupled-lr/--decoupled-min-lr) differs from the "
        "checkpoint's, follow this command line's, from the samples consumed (the rate changes at "
        "once); without it or --use-checkpoint-opt_param-scheduler such a resume is refused")
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, "--use-checkpoint-opt_param-scheduler",
        "with --load: continue the checkpoint's learning-rate schedule, whatever this command line's "
        "schedule settings say")
    keep_last: int | None = flag(None, "--keep-last",
                                  "keep only the newest N checkpoints of this run's lineage (the "
                                  "checkpoints it was resumed from and wrote); others are moved "
                                  "to SAVE/abandoned/, never deleted")
    async_save: bool = flag(
        False, "--async-save",
        "with --save: write checkpoints in the background (Megatron-LM's flag, here for ptdp's own "
        "format): at a save each rank copies its share to host memory and training goes on while "
        "a thread writes it; the checkpoint is published (sealed, renamed into place, `latest` "
        "moved) only once every rank's part is complete. One save in flight at a time; a stop "
        "and the end of training wait for it")
    eval_interval: int = flag(0, "--eval-interval",
                              "evaluate on the validation set every N iterations and after the "
                              "last (0: never)")
    eval_iters: int = flag(10, "--eval-iters", "global batches of validation samples per evaluation "
                           "(0: no evaluation, as in Megatron-LM)")
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

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates: --eval-interval N and --eval-iters K,
        neither 0 (Megatron-LM turns evaluation off with --eval-iters 0)."""
        return bool(self.eval_interval) and bool(self.eval_iters)

    @property
    def sharding_strategy(self) -> str:
        """What is sharded over the data-parallel ranks: no_shard, optim
        (--use-distributed-optimizer), optim_grads, optim_grads_params."""
        if self.use_megatron_fsdp:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"

    def reshard_after_forward(self, pipeline_size: int) -> bool:
        """--fsdp-reshard-after-forward as given, else its default: on
        without pipeline parallelism, off under it (ptdp train turns it on
        before launch where keeping would not fit: train_checks)."""
        if self.fsdp_reshard_after_forward is None:
            return pipeline_size == 1
        return self.fsdp_reshard_after_forward

    def batch_size(self, data_parallel_size: int) -> int:
        """B: --global-batch-size, after any ramp-up (ptdp.data.batches)."""
        return self.global_batch_size or self.micro_batch_size * data_parallel_size

    def num_microbatches(self, data_parallel_size: int) -> int:
        """m = B / (b·d): microbatches per pipeline per iteration."""
        return self.batch_size(data_parallel_size) // (self.micro_batch_size * data_parallel_size)


def train_count_problems(tr: TrainConfig) -> list[str]:
    """The batch sizes, the run's length and the log interval: positive integers."""
    return positive_integer_problems(
        tr, ("micro_batch_size", "global_batch_size", "train_iters", "train_samples",
             "log_interval"),
        optional=("global_batch_size", "train_iters", "train_samples"))


def precision_and_lr_problems(tr: TrainConfig) -> list[str]:
    """Mixed precision and loss scaling, --ddp-bucket-size, the learning rates,
    the warm-up and the decay in iterations."""
    problems = []
    if tr.bf16 and tr.fp16:
        problems.append("--bf16 and --fp16 exclude each other: choose one")
    if finite_or_none(tr.lr_warmup_init) and tr.lr_warmup_init < 0:
        problems.append(f"--lr-warmup-init={tr.lr_warmup_init} must be >= 0 (the learning rate the "
                        f"warm-up starts from)")
    if finite_or_none(tr.loss_scale) and tr.loss_scale is not None and tr.loss_scale <= 0:
        problems.append(f"--loss-scale={tr.loss_scale} must be > 0")
    if finite_or_none(tr.min_loss_scale, tr.initial_loss_scale) and (
            tr.min_loss_scale <= 0 or tr.initial_loss_scale < tr.min_loss_scale):
        problems.append(f"--initial-loss-scale {tr.initial_loss_scale} and --min-loss-scale "
                        f"{tr.min_loss_scale} must satisfy 0 < min <= initial")
    for name in ("loss_scale_window", "hysteresis", "ddp_bucket_size"):
        if not isinstance(getattr(tr, name), int) or getattr(tr, name) < 1:
            problems.append(f"{flag_in(TrainConfig, name)}={getattr(tr, name)!r} must be a positive integer")
    # lr 0 is allowed: a run that must not change the weights (checking a setup).
    if finite_or_none(tr.lr, tr.min_lr) and (tr.lr < 0 or tr.min_lr < 0 or tr.min_lr > tr.lr):
        problems.append(f"--min-lr {tr.min_lr} and --lr {tr.lr} must satisfy 0 <= min-lr <= lr")
    if tr.lr_warmup_iters < 0:
        problems.append(f"--lr-warmup-iters={tr.lr_warmup_iters} must be >= 0")
    if tr.lr_decay_iters is not None and tr.lr_decay_iters <= tr.lr_warmup_iters:
        problems.append(f"--lr-decay-iters {tr.lr_decay_iters} must exceed --lr-warmup-iters "
                        f"{tr.lr_warmup_iters}")
    return problems


def run_length_problems(tr: TrainConfig) -> list[str]:
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
        if value is not None and not is_count(value, least):
            problems.append(f"{flag_in(TrainConfig, name)}={value!r} must be an integer >= {least}")
    fraction = tr.lr_warmup_fraction
    if is_finite_number(fraction) and not 0.0 <= fraction < 1.0:
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
            mine = flag_in(TrainConfig, name.replace(other, unit))
            problems.append(f"{flag_in(TrainConfig, name)} counts {other.replace('iters', 'iterations')}, "
                            f"but the run's length is given in {unit.replace('iters', 'iterations')} "
                            f"({length}): use {mine}, or give the length as "
                            f"{'--train-iters' if samples else '--train-samples'}")
    warmup_name = "lr_warmup_" + unit
    if fraction is not None and getattr(tr, warmup_name) not in (0, None):
        problems.append(f"--lr-warmup-fraction and {flag_in(TrainConfig, warmup_name)} both set the "
                        f"warm-up: give one of them")
    if samples and is_count(tr.train_samples, 1) and is_count(tr.lr_warmup_samples, 0) \
            and (tr.lr_decay_samples is None or is_count(tr.lr_decay_samples, 1)):
        decay = tr.lr_decay_samples or tr.train_samples
        if decay <= tr.lr_warmup_samples:
            problems.append(f"--lr-warmup-samples {tr.lr_warmup_samples} must be less than the "
                            f"decay length, {decay} (--lr-decay-samples, default --train-samples)")
    # WSD: its annealing length, in the run's unit, and only with WSD.
    wsd_name = "lr_wsd_decay_" + unit
    wsd = getattr(tr, wsd_name)
    if tr.lr_decay_style == "WSD" and wsd is None:
        problems.append(f"--lr-decay-style WSD needs {flag_in(TrainConfig, wsd_name)} N: the length of "
                        f"the annealing at the end of the decay")
    elif tr.lr_decay_style != "WSD" and wsd is not None:  # (the other unit's: reported above)
        problems.append(f"{flag_in(TrainConfig, wsd_name)} only applies to --lr-decay-style WSD: add "
                        f"--lr-decay-style WSD or drop {flag_in(TrainConfig, wsd_name)}")
    elif tr.lr_decay_style == "WSD" and is_count(wsd, 0):
        decay = (tr.lr_decay_samples or tr.train_samples) if samples else \
            (tr.lr_decay_iters or tr.train_iters)
        if is_count(decay, 1) and wsd > decay:
            decay_flags = ("--lr-decay-samples, default --train-samples" if samples
                           else "--lr-decay-iters, default --train-iters")
            problems.append(f"{flag_in(TrainConfig, wsd_name)} {wsd} exceeds the decay length {decay} "
                            f"({decay_flags}), whose last part the annealing is: use at most "
                            f"{decay}")
    return problems


def optimizer_problems(tr: TrainConfig) -> list[str]:
    """--clip-grad, Adam's betas and epsilon, --weight-decay."""
    problems = []
    if finite_or_none(tr.clip_grad) and tr.clip_grad < 0:
        problems.append(f"--clip-grad={tr.clip_grad} must be >= 0 (0 turns clipping off)")
    for name, default in (("adam_beta1", 0.9), ("adam_beta2", 0.999)):
        beta = getattr(tr, name)
        if finite_or_none(beta) and not 0.0 <= beta < 1.0:
            problems.append(f"{flag_in(TrainConfig, name)}={beta} must be in [0, 1) (a moment's decay "
                            f"rate; the default is {default})")
    if finite_or_none(tr.adam_eps) and tr.adam_eps <= 0:
        problems.append(f"--adam-eps={tr.adam_eps} must be > 0 (it keeps Adam's update finite where "
                        f"the second moment is 0; the default is 1e-08)")
    if finite_or_none(tr.weight_decay) and tr.weight_decay < 0:
        problems.append(f"--weight-decay={tr.weight_decay} must be >= 0 (0 turns weight decay off)")
    if tr.overlap_param_gather and not (tr.use_distributed_optimizer or tr.use_megatron_fsdp):
        # Megatron-LM refuses it there too: without a sharded optimizer there is no gather.
        problems.append("--overlap-param-gather overlaps the all-gather of the distributed "
                        "optimizer's updated weights with the next forward, but this run's "
                        "optimizer is not sharded and gathers nothing: add "
                        "--use-distributed-optimizer (or --use-megatron-fsdp), or drop "
                        "--overlap-param-gather")
    return problems


def stopping_problems(tr: TrainConfig) -> list[str]:
    """--exit-interval, --exit-duration-in-mins, --max-consecutive-skipped-iterations,
    --exit-signal, and --async-save (whose save every stop waits for)."""
    problems = []
    interval = tr.exit_interval
    if interval is not None and not is_count(interval, 1):
        problems.append(f"--exit-interval={interval!r} must be a positive integer (or leave it out: "
                        f"no stop by iteration count)")
    minutes = tr.exit_duration_in_mins
    if is_finite_number(minutes) and minutes <= 0:
        problems.append(f"--exit-duration-in-mins={minutes} must be > 0 (or leave it out: no time "
                        f"limit)")
    skipped = tr.max_consecutive_skipped_iterations
    if not is_count(skipped, 0):
        problems.append(f"--max-consecutive-skipped-iterations={skipped!r} must be an integer >= 0 "
                        f"(0: never stop)")
    signal_problem = exit_signal_problem(tr.exit_signal)
    if signal_problem:
        problems.append(signal_problem)
    if tr.async_save and not tr.save:  # (checked with the stops, which wait for its save)
        problems.append("--async-save writes checkpoints in the background, but no --save DIR is "
                        "given to write them to: add --save DIR or drop --async-save")
    return problems


# What --load's checkpoint leaves out: with nothing loaded there is nothing to
# leave out, which ptdp.config.megatron.config_notes says.
LEAVE_OUT_FLAGS = ("--no-load-optim", "--no-load-rng")


def resume_control_problems(tr: TrainConfig) -> list[str]:
    """--finetune, --no-load-optim, --no-load-rng, --use-checkpoint-args and
    the two schedule flags: each says what to take from --load's checkpoint,
    so each needs --load but the two that leave something out of it (with
    --finetune, those two are implied and fine to give). A fine-tune is a new run from iteration 0: its --save must not
    be the directory of the checkpoint it loads, whose iter_* names and
    `latest` it would take over (the loaded run's checkpoints would be moved
    to SAVE/abandoned/). The schedule flags choose between the checkpoint's
    learning-rate schedule and the command line's (ptdp.train.lr_resume):
    one at most, and only where the checkpoint's is loaded."""
    override, keep = tr.override_opt_param_scheduler, tr.use_checkpoint_opt_param_scheduler
    uses = [(tr.finetune, "--finetune", "the checkpoint whose weights to fine-tune"),
            (tr.load_optim is False, "--no-load-optim",
             "it leaves out the loaded checkpoint's optimizer state"),
            (tr.load_rng is False, "--no-load-rng",
             "it leaves out the loaded checkpoint's random states"),
            (tr.use_checkpoint_args, "--use-checkpoint-args",
             "the checkpoint whose model settings to take"),
            (override, "--override-opt_param-scheduler",
             "the checkpoint whose learning-rate schedule to replace"),
            (keep, "--use-checkpoint-opt_param-scheduler",
             "the checkpoint whose learning-rate schedule to continue")]
    if not tr.load:  # (--no-load-optim/-rng without it: a note, as Megatron-LM accepts them)
        return [f"{name} needs --load DIR ({what}): add --load or drop {name}"
                for given, name, what in uses if given and name not in LEAVE_OUT_FLAGS]
    if override and keep:
        return ["--override-opt_param-scheduler (this command line's learning-rate schedule) and "
                "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude each other: keep one"]
    fresh = "--finetune" if tr.finetune else "--no-load-optim" if tr.load_optim is False else None
    if fresh and (override or keep):
        name = "--override-opt_param-scheduler" if override else "--use-checkpoint-opt_param-scheduler"
        return [f"{name} chooses between the checkpoint's learning-rate schedule and this command "
                f"line's, but with {fresh} the schedule starts afresh from this command line's: "
                f"drop {name}"]
    if tr.finetune and isinstance(tr.save, str) and isinstance(tr.load, str) \
            and holds_checkpoint(tr.save, tr.load):
        return [f"--finetune with --save {tr.save}, the directory of --load {tr.load}: a fine-tune "
                f"starts a run of its own at iteration 0, whose checkpoints would take the loaded "
                f"run's iter_* names and `latest` there: give the fine-tune another --save "
                f"directory (to resume a fine-tune saved there, drop --finetune)"]
    return []


def holds_checkpoint(save: str, load: str) -> bool:
    """Whether --load names --save or one iter_* directory in it (paths
    only: nothing is read)."""
    import re
    from pathlib import Path

    save_path, load_path = Path(save).resolve(), Path(load).resolve()
    return load_path == save_path or (load_path.parent == save_path
                                      and re.fullmatch(r"iter_\d{7}", load_path.name) is not None)


def loss_and_rate_problems(tr: TrainConfig) -> list[str]:
    """--calculate-per-token-loss, --decoupled-lr/--decoupled-min-lr, --grad-reduce-in-bf16,
    --main-grads-dtype.
    (A value that is not a finite number is _float_problems'.) Megatron-LM
    ignores --decoupled-min-lr without --decoupled-lr and --grad-reduce-in-bf16
    without --bf16; ptdp refuses them rather than drop a setting silently."""
    problems = []
    peak, final = tr.decoupled_lr, tr.decoupled_min_lr
    for flag_name, value in (("--decoupled-lr", peak), ("--decoupled-min-lr", final)):
        if is_finite_number(value) and value < 0:
            problems.append(f"{flag_name}={value} must be >= 0 (a learning rate)")
    if is_finite_number(final) and peak is None:  # (a non-finite one: reported once, above)
        problems.append(f"--decoupled-min-lr {final} needs --decoupled-lr (the embedding's and "
                        f"output layer's peak rate; without it they follow --lr and --min-lr): "
                        f"give --decoupled-lr or leave --decoupled-min-lr out")
    if is_finite_number(peak) and peak >= 0:
        end, end_flag = (final, "--decoupled-min-lr") if final is not None else (tr.min_lr, "--min-lr")
        if is_finite_number(end) and 0 <= end and end > peak:
            problems.append(f"{end_flag} {end} is above --decoupled-lr {peak}: the embedding and "
                            f"output layer would end the decay above their peak rate; give "
                            f"--decoupled-min-lr <= {peak}")
    if tr.grad_reduce_in_bf16 and not tr.bf16:
        problems.append("--grad-reduce-in-bf16 reduces the gradients of a --bf16 run in bf16; "
                        "this run is " + ("--fp16" if tr.fp16 else "fp32") + ": add --bf16 or "
                        "leave --grad-reduce-in-bf16 out")
    if tr.main_grads_dtype == "bf16" and not tr.bf16:
        problems.append("--main-grads-dtype bf16 keeps the main gradients of a --bf16 run in bf16 "
                        "(as Megatron-LM, whose bf16 main gradients are the bf16 model's); this run "
                        "is " + ("--fp16" if tr.fp16 else "fp32") + ": add --bf16 or give "
                        "--main-grads-dtype fp32")
    return problems


def logging_problems(tr: TrainConfig) -> list[str]:
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
