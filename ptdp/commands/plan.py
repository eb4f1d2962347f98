"""`ptdp plan`: its flags (the model's shape and settings, the devices and
the profile, each layout flag fixing its dimension) and its run: check them,
search or price the layouts (ptdp.perf.plan), and print the table, the
explanation, JSON, a `ptdp train` command or a plot. Torch-free at import."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys

from ptdp.config import Config, ConfigError, ModelConfig, validate
from ptdp.config.files import field_type
from ptdp.output_paths import output_path_problems
from ptdp.perf.analytic.counts import parameter_count
from ptdp.config.lora import TARGET_NAMES, LoRAConfig, lora_problems
from ptdp.perf.layout import SHARDING_STRATEGIES, Layout, LoRAWork, Workload
from ptdp.perf.plan.candidates import MIN_CONTEXT_POSITIONS, candidate_layouts
from ptdp.perf.plan.fixed_dimensions import (FixedDimensions, dimensions_line, fix_all_layout,
                                             fixed_dimensions, train_problems)
from ptdp.perf.plan.planner import (EXACT_ROWS, MODEL_SETTINGS, MOE_SETTINGS, PLOT_FORMATS,
                                    assumptions, caveat, context_without_dropout, describe,
                                    evaluate_layout, explain, plot, search, table, train_command)
from ptdp.perf.price.profiles import load_profile
from ptdp.schedules.kinds import DEFAULT_SCHEDULE, KINDS, PLAN_CHOICES

PLAN_SEQ_LENGTH = 2048     # the paper's
PLAN_VOCAB_SIZE = 51200    # the paper's


def _flag(name: str) -> str:
    return {f.name: f for f in dataclasses.fields(ModelConfig)}[name].metadata["flag"]


_TYPES = {"int": int, "float": float, "str": str}


def _add_model_settings(group: argparse._ArgumentGroup) -> None:
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for name in MODEL_SETTINGS:
        f = fields[name]
        meta = f.metadata
        if f.type == "bool":
            group.add_argument(meta["flag"], dest=name, action="store_true", help=meta["help"],
                               default=f.default)
            if meta.get("off_flag"):   # a setting on by default: its off switch too
                group.add_argument(meta["off_flag"], dest=name, action="store_false",
                                   help=argparse.SUPPRESS)
            continue
        if field_type(f.type) is list:   # --recompute-modules, the load-balancing type
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            group.add_argument(meta["flag"], dest=name, nargs="+", default=default,
                               metavar=meta.get("metavar", "VALUE"), help=meta["help"])
            continue
        kind = _TYPES[f.type.split("|")[0].strip()]
        group.add_argument(meta["flag"], dest=name, type=kind, default=f.default,
                           choices=meta.get("choices"),
                           metavar=None if "choices" in meta else meta.get("metavar") or {
                               int: "N", float: "X", str: "TEXT"}[kind],
                           help=meta["help"] + ("" if f.default is None
                                                else f" (default: {f.default})"))


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan", help="choose and predict a layout (t, c, p, d, b, v, schedule, split, "
                     "recomputation, sequence parallelism, sharding strategy, EP, ETP)",
        description="Search the layouts of a GPT (or a Llama-style model: --normalization "
                    "RMSNorm --swiglu --position-embedding-type rope --group-query-attention "
                    "--untie-embeddings-and-output-weights --disable-bias-linear; or a mixture of "
                    "experts: --num-experts ...) on N devices, each layout flag fixing its "
                    "dimension (--fix-all: evaluate exactly the given layout), and predict "
                    "iteration time, TFLOP/s per device and memory.")
    parser.not_taken = {"--moe-": "ptdp plan takes the MoE flags that describe the model ("
                        + ", ".join(_flag(name) for name in MOE_SETTINGS)
                        + "); this one does not change its costs: drop it"}
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
    for precision in ("bf16", "fp16"):
        parser.add_argument(f"--{precision}", dest="precision", action="store_const",
                            const=precision, help=f"--precision {precision}, as `ptdp train` "
                                                  "spells it")
    add_layout_flags(parser)
    add_lora_flags(parser)
    parser.add_argument("--top", type=int, default=10, metavar="N", help="rows in the table")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw throughput across layouts to this "
                        ".png, .pdf or .svg file (the suffix picks the format)")
    parser.add_argument("--print-flags", action="store_true",
                        help="print the winner as a whole `ptdp train` command (model, "
                             "precision, layout, batch, recomputation)")


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


def _layouts_to_price(args: argparse.Namespace, fixed: FixedDimensions, workload: Workload
                      ) -> tuple[Layout | None, list[Layout]]:
    """The one layout to price (--fix-all, or the only valid one), or None
    and the candidates to search; a fixed value no valid layout has is
    refused here, before any pricing, with `ptdp train`'s own message."""
    model, batch, devices = workload.model, workload.global_batch, args.gpus
    if fixed.fix_all:
        layout = fix_all_layout(args, model, devices)
        problems = (train_problems(model, layout, batch, devices, args.precision)
                    or layout.valid_for(model, batch))
        if problems:
            raise ConfigError(problems)
        return layout, [layout]
    candidates = list(candidate_layouts(workload, devices, **fixed.restrictions))
    if not candidates:
        # No layout has these values: say why, as `ptdp train` would of the
        # layout with every other dimension at its default.
        try:
            layout = fix_all_layout(args, model, devices)
            problems = (train_problems(model, layout, batch, devices, args.precision)
                        or layout.valid_for(model, batch))
        except ConfigError as error:
            problems = error.problems
        given = ", ".join(fixed.given.values())
        raise ConfigError(problems or [
            f"no layout with {given} is valid for this model and batch on {devices} devices "
            f"(ptdp train would accept it with the other dimensions at their defaults, but the "
            f"search's limits exclude it): price it with --fix-all, or fix fewer dimensions"])
    if len(candidates) == 1:   # every dimension given (or determined): that layout
        return candidates[0], candidates
    return None, candidates


