"""`ptdp plan`: choose t, c, p, d, b, v, the pipeline schedule, the layer
split, recomputation, sequence parallelism, the sharding strategy over the
data-parallel ranks (no_shard, optim = ZeRO-1, optim_grads = ZeRO-2 and,
once `ptdp train` runs it, optim_grads_params = ZeRO-3:
ptdp.perf.layout.PARAMETER_SHARDING_TRAINS) and, for a mixture of experts,
EP and ETP, for a model on N devices, and predict what
the run will cost.

The search enumerates every valid layout (candidates.py: the rules `ptdp
train` enforces), bounds each one's iteration time from below without building its schedule
(bounds.compute_lower_bound), and prices the layouts cheapest bound first
with the schedule simulator (simulate/predict.py: the same action lists the executor
runs, costed with a hardware profile), those whose memory per device
(analytic/memory.py) fits the profile's device memory, until no bound can reach
the top EXACT_ROWS rows; it ranks them by predicted throughput. Each
layout flag (`ptdp train`'s) fixes its dimension and the search covers the
rest; `--fix-all`, or flags that leave one valid layout, price that one
layout (fixed_dimensions.py).

Schedules: those whose records (ptdp.schedules.kinds) are searched: 1F1B,
interleaved 1F1B (v = 2 ... MAX_CHUNKS) and the zero-bubble ZB-H1 (v = 1,
m >= p) and ZB-V (v = 2, m >= 2p, l divisible by 2p), priced by the same
simulator with the backward split into B and W (price/pricing.py) and their
memory counted from F to B to W (analytic/memory.py). `--print-flags` prints
`--pipeline-schedule` with the kind's name for them (a V's two chunks per
rank are implied).

Sequence parallelism is searched on and off wherever it is valid (t > 1 and
t dividing s): it divides the activations between the tensor-parallel
regions and their element-wise work by t for the same tensor traffic plus
the re-gathers of the saved inputs, so it mostly decides what fits.

Uneven layer splits (ptdp.schedules.split): for each pipeline
layout with p >= 2 under a kind of fixed chunks (1F1B with v = 1, ZB-H1,
ZB-V; candidates.split_candidates) the search also tries
the embedding/loss accounting flags and, for v = 1, first/last-rank layer
counts that move one or two layers off the first and/or the last rank (the
output layer of a large-vocabulary model can cost several layers);
`--print-flags` appends their flags.

The explanation compares the winner with the best layout that differs from
it in one respect (a different t, p, b, v, schedule, recomputation,
sequence parallelism or sharding strategy), and names the time categories that
make the difference.
"""

from __future__ import annotations

import bisect
import heapq
import operator
import dataclasses
import shlex
from dataclasses import asdict, dataclass
from typing import Any

from ptdp.config import ModelConfig
from ptdp.schedules.kinds import DEFAULT_SCHEDULE
from ptdp.perf.plan.candidates import (  # noqa: F401  (candidate_layouts & co. are plan's API too)
    MAX_CHUNKS, MAX_MICROBATCH, MIN_CONTEXT_POSITIONS, SCHEDULES, candidate_layouts,
    context_sizes_to_search, split_candidates)
from ptdp.perf.plan.fixed_dimensions import FixedDimensions
from ptdp.perf.layout import ByValue, Layout, Workload

MEMORY_HEADROOM = 0.9      # leave 10 % of device memory to the allocator and workspaces
EXACT_ROWS = 30            # search's first rows are exact (see search); plot draws as many
PLOT_FORMATS = (".png", ".pdf", ".svg")   # --plot: matplotlib picks the format by the suffix
NOTABLE_GAIN = 0.05        # a layout left out of the search is named when it is this much faster


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
        from ptdp.perf.analytic.counts import parameters_per_device

        layout = asdict(self.layout)
        if self.layout.c == 1:   # (as before context parallelism: no c, no comm type)
            del layout["c"], layout["cp_comm"]
        layout["distributed_optimizer"] = self.layout.distributed_optimizer   # (as before sharding)
        if not self.layout.shards_parameters:   # (ZeRO-3's alone)
            del layout["reshard_after_forward"]
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


def evaluate_layout(workload: Workload, layout: Layout, profile) -> Evaluation:
    from ptdp.perf.analytic.memory import memory_per_device
    from ptdp.perf.simulate.predict import simulate

    memory = memory_per_device(workload, layout, kernels=_kernels(profile))
    fits = memory["total"] <= MEMORY_HEADROOM * profile.memory_bytes
    return Evaluation(layout, memory, simulate(workload, layout, profile), fits)


