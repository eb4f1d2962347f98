"""Sliding-window attention against full causal attention on this CPU (issue
43, item 7): forward + backward of ptdp.parallel.local_attention with a
window of L keys, and of the full causal attention (PyTorch's
scaled_dot_product_attention, what a layer without a window runs), at
growing sequence lengths; with a learnable sink per head as gpt-oss has,
and the shares of the causal (query, key) pairs and of the kernel's blocks
the window keeps (ptdp.perf.analytic.local_attention, what the planner
prices).

The two sides alternate, each figure the median of the repetitions, the
machine's 1-minute load quoted at the start and end of each row (this
machine is shared); before any time counts, the windowed output is checked
against the dense masked reference at the smallest length.

    .venv/bin/python bench/attention.py [--write]     # the figures in RESULTS.md
    .venv/bin/python bench/attention.py --tiny         # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import cpu_name, publish  # noqa: E402  bench/results.py

from ptdp.parallel.local_attention import DEFAULT_BLOCK, local_attention, window_mask  # noqa: E402
from ptdp.perf.analytic.local_attention import block_fraction, pair_fraction  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--window", type=int, default=128, help="L: keys before each query")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="alternating timings per side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="lengths 64 and 128, window 16, 2 repeats")
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    return p


def _inputs(s: int, heads: int, d: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, s, d, generator=generator, requires_grad=True)
               for _ in range(3))
    sinks = torch.randn(heads, generator=generator, requires_grad=True)
    return q, k, v, sinks


def _windowed(q, k, v, sinks, left):
    return local_attention(q, k, v, window=(left, 0), sinks=sinks)


def _full(q, k, v, sinks, left):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _seconds(fn, inputs, left) -> float:
    start = time.perf_counter()
    out = fn(*inputs, left)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def check(left: int, s: int, heads: int, d: int) -> float:
    """The windowed output's largest difference from the dense masked softmax
    with the sink as an extra column (fp64)."""
    q, k, v, sinks = (x.detach().double() for x in _inputs(s, heads, d))
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    scores = scores.masked_fill(~window_mask(s, (left, 0)), float("-inf"))
    column = sinks.view(1, heads, 1, 1).expand(1, heads, s, 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :s]
    return (local_attention(q, k, v, window=(left, 0), sinks=sinks) - weights @ v).abs().max().item()


def measure(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    error = check(args.window, min(args.lengths), args.heads, args.head_dim)
    if error > 1e-9:
        raise SystemExit(f"the windowed attention differs from the dense reference by {error:.3g}")
    rows = []
    for s in args.lengths:
        load = os.getloadavg()[0]
        inputs = _inputs(s, args.heads, args.head_dim)
        times = {"windowed": [], "full": []}
        for repeat in range(args.repeats + 1):   # the first of each side a warm-up
            order = ("windowed", "full") if repeat % 2 == 0 else ("full", "windowed")
            for side in order:
                for x in inputs:
                    x.grad = None
                seconds = _seconds(_windowed if side == "windowed" else _full, inputs,
                                   args.window)
                if repeat:
                    times[side].append(seconds)
        rows.append({"s": s, "windowed": statistics.median(times["windowed"]),
                     "full": statistics.median(times["full"]),
                     "pairs": pair_fraction(s, args.window),
                     "blocks": block_fraction(s, args.window, DEFAULT_BLOCK),
                     "load": (load, os.getloadavg()[0]), "error": error})
    return rows


def table(args, rows: list[dict]) -> str:
    lines = [f"### {datetime.date.today()}: window L = {args.window}, {args.heads} heads of "
             f"{args.head_dim}, b = 1, fp32, a learnable sink per head; {cpu_name()}, "
             f"{args.threads} thread(s), torch {torch.__version__}",
             "",
             f"Command: `python bench/attention.py {' '.join(sys.argv[1:])}`. Forward + backward, "
             f"median of {args.repeats} alternating repetitions a side after a warm-up; the "
             f"windowed output checked first against the dense masked softmax with the sink "
             f"as an extra column (fp64, largest difference {rows[0]['error']:.1e}).",
             "",
             "| s | windowed ms | full causal ms | full / windowed | pairs kept | blocks visited "
             "| load before / after |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['s']:,} | {1000 * row['windowed']:.1f} | {1000 * row['full']:.1f} "
                     f"| {row['full'] / row['windowed']:.2f} | {100 * row['pairs']:.1f} % "
                     f"| {100 * row['blocks']:.1f} % | {row['load'][0]:.1f} / "
                     f"{row['load'][1]:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.tiny:
        args.lengths, args.window, args.repeats = [64, 128], 16, 2
    publish("## Sliding-window attention against full causal attention",
            table(args, measure(args)), write=args.write)


if __name__ == "__main__":
    main()
