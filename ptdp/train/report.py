"""What the user sees of a training run: FLOPs and TFLOP/s, the log line,
the progress bar, per-phase times, TensorBoard scalars and the loss curve.

FLOPs follow the paper (GEMMs only, a lower bound of the work done). Per
transformer layer and iteration, the forward pass is

    24·B·s·h² + 4·B·s²·h        (QKV 6·B·s·h², attention output 2·B·s·h²,
                                 MLP 16·B·s·h², scores Q·Kᵀ and scores·V 4·B·s²·h)

and the output layer's forward is 2·B·s·h·V. A backward pass costs twice its
forward. So:

- no recomputation:   3 × forward      F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
- full recomputation: 4 × forward of the layers (the output layer is not
  recomputed)          F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))   (the paper's)
- selective recomputation (only the attention core is rebuilt in backward):
  no-recomputation F plus one more 4·B·s²·h per layer,
                       F = 72·B·s·l·h²·(1 + 2s/(9h) + V/(12·l·h)).

The attention FLOPs count the whole s×s score matrix (the causal mask does
not halve them), as the paper does. V is `ModelConfig.vocab_size`, the
unpadded vocabulary: the paper writes V (its 51,200 is GPT-2's 50,257 padded;
the padded columns are computed but are not model work).

The same count for the Llama family's options (d = h/a the head size, g the
key/value heads, g = a without grouped-query attention; f the MLP width,
--ffn-hidden-size, 4h by default; k = 2 with SwiGLU, whose first matrix
holds the gate's and the up projection's f rows each, else 1). A layer's
forward is

    2·B·s·h·((a + 2g)·d + a·d + (k + 1)·f) + 4·B·s²·a·d

(QKV: the queries a·d and the keys and values 2·g·d features, so grouped
queries shrink the key/value projections by g/a; the score and context
products still run for all a query heads; the MLP has k + 1 matrices of f×h).
With a·d = h, g = a, k = 1 and f = 4h this is the paper's 24·B·s·h² + 4·B·s²·h.
In closed form, without recomputation

    F = 6·B·s·h·(l·((a + 2g)·d + h + (k + 1)·f + 2s) + V)

and with full recomputation 8·B·s·h·(l·((a + 2g)·d + h + (k + 1)·f + 2s) + 3V/4).
RMSNorm, rotary embeddings, SwiGLU's element-wise gate and the biases are
element-wise work, not GEMMs, and are not counted, as the paper leaves out
LayerNorm, GeLU and softmax. An untied output layer has its own [V, h]
matrix but does the same 2·B·s·h·V forward as the tied one.

With full recomputation the formula counts every recomputed GEMM, as
Megatron-LM's re-entrant checkpoint executes them. PyTorch's non-re-entrant
checkpoint (ptdp.model.recompute) stops recomputing once every tensor the
backward needs is rebuilt: with hidden dropout that is the mask after the
last GEMM of each checkpointed group, so everything is re-run; without it
that GEMM (the MLP's 4h→h projection, 2·B·s·h·f) is not, and the hardware
executes that much less than F. TFLOP/s here is the paper's F over the measured time.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ptdp import device as devices
from ptdp.train.peak_memory import GIB, MEASURES, log_text as memory_log_text

# ------------------------------------------------------------------------------------------
# Peak throughput

# Dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's data sheets,
# by a substring of torch's device name; the first match wins, so more
# specific names come first ("H100 PCIe" before "H100", "A100" before
# "A10", "L40S" before "L40" before "L4"). "tf32" applies to fp32 training when
# torch.get_float32_matmul_precision() is "high" or "medium" (TF32 matmuls),
# "fp32" when it is "highest" (PyTorch's default). A dtype a GPU has no
# tensor cores for (bf16 on V100 and T4) is missing, and an empty entry is a
# known name without a known peak: not reported (give --peak-tflops).
DEFAULT_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},   # SXM
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},   # SXM (and GH200)
    "H800": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {},   # AWS's A10 variant: no published peak here; give --peak-tflops
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}


def _precision_key(dtype: torch.dtype) -> str | None:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def lookup_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The table's peak for a device called `device_name` computing in `dtype`."""
    key = _precision_key(dtype)
    for name, peaks in DEFAULT_PEAK_TFLOPS.items():
        if name.lower() in device_name.lower():
            return peaks.get(key) if key else None
    return None


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> float | None:
    """Peak TFLOP/s of one device: `override` (--peak-tflops) when given,
    else the table's value for a known GPU; None (not reported) on CPU and
    on unknown GPUs."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"--peak-tflops must be positive, not {override}")
        return float(override)
    if device.type != "cuda":
        return None
    return lookup_peak_tflops(devices.device_name(device), dtype)


def throughput(flops_per_iteration: float, iteration_seconds: float, world_size: int,
               peak: float | None) -> dict[str, float | None]:
    """Model TFLOP/s per device (the paper's F over n devices and the time of
    one iteration), and its fraction of `peak` (None when no peak is known)."""
    tflops = flops_per_iteration / (iteration_seconds * world_size) / 1e12
    return {"tflops_per_device": tflops, "peak_fraction": tflops / peak if peak else None}


# ------------------------------------------------------------------------------------------
# The log line


def format_log_line(record: dict[str, Any], train_iters: int) -> str:
    """One line per logged iteration. Uses the record's keys (see
    Trainer.step) and, when present: `val_loss` / `val_perplexity` /
    `val_bits_per_char` (the last evaluation), `skipped_iterations`
    (cumulative count of skipped steps), `tflops_per_device`,
    `peak_fraction` and the job's peak memory (`peak_memory_gib`, ...:
    ptdp.train.peak_memory)."""
    def number(key: str, fmt: str) -> str:
        value = record.get(key)
        return "n/a" if value is None else format(value, fmt)

    parts = [f"iteration {record['iteration']:>5}/{train_iters}",
             f"consumed samples {record['consumed_samples']:>7}"]
    if record.get("global_batch_size") is not None:  # during and after a ramp-up
        parts.append(f"global batch size {record['global_batch_size']:>5}")
    parts.append(f"loss {number('loss', '.4f')}")
    if record.get("loss_tokens") is not None:  # --sft: how much of the batch trains
        parts.append(f"loss tokens {record['loss_tokens']} "
                     f"({record['loss_token_fraction']:.1%} of the batch)")
    if record.get("val_loss") is not None:
        text = f"val loss {record['val_loss']:.4f}"
        details = []
        if record.get("val_perplexity") is not None:
            details.append(f"ppl {record['val_perplexity']:.4g}")
        if record.get("val_bits_per_char") is not None:
            details.append(f"{record['val_bits_per_char']:.4g} bits/char")
        if details:
            text += f" ({', '.join(details)})"
        parts.append(text)
    parts += [f"{key} {record[key]:.4f}" for key in BALANCING_KEYS if record.get(key) is not None]
    parts += [f"{key} {record[key]:.4f}" for key in mtp_keys(record)]
    if record.get("moe_busiest_expert_share") is not None:
        parts.append(f"expert load {record['moe_idlest_expert_share']:.1%} to "
                     f"{record['moe_busiest_expert_share']:.1%}")
    if record.get("moe_dropped_fraction") is not None:
        parts.append(f"dropped {record['moe_dropped_fraction']:.2%}")
    parts += [f"lr {number('lr', '.3e')}", f"grad norm {number('grad_norm', '.4f')}"]
    if record.get("num_zeros") is not None:  # --log-num-zeros-in-grad
        parts.append(f"num zeros {record['num_zeros']}")
    if record.get("params_norm") is not None:  # --log-params-norm
        parts.append(f"params norm {record['params_norm']:.4f}")
    if record.get("loss_scale", 1.0) != 1.0:
        parts.append(f"loss scale {record['loss_scale']:.0f}")
    skipped_total = record.get("skipped_iterations", int(bool(record.get("skipped"))))
    if skipped_total or record.get("skipped"):
        parts.append(f"skipped steps {skipped_total}"
                     + (" (this one: inf/nan gradient)" if record.get("skipped") else ""))
    parts += [f"{record['iteration_ms']:.1f} ms/iter", f"{record['tokens_per_s']:.0f} tokens/s"]
    if record.get("tflops_per_device") is not None:
        text = f"{_tflops(record['tflops_per_device'])} TFLOP/s/device"
        if record.get("peak_fraction") is not None:
            text += f" ({100 * record['peak_fraction']:.1f}% of peak)"
        parts.append(text)
    memory = memory_log_text(record)
    if memory is not None:
        parts.append(memory)
    return " | ".join(parts)


def _tflops(value: float) -> str:
    # CPU runs reach well under 1 TFLOP/s: keep three significant digits there.
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


# ------------------------------------------------------------------------------------------
# Progress bar


class Progress:
    """A progress bar with ETA over the training iterations, on stderr.

    Shown only when stderr is a terminal (`enabled=None`); otherwise it does
    nothing and the plain log lines are the whole output. When stdout is a
    terminal too, prints to stdout appear above the bar; when stdout goes to
    a file they stay there."""

    def __init__(self, total: int, *, start: int = 0, description: str = "training",
                 enabled: bool | None = None, console: Any = None):
        self.total = total
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = None
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn)

        console = console if console is not None else Console(file=sys.stderr)
        self._progress = RichProgress(
            TextColumn("[progress.description]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TextColumn("iterations"), TimeElapsedColumn(),
            TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
            console=console, redirect_stdout=sys.stdout.isatty(), redirect_stderr=False)
        self._task = self._progress.add_task(description, total=total, completed=start, status="")
        self._progress.start()

    def update(self, iteration: int, loss: float | None = None) -> None:
        """`iteration` iterations are done (1-based count)."""
        if self._progress is None:
            return
        status = f"loss {loss:.4f}" if loss is not None else ""
        self._progress.update(self._task, completed=iteration, status=status)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------
# Per-phase times


def phase_times(timeline_boxes: Iterable[Sequence]) -> dict[str, float]:
    """Seconds one rank spent in forward (F), backward (B) and pipeline
    exchanges (comm: transfers and waiting for peers) during one executor
    run, from its boxes `(op, microbatch, chunk, start, end)`; `other` is the
    rest of the run's span (between actions: Python overhead, reading data
    outside a box)."""
    totals = {"F": 0.0, "B": 0.0, "comm": 0.0}
    span = 0.0
    for op, _mb, _chunk, start, end in timeline_boxes:
        if op not in totals:
            raise ValueError(f"unknown timeline op {op!r}; expected F, B or comm")
        totals[op] += end - start
        span = max(span, end)
    busy = sum(totals.values())
    return {"forward_seconds": totals["F"], "backward_seconds": totals["B"],
            "comm_seconds": totals["comm"], "span_seconds": span,
            "other_seconds": max(0.0, span - busy)}


# ------------------------------------------------------------------------------------------
# TensorBoard

# record key -> TensorBoard tag (only the keys present and not None are written).
# ptdp's own tags, always written: training scalars every
# --tensorboard-log-interval iterations, validation ones at each evaluation.
TENSORBOARD_TAGS: dict[str, str] = {
    "loss": "train/loss",
    "val_loss": "valid/loss",
    "val_perplexity": "valid/perplexity",
    "val_bits_per_char": "valid/bits_per_char",
    "lr": "train/learning_rate",
    "global_batch_size": "train/batch_size",
    "grad_norm": "train/grad_norm",
    "num_zeros": "train/num_zeros",
    "params_norm": "train/params_norm",
    "loss_scale": "train/loss_scale",
    "skipped_iterations": "train/skipped_iterations",
    "tokens_per_s": "throughput/tokens_per_s",
    "loss_tokens": "train/loss_tokens",                   # --sft
    "loss_token_fraction": "train/loss_token_fraction",
    "tflops_per_device": "throughput/tflops_per_device",
    "peak_fraction": "throughput/peak_fraction",
    "iteration_ms": "time/iteration_ms",
    "forward_backward_ms": "time/forward_backward_ms",
    "forward_ms": "time/forward_ms",
    "backward_ms": "time/backward_ms",
    "weight_grad_ms": "time/weight_grad_ms",
    "pipeline_transfer_ms": "time/pipeline_transfer_ms",
    "grad_reduce_ms": "time/grad_reduce_ms",
    "optimizer_ms": "time/optimizer_ms",
    # MoE layers' balancing losses, without their coefficients: Megatron-LM's tags
    "load_balancing_loss": "load_balancing_loss",
    "seq_load_balancing_loss": "seq_load_balancing_loss",
    "global_load_balancing_loss": "global_load_balancing_loss",
    "z_loss": "z_loss",
    # ptdp's own: how evenly the experts were loaded (shares of the tokens
    # the experts took; 1/E each when balanced), the tokens a capacity dropped
    "moe_busiest_expert_share": "moe/busiest_expert_share",
    "moe_idlest_expert_share": "moe/idlest_expert_share",
    "moe_dropped_fraction": "moe/dropped_fraction",
    # The job's peak memory so far: the largest rank's (resident set on CPU,
    # allocated by tensors on CUDA), which rank that is, and on CUDA the
    # largest reserved by the caching allocator.
    "peak_memory_gib": "memory/peak_gib",
    "peak_memory_rank": "memory/peak_rank",
    "peak_reserved_memory_gib": "memory/peak_reserved_gib",
}
# The balancing losses on the log line, as Megatron-LM names them there.
BALANCING_KEYS = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
                  "z_loss")
VALIDATION_KEYS = frozenset({"val_loss", "val_perplexity", "val_bits_per_char"})


def mtp_keys(record: dict[str, Any]) -> list[str]:
    """The record's MTP losses (--mtp-num-layers), under Megatron-LM's names
    ("mtp_1 loss", ...), which are its log's and TensorBoard tags too."""
    return [key for key in record if key.startswith("mtp_") and key.endswith(" loss")
            and record[key] is not None]

