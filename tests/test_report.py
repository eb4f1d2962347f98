"""What the user sees: FLOPs, peak, the log line, progress bar, phase times,
TensorBoard scalars and the loss curve (ptdp.train.report)."""

import dataclasses
import io
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ptdp.config import ModelConfig
from ptdp.model.gpt import build_chunks
from ptdp.parallel.topology import ParallelContext
from ptdp.perf.analytic.flops import configured_flops_per_iteration, model_flops_per_iteration
from ptdp import device as devices
from ptdp.train import peak_memory
from ptdp.train.report import (
    DEFAULT_PEAK_TFLOPS,
    Progress,
    TensorBoardLogger,
    format_log_line,
    lookup_peak_tflops,
    peak_tflops,
    phase_times,
    plot_loss_curve,
    throughput,
)

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=96,
                   make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0)

# ------------------------------------------------------------------------------------------
# FLOPs: against an explicit count of the model's matmuls


def _attention_forward(q, k, v, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(q, k, v)                  # Q·Kᵀ and scores·V: 4·b·s²·h


def _attention_backward(grad, q, k, v, *args, out_shape=None, **kwargs):
    # The paper's rule, backward = 2 × forward (torch's own formula adds the
    # scores' recomputation inside flash attention's backward).
    return 2 * sdpa_flop_count(q, k, v)


# FlopCounterMode has no formula for the CPU attention kernel: count it too.
CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_forward,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}


def _counted_flops(config: ModelConfig, batch: int, early_stop: bool = False) -> int:
    """FLOPs of the matmuls that one forward and backward of the one-process
    model executes (recomputation included, as configured)."""
    model = build_chunks(config, ParallelContext.single(), torch.device("cpu"), seed=3)[0]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1), generator=generator)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop), \
            FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("layout", [
    dict(),
    dict(recompute_granularity="selective"),
    dict(recompute_granularity="full"),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(ffn_hidden_size=48),
], ids=["none", "selective", "full-uniform", "full-block-1-of-2", "ffn-48"])
def test_flops_equal_the_counted_matmuls(layout):
    config = dataclasses.replace(TINY, **layout)
    counted = _counted_flops(config, batch=3)
    assert configured_flops_per_iteration(config, 3, num_model_chunks=1) == counted


def test_flops_closed_forms_are_the_papers():
    B, s, h, l, V = 3, TINY.seq_length, TINY.hidden_size, TINY.num_layers, TINY.vocab_size
    none = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    full = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    selective = 72 * B * s * l * h * h * (1 + 2 * s / (9 * h) + V / (12 * l * h))
    assert model_flops_per_iteration(TINY, B, recompute=None) == pytest.approx(none, rel=1e-12)
    assert model_flops_per_iteration(TINY, B, recompute="full") == pytest.approx(full, rel=1e-12)
    assert model_flops_per_iteration(TINY, B, recompute="selective") == pytest.approx(selective, rel=1e-12)
    assert none < selective < full
    with pytest.raises(ValueError, match="recompute"):
        model_flops_per_iteration(TINY, B, recompute="partial")


def test_early_stopping_checkpoint_skips_the_last_gemm_of_each_group():
    """PyTorch's default (non-re-entrant, early stop) recomputation skips the
    MLP's last GEMM, 2·B·s·h·f per checkpointed group, as the module doc says."""
    config = dataclasses.replace(TINY, recompute_granularity="full")
    counted = _counted_flops(config, batch=3, early_stop=True)
    skipped = config.num_layers * 2 * 3 * config.seq_length * config.hidden_size * config.ffn_size
    assert counted == model_flops_per_iteration(config, 3, recompute="full") - skipped


# 1.7B row of the paper (PAPER.md, "Implementation points"): h = 2304, a = 24,
# l = 24, s = 2048, V = 51200; t = p = 1, n = 32 GPUs, B = 512: 137 TFLOP/s
# per GPU, 44% of the A100's 312.
PAPER_1_7B = ModelConfig(num_layers=24, hidden_size=2304, num_attention_heads=24, seq_length=2048,
                         vocab_size=51200)
# The paper's largest GPT-3-like row: 175B, h = 12288, l = 96, B = 1536.
PAPER_175B = ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                         vocab_size=51200)


