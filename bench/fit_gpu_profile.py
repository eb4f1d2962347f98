"""A GPU profile from bench/gpu.py's kernel sweep, and what it changes.

    python bench/gpu.py --write --json gpu.json        # on the GPU
    python bench/fit_gpu_profile.py gpu.json --out h200-measured.json

bench/gpu.py's kernel sweep (bench/gpu_kernels_sweep.py) times, on one GPU,
the GEMMs of every published row's layers, ptdp's memory-bound operators,
its optimizer step, launches, and one GEMM sustained for 15 s. This script
turns those timings into the numbers of a hardware profile, each from
measurements of kernels, none from a training run's throughput:

- the tile model's `gemm_efficiency` (e_max) and `tile_overhead_seconds`:
  least squares on relative error over every compute-bound bf16 GEMM
  measured (`ptdp.perf.calibrate.gpu.fit_tile_model`, as `ptdp calibrate` fits
  them), then e_max scaled by the sustained GEMM's last window over its
  first where that is below 1 (a training run keeps the chip busy; its
  clocks are the sustained ones);
- `op_bandwidth` per planner class (elementwise, gelu, layer_norm,
  attention_core, residual, optimizer): the bytes the planner counts for
  ptdp's own operators of that class over their measured time, at the
  largest size measured (where a launch is negligible);
- `launch_overhead`: `ptdp calibrate`'s chain measurement (per operator);
- `attention_efficiency`: the flash blocks' fraction of the per-SM peak for
  which the profile's forward and backward attention times match the
  measured causal scaled_dot_product_attention calls (median ratio 1);
  the same for cuDNN's kernel where the sweep timed it, which prices the
  published rows (bench/published_runs.py) in place of the rate fitted to
  the FlashAttention-3 paper's benchmarks.

It prints the fitted numbers beside the built-in profile's, then
bench/published_runs.py's table and ptdp's own runs priced with the fitted
profile (as h100 and h200), so the effect on every row is seen before the
numbers go into ptdp/perf/price/profiles.py. `--out` writes the profile as JSON
(`ptdp plan --gpu PATH` takes it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import published_runs  # noqa: E402  bench/published_runs.py

from ptdp.perf.calibrate.gpu import fit_tile_model  # noqa: E402
from ptdp.perf.calibrate.calibration_point import efficiency_at_median_ratio_one  # noqa: E402
from ptdp.perf.price.profiles import HardwareProfile, builtin_profile, save_profile  # noqa: E402

# ptdp's own operators of each planner class, as the sweep names them (the
# eager bias + GeLU and the two AdamW kernels alone are not what ptdp runs
# in a layer or a step).
PTDP_OPERATORS = {
    "elementwise": ("copy", "add (x + y)"),
    "gelu": ("bias + GeLU, ptdp fused", "SwiGLU, ptdp fused"),
    "layer_norm": ("LayerNorm", "RMSNorm"),
    "attention_core": ("softmax",),
    "residual": ("dropout", "bias + dropout + add, ptdp fused"),
    "optimizer": ("optimizer step, ptdp (fp32 state, bf16 model)",),
}


def _measured(entry: dict[str, Any] | None) -> bool:
    return bool(entry) and "seconds" in entry and entry["seconds"] > 0


def gemm_fit(sweep: dict[str, Any], base: HardwareProfile) -> dict[str, Any]:
    """(overhead, e_max) of the tile model over the sweep's bf16 GEMMs, and
    e_max under sustained load."""
    rows = [{"m": case["m"], "n": case["n"], "k": case["k"], "seconds": case["bf16"]["seconds"]}
            for case in sweep["gemm"]["rows"] if _measured(case.get("bf16"))]
    overhead, e_max = fit_tile_model(rows, base.peak_flops("bf16"), base.sm_count,
                                     base.gemm_tile, base.memory_bandwidth)
    sustained = sweep.get("sustained") or {}
    factor = min(1.0, sustained.get("last_over_first", 1.0))
    return {"gemms": len(rows), "tile_overhead_seconds": overhead, "burst_e_max": e_max,
            "sustained_factor": factor, "gemm_efficiency": e_max * factor}


def bandwidth_fit(sweep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per planner class: ptdp's operators at their largest measured size,
    the planner's bytes over the measured seconds (each, and all together)."""
    largest: dict[str, dict[str, Any]] = {}
    for row in sweep["memory"]["rows"]:
        if not _measured(row):
            continue
        name = row["op"].split(" (rows of")[0]
        if name not in largest or row["elements"] > largest[name]["elements"]:
            largest[name] = row
    fitted = {}
    for op_class, names in PTDP_OPERATORS.items():
        rows = {name: largest[name] for name in names if name in largest}
        if not rows:
            continue
        fitted[op_class] = {
            "bandwidth": sum(r["planner_bytes"] for r in rows.values())
            / sum(r["seconds"] for r in rows.values()),
            "operators": {name: r["planner_bytes"] / r["seconds"] for name, r in rows.items()}}
    return fitted


