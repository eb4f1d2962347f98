"""bench/peers.py: the harness that times ptdp against PyTorch's own
parallelism must first see both sides compute the same losses. Run here on a
tiny GPT, one row of each kind (a few seconds each); the figures in
bench/RESULTS.md come from the full script."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import peers  # noqa: E402  bench/peers.py

from ptdp.schedules.split import LayerSplit  # noqa: E402
from ptdp.perf.price.profiles import HardwareProfile  # noqa: E402


# The 3-D row (pipelining + DTensor + FSDP2, 8 processes a side) is left to
# the benchmark itself, which checks every row's losses before it times it:
# here it would cost half a minute of the suite.
ROWS = [
    peers.Row("pipeline", p=2, v=2),                      # ScheduleInterleaved1F1B
    peers.Row("pipeline", p=2, schedule="gpipe"),          # ScheduleGPipe
    peers.Row("tensor", t=2),                              # DTensor + loss_parallel
    peers.Row("pipeline", p=2, split=LayerSplit(first=3)),  # Schedule1F1B, stages of 3 and 5 layers
]
# The benchmark's own launch (run_row: fresh processes a row) for one row;
# the others on the test pool's ranks (the same run_sides, without the
# processes' start-up).
LAUNCHED = ROWS[1]


def _row_on_the_pool(rank, row):
    return peers.run_sides(row, peers.TINY_MODEL, iters=2, warmup=1)


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.describe().replace(" ", "-"))
def test_both_sides_compute_the_same_losses(pools, row):
    if row is LAUNCHED:
        result = peers.run_row(row, peers.TINY_MODEL, iters=2, warmup=1)
    else:
        ranks = pools(row.world).run(_row_on_the_pool, row)[0]
        result = peers.summarise(row, peers.TINY_MODEL, ranks, load=((0.0,) * 3,) * 2)
    ours, theirs = result["ours_losses"], result["theirs_losses"]
    assert len(ours) == len(theirs) == 3
    assert result["same_loss"], (ours, theirs)
    assert ours[-1] < ours[0]                    # training moves: the losses compared are not a constant
    assert result["ours_tokens_per_s"] > 0 and result["theirs_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["theirs_s"] / result["ours_s"])


SHARDED_MODEL = replace(peers.TINY_MODEL, num_layers=2)


def _sharded_row(rank, strategy):
    row = peers.Row("sharded", d=2, strategy=strategy, memory=True)
    return peers.run_sides(row, SHARDED_MODEL, iters=1, warmup=0)


# Bytes per parameter of the one-process model each side holds at d = 2
# (fp32, Adam): FSDP2 half of parameters, gradients and two moments under
# either setting; ours under ZeRO-2 every parameter, half the gradients and
# half of main weights + moments, under ZeRO-3 half of each (its fp32
# parameter shard is the optimizer's main copy).
@pytest.mark.parametrize("strategy, ours_per_param", [
    ("optim_grads", {"params": 4, "grads": 2, "optimizer": 6}),
    ("optim_grads_params", {"params": 2, "grads": 2, "optimizer": 4}),
])
def test_the_sharded_rows_measure_what_each_side_holds(pools, strategy, ours_per_param):
    """ptdp's ZeRO-2/3 against FSDP2 at d = 2 on a two-layer GPT, on the
    test pool's two ranks: the same losses, each side's bytes against the
    parameter count N of the one-process model, and step peaks that hold
    what each side gathers: FSDP2's root unit (the word embedding, counted
    through its storages' resize_), ours its full gradients (the buffer's
    own count) and under ZeRO-3 its gathered ends too."""
    row = peers.Row("sharded", d=2, strategy=strategy, memory=True)
    ranks = pools(2).run(_sharded_row, strategy)[0]
    result = peers.summarise(row, SHARDED_MODEL, ranks, load=((0.0,) * 3,) * 2)
    assert len(result["ours_losses"]) == 2 and result["same_loss"], result
    n = sum(t.numel() for t in peers._logical_weights(SHARDED_MODEL, seed=1234).values())
    ours, theirs = result["memory"]["ours"], result["memory"]["theirs"]
    expected = {"ours": ours_per_param, "theirs": {"params": 2, "grads": 2, "optimizer": 4}}
    for side, per_param in expected.items():
        for key, nbytes in per_param.items():
            # padding to a multiple of d, and torch's step counters
            assert result["memory"][side][key] == pytest.approx(nbytes * n, rel=1e-3), (side, key)
    for side in (ours, theirs):
        assert side["total"] == side["params"] + side["grads"] + side["optimizer"] == side["start"]
    word_embedding = 4 * SHARDED_MODEL.vocab_size * SHARDED_MODEL.hidden_size
    assert ours["peak"] >= ours["start"] + ours["peak_full_grad_bytes"] > ours["start"]
    assert theirs["peak"] >= theirs["start"] + word_embedding
    if strategy == "optim_grads":  # FSDP2 keeps every layer gathered to its backward
        assert theirs["peak"] >= theirs["start"] + 4 * n
        # ours: a layer's gradients being filled and two being reduced, not the model's
        assert 0 < ours["peak_full_grad_bytes"] < 4 * n
    else:
        assert ours["peak"] >= ours["start"] + word_embedding


def test_a_row_ptdp_refuses_is_skipped_with_its_reason():
    reason = peers.refusal(peers.Row("sharded", d=3, strategy="optim_grads"), peers.TINY_MODEL)
    assert reason is not None and "--global-batch-size 16 is not divisible" in reason
    assert peers.refusal(peers.Row("sharded", d=2, strategy="optim_grads"), peers.TINY_MODEL) is None
    zero3 = [row for row in peers.SECTIONS["sharded"] if row.strategy == "optim_grads_params"]
    assert {row.d for row in zero3} == {2, 4} and all(row.reshard_after_forward for row in zero3)
    assert peers.Row("3d", d=2, distributed_optimizer=True).strategy == "optim"
    with pytest.raises(ValueError, match="choose from"):
        peers.Row("sharded", d=2, strategy="zero3")


def test_a_loss_difference_is_caught():
    assert peers.loss_difference([2.0, 1.5], [2.0, 1.5]) == 0.0
    assert peers.loss_difference([2.0, 1.5], [2.0, 1.5 * (1 + 1e-3)]) > peers.LOSS_RTOL
    assert math.isinf(peers.loss_difference([2.0, float("nan")], [2.0, 1.5]))
    assert math.isinf(peers.loss_difference([2.0], [2.0, 1.5]))
    assert math.isinf(peers.loss_difference([], []))


def test_the_balanced_rows_take_the_split_the_planner_predicts_fastest():
    """On a CPU whose output layer (V = 8192) costs several layers, the
    pipeline rows with one chunk per rank get a split that takes layers off
    the last stage; the interleaved rows have none (uneven splits are
    refused there)."""
    cpu = HardwareProfile(name="cpu-test", kind="cpu", devices_per_server=256, peak_tflops=0.1,
                          peak_tflops_fp32=0.1, gemm_efficiency=1.0, gemm_ramp_seconds=2e-6,
                          memory_bandwidth=10e9, intra_bandwidth=1e9, intra_latency=1e-4,
                          inter_bandwidth=1e9, inter_latency=1e-4, launch_overhead=3e-6, cores=4)
    balanced = peers.balanced_rows(peers.SECTIONS["pipeline"], peers.MODEL, cpu)
    assert balanced and all(row.v == 1 and not row.split.even for row in balanced)
    for row in balanced:
        counts = [int(n) for n in row.describe().split("layers ")[1].split(",")]
        assert sum(counts) == peers.MODEL.num_layers and counts[-1] < max(counts), row.describe()
