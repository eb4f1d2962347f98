"""ptdp against its own past: the same training step timed at several commits.

For finding which change slowed a layout down (bisecting): each revision
is checked out into a temporary git worktree and timed in its own local
gloo job, the revisions alternating round by round (forward, then
backward order), so machine noise spreads over all of them alike. Each job
builds ptdp's Trainer at that revision (the same model as
bench/megatron_peers.py: l = 8, h = 256, a = 8, s = 128, V = 8192, fp32,
micro batch 2, global batch 16) and times Trainer.step, optimizer
included. Reported per revision: the median wall time, the median CPU time
of all ranks together (the work done, which other jobs on a shared machine
barely change: waiting in a collective costs none) and the forward-backward
part of the step as the step's own record gives it.

    python bench/history.py HEAD~40 HEAD~20 HEAD            # t = 2, 3 rounds
    python bench/history.py --layout p=2 --rounds 4 REV ... # or t=2, t=2,p=2
    python bench/history.py --write REV ...                 # append to bench/RESULTS.md

Revisions older than the Trainer's present constructor (December 2026's
first day) are not supported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
HEADING = "## ptdp against its own past: one training step at several commits (CPU)"


def _layout(text: str) -> dict:
    sizes = {"t": 1, "p": 1}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in sizes or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"layout {text!r}: give t=N and/or p=N, e.g. t=2,p=2")
        sizes[key] = int(value)
    return sizes


def _rank(rank: int, checkout: str, t: int, p: int, iters: int, port: int, out: str) -> None:
    """One rank of one revision's job (a spawned process): `checkout`'s ptdp."""
    sys.path.insert(0, checkout)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=t * p)
    from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    model = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128,
                        vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0)
    config = Config(model=model,
                    parallel=ParallelConfig(tensor_model_parallel_size=t,
                                            pipeline_model_parallel_size=p, data_parallel_size=1,
                                            pipeline_schedule="1f1b", device="cpu"),
                    train=TrainConfig(micro_batch_size=2, global_batch_size=16, lr=1e-4,
                                      lr_decay_style="constant", clip_grad=0.0, seed=1234),
                    data=DataConfig(mock_data=True))
    trainer = Trainer(config, ParallelContext.build(RankGrid(tp=t, dp=1, pp=p)),
                      torch.device("cpu"))
    steps = []
    for iteration in range(1 + iters):  # the first warms up
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        record, _ = trainer.step(iteration)
        cpu_end = time.process_time()
        dist.barrier()
        if iteration:
            steps.append({"wall": time.perf_counter() - start, "cpu": cpu_end - cpu_start,
                          "forward_backward": record["forward_backward_ms"] / 1e3})
    every = [None] * (t * p)
    dist.all_gather_object(every, steps)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


def _job(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    checkout, t, p, iters, port, out = argv
    mp.start_processes(_rank, args=(checkout, int(t), int(p), int(iters), int(port), out),
                       nprocs=int(t) * int(p), start_method="spawn")


def time_revision(checkout: str, layout: dict, iters: int) -> list[dict]:
    """Per timed step: rank 0's wall and forward-backward seconds, every
    rank's CPU seconds summed."""
    from local_job import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "steps.json")
        # A fresh interpreter whose ptdp is the checkout's, not this one's.
        code = "import sys; sys.path.insert(0, sys.argv[1]); import history; history._job(sys.argv[2:])"
        subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), checkout,
                        str(layout["t"]), str(layout["p"]), str(iters), str(port), out],
                       check=True, env={**os.environ, "PYTHONPATH": checkout})
        ranks = json.loads(Path(out).read_text())
    return [{"wall": ranks[0][i]["wall"], "forward_backward": ranks[0][i]["forward_backward"],
             "cpu": sum(rank[i]["cpu"] for rank in ranks)} for i in range(len(ranks[0]))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs="+", metavar="REV", help="commits to time (git names)")
    parser.add_argument("--layout", type=_layout, default="t=2", help="t=N,p=N (default t=2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every revision")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per revision and round")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args(argv)
    layout = args.layout
    commits = {}
    for rev in args.revisions:
        found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
                               capture_output=True, text=True)
        if found.returncode:
            parser.error(f"{rev!r} is not a commit of this repository: give a commit, branch or tag")
        commits[rev] = found.stdout.strip()
    steps: dict[str, list[dict]] = {rev: [] for rev in commits}
    load = [os.getloadavg()[0]]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for rev, commit in commits.items():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                                f"{tmp}/{commit}", commit], check=True)
            for round_ in range(args.rounds):
                order = list(commits) if round_ % 2 == 0 else list(commits)[::-1]
                for rev in order:
                    try:
                        steps[rev] += time_revision(f"{tmp}/{commits[rev]}", layout, args.iters)
                    except subprocess.CalledProcessError:
                        raise SystemExit(
                            f"{rev} ({commits[rev]}) did not run (its error is above): a revision "
                            f"from before the Trainer's present constructor cannot be timed here; "
                            f"leave it out or give a later one") from None
                load.append(os.getloadavg()[0])
                print(f"round {round_ + 1} of {args.rounds}, load {load[-1]:.1f}", file=sys.stderr)
        finally:
            for commit in commits.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                f"{tmp}/{commit}"], capture_output=True)
    from results import publish
    publish(HEADING, report(args, layout, commits, steps, load, time.time() - started),
            write=args.write)
    return 0


def report(args, layout: dict, commits: dict, steps: dict, load: list, seconds: float) -> str:
    from results import cpu_name

    shape = ",".join(f"{k}={v}" for k, v in layout.items() if v > 1) or "one process"
    lines = [f"### {datetime.date.today().isoformat()}: {shape}, l=8, h=256, a=8, s=128, V=8192, "
             f"fp32, micro batch 2, global batch 16, one Trainer.step (optimizer included)\n",
             f"Command: `python bench/history.py --layout {shape} --rounds {args.rounds} --iters "
             f"{args.iters} {' '.join(commits)}`  \n"
             f"{cpu_name()}, {os.cpu_count()} cores, one thread per rank; load {min(load):.1f}–"
             f"{max(load):.1f}; run time {seconds:.0f} s. Medians over {args.rounds} rounds of "
             f"{args.iters} steps; CPU s is every rank's CPU time together."
             + (" Measured under load (the 1-minute load average exceeded the "
                f"{os.cpu_count()} cores): the wall times are to be rerun on a quiet machine; "
                "the CPU times are the work done, which load barely changes."
                if max(load) > (os.cpu_count() or 1) else "") + "\n",
             "| revision | commit | date | wall s | CPU s (all ranks) | forward-backward s |",
             "|---|---|---|---:|---:|---:|"]
    for rev, commit in commits.items():
        date = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%cs", commit],
                              capture_output=True, text=True).stdout.strip()
        s = steps[rev]
        lines.append(f"| {rev} | {commit} | {date} | {statistics.median(x['wall'] for x in s):.3f} | "
                     f"{statistics.median(x['cpu'] for x in s):.3f} | "
                     f"{statistics.median(x['forward_backward'] for x in s):.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
