"""bench/packing.py: the harness that times packed sequences against one
conversation per sequence must train both layouts on the same
conversations, count the loss tokens each step really trained on, and
derive its ratios from the figures in its table. Run here on a tiny model
(a few seconds); the figures in bench/RESULTS.md come from the full script."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import packing  # noqa: E402  bench/packing.py

TINY = ["--seq", "512", "--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "128",
        "--batch", "2", "--conversations", "12", "--pairs", "2", "--kernel-seq", "256",
        "--kernel-pairs", "1"]


def test_the_chat_set_has_the_length_spread_and_prompt_share_asked_for():
    conversations = packing.chat_set(2000, 2048, 1000, seed=1)
    lengths = np.array([len(c.ids) for c in conversations])
    assert lengths.min() >= packing.MIN_LENGTH and lengths.max() == 2048  # the tail reaches s
    assert 250 < np.median(lengths) < 350 and np.percentile(lengths, 90) > 2 * np.median(lengths)
    in_loss = sum(int(c.loss_mask.sum()) for c in conversations) / lengths.sum()
    assert 0.55 < in_loss < 0.65                         # about 40% prompt
    assert all(c.loss_mask.any() and not c.loss_mask[0] for c in conversations)  # prompt first
    assert all(((c.ids >= 1) & (c.ids < 1000)).all() for c in conversations)   # never the pad id


def test_both_layouts_train_on_the_same_conversations_and_the_table_adds_up():
    args = packing.parser().parse_args(TINY)
    result = packing.train_both(args)
    conversations, runs = result["conversations"], result["runs"]
    # Loss tokens: each conversation's mask less its first token (nothing predicts it).
    want_loss_tokens = sum(int(c.loss_mask[1:].sum()) for c in conversations)
    want_tokens = sum(len(c.ids) for c in conversations)
    packed, unpacked = runs[packing.PACKED], runs[packing.UNPACKED]
    for run in (packed, unpacked):
        stats = run["stats"]
        assert stats.conversations == len(conversations) and stats.truncated == 0
        assert stats.loss_tokens == want_loss_tokens and stats.conversation_tokens == want_tokens
        assert len(run["times"]) == len(run["records"]) == args.pairs
        # Each timed step trained on the loss tokens of its samples (cycled in order).
        sequences = run["sequences"]
        for step, record in enumerate(run["records"], start=args.warmup):
            picked = [sequences[(step * args.batch + j) % len(sequences)]
                      for j in range(args.batch)]
            assert record["loss_tokens"] == int(sum(s.loss_mask.sum() for s in picked))
            assert np.isfinite(record["loss"]) and not record["skipped"]
    assert unpacked["stats"].sequences == len(conversations) > packed["stats"].sequences
    assert packed["stats"].padding_fraction < unpacked["stats"].padding_fraction

    summary = result["summary"]
    figures = summary["figures"]
    for name, run in runs.items():
        assert figures[name]["tokens_per_s"] == pytest.approx(
            args.batch * args.seq / np.median(run["times"]))
    fraction_gain = (packed["stats"].loss_token_fraction / unpacked["stats"].loss_token_fraction)
    assert summary["loss_tokens_ratio"] == pytest.approx(summary["tokens_ratio"] * fraction_gain)
    # Pair by pair: the unpacked step's time over the packed one's, times the fraction gain.
    assert summary["pair_ratios"] == pytest.approx(
        [u / p * fraction_gain for p, u in zip(packed["times"], unpacked["times"])])

    kernels = packing.kernel_comparison(args)
    text = packing.report(args, result, kernels, [("before", (1.0, 2.0, 3.0))])
    assert f"| {packing.PACKED} | {packed['stats'].sequences} |" in text
    assert f"| {packing.UNPACKED} | {len(conversations)} | 1.00 |" in text
    assert f"loss tokens/s **{summary['loss_tokens_ratio']:.2f}x**" in text
    assert "| 256 |" in text and "--seq 512" in text and "before 1.00, 2.00, 3.00" in text
