"""`ptdp plan`: choose t, p, d, b, v, the pipeline schedule, recomputation,
sequence parallelism and the optimizer's sharding for a model on N devices,
and predict what the run will cost.

The search enumerates every valid layout (the rules `ptdp train` enforces),
bounds each one's iteration time from below without building its schedule
(bounds.compute_lower_bound), and prices the layouts cheapest bound first
with the schedule simulator (predict.py: the same action lists the executor
runs, costed with a hardware profile), those whose memory per device
(memory.py) fits the profile's device memory, until no bound can reach
the top EXACT_ROWS rows; it ranks them by predicted throughput. Given
layout flags it evaluates that one layout.

Schedules: 1F1B, interleaved 1F1B (v = 2 ... MAX_CHUNKS) and the
zero-bubble zb-h1 (v = 1, m >= p) and zbv (v = 2, m >= 2p, l divisible by
2p), priced by the same simulator with the backward split into B and W
(pricing.py) and their memory counted from F to B to W (memory.py).
`--print-flags`
prints `--pipeline-schedule zb-h1` or `--pipeline-schedule zbv` for them
(zbv's two chunks per rank are implied).

Sequence parallelism is searched on and off wherever it is valid (t > 1 and
t dividing s): it divides the activations between the tensor-parallel
regions and their element-wise work by t for the same tensor traffic plus
the re-gathers of the saved inputs, so it mostly decides what fits.

Uneven layer splits (ptdp.parallel.pipeline.split): for each pipeline
layout with p >= 2 under 1f1b (v = 1), zb-h1 or zbv the search also tries
the embedding/loss accounting flags and, for v = 1, first/last-rank layer
counts that move one or two layers off the first and/or the last rank (the
output layer of a large-vocabulary model can cost several layers);
`--print-flags` appends their flags.

The explanation compares the winner with the best layout that differs from
it in one respect (a different t, p, b, v, schedule, recomputation,
sequence parallelism or optimizer), and names the time categories that
make the difference.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from ptdp.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from ptdp.config.context import context_parallel_problems
from ptdp.output_paths import output_path_problems
from ptdp.parallel.pipeline.split import LayerSplit, split_problems
from ptdp.perf.layout import Layout, Workload

MEMORY_HEADROOM = 0.9      # leave 10 % of device memory to the allocator and workspaces
MAX_MICROBATCH = 32        # larger microbatches only add memory at these sizes
MAX_CHUNKS = 8             # interleaving beyond this only adds transfers
MIN_CONTEXT_POSITIONS = 1024   # the search's smallest s/c (see context_sizes_to_search)
# The schedules searched: 1F1B (interleaved with v > 1) and the two zero-bubble
# ones. GPipe is never better than 1F1B here (same bubble, more memory).
SCHEDULES = ("1f1b", "zb-h1", "zbv")
EXACT_ROWS = 30            # search's first rows are exact (see search); plot draws as many
PLOT_FORMATS = (".png", ".pdf", ".svg")   # --plot: matplotlib picks the format by the suffix


@dataclass
class Evaluation:
    layout: Layout
    memory: dict[str, float]       # bytes per device by kind, and "total"
    prediction: Any                # predict.Prediction
    fits: bool

    @property
    def tflops(self) -> float:
        return self.prediction.tflops_per_device

    @property
    def seconds(self) -> float:
        return self.prediction.iteration_seconds

    def summary(self) -> dict[str, Any]:
        from ptdp.perf.analytic import parameters_per_device

        layout = asdict(self.layout)
        if self.layout.c == 1:   # (as before context parallelism: no c, no comm type)
            del layout["c"], layout["cp_comm"]
        return {"layout": layout,
                "iteration_seconds": self.seconds,
                "tflops_per_device": self.tflops,
                "flops_per_iteration": self.prediction.flops_per_iteration,
                "parameters_per_device": parameters_per_device(self.prediction.workload.model,
                                                               self.layout),
                "bubble_fraction": self.prediction.bubble_fraction,
                "memory_per_device_bytes": self.memory["total"],
                "memory_breakdown_bytes": {k: v for k, v in self.memory.items() if k != "total"},
                "seconds_by_category": dict(self.prediction.seconds_by_category),
                "fits": self.fits}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(workload: Workload, devices: int, *, tensor_sizes=None,
                      microbatch_sizes=None, chunk_counts=None,
                      recompute=(None, "selective", "full"),
                      distributed_optimizer=(False, True),
                      sequence_parallel=(False, True), schedules=SCHEDULES,
                      layer_splits: bool = True, context_sizes=None,
                      cp_comm: str = "p2p") -> Iterable[Layout]:
    """Every layout `ptdp train` would accept for this workload on
    `devices` (optionally only some tensor sizes, microbatch sizes, chunk counts,
    recomputation kinds, optimizer or sequence-parallelism choices, or
    schedules among SCHEDULES; sequence parallelism only where t > 1
    divides s). "1f1b" with v > 1 is the interleaved schedule; zb-h1 has
    v = 1 and zbv v = 2, each only where its microbatch and layer rules hold.
    `layer_splits`: also the uneven splits of `split_candidates`.
    Context parallelism: every c of `context_sizes` (default: each that
    `context_sizes_to_search` keeps) with the comm type `cp_comm`; the
    t·p·d ranks are then devices/c."""
    model, batch = workload.model, workload.global_batch
    for c in (context_sizes_to_search(model, devices, cp_comm) if context_sizes is None
              else [c for c in context_sizes if devices % c == 0]):
        yield from _candidates_of_context(workload, devices, c, cp_comm if c > 1 else "p2p",
                                          tensor_sizes, microbatch_sizes, chunk_counts,
                                          recompute, distributed_optimizer, sequence_parallel,
                                          schedules, layer_splits)


def context_sizes_to_search(model: ModelConfig, devices: int, cp_comm: str = "p2p") -> list[int]:
    """The context-parallel sizes a search tries: 1, and each c dividing
    the devices that `ptdp train`'s rules allow at t = 1 (s divisible by 2c,
    a2a's heads and key/value groups by c, no attention dropout) while a
    rank keeps at least MIN_CONTEXT_POSITIONS positions (shorter blocks
    hide no transfer and only add steps; give --context-parallel-size to
    price one anyway)."""
    sizes = [1]
    for c in _divisors(devices)[1:]:
        if model.seq_length // c < MIN_CONTEXT_POSITIONS:
            break
        if not context_parallel_problems(model, ParallelConfig(context_parallel_size=c,
                                                               cp_comm_type=cp_comm)):
            sizes.append(c)
    return sizes


def _candidates_of_context(workload: Workload, devices: int, c: int, cp_comm: str,
                           tensor_sizes, microbatch_sizes, chunk_counts, recompute,
                           distributed_optimizer, sequence_parallel, schedules,
                           layer_splits: bool) -> Iterable[Layout]:
    """`candidate_layouts` of one context-parallel size c."""
    model, batch = workload.model, workload.global_batch
    ranks = devices // c
    for t in _divisors(ranks):
        if tensor_sizes is not None and t not in tensor_sizes:
            continue
        for p in _divisors(ranks // t):
            d = ranks // (t * p)
            if batch % d:
                continue
            sizes = [k for k in _divisors(batch // d) if k <= MAX_MICROBATCH]
            if microbatch_sizes is not None:
                sizes = [k for k in sizes if k in microbatch_sizes]
            chunks = [1] + (list(range(2, MAX_CHUNKS + 1)) if p > 1 else [])
            if chunk_counts is not None:
                chunks = [v for v in chunks if v in chunk_counts]
            pipelines = [(schedule, v) for v in chunks for schedule in schedules
                         if (schedule, v) in (("1f1b", v), ("zb-h1", 1), ("zbv", 2))
                         and (p > 1 or schedule == "1f1b")]   # with p = 1 all are one schedule
            for b in sizes:
                for schedule, v in pipelines:
                    for kind in recompute:
                        for sharded in (distributed_optimizer if d * c > 1 else (False,)):
                            for split in sequence_parallel:
                                layout = Layout(t=t, p=p, d=d, b=b, v=v, recompute=kind,
                                                distributed_optimizer=sharded,
                                                sequence_parallel=split, schedule=schedule,
                                                c=c, cp_comm=cp_comm)
                                if not layout.valid_for(model, batch):
                                    yield layout
                                if layer_splits:
                                    yield from _uneven(layout, model, batch)


def _uneven(layout: Layout, model: ModelConfig, batch: int) -> Iterable[Layout]:
    """The valid uneven variants of `layout`, one per distinct cut (a split
    that cuts as the even one does, or as an earlier one, is left out)."""
    splits = _uneven_splits(model.num_layers, layout.p, layout.v, layout.schedule)
    # Once the split's own rules hold, every other rule is the same for all splits.
    if splits and not dataclasses.replace(layout, split=splits[0]).valid_for(model, batch):
        yield from (dataclasses.replace(layout, split=split) for split in splits)


@functools.lru_cache(maxsize=4096)
def _uneven_splits(num_layers: int, p: int, v: int, schedule: str) -> tuple[LayerSplit, ...]:
    """The splits of `split_candidates` that split_problems accepts, one per
    distinct cut, none cutting as the even split does where that is valid."""
    layout = Layout(p=p, v=v, schedule=schedule)
    kind = layout.schedule_kind
    even = num_layers % (2 * p if kind == "zbv" else p * v) == 0
    seen = {tuple(layout.stage_layers(num_layers))} if even else set()
    splits = []
    for split in split_candidates(layout, num_layers):
        if kind == "interleaved" or split_problems(num_layers, p, v, kind, split):
            continue
        counts = tuple(dataclasses.replace(layout, split=split).stage_layers(num_layers))
        if counts not in seen:
            seen.add(counts)
            splits.append(split)
    return tuple(splits)


def split_candidates(layout: Layout, num_layers: int) -> list[LayerSplit]:
    """The uneven splits the search tries for `layout` (not checked: the
    caller keeps the valid ones). Only p >= 2 under 1f1b or gpipe with
    v = 1, zb-h1 or zbv: the three nontrivial combinations of the accounting
    flags, and for v = 1 first/last-rank layer counts one or two below the
    even share (ceil(l/p)) on the first and/or the last rank."""
    if layout.p < 2 or layout.schedule_kind not in ("1f1b", "gpipe", "zb-h1", "zbv"):
        return []
    splits = [LayerSplit(embedding=True), LayerSplit(loss=True),
              LayerSplit(embedding=True, loss=True)]
    if layout.v == 1:
        share = -(-num_layers // layout.p)
        counts = [None] + [share - k for k in (1, 2) if share - k >= 1]
        splits += [LayerSplit(first=first, last=last) for first in counts for last in counts
                   if (first, last) != (None, None)]
    return splits


def evaluate_layout(workload: Workload, layout: Layout, profile) -> Evaluation:
    from ptdp.perf.memory import memory_per_device
    from ptdp.perf.predict import simulate

    memory = memory_per_device(workload, layout, kernels=_kernels(profile))
    fits = memory["total"] <= MEMORY_HEADROOM * profile.memory_bytes
    return Evaluation(layout, memory, simulate(workload, layout, profile), fits)


def _kernels(profile) -> str:
    """Which attention/LayerNorm kernels the memory model assumes."""
    return "cpu" if profile.kind == "cpu" else "cuda"


def search(workload: Workload, devices: int, profile, *, top: int | None = None,
           exhaustive: bool = False, progress=None, **restrictions) -> list[Evaluation]:
    """Layouts that fit, best predicted throughput first (`restrictions`:
    see candidate_layouts).

    Every candidate gets a lower bound on its iteration time
    (bounds.compute_lower_bound: its busiest rank's compute plus the pipeline
    fill and drain that rank cannot skip, its gradient reductions and the
    optimizer; no schedule is built). The layouts are priced cheapest bound
    first, and the search stops at the first whose bound is no better than
    the EXACT_ROWS-th best time priced so far: no layout after it can reach
    those rows, so the first EXACT_ROWS results are what pricing every
    layout gives (`exhaustive=True` prices every layout; the tests compare
    the two). Memory is checked only for layouts that get that far. Then,
    for each respect `explain` compares
    (t, p, b, v, schedule, ...), the best layout that differs from the
    winner in it alone is found the same way among its few candidates and
    added to the results. `progress(stage, done, total)`, if given, hears
    how far it is ("bounding", "pricing", then "done" with the layouts
    priced)."""
    from ptdp.perf.bounds import compute_lower_bound

    report = progress or (lambda stage, done, total: None)
    candidates = list(candidate_layouts(workload, devices, **restrictions))
    bounds = {}
    for i, layout in enumerate(candidates):
        if i % 500 == 0:
            report("bounding", i, len(candidates))
        bounds[layout] = compute_lower_bound(workload, layout, profile)
    if exhaustive:
        results = [e for e in (_evaluate_if_fits(workload, layout, profile)
                               for layout in candidates) if e is not None]
        results.sort(key=lambda e: (e.seconds, e.memory["total"]))
        return results[:top] if top else results

    priced: dict[Layout, Evaluation | None] = {}
    results = _best_by_bound(candidates, bounds, EXACT_ROWS, workload, profile, priced)
    if results:
        winner = results[0].layout
        for field in ASPECTS:
            free = {field, "d"} | COUPLED.get(field, set())
            rivals = [layout for layout in candidates
                      if getattr(layout, field) != getattr(winner, field)
                      and all(getattr(layout, f) == getattr(winner, f)
                              for f in ASPECTS if f not in free)]
            _best_by_bound(rivals, bounds, 1, workload, profile, priced)
        results = [e for e in priced.values() if e is not None]
    report("done", len(priced), len(candidates))
    results.sort(key=lambda e: (e.seconds, e.memory["total"]))
    return results[:top] if top else results


def _evaluate_if_fits(workload: Workload, layout: Layout, profile) -> Evaluation | None:
    """The layout's Evaluation, or None (without pricing it) if its memory
    does not fit the device."""
    from ptdp.perf.memory import memory_per_device
    from ptdp.perf.predict import simulate

    memory = memory_per_device(workload, layout, kernels=_kernels(profile))
    if memory["total"] > MEMORY_HEADROOM * profile.memory_bytes:
        return None
    return Evaluation(layout, memory, simulate(workload, layout, profile), True)


def _best_by_bound(layouts: list[Layout], bounds: dict[Layout, float], rows: int,
                   workload: Workload, profile, priced: dict[Layout, Evaluation | None]
                   ) -> list[Evaluation]:
    """The `rows` fastest of `layouts` that fit, exactly: price them
    cheapest bound first until a bound reaches the rows-th best time
    (`priced` keeps every evaluation, None for what does not fit)."""
    times: list[float] = []
    found: list[Evaluation] = []
    for layout in sorted(layouts, key=lambda layout: bounds[layout]):
        if len(times) >= rows and bounds[layout] >= times[rows - 1]:
            break
        if layout not in priced:
            priced[layout] = _evaluate_if_fits(workload, layout, profile)
        evaluation = priced[layout]
        if evaluation is not None:
            found.append(evaluation)
            bisect.insort(times, evaluation.seconds)
    found.sort(key=lambda e: (e.seconds, e.memory["total"]))
    return found[:rows]


ASPECTS = {  # what differs, and how to say it
    "t": "tensor-parallel size", "p": "pipeline-parallel size", "c": "context-parallel size",
    "b": "microbatch size",
    "v": "chunks per rank", "schedule": "schedule", "recompute": "recomputation",
    "sequence_parallel": "sequence parallelism",
    "distributed_optimizer": "optimizer sharding", "split": "layer split",
}
# Sequence parallelism exists only with t > 1: a rival of another t may differ in it too.
# zbv fixes v = 2: a rival of another schedule may differ in v too.
# An uneven split is valid for some p, v and schedules only: their rivals may differ in it too.
# Sequence parallelism's rule (s/c divisible by t) involves c too.
COUPLED = {"t": {"sequence_parallel"}, "schedule": {"v", "split"}, "p": {"split"},
           "v": {"split"}, "c": {"sequence_parallel"}}


def explain(results: list[Evaluation], profile) -> list[str]:
    """Why the winner wins: for each aspect, the best layout that differs in
    it, how much slower it is, and the categories that account for it."""
    if not results:
        return []
    best = results[0]
    model = best.prediction.workload.model
    lines = [f"best: {describe(best.layout, model)}: {best.seconds:.3f} s per iteration, "
             f"{best.tflops:.1f} TFLOP/s per device, "
             f"{best.memory['total'] / 2**30:.1f} GiB per device"]
    if best.layout.t <= profile.devices_per_server and best.layout.t > 1:
        lines.append(f"  tensor parallelism stays inside a server (t = {best.layout.t} <= "
                     f"{profile.devices_per_server} devices per server), where its all-reduces "
                     "use the fast links")
    for field, words in ASPECTS.items():
        # The best layout that differs in this respect alone (d follows from
        # t and p on a fixed number of devices).
        free = {field, "d"} | COUPLED.get(field, set())
        rival = next((e for e in results[1:]
                      if getattr(e.layout, field) != getattr(best.layout, field)
                      and all(getattr(e.layout, f) == getattr(best.layout, f)
                              for f in ASPECTS if f not in free)), None)
        if rival is None:
            if field == "sequence_parallel" and best.layout.sequence_parallel:
                lines.append(_unsplit_memory(best, profile))
            continue
        slower = rival.seconds / best.seconds - 1
        deltas = {k: rival.prediction.seconds_by_category.get(k, 0.0)
                  - best.prediction.seconds_by_category.get(k, 0.0)
                  for k in set(rival.prediction.seconds_by_category)
                  | set(best.prediction.seconds_by_category)}
        worst = sorted(deltas.items(), key=lambda kv: -kv[1])[:2]
        reasons = ", ".join(f"{name} +{delta:.3f} s" for name, delta in worst if delta > 0)
        value = getattr(rival.layout, field)
        if field == "sequence_parallel":
            value = "on" if value else "off"
        elif field == "schedule":
            value = rival.layout.schedule_kind
        elif field == "split":
            value = split_text(rival.layout, model)
        lines.append(f"  vs {words} {value!s:>5}: {slower:+.1%} time"
                     + (f" ({reasons})" if reasons else ""))
    return lines


def _unsplit_memory(best: Evaluation, profile) -> str:
    """What the winner would need without sequence parallelism, when no
    such layout is among the results (it did not fit)."""
    from ptdp.perf.memory import memory_per_device

    unsplit = dataclasses.replace(best.layout, sequence_parallel=False)
    memory = memory_per_device(best.prediction.workload, unsplit, kernels=_kernels(profile))
    fits = memory["total"] <= MEMORY_HEADROOM * profile.memory_bytes
    return (f"  vs sequence parallelism   off: {memory['total'] / 2**30:.1f} GiB per device "
            f"(activations {memory['activations'] / 2**30:.1f} GiB instead of "
            f"{best.memory['activations'] / 2**30:.1f})"
            + ("" if fits else f", does not fit {profile.memory_bytes / 2**30:.0f} GiB"))


def split_text(layout: Layout, model: ModelConfig | None = None) -> str:
    """How the layers are split: "even", or "layers per stage 3,4,4,3"
    (the flags without the model)."""
    if layout.split.even:
        return "even"
    if model is None:
        return " ".join(layout.split.flags())
    return "layers per stage " + ",".join(map(str, layout.stage_layers(model.num_layers)))


def describe(layout: Layout, model: ModelConfig | None = None) -> str:
    text = f"t={layout.t} p={layout.p} d={layout.d} b={layout.b}"
    if layout.c > 1:
        text = (f"t={layout.t} c={layout.c} ({layout.cp_comm}) p={layout.p} d={layout.d} "
                f"b={layout.b}")
    if layout.v > 1:
        text += f" v={layout.v}"
    if layout.schedule != "1f1b":
        text += f" {layout.schedule}"
    if layout.recompute:
        text += f" recompute={layout.recompute}"
    if layout.sequence_parallel:
        text += " sequence-parallel"
    if layout.distributed_optimizer:
        text += " distributed-optimizer"
    if not layout.split.even:
        text += " " + split_text(layout, model)
    return text


def table(results: list[Evaluation], rows: int) -> str:
    # A column for c only where a row has context parallelism.
    context = any(e.layout.c > 1 for e in results[:rows])
    header = ("| rank | t | " + ("c | " if context else "") + "p | d | b | v | schedule | "
              "layers per stage | recompute | seq. par. | "
              "dist. opt. | s/iter | TFLOP/s/device | bubble | memory GiB |")
    lines = [header, "|" + "---|" * (16 if context else 15)]
    for i, e in enumerate(results[:rows], 1):
        layout = e.layout
        layers = ("even" if layout.split.even else
                  split_text(layout, e.prediction.workload.model).removeprefix("layers per stage "))
        c = (f"{layout.c} {layout.cp_comm} | " if layout.c > 1 else "1 | ") if context else ""
        lines.append(f"| {i} | {layout.t} | {c}{layout.p} | {layout.d} | {layout.b} | {layout.v} | "
                     f"{layout.schedule_kind} | {layers} | "
                     f"{layout.recompute or '-'} | {'yes' if layout.sequence_parallel else '-'} | "
                     f"{'yes' if layout.distributed_optimizer else '-'} | "
                     f"{e.seconds:.3f} | {e.tflops:.1f} | {e.prediction.bubble_fraction:.3f} | "
                     f"{e.memory['total'] / 2**30:.1f} |")
    return "\n".join(lines)


def plot(results: list[Evaluation], path: str, rows: int = EXACT_ROWS) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = results[:rows]
    figure = Figure(figsize=(max(6, 0.35 * len(shown)), 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.bar(range(len(shown)), [e.tflops for e in shown], color="#4477aa")
    axes.set_xticks(range(len(shown)))
    axes.set_xticklabels([describe(e.layout).replace(" ", "\n") for e in shown], fontsize=6)
    axes.set_ylabel("predicted TFLOP/s per device")
    axes.set_title("layouts that fit, best first")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# ------------------------------------------------------------------ command line

PLAN_SEQ_LENGTH = 2048     # the paper's
PLAN_VOCAB_SIZE = 51200    # the paper's
PRECISION_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}


def train_command(model: ModelConfig, layout: Layout, global_batch: int, precision: str) -> str:
    """The whole `ptdp train` command for `layout`: the model's shape and
    every setting that differs from `ptdp train`'s default, the precision,
    the layout, the batch and the recomputation. Pasting it (with data
    flags, or --mock-data) trains the model the plan priced."""
    defaults = ModelConfig()
    flags = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--num-attention-heads", str(model.num_attention_heads),
             "--seq-length", str(model.seq_length), "--vocab-size", str(model.vocab_size)]
    if model.ffn_hidden_size is not None:
        flags += ["--ffn-hidden-size", str(model.ffn_hidden_size)]
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for name in MODEL_SETTINGS:
        value = getattr(model, name)
        if value == getattr(defaults, name):
            continue
        flag = fields[name].metadata["flag"]
        flags += [flag] if isinstance(value, bool) else [flag, f"{value:g}" if isinstance(
            value, float) else str(value)]
    flags += PRECISION_FLAGS[precision] + layout.train_flags(model, global_batch)
    return "ptdp train " + " ".join(flags)


def assumptions(workload: Workload, devices: int, profile) -> str:
    """What the plan takes as given besides the model's shape, in one line."""
    model = workload.model
    return (f"assuming: sequence length {model.seq_length}, vocabulary {model.vocab_size} "
            f"(padded to a multiple of {model.make_vocab_size_divisible_by}·t), "
            f"{workload.precision}, global batch {workload.global_batch}, {devices} devices "
            f"of profile {profile.name}")

