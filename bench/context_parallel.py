"""Context parallelism on this machine: the longest sequence that trains
within a fixed memory per rank, with and without it, and the iteration time
of the three ways its attention exchanges keys and values (CPU, gloo).

1. Longest sequence. A small Llama-like model (RMSNorm, SwiGLU, rotary
   positions, grouped-query attention, untied output layer) trains one
   iteration of one sequence (b = 1) through ptdp's Trainer, on one process
   (c = 1) and on c processes (-c, default 4; --cp-comm-type p2p). The
   memory of a rank is the peak of its resident set during the iteration
   above the resident set just before it, after the Trainer is built: the
   kernel's high-water mark (VmHWM) reset to the current resident set before
   the step (/proc/self/clear_refs), glibc told to serve allocations above
   64 KiB by mmap so that freed tensors leave the resident set at once. That
   is what the iteration needs beyond the model's weights and gradients
   (activations, attention's work space, the logits, the ring's buffers);
   the Adam state the first iteration allocates is in it too, but only
   where it exceeds the activations, at short lengths (it is allocated after
   the backward has freed them). The largest rank's figure counts. A
   doubling search from --start finds the longest --seq-length within
   --budget-mib at each c, then --refine bisection steps between the last
   length that fit and the first that did not. Each trial also reports the
   bytes autograd saves for backward (ptdp.perf.analytic.saved) and the whole
   resident peak.
2. Time. The same c (one thread per process), one model and sequence
   length, one Trainer per --cp-comm-type (p2p, all_gather, a2a); iterations
   rotate the order of the three so the machine's noise falls on all; the
   median of the timed iterations, as ratios to p2p. The three must compute
   the same losses (checked).

    python bench/context_parallel.py            # prints the tables
    python bench/context_parallel.py --write    # also appends them to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from local_job import free_port  # noqa: E402
from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.config.checks import validate
from ptdp.parallel.block_attention import block_kernel
from ptdp.parallel.context_attention import COMM_TYPES, KERNEL_OPS
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic.saved import SavedTensorBytes
from ptdp.train.loop import Trainer

HEADING = "## Context parallelism: longest sequence within a memory per rank, and its exchanges (CPU)"
CPU = torch.device("cpu")
MIB = 2 ** 20
LOSS_RTOL = 1e-4   # the three exchanges sum the same products in other orders


def llama_model(hidden: int = 256, layers: int = 2, heads: int = 8, groups: int = 4,
                ffn: int = 688, vocab: int = 1024, seq: int = 1024) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=groups, group_query_attention=groups != heads,
                       seq_length=seq, vocab_size=vocab, hidden_dropout=0.0,
                       attention_dropout=0.0, normalization="RMSNorm", swiglu=True,
                       ffn_hidden_size=ffn, position_embedding_type="rope",
                       untie_embeddings_and_output_weights=True, disable_bias_linear=True)


def train_config(model: ModelConfig, c: int, comm: str = "p2p", iters: int = 1) -> Config:
    config = Config(model=model,
                    parallel=ParallelConfig(context_parallel_size=c, cp_comm_type=comm),
                    train=TrainConfig(micro_batch_size=1, global_batch_size=1, train_iters=iters,
                                      seed=5),
                    data=DataConfig(mock_data=True))
    validate(config, world_size=c)
    return config


def context(c: int) -> ParallelContext:
    return ParallelContext.single() if c == 1 else ParallelContext.build(RankGrid(tp=1, dp=1, pp=1,
                                                                                  cp=c))


# ---------------------------------------------------------------- memory, per rank

def _status_bytes(field: str) -> int | None:
    try:
        match = re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # VmHWM := VmRSS
        return True
    except OSError:
        return False


def _largest_over_ranks(values: list[float], c: int) -> list[float]:
    """Each value's maximum over the c ranks (all ranks get it, so all take
    the same decisions)."""
    if c == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def step_memory(model: ModelConfig, c: int, seq: int) -> dict:
    """One training iteration at sequence length `seq` on this rank's share
    of a c-rank context group: the peak resident bytes above the resident set
    before it, the bytes saved for backward, the whole resident peak and the
    loss; each figure the largest over the ranks."""
    trainer = Trainer(train_config(dataclasses.replace(model, seq_length=seq), c), context(c), CPU)
    parameters = [p for chunk in trainer.chunks for p in chunk.parameters()]
    gc.collect()
    if c > 1:
        dist.barrier()
    if not _reset_peak():
        raise SystemExit("cannot reset the resident high-water mark (/proc/self/clear_refs): "
                         "this benchmark needs Linux")
    baseline = _status_bytes("VmRSS")
    with SavedTensorBytes(parameters) as saved:
        record, _ = trainer.step(0)
    peak = _status_bytes("VmHWM")
    loss = record["loss"] if record["loss"] is not None else float("-inf")
    above, saved_bytes, whole, loss = _largest_over_ranks(
        [peak - baseline, saved.bytes, peak, loss], c)
    del trainer, parameters
    gc.collect()
    return {"seq": seq, "above": int(above), "saved": int(saved_bytes), "peak": int(whole),
            "loss": loss}


def search(fits: Callable[[int], bool], start: int, refine: int, grain: int,
           limit: int) -> tuple:
    """(longest length that fits, first length found not to): doubling from
    `start` up to `limit`, then `refine` bisection steps on multiples of
    `grain`. The first is None when `start` does not fit, the second when
    every length up to `limit` fits."""
    fit, over = None, start
    while True:
        if over > limit:
            return fit, None
        if not fits(over):
            break
        fit, over = over, 2 * over
    for _ in range(refine if fit is not None else 0):
        middle = (fit + over) // 2 // grain * grain
        if middle in (fit, over):
            break
        if fits(middle):
            fit = middle
        else:
            over = middle
    return fit, over


def longest_within(rank: int, model: ModelConfig, c: int, budget: int, start: int,
                   refine: int, limit: int) -> dict:
    """The longest --seq-length whose iteration stays within `budget` bytes
    per rank (see `search`; lengths multiples of 64·c, so of 2c); every trial
    recorded."""
    torch.manual_seed(0)
    # Warm-up: code and buffers first touched by a step count in the baseline.
    step_memory(model, c, 16 * c)
    trials = []

    def fits(seq: int) -> bool:
        trials.append(step_memory(model, c, seq))
        return trials[-1]["above"] <= budget

    fit, over = search(fits, start, refine, 64 * c, limit)
    return {"c": c, "longest": fit, "first_over": over, "trials": trials,
            "kernel": block_kernel(CPU, torch.float32,
                                   model.hidden_size // model.num_attention_heads)}


# ---------------------------------------------------------------- time, per rank

def comm_times(rank: int, model: ModelConfig, c: int, warmup: int, iters: int) -> dict:
    """Iteration times and losses of one Trainer per --cp-comm-type at the
    same layout, the order of the three rotating every iteration."""
    trainers = {comm: Trainer(train_config(model, c, comm, warmup + iters), context(c), CPU)
                for comm in COMM_TYPES}
    times: dict[str, list[float]] = {comm: [] for comm in COMM_TYPES}
    losses: dict[str, list[float]] = {comm: [] for comm in COMM_TYPES}
    for iteration in range(warmup + iters):
        shift = iteration % len(COMM_TYPES)
        for comm in COMM_TYPES[shift:] + COMM_TYPES[:shift]:
            dist.barrier()
            start = time.perf_counter()
            record, _ = trainers[comm].step(iteration)
            dist.barrier()
            losses[comm].append(record["loss"])
            if iteration >= warmup:
                times[comm].append(time.perf_counter() - start)
    return {"times": times, "losses": losses, "seq": model.seq_length, "warmup": warmup}


# ---------------------------------------------------------------- processes

def _worker(rank: int, world: int, port: int, threads: int, jobs: list, out: str) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    try:
        results = [globals()[name](rank, *args) for name, args in jobs]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_jobs(world: int, threads: int, jobs: list) -> list:
    """Run each (function name, args) of `jobs` in turn on `world` fresh
    processes (one gloo group); rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(world, free_port(), threads, jobs, out), nprocs=world,
                           join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


