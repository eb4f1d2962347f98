"""bench/reshard.py: the harness that times ZeRO-3's two reshard policies
must see both compute the same losses before any time counts, find the
policy's difference in the whole parameters a rank holds at once, and quote
the performance model beside it. Run here in --tiny mode on the session's
pool of 4 gloo processes (a few seconds; the bench itself starts a fresh job
per run); the figures in bench/RESULTS.md come from the full script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import reshard  # noqa: E402  bench/reshard.py


def _rank_figures(rank: int, flags: list[str]) -> dict:
    # The pool's processes may have started before bench/ was on sys.path.
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import reshard as bench

    return bench.rank_figures(flags)


def test_both_policies_agree_and_the_tables_render(pools):
    args = reshard.resolve(reshard.parser().parse_args(["--tiny"]))
    pool = pools(reshard.WORLD)
    results = [reshard.run_row(args, name, p, layout,
                               runner=lambda flags: pool.run(_rank_figures, flags))
               for name, p, layout in reshard.rows(1)]
    assert [r["name"] for r in results] == ["p=2 d=2 1f1b", "p=2 d=2 interleaved v=2", "p=1 d=4"]
    for row in results:
        # The same losses under both policies, every iteration, found on the last stage.
        assert len(row["losses"]) == args.iters + 1 and None not in row["losses"]
        assert row["loss_max_rel_diff"] <= reshard.LOSS_RTOL
        reshard_, keep = row["policies"]["reshard"], row["policies"]["keep"]
        assert row["ratio"] == pytest.approx(keep["ms"] / reshard_["ms"])
        for policy in (reshard_, keep):
            assert policy["ms"] > 0 and len(policy["run_ms"]) == args.pairs
            assert len(policy["peak_memory"]) == len(policy["vm_hwm"]) == reshard.WORLD
            assert all(m > 0 for m in policy["peak_memory"])
            assert len(policy["predicted"]["memory"]) == row["p"]
            assert policy["predicted"]["seconds"] > 0
        # Keeping holds every layer of the rank at once; resharding a layer
        # or two beside the chunk's ends (4 layers, 1 or 2 per rank here).
        if row["p"] == 1:
            assert all(k > r for k, r in zip(keep["full_param_bytes"], reshard_["full_param_bytes"]))
        assert all(k >= r > 0 for k, r in zip(keep["full_param_bytes"], reshard_["full_param_bytes"]))
        # The model: keeping costs the weights of the layers not gathered.
        predicted_weights = [[r["weights"] for r in policy["predicted"]["memory"]]
                             for policy in (reshard_, keep)]
        assert all(k >= r for r, k in zip(*predicted_weights))
    # Whole-parameter bytes agree across the data-parallel replicas of a stage.
    keep = results[2]["policies"]["keep"]["full_param_bytes"]
    assert len(set(keep)) == 1
    text = reshard.table(args, results)
    assert text.count("| reshard |") == 3 and text.count("| keep |") == 3
    assert text.count("yes (") == 3 and "ptdp train --num-layers 4" in text


def test_losses_that_differ_stop_the_row():
    args = reshard.resolve(reshard.parser().parse_args(["--tiny"]))
    figures = {"seconds": [0.1], "peak_memory": 1, "vm_hwm": 1, "full_param_bytes": 1}
    calls = []

    def runner(flags):
        calls.append(flags)
        loss = 5.0 * (1 + 1e-4 * (len(calls) - 1))   # the second run drifts by 1e-4
        return [dict(figures, losses=[None, None])] * 3 + [dict(figures, losses=[loss, loss])]
    with pytest.raises(AssertionError, match="losses differ by 1.00e-04 relative"):
        reshard.run_row(args, "p=1 d=4", 1, [], runner=runner)
    assert [flags[-1] for flags in calls] == ["--fsdp-reshard-after-forward",
                                              "--no-fsdp-reshard-after-forward"]