# --log-timers-to-tensorboard: the iteration's timers in seconds under
# Megatron-LM's names (its timer name + "-time"), where it has the same timer.
# Megatron-LM writes the slowest rank's time; ptdp the logging rank's (the
# last pipeline stage's, whose forward-backward ends last), no collective.
MEGATRON_TIMER_TAGS: dict[str, str] = {
    "iteration_ms": "iteration-time",
    "forward_backward_ms": "forward-backward-time",
    "forward_ms": "forward-compute-time",
    "backward_ms": "backward-compute-time",
    "grad_reduce_ms": "all-grads-sync-time",
    "optimizer_ms": "optimizer-time",
    # ptdp's own: Megatron-LM times each send/receive kind separately, and
    # has no zero-bubble W pass.
    "pipeline_transfer_ms": "pipeline-transfer-time",
    "weight_grad_ms": "weight-grad-compute-time",
}
# Megatron-LM's own tags (training_log and evaluate_and_print_results), always
# written beside ptdp's, so that a Megatron-LM run and a ptdp run overlay in
# one TensorBoard: each by iteration and, as "TAG vs samples", by consumed
# samples. The training ones every --tensorboard-log-interval iterations;
# grad-norm not on a skipped step (Megatron-LM has none there either).
MEGATRON_TRAINING_TAGS: dict[str, str] = {
    "lr": "learning-rate",
    "global_batch_size": "batch-size",
    "loss": "lm loss",
    "loss_scale": "loss-scale",
    "grad_norm": "grad-norm",
    "num_zeros": "num-zeros",
    "params_norm": "params-norm",
}
MEGATRON_VALIDATION_TAGS: dict[str, str] = {"val_loss": "lm loss validation"}
# --log-validation-ppl-to-tensorboard: Megatron-LM's tags for its "lm loss".
VALIDATION_PPL_TAG = "lm loss validation ppl"
# --log-throughput: Megatron-LM's tag, model TFLOP/s per device.
THROUGHPUT_TAG = "throughput"
# Megatron-LM's tag (--log-memory-to-tensorboard) for the peak bytes allocated by tensors (CUDA).
MEGATRON_MAX_ALLOCATED_TAG = "mem-max-allocated-bytes"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