def attention_fit(sweep: dict[str, Any], base: HardwareProfile,
                  kernel: str = "") -> dict[str, Any] | None:
    """The flash blocks' fraction of the per-SM peak (`attention_efficiency`)
    for which the profile's attention times, forward and backward of every
    measured call, are too fast as often as too slow (their median ratio to
    the measurements is 1; bisection: times fall as the fraction rises).
    `kernel`: "" for the kernel PyTorch picks (ptdp's), "cudnn" for cuDNN's
    (the published rows')."""
    prefix = f"{kernel}_" if kernel else ""
    rows = [r for r in (sweep.get("attention") or {}).get("rows", [])
            if r.get(f"{prefix}forward_s") and r.get(f"{prefix}backward_s")]
    if not rows:
        return None

    def ratios(efficiency: float) -> list[float]:
        profile = dataclasses.replace(base, attention_efficiency=efficiency)
        out = []
        for r in rows:
            forward, backward = profile.attention_seconds(r["heads"], r["seq"], r["head_dim"])
            out += [forward / r[f"{prefix}forward_s"], backward / r[f"{prefix}backward_s"]]
        return out

    efficiency = efficiency_at_median_ratio_one(ratios, tolerance=1e-6)
    return {"calls": len(rows), "attention_efficiency": efficiency,
            "median_ratio": statistics.median(ratios(efficiency))}


def launch_fit(sweep: dict[str, Any]) -> float | None:
    rows = [row for row in sweep["launch"]["rows"] if "calibrate" in row["what"] and
            _measured(row)]
    return rows[0]["seconds"] if rows else None


def fitted_profile(report: dict[str, Any], name: str = "h200") -> tuple[HardwareProfile, dict]:
    """The built-in `name` profile with the sweep's numbers, and the fit's details."""
    sweep = report["kernels_sweep"]
    if not sweep or sweep.get("crashed") or not sweep.get("gemm"):
        raise ValueError("the report has no kernel sweep to fit (run bench/gpu.py on a GPU, "
                         "with --json)")
    base = builtin_profile(name)
    gemm = gemm_fit(sweep, base)
    bandwidths = bandwidth_fit(sweep) if sweep.get("memory") else {}
    launch = launch_fit(sweep) if sweep.get("launch") else None
    # The flash blocks share the GEMMs' fixed cost per tile: fit them with it.
    tiled = dataclasses.replace(base, tile_overhead_seconds=gemm["tile_overhead_seconds"])
    attention = attention_fit(sweep, tiled)
    cudnn_attention = attention_fit(sweep, tiled, "cudnn")
    changes: dict[str, Any] = {
        "gemm_efficiency": gemm["gemm_efficiency"],
        "tile_overhead_seconds": gemm["tile_overhead_seconds"],
        "op_bandwidth": {c: fit["bandwidth"] for c, fit in bandwidths.items()}}
    if launch is not None:
        changes["launch_overhead"] = launch
    if attention is not None:
        changes["attention_efficiency"] = attention["attention_efficiency"]
    profile = dataclasses.replace(
        base, name=f"{name}-measured", **changes,
        notes=f"{base.notes}; GEMM tile model, memory-bound classes and launches fitted to "
              f"bench/gpu.py's kernel sweep on {sweep.get('device_name')} "
              f"(bench/fit_gpu_profile.py)")
    return profile, {"gemm": gemm, "bandwidth": bandwidths, "launch": launch,
                     "attention": attention, "cudnn_attention": cudnn_attention}