def _kernels(profile) -> str:
    """Which attention/LayerNorm kernels the memory model assumes."""
    return "cpu" if profile.kind == "cpu" else "cuda"


def search(workload: Workload, devices: int, profile, *, top: int | None = None,
           exhaustive: bool = False, progress=None, candidates: list[Layout] | None = None,
           best_only: bool = False, beyond=None, **restrictions) -> list[Evaluation]:
    """Layouts that fit, best predicted throughput first, among `candidates`
    (default: candidate_layouts with `restrictions`).

    Every candidate gets a lower bound on its iteration time
    (bounds.compute_lower_bound: its busiest rank's compute plus the pipeline
    fill and drain that rank cannot skip, its gradient reductions and the
    optimizer; no schedule is built; the reductions and the optimizer are
    priced only for the layouts the search reaches, `_Bounds`). The layouts
    are priced cheapest bound first, and the search stops at the first whose bound is no better than
    the EXACT_ROWS-th best time priced so far: no layout after it can reach
    those rows, so the first EXACT_ROWS results are what pricing every
    layout gives (`exhaustive=True` prices every layout; the tests compare
    the two). Memory is checked only for layouts that get that far. Then,
    for each respect `explain` compares
    (t, p, b, v, schedule, ...), the best layout that differs from the
    winner in it alone is found the same way among its few candidates and
    added to the results. `progress(stage, done, total)`, if given, hears
    how far it is ("bounding", "pricing", then "done" with the layouts
    priced). `best_only`: the fastest layout alone (exact too), no rivals;
    with `beyond(seconds)` also, only if it is faster than what `beyond`
    rejects (`beyond` must reject every time above one it rejects): no
    layout whose bound `beyond` rejects is priced (an iteration never beats
    its bound), and the result is empty when none is left; a layout whose
    bound without its reductions `beyond` rejects is not even bounded whole."""
    report = progress or (lambda stage, done, total: None)
    if candidates is None:
        candidates = list(candidate_layouts(workload, devices, **restrictions))
    if exhaustive:
        results = [e for e in (_evaluate_if_fits(workload, layout, profile)
                               for layout in candidates) if e is not None]
        results.sort(key=lambda e: (e.seconds, e.memory["total"]))
        return results[:top] if top else results

    bounds = _Bounds(workload, profile, ByValue(workload))   # (the workload read once)
    for i, layout in enumerate(candidates):
        if i % 500 == 0:
            report("bounding", i, len(candidates))
        bounds.add(layout)
    if best_only and beyond is not None:
        # What `beyond` rejects without the reductions it rejects with them
        # (they only add): such layouts are left out at once.
        candidates = [layout for layout in candidates if not beyond(bounds.partial[layout])]
    priced: dict[Layout, Evaluation | None] = {}
    results = _best_by_bound(candidates, bounds, 1 if best_only else EXACT_ROWS, workload,
                             profile, priced, beyond if best_only else None)
    if best_only:
        return results
    if results:
        winner = results[0].layout
        fields = list(ASPECTS)
        # (each candidate's aspects read once: tens of thousands of candidates)
        aspects = [operator.attrgetter(*fields)(layout) for layout in candidates]
        best = operator.attrgetter(*fields)(winner)
        for k, field in enumerate(fields):
            free = {field, "d"} | COUPLED.get(field, set())
            same = [i for i, f in enumerate(fields) if f not in free]
            rivals = [layout for layout, values in zip(candidates, aspects)
                      if values[k] != best[k] and all(values[i] == best[i] for i in same)]
            _best_by_bound(rivals, bounds, 1, workload, profile, priced)
        results = [e for e in priced.values() if e is not None]
    report("done", len(priced), len(candidates))
    results.sort(key=lambda e: (e.seconds, e.memory["total"]))
    return results[:top] if top else results


def _evaluate_if_fits(workload: Workload, layout: Layout, profile,
                      keys: tuple[ByValue, ByValue] | None = None) -> Evaluation | None:
    """The layout's Evaluation, or None (without pricing it) if its memory
    does not fit the device. `keys`: memory_fits'."""
    from ptdp.perf.analytic.memory import memory_fits
    from ptdp.perf.simulate.predict import simulate

    memory = memory_fits(workload, layout, MEMORY_HEADROOM * profile.memory_bytes,
                         kernels=_kernels(profile), keys=keys)
    if memory is None:
        return None
    return Evaluation(layout, memory, simulate(workload, layout, profile), True)


