"""The shape-based GEMM and fused-attention model (ptdp/perf/price/gemm.py), its use
in the GPU profiles (ptdp/perf/price/profiles.py) and the GPU calibration's fit
(ptdp/perf/calibrate/gpu.fit_tile_model)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from ptdp.config import ModelConfig
from ptdp.perf.price import gemm
from ptdp.perf.calibrate.gpu import fit_tile_model
from ptdp.perf.price.machine import Machine
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.price.profiles import HardwareProfile, load_profile

A100 = load_profile("a100")
DEVICE = A100.tiled_device("bf16")
CPU = HardwareProfile(name="cpu-test", kind="cpu", devices_per_server=256, peak_tflops=0.1,
                      peak_tflops_fp32=0.1, gemm_efficiency=0.8, gemm_ramp_seconds=2e-6,
                      memory_bandwidth=10e9, cores=4)


def _bytes_over_bandwidth(m, n, k, batch=1):
    return gemm.gemm_bytes(m, n, k, batch, 2) / DEVICE.memory_bandwidth


# ------------------------------------------------------------------ GEMMs

@pytest.mark.parametrize("axis", range(4))
def test_time_never_falls_as_a_dimension_grows(axis):
    sizes = [1, 7, 64, 100, 128, 129, 255, 256, 1000, 2048, 4096, 8193]
    for base in [(64, 64, 64, 1), (1024, 2048, 512, 2), (8192, 128, 8, 1), (300, 5000, 96, 24)]:
        times = []
        for size in sizes:
            shape = list(base)
            shape[axis] = size
            times.append(gemm.gemm_seconds(DEVICE, *shape))
        assert all(b >= a for a, b in zip(times, times[1:])), (base, axis, times)


def test_a_part_empty_last_wave_costs_a_whole_wave():
    sms, tile = DEVICE.sm_count, DEVICE.tile_m
    full = gemm.gemm_seconds(DEVICE, sms * tile, DEVICE.tile_n, 8192)      # tiles = SMs
    one_more = gemm.gemm_seconds(DEVICE, (sms + 1) * tile, DEVICE.tile_n, 8192)
    assert one_more / full == pytest.approx(2.0, rel=1e-6)
    # The same through the batch: 4 tiles each, 27 · 4 = 108 tiles vs 28 · 4 = 112.
    assert sms == 27 * 4
    assert (gemm.gemm_seconds(DEVICE, 2 * tile, 2 * DEVICE.tile_n, 8192, batch=28)
            == pytest.approx(2 * gemm.gemm_seconds(DEVICE, 2 * tile, 2 * DEVICE.tile_n, 8192,
                                                   batch=27)))


def test_never_faster_than_the_bytes_and_memory_bound_when_skinny():
    for m, n, k, batch in itertools.product((1, 64, 1000, 8192), (8, 512, 12288), (8, 96, 4096),
                                            (1, 16)):
        assert gemm.gemm_seconds(DEVICE, m, n, k, batch) >= _bytes_over_bandwidth(m, n, k, batch)
    # k = 8: 2·m·n·8 FLOPs on m·n outputs written, far below the machine balance.
    assert gemm.gemm_seconds(DEVICE, 8192, 8192, 8) == _bytes_over_bandwidth(8192, 8192, 8)
    assert gemm.gemm_compute_seconds(DEVICE, 8192, 8192, 8) < _bytes_over_bandwidth(8192, 8192, 8)


def test_large_square_gemms_approach_e_max_and_small_ones_fall_far_below():
    e_max = A100.gemm_efficiency
    assert gemm.gemm_efficiency(DEVICE, 16384, 16384, 16384) == pytest.approx(e_max, rel=0.01)
    assert gemm.gemm_efficiency(DEVICE, 16384, 16384, 16384) <= e_max
    # Small: one wave, mostly idle SMs; skinny: the tile's fixed cost or the bytes dominate.
    for shape in [(256, 256, 256), (128, 128, 64), (8192, 8192, 8), (16384, 64, 16384)]:
        assert gemm.gemm_efficiency(DEVICE, *shape) < 0.3 * e_max, shape
    # K amortises the fixed cost per tile: the same output, a longer k, closer to e_max.
    short, long = (gemm.gemm_efficiency(DEVICE, 16384, 16384, k) for k in (128, 8192))
    assert short < 0.9 * long


def test_profile_gemm_seconds_uses_the_tile_model_on_gpus():
    assert A100.gemm_seconds(4096, 4096, 4096) == gemm.gemm_seconds(DEVICE, 4096, 4096, 4096)
    fp32 = A100.tiled_device("fp32")
    assert A100.gemm_seconds(4096, 4096, 4096, precision="fp32", bytes_per_element=4) == (
        gemm.gemm_seconds(fp32, 4096, 4096, 4096, bytes_per_element=4))
    h100 = load_profile("h100")
    assert (h100.sm_count, h100.gemm_tile, h100.fused_attention) == (132, (128, 256), True)
    assert (A100.sm_count, A100.gemm_tile, A100.fused_attention) == (108, (128, 128), True)


def test_cpu_profiles_keep_the_saturating_roofline():
    for m, n, k, batch, precision, E in [(64, 64, 64, 1, "fp32", 4),
                                         (256, 1024, 256, 8, "fp32", 4),
                                         (2048, 2048, 2048, 1, "bf16", 2),
                                         (128, 128, 8, 1, "fp32", 4)]:
        work = 2.0 * m * n * k * batch
        peak = CPU.peak_flops(precision)
        efficiency = CPU.gemm_efficiency * work / (work + peak * CPU.gemm_ramp_seconds)
        expected = max(work / (peak * efficiency),
                       batch * (m * k + k * n + m * n) * E / CPU.memory_bandwidth)
        assert CPU.gemm_seconds(m, n, k, batch=batch, precision=precision,
                                bytes_per_element=E) == expected
    assert not CPU.fused_attention


def test_profiles_without_the_new_fields_still_load(tmp_path):
    data = A100.to_dict()
    for key in ("sm_count", "gemm_tile", "tile_overhead_seconds", "fused_attention"):
        data.pop(key)
    old = HardwareProfile.from_dict(data)
    assert old.gemm_tile == (128, 128) and old.sm_count == 108 and not old.fused_attention
    path = tmp_path / "p.json"
    path.write_text(json.dumps(A100.to_dict()))
    assert HardwareProfile.from_dict(json.loads(path.read_text())) == A100


# ------------------------------------------------------------------ fused attention

def test_attention_grows_with_the_square_of_the_sequence_and_causal_is_half():
    for s in (2048, 4096, 8192):
        forward, backward = A100.attention_seconds(64, s, 128)
        double = A100.attention_seconds(64, 2 * s, 128)
        assert double[0] / forward == pytest.approx(4, rel=0.1)
        assert double[1] / backward == pytest.approx(4, rel=0.1)
        full = A100.attention_seconds(64, s, 128, causal=False)
        assert forward / full[0] == pytest.approx(0.5, abs=0.05)
        assert backward / full[1] == pytest.approx(0.5, abs=0.05)
        assert backward > 2 * forward


def test_attention_respects_its_memory_traffic():
    bh, s, d = 32, 1024, 128
    forward, backward = gemm.attention_seconds(DEVICE, bh, s, d)
    vector = bh * s * d * 2
    assert forward >= (4 * vector + 4 * bh * s) / DEVICE.memory_bandwidth
    assert backward >= (8 * vector + 8 * bh * s) / DEVICE.memory_bandwidth
    # Very short sequences: bound by the bytes, not by the block products.
    slow_memory = dataclasses.replace(DEVICE, memory_bandwidth=1e9)
    forward, _ = gemm.attention_seconds(slow_memory, bh, 128, d)
    assert forward == (4 * bh * 128 * d * 2 + 4 * bh * 128) / 1e9


def test_fused_attention_replaces_the_score_and_context_gemms_in_the_layer():
    model = ModelConfig(num_layers=2, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                        vocab_size=51200)
    workload, layout = Workload(model, global_batch=8, precision="bf16"), Layout(t=2, b=2)

    def layer(profile):
        ops = OperatorModel(workload, layout, profile, Machine(layout, profile))
        return ops, ops.layer_forward().total_work, ops.layer_backward().total_work

    fused, f_fused, b_fused = layer(A100)
    plain, f_plain, b_plain = layer(dataclasses.replace(A100, fused_attention=False))
    shapes = plain.layer_gemms()
    core_forward = (plain.gemm(*shapes["scores"][:3], shapes["scores"][3])
                    + plain.gemm(*shapes["context"][:3], shapes["context"][3])
                    + plain.memory_ops_seconds(plain.attention_core_ops(), False))
    attention_forward, attention_backward = A100.attention_seconds(2 * 16 // 2, 2048, 128)
    assert f_fused == pytest.approx(f_plain - core_forward + attention_forward)
    assert fused.attention_core_ops() == []
    assert b_fused < b_plain and attention_backward > 0
    # Zero-bubble: B + W is the fused backward, the attention backward in B.
    b, w = fused.layer_backward_parts()
    assert b.total_work + w.total_work == pytest.approx(b_fused)
    assert b.total_work > attention_backward


# ------------------------------------------------------------------ calibrate's fit

def test_fit_tile_model_recovers_the_parameters_from_synthetic_timings():
    truth = dataclasses.replace(DEVICE, achievable_fraction=0.71, tile_overhead_seconds=1.7e-6)
    shapes = [(m, n, k) for m in (1024, 4096, 16384) for n in (1024, 4096, 12288)
              for k in (128, 1024, 8192)] + [(8192, 8192, 8)]      # one memory-bound, left out
    noise = itertools.cycle((1.0, 1.01, 0.99, 1.005))
    rows = [{"m": m, "n": n, "k": k, "seconds": gemm.gemm_seconds(truth, m, n, k) * next(noise)}
            for m, n, k in shapes]
    overhead, fraction = fit_tile_model(rows, truth.peak_flops, truth.sm_count,
                                        (truth.tile_m, truth.tile_n), truth.memory_bandwidth)
    assert fraction == pytest.approx(0.71, rel=0.02)
    assert overhead == pytest.approx(1.7e-6, rel=0.2)
    exact = [dict(row, seconds=gemm.gemm_seconds(truth, row["m"], row["n"], row["k"]))
             for row in rows]
    overhead, fraction = fit_tile_model(exact, truth.peak_flops, truth.sm_count,
                                        (truth.tile_m, truth.tile_n), truth.memory_bandwidth)
    assert (overhead, fraction) == (pytest.approx(1.7e-6, rel=1e-6), pytest.approx(0.71, rel=1e-9))


def test_fit_tile_model_needs_compute_bound_timings():
    with pytest.raises(ValueError, match="compute-bound"):
        fit_tile_model([{"m": 8192, "n": 8192, "k": 8, "seconds": 1e-4}], DEVICE.peak_flops,
                       DEVICE.sm_count, (128, 128), DEVICE.memory_bandwidth)
    assert math.isfinite(fit_tile_model(
        [{"m": 4096, "n": 4096, "k": 4096, "seconds": 1e-3},
         {"m": 8192, "n": 8192, "k": 8192, "seconds": 8e-3}], DEVICE.peak_flops,
        DEVICE.sm_count, (128, 128), DEVICE.memory_bandwidth)[1])
