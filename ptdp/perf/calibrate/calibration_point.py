"""The one calibration point: the paper's 1.7B run at 137 TFLOP/s per GPU,
against which the a100 profile's GEMM efficiency is fitted; and the fits to
measurements of kernels, not of training runs: the paper's attention core
to one layer Korthikanti et al. timed on A100s, the Hopper profiles to a
matrix product and to published attention benchmarks.
"""

from __future__ import annotations

import dataclasses
import statistics

from ptdp.perf.layout import Layout, Workload
from ptdp.perf.simulate.predict import simulate
from ptdp.perf.price.profiles import (ACHIEVED_HBM_FRACTION, BUILTIN, CALIBRATED_GEMM_EFFICIENCY,
                                      HOPPER_GEMM_EFFICIENCY, HOPPER_MATMUL,
                                      PAPER_ATTENTION_CORE_FRACTION, HardwareProfile)

CALIBRATION_TFLOPS = 137.0


def calibration_point():
    """(workload, layout) of the paper's 1.7B run: h = 2304, a = 24, l = 24,
    s = 2048, V = 51200, t = p = 1, d = 32, B = 512, b = 16, 16-bit
    precision, full activation recomputation (the paper's FLOP count, 96·B·s·l·h²·(...),
    counts the recomputed forward)."""
    from ptdp.config import ModelConfig

    model = ModelConfig(num_layers=24, hidden_size=2304, num_attention_heads=24, seq_length=2048,
                        vocab_size=51200, recompute_granularity="full")
    return (Workload(model, global_batch=512, precision="fp16"),
            Layout(t=1, p=1, d=32, b=16, recompute="full"))


def paper_kernels(profile: HardwareProfile, *,
                  attention_core_fraction: float = PAPER_ATTENTION_CORE_FRACTION
                  ) -> HardwareProfile:
    """`profile` running the paper's kernels (Megatron-LM, 2021-22):
    attention as two batched GEMMs around a fused scale-mask-softmax kernel
    and PyTorch's dropout, which write and read the s×s scores (flash
    attention came later), those passes at `attention_core_fraction` of the
    data sheet's HBM bandwidth (profiles.PAPER_ATTENTION_CORE_FRACTION);
    apex's fused multi-tensor Adam (price/operator_bytes.py); full recomputation
    rerunning each layer's whole forward (Megatron-LM's re-entrant
    checkpoint function; Korthikanti et al.'s Table 4 shows it: full
    recomputation adds 7.6 ms to a layer whose forward takes 7.7).
    The paper's runs, the calibration point and any check against them, are
    priced so; ptdp's own runs use the profile's kernels. (How a run reduced
    its gradients is the row's own: the calibration point ran PyTorch's
    DistributedDataParallel, whose buckets overlap the backward as ptdp's
    do, `--DDP-impl torch` in Megatron-LM's run_table_1.sh; the larger
    models its local DDP, after the backward.)"""
    data_sheet = profile.memory_bandwidth / ACHIEVED_HBM_FRACTION
    return dataclasses.replace(
        profile, fused_attention=False, fused_optimizer=True, recompute_whole_layer=True,
        op_bandwidth={**profile.op_bandwidth,
                      "attention_core": attention_core_fraction * data_sheet})


# One 22B layer (h = 6144, a = 64, s = 2048, V = 51200 GPT, bf16) on 8 A100s
# (t = 8), forward plus backward in milliseconds, as Korthikanti et al. 2022
# timed it (arXiv 2205.05198, Table 4), by recomputation and sequence
# parallelism. Forward alone: 7.7 without recomputation. The table's micro
# batch is taken as the 22B run's, b = 4 (one microbatch per iteration, as
# recalled from Table 3): the only one for which these are times an A100 runs, since a layer's
# GEMMs do 2.45e11·b FLOPs per rank forward, 127 TFLOP/s in 7.7 ms at b = 4
# (41 % of peak, the 22B run's MFU), 64 at b = 2 and an impossible 254
# (81 %, collectives included) at b = 8; and 48 layers of 20.3 ms make that
# run's 1.1 s iteration. A measurement of one layer's kernels, not a
# training run's throughput.
KORTHIKANTI_LAYER = {"hidden": 6144, "heads": 64, "seq": 2048, "vocab": 51200, "t": 8, "b": 4}
KORTHIKANTI_LAYER_MS = {  # (recomputation, sequence parallelism): forward + backward
    (None, False): 19.6, (None, True): 19.0, ("full", False): 27.2,
    ("selective", False): 20.9, ("selective", True): 20.3}