class _Bounds:
    """Each candidate's lower bound (bounds.compute_lower_bound), its
    reductions priced only when a search reaches it: every candidate gets
    the bound without them at once (`add`), never above the whole one, and
    `in_order` hands layouts out by their whole bound, as sorting every
    whole bound would (ties in the given order), pricing a layout's whole
    bound only when its partial one comes up. Most of a search's layouts
    are never reached, and their reductions are never priced."""

    def __init__(self, workload: Workload, profile, workload_key: ByValue):
        self.workload, self.profile, self.key = workload, profile, workload_key
        self.partial: dict[Layout, float] = {}
        self.whole: dict[Layout, float] = {}
        self._by_shape: dict[tuple, float] = {}   # partial bounds by what they read
        self.keys = (workload_key, ByValue(workload.model))   # (memory_fits')

    def add(self, layout: Layout) -> None:
        from ptdp.perf.simulate.bounds import compute_lower_bound, partial_bound_shape

        # (layouts that differ only in what follows the flush share it)
        shape = partial_bound_shape(layout)
        bound = self._by_shape.get(shape)
        if bound is None:
            bound = self._by_shape[shape] = compute_lower_bound(
                self.workload, layout, self.profile, self.key, reductions=False)
        self.partial[layout] = bound

    def __getitem__(self, layout: Layout) -> float:
        """The whole bound."""
        if layout not in self.whole:
            from ptdp.perf.simulate.bounds import compute_lower_bound
            self.whole[layout] = compute_lower_bound(self.workload, layout, self.profile,
                                                     self.key)
        return self.whole[layout]

    def in_order(self, layouts: list[Layout]):
        """`layouts` by whole bound, ties in their order. (A layout comes out
        once no other can come before it: each remaining one's key, its
        partial or its whole bound, is at least the whole bound given.)"""
        heap = []
        for position, layout in enumerate(layouts):
            whole = self.whole.get(layout)
            heap.append((self.partial[layout] if whole is None else whole, position,
                         whole is not None))
        heapq.heapify(heap)
        while heap:
            _, position, whole = heapq.heappop(heap)
            if whole:
                yield layouts[position]
            else:
                heapq.heappush(heap, (self[layouts[position]], position, True))


def _best_by_bound(layouts: list[Layout], bounds: _Bounds, rows: int,
                   workload: Workload, profile, priced: dict[Layout, Evaluation | None],
                   beyond=None) -> list[Evaluation]:
    """The `rows` fastest of `layouts` that fit, exactly: price them
    cheapest bound first until a bound reaches the rows-th best time, or
    `beyond(bound)` says no layout from there on is wanted (`priced` keeps
    every evaluation, None for what does not fit)."""
    times: list[float] = []
    found: list[Evaluation] = []
    for layout in bounds.in_order(layouts):
        if len(times) >= rows and bounds[layout] >= times[rows - 1]:
            break
        if beyond is not None and beyond(bounds[layout]):
            break
        if layout not in priced:
            priced[layout] = _evaluate_if_fits(workload, layout, profile, bounds.keys)
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
    "sharding": "sharding strategy", "split": "layer split",
    "ep": "expert-parallel size", "etp": "expert-tensor-parallel size",
}
# Sequence parallelism exists only with t > 1: a rival of another t may differ in it too.
# A V's kind fixes v = 2: a rival of another schedule may differ in v too.
# An uneven split is valid for some p, v and schedules only: their rivals may differ in it too.
# Sequence parallelism's rule (s/c divisible by t) involves c too.
# Expert layouts are valid for some t·c·d only (EP·ETP divides it; ETP None means t), and
# need sequence parallelism where t > 1: the rivals of t, c and p may differ in them too.
COUPLED = {"t": {"sequence_parallel", "ep", "etp"}, "schedule": {"v", "split"},
           "p": {"split", "ep", "etp"}, "v": {"split"}, "c": {"sequence_parallel", "ep", "etp"},
           "ep": {"sequence_parallel", "etp"}, "etp": {"sequence_parallel", "ep"},
           "sequence_parallel": {"ep", "etp"}}


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
        elif field == "etp" and value is None:
            value = f"t={rival.layout.t}"
        lines.append(f"  vs {words} {value!s:>5}: {slower:+.1%} time"
                     + (f" ({reasons})" if reasons else ""))
    return lines


