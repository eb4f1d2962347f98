"""Zero-bubble pipeline schedules (zb-h1, zbv) against 1F1B, interleaved
1F1B and PyTorch's own zero-bubble schedules, in one run.

1. Time. For p in (2, 4) (t = 1, d = 1; the GPT of bench/peers.py, global
   batch 16, micro batch 2, so m = 8: 4p at p = 2, 2p at p = 4, valid for
   every schedule here), one local gloo job of p processes builds eight
   sides from the same logical weights, four of ours (ptdp's Trainer under
   1f1b, interleaved 1F1B with v = 2, zb-h1, zbv) and each one's PyTorch
   peer (bench/peers.py's TorchSide: Schedule1F1B, ScheduleInterleaved1F1B,
   ScheduleInterleavedZeroBubble on one stage per rank (its ZB1P order is
   ZB-H1 there), ScheduleZBVZeroBubble on the same V placement, rank r
   holding stages r and 2p - 1 - r). Every iteration runs each side once,
   in an order reversed every other iteration (ABBA over the eight, a
   barrier around each), so the machine's noise falls on all alike. Before
   any time counts, the losses of every iteration must agree (relative
   1e-4) with the PyTorch peer's and with ours under 1F1B; a row whose
   losses differ fails. Reported: median iteration time as tokens/s, the
   ratio PyTorch's time / ours, and ours' gain over ours 1F1B in the same
   run (time of 1F1B / time of the row - 1).
2. Prediction. ptdp's unit-time simulator
   (ptdp.schedules.simulate) prices each of our schedules with this
   run's own costs: per rank, the mean per microbatch of the executor's
   forward time (F), backward time less W (B; under 1F1B the whole
   backward) and weight-gradient time (W), averaged over the ranks (the
   simulator prices every stage alike; the last stage, which holds the
   output layer, is heavier, so the prediction with the slowest rank's
   costs is given too), plus the measured time outside the pipeline: the
   gradient reduction of the rank that waited least in it (a rank's
   reduction time includes waiting for the last stage, whose tied
   embedding it all-reduces with) and the slowest optimizer step. The
   predicted gain over 1F1B is set against the measured one; the
   difference is in points. A zero-bubble schedule is simulated with its
   exchanges placed for those costs and sends that do not wait, as the
   trainer runs it after its second iteration.
3. Memory. For p in (2, 4), 1F1B, zb-h1 and zbv each in fresh processes
   (one Trainer only): a few warm-up iterations, then the kernel's
   high-water mark (VmHWM) reset to the current resident set
   (/proc/self/clear_refs, as bench/memory.py does) and read after a few
   more iterations; glibc serves allocations above 64 KiB by mmap
   (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the resident set at
   once; every process imports torch.fx.experimental.symbolic_shapes
   first (sympy: about 34 MiB resident, which torch.autograd.backward
   imports on its first call with explicit gradients, i.e. on every rank
   under zb-h1's W but not on 1F1B's last rank), so that a one-off import
   does not count as the schedule's memory. Per rank: the peak RSS, its
   rise over the resident set after warm-up (activations, inputs and
   output gradients kept for W, transient gradients) and the executor's
   peak stored activations, F to B and F to W. The layout's peak is the
   largest rank's.

On this machine's 2 cores, p = 4 puts 4 single-thread processes on 2
cores: a rank's idle time in the pipeline is another rank's compute time,
which the simulator (one core per rank) does not model.

    python bench/zero_bubble.py                      # both p, prints the tables
    python bench/zero_bubble.py --p 2 --iters 4      # a quick look
    python bench/zero_bubble.py --write              # append them to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402  bench/peers.py (puts the repository root on sys.path)
from memory import _reset_peak, _status_bytes  # noqa: E402  bench/memory.py
from local_job import free_port  # noqa: E402
from results import cpu_name, publish  # noqa: E402

from ptdp.config import ModelConfig  # noqa: E402
from ptdp.schedules.build import build_schedule, uniform_costs  # noqa: E402
from ptdp.schedules.simulate import compute_costs, simulate  # noqa: E402

HEADING = "## Zero-bubble schedules: against 1F1B and PyTorch's zero-bubble schedules (CPU)"
SCHEDULES = (("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zbv", 2))   # (schedule, v); 1f1b v=2: interleaved
MEMORY_SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("zbv", 2))
MIB = 2 ** 20


def rows_for(p: int) -> list[peers.Row]:
    return [peers.Row("zero-bubble", p=p, schedule=s, v=v) for s, v in SCHEDULES]


# ------------------------------------------------------------------------------------------
# Time: the eight sides of one p in the same processes


def _start(rank: int, world: int, port: int, threads: int):
    from ptdp.parallel.topology import ParallelContext, RankGrid

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return ParallelContext.build(RankGrid(tp=1, dp=1, pp=world))


def _gather_to(out: str, figures: dict) -> None:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))


def _worker(rank: int, world: int, port: int, model: ModelConfig, iters: int, warmup: int,
            threads: int, out: str) -> None:
    from ptdp.train.loop import Trainer

    ctx = _start(rank, world, port, threads)
    try:
        sides, errors = [], {}
        rows = rows_for(world)
        logical = peers._logical_weights(model, peers.config_for(rows[0], model).train.seed)
        for index, row in enumerate(rows):
            ours = Trainer(peers.config_for(row, model), ctx, torch.device("cpu"))
            sides.append((index, "ours", ours))
            try:
                theirs = peers.TorchSide(row, model, logical, ctx, ours.microbatch_fn)
                sides.append((index, "theirs", theirs))
            except (ValueError, RuntimeError, NotImplementedError) as error:
                errors[index] = f"{type(error).__name__}: {error}"
        times = {f"{i}/{who}": [] for i, who, _ in sides}
        losses = {key: [] for key in times}
        stats = {f"{i}/ours": [] for i, who, _ in sides if who == "ours"}
        for iteration in range(warmup + iters):
            for index, who, side in (sides if iteration % 2 == 0 else sides[::-1]):  # ABBA
                key = f"{index}/{who}"
                dist.barrier()
                start = time.perf_counter()
                if who == "ours":
                    record, run = side.step(iteration)
                    loss = record["loss"]
                else:
                    loss = side.step(iteration)
                dist.barrier()
                elapsed = time.perf_counter() - start
                losses[key].append(loss)
                if iteration < warmup:
                    continue
                times[key].append(elapsed)
                if who == "ours":
                    stats[key].append({
                        "F": run.forward_seconds, "B": run.backward_seconds - run.weight_grad_seconds,
                        "W": run.weight_grad_seconds,
                        "reduce": record["grad_reduce_ms"] / 1e3,
                        "optimizer": record["optimizer_ms"] / 1e3,
                        "peak_stored": run.peak_stored,
                        "peak_awaiting_weight_grads": run.peak_awaiting_weight_grads})
        _gather_to(out, {"times": times, "losses": losses, "stats": stats, "errors": errors})
    finally:
        dist.destroy_process_group()


def _launch(worker, world: int, args: tuple, env: dict | None = None) -> list[dict]:
    """Run `worker(rank, world, port, *args, threads, out)` on `world` local
    processes; what rank 0 wrote (every rank's figures)."""
    threads = max(1, (os.cpu_count() or 1) // world)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # spawned children inherit the environment
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(worker, args=(world, free_port(), *args, threads, out),
                               nprocs=world, join=True, start_method="spawn")
            return json.loads(Path(out).read_text())
    finally:
        for k, value in saved.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value


def _merged_losses(ranks: list[dict], key: str) -> list[float | None]:
    """Per iteration, the loss of the rank that holds it (the last stage;
    rank 0 under the V placement)."""
    columns = zip(*(r["losses"][key] for r in ranks))
    return [next((x for x in column if x is not None), None) for column in columns]


def _mean_costs(ranks: list[dict], key: str, m: int) -> list[dict]:
    """Per rank, the mean over the timed iterations of F, B, W per
    microbatch, of the gradient reduction and the optimizer step, and the
    peaks."""
    per_rank = []
    for r in ranks:
        runs = r["stats"][key]
        mean = {name: statistics.mean(run[name] for run in runs)
                for name in ("F", "B", "W", "reduce", "optimizer")}
        for name in ("F", "B", "W"):
            mean[name] /= m
        for name in ("peak_stored", "peak_awaiting_weight_grads"):
            mean[name] = max(run[name] for run in runs)
        per_rank.append(mean)
    return per_rank


def predicted_seconds(row: peers.Row, model: ModelConfig, costs: dict) -> float:
    """The unit-time simulator's iteration time for `row` with per-microbatch
    stage costs F, B, W (seconds; W only under a zero-bubble schedule) plus
    the time outside the pipeline."""
    parallel = peers.config_for(row, model).parallel
    schedule = build_schedule(parallel.schedule_kind, row.p, row.microbatches,
                              parallel.virtual_stages(model.num_layers))
    us = {name: round(costs[name] * 1e6) for name in ("F", "B", "W")}
    weight = {"weight_cost": us["W"]} if schedule.zero_bubble else {}
    if schedule.zero_bubble:  # its exchanges placed for these costs, as the trainer does
        per_op = compute_costs(schedule, us["F"], us["B"] + us["W"], us["W"])
        schedule = build_schedule(schedule.kind, schedule.p, schedule.m, schedule.v,
                                  uniform_costs(schedule.p, schedule.v, per_op))
    result = simulate(schedule, forward_cost=us["F"], backward_cost=us["B"] + us["W"], **weight)
    return float(result.makespan / Fraction(10 ** 6)) + costs["outside"]


def run_p(p: int, model: ModelConfig, iters: int, warmup: int) -> list[dict]:
    """The rows of one p, measured in one job."""
    ranks = _launch(_worker, p, (model, iters, warmup))
    rows = rows_for(p)
    tokens = rows[0].global_batch * model.seq_length
    results = []
    for index, row in enumerate(rows):
        key = f"{index}/ours"
        costs = _mean_costs(ranks, key, row.microbatches)
        mean = {name: statistics.mean(c[name] for c in costs) for name in ("F", "B", "W")}
        # Outside the pipeline: a rank's reduction time includes waiting for
        # the others to finish their pipeline (the tied embedding's
        # all-reduce joins the first and last stage), so the least of them
        # is the reduction itself; then the slowest optimizer step.
        mean["outside"] = (min(c["reduce"] for c in costs) + max(c["optimizer"] for c in costs))
        slowest = max(costs, key=lambda c: c["F"] + c["B"] + c["W"])
        r = {"row": asdict(row), "layout": row.describe(), "peer": row.peer_name(),
             "ours_s": statistics.median(ranks[0]["times"][key]),
             "ours_losses": _merged_losses(ranks, key), "costs": costs,
             "predicted_s": predicted_seconds(row, model, mean),
             "predicted_slowest_s": predicted_seconds(row, model, {**slowest, "outside": mean["outside"]}),
             "peer_error": ranks[0]["errors"].get(str(index))}
        r["ours_tokens_per_s"] = tokens / r["ours_s"]
        reference = results[0]["ours_losses"] if results else r["ours_losses"]
        r["loss_max_rel_diff"] = peers.loss_difference(r["ours_losses"], reference)
        if r["peer_error"] is None:
            theirs = f"{index}/theirs"
            r["theirs_s"] = statistics.median(ranks[0]["times"][theirs])
            r["theirs_tokens_per_s"] = tokens / r["theirs_s"]
            r["ratio"] = r["theirs_s"] / r["ours_s"]
            r["theirs_losses"] = _merged_losses(ranks, theirs)
            r["loss_max_rel_diff"] = max(r["loss_max_rel_diff"], peers.loss_difference(
                r["ours_losses"], r["theirs_losses"]))
        r["same_loss"] = r["loss_max_rel_diff"] <= peers.LOSS_RTOL
        base = results[0] if results else r
        r["gain"] = base["ours_s"] / r["ours_s"] - 1
        r["predicted_gain"] = base["predicted_s"] / r["predicted_s"] - 1
        r["predicted_slowest_gain"] = base["predicted_slowest_s"] / r["predicted_slowest_s"] - 1
        results.append(r)
    return results


# ------------------------------------------------------------------------------------------
# Memory: one schedule per job


def _memory_worker(rank: int, world: int, port: int, row: peers.Row, model: ModelConfig,
                   iters: int, warmup: int, threads: int, out: str) -> None:
    from ptdp.train.loop import Trainer

    # Imported on the first torch.autograd.backward with explicit gradients
    # (sympy, about 34 MiB resident): under 1F1B by every rank but the last,
    # under zb-h1 by every rank's W. Imported here by all, it counts for none.
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    ctx = _start(rank, world, port, threads)
    try:
        trainer = Trainer(peers.config_for(row, model), ctx, torch.device("cpu"))
        for iteration in range(warmup):
            trainer.step(iteration)
        gc.collect()
        dist.barrier()
        reset = _reset_peak()
        baseline = _status_bytes("VmRSS")
        stored = awaiting = 0
        for iteration in range(warmup, warmup + iters):
            _, run = trainer.step(iteration)
            stored = max(stored, run.peak_stored)
            awaiting = max(awaiting, run.peak_awaiting_weight_grads)
        _gather_to(out, {"peak": _status_bytes("VmHWM"), "baseline": baseline, "reset": reset,
                         "peak_stored": stored, "peak_awaiting_weight_grads": awaiting})
    finally:
        dist.destroy_process_group()


def run_memory(p: int, model: ModelConfig, iters: int = 2, warmup: int = 2,
               schedules=MEMORY_SCHEDULES) -> dict[str, list[dict]]:
    """Per layout name, per rank: peak RSS, baseline and peak stored activations."""
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = [peers.Row("memory", p=p, schedule=s, v=v) for s, v in schedules]
    return {row.describe(): _launch(_memory_worker, p, (row, model, iters, warmup), env)
            for row in rows}


# ------------------------------------------------------------------------------------------
# Report


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def time_table(results: list[dict]) -> str:
    lines = ["| layout (ours) | PyTorch side | ours tokens/s | PyTorch tokens/s | ours / PyTorch "
             "| losses agree (max rel. diff) | gain over ours 1F1B | predicted (mean costs) "
             "| measured - predicted | predicted (slowest rank's costs) |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in results:
        agree = ("yes" if r["same_loss"] else "**NO**") + f" ({r['loss_max_rel_diff']:.1e})"
        if r["peer_error"] is not None:
            theirs = f"cannot run: {r['peer_error']}"
            rate = ratio = "-"
        else:
            theirs = r["peer"]
            rate = peers.fmt_rate(r["theirs_tokens_per_s"])
            ratio = f"{r['ratio']:.2f}" if r["same_loss"] else "not counted"
        first = r["row"]["schedule"] == "1f1b" and r["row"]["v"] == 1
        gains = ("| (base) | | | |" if first else
                 f"| {_pct(r['gain'])} | {_pct(r['predicted_gain'])} | "
                 f"{100 * (r['gain'] - r['predicted_gain']):+.1f} points | "
                 f"{_pct(r['predicted_slowest_gain'])} |")
        lines.append(f"| {r['layout']} | {theirs} | {peers.fmt_rate(r['ours_tokens_per_s'])} | {rate} "
                     f"| {ratio} | {agree} {gains}")
    return "\n".join(lines)


def cost_table(results: list[dict]) -> str:
    lines = ["| layout | rank | F ms | B ms | W ms | reduction ms | optimizer ms | measured ms "
             "| predicted ms | peak stored F→B | F→W |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for rank, c in enumerate(r["costs"]):
            tail = (f"{1e3 * r['ours_s']:.0f} | {1e3 * r['predicted_s']:.0f}" if rank == 0 else " | ")
            lines.append(f"| {r['layout']} | {rank} | {1e3 * c['F']:.1f} | {1e3 * c['B']:.1f} | "
                         f"{1e3 * c['W']:.1f} | {1e3 * c['reduce']:.1f} | {1e3 * c['optimizer']:.1f} | "
                         f"{tail} | "
                         f"{c['peak_stored']} | {c['peak_awaiting_weight_grads']} |")
    return "\n".join(lines)


def memory_table(memory: dict[str, list[dict]]) -> str:
    names = list(memory)
    base = names[0]
    lines = ["| layout | rank | peak RSS MiB | vs " + base + " | rise over warm RSS MiB | vs " + base
             + " | peak stored F→B | F→W |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        for rank, (m, b) in enumerate(zip(memory[name], memory[base])):
            rise, base_rise = m["peak"] - m["baseline"], b["peak"] - b["baseline"]
            versus = f"{rise / base_rise:.2f}" if base_rise > 0 else "-"
            lines.append(f"| {name} | {rank} | {m['peak'] / MIB:.0f} | {m['peak'] / b['peak']:.3f} | "
                         f"{rise / MIB:.1f} | {versus} | {m['peak_stored']} | "
                         f"{m['peak_awaiting_weight_grads']} |")
    return "\n".join(lines)


def memory_verdict(memory: dict[str, list[dict]], p: int) -> str:
    """The acceptance: zb-h1's peak stored (F to B) equals 1F1B's on every
    rank, and its peak RSS is within 10 % of 1F1B's (the layout's: the
    largest over the ranks; and rank by rank)."""
    ours = {k.split()[-1]: v for k, v in memory.items()}
    f1b, zb = ours["1f1b"], ours["zb-h1"]
    stored = all(a["peak_stored"] == b["peak_stored"] for a, b in zip(f1b, zb))
    layout = max(r["peak"] for r in zb) / max(r["peak"] for r in f1b) - 1
    worst = max(abs(b["peak"] / a["peak"] - 1) for a, b in zip(f1b, zb))

    def within(x: float) -> str:
        return "within" if abs(x) <= 0.10 else "**outside**"
    return (f"p={p}: zb-h1's peak stored activations (F→B) {'equal' if stored else '**differ from**'} "
            f"1F1B's on every rank. Peak RSS of the layout (largest rank): zb-h1 {_pct(layout)} "
            f"against 1F1B ({within(layout)} 10 %); rank by rank at most {worst:.1%} apart "
            f"({within(worst)} 10 %).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, nargs="+", default=[2, 4], choices=[2, 4],
                        help="pipeline sizes (default: 2 4)")
    parser.add_argument("--iters", type=int, default=16, help="timed iterations per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument("--tiny", action="store_true",
                        help="a small model (seconds per job) for checking the harness")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--write", action="store_true", help="append the tables to bench/RESULTS.md")
    args = parser.parse_args(argv)

    model = peers.TINY_MODEL if args.tiny else peers.MODEL
    started = time.time()
    timing, memory = {}, {}
    for p in args.p:
        timing[p] = run_p(p, model, args.iters, args.warmup)
        for r in timing[p]:
            print(f"p={p} {r['layout']}: ours {r['ours_s']:.3f} s, PyTorch "
                  f"{r.get('theirs_s', float('nan')):.3f} s, gain over 1F1B {r['gain']:+.1%} "
                  f"(predicted {r['predicted_gain']:+.1%}), losses agree {r['same_loss']}",
                  file=sys.stderr)
        if not args.no_memory:
            memory[p] = run_memory(p, model)

    date = datetime.date.today().isoformat()
    command = (f"python bench/zero_bubble.py --p {' '.join(map(str, args.p))} --iters {args.iters} "
               f"--warmup {args.warmup}" + (" --tiny" if args.tiny else "")
               + (" --no-memory" if args.no_memory else ""))
    row = peers.Row("zero-bubble")
    threads = " and ".join(f"{max(1, (os.cpu_count() or 1) // p)} thread(s) each at p = {p}"
                           for p in args.p)
    blocks = [
        f"### {date}: GPT l={model.num_layers}, h={model.hidden_size}, a={model.num_attention_heads}, "
        f"s={model.seq_length}, V={model.vocab_size}, fp32, global batch {row.global_batch}, "
        f"micro batch {row.micro_batch} (m = {row.microbatches})\n\n"
        f"Command: `{command}`  \n"
        f"torch {torch.__version__}, gloo, {cpu_name()}, {os.cpu_count()} cores shared by the "
        f"processes ({threads}). Median of {args.iters} iterations per side, the eight sides "
        f"of a p alternating in the same processes; ratio = PyTorch's time / ours (> 1: ours "
        f"faster); gain = ours 1F1B's time / the row's - 1; predicted = ptdp's unit-time simulator "
        f"with this run's mean per-microbatch F, B, W over the ranks plus the time outside the "
        f"pipeline (the least waiting rank's gradient reduction, the slowest optimizer step)."
        + ("".join(f" At p = {p}, {p} processes share the {os.cpu_count()} cores: one rank's idle "
                   f"time in the pipeline is another's compute time, which the simulator (a core "
                   f"per rank) does not model." for p in args.p if p > (os.cpu_count() or 1)))
        + (" Tiny model: the figures check the harness, they are not results." if args.tiny else "")
        + "\n"]
    for p in args.p:
        blocks.append(f"p = {p}, t = 1, d = 1:\n\n" + time_table(timing[p]))
    blocks.append("Measured costs per microbatch (the simulator's input) and peak stored "
                  "activations, per rank:\n\n" + cost_table([r for p in args.p for r in timing[p]]))
    for p, figures in memory.items():
        reset = all(m["reset"] for ranks in figures.values() for m in ranks)
        peak = ("VmHWM reset after warm-up" if reset else
                "VmHWM of the whole process: /proc/self/clear_refs not writable")
        blocks.append(f"Memory, p = {p}, each schedule in fresh processes: peak RSS over 2 iterations "
                      f"after 2 warm-up ones ({peak}); rise = peak - resident set after warm-up.\n\n"
                      + memory_table(figures) + "\n\n" + memory_verdict(figures, p))
    blocks.append(f"Run time {time.time() - started:.0f} s.")
    publish(HEADING, "\n\n".join(blocks) + "\n", write=args.write)
    if args.json:
        Path(args.json).write_text(json.dumps({"timing": timing, "memory": memory}, indent=1))
    failed = [f"p={p} {r['layout']}" for p in args.p for r in timing[p] if not r["same_loss"]]
    if failed:
        print(f"losses differ in {len(failed)} row(s): {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
