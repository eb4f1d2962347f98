"""bench/attention.py: the windowed-against-full comparison checks the
windowed kernel against the dense reference before timing, and reports the
shares the planner prices. Run here in its --tiny form (well under a
second of attention); the figures in bench/RESULTS.md come from the full
script. No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import attention  # noqa: E402  bench/attention.py


def test_the_tiny_run_checks_the_kernel_and_reports_every_length(capsys):
    attention.main(["--tiny"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 64", "| 128"]
    assert "largest difference" in out
    args = attention.parser().parse_args(["--lengths", "64", "--window", "16"])
    assert attention.check(args.window, 64, 2, 8) < 1e-9