def _unsplit_memory(best: Evaluation, profile) -> str:
    """What the winner would need without sequence parallelism, when no
    such layout is among the results (it did not fit)."""
    from ptdp.perf.analytic.memory import memory_per_device

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
    if layout.schedule != DEFAULT_SCHEDULE:
        text += f" {layout.schedule}"
    if layout.recompute:
        text += f" recompute={layout.recompute}"
    if layout.sequence_parallel:
        text += " sequence-parallel"
    text += sharding_words(layout)
    if layout.ep > 1:
        text += f" ep={layout.ep}"
    if layout.etp is not None:
        text += f" etp={layout.etp}"
    if not layout.scatter_gather:
        text += " no-scatter-gather"
    if not layout.split.even:
        text += " " + split_text(layout, model)
    return text


def sharding_words(layout: Layout) -> str:
    """How `describe` names the sharding strategy (nothing for no_shard)."""
    if layout.sharding == "no_shard":
        return ""
    if layout.sharding == "optim":
        return " distributed-optimizer"
    return f" sharding={layout.sharding}" + ("" if not layout.shards_parameters
                                             or layout.reshard_after_forward else " no-reshard")


def sharding_cell(layout: Layout) -> str:
    """The table's sharding column: the strategy ("-": none; ZeRO-3 kept
    gathered across microbatches: "+keep")."""
    if layout.sharding == "no_shard":
        return "-"
    return layout.sharding + ("+keep" if layout.shards_parameters
                              and not layout.reshard_after_forward else "")


def table(results: list[Evaluation], rows: int) -> str:
    # A column for c only where a row has context parallelism; EP and ETP for an MoE.
    context = any(e.layout.c > 1 for e in results[:rows])
    experts = any(e.prediction.workload.model.is_moe for e in results[:rows])
    header = ("| rank | t | " + ("c | " if context else "") + "p | d | "
              + ("EP | ETP | " if experts else "") + "b | v | schedule | "
              "layers per stage | recompute | seq. par. | "
              "sharding | s/iter | TFLOP/s/device | bubble | memory GiB |")
    lines = [header, "|" + "---|" * (15 + context + 2 * experts)]
    for i, e in enumerate(results[:rows], 1):
        layout = e.layout
        layers = ("even" if layout.split.even else
                  split_text(layout, e.prediction.workload.model).removeprefix("layers per stage "))
        c = (f"{layout.c} {layout.cp_comm} | " if layout.c > 1 else "1 | ") if context else ""
        d = f"{layout.d} | " + (f"{layout.ep} | {layout.expert_tensor} | " if experts else "")
        lines.append(f"| {i} | {layout.t} | {c}{layout.p} | {d}{layout.b} | {layout.v} | "
                     f"{layout.schedule_kind} | {layers} | "
                     f"{layout.recompute or '-'} | {'yes' if layout.sequence_parallel else '-'} | "
                     f"{sharding_cell(layout)} | "
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


# ------------------------------------------------------------------ the command's words

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
        if name == "recompute_modules" and layout.recompute != "selective":
            continue   # (`ptdp train` takes them with selective recomputation only)
        if isinstance(value, list):
            flags += [flag, *map(str, value)]
            continue
        flags += [flag] if isinstance(value, bool) else [flag, f"{value:g}" if isinstance(
            value, float) else str(value)]
    flags += PRECISION_FLAGS[precision] + layout.train_flags(model, global_batch)
    return "ptdp train " + " ".join(map(shlex.quote, flags))   # (a --moe-layer-freq pattern)


def assumptions(workload: Workload, devices: int, profile) -> str:
    """What the plan takes as given besides the model's shape, in one line."""
    model = workload.model
    return (f"assuming: sequence length {model.seq_length}, vocabulary {model.vocab_size} "
            f"(padded to a multiple of {model.make_vocab_size_divisible_by}·t), "
            f"{workload.precision}, global batch {workload.global_batch}, {devices} devices "
            f"of profile {profile.name}")

def caveat(profile) -> str | None:
    """What a user of this profile should know about its accuracy for
    ptdp's own runs (README, "Planning a run, and how far to trust it")."""
    if profile.name in ("h100", "h200"):
        return ("note: on h100/h200 this model prices ptdp's operators beyond the matrix "
                "products at 88 % of the data sheet's bandwidth; ptdp's own runs on an H200 measured "
                "slower than it predicts (4.5 to 12 %, README: \"Planning a run, and how far to "
                "trust it\")")
    return None


# A mixture of experts' model settings (ptdp.config.moe; ptdp train's flags): those
# that shape its costs, and the routing ones that change none, so that a
# run's model flags paste as they are.
MOE_SETTINGS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk",
                "moe_shared_expert_intermediate_size", "moe_layer_freq",
                "moe_expert_capacity_factor", "moe_token_dispatcher_type",
                # what the router and the experts keep for backward
                # (ptdp.perf.analytic.moe.moe_saved_bytes)
                "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                "moe_shared_expert_gate", "moe_grouped_gemm",
                # DeepSeek-V3's routing: the same work whichever experts win
                "moe_router_score_function", "moe_router_pre_softmax",
                "moe_router_topk_scaling_factor", "moe_router_num_groups",
                "moe_router_group_topk", "moe_router_dtype", "moe_router_enable_expert_bias",
                "moe_router_bias_update_rate", "moe_router_force_load_balancing")


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
                  "rope_scaling_factor", "window_size", "window_attn_skip_freq",
                  "softmax_type", "init_method_std",
                  # gpt-oss's and Gemma 3's pieces: GeGLU widens the MLP as
                  # SwiGLU does, the sandwich norms add two norms a layer and
                  # sinks a rescale of the attention output; the rotary
                  # variants and scales cost nothing more
                  "geglu", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value",
                  "softmax_scale", "scale_embeddings", "sandwich_norm", "apply_layernorm_1p",
                  "rotary_base_local", "rotary_percent", "rotary_seq_len_interpolation_factor",
                  "rotary_scaling_factor", "yarn_original_max_position_embeddings",
                  "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim",
                  "yarn_correction_range_round_to_int",
                  # DeepSeek-V3's: multi-latent attention's widths and rotation,
                  # multi-token prediction's depth and loss weight, and what
                  # selective recomputation recomputes (with
                  # --recompute-granularity selective, as `ptdp train` asks)
                  "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                  "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "mtp_num_layers",
                  "mtp_loss_scaling_factor", "recompute_modules") + MOE_SETTINGS