def korthikanti_layer_ms(profile: HardwareProfile) -> dict[tuple[str | None, bool], float]:
    """The layer of KORTHIKANTI_LAYER_MS as `profile` prices it: one
    microbatch's forward, backward and recomputation, collectives included
    (each exposed, as Megatron-LM ran them in 2022), in milliseconds, for
    each of the table's settings."""
    from ptdp.config import ModelConfig
    from ptdp.perf.price.stage_costs import operator_model

    shape = KORTHIKANTI_LAYER
    model = ModelConfig(num_layers=1, hidden_size=shape["hidden"],
                        num_attention_heads=shape["heads"], seq_length=shape["seq"],
                        vocab_size=shape["vocab"])
    workload = Workload(model, global_batch=shape["b"], precision="bf16")
    times = {}
    for recompute, sequence_parallel in KORTHIKANTI_LAYER_MS:
        layout = Layout(t=shape["t"], p=1, d=1, b=shape["b"], recompute=recompute,
                        sequence_parallel=sequence_parallel)
        ops = operator_model(workload, layout, profile)
        costs = (ops.layer_forward(), ops.layer_backward(), ops.layer_recompute(recompute))
        times[recompute, sequence_parallel] = 1e3 * sum(c.total_work + c.comm for c in costs)
    return times


def selective_overhead_ms(times: dict[tuple[str | None, bool], float]) -> float:
    """What selective recomputation adds to the layer, the mean over the
    table's two pairs (without and with sequence parallelism)."""
    return ((times["selective", False] - times[None, False])
            + (times["selective", True] - times[None, True])) / 2


def fit_attention_core_fraction(e_max: float = CALIBRATED_GEMM_EFFICIENCY, *,
                                tolerance: float = 1e-7) -> float:
    """The fraction of the A100's data-sheet HBM bandwidth at which the
    paper's attention-core passes make the a100 profile (at `e_max`) price
    selective recomputation's overhead in KORTHIKANTI_LAYER_MS as measured
    (1.3 ms): bisection, the overhead falling as the fraction rises."""
    measured = selective_overhead_ms(KORTHIKANTI_LAYER_MS)

    def overhead(fraction: float) -> float:
        profile = paper_kernels(BUILTIN["a100"](e_max), attention_core_fraction=fraction)
        return selective_overhead_ms(korthikanti_layer_ms(profile))

    low, high = 0.05, 1.0
    if overhead(high) > measured:
        raise ValueError(f"even at the data sheet's bandwidth the attention core costs "
                         f"{overhead(high):.2f} ms > {measured:.2f} ms")
    while high - low > tolerance:
        mid = (low + high) / 2
        if overhead(mid) > measured:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def fit_paper_kernels(*, rounds: int = 20, tolerance: float = 1e-6) -> tuple[float, float]:
    """(e_max, attention-core fraction) fitted together: e_max to the 1.7B
    calibration point, the fraction to Korthikanti et al.'s layer; each
    depends on the other (the calibration point runs the attention core, the
    layer's recomputed attention core runs two GEMMs), so alternate until
    neither moves."""
    fraction = PAPER_ATTENTION_CORE_FRACTION
    e_max = CALIBRATED_GEMM_EFFICIENCY
    for _ in range(rounds):
        e_next = fit_to_calibration_point(attention_core_fraction=fraction)
        fraction_next = fit_attention_core_fraction(e_next)
        done = abs(e_next - e_max) < tolerance and abs(fraction_next - fraction) < tolerance
        e_max, fraction = e_next, fraction_next
        if done:
            break
    return e_max, fraction


def fit_to_calibration_point(target_tflops: float = CALIBRATION_TFLOPS, *,
                             attention_core_fraction: float = PAPER_ATTENTION_CORE_FRACTION,
                             tolerance: float = 1e-6) -> float:
    """The e_max for which `ptdp.perf.simulate.predict.simulate` predicts `target_tflops` per GPU
    for the paper's 1.7B run on `a100` with the paper's kernels
    (`paper_kernels`)."""
    workload, layout = calibration_point()

    def predicted(e_max: float) -> float:
        profile = paper_kernels(BUILTIN["a100"](e_max),
                                attention_core_fraction=attention_core_fraction)
        return simulate(workload, layout, profile).tflops_per_device

    return _e_max_reaching(predicted, target_tflops, tolerance, "the model predicts")


