"""Loss spikes never cost the good checkpoint (issue 30, item 2): a
checkpoint is good once the iteration after it had a loss in the run's
normal range (ptdp/train/loss_range.py); --keep-last keeps the newest good
one, and a divergence names it and points `latest` back at it.

The two sequences of the issue run in-process on one process with the tiny
flag set (4 layers, h 32, s 32, V 512, micro batch 2, global batch 8)."""

import json
import math
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.train.loss_range import WINDOW, LossRange

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
        "32", "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--mock-data", "--log-interval", "1"]


def _names(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir())


# ------------------------------------------------------------------ the rule

def test_the_first_finite_loss_is_in_range_and_a_doubling_is_not():
    watch = LossRange()
    assert watch.observe(1, 6.0) is None and watch.limit() == 12.0
    assert watch.observe(2, 11.9) is None          # below 6 + 6 (median of [6]): in range
    said = watch.observe(3, 100.0)                  # median 8.95, limit 17.9
    assert said.startswith("ptdp: warning: iteration 3: the loss 100 left its normal range")
    assert watch.left_at == 3 and watch.recent == [6.0, 11.9]   # out of range: not in the window
    assert watch.observe(4, 1e12) is None           # still out: said once
    assert watch.observe(5, 7.0).startswith("ptdp: iteration 5: the loss 7 is back")
    assert watch.left_at is None and watch.recent == [6.0, 11.9, 7.0]


def test_small_losses_need_a_jump_of_a_nat():
    watch = LossRange([0.02] * 5)
    assert watch.limit() == pytest.approx(1.02)
    assert watch.observe(6, 0.9) is None and watch.left_at is None


def test_non_finite_losses_are_out_of_range_and_the_window_is_bounded():
    watch = LossRange()
    watch.observe(1, math.nan)
    assert watch.left_at == 1 and watch.recent == []
    for i in range(2, 2 + 2 * WINDOW):
        watch.observe(i, 5.0 + i / 1000)
    assert len(watch.recent) == WINDOW and watch.recent[-1] == 5.0 + (1 + 2 * WINDOW) / 1000


def test_a_checkpoint_is_good_only_once_the_iteration_after_it_is_in_range(tmp_path):
    watch = LossRange()
    watch.observe(1, 6.0)
    watch.saved(tmp_path / "iter_0000001")
    assert watch.good is None                        # not yet known
    watch.observe(2, 6.1)
    assert watch.good == tmp_path / "iter_0000001"
    watch.saved(tmp_path / "iter_0000002")
    watch.observe(3, 1e9)                            # iter_2's weights are bad
    watch.saved(tmp_path / "iter_0000003")
    watch.observe(4, 6.0)                            # back in range: iter_3 is good after all
    assert watch.good == tmp_path / "iter_0000003"


def test_the_watch_travels_in_the_checkpoint(tmp_path):
    (tmp_path / "iter_0000004").mkdir()
    watch = LossRange([6.0, 6.1], left_at=6, good=tmp_path / "iter_0000004")
    metadata = {"loss_range": json.loads(json.dumps(watch.record()))}
    loaded = LossRange.loaded(tmp_path / "iter_0000006", metadata)
    assert (loaded.recent, loaded.left_at, loaded.good, loaded.pending) == (
        [6.0, 6.1], 6, tmp_path / "iter_0000004", tmp_path / "iter_0000006")
    assert "saved while the training loss was outside its normal range (since iteration 6)" in \
        loaded.load_warning(tmp_path / "iter_0000006")
    # A name that is not a checkpoint beside it is not taken.
    metadata["loss_range"]["good"] = "../elsewhere/iter_0000001"
    assert LossRange.loaded(tmp_path / "iter_0000006", metadata).good is None


# ------------------------------------------------------------------ the sequences

def test_a_spike_after_a_resume_keeps_the_good_checkpoint_and_latest_goes_back_to_it(tmp_path, capsys):
    """Resume a good iter_4 with --lr 1e6 --clip-grad 0 --keep-last 1 (and
    --override-opt_param-scheduler: another schedule than the checkpoint's),
    saving every iteration: iteration 5's step ruins the weights, iteration
    6's loss leaves its range still finite, so iter_6 is saved; iteration 7
    diverges. iter_4 must survive, the
    error must name it (not call iter_5 untouched), and `latest` must name
    it, so that resuming with the normal --lr trains on from good weights."""
    save = tmp_path / "X"
    assert main(["train", *TINY, "--lr", "1e-3", "--save", str(save), "--train-iters", "4"]) == 0
    capsys.readouterr()
    assert main(["train", *TINY, "--load", str(save), "--save", str(save), "--lr", "1e6",
                 "--clip-grad", "0", "--lr-warmup-iters", "0", "--save-interval", "1",
                 "--keep-last", "1", "--train-iters", "10", "--override-opt_param-scheduler"]) == 1
    err = capsys.readouterr().err
    assert "iteration 6: the loss" in err and "left its normal range" in err
    assert f"the newest checkpoint known good is {save}/iter_0000004" in err
    assert "`latest` now names it" in err and "untouched" not in err
    assert _names(save) == ["iter_0000004", "iter_0000006", "latest"]
    assert resolve(save).name == "iter_0000004"
    assert read_metadata(save / "iter_0000006")["loss_range"]["good"] == "iter_0000004"

    assert main(["train", *TINY, "--load", str(save), "--save", str(save), "--lr", "1e-3",
                 "--train-iters", "6", "--override-opt_param-scheduler"]) == 0
    out, err = capsys.readouterr()
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines()
              if line.startswith("iteration ")]
    assert len(losses) == 2 and all(loss < 7 for loss in losses), out
    assert "abandoned" in _names(save) and resolve(save).name == "iter_0000006"


def test_keep_last_keeps_the_good_checkpoint_without_a_resume(tmp_path, capsys):
    """A learning rate warming up to absurd values (0.25 more each
    iteration, from 0 at the first as in Megatron-LM): the loss leaves its
    range at iteration 5, so iter_3 (the last checkpoint whose next
    iteration was in range) outlives --keep-last 2."""
    save = tmp_path / "Y"
    assert main(["train", *TINY, "--save", str(save), "--lr", "1e6", "--lr-warmup-iters", "4000000",
                 "--lr-decay-style", "constant", "--clip-grad", "0", "--save-interval", "1",
                 "--keep-last", "2", "--train-iters", "6"]) == 0
    err = capsys.readouterr().err
    assert "iteration 5: the loss" in err and "left its normal range" in err
    assert _names(save) == ["iter_0000003", "iter_0000005", "iter_0000006", "latest"]
    assert f"the newest checkpoint known good is {save}/iter_0000003 (--keep-last never removes " \
        "it)" in err
    assert read_metadata(save / "iter_0000006")["loss_range"]["left_at"] == 5