def context_without_dropout(workload: Workload, devices: int, profile, fixed: FixedDimensions,
                            best: Evaluation) -> str | None:
    """A note when attention dropout kept context parallelism out of the
    search (ptdp's context-parallel attention has no dropout yet) and
    dropping it would give a faster plan that uses context parallelism:
    the best such layout without dropout, against `best` and against
    `best`'s own layout without dropout (the part of the gain that is
    context parallelism's). None where c was given or would not help."""
    model = workload.model
    if not model.attention_dropout > 0 or "context_sizes" in fixed.restrictions:
        return None
    free = dataclasses.replace(model, attention_dropout=0.0)
    cp_comm = fixed.restrictions.get("cp_comm", "p2p")
    sizes = tuple(context_sizes_to_search(free, devices, cp_comm)[1:])
    if not sizes:
        return None
    free_workload = dataclasses.replace(workload, model=free)
    same = evaluate_layout(free_workload, best.layout, profile)
    slowest = min(same.seconds, best.seconds)

    def too_slow(seconds: float) -> bool:   # (what the note leaves out)
        return seconds * (1 + NOTABLE_GAIN) > slowest

    # Only a layout that would be named is wanted: a bound too slow for the
    # note ends the search (the note is the one pricing every such layout gives).
    found = search(free_workload, devices, profile, best_only=True, beyond=too_slow,
                   **{**fixed.restrictions, "context_sizes": sizes})
    if not found or too_slow(found[0].seconds):
        return None
    rival = found[0]
    default = " (the default, as in Megatron-LM)" if model.attention_dropout == 0.1 else ""
    return (f"note: context parallelism was not searched: ptdp's context-parallel attention has "
            f"no dropout yet, and --attention-dropout is {model.attention_dropout:g}{default}. "
            f"With --attention-dropout 0, {describe(rival.layout, free)} takes "
            f"{rival.seconds:.3f} s per iteration ({rival.tflops:.1f} TFLOP/s per device): "
            f"{best.seconds / rival.seconds - 1:.0%} faster than the best plan above, "
            f"{same.seconds / rival.seconds - 1:.0%} faster than its layout without dropout "
            f"({same.seconds:.3f} s); plan again with --attention-dropout 0 to see those layouts")