# The ModelConfig settings `plan` takes besides the shape, with `ptdp train`'s
# flags, defaults and help (from the dataclass): what decides the model's
# parameters, FLOPs and memory (the Llama family's options among them). The
# epsilon and the rotary base change none of it; they are accepted so that a
# run's model flags can be pasted as they are.
MODEL_SETTINGS = ("max_position_embeddings", "make_vocab_size_divisible_by", "hidden_dropout",
                  "attention_dropout", "normalization", "norm_epsilon", "swiglu",
                  "position_embedding_type", "rotary_base", "group_query_attention",
                  "num_query_groups", "untie_embeddings_and_output_weights", "disable_bias_linear",
                  "kv_channels", "qk_layernorm", "add_qkv_bias", "use_rope_scaling",
                  "rope_scaling_factor")
_TYPES = {"int": int, "float": float, "str": str}


def _add_model_settings(group: argparse._ArgumentGroup) -> None:
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for name in MODEL_SETTINGS:
        f = fields[name]
        meta = f.metadata
        if f.type == "bool":
            group.add_argument(meta["flag"], dest=name, action="store_true", help=meta["help"])
            continue
        kind = _TYPES[f.type.split("|")[0].strip()]
        group.add_argument(meta["flag"], dest=name, type=kind, default=f.default,
                           choices=meta.get("choices"),
                           metavar=None if "choices" in meta else {int: "N", float: "X"}[kind],
                           help=meta["help"] + ("" if f.default is None
                                                else f" (default: {f.default})"))


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan", help="choose and predict a layout (t, p, d, b, v, schedule, recomputation, "
                     "sequence parallelism)",
        description="Search the layouts of a GPT (or a Llama-style model: --normalization "
                    "RMSNorm --swiglu --position-embedding-type rope --group-query-attention "
                    "--untie-embeddings-and-output-weights --disable-bias-linear) on N devices, or "
                    "evaluate one given by layout flags, and predict iteration time, TFLOP/s per "
                    "device and memory.")
    moe = ("ptdp plan does not price mixtures of experts yet (ptdp train runs them): plan the "
           "dense model without the MoE flags")
    parser.not_taken = {"--num-experts": moe, "--moe-": moe, "--expert-model-parallel-size": moe,
                        "--expert-tensor-parallel-size": moe}
    model = parser.add_argument_group("model")
    for flag, default, words in (
            ("--num-layers", None, None), ("--hidden-size", None, None),
            ("--num-attention-heads", None, None),
            ("--seq-length", PLAN_SEQ_LENGTH, "sequence length the plan assumes"),
            ("--vocab-size", PLAN_VOCAB_SIZE, "vocabulary the plan assumes (GPT-2's 50257 pads "
                                              "to 50304; the paper's runs used 51200)"),
            ("--ffn-hidden-size", None, "MLP width (default 4·h)")):
        model.add_argument(flag, type=int, default=default, required=default is None
                           and flag != "--ffn-hidden-size", metavar="N",
                           help=None if words is None else words + (
                               f" (default: {default})" if default else ""))
    _add_model_settings(model)
    parser.add_argument("--gpus", type=int, required=True, metavar="N", help="devices in all")
    parser.add_argument("--gpu", default="a100", help="a100, h100, h200, local (the profile "
                        "`ptdp calibrate` wrote) or a profile JSON path (default: a100)")
    parser.add_argument("--global-batch-size", type=int, required=True, metavar="B")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16",
                        help="the precision the plan assumes (default: bf16; `ptdp train "
                             "--bf16`, `--fp16`, or neither for fp32)")
    layout = parser.add_argument_group("one layout (evaluate instead of searching)")
    layout.add_argument("--tensor-model-parallel-size", "-t", type=int, metavar="N")
    layout.add_argument("--pipeline-model-parallel-size", "-p", type=int, metavar="N")
    layout.add_argument("--micro-batch-size", type=int, metavar="N")
    layout.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, metavar="N")
    layout.add_argument("--pipeline-schedule", choices=("1f1b", "gpipe", "zb-h1", "zbv"),
                        help="as for `ptdp train` (zbv: two chunks per rank; default 1f1b, "
                             "interleaved with --num-layers-per-virtual-pipeline-stage)")
    layout.add_argument("--recompute-granularity", choices=("full", "selective"))
    layout.add_argument("--sequence-parallel", action="store_true",
                        help="split the activations between the tensor-parallel regions along "
                             "the sequence (needs t > 1 dividing --seq-length)")
    layout.add_argument("--use-distributed-optimizer", action="store_true")
    layout.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N",
                        help="as for `ptdp train`: layers on the first pipeline rank")
    layout.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                        help="as for `ptdp train`: layers on the last pipeline rank")
    layout.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    layout.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    context = parser.add_argument_group("context parallelism (searched unless given)")
    context.add_argument("--context-parallel-size", type=int, metavar="N",
                         help="as for `ptdp train`: c ranks each holding s/c of every sequence "
                              "(alone, the search keeps this c; default: c is searched from 1 "
                              f"while s/c >= {MIN_CONTEXT_POSITIONS})")
    context.add_argument("--cp-comm-type", choices=("p2p", "all_gather", "a2a"),
                         help="as for `ptdp train` (default: p2p)")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="rows in the table")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw throughput across layouts to this "
                        ".png, .pdf or .svg file (the suffix picks the format)")
    parser.add_argument("--print-flags", action="store_true",
                        help="print the winner as a whole `ptdp train` command (model, "
                             "precision, layout, batch, recomputation)")


