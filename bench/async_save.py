"""--async-save against synchronous saves: the time training is blocked per
save, and the run's time end to end (CPU, one process).

Runs `ptdp train` on a small GPT that saves every --save-interval
iterations, synchronously and with --async-save alternating (the same
settings, --pairs pairs, the order swapped in every other pair so that a
drift of the machine's load favours neither), and reads each save's line
("training was blocked X s"). The run's time is counted from the start-up
line (the model is built) to the process's exit, so the interpreter's and
torch's start-up are left out; the whole command's time is shown too. The
machine's load average is quoted before and after, since other work on it
slows both kinds of run.

    .venv/bin/python bench/async_save.py [--pairs 3] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Asynchronous checkpoint saves (--async-save) against synchronous ones (CPU)"
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "8192",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-4", "--log-interval",
         "1000"]
BLOCKED = re.compile(r"ptdp: saved checkpoint \S+ \((?:--async-save: )?training was blocked "
                     r"([0-9.]+) s")


def _run(asynchronous: bool, iters: int, interval: int, save: Path) -> dict:
    """One run: its saves' blocked seconds, its time from start-up to exit
    and the whole command's, and the checkpoint's size."""
    command = [sys.executable, "-m", "ptdp", "train", *MODEL, "--train-iters", str(iters),
               "--save", str(save), "--save-interval", str(interval)]
    if asynchronous:
        command.append("--async-save")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    built, blocked = None, []
    for line in process.stdout:
        if built is None and line.startswith("ptdp: 1 process"):
            built = time.perf_counter()
        match = BLOCKED.match(line)
        if match:
            blocked.append(float(match.group(1)))
    stderr = process.stderr.read()
    if process.wait() != 0:
        raise SystemExit(f"ptdp train failed:\n{stderr}")
    ended = time.perf_counter()
    newest = max(save.glob("iter_*"))
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    return {"blocked": blocked, "run": ended - built, "command": ended - began, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="synchronous/asynchronous pairs")
    parser.add_argument("--iters", type=int, default=12, help="iterations per run")
    parser.add_argument("--save-interval", type=int, default=2, help="save every N iterations")
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="ptdp-async-save-bench-") as work:
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for asynchronous in order:
                save = Path(work) / f"pair{pair}-{'async' if asynchronous else 'sync'}"
                run = _run(asynchronous, args.iters, args.save_interval, save)
                runs[asynchronous].append(run)
                print(f"pair {pair + 1}, {'async' if asynchronous else 'sync '}: blocked per save "
                      f"{statistics.median(run['blocked']):.3f} s (median of {len(run['blocked'])}), "
                      f"run {run['run']:.1f} s", file=sys.stderr, flush=True)
    load_after = os.getloadavg()

    rows = ["| pair | sync: blocked per save (s) | async: blocked per save (s) | blocked, async/sync "
            "| sync: run (s) | async: run (s) | run, async/sync |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for pair, (sync, asyn) in enumerate(zip(runs[False], runs[True])):
        blocked_sync, blocked_async = (statistics.median(r["blocked"]) for r in (sync, asyn))
        rows.append(f"| {pair + 1} | {blocked_sync:.3f} | {blocked_async:.3f} | "
                    f"{blocked_async / blocked_sync:.3f} | {sync['run']:.1f} | {asyn['run']:.1f} | "
                    f"{asyn['run'] / sync['run']:.3f} |")
    every = {kind: [b for r in runs[kind] for b in r["blocked"]] for kind in runs}
    blocked_ratio = statistics.median(every[True]) / statistics.median(every[False])
    run_ratio = (statistics.median(r["run"] for r in runs[True])
                 / statistics.median(r["run"] for r in runs[False]))
    saved = (statistics.median(r["run"] for r in runs[False])
             - statistics.median(r["run"] for r in runs[True]))
    checkpoint_mb = runs[False][0]["bytes"] / 1e6
    saves = len(runs[False][0]["blocked"])
    block = "\n".join([
        f"### {datetime.date.today().isoformat()}: {checkpoint_mb:.0f} MB checkpoints, {saves} saves "
        f"in {args.iters} iterations, {args.pairs} pairs",
        "",
        f"Command: `python bench/async_save.py --pairs {args.pairs} --iters {args.iters} "
        f"--save-interval {args.save_interval}{' --write' if args.write else ''}`  ",
        f"torch {torch.__version__}, {cpu_name()}, {os.cpu_count()} cores; one process "
        f"(`ptdp train {' '.join(MODEL)}`), saving every {args.save_interval} iterations into a "
        f"directory on the local disk; each pair runs the two kinds back to back, the order "
        f"swapped in every other pair. Load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in load_after)}. Blocked: what each save's line reports "
        f"(synchronous: the whole save; asynchronous: the snapshot copy, the checks at iteration "
        f"boundaries, the wait and the publication), median per run. Run: from the start-up line "
        f"to the process's exit (the last save included, which a run waits for).",
        "",
        *rows,
        "",
        f"Median over every save: training blocked **{blocked_ratio:.3f}x** as long per save with "
        f"--async-save ({statistics.median(every[True]):.3f} s against "
        f"{statistics.median(every[False]):.3f} s); run time **{run_ratio:.3f}x** "
        f"({saved:+.1f} s saved per run, median).",
        "",
    ])
    publish(HEADING, block, write=args.write)


if __name__ == "__main__":
    main()
