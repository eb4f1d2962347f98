"""Activation memory with and without recomputation (CPU, peak RSS).

Runs one training-mode forward + backward of a GPT in a fresh process per
recomputation layout (off, selective, full-uniform-1, full-block-k) and
reports the peak resident memory above that process's own baseline taken
after the model is built (and warmed up on a tiny batch, so that code and
modules first touched by a backward pass count in the baseline, not in the
peak). Prints a Markdown table; with --write appends it to bench/RESULTS.md
under "Activation memory (CPU, peak RSS)".

    python bench/memory.py                      # defaults: l=12 h=512 a=8 s=1024 b=4 V=50257
    python bench/memory.py --seq 512 --write

How the peak is measured: the kernel's high-water mark (VmHWM), reset to the
current resident set just before the measured step (/proc/self/clear_refs,
Linux >= 4.0); ru_maxrss is used where that is not possible, but it cannot
be reset and carries the parent's resident size across fork + exec. glibc is
told to serve allocations above 64 KiB by mmap (MALLOC_MMAP_THRESHOLD_), so
freed tensors leave the resident set at once and the peak follows the live
tensors rather than heap fragmentation (--glibc-default-malloc turns that
off). "saved" is the bytes of distinct storages held for backward at the end
of the forward (saved-tensor hooks around the model call; non-reentrant
checkpoint keeps its region's tensors behind its own inner hooks, so this
counts what really stays stored), parameters excluded.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Activation memory (CPU, peak RSS)"


def layouts(block_layers: int) -> dict[str, dict]:
    return {
        "off": {},
        "selective": dict(recompute_granularity="selective"),
        "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1),
        f"full-block-{block_layers}": dict(recompute_granularity="full", recompute_method="block",
                                           recompute_num_layers=block_layers),
    }


# ---------------------------------------------------------------- worker side

def _status_bytes(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(field + r":\s+(\d+) kB", text)
    return int(match.group(1)) * 1024 if match else None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(spec: dict) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from ptdp.config import ModelConfig
    from ptdp.model.gpt import GPT
    from ptdp.parallel.tensor import RNGStreams
    from ptdp.parallel.topology import ParallelContext
    from ptdp.perf.analytic.saved import SavedTensorBytes

    torch.set_num_threads(spec.pop("threads"))
    batch = spec.pop("micro_batch")
    config = ModelConfig(**spec)
    ctx = ParallelContext.single()
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(1234, ctx)
    model = GPT(config, ctx, rng).initialize(1234).train()
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1),
                           generator=torch.Generator().manual_seed(0))
    model(tokens[:1, :9], tokens[:1, 1:10]).backward()  # warm-up
    model.zero_grad(set_to_none=True)
    gc.collect()

    reset = _reset_peak()
    baseline = _status_bytes("VmRSS") if reset else None
    if baseline is None:  # no /proc: ru_maxrss, which cannot be reset
        reset = False
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with SavedTensorBytes(model.parameters()) as counted:
        loss = model(tokens[:, :-1], tokens[:, 1:])
    saved = counted.bytes
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") if reset else None
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(baseline=baseline, peak=peak, saved=saved, seconds=seconds, hwm=reset,
                torch=torch.__version__)


# ---------------------------------------------------------------- driver side

def run_layout(model: dict, layout: dict, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if not args.glibc_default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["OMP_NUM_THREADS"] = str(args.threads)
    spec = {**model, **layout, "threads": args.threads}
    process = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                             cwd=ROOT, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        raise SystemExit(f"worker failed for {layout}:\n{process.stderr}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def report(args: argparse.Namespace, model: dict, results: dict[str, dict], command: str) -> str:
    mib = 2 ** 20
    off = results["off"]["peak"] - results["off"]["baseline"]
    any_result = next(iter(results.values()))
    lines = [
        f"### {datetime.date.today().isoformat()}: GPT l={args.layers}, h={args.hidden}, "
        f"a={args.heads}, s={args.seq}, b={args.micro_batch}, V={args.vocab}, fp32, CPU",
        "",
        f"Command: `{command}`  ",
        f"torch {any_result['torch']}, {cpu_name()}, {args.threads} thread(s); dropout "
        f"{args.dropout} (hidden and attention); peak = "
        + ("VmHWM reset after warm-up" if all(r["hwm"] for r in results.values())
           else "ru_maxrss (could not reset VmHWM)")
        + ("" if args.glibc_default_malloc else ", MALLOC_MMAP_THRESHOLD_=65536") + ".",
        "",
        "| recompute | peak above baseline (MiB) | ratio to off | saved for backward (MiB) "
        "| forward+backward (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        peak = r["peak"] - r["baseline"]
        lines.append(f"| {name} | {peak / mib:.0f} | {peak / off:.2f} | {r['saved'] / mib:.0f} "
                     f"| {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--block-layers", type=int, default=None,
                        help="layers checkpointed by the block method (default: half)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="do not set MALLOC_MMAP_THRESHOLD_ (peaks then include heap "
                             "fragmentation)")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    block_layers = args.block_layers or max(1, args.layers // 2)
    model = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=args.dropout,
                 attention_dropout=args.dropout, micro_batch=args.micro_batch)
    command = shlex.join(["python", "bench/memory.py", *(sys.argv[1:] if argv is None else argv)])
    results = {}
    for name, layout in layouts(block_layers).items():
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = run_layout(model, layout, args)
    block = report(args, model, results, command)
    publish(HEADING, block, write=args.write)


if __name__ == "__main__":
    main()