def _paper_parameters(c: ModelConfig) -> float:
    l, h, V, s = c.num_layers, c.hidden_size, c.vocab_size, c.seq_length
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def test_paper_calibration_point():
    F = model_flops_per_iteration(PAPER_1_7B, 512, recompute="full")
    # By hand: 96·512·2048·24·2304² · (1 + 2048/13824 + 51200/884736)
    assert F == pytest.approx(1.2825e16 * (1 + 0.148148 + 0.057870), rel=1e-4)
    assert _paper_parameters(PAPER_1_7B) == pytest.approx(1.7e9, rel=0.04)  # "1.7B"
    seconds = F / (32 * 137e12)  # the iteration time that 137 TFLOP/s per GPU implies
    assert seconds == pytest.approx(3.52, rel=0.01)
    result = throughput(F, seconds, world_size=32, peak=312.0)
    assert result["tflops_per_device"] == pytest.approx(137.0)
    assert round(100 * result["peak_fraction"]) == 44  # the paper's 44%


@pytest.mark.parametrize("config, batch, bound", [(PAPER_175B, 1536, 0.03), (PAPER_1_7B, 512, 0.12)])
def test_training_time_rule_agrees_with_the_flops_formula(config, batch, bound):
    """The paper's training time 8·T·P/(n·X) is F's tokens·8·P approximation:
    within 3% for 175B (s/(6h) and V/(16lh) are small), about 12% at 1.7B."""
    F = model_flops_per_iteration(config, batch, recompute="full")
    eight_tp = 8 * batch * config.seq_length * _paper_parameters(config)
    assert 1.0 < F / eight_tp < 1.0 + bound


# ------------------------------------------------------------------------------------------
# Peak


def test_every_table_entry_is_reachable_by_its_name():
    for name, peaks in DEFAULT_PEAK_TFLOPS.items():
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            assert lookup_peak_tflops(f"NVIDIA {name}", dtype) == peaks.get(key), name


@pytest.mark.parametrize("name, dtype, want", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H200", torch.bfloat16, 989.0),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5),  # PyTorch's default: no TF32 matmuls
    ("NVIDIA L40S", torch.float16, 362.0),
    ("NVIDIA L4", torch.float16, 121.0),
    ("Tesla V100-SXM2-16GB", torch.float16, 125.0),
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 tensor cores
    ("NVIDIA A10G", torch.bfloat16, None),
    ("Some Future GPU", torch.bfloat16, None),
])
def test_peak_defaults(name, dtype, want):
    assert lookup_peak_tflops(name, dtype) == want


def test_tf32_peak_when_tf32_matmuls_are_on():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert lookup_peak_tflops("NVIDIA A100-SXM4-40GB", torch.float32) == 156.0
    finally:
        torch.set_float32_matmul_precision(previous)


def test_peak_on_cpu_and_override():
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, torch.float32, None) is None
    assert peak_tflops(cpu, torch.float32, 2.5) == 2.5
    with pytest.raises(ValueError, match="--peak-tflops"):
        peak_tflops(cpu, torch.float32, 0.0)


# ------------------------------------------------------------------------------------------
# The log line

BASE = {"iteration": 10, "consumed_samples": 160, "loss": 2.5, "lr": 3e-3, "grad_norm": 0.75,
        "loss_scale": 1.0, "skipped": False, "iteration_ms": 123.45, "tokens_per_s": 8300.2}


def test_log_line_with_everything():
    record = dict(BASE, val_loss=2.6, val_perplexity=math.exp(2.6), loss_scale=65536.0,
                  skipped=True, skipped_iterations=2, tflops_per_device=123.4, peak_fraction=0.4)
    line = format_log_line(record, 40)
    for part in ["iteration    10/40", "consumed samples     160", "loss 2.5000",
                 "val loss 2.6000 (ppl 13.46)", "lr 3.000e-03", "grad norm 0.7500",
                 "loss scale 65536", "skipped steps 2 (this one: inf/nan gradient)",
                 "123.5 ms/iter", "8300 tokens/s", "123.4 TFLOP/s/device (40.0% of peak)"]:
        assert part in line, (part, line)
    assert line.index("loss 2.5000") < line.index("val loss") < line.index("lr ")