# ---------------------------------------------------------------- report

def _describe(model: ModelConfig) -> str:
    return (f"Llama-like l={model.num_layers}, h={model.hidden_size}, "
            f"a={model.num_attention_heads}, g={model.num_query_groups}, "
            f"f={model.ffn_hidden_size}, V={model.vocab_size}, b=1, fp32")


def _length(seq: int | None) -> str:
    return "none up to --max-seq" if seq is None else f"{seq:,}"


def _bound(many: dict, one: dict) -> str:
    """The ratio's range the search's resolution leaves."""
    low = many["longest"] / one["first_over"] if one["first_over"] else 0.0
    high = f"{many['first_over'] / one['longest']:.2f}" if many["first_over"] else "unbounded"
    return f"{low:.2f} and {high}"


def memory_table(searches: list[dict], budget: int) -> str:
    rows = []
    for search in searches:
        for trial in search["trials"]:
            fits = trial["above"] <= budget
            rows.append(f"| {search['c']} | {trial['seq']:,} | {trial['above'] / MIB:.0f} | "
                        f"{trial['saved'] / MIB:.0f} | {trial['peak'] / MIB:.0f} | "
                        f"{'yes' if fits else 'no'} |")
    return "\n".join([
        "| c | --seq-length | iteration's peak above its start, largest rank (MiB) "
        "| saved for backward (MiB) | whole resident peak (MiB) | within budget |",
        "|---|---:|---:|---:|---:|---|", *rows])


