"""bench/context_parallel.py on a tiny Llama-like model: the search finds the
longest length that fits, a rank at c = 2 holds half of one process's saved
activations, the three --cp-comm-type Trainers compute the same losses, and
the report renders. The memory figures and timings themselves are not judged
(one run in a long-lived process on a shared CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import context_parallel as cp  # noqa: E402  bench/context_parallel.py

TINY = cp.llama_model(hidden=64, layers=1, heads=4, groups=2, ffn=172, vocab=256)
SEQ = 1024
BUDGET_MIB = 1


def test_the_search_doubles_then_bisects():
    tried = []

    def fits(seq):
        tried.append(seq)
        return seq <= 5000

    assert cp.search(fits, 1024, 4, 256, limit=65536) == (4864, 5120)
    assert tried == [1024, 2048, 4096, 8192, 6144, 5120, 4608, 4864]
    tried.clear()
    assert cp.search(fits, 8192, 4, 256, limit=65536) == (None, 8192)   # nothing fits
    assert tried == [8192]
    tried.clear()
    assert cp.search(fits, 1024, 0, 256, limit=65536) == (4096, 8192)   # doubling only
    tried.clear()
    assert cp.search(fits, 1024, 4, 256, limit=4096) == (4096, None)    # all fit up to the limit
    assert tried == [1024, 2048, 4096]


def _on_two_ranks(rank):
    return {"memory": cp.step_memory(TINY, 2, SEQ),
            "search": cp.longest_within(rank, TINY, 2, BUDGET_MIB * cp.MIB, 128, 1, 1024),
            "timing": cp.comm_times(rank, cp.llama_model(hidden=64, layers=1, heads=4, groups=2,
                                                         ffn=172, vocab=256, seq=256), 2, 0, 1)}


def test_a_context_rank_saves_half_and_the_report_renders(pools):
    one = cp.step_memory(TINY, 1, SEQ)
    two = pools(2).run(_on_two_ranks)
    # Every figure is the largest over the ranks: the same on both, and so the search's steps.
    assert [r["memory"] for r in two] == [two[0]["memory"]] * 2
    assert [r["search"] for r in two] == [two[0]["search"]] * 2
    two = two[0]
    # Every activation of a rank holds s/c positions: half of one process's bytes.
    assert two["memory"]["saved"] / one["saved"] == pytest.approx(0.5, abs=0.05)
    assert two["memory"]["loss"] == pytest.approx(one["loss"], rel=1e-5)

    search = two["search"]
    budget = BUDGET_MIB * cp.MIB
    fitting = [t["seq"] for t in search["trials"] if t["above"] <= budget]
    assert search["longest"] == max(fitting, default=None)
    assert all(t["above"] > budget for t in search["trials"] if t["seq"] == search["first_over"])
    assert max(t["seq"] for t in search["trials"]) <= 1024
    assert search["kernel"] in cp.KERNEL_OPS

    timing = two["timing"]
    assert cp.same_losses(timing["losses"]) and list(timing["times"]) == list(cp.COMM_TYPES)
    assert all(len(times) == 1 for times in timing["times"].values())
    broken = {**timing["losses"], "a2a": [timing["losses"]["a2a"][0] * (1 + 1e-3)]}
    assert not cp.same_losses(broken)

    serial = {"c": 1, "longest": 1024, "first_over": 2048, "kernel": search["kernel"],
              "trials": [{"seq": 1024, "above": 3 * cp.MIB, "saved": cp.MIB, "peak": 9 * cp.MIB,
                          "loss": 5.5}]}
    args = cp.build_parser().parse_args(["-c", "2", "--budget-mib", "4"])
    args.load = (1.0, 2.0)
    text = cp.report(args, TINY, [serial, {**search, "longest": 2048}], timing, "python x")
    assert "**1,024 tokens at c = 1, 2,048 at c = 2 (p2p), 2.00×**" in text
    assert f"so the ratio is between {2048 / 2048:.2f} and " in text
    assert "| 1 | 1,024 | 3 | 1 | 9 | yes |" in text
    assert "| p2p |" in text and "| 1.000 |" in text and "| a2a |" in text


# ------------------------------------------------------------------ the training page's command

def _train_on_rank(rank, config):
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import train

    ctx = ParallelContext.build(RankGrid(tp=1, dp=1, pp=1, cp=4))
    return [record["loss"] for record in train(config, ctx, cp.CPU)]


def test_the_long_context_command_trains_as_one_process(pools):
    """docs/training.md's c = 4 command, its flags through ptdp's own parser and
    checks, trained by ptdp's training loop on the session's four pooled
    ranks (a launch of four fresh processes costs 20 s on two cores; the
    launcher is tested on its own). Only the sequence is shortened, to a
    length the same rules accept; its losses equal one process's."""
    import dataclasses
    import shlex

    from ptdp import cli
    from ptdp.commands.train import config_from_args
    from ptdp.config import validate
    from ptdp.parallel.topology import ParallelContext
    from ptdp.train.loop import Trainer
    from tests.doc_commands import commands

    (command,) = commands("long-context")
    words = shlex.split(command, comments=True)
    assert Path(words[0]).name == "ptdp" and words[1] == "train"
    config = config_from_args(cli.build_parser().parse_args(words[1:]))
    parallel, model = config.parallel, config.model
    assert (parallel.context_parallel_size, parallel.cp_comm_type, parallel.world_size) == \
        (4, "p2p", 4)
    # The bench's model, at the length the bench found within its budget at c = 4.
    assert dataclasses.replace(model, seq_length=1024) == dataclasses.replace(
        cp.train_config(cp.llama_model(seq=1024), 4).model)
    assert model.seq_length == 16384
    config.model = dataclasses.replace(model, seq_length=256)
    validate(config, world_size=4)

    losses = pools(4).run(_train_on_rank, config)[0]
    assert len(losses) == config.train.train_iters == 2

    serial = dataclasses.replace(config, parallel=dataclasses.replace(parallel,
                                                                      context_parallel_size=1))
    trainer = Trainer(serial, ParallelContext.single(), cp.CPU)
    assert losses == pytest.approx([trainer.step(i)[0]["loss"] for i in range(2)], rel=1e-5)
