"""Draw one loss curve for a run trained in phases, each resumed from the one
before under another layout: `ptdp train --loss-curve` draws only the
iterations of its own run, and the demo's first 10 iterations (t = p = d = 2)
are in another metrics file than the 290 resumed with d = 2.

    .venv/bin/python scripts/plot_loss_curve.py OUT.png \\
        --phase "t=p=d=2" demo-output/metrics-3d.jsonl --phase "d=2" demo-output/metrics.jsonl

Each --phase is a label and a --metrics-file, in the order they ran; a
dashed line marks each change of phase, labelled "t=p=d=2 | d=2".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptdp.train.report import join_phases, plot_loss_curve, read_metrics  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the image to write (format from its suffix: .png, .svg)")
    parser.add_argument("--phase", nargs=2, action="append", required=True,
                        metavar=("LABEL", "METRICS_FILE"),
                        help="a phase's label and --metrics-file, in the order they ran")
    args = parser.parse_args(argv)
    missing = [path for _, path in args.phase if not Path(path).is_file()]
    if missing:
        parser.error(f"no metrics file {', '.join(missing)}: give the --metrics-file of each phase")
    try:
        records, boundaries = join_phases([(label, read_metrics(path))
                                           for label, path in args.phase])
        path = plot_loss_curve(records, args.output, boundaries)
    except ValueError as error:  # a garbled metrics file, or no loss in any
        print(f"plot_loss_curve.py: error: {error}", file=sys.stderr)
        return 1
    print(f"ptdp demo: drew the loss curve of iterations {records[0]['iteration']}-"
          f"{records[-1]['iteration']} to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
