"""bench/lora.py: the harness that compares LoRA with full fine-tuning must
train both modes on the same model, hold the adapters alone in the buffer
with LoRA, and quote the memory model's state bytes equal to what the
Trainer holds. Run here on a tiny model in one process (a few seconds); the
figures in bench/RESULTS.md come from the full script."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import lora  # noqa: E402  bench/lora.py

from ptdp.model.adapters import adapter_shapes  # noqa: E402

TINY = ["--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "32", "--vocab", "256",
        "--steps", "1", "--pairs", "1", "--rank", "4"]


def test_both_modes_run_and_the_model_matches_the_measured_state():
    args = lora.parser().parse_args(TINY)
    runs = [lora.measure(args, mode, 1) for mode in lora.MODES]
    full, adapters = runs
    config = lora.config_for(args, "lora", 1)
    expected = sum(a * b for a, b in adapter_shapes(config.model, config.lora).values())
    assert adapters["trainable"] == expected < full["trainable"]
    for run in runs:
        measured, predicted = run["measured"], run["predicted"]
        for key in ("weights", "gradients", "optimizer"):
            assert predicted[key] == measured[key], (run["mode"], key)
        assert run["tokens_per_s"] > 0 and run["peak_rss"] > 0 and run["load"] >= 0
    assert full["measured"]["frozen"] == 0 < adapters["measured"]["frozen"]
    text = lora.table(args, [full, adapters, dict(full, d=2), dict(adapters, d=2)])
    assert text.count("| 1 | lora |") == 1 and "(exact)" in text
