"""bench/zero_bubble.py: the harness that times ptdp's zero-bubble schedules
against 1F1B and PyTorch's own zero-bubble schedules must first see every
side compute the same losses. Run here on a tiny GPT at p = 2, one job of
two processes (a few seconds); the figures in bench/RESULTS.md come from the
full script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import peers  # noqa: E402  bench/peers.py
import zero_bubble  # noqa: E402  bench/zero_bubble.py


def test_every_side_computes_the_same_losses_and_the_table_renders():
    results = zero_bubble.run_p(2, peers.TINY_MODEL, iters=1, warmup=1)
    assert [r["layout"] for r in results] == ["p=2 1f1b", "p=2 interleaved v=2", "p=2 zb-h1", "p=2 zbv"]
    assert [r["peer"] for r in results] == ["Schedule1F1B", "ScheduleInterleaved1F1B",
                                            "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]
    for r in results:
        assert r["peer_error"] is None, r["peer_error"]
        assert len(r["ours_losses"]) == len(r["theirs_losses"]) == 2
        assert r["same_loss"], (r["layout"], r["ours_losses"], r["theirs_losses"])
        assert r["ratio"] == pytest.approx(r["theirs_s"] / r["ours_s"])
        assert r["predicted_s"] > 0 and r["predicted_slowest_s"] > 0
    # zbv's loss is on rank 0, the others' on rank 1: all were found, and agree.
    assert results[3]["ours_losses"] == pytest.approx(results[0]["ours_losses"], rel=peers.LOSS_RTOL)
    assert results[0]["gain"] == 0.0
    # zb-h1 holds 1F1B's activations from F to B on every rank (p - r); W only under zero bubble.
    stored = [[c["peak_stored"] for c in results[i]["costs"]] for i in (0, 2)]
    assert stored == [[2, 1], [2, 1]]
    assert all(c["W"] > 0 for c in results[2]["costs"]) and all(c["W"] == 0 for c in results[0]["costs"])
    table = zero_bubble.time_table(results)
    assert table.count("\n") == 5 and "ScheduleZBVZeroBubble" in table and "**NO**" not in table
    assert "p=2 zbv | 1 |" in zero_bubble.cost_table(results)


def test_memory_is_measured_per_rank_and_judged():
    memory = zero_bubble.run_memory(2, peers.TINY_MODEL, iters=1, warmup=1,
                                    schedules=(("1f1b", 1), ("zb-h1", 1)))
    assert list(memory) == ["p=2 1f1b", "p=2 zb-h1"]
    for ranks in memory.values():
        assert [r["peak_stored"] for r in ranks] == [2, 1]
        # The high-water mark is reset to the RSS of that moment and the
        # baseline read just after: the RSS can rise in between and fall
        # again through madvise, which does not move the mark; allow 1 %.
        assert all(r["peak"] >= 0.99 * r["baseline"] > 0 for r in ranks)
    assert [r["peak_awaiting_weight_grads"] for r in memory["p=2 zb-h1"]] == [2, 2]
    assert "| p=2 zb-h1 | 1 |" in zero_bubble.memory_table(memory)
    assert "equal 1F1B's on every rank" in zero_bubble.memory_verdict(memory, 2)


def test_the_memory_verdict():
    def ranks(*peaks):
        return [{"peak": peak, "baseline": peak - 10, "reset": True, "peak_stored": 2 - rank,
                 "peak_awaiting_weight_grads": 2} for rank, peak in enumerate(peaks)]
    memory = {"p=2 1f1b": ranks(400, 360), "p=2 zb-h1": ranks(404, 380)}
    verdict = zero_bubble.memory_verdict(memory, 2)
    assert "equal 1F1B's" in verdict and "+1.0% against 1F1B (within 10 %)" in verdict
    assert "at most 5.6% apart (within" in verdict
    memory["p=2 zb-h1"] = ranks(404, 460)
    assert "+15.0% against 1F1B (**outside** 10 %)" in zero_bubble.memory_verdict(memory, 2)
    memory["p=2 zb-h1"][1]["peak_stored"] = 2
    assert "**differ from**" in zero_bubble.memory_verdict(memory, 2)
