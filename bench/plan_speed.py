"""`ptdp plan`'s own time at two commits, from the command line.

Each command runs in a fresh process, alternating between a checkout of
`--before` (a temporary git worktree) and this tree, for `--rounds`
rounds; each run's wall time, CPU time (user + system) and the 1-minute
load average before it are recorded, and the printed plans of the two
sides must be byte-identical (a speed-up that changes a plan is a bug).

    python bench/plan_speed.py --before ecbf428            # the three searches
    python bench/plan_speed.py --before ecbf428 --write    # append to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import cpu_name, publish  # noqa: E402

HEADING = "## Planner search time"
ONE_T = ("--num-layers 128 --hidden-size 25600 --num-attention-heads 160 --gpus 3072 --gpu a100 "
         "--global-batch-size 3072 --top 30")
SEARCHES = {  # name: ptdp plan's arguments
    "the README's 39B GPT on 64 A100s": "--num-layers 48 --hidden-size 8192 "
    "--num-attention-heads 64 --gpus 64 --gpu a100 --global-batch-size 512 --top 30",
    "the 1T GPT on 3072 A100s, t = 8 and p = 64 fixed": ONE_T + " -t 8 -p 64",
    "the 1T GPT on 3072 A100s, nothing fixed": ONE_T,
}


def _run(tree: Path, arguments: str) -> tuple[float, float, float, bytes]:
    """(wall s, CPU s, load before, stdout) of `ptdp plan ARGUMENTS` run from `tree`."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "ptdp.cli", "plan", *arguments.split()],
                            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                            capture_output=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, load, result.stdout


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()
    after_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                  capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        old = Path(folder) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(old), args.before],
                       cwd=ROOT, check=True)
        try:
            runs = {(name, side): [] for name in SEARCHES for side in ("before", "after")}
            for _ in range(args.rounds):
                for name, arguments in SEARCHES.items():
                    for side, tree in (("before", old), ("after", ROOT)):
                        runs[(name, side)].append(_run(tree, arguments))
                        wall, cpu, load, _ = runs[(name, side)][-1]
                        print(f"{name}, {side}: {wall:.2f} s wall, {cpu:.2f} s CPU, load {load:.1f}",
                              file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
    lines = [f"### {datetime.date.today().isoformat()}: before {args.before}, after {after_commit}",
             "",
             f"Command: `python bench/plan_speed.py --before {args.before} --rounds {args.rounds}`  ",
             f"{cpu_name()}, {os.cpu_count()} cores. Fresh processes from the command line, "
             f"{args.rounds} rounds alternating before and after; CPU = user + system; load = "
             "the 1-minute average before each run (above the cores: measured under load).",
             "",
             "| search | before: wall s (CPU s) | after: wall s (CPU s) | plans | load |",
             "|---|---|---|---|---|"]
    for name in SEARCHES:
        before, after = runs[(name, "before")], runs[(name, "after")]
        same = {out for *_, out in before + after}
        lines.append(f"| {name} | {_span([r[0] for r in before])} ({_span([r[1] for r in before])}) | "
                     f"{_span([r[0] for r in after])} ({_span([r[1] for r in after])}) | "
                     f"{'byte-identical' if len(same) == 1 else 'DIFFER'} | "
                     f"{_span([r[2] for r in before + after])} |")
    publish(HEADING, "\n".join(lines) + "\n", write=args.write)
    return 0 if all(len({out for *_, out in runs[(name, "before")] + runs[(name, "after")]}) == 1
                    for name in SEARCHES) else 1


if __name__ == "__main__":
    sys.exit(main())
