"""`ptdp schedule`: build one iteration of a pipeline schedule, simulate it
in unit time (ptdp.schedules.simulate), print its makespan, bubble and
every rank's computes, and draw its timeline (ptdp.perf.simulate.timeline).
Torch-free: the schedules and the timeline import no torch."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path

from ptdp.perf.simulate.timeline import boxes_from_simulation, draw_timeline, format_fraction
from ptdp.schedules.actions import Compute, ScheduleError
from ptdp.schedules.build import build_schedule, uniform_costs
from ptdp.schedules.kinds import (KIND_NAMES, KINDS, SPLIT_BACKWARD, any_chunks_kind, kind_named,
                                  lower_first, or_list)
from ptdp.schedules.simulate import SimulationResult, compute_costs, simulate


def _cost(text: str) -> Fraction:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 1, 0.5, 1/3)") from None


def _interleaving() -> str:
    """The kinds that run interleaved with chunks (ScheduleKind.with_chunks)."""
    return " or ".join(k.name for k in KINDS.values() if k.with_chunks)


def add_schedule_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `schedule` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "schedule", help="print and draw a pipeline schedule (GPipe, 1F1B, interleaved 1F1B, "
                         "zero bubble)",
        description="Build one iteration of a pipeline schedule, simulate it in unit time and "
                    "print its makespan, bubble fraction, peak in-flight microbatches and the "
                    "order of computes on every rank; --out draws it like the paper's "
                    "Figures 3 and 4. Time is in units of one stage's forward pass by default "
                    "(forward 1, backward 2; a chunk costs 1/v of that). Under "
                    f"{' and '.join(SPLIT_BACKWARD)} "
                    "the backward is split into B (input gradient) and W (weight gradients), "
                    "by default 1 each.")
    parser.add_argument("--kind", "--pipeline-schedule", dest="kind", required=True,
                        choices=KIND_NAMES,
                        help="schedule kind (--pipeline-schedule as in ptdp train, which also "
                             f"takes {_interleaving()} with --num-layers-per-virtual-pipeline-stage "
                             f"for {any_chunks_kind().name})")
    parser.add_argument("-p", "--pipeline-model-parallel-size", dest="p", type=int, required=True,
                        metavar="P", help="pipeline ranks p")
    parser.add_argument("-m", "--num-microbatches", dest="m", type=int, required=True, metavar="M",
                        help="microbatches per iteration m")
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", dest="layers_per_chunk",
                        type=int, default=None, metavar="K",
                        help="layers per model chunk, with --num-layers, as in ptdp train: v = "
                             f"num-layers / (p·K) chunks per rank; with --kind {_interleaving()} "
                             f"it selects {lower_first(any_chunks_kind().title)}")
    parser.add_argument("--num-layers", dest="num_layers", type=int, default=None, metavar="L",
                        help="transformer layers, for --num-layers-per-virtual-pipeline-stage")
    parser.add_argument("-v", "--num-model-chunks", dest="v", type=int, default=None, metavar="V",
                        help="model chunks per rank directly, instead of the two flags above "
                             f"(default: 2 for {' and '.join(k.name for k in KINDS.values() if k.chunks != 1)}, "
                             "else 1)")
    parser.add_argument("--out", metavar="FILE.png",
                        help="draw the timeline to this file (.png; .svg and .pdf also work)")
    parser.add_argument("--forward-cost", type=_cost, default=Fraction(1), metavar="X",
                        help="time of a forward through one rank's layers (default: 1)")
    parser.add_argument("--backward-cost", type=_cost, default=Fraction(2), metavar="X",
                        help="time of a backward through one rank's layers (default: 2)")
    parser.add_argument("--weight-cost", type=_cost, default=None, metavar="X",
                        help=f"{' and '.join(SPLIT_BACKWARD)} only: the weight-gradient (W) share "
                             "of the backward "
                             "cost; B costs the rest (default: half the backward cost)")
    parser.add_argument("--transfer-cost", type=_cost, default=Fraction(0), metavar="X",
                        help="time of one batched point-to-point exchange (default: 0)")
    parser.add_argument("--xmax", type=float, default=None, metavar="T",
                        help="right end of the picture's time axis, to draw several schedules "
                             "to the same scale (default: the makespan)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    return parser


def paper_bubble_fraction(kind: str, p: int, m: int, v: int) -> Fraction:
    """The kind's record's bubble under unit costs: (p-1)/m for GPipe and
    1F1B, (p-1)/(m·v) for interleaved 1F1B; under F = B = W, (p-1)/(3m) for
    ZB-H1 and (p-1)/(6m) for ZB-V (zero_bubble.py)."""
    return kind_named(kind).bubble(p, m, v)


def _number(x: Fraction) -> float | int:
    return int(x) if x.denominator == 1 else float(x)


def _error(message: str) -> int:
    print(f"ptdp: error: {message}", file=sys.stderr)
    return 2


def kind_and_chunks(kind: str, p: int, v: int | None, num_layers: int | None,
                    layers_per_chunk: int | None) -> tuple[str, int]:
    """The schedule kind and chunks per rank v that `ptdp schedule`'s flags
    mean, read as `ptdp train` reads them: --num-layers-per-virtual-pipeline-stage
    K with --num-layers L gives v = L / (p·K), and turns 1F1B into interleaved
    1F1B. ValueError, naming the flags, when they cannot work or disagree."""
    record = kind_named(kind)
    default = record.chunks or 2
    if layers_per_chunk is None:
        return kind, v if v is not None else default
    k, flag = layers_per_chunk, "--num-layers-per-virtual-pipeline-stage"
    if num_layers is None:
        raise ValueError(f"{flag} {k} needs --num-layers L: ranks hold v = L / (p·{k}) chunks, "
                         f"as in ptdp train (or give -v/--num-model-chunks V instead)")
    if not record.takes_layers_per_chunk and record.other_chunks is not None:
        other = kind_named(record.other_chunks)
        raise ValueError(f"--kind {kind} has one model chunk per rank, so {flag} {k} does not "
                         f"apply: drop it, or use --kind {other.name} ({other.chunks_words})")
    if not record.takes_layers_per_chunk:
        title = lower_first(any_chunks_kind().title)
        raise ValueError(f"--kind {kind} cannot be combined with {flag} (interleaving uses the "
                         f"{title} schedule): drop one of them")
    if k < 1 or num_layers < 1 or p < 1:
        raise ValueError(f"{flag} {k}, --num-layers {num_layers} and -p {p} must be positive")
    if num_layers % (p * k):
        raise ValueError(f"--num-layers {num_layers} is not divisible by -p {p} × {flag} {k} = "
                         f"{p * k}: every rank holds v chunks of {k} layers")
    chunks = num_layers // (p * k)
    if v is not None and v != chunks:
        raise ValueError(f"-v/--num-model-chunks {v} disagrees with --num-layers {num_layers} / "
                         f"(-p {p} × {flag} {k}) = {chunks} chunks per rank: give one of them")
    return record.with_chunks or kind, chunks


def compute_label(compute: Compute) -> str:
    """'F1.0': a compute as the text shows it, its microbatch numbered from 1
    like the picture's boxes, its chunk from 0 like the picture's legend."""
    return f"{compute.op}{compute.microbatch + 1}.{compute.chunk}"


def run_schedule_command(args: argparse.Namespace) -> int:
    p, m = args.p, args.m
    try:
        kind, v = kind_and_chunks(args.kind, p, args.v, getattr(args, "num_layers", None),
                                  getattr(args, "layers_per_chunk", None))
    except ValueError as error:
        return _error(str(error))
    out = Path(args.out) if args.out else None
    if out is not None:
        if out.suffix.lower() not in (".png", ".svg", ".pdf"):
            return _error(f"--out {args.out}: give a .png (or .svg, .pdf) file name")
        if not out.resolve().parent.is_dir():
            return _error(f"--out {args.out}: directory {out.resolve().parent} does not exist; "
                          f"create it or choose another path")
        if out.is_dir():
            return _error(f"--out {args.out} is a directory; give a file name")
    for name, value, least in (("--forward-cost", args.forward_cost, 0),
                               ("--backward-cost", args.backward_cost, 0),
                               ("--transfer-cost", args.transfer_cost, None)):
        if (value <= 0) if least is not None else (value < 0):
            return _error(f"{name} {value} must be {'positive' if least is not None else '0 or more'}")
    weight_cost = getattr(args, "weight_cost", None)
    if weight_cost is not None and not kind_named(kind).splits_backward:
        return _error(f"--weight-cost applies only to --kind {or_list(SPLIT_BACKWARD)}, whose "
                      f"backward is split into B and W; {kind}'s backward is one compute")
    if weight_cost is not None and not 0 < weight_cost < args.backward_cost:
        return _error(f"--weight-cost {weight_cost} must lie strictly between 0 and the backward "
                      f"cost {args.backward_cost}")
    if args.xmax is not None and args.xmax <= 0:
        return _error(f"--xmax {args.xmax} must be positive")
    try:
        schedule = build_schedule(kind, p, m, v)
        if schedule.zero_bubble:  # exchanges placed for these costs, as the trainer does
            per_op = compute_costs(schedule, args.forward_cost, args.backward_cost, weight_cost)
            schedule = build_schedule(kind, p, m, v, uniform_costs(p, v, per_op))
        result = simulate(schedule, args.forward_cost, args.backward_cost, args.transfer_cost,
                          weight_cost)
    except ScheduleError as error:
        return _error(str(error))

    paper = paper_bubble_fraction(kind, p, m, v)
    actions = [[str(c) for c in schedule.computes(rank)] for rank in range(p)]  # JSON: 0-based data
    if out is not None:
        title = f"{kind_named(kind).title}: p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "")
        title += f" · makespan {float(result.makespan):g}"
        try:
            draw_timeline(boxes_from_simulation(result, transfer_cost=args.transfer_cost), out,
                          v=v, title=title, bubble_fraction=result.bubble_fraction, xmax=args.xmax)
        except OSError as error:
            print(f"ptdp: error: cannot write {out}: {error}", file=sys.stderr)
            return 1

    if args.json:
        print(json.dumps({
            "kind": kind, "p": p, "m": m, "v": v,
            "forward_cost": _number(args.forward_cost), "backward_cost": _number(args.backward_cost),
            "transfer_cost": _number(args.transfer_cost),
            **({"weight_cost": _number(weight_cost if weight_cost is not None
                                       else args.backward_cost / 2),
                "peak_before_backward": list(result.peak_before_backward)}
               if schedule.zero_bubble else {}),
            "makespan": _number(result.makespan), "ideal": _number(result.ideal),
            "bubble_fraction": float(result.bubble_fraction),
            "bubble_fraction_exact": str(result.bubble_fraction),
            "paper_bubble_fraction": float(paper),
            "peak_in_flight": list(result.peak_in_flight),
            "actions": actions,
            "timeline": [[[str(i.action), float(i.start), float(i.end)] for i in row]
                         for row in result.timelines],
            "out": str(out) if out is not None else None,
        }))
        return 0

    print("\n".join(_text_report(args, kind, schedule, result, paper, weight_cost, out)))
    return 0


def _text_report(args: argparse.Namespace, kind: str, schedule, result: SimulationResult,
                 paper: Fraction, weight_cost, out: Path | None) -> list[str]:
    """`ptdp schedule`'s text: the kind, the costs, makespan and bubble, the
    peaks and every rank's computes."""
    p, m, v = schedule.p, schedule.m, schedule.v
    formula = kind_named(kind).bubble_formula
    if schedule.zero_bubble:
        w = weight_cost if weight_cost is not None else args.backward_cost / 2
        costs = (f"costs per rank: forward {args.forward_cost}, backward {args.backward_cost} = "
                 f"B {args.backward_cost - w} + W {w}, transfer {args.transfer_cost}")
    else:
        costs = (f"costs per rank: forward {args.forward_cost}, backward {args.backward_cost}, "
                 f"transfer {args.transfer_cost}")
    lines = [
        f"{kind_named(kind).title} schedule: p = {p} rank{'s' * (p > 1)}, m = {m} "
        f"microbatch{'es' * (m > 1)}, v = {v} chunk{'s' * (v > 1)} per rank",
        costs + (" (one chunk: 1/v of these)" if v > 1 else ""),
        f"makespan {float(result.makespan):g} (ideal m·(forward + backward) = "
        f"{float(result.ideal):g})",
        f"bubble fraction {format_fraction(result.bubble_fraction)}; "
        f"paper {formula} = {format_fraction(paper)}",
        "peak in flight per rank: " + " ".join(map(str, result.peak_in_flight))
        + (" (microbatch-chunk activations)" if v > 1 else " (microbatches)")
        + (" stored from F until W; until B: " + " ".join(map(str, result.peak_before_backward))
           if schedule.zero_bubble else ""),
        ("computes per rank (Fi.c / Bi.c / Wi.c: forward / input gradient / weight gradients of "
         "microbatch i through chunk c; microbatches numbered from 1 as in the picture, chunks "
         "from 0):" if schedule.zero_bubble else
         "computes per rank (Fi.c / Bi.c: forward / backward of microbatch i through chunk c; "
         "microbatches numbered from 1 as in the picture, chunks from 0):"),
    ]
    width = len(f"rank {p - 1}")
    lines += [f"  {f'rank {rank}':>{width}}: " + " ".join(map(compute_label, schedule.computes(rank)))
              for rank in range(p)]
    if out is not None:
        lines.append(f"wrote {out}")
    return lines
