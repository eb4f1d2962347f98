"""Timeline pictures of pipeline schedules, in the style of the paper's Figures 3 and 4.

A timeline is one list of boxes per pipeline rank (`list[list[Box]]`); a box
is `(op, microbatch, chunk, start, end)` with op "F" (forward), "B"
(backward; under a zero-bubble schedule only its input-gradient half) or "W"
(weight-gradient half, zero-bubble schedules) of one microbatch through one
model chunk, or "comm" (a transfer) / "wait" (for a peer's data: the
trainer's measured exchanges, see `separate_waits`, and `ptdp plan`'s
predicted ones), drawn as thin grey bars, hatched and dotted. Microbatches
and chunks are 0-based in the boxes, as everywhere in ptdp; the picture, and
`ptdp schedule`'s text with it, number microbatches from 1 like the paper
and the trainer's measured timeline (see `draw_timeline(first_microbatch=...)`); chunks stay 0-based
("chunk 0" in the legend).

`boxes_from_simulation` turns a `SimulationResult` into boxes,
`draw_timeline` draws boxes to a PNG (pipeline rank 0 on top, time to the
right; forwards blue, backwards green, weight gradients orange, one shade per
chunk, dark for chunk 0; idle time, the bubble, pale red). The `ptdp
schedule` command (ptdp.commands.schedule) prints and draws them.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import NamedTuple, Sequence

from ptdp.schedules.actions import Compute, Exchange
from ptdp.schedules.simulate import SimulationResult


class Box(NamedTuple):
    op: str            # "F", "B", "W", "comm" or "wait"
    microbatch: int    # 0-based; -1 for comm/wait boxes
    chunk: int         # 0-based; -1 for comm/wait boxes
    start: float
    end: float


COMPUTE_OPS = ("F", "B", "W")
OTHER_OPS = ("comm", "wait")

# Chunk 0 dark, the last chunk light (the paper's Figure 4 with v = 2).
_SHADES = {"F": ("#1f4fa0", "#a9c9f2"), "B": ("#1c7a34", "#aee4a9"),
           "W": ("#b35806", "#fdc48a")}
_OTHER_STYLE = {"comm": ("#8c8c8c", "////", "communication"),
                "wait": ("#cfcfcf", "....", "waiting for a peer")}
# Idle time (no box at all): a pale red, unlike any compute shade or the grey of communication.
_IDLE_COLOUR = "#f7d4cf"
_CHAR_WIDTH = 0.65  # a character's width over the font size, DejaVu Sans, with a margin


def _mix(dark: str, light: str, t: float) -> str:
    a = [int(dark[i:i + 2], 16) for i in (1, 3, 5)]
    b = [int(light[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b))


def colour(op: str, chunk: int, v: int) -> str:
    """Fill colour of a forward ("F"), backward ("B") or weight-gradient ("W") box of `chunk` when
    ranks hold `v` chunks: chunk 0 dark, chunk v-1 light, evenly in between."""
    dark, light = _SHADES[op]
    return dark if v == 1 else _mix(dark, light, chunk / (v - 1))


def _text_colour(fill: str) -> str:
    r, g, b = (int(fill[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.55 else "black"


def boxes_from_simulation(result: SimulationResult, *, transfer_cost: float | Fraction = 0
                          ) -> list[list[Box]]:
    """One box per compute of the simulation, with its simulated times.

    With `transfer_cost` > 0 (the value given to `simulate`), every exchange
    that precedes a compute also gets a "comm" box: the last `transfer_cost`
    of time before that compute (the simulator completes an exchange
    `transfer_cost` after both sides posted it). An exchange after a rank's
    last compute is not drawn: the simulation result does not record when it
    ended.
    """
    transfer_cost = Fraction(transfer_cost)
    rows: list[list[Box]] = []
    for rank, intervals in enumerate(result.timelines):
        row: list[Box] = []
        computes = iter(intervals)
        previous_end = Fraction(0)
        exchange_pending = False
        for action in result.schedule.ranks[rank]:
            if isinstance(action, Exchange):
                exchange_pending = True
                continue
            interval = next(computes)
            assert isinstance(action, Compute) and interval.action == action
            if exchange_pending and transfer_cost > 0:
                start = max(previous_end, interval.start - transfer_cost)
                if interval.start > start:
                    row.append(Box("comm", -1, -1, float(start), float(interval.start)))
            exchange_pending = False
            row.append(Box(action.op, action.microbatch, action.chunk,
                           float(interval.start), float(interval.end)))
            previous_end = interval.end
        rows.append(row)
    return rows


def separate_waits(rows: Sequence[Sequence[Box]], schedule) -> list[list[Box]]:
    """A measured timeline (the trainer's, `ptdp train --timeline`) with each
    exchange's waiting for its peers apart from its communication.

    The trainer records one "comm" box per exchange of a rank's actions in
    `schedule`, from posting its transfers until its receives have arrived.
    A receive cannot complete before the peer posts the matching send, which
    it does as its own exchange begins (the rows' clocks are aligned by a
    barrier before the iteration): until the latest such start among the
    exchange's receives the rank waits for a peer still computing, the
    pipeline's dependency and not the network's cost. Each box becomes a
    "wait" box up to that point and a "comm" box for the rest (the transfer
    itself). The wait is a lower bound (a peer posts its send a little after
    its exchange begins); an exchange of sends alone stays "comm"."""
    exchanges = [[a for a in schedule.ranks[rank] if isinstance(a, Exchange)]
                 for rank in range(len(rows))]
    for rank, row in enumerate(rows):
        recorded = sum(1 for box in row if box[0] == "comm")
        if recorded != len(exchanges[rank]):
            raise ValueError(f"pipeline rank {rank}: {recorded} comm boxes for the "
                             f"{len(exchanges[rank])} exchanges of its schedule")
    posted: dict[tuple[int, tuple], float] = {}  # (sending rank, transfer) -> exchange start
    for rank, row in enumerate(rows):
        comm = (Box(*box) for box in row if box[0] == "comm")
        for exchange, box in zip(exchanges[rank], comm):
            for transfer in exchange.transfers:
                if transfer.op == "send":
                    posted[(rank, transfer.tag)] = box.start
    separated: list[list[Box]] = []
    for rank, row in enumerate(rows):
        own = iter(exchanges[rank])
        boxes: list[Box] = []
        for box in (Box(*b) for b in row):
            if box.op != "comm":
                boxes.append(box)
                continue
            sent = [posted[key] for key in ((t.peer, t.tag) for t in next(own).transfers
                                            if t.op == "recv") if key in posted]
            ready = min(max([box.start, *sent]), box.end)
            if ready > box.start:
                boxes.append(Box("wait", -1, -1, box.start, ready))
            if box.end > ready or ready == box.start:
                boxes.append(Box("comm", -1, -1, ready, box.end))
        separated.append(boxes)
    return separated


def format_fraction(x: Fraction | float) -> str:
    """3/16 -> '3/16 = 0.1875 (18.75%)'; a float -> '0.1875 (18.75%)'."""
    exact = f"{x.numerator}/{x.denominator} = " if isinstance(x, Fraction) and x.denominator > 1 else ""
    return f"{exact}{float(x):.6g} ({float(x) * 100:.4g}%)"


def idle_gaps(row: Sequence[Box], end: float, min_gap: float = 0.0) -> list[tuple[float, float]]:
    """The stretches of [0, end] that no box of `row` covers (compute, comm or
    wait): the time a rank does nothing, the bubble. Gaps of `min_gap` or
    less are left out."""
    gaps, reached = [], 0.0
    for box in sorted((Box(*b) for b in row), key=lambda b: b.start):
        if box.start - reached > min_gap:
            gaps.append((reached, box.start))
        reached = max(reached, box.end)
    if end - reached > min_gap:
        gaps.append((reached, end))
    return gaps


def typical_box(rows: Sequence[Sequence[Box]]) -> float:
    """The median length of the compute boxes: the picture's unit of width,
    whatever the time unit (unit time, ms)."""
    lengths = sorted(b[4] - b[3] for row in rows for b in row if b[0] in COMPUTE_OPS and b[4] > b[3])
    return lengths[len(lengths) // 2] if lengths else 1.0


def figure_size(p: int, slots: float, legend_rows: int = 2) -> tuple[float, float]:
    """(width, height) in inches of the picture of p ranks whose time axis is
    `slots` typical boxes long (`typical_box`), with `legend_rows` rows of
    legend entries: 0.4 inch per typical box, half an inch per rank."""
    width = min(24.0, max(8.0, 2.5 + 0.4 * float(slots)))
    height = 1.6 + 0.5 * p + 0.22 * legend_rows + 0.3
    return width, max(3.0, height)


def draw_timeline(rows: Sequence[Sequence[Box]], path: str | Path, *, v: int, title: str,
                  time_unit: str = "unit time", bubble_fraction: Fraction | float | None = None,
                  xmax: float | None = None, first_microbatch: int = 1, dpi: int = 120) -> None:
    """Draw `rows` (one list of boxes per pipeline rank, rank 0 on top) to `path`.

    Box labels are microbatch numbers starting at `first_microbatch` (1 like
    the paper and `ptdp schedule`'s text; 0 for ptdp's internal numbering);
    labels too wide for their box are left out. Idle time (no box) is
    shaded and in the legend, apart from communication and waiting.
    `bubble_fraction`, when given, is added to the title. `xmax` fixes the
    right end of the time axis, and the width to 0.4 inch per unit of time,
    to draw several schedules to the same scale. The format follows the file
    suffix (PNG, SVG, PDF).
    """
    fig = timeline_figure(rows, v=v, title=title, time_unit=time_unit,
                          bubble_fraction=bubble_fraction, xmax=xmax,
                          first_microbatch=first_microbatch)
    fig.savefig(path, dpi=dpi)


def _check_boxes(rows: Sequence[Sequence[Box]], v: int) -> None:
    """ValueError for what timeline_figure cannot draw."""
    if len(rows) == 0:
        raise ValueError("draw_timeline needs at least one rank")
    if v < 1:
        raise ValueError(f"v = {v} must be at least 1")
    for rank, row in enumerate(rows):
        for box in row:
            if box[0] not in COMPUTE_OPS + OTHER_OPS:
                raise ValueError(f"rank {rank}: unknown box op {box[0]!r}; use F, B, W, comm or wait")
            if box[0] in COMPUTE_OPS and not 0 <= box[2] < v:
                raise ValueError(f"rank {rank}: box {tuple(box)} has chunk {box[2]}, not in 0..{v - 1}")
            if box[4] < box[3]:
                raise ValueError(f"rank {rank}: box {tuple(box)} ends before it starts")


def _draw_boxes(ax, rows: list[list[Box]], gaps, v: int, points_per_unit: float,
                label_width_pt: float, fontsize: float, first_microbatch: int) -> None:
    """The idle gaps, the compute boxes (labelled with their microbatch where
    the label fits) and the thin communication and waiting bars."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    for rank, row_gaps in enumerate(gaps):
        ax.add_collection(PatchCollection(
            [Rectangle((start, rank - 0.4), stop - start, 0.8) for start, stop in row_gaps],
            facecolors=_IDLE_COLOUR, edgecolors="none", zorder=1))
    # One collection per style: thousands of single patches draw slowly.
    rectangles, fills, line_widths = [], [], []
    thin: dict[str, list] = {op: [] for op in OTHER_OPS}
    for rank, row in enumerate(rows):
        for box in row:
            if box.op in OTHER_OPS:
                thin[box.op].append(Rectangle((box.start, rank - 0.1), box.end - box.start, 0.2))
                continue
            fill = colour(box.op, box.chunk, v)
            box_width_pt = (box.end - box.start) * points_per_unit
            rectangles.append(Rectangle((box.start, rank - 0.4), box.end - box.start, 0.8))
            fills.append(fill)
            line_widths.append(0.6 if box_width_pt >= 6 else 0.25)
            if label_width_pt <= box_width_pt and fontsize >= 6:  # smaller is not legible
                ax.text((box.start + box.end) / 2, rank, str(box.microbatch + first_microbatch),
                        ha="center", va="center", fontsize=fontsize, color=_text_colour(fill),
                        zorder=4)
    ax.add_collection(PatchCollection(rectangles, facecolors=fills, edgecolors="black",
                                      linewidths=line_widths, zorder=3))
    for op, patches in thin.items():
        if patches:
            edge, hatch, _ = _OTHER_STYLE[op]
            ax.add_collection(PatchCollection(patches, facecolors="white", edgecolors=edge,
                                              hatch=hatch, linewidths=0.5, zorder=2))


def timeline_figure(rows: Sequence[Sequence[Box]], *, v: int, title: str,
                    time_unit: str = "unit time", bubble_fraction: Fraction | float | None = None,
                    xmax: float | None = None, first_microbatch: int = 1):
    """The matplotlib Figure `draw_timeline` saves (see there). Uses the Agg
    canvas directly: no pyplot, no global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    p = len(rows)
    _check_boxes(rows, v)
    rows = [[Box(*box) for box in row] for row in rows]
    boxes = [box for row in rows for box in row]
    end = max((b.end for b in boxes), default=1.0)
    span = max(float(xmax) if xmax is not None else end, end, 1e-9)
    computes = [b for b in boxes if b.op in COMPUTE_OPS]
    has_w = any(b.op == "W" for b in boxes)
    names = ((("F", "forward"), ("B", "input gradient (B)"), ("W", "weight gradient (W)")) if has_w
             else (("F", "forward"), ("B", "backward")))
    # Gaps narrower than a pixel or so are bookkeeping between measured boxes, not a bubble.
    gaps = [idle_gaps(row, end, min_gap=span * 1e-4) for row in rows]

    # The legend: one column per chunk (forward above backward), then the other kinds of time.
    handles, labels = [], []
    for chunk in range(v):
        for op, name in names:
            handles.append(Patch(facecolor=colour(op, chunk, v), edgecolor="black", linewidth=0.6))
            labels.append(name if v == 1 else f"{name}, chunk {chunk}")
    others = [op for op in OTHER_OPS if any(b.op == op for b in boxes)]
    for op in others:
        edge, hatch, name = _OTHER_STYLE[op]
        handles.append(Patch(facecolor="white", edgecolor=edge, hatch=hatch, linewidth=0.5))
        labels.append(name)
    if any(gaps):
        handles.append(Patch(facecolor=_IDLE_COLOUR, edgecolor="none"))
        labels.append("idle (the bubble)")
    legend_rows = len(names)
    ncols = v + -(-(len(handles) - v * len(names)) // legend_rows)
    while len(handles) < ncols * legend_rows:  # blanks keep every column legend_rows high
        handles.append(Patch(visible=False))
        labels.append("")
    entry_width = max(len(label) for label in labels) * _CHAR_WIDTH * 9 / 72 + 0.6  # inches
    numbering = ("numbered from 1, as in the paper" if first_microbatch == 1
                 else f"numbered from {first_microbatch}")
    what = "a forward or backward" + (" half" if has_w else "") + " of one microbatch"
    what += "" if v == 1 else " through one chunk"
    legend_title = f"box = {what} (microbatches {numbering})"
    # With xmax, pictures drawn to one scale get one width per unit of time; else the
    # width follows the boxes, whatever the time unit (unit time, ms).
    width, height = figure_size(p, span / (1.0 if xmax is not None else typical_box(rows)),
                                legend_rows)
    # The legend must not be cut off.
    width = max(width, ncols * entry_width + 0.5, len(legend_title) * 0.55 * 9 / 72 + 0.5)

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=9,
               title=legend_title, title_fontsize=9, frameon=False)

    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(p), [f"pipeline rank {r}" for r in range(p)])
    ax.tick_params(axis="y", length=0, labelsize=10)
    ax.tick_params(axis="x", labelsize=9)
    ax.grid(axis="x", color="#e8e8e8", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel(f"time ({time_unit}); dashed line: end of the iteration (pipeline flush)",
                  fontsize=10)
    heading = title
    if bubble_fraction is not None:
        heading += f" · bubble fraction {format_fraction(bubble_fraction)}"
    ax.set_title(heading, fontsize=12, wrap=True)

    # Lay the figure out now, to size the box labels by the axes' real extent.
    axes_width_in = width - 0.4 - 0.09 * len(f"pipeline rank {p - 1}")  # estimate for the ticks
    ax.xaxis.set_major_locator(MaxNLocator(nbins=max(4, int(axes_width_in * 1.6)),
                                           steps=[1, 2, 5, 10]))
    fig.get_layout_engine().execute(fig)
    fig.set_layout_engine("none")  # keep this layout when saving
    bbox = ax.get_position()
    points_per_unit = bbox.width * width * 72 / span
    row_height_pt = 0.8 * bbox.height * height * 72 / p

    digits = max((len(str(b.microbatch + first_microbatch)) for b in computes), default=1)
    narrowest = min((b.end - b.start for b in computes), default=1.0) * points_per_unit
    fontsize = min(10.0, 0.55 * row_height_pt, max(6.0, (narrowest - 3) / (_CHAR_WIDTH * digits)))
    # Label all boxes of a width or none: the fit test uses the widest label.
    label_width_pt = _CHAR_WIDTH * fontsize * digits + 2

    _draw_boxes(ax, rows, gaps, v, points_per_unit, label_width_pt, fontsize, first_microbatch)
    if computes:
        ax.axvline(end, color="#555555", linestyle=(0, (4, 3)), linewidth=0.8, zorder=1)
    return fig