class TensorBoardLogger:
    """Writes a record's scalars to TensorBoard event files in `directory`
    (view with `tensorboard --logdir DIRECTORY`). Needs the `tensorboard`
    package; without it, construction fails with the fix.

    `interval`: training scalars on iterations divisible by it (validation
    ones at every evaluation), Megatron-LM's --tensorboard-log-interval.
    Megatron-LM's main tags (MEGATRON_TRAINING_TAGS, MEGATRON_VALIDATION_TAGS:
    'lm loss', 'learning-rate', 'grad-norm', ... and their "vs samples")
    are always written beside ptdp's own (train/loss, ...), so a Megatron-LM
    run and a ptdp run overlay; `global_batch_size` is the batch-size written
    where the record has none (no ramp-up). The other options add Megatron-
    LM's optional tags for quantities ptdp writes under its own tags anyway,
    as Megatron-LM's flags of the same names do: `timers` (seconds, MEGATRON_TIMER_TAGS), `validation_ppl`
    (VALIDATION_PPL_TAG, by iteration and "... vs samples") and `throughput`
    (THROUGHPUT_TAG)."""

    def __init__(self, directory: str | Path, *, interval: int = 1, timers: bool = False,
                 validation_ppl: bool = False, throughput: bool = False,
                 global_batch_size: int | None = None):
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"--tensorboard-log-interval must be a positive integer, not {interval!r}")
        try:
            import tensorboard  # noqa: F401 - torch's writer needs it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError(
                f"--tensorboard-dir {directory} needs the tensorboard package: "
                "pip install tensorboard (into the environment ptdp runs in)") from None
        self.directory = Path(directory)
        self.interval, self.timers = interval, timers
        self.validation_ppl, self.throughput = validation_ppl, throughput
        # Megatron-LM's batch-size where the record has none (no ramp-up).
        self.global_batch_size = global_batch_size
        self.writer = SummaryWriter(log_dir=str(self.directory))

    @classmethod
    def for_run(cls, tr) -> "TensorBoardLogger":
        """The logger --tensorboard-dir and its companion flags ask for (`tr`: a TrainConfig)."""
        return cls(tr.tensorboard_dir, interval=tr.tensorboard_log_interval,
                   timers=tr.log_timers_to_tensorboard,
                   validation_ppl=tr.log_validation_ppl_to_tensorboard,
                   throughput=tr.log_throughput, global_batch_size=tr.global_batch_size)

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        step = record["iteration"] if step is None else step
        training = step % self.interval == 0
        for key, tag in TENSORBOARD_TAGS.items():
            value = _finite(record.get(key))
            if value is not None and (training or key in VALIDATION_KEYS):
                self.writer.add_scalar(tag, value, step)
        if training:
            self._log_megatron_training(record, step)
            for key in mtp_keys(record):
                self.writer.add_scalar(key, record[key], step)
        self._megatron_scalars(MEGATRON_VALIDATION_TAGS, record, step)
        ppl = _finite(record.get("val_perplexity"))
        if self.validation_ppl and ppl is not None:
            self.writer.add_scalar(VALIDATION_PPL_TAG, ppl, step)
            if record.get("consumed_samples") is not None:
                self.writer.add_scalar(VALIDATION_PPL_TAG + " vs samples", ppl,
                                       record["consumed_samples"])

    def _megatron_scalars(self, tags: dict[str, str], record: dict[str, Any], step: int) -> None:
        samples = record.get("consumed_samples")
        for key, tag in tags.items():
            value = _finite(record.get(key))
            if value is None and key == "global_batch_size":
                value = _finite(self.global_batch_size)
            if value is not None:
                self.writer.add_scalar(tag, value, step)
                if samples is not None:
                    self.writer.add_scalar(tag + " vs samples", value, samples)

    def _log_megatron_training(self, record: dict[str, Any], step: int) -> None:
        self._megatron_scalars(MEGATRON_TRAINING_TAGS, record, step)
        if self.timers:
            for key, tag in MEGATRON_TIMER_TAGS.items():
                value = _finite(record.get(key))
                if value is not None:
                    self.writer.add_scalar(tag, value / 1e3, step)
        throughput = _finite(record.get("tflops_per_device"))
        if self.throughput and throughput is not None:
            self.writer.add_scalar(THROUGHPUT_TAG, throughput, step)
        # Megatron-LM's --log-memory-to-tensorboard tag for the same quantity
        # on CUDA (its logging rank's; here the largest rank's): no resident
        # set on CPU passes for allocated bytes.
        allocated = _finite(record.get("peak_memory_gib"))
        if allocated is not None and record.get("peak_memory_measure") == MEASURES["cuda"]:
            self.writer.add_scalar(MEGATRON_MAX_ALLOCATED_TAG, allocated * GIB, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> "TensorBoardLogger":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------
# Loss curve


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """A --metrics-file's records in iteration order, each iteration's last
    (a resumed run appends its records after the earlier ones); the marker
    lines a run writes where it starts ({"event": ...}) are skipped, and so
    is a last line cut short (a run killed while writing it)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    latest: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise ValueError(f"{path}, line {number}: not a JSON record; a --metrics-file "
                             f"holds one per line") from None
        if isinstance(record, dict) and "event" not in record and "iteration" in record:
            latest[record["iteration"]] = record
    return [latest[iteration] for iteration in sorted(latest)]


def join_phases(phases: Sequence[tuple[str, list[dict[str, Any]]]]
                ) -> tuple[list[dict[str, Any]], list[tuple[float, str]]]:
    """One run in phases (label, records), each resumed from the one before,
    perhaps under another layout (the demo: "t=p=d=2", then "d=2"): the
    records of the whole run, and where each change happened (between two
    iterations) with its label ("t=p=d=2 | d=2"). A phase's records from
    the iteration a later phase starts at on were redone by it and give way."""
    phases = [(label, records) for label, records in phases if records]
    records: list[dict[str, Any]] = []
    boundaries: list[tuple[float, str]] = []
    for index, (label, phase) in enumerate(phases):
        later = [p[0]["iteration"] for _, p in phases[index + 1:]]
        end = min(later) if later else math.inf
        records += [r for r in phase if r["iteration"] < end]
        if index:
            boundaries.append((phase[0]["iteration"] - 0.5, f"{phases[index - 1][0]} | {label}"))
    return records, boundaries


def loss_curve_figure(records: list[dict[str, Any]], boundaries: Sequence[tuple[float, str]] = ()):
    """The loss curve as a matplotlib Figure (not drawn yet): training loss
    per iteration (line), validation loss (points) and, at each of
    `boundaries` (iteration, label), a dashed vertical line with its label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["iteration"], r["loss"]) for r in records if r.get("loss") is not None]
    valid = [(r["iteration"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train and not valid:
        raise ValueError("no losses to plot (records hold the loss on the last pipeline stage only)")
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), color="tab:blue", linewidth=1.2, label="training loss")
    if valid:
        ax.plot(*zip(*valid), "o", color="tab:orange", markersize=5, label="validation loss")
    for at, label in boundaries:
        ax.axvline(at, color="gray", linestyle="--", linewidth=1)
        ax.annotate(label, (at, 1), xycoords=("data", "axes fraction"), xytext=(3, -3),
                    textcoords="offset points", va="top", fontsize=8, color="dimgray")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (cross entropy, nats per token)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def plot_loss_curve(records: list[dict[str, Any]], path: str | Path,
                    boundaries: Sequence[tuple[float, str]] = ()) -> Path:
    """`loss_curve_figure` to an image (format from the suffix, e.g. PNG);
    linear axes. Uses matplotlib's Agg canvas directly: no global backend
    state."""
    path = Path(path)
    loss_curve_figure(records, boundaries).savefig(path, dpi=120)
    return path
