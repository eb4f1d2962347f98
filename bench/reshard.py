"""ZeRO-3's two reshard policies under pipeline parallelism (CPU, gloo):
`--fsdp-reshard-after-forward` (each layer gathered before its forward and
again before its backward, per microbatch, let go after each) against
`--no-fsdp-reshard-after-forward` (each layer gathered once per iteration
and kept to its end), so that the default can be chosen by measurement.

Rows: p = 2, d = 2 under 1F1B; p = 2, d = 2 interleaved (v = 2,
--num-layers-per-virtual-pipeline-stage); p = 1, d = 4, the reference
without a pipeline. Each row trains the same GPT on the same mock batches
(micro batch 1, m microbatches per iteration on every pipeline) under both
policies, each run a fresh local job of 4 processes (one thread each,
forked from a fork server that imported ptdp, as `ptdp train` starts them:
ptdp.launch.launch_local) built from the `ptdp train` flags printed with
the row; the runs alternate, reshard, keep, reshard, keep, ... (`--pairs`
pairs). Before any time counts, every run's loss of every iteration must
agree with the row's first run to 1e-5 relative (both policies compute the
same; a disagreement stops the bench). Per run: the time of each
iteration after the warm-up (a barrier before each, the slowest rank's
time), each rank's peak memory as the run reports it (ptdp.device.peak_memory:
getrusage's ru_maxrss, the log line's and metrics file's `peak memory`;
on Linux it carries the parent's resident set across fork + exec, so it is
also given as VmHWM, the peak of the rank's own address space), and the
most whole-parameter bytes the rank held at once
(ShardedParamBuffer.full_param_bytes, read after each gather starts).
Per row: median ms per iteration of each policy over all its runs'
iterations and their ratio, the machine's 1-minute load at the row's start
and end (os.getloadavg; the machine is shared), and beside the measured
figures what ptdp's performance model predicts for both policies on this
layout: ptdp.perf.analytic.memory.memory_per_rank (CPU kernels; the
weights' bytes and the total per pipeline rank) and
ptdp.perf.simulate.predict.simulate's iteration time (on this machine's
profile, calibrated first as `ptdp calibrate` does; `--profile` names
another).

On CPU the resident set also follows glibc's allocator: a policy that
lets whole parameters go and takes them back many times an iteration can
leave freed heap behind, so `--malloc-mmap-threshold 65536` (glibc's
MALLOC_MMAP_THRESHOLD_ in the ranks, as bench/memory.py sets it) measures
the resident set with freed tensors returned at once.

    .venv/bin/python bench/reshard.py [--write]   # the figures in RESULTS.md
    .venv/bin/python bench/reshard.py --malloc-mmap-threshold 65536 --write
    .venv/bin/python bench/reshard.py --tiny      # a few seconds: checks the harness
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import cpu_name, publish  # noqa: E402  bench/results.py

HEADING = "## ZeRO-3 reshard policy under pipelines"
POLICIES = ("reshard", "keep")   # --fsdp-reshard-after-forward, --no-fsdp-reshard-after-forward
POLICY_FLAG = {"reshard": "--fsdp-reshard-after-forward",
               "keep": "--no-fsdp-reshard-after-forward"}
LOSS_RTOL = 1e-5
WORLD = 4
MIB = 2 ** 20


def rows(layers_per_virtual_stage: int) -> list[tuple[str, int, list[str]]]:
    """(name, p, layout flags) of each row, on 4 processes."""
    return [("p=2 d=2 1f1b", 2, ["--pipeline-model-parallel-size", "2"]),
            ("p=2 d=2 interleaved v=2", 2,
             ["--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", str(layers_per_virtual_stage)]),
            ("p=1 d=4", 1, [])]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=8, help="m per iteration (micro batch 1)")
    p.add_argument("--iters", type=int, default=4, help="timed iterations per run (after one warm-up)")
    p.add_argument("--pairs", type=int, default=3, help="alternating reshard/keep pairs per row")
    p.add_argument("--profile", default=None,
                   help="the hardware profile of the predicted time: calibrate (measure this "
                        "machine first, under a minute; the default), a100, h100, h200, local "
                        "(`ptdp calibrate`'s) or a JSON path; a100 under --tiny")
    p.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                   help="glibc serves allocations above BYTES by mmap in the ranks "
                        "(MALLOC_MMAP_THRESHOLD_), so that freed whole parameters leave the "
                        "resident set at once; default glibc's own, adaptive")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny GPT, 1 timed iteration, 1 pair: checks the harness in seconds")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.vocab = 4, 32, 4, 32, 256
        args.microbatches, args.iters, args.pairs = 4, 1, 1
    args.profile = args.profile or ("a100" if args.tiny else "calibrate")
    args.hardware = hardware_profile(args.profile)
    return args


def hardware_profile(name: str):
    """The profile the predicted times are priced on."""
    if name == "calibrate":
        from ptdp.perf.calibrate.profile import calibrate

        return calibrate(log=lambda line: print(f"calibrate: {line}", file=sys.stderr))
    from ptdp.perf.price.profiles import load_profile

    return load_profile(name)


def train_flags(args, p: int, layout: list[str], policy: str) -> list[str]:
    """The `ptdp train` command line of one run (4 processes: d = 4 / p)."""
    d = WORLD // p
    return ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
            "--max-position-embeddings", str(args.seq), "--vocab-size", str(args.vocab),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--seed", "1",
            "--micro-batch-size", "1", "--global-batch-size", str(args.microbatches * d),
            "--train-iters", str(args.iters + 1), "--data-parallel-size", str(d), *layout,
            "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            POLICY_FLAG[policy]]


def config_of(flags: list[str]):
    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_args

    return config_from_args(build_parser().parse_args(["train", *flags]))


def _vm_hwm() -> int:
    """This process's own peak resident set (VmHWM), bytes; 0 where unknown."""
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def rank_figures(flags: list[str]) -> dict:
    """One rank of one run, in a job whose default process group is up (4
    ranks): the iterations' times and losses, the rank's peaks."""
    import torch
    import torch.distributed as dist

    from ptdp import device as devices
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    config = config_of(flags)
    torch.set_num_threads(1)
    p = config.parallel.pipeline_model_parallel_size
    ctx = ParallelContext.build(RankGrid(tp=1, dp=dist.get_world_size() // p, pp=p))
    trainer = Trainer(config, ctx, torch.device("cpu"))
    buffer = trainer.buffer
    held = [buffer.full_param_bytes]
    start_gather = buffer._start_gather

    def gather_and_count(unit: int) -> None:  # the most whole parameters held at once
        start_gather(unit)
        held[0] = max(held[0], buffer.full_param_bytes)
    buffer._start_gather = gather_and_count   # the hooks look it up at each call
    seconds, losses = [], []
    for iteration in range(config.train.train_iters):
        dist.barrier()
        began = time.perf_counter()
        record, _ = trainer.step(iteration)
        seconds.append(time.perf_counter() - began)
        losses.append(record.get("loss") if trainer.holds_loss else None)
    return {"seconds": seconds[1:], "losses": losses, "full_param_bytes": held[0],
            "peak_memory": devices.peak_memory(torch.device("cpu"))[0], "vm_hwm": _vm_hwm()}


def _run(env, payload) -> None:
    import torch.distributed as dist

    from ptdp.distributed import init_process_group

    flags, out = payload
    init_process_group(env, "gloo", timedelta(minutes=10))
    try:
        Path(out, f"{env.rank}.json").write_text(json.dumps(rank_figures(flags)))
    finally:
        dist.destroy_process_group()


def launched(flags: list[str]) -> list[dict]:
    """Each rank's figures of one run: a fresh local job of 4 processes,
    forked from a fork server that imported ptdp, as `ptdp train` starts them."""
    from ptdp.launch import CPU_RANK_MODULES, launch_local

    with tempfile.TemporaryDirectory() as out:
        launch_local(WORLD, _run, (flags, out), preload=CPU_RANK_MODULES)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(WORLD)]


def measure(flags: list[str], runner=launched) -> dict:
    """One run (`runner`: flags -> each rank's figures): per iteration the
    slowest rank's time, the loss (of the last stage), each rank's peaks."""
    ranks = runner(flags)
    losses = [next((x for x in column if x is not None), None)
              for column in zip(*(r["losses"] for r in ranks))]
    return {"seconds": [max(column) for column in zip(*(r["seconds"] for r in ranks))],
            "losses": losses, **{key: [r[key] for r in ranks]
                                 for key in ("peak_memory", "vm_hwm", "full_param_bytes")}}


def loss_difference(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two runs' losses, iteration by iteration."""
    if len(a) != len(b) or None in a or None in b:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def predict(flags: list[str], profile) -> dict:
    """The performance model's memory per pipeline rank and iteration time."""
    from ptdp.perf.analytic.memory import memory_per_rank
    from ptdp.perf.fits import layout_of, workload_of
    from ptdp.perf.simulate.predict import simulate

    config = config_of(flags)
    workload, layout = workload_of(config), layout_of(config)
    memory = memory_per_rank(workload, layout, kernels="cpu",
                             bucket_size=config.train.ddp_bucket_size)
    seconds = simulate(workload, layout, profile).iteration_seconds
    return {"memory": memory, "seconds": seconds}


def run_row(args, name: str, p: int, layout: list[str], runner=launched) -> dict:
    """Both policies of one row, alternating; raises when the losses differ."""
    load_start = os.getloadavg()[0]
    runs = {policy: [] for policy in POLICIES}
    for pair in range(args.pairs):
        for policy in POLICIES:
            runs[policy].append(measure(train_flags(args, p, layout, policy), runner))
    load_end = os.getloadavg()[0]
    reference = runs[POLICIES[0]][0]["losses"]
    difference = max(loss_difference(run["losses"], reference)
                     for policy in POLICIES for run in runs[policy])
    if not difference <= LOSS_RTOL:
        raise AssertionError(f"{name}: the policies' losses differ by {difference:.2e} relative "
                             f"(allowed {LOSS_RTOL:g}): {[r['losses'] for r in runs['reshard']]} "
                             f"against {[r['losses'] for r in runs['keep']]}")
    row = {"name": name, "p": p, "load": [load_start, load_end], "losses": reference,
           "loss_max_rel_diff": difference, "flags": train_flags(args, p, layout, "keep")[:-1],
           "policies": {}}
    for policy in POLICIES:
        mine = runs[policy]
        row["policies"][policy] = {
            "ms": 1e3 * statistics.median(s for run in mine for s in run["seconds"]),
            "run_ms": [1e3 * statistics.median(run["seconds"]) for run in mine],
            **{key: [statistics.median(run[key][rank] for run in mine) for rank in range(WORLD)]
               for key in ("peak_memory", "vm_hwm", "full_param_bytes")},
            "predicted": predict(train_flags(args, p, layout, policy), args.hardware)}
    row["ratio"] = row["policies"]["keep"]["ms"] / row["policies"]["reshard"]["ms"]
    row["pair_ratios"] = [k / r for k, r in zip(row["policies"]["keep"]["run_ms"],
                                                row["policies"]["reshard"]["run_ms"])]
    return row


def _mib(values) -> str:
    return "/".join(f"{v / MIB:.0f}" for v in values)


def _mib1(values) -> str:
    return "/".join(f"{v / MIB:.1f}" for v in values)


def _quoted_options() -> list[str]:
    """This command's options for the record, less --json's file (a machine path)."""
    options = sys.argv[1:]
    if "--json" in options:
        at = options.index("--json")
        options = options[:at] + options[at + 2:]
    return [o for o in options if not o.startswith("--json=")]


def table(args, results: list[dict]) -> str:
    lines = [f"### {datetime.date.today()}: GPT {args.layers} × {args.hidden}, "
             f"{args.heads} heads, s {args.seq}, vocab {args.vocab}, fp32, micro batch 1, "
             f"m = {args.microbatches} per pipeline per iteration, 4 processes × 1 thread",
             "",
             f"Command: `{' '.join(['python bench/reshard.py'] + _quoted_options())}`; "
             f"{cpu_name()}, {os.cpu_count()} cores shared by the 4 ranks and other users. "
             f"ZeRO-3 (`--use-megatron-fsdp --data-parallel-sharding-strategy "
             f"optim_grads_params`); reshard = `--fsdp-reshard-after-forward`, keep = "
             f"`--no-fsdp-reshard-after-forward`. {args.pairs} alternating pairs of fresh "
             f"runs per row, {args.iters} timed iterations each after 1 warm-up; ms = median "
             f"over all the policy's iterations (the slowest rank's); ratio = keep / reshard "
             f"(< 1: keeping is faster), per pair in brackets. Losses agreed per iteration "
             f"between every run (max relative difference given). Memory per rank (ranks "
             f"0/1/2/3, MiB, median over the runs): the run's `peak memory` (ru_maxrss), "
             f"VmHWM (the rank's own address space; ru_maxrss carries the launcher's resident "
             f"set across fork + exec), the most whole-parameter bytes held at once "
             f"(full_param_bytes). Predicted: ptdp.perf memory_per_rank (CPU kernels) per "
             f"pipeline rank, weights and total, and simulate's iteration time on "
             + ("this machine's profile, calibrated in the run (`ptdp calibrate`'s measurements)."
                if args.profile == "calibrate" else
                f"the `{args.profile}` profile (not this CPU: only its ratio compares).")
             + (f" glibc's mmap threshold {args.malloc_mmap_threshold} bytes in the ranks "
                f"(MALLOC_MMAP_THRESHOLD_): freed whole parameters leave the resident set."
                if args.malloc_mmap_threshold else " glibc's default (adaptive) mmap threshold.")
             + (" Tiny model: the figures check the harness, they are not results."
                if args.tiny else ""), "",
             "| layout | load start→end | policy | ms / iteration | keep / reshard | losses "
             "agree (max rel diff) | peak memory MiB (run's) | VmHWM MiB | whole params held "
             "MiB | predicted weights MiB | predicted total MiB | predicted s (ratio) |",
             "|---|---|---|---:|---|---|---|---|---|---|---|---|"]
    for row in results:
        for policy in POLICIES:
            mine = row["policies"][policy]
            pred = mine["predicted"]
            pred_ratio = (row["policies"]["keep"]["predicted"]["seconds"]
                          / row["policies"]["reshard"]["predicted"]["seconds"])
            first = policy == POLICIES[0]
            lines.append(
                f"| {row['name'] if first else ''} | "
                f"{'{:.1f}→{:.1f}'.format(*row['load']) if first else ''} | {policy} | "
                f"{mine['ms']:.0f} | "
                + (f"{row['ratio']:.3f} ({', '.join(f'{r:.3f}' for r in row['pair_ratios'])})"
                   if not first else "")
                + f" | {'yes ({:.1e})'.format(row['loss_max_rel_diff']) if first else ''} | "
                f"{_mib(mine['peak_memory'])} | {_mib(mine['vm_hwm'])} | "
                f"{_mib1(mine['full_param_bytes'])} | "
                f"{_mib1(r['weights'] for r in pred['memory'])} | "
                f"{_mib(r['total'] for r in pred['memory'])} | {pred['seconds']:.4f}"
                + (f" ({pred_ratio:.3f})" if not first else "") + " |")
    lines += ["", "Flags of a row (p = 2 d = 2 1F1B; add the policy's flag): `ptdp train "
              + " ".join(results[0]["flags"]) + "`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.malloc_mmap_threshold:   # before the ranks' fork server starts: glibc reads it then
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    args = resolve(args)
    started = time.time()
    results = []
    for name, p, layout in rows(max(1, args.layers // 4)):
        results.append(run_row(args, name, p, layout))
        row = results[-1]
        print(f"{name}: reshard {row['policies']['reshard']['ms']:.0f} ms, keep "
              f"{row['policies']['keep']['ms']:.0f} ms, keep / reshard {row['ratio']:.3f}, "
              f"load {row['load'][0]:.1f}→{row['load'][1]:.1f}", file=sys.stderr)
    block = table(args, results) + f"\nRun time {time.time() - started:.0f} s.\n"
    publish(HEADING, block, write=args.write)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