def fit_to_matmul(profile: str = "h200", size: int = HOPPER_MATMUL[0],
                  tflops: float = HOPPER_MATMUL[1], *, tolerance: float = 1e-6) -> float:
    """The e_max for which the built-in `profile`'s tile model prices a
    size³ bf16 matrix product at `tflops` (the h100 and h200 profiles'
    e_max, from the product measured on an H200)."""
    flops = 2.0 * size ** 3

    def priced(e_max: float) -> float:
        return flops / BUILTIN[profile](e_max).gemm_seconds(size, size, size,
                                                             precision="bf16") / 1e12

    return _e_max_reaching(priced, tflops, tolerance, "the tile model prices")


# Published attention kernel throughput on one H100 SXM5 (TFLOP/s, bf16, head
# dim 128, 16 heads, batch × sequence = 16k; forward with and without the
# causal mask, backward as plotted): the FlashAttention-3 paper's figures 5
# and 6 (Shah et al. 2024, arXiv 2407.08608), read off the bars' labels.
# FLOPs as the paper counts them: 4·s²·d per head forward, half of it
# causal; backward 2.5 times the forward.
HOPPER_ATTENTION_SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
HOPPER_ATTENTION_BENCHMARKS = {
    "flash2": {"forward causal": (191, 260, 298, 319, 333, 335),
               "forward": (309, 350, 362, 368, 370, 370),
               "backward": (214, 260, 291, 310, 318, 322)},
    "cudnn": {"forward causal": (315, 410, 484, 518, 529, 539),
              "forward": (497, 574, 617, 609, 600, 595),
              "backward": (305, 408, 465, 499, 518, 516)},
}


def attention_ratios(profile: HardwareProfile, kernel: str) -> list[float]:
    """Predicted over published seconds of every benchmark point of `kernel`
    (HOPPER_ATTENTION_BENCHMARKS), as `profile` prices them."""
    ratios = []
    for series, tflops in HOPPER_ATTENTION_BENCHMARKS[kernel].items():
        causal = series == "forward causal"
        for s, measured in zip(HOPPER_ATTENTION_SEQUENCES, tflops):
            batch_heads, head_dim = 16 * 16384 // s, 128
            forward, backward = profile.attention_seconds(batch_heads, s, head_dim, causal=causal)
            flops = 4.0 * s * s * head_dim * batch_heads * (0.5 if causal else 1.0)
            if series == "backward":
                ratios.append(backward / (2.5 * flops / (measured * 1e12)))
            else:
                ratios.append(forward / (flops / (measured * 1e12)))
    return ratios


def fit_attention(kernel: str, profile: str = "h100") -> float:
    """The `attention_efficiency` for which the built-in `profile` prices
    the published benchmarks of `kernel` too fast as often as too slow."""
    base = BUILTIN[profile](HOPPER_GEMM_EFFICIENCY)   # (attention_efficiency stands in for e_max)
    return efficiency_at_median_ratio_one(
        lambda efficiency: attention_ratios(
            dataclasses.replace(base, attention_efficiency=efficiency), kernel))


def efficiency_at_median_ratio_one(ratios_at, *, low: float = 1e-6,
                                   tolerance: float = 1e-7) -> float:
    """The fraction of the per-SM peak in (`low`, 1] at which the median of
    `ratios_at(fraction)` (predicted over measured seconds, which fall as
    the fraction rises) is 1: bisection on the logarithm (a CPU's fraction
    is tiny)."""
    high = 1.0
    while high / low > 1 + tolerance:
        mid = (low * high) ** 0.5
        if statistics.median(ratios_at(mid)) > 1:   # predicted slower than measured: raise it
            low = mid
        else:
            high = mid
    return (low * high) ** 0.5


def _e_max_reaching(tflops_at, target: float, tolerance: float, what: str) -> float:
    """Bisection on e_max in (0.01, 1] for `tflops_at(e_max)` = `target`
    (TFLOP/s rise monotonically with e_max)."""
    low, high = 0.01, 1.0
    if tflops_at(high) < target:
        raise ValueError(f"even at 100% of the per-SM peak {what} "
                         f"{tflops_at(high):.1f} < {target} TFLOP/s")
    while high - low > tolerance:
        mid = (low + high) / 2
        if tflops_at(mid) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2
