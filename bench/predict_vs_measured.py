"""Predicted vs measured iteration time on this machine (CPU, local processes).

Calibrates this machine (`ptdp calibrate`, or reads `--profile PATH`), then
for each layout runs `ptdp train --mock-data` in a subprocess (a small GPT,
fp32, --metrics-file), takes the median `iteration_ms` of the iterations
after the warm-up, and predicts the same iteration with
`ptdp.perf.simulate.predict.simulate` on the calibrated profile. Prints a Markdown table
(layout, measured, predicted, ratio) and the median absolute relative error;
with --write appends it to bench/RESULTS.md under "Predicted vs measured
iteration time". Nothing is fitted per layout: the only inputs are the
profile's measured constants (see ptdp/perf/calibrate/measure.py).

    python bench/predict_vs_measured.py                 # calibrate, then 10 layouts
    python bench/predict_vs_measured.py --profile local.json --layouts 3 --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results import cpu_name, publish  # noqa: E402  bench/results.py: the script folder is on sys.path

from ptdp.config import ModelConfig  # noqa: E402
from ptdp.perf.simulate.predict import simulate  # noqa: E402
from ptdp.schedules.split import LayerSplit  # noqa: E402
from ptdp.perf.layout import Layout, Workload  # noqa: E402
from ptdp.perf.price.profiles import load_profile, save_profile  # noqa: E402

HEADING = "## Predicted vs measured iteration time"
# Per-phase times in the metrics (of the logging rank: the last pipeline stage) and the
# prediction's categories they correspond to, printed to stderr side by side.
PHASES = {"compute": (("forward_ms", "backward_ms"),
                      ("forward compute", "backward compute", "recompute", "tensor all-reduce")),
          "exchanges": (("pipeline_transfer_ms",), ("pipeline transfer", "bubble/idle")),
          "reduction": (("grad_reduce_ms",), ("data-parallel reduction",)),
          "optimizer": (("optimizer_ms",), ("optimizer",))}
TARGET = 0.10   # median absolute relative error (issue 15)

LAYOUTS = [
    Layout(b=2),
    Layout(b=4),
    Layout(t=2, b=2),
    Layout(p=2, b=2),
    Layout(d=2, b=2),
    Layout(p=2, v=2, b=2),
    Layout(t=2, p=2, b=2),
    Layout(p=4, b=2),
    Layout(p=2, d=2, b=2, schedule="gpipe"),
    Layout(t=2, p=2, d=2, b=2),
    # Uneven stages (issue 15) and the zero-bubble schedules (issue 14).
    Layout(p=2, b=2, split=LayerSplit(last=3)),
    Layout(p=4, b=2, split=LayerSplit(first=1, last=1)),
    Layout(p=2, b=2, schedule="zb-h1"),
    Layout(p=2, v=2, b=2, schedule="zbv"),
    # Full recomputation (with the model's hidden dropout, the whole layer reruns).
    Layout(b=2, recompute="full"),
    Layout(t=2, p=2, b=2, recompute="full"),
]


def describe(layout: Layout, num_layers: int) -> str:
    text = f"t={layout.t} p={layout.p} d={layout.d} b={layout.b}"
    if layout.schedule == "zbv":
        text += " zbv"
    elif layout.v > 1:
        text += f" v={layout.v}"
    elif layout.p > 1:
        text += f" {layout.schedule}"
    if not layout.split.even:
        text += " layers " + ",".join(map(str, layout.stage_layers(num_layers)))
    if layout.distributed_optimizer:
        text += " dist-opt"
    if layout.recompute:
        text += f" recompute={layout.recompute}"
    return text


def model_flags(model: ModelConfig) -> list[str]:
    return ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--num-attention-heads", str(model.num_attention_heads),
            "--seq-length", str(model.seq_length), "--vocab-size", str(model.vocab_size)]


def measure(model: ModelConfig, layout: Layout, global_batch: int, iterations: int,
            warmup: int) -> dict:
    """Run `ptdp train` once; the median iteration_ms after `warmup` iterations."""
    with tempfile.TemporaryDirectory(prefix="ptdp-bench-") as folder:
        metrics = Path(folder) / "metrics.jsonl"
        command = [sys.executable, "-m", "ptdp", "train", "--mock-data", *model_flags(model),
                   *layout.train_flags(model, global_batch), "--train-iters", str(iterations),
                   "--log-interval", str(iterations), "--metrics-file", str(metrics)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        started = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["iteration_ms"] for r in records[warmup:]]
    phases = {name: statistics.median(sum(r[key] for key in keys) for r in records[warmup:])
              for name, (keys, _) in PHASES.items()}
    return {"ms": statistics.median(times), "all_ms": [round(x, 1) for x in times],
            "phases": phases, "wall_s": time.perf_counter() - started, "command": command}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="a hardware profile JSON (default: run ptdp calibrate)")
    parser.add_argument("--save-profile", help="also write the calibrated profile here")
    parser.add_argument("--layouts", type=int, default=len(LAYOUTS),
                        help=f"run only the first N layouts (default: all {len(LAYOUTS)})")
    parser.add_argument("--iterations", type=int, default=8, help="iterations per run (default 8)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="iterations left out of the median (default 3)")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the layouts this many times, one after the other, and keep "
                             "each layout's lowest median: the pass least disturbed by other "
                             "load on the machine (default 1)")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    if args.iterations <= args.warmup:
        parser.error("--iterations must exceed --warmup")

    started = time.perf_counter()
    if args.profile:
        profile = load_profile(args.profile)
        source = f"profile {args.profile}"
    else:
        from ptdp.perf.calibrate.profile import calibrate

        profile = calibrate(log=lambda line: print(f"calibrate: {line}", file=sys.stderr))
        source = "ptdp calibrate, in this run"
        if args.save_profile:
            save_profile(profile, args.save_profile)

    model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                        vocab_size=args.vocab_size)
    workload = Workload(model, args.global_batch_size, precision="fp32")
    best: dict[Layout, dict] = {}
    rows = []
    for _ in range(args.passes):
        for layout in LAYOUTS[:args.layouts]:
            measured = measure(model, layout, args.global_batch_size, args.iterations, args.warmup)
            if layout not in best or measured["ms"] < best[layout]["ms"]:
                best[layout] = measured
            predicted = simulate(workload, layout, profile)
            ratio = predicted.iteration_seconds * 1e3 / measured["ms"]
            print(f"{describe(layout, model.num_layers):<40} measured {measured['ms']:8.1f} ms {measured['all_ms']}  "
                  f"predicted {predicted.iteration_seconds * 1e3:8.1f} ms  ratio {ratio:.2f}  "
                  f"({measured['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            phases = predicted.rank_categories(0 if layout.schedule == "zbv" else layout.p - 1)
            print("    last stage, measured/predicted ms: " + ", ".join(
                f"{name} {measured['phases'][name]:.0f}/"
                f"{sum(phases[c] for c in categories) * 1e3:.0f}"
                for name, (_, categories) in PHASES.items()), file=sys.stderr, flush=True)
    for layout in LAYOUTS[:args.layouts]:
        predicted = simulate(workload, layout, profile)
        rows.append((layout, best[layout], predicted,
                     predicted.iteration_seconds * 1e3 / best[layout]["ms"]))

    errors = [abs(ratio - 1) for *_, ratio in rows]
    median_error = statistics.median(errors)
    lines = [f"### {datetime.date.today()}: {model.num_layers} layers, h={model.hidden_size}, "
             f"a={model.num_attention_heads}, s={model.seq_length}, V={model.vocab_size}, "
             f"B={args.global_batch_size}, fp32, dropout 0.1",
             "",
             f"Command: `{shlex.join(['python', f'bench/{Path(__file__).name}', *given])}`  ",
             f"{cpu_name()}, {os.cpu_count()} CPUs; profile: {source} (GEMM peak "
             f"{profile.peak_tflops_fp32 * 1e3:.1f} GFLOP/s per thread, +{profile.gemm_ramp_seconds * 1e6:.1f} "
             f"us per GEMM, GEMM speed-up on {profile.cores} threads {profile.thread_speedup:.2f}, "
             f"{profile.available_cores or profile.cores:.2f} of {profile.cores} cores available, "
             f"gloo all-reduce {profile.intra_latency * 2e6:.0f} us + bytes / "
             f"{profile.intra_bandwidth / 1e9:.2f} GB/s); "
             f"measured = median iteration_ms of iterations {args.warmup + 1}..{args.iterations} "
             f"(logged by the last pipeline stage)"
             + (f", the lowest of {args.passes} passes" if args.passes > 1 else "")
             + "; predicted = ptdp.perf.simulate.predict.simulate.",
             "",
             "| layout | processes | m | measured ms | predicted ms | predicted / measured |",
             "|---|---:|---:|---:|---:|---:|"]
    for layout, measured, predicted, ratio in rows:
        lines.append(f"| {describe(layout, model.num_layers)} | {layout.devices} | {predicted.microbatches} | "
                     f"{measured['ms']:.1f} | {predicted.iteration_seconds * 1e3:.1f} | {ratio:.2f} |")
    verdict = "meets" if median_error <= TARGET else "misses"
    lines += ["", f"Median absolute relative error: **{100 * median_error:.1f}%** ({verdict} the "
                  f"{100 * TARGET:.0f}% target); largest {100 * max(errors):.1f}%. "
                  f"Whole benchmark: {time.perf_counter() - started:.0f} s.", ""]
    publish(HEADING, "\n".join(lines), write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