def test_log_line_minimal():
    line = format_log_line(BASE, 40)
    assert line == ("iteration    10/40 | consumed samples     160 | loss 2.5000 | lr 3.000e-03 | "
                    "grad norm 0.7500 | 123.5 ms/iter | 8300 tokens/s")
    # Earlier skips stay visible; a CPU-sized TFLOP/s keeps its digits; no peak, no %.
    line = format_log_line(dict(BASE, skipped_iterations=3, tflops_per_device=0.01234,
                                peak_fraction=None, loss=None), 40)
    assert "skipped steps 3 |" in line and "this one" not in line
    assert "0.0123 TFLOP/s/device" in line and "peak" not in line
    assert "loss n/a" in line


def test_log_line_carries_the_jobs_peak_memory():
    cpu = peak_memory.job_fields((peak_memory.encode(412 * 2**20, 3, 4), -1.0), 4,
                                 torch.device("cpu"))
    assert cpu == {"peak_memory_gib": pytest.approx(412 / 1024), "peak_memory_rank": 3,
                   "peak_memory_measure": "resident set size"}
    assert format_log_line(dict(BASE, **cpu), 40).endswith(
        " | peak memory 0.402 GiB (rank 3, resident set)")
    cuda = peak_memory.job_fields((peak_memory.encode(12 * 2**30, 5, 8),
                                   peak_memory.encode(14 * 2**30, 2, 8)), 8, torch.device("cuda"))
    assert cuda["peak_reserved_memory_gib"] == 14.0 and cuda["peak_reserved_memory_rank"] == 2
    assert format_log_line(dict(BASE, **cuda), 40).endswith(
        " | peak memory 12 GiB (rank 5, allocated), reserved 14 GiB (rank 2)")


def test_peak_memory_codes_take_the_largest_rank_with_its_number():
    """The MAX all-reduce of the codes is the largest peak with its rank."""
    world = 1000
    peaks = [300 * 2**20, 7 * 2**40 + 5 * 1024, 64 * 2**20] + [2**30] * (world - 3)
    codes = [peak_memory.encode(nbytes, rank, world) for rank, nbytes in enumerate(peaks)]
    assert peak_memory.decode(max(codes), world) == (7 * 2**40 + 5 * 1024, 1)
    assert peak_memory.decode(-1.0, world) is None
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        peak_memory.encode(1, 4, 4)


def test_peak_resident_set_is_in_bytes_on_linux_and_macos(monkeypatch):
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    monkeypatch.setattr(sys, "platform", "linux")
    linux = devices.peak_resident_bytes()
    assert linux >= usage.ru_maxrss * 1024 > 50 * 2**20  # this process imported torch
    monkeypatch.setattr(sys, "platform", "darwin")  # getrusage counts bytes there
    assert devices.peak_resident_bytes() < linux / 1000


def test_peak_memory_on_cuda_is_the_allocators(monkeypatch):
    """(No GPU needed: torch's two counters stand in.)"""
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: asked.append(device) or 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved",
                        lambda device: asked.append(device) or 4 * 2**30)
    gpu = torch.device("cuda", 1)
    assert devices.peak_memory(gpu) == (3 * 2**30, 4 * 2**30) and asked == [gpu, gpu]
    fields = peak_memory.job_fields(peak_memory.own_codes(gpu, 0, 1), 1, gpu)
    assert fields == {"peak_memory_gib": 3.0, "peak_memory_rank": 0,
                      "peak_memory_measure": "allocated by tensors",
                      "peak_reserved_memory_gib": 4.0, "peak_reserved_memory_rank": 0}