def report(args: argparse.Namespace, model: ModelConfig, searches: list[dict], timing: dict,
           command: str) -> str:
    budget = args.budget_mib * MIB
    one, many = searches
    c = many["c"]
    if one["longest"] is None or many["longest"] is None:
        raise SystemExit(f"--start {args.start} is over the budget at c = 1 or c = {c}: "
                         f"give a smaller --start or a larger --budget-mib")
    ratio = many["longest"] / one["longest"] if one["longest"] and many["longest"] else float("nan")
    times = {comm: statistics.median(timing["times"][comm]) for comm in COMM_TYPES}
    tokens = timing["seq"]
    kernel = one["kernel"]
    lines = [
        f"### {datetime.date.today()}: {_describe(model)}, {cpu_name()}",
        "",
        f"Command: `{command}`  ",
        f"torch {torch.__version__}; attention kernel of every block: {kernel} "
        f"({KERNEL_OPS[kernel]}); c = 1 on one process with {args.threads} threads, c = {c} on "
        f"{c} processes with one thread each (gloo); MALLOC_MMAP_THRESHOLD_=65536; the "
        f"machine's load average {args.load[0]:.1f} at the start, {args.load[1]:.1f} at the end "
        f"(other jobs share its cores).",
        "",
        f"**Longest sequence within {args.budget_mib} MiB per rank** (memory of a rank: the peak "
        f"resident set during one training iteration above the resident set before it, VmHWM "
        f"reset after the Trainer is built; the weights and gradients, the same at every c, come "
        f"on top): **{one['longest']:,} tokens at c = 1, {many['longest']:,} at c = {c} (p2p), "
        f"{ratio:.2f}×** (first lengths over the budget: {_length(one['first_over'])} and "
        f"{_length(many['first_over'])}, so the ratio is between {_bound(many, one)}). Every "
        f"trial, doubling from {args.start:,} then up to "
        f"{args.refine} bisection steps:",
        "",
        memory_table(searches, budget),
        "",
        f"An iteration's memory grows linearly with the sequence (the attention kernel keeps no "
        f"s × s matrix) and context parallelism divides it by c: a rank holds s/c positions of "
        f"every activation, the logits included. What does not fall is small and fixed (at short "
        f"lengths the figure is mostly the Adam state the first iteration allocates).",
        "",
        f"**Iteration time by --cp-comm-type**, c = {c}, --seq-length {tokens:,}, one thread per "
        f"process, median of {len(timing['times']['p2p'])} iterations after {timing['warmup']} "
        f"of warm-up, the order of the three rotating every iteration (the three computed the "
        f"same losses within {LOSS_RTOL:g}):",
        "",
        "| --cp-comm-type | iteration (ms) | tokens/s | time / p2p's |",
        "|---|---:|---:|---:|",
        *[f"| {comm} | {times[comm] * 1e3:.0f} | {tokens / times[comm]:,.0f} | "
          f"{times[comm] / times['p2p']:.3f} |" for comm in COMM_TYPES],
        "",
        "Per layer and rank, p2p runs c ring steps of one kernel call each, merging the partial "
        "outputs by their log-sum-exp, each key/value transfer overlapping a step; all_gather "
        "gathers all keys and values first, then makes up to four kernel calls; a2a exchanges "
        "heads for positions before and after the attention and makes one causal call over the "
        "whole sequence on heads/c heads. Over loopback gloo, with one thread per process and "
        f"{c} processes on {os.cpu_count()} shared cores, the transfers are cheap and cannot "
        "truly overlap, so fewer, larger kernel calls count for more than p2p's overlap. These "
        "ratios are of one run on a shared machine and move by tens of percent between runs.",
        "",
    ]
    return "\n".join(lines)


