"""bench/moe.py on a tiny MoE GPT: the dense model it is compared with has
the closest active parameters, the one-process sides and the MoE layer's
looped and grouped experts compute the same numbers, the EP = 2 sides (one
job of two pooled processes) compute the one-process losses, the expert
memory of built Trainers equals the performance model's, and the report
renders every table. The timings are not judged (one run on a shared CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import moe  # noqa: E402  bench/moe.py

from ptdp.perf.analytic.counts import active_parameter_count  # noqa: E402

TINY = moe.moe_model(hidden=32, heads=4, layers=2, seq=16, vocab=128, experts=4, topk=2,
                     expert_ffn=32)
RUN = moe.Run(micro_batch=2, global_batch=4, iters=1, warmup=1, layer_iters=1)
LAYOUTS = ((1, 1, False), (2, 2, False), (2, 2, True))   # (EP, d, distributed optimizer)


def _on_two_ranks(rank, model, dense, run):
    """What the bench's 2- and 4-process jobs run, on the test pool's ranks."""
    return {"ep": moe.ep_sides(rank, model, dense, run),
            "held": moe.held_expert_memory(rank, model, LAYOUTS)}


def test_the_dense_model_has_the_closest_active_parameters():
    dense = moe.matched_dense(TINY)
    assert not dense.is_moe and dense.moe_ffn_hidden_size is None
    # 2 layers of 3h columns per unit of f; the router's h·E = 128 per layer.
    difference = active_parameter_count(dense) - active_parameter_count(TINY)
    assert (dense.ffn_hidden_size, difference) == (65, -64)
    assert abs(difference) <= 2 * 3 * 32 / 2
    # The benchmark's model: E = 8, h = 256, F = 256, k = 2: f = 2·256 + 3 (h·E = 8h ≈ 9h).
    assert moe.matched_dense(moe.moe_model()).ffn_hidden_size == 515


def test_the_sides_agree_and_the_report_renders(pools):
    dense = moe.matched_dense(TINY)
    one = moe.one_process(TINY, dense, RUN)
    assert list(one["times"]) == ["dense", "MoE", "MoE grouped GEMM"]
    assert all(len(times) == 1 for times in one["times"].values())
    assert one["losses"]["MoE grouped GEMM"] == pytest.approx(one["losses"]["MoE"], rel=1e-6)
    assert one["layer"]["grouped_used"] and one["layer"]["max_diff"] < 1e-5

    ranks = pools(2).run(_on_two_ranks, TINY, dense, RUN)
    ep = ranks[0]["ep"]
    assert list(ep["times"]) == list(moe.EP_SIDES)
    for side in moe.EP_SIDES:
        reference = one["losses"]["dense" if side.startswith("dense") else "MoE"]
        assert ep["losses"][side] == pytest.approx(reference, rel=moe.LOSS_RTOL), side
    assert ranks[1]["held"][0] is None   # EP = 1, d = 1: rank 1 is outside the layout

    memory = moe.memory_rows(TINY, [r["held"] for r in ranks], LAYOUTS)
    assert [row["ranks"] for row in memory] == [1, 2, 2]
    # 2 layers × 4 experts × 3·32·32 on one rank, half of them at EP = 2.
    assert [row["measured"]["parameters"] for row in memory] == [24576, 12288, 12288]
    for row in memory:
        assert row["ranks_agree"] and row["measured"] == row["model"], row

    text = moe.report(TINY, dense, RUN, one, ep, memory, "python bench/moe.py --tiny", 1.0)
    assert "expert load over the timed iterations: the busiest expert" in text
    assert "dense f=65" in text and "(-64; per layer the router's h·E = 128" in text
    for side in ("| 1 process | MoE grouped GEMM |", "| 2 processes | MoE EP=2 allgather |",
                 "| 2 processes | MoE EP=2 alltoall |"):
        assert side in text
    assert text.count("| yes (") == 6 and "**NO**" not in text
    assert "| --moe-grouped-gemm | grouped_mm |" in text
    assert "Dispatchers at EP = 2: alltoall / allgather iteration time **" in text
    assert "| 2 | 2 | 1 | plain | 12,288 / 12,288 |" in text and "| 0.500 |" in text
    assert "Measured equals the model in every figure" in text