def _layout_from_args(args: argparse.Namespace, model: ModelConfig, devices: int) -> Layout | None:
    given = [args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
             args.micro_batch_size, args.num_layers_per_virtual_pipeline_stage,
             args.recompute_granularity, args.pipeline_schedule,
             args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers]
    split = LayerSplit(first=args.decoder_first_pipeline_num_layers,
                       last=args.decoder_last_pipeline_num_layers,
                       embedding=args.account_for_embedding_in_pipeline_split,
                       loss=args.account_for_loss_in_pipeline_split)
    if (all(value is None for value in given) and not args.use_distributed_optimizer
            and not args.sequence_parallel and split.even):
        return None
    t = args.tensor_model_parallel_size or 1
    p = args.pipeline_model_parallel_size or 1
    c = args.context_parallel_size or 1
    if devices % (t * c * p):
        raise ConfigError([f"--gpus {devices} is not a multiple of t·c·p = {t * c * p}" if c > 1
                           else f"--gpus {devices} is not a multiple of t·p = {t * p}"])
    schedule = args.pipeline_schedule or "1f1b"
    v = 2 if schedule == "zbv" else 1
    k = args.num_layers_per_virtual_pipeline_stage
    if k and schedule == "zbv" and k * 2 * p != model.num_layers:
        raise ConfigError([f"--pipeline-schedule zbv has two chunks per rank, so "
                           f"--num-layers-per-virtual-pipeline-stage {k} must be --num-layers / 2p "
                           f"= {model.num_layers / (2 * p):g}: drop it"])
    if k and schedule in ("gpipe", "zb-h1"):
        raise ConfigError([f"--pipeline-schedule {schedule} has one chunk per rank: drop "
                           f"--num-layers-per-virtual-pipeline-stage"])
    if k and schedule != "zbv":
        per = p * args.num_layers_per_virtual_pipeline_stage
        if model.num_layers % per:
            raise ConfigError([f"--num-layers {model.num_layers} is not a multiple of p × "
                               f"--num-layers-per-virtual-pipeline-stage = {per}"])
        v = model.num_layers // per
    return Layout(t=t, p=p, d=devices // (t * c * p), b=args.micro_batch_size or 1, v=v,
                  schedule=schedule, recompute=args.recompute_granularity,
                  distributed_optimizer=args.use_distributed_optimizer,
                  sequence_parallel=args.sequence_parallel, split=split, c=c,
                  cp_comm=(args.cp_comm_type or "p2p") if c > 1 else "p2p")


