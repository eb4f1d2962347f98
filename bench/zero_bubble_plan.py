"""The planner's predictions for the paper's largest layouts under 1F1B,
interleaved 1F1B, zb-h1 and zbv (issue 14): predictions of ptdp's
performance model on the `a100` profile, not measurements.

The layouts are the paper's weak-scaling runs of 145.6B to 1008B parameters
(Narayanan et al. 2021, Table 1: s = 2048, V = 51200, t = 8, p as listed,
batch as listed, on DGX A100 80 GB servers), with b = 1, full activation
recomputation (as the paper used at these sizes), no sequence parallelism
and no distributed optimizer (neither existed then). Interleaving uses v = 2
chunks per rank, v = 3 for the 530B model (3 layers per rank: v = 2 cannot
split them); zbv needs l divisible by 2p, which 105 layers on 35 ranks are
not, so it has no 530B row.

    .venv/bin/python bench/zero_bubble_plan.py            # markdown table (about 40 seconds)
    .venv/bin/python bench/zero_bubble_plan.py --json
"""

from __future__ import annotations

import argparse
import json
import time

from ptdp.config import ModelConfig
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.plan.planner import MEMORY_HEADROOM, evaluate_layout
from ptdp.perf.price.profiles import load_profile

# name: (layers, hidden, heads, p, GPUs, global batch, interleaved v)
PAPER = {"145B": (80, 12288, 96, 8, 1536, 2304, 2),
         "310B": (96, 16384, 128, 16, 1920, 2160, 2),
         "530B": (105, 20480, 128, 35, 2520, 2520, 3),
         "1T": (128, 25600, 160, 64, 3072, 3072, 2)}
T = 8


def layouts(name: str) -> dict[str, Layout]:
    layers, _, _, p, gpus, _, v = PAPER[name]
    common = dict(t=T, p=p, d=gpus // (T * p), b=1, recompute="full")
    out = {"1f1b": Layout(**common), f"interleaved v={v}": Layout(v=v, **common),
           "zb-h1": Layout(schedule="zb-h1", **common)}
    if layers % (2 * p) == 0:
        out["zbv"] = Layout(v=2, schedule="zbv", **common)
    return out


def run(profile_name: str = "a100") -> list[dict]:
    profile = load_profile(profile_name)
    rows = []
    for name, (layers, hidden, heads, p, gpus, batch, _) in PAPER.items():
        model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            seq_length=2048, vocab_size=51200)
        workload = Workload(model, batch)
        for schedule, layout in layouts(name).items():
            started = time.perf_counter()
            e = evaluate_layout(workload, layout, profile)
            rows.append({"model": name, "gpus": gpus, "t": T, "p": p, "d": layout.d,
                         "m": e.prediction.microbatches, "schedule": schedule,
                         "iteration_seconds": e.seconds, "tflops_per_gpu": e.tflops,
                         "bubble_fraction": e.prediction.bubble_fraction,
                         "memory_gib": e.memory["total"] / 2**30,
                         "fits": e.memory["total"] <= MEMORY_HEADROOM * profile.memory_bytes,
                         "seconds_to_predict": time.perf_counter() - started})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | GPUs (t, p, d, m) | schedule | s/iteration | TFLOP/s per GPU | bubble | "
             "GiB per GPU | zb-h1 / zbv gain vs this |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        same = {r["schedule"]: r["iteration_seconds"] for r in rows if r["model"] == row["model"]}
        gains = ""
        if not row["schedule"].startswith("zb"):
            gains = " / ".join(f"{row['iteration_seconds'] / same[k] - 1:+.1%}" if k in same
                               else "n/a" for k in ("zb-h1", "zbv"))
        lines.append(f"| {row['model']} | {row['gpus']} ({row['t']}, {row['p']}, {row['d']}, "
                     f"{row['m']}) | {row['schedule']} | {row['iteration_seconds']:.2f} | "
                     f"{row['tflops_per_gpu']:.1f} | {row['bubble_fraction']:.3f} | "
                     f"{row['memory_gib']:.1f}{'' if row['fits'] else ' (does not fit)'} | "
                     f"{gains} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="a100", help="profile (default: a100)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.gpu)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