def run_plan_command(args: argparse.Namespace) -> int:
    # The search keeps millions of small acyclic objects alive (schedules,
    # plays); the cyclic collector's full passes over them cost more than the
    # search itself (about half of the 1T search's time), and they free nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _plan(args)
    finally:
        if collecting:
            gc.enable()


def _plan(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    problems = [f"{flag} must be positive" for flag, value in
                (("--gpus", args.gpus), ("--global-batch-size", args.global_batch_size),
                 ("--context-parallel-size", args.context_parallel_size))
                if value is not None and value < 1]
    if args.plot is not None:  # checked now, not after the search
        problems += output_path_problems("--plot", args.plot, suffix=PLOT_FORMATS)
    try:   # the model's own rules, as `ptdp train` checks them (with t = p = d = 1);
        # --recompute-modules asks for --recompute-granularity selective, as there
        validate(Config(model=dataclasses.replace(
            model, recompute_granularity=args.recompute_granularity)))
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError(problems)
    try:
        profile = load_profile(args.gpu)
    except (OSError, ValueError) as error:
        raise ConfigError([f"--gpu {args.gpu}: {error}"]) from None
    if args.overlap_param_gather:
        profile = dataclasses.replace(profile, overlap_param_gather=True)
    lora = lora_from_args(args, model)
    workload = Workload(model, args.global_batch_size, args.precision, LoRAWork.of(lora))
    fixed = fixed_dimensions(args, model, args.gpus)
    layout, candidates = _layouts_to_price(args, fixed, workload)
    if layout is not None:
        results = [evaluate_layout(workload, layout, profile)]
    else:
        results = search(workload, args.gpus, profile, progress=_progress_printer(),
                         candidates=candidates)
        if not results:
            raise ConfigError([f"no layout of this model fits {args.gpus} × "
                               f"{profile.memory_bytes / 2**30:.0f} GiB ({profile.name}); add "
                               "devices or shrink the model or batch"
                               + ("" if not fixed.given else ", or fix fewer dimensions")])
    dimensions = dimensions_line(fixed, candidates, model)
    notes = [note for note in [None if layout is not None else context_without_dropout(
        workload, args.gpus, profile, fixed, results[0])] if note]
    if args.json:
        print(json.dumps({"profile": profile.name, "devices": args.gpus,
                          "global_batch_size": args.global_batch_size,
                          "seq_length": model.seq_length, "vocab_size": model.vocab_size,
                          "precision": args.precision,
                          "parameters": parameter_count(model),
                          "lora": lora_summary(model, lora),
                          "fixed": fixed.given, "dimensions": dimensions, "notes": notes,
                          "results": [e.summary() for e in results[:max(args.top, 1)]]}, indent=1))
    else:
        print(f"model: {parameter_count(model) / 1e9:.3g} B parameters")
        if workload.lora:
            print(lora_line(model, lora))
        print(assumptions(workload, args.gpus, profile))
        if caveat(profile):
            print(caveat(profile))
        print(dimensions)
        print(table(results, args.top))
        print()
        if layout is not None:   # one layout: its breakdown
            e = results[0]
            print(f"{describe(e.layout, model)}: {e.seconds:.3f} s per iteration, "
                  f"{e.tflops:.1f} TFLOP/s per device, {e.memory['total'] / 2**30:.1f} GiB per device"
                  + ("" if e.fits else f" (does NOT fit {profile.memory_bytes / 2**30:.0f} GiB)"))
            for name, seconds in sorted(e.prediction.seconds_by_category.items(),
                                        key=lambda kv: -kv[1]):
                print(f"  {name:<24} {seconds:.4f} s")
        else:
            print("\n".join(explain(results, profile)))
        for note in notes:
            print(note)
    if args.print_flags:
        command = train_command(model, results[0].layout, args.global_batch_size, args.precision)
        command += "".join(" " + flag for flag in lora_flags(lora))
        if args.overlap_param_gather and results[0].layout.sharding in ("optim", "optim_grads"):
            command += " --overlap-param-gather"
        print(("" if args.json else "\n") + command, file=sys.stdout)
    if args.plot:
        plot(results, args.plot)
        if not args.json:
            print(f"drew {args.plot}")
    return 0


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    layout = parser.add_argument_group(
        "layout (each flag fixes its dimension, the search covers the others)")
    layout.add_argument("--fix-all", action="store_true",
                        help="price exactly the given layout, every dimension not given at "
                             "`ptdp train`'s default (b = 1): no search")
    layout.add_argument("--tensor-model-parallel-size", "-t", type=int, metavar="N")
    layout.add_argument("--pipeline-model-parallel-size", "-p", type=int, metavar="N")
    layout.add_argument("--data-parallel-size", type=int, metavar="N",
                        help="as for `ptdp train` (default: --gpus / (t·c·p))")
    layout.add_argument("--micro-batch-size", type=int, metavar="N")
    layout.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, metavar="N",
                        help=f"fixes v = l / (p·N) (interleaved 1F1B, or {_v_kinds()} where "
                             f"v = 2)")
    layout.add_argument("--pipeline-schedule", choices=PLAN_CHOICES,
                        help=f"as for `ptdp train` ({_v_kinds()}: two chunks per rank; "
                             f"{DEFAULT_SCHEDULE} is interleaved with "
                             f"--num-layers-per-virtual-pipeline-stage; {_unsearched()} is priced "
                             f"only when given)")
    layout.add_argument("--recompute-granularity", choices=("full", "selective"),
                        help="as for `ptdp train` (no recomputation, its default, has no flag: "
                             "it is searched, or fixed by --fix-all)")
    layout.add_argument("--recompute-method", choices=("uniform",),
                        help="the plan prices full recomputation as uniform, 1 layer per group")
    layout.add_argument("--recompute-num-layers", type=int, choices=(1,), metavar="1")
    layout.add_argument("--sequence-parallel", action="store_true",
                        help="fixes sequence parallelism on (needs t > 1 dividing --seq-length); "
                             "off has no flag: it is searched, or fixed by --fix-all")
    layout.add_argument("--use-distributed-optimizer", action="store_true",
                        help="fixes the sharding strategy at optim, the sharded optimizer "
                             "(ZeRO-1; otherwise the strategy is searched, or none with --fix-all)")
    layout.add_argument("--use-megatron-fsdp", action="store_true",
                        help="as for `ptdp train`: fixes the sharding strategy at "
                             "--data-parallel-sharding-strategy's")
    layout.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES,
                        help="with --use-megatron-fsdp: no_shard, optim (ZeRO-1), optim_grads "
                             "(ZeRO-2) or optim_grads_params (ZeRO-3, the default)")
    layout.add_argument("--fsdp-reshard-after-forward", action=argparse.BooleanOptionalAction,
                        help="ZeRO-3: free each unit's gathered parameters after its forward "
                             "(or, with --no-..., keep a stage's across its microbatches); "
                             "searched unless given")
    layout.add_argument("--overlap-param-gather", action="store_true",
                        help="as for `ptdp train`: ZeRO-1's and ZeRO-2's all-gather of the "
                             "updated weights runs under the next forward (priced so; the "
                             "printed command keeps the flag where the strategy gathers them)")
    layout.add_argument("--no-scatter-gather-tensors-in-pipeline", dest="scatter_gather",
                        action="store_false", help="as for `ptdp train`")
    layout.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N",
                        help="as for `ptdp train`: layers on the first pipeline rank")
    layout.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                        help="as for `ptdp train`: layers on the last pipeline rank")
    layout.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    layout.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    layout.add_argument("--expert-model-parallel-size", type=int, metavar="N",
                        help="as for `ptdp train`: EP (an MoE model's experts over EP ranks)")
    layout.add_argument("--expert-tensor-parallel-size", type=int, metavar="N",
                        help="as for `ptdp train`: ETP (default t)")
    context = parser.add_argument_group("context parallelism (searched unless given)")
    context.add_argument("--context-parallel-size", type=int, metavar="N",
                         help="as for `ptdp train`: c ranks each holding s/c of every sequence "
                              "(default: c is searched from 1 "
                              f"while s/c >= {MIN_CONTEXT_POSITIONS})")
    context.add_argument("--cp-comm-type", choices=("p2p", "all_gather", "a2a"),
                         help="as for `ptdp train` (default: p2p)")


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """`ptdp train`'s --lora-* flags (ptdp.config.lora): the plan prices
    adapters on a frozen base; --lora-alpha and --lora-dropout's rate change
    no cost (a dropout's mask and copy do: any p > 0 counts them)."""
    fields = {f.name: f for f in dataclasses.fields(LoRAConfig)}
    group = parser.add_argument_group("low-rank adapters (as for `ptdp train`)")
    for name in ("lora_rank", "lora_alpha", "lora_dropout"):
        meta = fields[name].metadata
        group.add_argument(meta["flag"], dest=name, type=int if name == "lora_rank" else float,
                           default=fields[name].default, metavar=meta.get("metavar"),
                           help=meta["help"])
    meta = fields["lora_target_modules"].metadata
    group.add_argument(meta["flag"], dest="lora_target_modules", nargs="+",
                       default=list(TARGET_NAMES), metavar=meta["metavar"], help=meta["help"])
    meta = fields["lora_share_expert_adapters"].metadata
    group.add_argument(meta["flag"], dest="lora_share_expert_adapters", action="store_true",
                       help=meta["help"])