def _context_restrictions(args: argparse.Namespace, model: ModelConfig,
                          devices: int) -> dict[str, Any]:
    """The search's context-parallel restrictions from --context-parallel-size
    and --cp-comm-type (checked against the rules that do not involve t)."""
    c, comm = args.context_parallel_size, args.cp_comm_type or "p2p"
    if c is None:
        return {"cp_comm": comm}
    problems = []
    if c < 1:
        problems.append(f"--context-parallel-size {c} must be positive")
    elif devices % c:
        problems.append(f"--gpus {devices} is not a multiple of --context-parallel-size {c}")
    else:
        problems += context_parallel_problems(model, ParallelConfig(context_parallel_size=c,
                                                                    cp_comm_type=comm), devices)
    if problems:
        raise ConfigError(problems)
    return {"context_sizes": (c,), "cp_comm": comm}


def _progress_printer():
    """Reports the search's progress on stderr: a counter redrawn in place on
    a terminal, a line at the start and the end elsewhere (logs)."""
    terminal = sys.stderr.isatty()

    def report(stage: str, done: int, total: int) -> None:
        if terminal:
            end = "\n" if stage == "done" else ""
            print(f"\rptdp plan: {stage} {done:,}/{total:,} layouts" + " " * 8, end=end,
                  file=sys.stderr, flush=True)
        elif stage == "bounding" and done == 0:
            print(f"ptdp plan: searching {total:,} layouts", file=sys.stderr, flush=True)
        elif stage == "done":
            print(f"ptdp plan: priced {done:,} of {total:,} layouts (the others cannot reach "
                  f"the top {EXACT_ROWS})", file=sys.stderr, flush=True)
    return report


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig `plan`'s flags describe."""
    return ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                       vocab_size=args.vocab_size, ffn_hidden_size=args.ffn_hidden_size,
                       **{name: getattr(args, name) for name in MODEL_SETTINGS})


