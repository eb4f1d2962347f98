"""Causal attention over packed documents on this CPU: the per-document
path (each document through causal scaled_dot_product_attention) against
the dense block-diagonal mask, and FlexAttention's forward where this torch
runs it on CPU (its eager form: the unfused reference, no backward).

Packs are filled with conversation-like lengths (log-normal, median 300
tokens, clipped to [16, s]), the last one cut to fit, as first-fit packing
leaves them; fp32, GQA. Forward + backward for per-document and dense;
forward alone for all three. The kinds alternate in each pair, order
swapped every other pair.

    python bench/document_attention.py            # prints the table
    python bench/document_attention.py --write    # also appends it to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings

import torch

from ptdp.parallel.document_attention import (DENSE, FLEX, PER_DOCUMENT,
                                              document_causal_attention, flex_available)
from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

HEADING = ("## Document-masked attention for packed sequences: per-document against the dense "
           "mask (CPU)")


def pack_lengths(seq: int, generator: torch.Generator) -> list[int]:
    """Document lengths that fill one pack of `seq` tokens."""
    lengths, filled = [], 0
    while filled < seq:
        draw = torch.empty(1).log_normal_(mean=5.7, std=0.8, generator=generator).item()
        length = min(max(16, int(draw)), seq - filled)
        lengths.append(length)
        filled += length
    return lengths


def _timed(function, *tensors, backward: bool) -> float:
    tensors = [t.detach().requires_grad_(backward) for t in tensors]
    began = time.perf_counter()
    if backward:
        function(*tensors).sum().backward()
    else:
        with torch.no_grad():
            function(*tensors)
    return time.perf_counter() - began


def measure(seq: int, args: argparse.Namespace) -> dict:
    generator = torch.Generator().manual_seed(seq)
    lengths = pack_lengths(seq, generator)
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                  torch.tensor(lengths))
    q = torch.randn(1, args.heads, seq, args.head_dim, generator=generator)
    k, v = (torch.randn(1, args.groups, seq, args.head_dim, generator=generator)
            for _ in range(2))
    kernels = [PER_DOCUMENT, DENSE] + ([FLEX] if args.flex else [])
    times = {(kernel, backward): [] for kernel in kernels for backward in (True, False)}
    for pair in range(args.pairs + 1):  # the first is a warm-up
        order = kernels if pair % 2 == 0 else kernels[::-1]
        for backward in (True, False):
            for kernel in order:
                if kernel == FLEX and backward:
                    continue
                seconds = _timed(lambda q, k, v, kernel=kernel: document_causal_attention(
                    q, k, v, ids, kernel=kernel), q, k, v, backward=backward)
                if pair:
                    times[(kernel, backward)].append(seconds)
    median = {key: statistics.median(values) for key, values in times.items() if values}
    inside = sum(n * (n + 1) // 2 for n in lengths) / (seq * (seq + 1) // 2)
    return {"seq": seq, "documents": len(lengths), "median_length": statistics.median(lengths),
            "inside": inside, "median": median}


def report(args: argparse.Namespace, rows: list[dict], load: tuple) -> str:
    flex = args.flex
    lines = [f"### {datetime.date.today().isoformat()}: b = 1, {args.heads} heads, "
             f"{args.groups} key/value groups, head size {args.head_dim}, fp32, "
             f"{args.pairs} pairs", "",
             "Command: `python bench/document_attention.py --write`  ",
             f"torch {torch.__version__}, {cpu_name()}, {torch.get_num_threads()} threads. "
             f"Load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load[0])}, "
             f"after {', '.join(f'{x:.2f}' for x in load[1])}. Median seconds per call; "
             f"'causal work inside documents' is the share of the causal s × s scores "
             f"that fall within a document (the least work a document kernel needs).", "",
             "| s | documents | median length | causal work inside documents | per-document "
             "fwd+bwd (s) | dense fwd+bwd (s) | dense/per-document | per-document fwd (s) | "
             "dense fwd (s) | dense/per-document" + (" | flex fwd (s) | flex/per-document |"
                                                     if flex else " |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:" + ("|---:|---:|" if flex
                                                                   else "|")]
    for row in rows:
        m = row["median"]
        cells = [row["seq"], row["documents"], f"{row['median_length']:.0f}",
                 f"{row['inside']:.3f}", f"{m[(PER_DOCUMENT, True)]:.3f}",
                 f"{m[(DENSE, True)]:.3f}", f"{m[(DENSE, True)] / m[(PER_DOCUMENT, True)]:.1f}x",
                 f"{m[(PER_DOCUMENT, False)]:.3f}", f"{m[(DENSE, False)]:.3f}",
                 f"{m[(DENSE, False)] / m[(PER_DOCUMENT, False)]:.1f}x"]
        if flex:
            cells += [f"{m[(FLEX, False)]:.3f}",
                      f"{m[(FLEX, False)] / m[(PER_DOCUMENT, False)]:.1f}x"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--no-flex", dest="flex", action="store_false")
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)
    args.flex = args.flex and flex_available("cpu")
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    before = os.getloadavg()
    rows = [measure(seq, args) for seq in args.seq]
    publish(HEADING, report(args, rows, (before, os.getloadavg())), write=args.write)


if __name__ == "__main__":
    sys.exit(main())