def lora_from_args(args: argparse.Namespace, model: ModelConfig) -> LoRAConfig:
    """The --lora-* settings, checked as `ptdp train` checks them against the model."""
    from ptdp.model.adapters import adapter_problems

    lora = LoRAConfig(**{name: getattr(args, name) for name in (
        "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules",
        "lora_share_expert_adapters")})
    problems = lora_problems(lora)
    if not problems:
        problems = adapter_problems(model, lora)
    if problems:
        raise ConfigError(problems)
    return lora


def lora_summary(model: ModelConfig, lora: LoRAConfig) -> dict | None:
    """The adapters' settings and the trainable and frozen parameters (logical)."""
    work = LoRAWork.of(lora)
    if work is None:
        return None
    from ptdp.perf.analytic.lora import adapter_parameter_count, adapter_shapes_of

    trainable = adapter_parameter_count(model, work)
    return {"rank": lora.lora_rank, "target_modules": list(lora.lora_target_modules),
            "adapters": len(adapter_shapes_of(model, work)) // 2, "trainable": trainable,
            "frozen": parameter_count(model)}


def lora_line(model: ModelConfig, lora: LoRAConfig) -> str:
    summary = lora_summary(model, lora)
    return (f"LoRA: rank {summary['rank']} on {' '.join(summary['target_modules'])}, "
            f"{summary['adapters']} adapters; trainable {summary['trainable'] / 1e6:.3g} M "
            f"({100 * summary['trainable'] / summary['frozen']:.2g} % of the frozen "
            f"{summary['frozen'] / 1e9:.3g} B): priced with a frozen base (no weight gradients, "
            f"optimizer state or reduction for it)")


def lora_flags(lora: LoRAConfig) -> list[str]:
    """The `ptdp train` flags of these --lora-* settings (none without adapters)."""
    if not lora.enabled:
        return []
    flags = ["--lora-rank", str(lora.lora_rank), "--lora-alpha", f"{lora.lora_alpha:g}"]
    if lora.lora_dropout:
        flags += ["--lora-dropout", f"{lora.lora_dropout:g}"]
    if list(lora.lora_target_modules) != list(TARGET_NAMES):
        flags += ["--lora-target-modules", *(f"'{name}'" if "*" in name or "[" in name else name
                                             for name in lora.lora_target_modules)]
    if lora.lora_share_expert_adapters:
        flags.append("--lora-share-expert-adapters")
    return flags


def _v_kinds() -> str:
    return " or ".join(k.name for k in KINDS.values() if k.flag and k.fixed_chunks)


def _unsearched() -> str:
    return " or ".join(k.name for k in KINDS.values() if k.flag and not k.searched)