def same_losses(losses: dict[str, list[float]]) -> bool:
    reference = losses["p2p"]
    return all(len(losses[comm]) == len(reference) and all(
        abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(losses[comm], reference))
        for comm in COMM_TYPES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="key/value groups (GQA)")
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("-c", "--context-parallel-size", dest="c", type=int, default=4)
    parser.add_argument("--budget-mib", type=int, default=256,
                        help="memory per rank an iteration may take above its start")
    parser.add_argument("--start", type=int, default=1024, help="first --seq-length tried")
    parser.add_argument("--refine", type=int, default=4, help="bisection steps after doubling")
    parser.add_argument("--max-seq", type=int, default=131072, help="longest --seq-length tried")
    parser.add_argument("--time-seq", type=int, default=4096, help="--seq-length of the timing")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per comm type")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads of the c = 1 process")
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    c = args.c
    if c < 2 or args.start % (64 * c) or args.time_seq % (2 * c):
        parser.error(f"-c must be at least 2, --start a multiple of 64·c = {64 * c} and "
                     f"--time-seq of 2c = {2 * c}")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"   # read by the spawned processes' glibc
    model = llama_model(args.hidden, args.layers, args.heads, args.groups, args.ffn, args.vocab)
    budget = args.budget_mib * MIB
    began, load = time.perf_counter(), os.getloadavg()[0]
    (one,) = run_jobs(1, args.threads, [("longest_within", (model, 1, budget, args.start,
                                                            args.refine, args.max_seq))])
    print(f"c = 1: {one['longest']} ({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    many, timing = run_jobs(c, 1, [
        ("longest_within", (model, c, budget, args.start, args.refine, args.max_seq)),
        ("comm_times", (dataclasses.replace(model, seq_length=args.time_seq), c, args.warmup,
                        args.iters))])
    print(f"c = {c}: {many['longest']}, timing done ({time.perf_counter() - began:.0f} s)",
          file=sys.stderr)
    args.load = (load, os.getloadavg()[0])
    if not same_losses(timing["losses"]):
        raise SystemExit(f"the comm types computed different losses: {timing['losses']}")
    command = shlex.join(["python", "bench/context_parallel.py",
                          *(sys.argv[1:] if argv is None else argv)])
    publish(HEADING, report(args, model, [one, many], timing, command), write=args.write)


if __name__ == "__main__":
    main()