def report_text(base: HardwareProfile, profile: HardwareProfile, details: dict) -> str:
    gemm = details["gemm"]
    lines = [f"GEMMs ({gemm['gemms']} bf16 shapes): e_max {gemm['burst_e_max']:.4f} burst, "
             f"x {gemm['sustained_factor']:.3f} sustained = {profile.gemm_efficiency:.4f} "
             f"(built in: {base.gemm_efficiency:.4f}); tile overhead "
             f"{profile.tile_overhead_seconds * 1e6:.2f} µs (built in: "
             f"{base.tile_overhead_seconds * 1e6:.2f})"]
    for op_class, fit in details["bandwidth"].items():
        each = ", ".join(f"{name} {bw / 1e9:.0f}" for name, bw in fit["operators"].items())
        lines.append(f"{op_class}: {fit['bandwidth'] / 1e9:.0f} GB/s of the planner's bytes "
                     f"({fit['bandwidth'] / base.memory_bandwidth:.0%} of "
                     f"{base.memory_bandwidth / 1e9:.0f}; {each})")
    if details.get("attention"):
        att = details["attention"]
        lines.append(f"attention ({att['calls']} calls): flash blocks at "
                     f"{att['attention_efficiency']:.4f} of the per-SM peak (built in: "
                     + (f"{base.attention_efficiency:.4f}, FlashAttention-2's published rate)"
                        if base.attention_efficiency else f"e_max, {base.gemm_efficiency:.4f})"))
    if details.get("cudnn_attention"):
        att = details["cudnn_attention"]
        lines.append(f"cuDNN's attention ({att['calls']} calls, the published rows' kernel): "
                     f"flash blocks at {att['attention_efficiency']:.4f} of the per-SM peak "
                     f"(built in, from the FlashAttention-3 paper's H100 benchmarks: "
                     f"{published_runs.HOPPER_ATTENTION_EFFICIENCY['cudnn']:.4f})")
    if details["launch"] is not None:
        lines.append(f"launch: {details['launch'] * 1e6:.2f} µs per operator (built in: "
                     f"{base.launch_overhead * 1e6:.2f})")
    return "\n".join(lines)


def priced_with(profile: HardwareProfile, runs: list | None = None,
                cudnn_attention: float | None = None) -> str:
    """bench/published_runs.py's rows (`runs`, default all) and ptdp's own,
    with `profile` standing for the h100 and the h200 (same compute; the
    h100 keeps its own memory bandwidth and size); the published rows'
    attention at `cudnn_attention` (cuDNN's measured fraction) where given."""
    h100 = dataclasses.replace(profile, name="h100",
                               memory_bandwidth=builtin_profile("h100").memory_bandwidth,
                               memory_bytes=builtin_profile("h100").memory_bytes)
    profiles = {"h100": h100, "h200": profile}
    original, rates = published_runs.load_profile, published_runs.HOPPER_ATTENTION_EFFICIENCY

    def load(name: str) -> HardwareProfile:
        return profiles.get(name) or original(name)

    published_runs.load_profile = load
    if cudnn_attention is not None:
        published_runs.HOPPER_ATTENTION_EFFICIENCY = {**rates, "cudnn": cudnn_attention}
    try:
        priced = [published_runs.price(run) for run in runs or published_runs.RUNS
                  if run.priced]
        errors = [abs(p.error) for p in priced if not p.run.calibration]
        return (published_runs.validation_table(priced) + "\n\n"
                + f"{sum(e <= 0.10 for e in errors)} of {len(errors)} published rows within "
                  f"10 %, median |error| {statistics.median(errors):.1%}")
    finally:
        published_runs.load_profile = original
        published_runs.HOPPER_ATTENTION_EFFICIENCY = rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="bench/gpu.py's --json output")
    parser.add_argument("--profile", default="h200", help="the built-in profile fitted (h200)")
    parser.add_argument("--out", help="write the fitted profile as JSON here")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    profile, details = fitted_profile(report, args.profile)
    print(report_text(builtin_profile(args.profile), profile, details))
    print()
    cudnn = details.get("cudnn_attention")
    print(priced_with(profile, cudnn_attention=cudnn["attention_efficiency"] if cudnn else None))
    if args.out:
        save_profile(profile, args.out)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