def _agreed_memory(rank: int) -> tuple[int, tuple[int, int], dict]:
    """One rank of a job: the rank whose peak was the lower raises its peak
    256 MiB above the other's; then (that rank, this rank's peak just before
    and just after the all-reduce, the job's fields as the training loop
    gets them)."""
    from ptdp.config import TrainConfig
    from ptdp.train.stopping import StopConditions

    dist, cpu = torch.distributed, torch.device("cpu")
    world = dist.get_world_size()
    before = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(before, torch.tensor([float(devices.peak_resident_bytes())], dtype=torch.float64))
    peaks = [float(t) for t in before]
    lowest = peaks.index(min(peaks))
    held = torch.ones(int(max(peaks) - min(peaks)) // 4 + 2**26) if rank == lowest else None
    stopping = StopConditions(TrainConfig(exit_signal_handler=False), cpu, uses_loss_scaling=False,
                              rank=rank, is_logger=rank == 0)
    measured = devices.peak_resident_bytes()
    verdict = stopping.agree({"loss": 1.0, "grad_norm": 1.0, "iteration_ms": 1.0},
                             peak_memory.own_codes(cpu, rank, world))
    fields = peak_memory.job_fields(verdict.memory, world, cpu)
    del held
    return lowest, (measured, devices.peak_resident_bytes()), fields


def test_the_job_peak_is_the_largest_ranks(pools):
    ranks = pools(2).run(_agreed_memory)
    lowest, fields = ranks[0][0], ranks[0][2]
    before = [own[0] for _, own, _ in ranks]
    after = [own[1] for _, own, _ in ranks]
    assert ranks[1][2] == fields  # every rank agrees
    assert fields["peak_memory_rank"] == before.index(max(before)) == lowest
    # (KiB, and a peak can only grow while it is measured)
    assert max(before) - 1024 <= fields["peak_memory_gib"] * 2**30 <= max(after)
    assert fields["peak_memory_gib"] > 0.25 + 50 / 1024  # the tensor, and torch


# ------------------------------------------------------------------------------------------
# Progress bar


def test_progress_is_off_without_a_terminal(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    progress = Progress(10)
    assert not progress.enabled
    progress.update(5, loss=1.0)
    progress.close()
    assert stderr.getvalue() == ""


def test_progress_draws_on_a_terminal():
    from rich.console import Console

    out = io.StringIO()
    progress = Progress(10, enabled=True, console=Console(file=out, force_terminal=True, width=120))
    progress.update(4, loss=1.5)
    progress.update(10, loss=1.25)
    progress.close()
    text = out.getvalue()
    assert "10/10" in text and "loss 1.2500" in text


# ------------------------------------------------------------------------------------------
# Per-phase times


def test_phase_times_sum_the_boxes():
    boxes = [("comm", -1, -1, 0.0, 0.5), ("F", 0, 0, 0.5, 1.5), ("F", 1, 0, 1.5, 2.0),
             ("comm", -1, -1, 2.25, 2.5), ("B", 0, 0, 2.5, 4.5), ("B", 1, 0, 4.5, 5.0)]
    assert phase_times(boxes) == {"forward_seconds": 1.5, "backward_seconds": 2.5,
                                  "comm_seconds": 0.75, "span_seconds": 5.0,
                                  "other_seconds": 0.25}
    assert phase_times([])["forward_seconds"] == 0.0
    with pytest.raises(ValueError, match="unknown"):
        phase_times([("X", 0, 0, 0.0, 1.0)])


# ------------------------------------------------------------------------------------------
# TensorBoard and the loss curve


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [dict(BASE, iteration=i, loss=3.0 - 0.5 * i, tflops_per_device=0.5,
                    forward_backward_ms=10.0 + i) for i in (1, 2, 3)]
    records[1].update(val_loss=2.25, val_perplexity=math.exp(2.25))
    records[2]["grad_norm"] = float("nan")  # a skipped step: not written
    with TensorBoardLogger(tmp_path / "tb") as logger:
        for record in records:
            logger.log(record)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "valid/loss", "valid/perplexity", "train/learning_rate",
            "throughput/tokens_per_s", "throughput/tflops_per_device",
            "time/forward_backward_ms"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.0), (3, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("valid/loss")] == [(2, 2.25)]
    assert [e.step for e in events.Scalars("train/grad_norm")] == [1, 2]


def test_tensorboard_missing_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        TensorBoardLogger(tmp_path / "tb")


def test_loss_curve_writes_a_png(tmp_path):
    records = [dict(BASE, iteration=i, loss=5.0 / i) for i in range(1, 21)]
    for i in (9, 19):
        records[i].update(val_loss=5.5 / (i + 1))
    path = plot_loss_curve(records, tmp_path / "loss.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="no losses"):
        plot_loss_curve([dict(BASE, loss=None)], tmp_path / "empty.png")


def test_tensorboard_carries_megatron_lm_tag_names(tmp_path):
    """Megatron-LM's training_log and evaluate_and_print_results names, by
    iteration and 'vs samples', beside ptdp's own tags, so that a Megatron-LM
    run and a ptdp run overlay in one TensorBoard."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [dict(BASE, iteration=i, consumed_samples=16 * i, loss=3.0 - 0.5 * i,
                    params_norm=10.0 + i, num_zeros=7) for i in (1, 2, 3)]
    records[1].update(val_loss=2.25)
    records[2].update(grad_norm=float("nan"), global_batch_size=32)  # skipped; ramped up
    with TensorBoardLogger(tmp_path / "tb", global_batch_size=16) as logger:
        for record in records:
            logger.log(record)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()

    def scalars(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert scalars("lm loss") == scalars("train/loss") == [(1, 2.5), (2, 2.0), (3, 1.5)]
    assert scalars("lm loss vs samples") == [(16, 2.5), (32, 2.0), (48, 1.5)]
    assert scalars("learning-rate") == [(i, pytest.approx(3e-3)) for i in (1, 2, 3)]
    assert scalars("batch-size") == [(1, 16), (2, 16), (3, 32)]
    assert scalars("grad-norm") == [(1, 0.75), (2, 0.75)]  # none for the skipped step
    assert scalars("grad-norm vs samples") == [(16, 0.75), (32, 0.75)]
    assert scalars("loss-scale") == [(i, 1.0) for i in (1, 2, 3)]
    assert scalars("params-norm") == [(i, 10.0 + i) for i in (1, 2, 3)]
    assert scalars("num-zeros vs samples") == [(16 * i, 7) for i in (1, 2, 3)]
    assert scalars("lm loss validation") == [(2, 2.25)]
    assert scalars("lm loss validation vs samples") == [(32, 2.25)]


def test_tensorboard_peak_memory_and_megatron_lm_allocated_bytes(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cuda = peak_memory.job_fields((peak_memory.encode(12 * 2**30, 5, 8),
                                   peak_memory.encode(14 * 2**30, 2, 8)), 8, torch.device("cuda"))
    cpu = peak_memory.job_fields((peak_memory.encode(2**30, 1, 2), -1.0), 2, torch.device("cpu"))
    for name, fields in (("cuda", cuda), ("cpu", cpu)):
        with TensorBoardLogger(tmp_path / name) as logger:
            logger.log(dict(BASE, iteration=1, **fields))
    events = {name: EventAccumulator(str(tmp_path / name)) for name in ("cuda", "cpu")}
    for accumulator in events.values():
        accumulator.Reload()

    def scalars(name, tag):
        return [(e.step, e.value) for e in events[name].Scalars(tag)]

    assert scalars("cuda", "memory/peak_gib") == [(1, 12.0)]
    assert scalars("cuda", "memory/peak_rank") == [(1, 5.0)]
    assert scalars("cuda", "memory/peak_reserved_gib") == [(1, 14.0)]
    assert scalars("cuda", "mem-max-allocated-bytes") == [(1, 12.0 * 2**30)]
    assert scalars("cpu", "memory/peak_gib") == [(1, 1.0)]
    # A resident set is not the allocator's bytes: no Megatron-LM tag for it.
    assert "mem-max-allocated-bytes" not in events["cpu"].Tags()["scalars"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_metrics_file_that_cannot_be_written_is_named():
    """Issue 38: a full disk under --metrics-file said "No space left on
    device" without naming the file."""
    from ptdp.errors import UserError
    from ptdp.train.run_log import _report

    full = open("/dev/full", "w")
    with pytest.raises(UserError) as caught:
        _report({"iteration": 3, "loss": 1.0}, full, None, False, 10, force=False)
    with pytest.raises(OSError):
        full.close()  # (the loop's close: it would raise the same again)
    assert str(caught.value) == (
        "--metrics-file /dev/full: cannot write iteration 3's record (No space left on device); "
        "free space there or give another --metrics-file")
