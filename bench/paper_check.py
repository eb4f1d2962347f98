"""The planner against the paper's largest run, and how fast it searches.

1. A check, not a fit: the paper reports 502 PFLOP/s on 3072 A100s for its
   1T-parameter GPT (l = 128, h = 25600, a = 160, s = 2048, V = 51200;
   t = 8, p = 64, b = 1, B = 3072, full recomputation), 163 TFLOP/s per GPU.
   The a100 profile is fitted to the paper's 1.7B point only
   (ptdp/perf/profiles.py); this prints what it predicts for the 1T layout,
   priced with the paper's kernels (cost.paper_kernels: attention as GEMMs
   and a softmax pass, as the 1.7B point is) and, for reference, with
   ptdp's (flash attention). Nothing is tuned to it. PAPER.md does not say
   whether the 1T run used the interleaved schedule: both are shown.
2. The README's planner example (39B GPT on 64 A100s, B = 512): the search's
   time, and the exhaustive search's (every layout priced) with its winner,
   which must be the same.

    python bench/paper_check.py            # both (the exhaustive search takes minutes)
    python bench/paper_check.py --write    # and append the tables to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results import cpu_name, publish  # noqa: E402  bench/results.py

from ptdp.config import ModelConfig  # noqa: E402
from ptdp.perf.calibration_point import paper_kernels  # noqa: E402
from ptdp.perf.layout import Layout, Workload  # noqa: E402
from ptdp.perf.plan import describe, search  # noqa: E402
from ptdp.perf.predict import simulate  # noqa: E402
from ptdp.perf.profiles import load_profile  # noqa: E402

PAPER_TFLOPS = 163.0   # 502 PFLOP/s over 3072 GPUs
GPT_1T = ModelConfig(num_layers=128, hidden_size=25600, num_attention_heads=160,
                     seq_length=2048, vocab_size=51200)
GPT_39B = ModelConfig(num_layers=48, hidden_size=8192, num_attention_heads=64, seq_length=2048,
                      vocab_size=51200)


def trillion_check() -> str:
    workload = Workload(GPT_1T, 3072, "fp16")
    a100 = load_profile("a100")
    lines = ["| schedule | kernels | s/iter | TFLOP/s per GPU | vs the paper's 163 |",
             "|---|---|---:|---:|---:|"]
    for name, layout in (("1F1B", Layout(t=8, p=64, d=6, b=1, recompute="full")),
                         ("interleaved, v = 2", Layout(t=8, p=64, d=6, b=1, v=2,
                                                       recompute="full"))):
        for kernels, profile in (("the paper's", paper_kernels(a100)),
                                 ("ptdp's (flash attention)", a100)):
            prediction = simulate(workload, layout, profile)
            tflops = prediction.tflops_per_device
            lines.append(f"| {name} | {kernels} | {prediction.iteration_seconds:.1f} | "
                         f"{tflops:.1f} | {tflops / PAPER_TFLOPS - 1:+.1%} |")
    return "\n".join(lines)


def search_speed(exhaustive: bool) -> str:
    workload, a100 = Workload(GPT_39B, 512), load_profile("a100")
    start = time.perf_counter()
    pruned = search(workload, 64, a100)
    seconds = time.perf_counter() - start
    lines = [f"Search (`ptdp plan`'s, cold caches): {seconds:.2f} s, {len(pruned)} layouts "
             f"priced; winner {describe(pruned[0].layout, GPT_39B)} at "
             f"{pruned[0].tflops:.1f} TFLOP/s per GPU."]
    if exhaustive:
        start = time.perf_counter()
        everything = search(workload, 64, a100, exhaustive=True)
        full = time.perf_counter() - start
        same = [e.layout for e in everything[:30]] == [e.layout for e in pruned[:30]]
        lines.append(f"Every layout priced: {full:.0f} s, {len(everything)} layouts that fit; "
                     f"winner {describe(everything[0].layout, GPT_39B)}; the first 30 rows "
                     + ("are the same." if same else "DIFFER."))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    parser.add_argument("--no-exhaustive", action="store_true",
                        help="skip pricing every layout (minutes)")
    args = parser.parse_args()
    check = trillion_check()
    speed = search_speed(not args.no_exhaustive)
    stamp = time.strftime("%Y-%m-%d")
    publish("## The planner against the paper's 1T run",
            f"### {stamp}\n\nCommand: `python bench/paper_check.py`; profile a100 (e_max fitted "
            f"to the 1.7B point only); 1T GPT, t = 8, p = 64, d = 6, b = 1, B = 3072, full "
            f"recomputation, fp16.\n\n{check}\n", write=args.write)
    publish("## Planner search time",
            f"### {stamp}\n\nCommand: `python bench/paper_check.py`; {cpu_name()}; the README's "
            f"39B GPT on 64 A100s, B = 512.\n\n{speed}\n", write=args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