def run_plan_command(args: argparse.Namespace) -> int:
    from ptdp.perf.analytic import parameter_count
    from ptdp.perf.profiles import load_profile

    model = model_from_args(args)
    problems = [f"{flag} must be positive" for flag, value in
                (("--gpus", args.gpus), ("--global-batch-size", args.global_batch_size),
                 ("--context-parallel-size", args.context_parallel_size))
                if value is not None and value < 1]
    if args.plot is not None:  # checked now, not after the search
        problems += output_path_problems("--plot", args.plot, suffix=PLOT_FORMATS)
    try:   # the model's own rules, as `ptdp train` checks them (with t = p = d = 1)
        validate(Config(model=model))
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError(problems)
    try:
        profile = load_profile(args.gpu)
    except (OSError, ValueError) as error:
        raise ConfigError([f"--gpu {args.gpu}: {error}"]) from None
    workload = Workload(model, args.global_batch_size, args.precision)
    layout = _layout_from_args(args, model, args.gpus)
    if layout is not None:
        problems = layout.valid_for(model, args.global_batch_size)
        if problems:
            raise ConfigError(problems)
        results = [evaluate_layout(workload, layout, profile)]
    else:
        results = search(workload, args.gpus, profile, progress=_progress_printer(),
                         **_context_restrictions(args, model, args.gpus))
        if not results:
            raise ConfigError([f"no layout of this model fits {args.gpus} × "
                               f"{profile.memory_bytes / 2**30:.0f} GiB ({profile.name}); add "
                               "devices or shrink the model or batch"])
    if args.json:
        print(json.dumps({"profile": profile.name, "devices": args.gpus,
                          "global_batch_size": args.global_batch_size,
                          "seq_length": model.seq_length, "vocab_size": model.vocab_size,
                          "precision": args.precision,
                          "parameters": parameter_count(model),
                          "results": [e.summary() for e in results[:max(args.top, 1)]]}, indent=1))
    else:
        print(f"model: {parameter_count(model) / 1e9:.3g} B parameters")
        print(assumptions(workload, args.gpus, profile))
        print(table(results, args.top))
        print()
        if layout is not None:
            e = results[0]
            print(f"{describe(e.layout, model)}: {e.seconds:.3f} s per iteration, "
                  f"{e.tflops:.1f} TFLOP/s per device, {e.memory['total'] / 2**30:.1f} GiB per device"
                  + ("" if e.fits else f" (does NOT fit {profile.memory_bytes / 2**30:.0f} GiB)"))
            for name, seconds in sorted(e.prediction.seconds_by_category.items(),
                                        key=lambda kv: -kv[1]):
                print(f"  {name:<24} {seconds:.4f} s")
        else:
            print("\n".join(explain(results, profile)))
    if args.print_flags:
        command = train_command(model, results[0].layout, args.global_batch_size, args.precision)
        print(("" if args.json else "\n") + command, file=sys.stdout)
    if args.plot:
        plot(results, args.plot)
        if not args.json:
            print(f"drew {args.plot}")
    return 0

