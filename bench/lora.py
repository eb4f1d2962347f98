"""LoRA against full fine-tuning of the same model on this CPU (issue 41):
peak memory and tokens/s, one process and d = 2 (local processes over
gloo), and the memory model's trainable/frozen split against the bytes a
Trainer really holds.

Each run is a fresh launch (`ptdp.launch.launch_local`), so each process's
peak resident memory (getrusage's ru_maxrss) is its own run's; the runs of
the two modes alternate (the order swapped every other pair), and each
figure is quoted with the machine's 1-minute load average at its start
(os.getloadavg), as this machine is shared. Per run: the median step time
after a warm-up step, tokens/s (global batch × s over it), the largest
rank's peak RSS, and per rank 0 the measured state — the frozen base's
bytes (parameters outside the buffer), the buffer's weights, its fp32
gradients (and shard) and the optimizer's state — against
ptdp.perf.analytic.memory.memory_per_rank's (weights = frozen + adapters).

    .venv/bin/python bench/lora.py [--write]          # the figures in RESULTS.md
    .venv/bin/python bench/lora.py --layers 1 --hidden 32 --steps 2 --pairs 1   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import cpu_name, publish  # noqa: E402  bench/results.py

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from ptdp.config.lora import LoRAConfig  # noqa: E402
from ptdp.distributed import init_process_group  # noqa: E402
from ptdp.launch import launch_local  # noqa: E402
from ptdp.parallel.topology import ParallelContext, RankGrid  # noqa: E402
from ptdp.perf.analytic.memory import memory_per_rank  # noqa: E402
from ptdp.perf.fits import layout_of, workload_of  # noqa: E402
from ptdp.train.loop import Trainer  # noqa: E402

MODES = ("full", "lora")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=8, help="the adapters' rank (all four targets)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (after one warm-up)")
    p.add_argument("--pairs", type=int, default=2, help="alternating full/LoRA pairs per d")
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    return p


def config_for(args, mode: str, d: int) -> Config:
    model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                        num_attention_heads=args.heads, seq_length=args.seq,
                        vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    return Config(model=model, parallel=ParallelConfig(data_parallel_size=d),
                  lora=LoRAConfig(lora_rank=args.rank if mode == "lora" else 0, lora_alpha=16),
                  train=TrainConfig(micro_batch_size=args.micro_batch,
                                    global_batch_size=args.micro_batch * d, bf16=True,
                                    use_distributed_optimizer=d > 1,
                                    train_iters=args.steps + 1, seed=1),
                  data=DataConfig(mock_data=True))


def _run(env, payload):
    args, mode, d, out = payload
    torch.set_num_threads(1)
    if d > 1:
        init_process_group(env, "gloo", timedelta(minutes=10))
    ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=1)) if d > 1 else ParallelContext.single()
    config = config_for(args, mode, d)
    trainer = Trainer(config, ctx, torch.device("cpu"))
    seconds = []
    for iteration in range(args.steps + 1):
        start = time.perf_counter()
        trainer.step(iteration)
        seconds.append(time.perf_counter() - start)
    buffer = trainer.buffer
    measured = {
        "frozen": sum(p.numel() * p.element_size() for p in trainer.model.parameters()
                      if not p.requires_grad),
        "weights": buffer.param_data.nbytes,
        "gradients": buffer.grad_data.nbytes + (buffer.grad_shard.nbytes
                                                if buffer.grad_shard is not None else 0),
        "optimizer": trainer.optimizer.state_bytes}
    measured["weights"] += measured["frozen"]
    predicted = memory_per_rank(workload_of(config), layout_of(config), kernels="cpu",
                                bucket_size=config.train.ddp_bucket_size)[0]
    Path(out, f"{env.rank}.json").write_text(json.dumps({
        "seconds": seconds[1:], "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "measured": measured, "predicted": predicted,
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}))


def measure(args, mode: str, d: int) -> dict:
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        launch_local(d, _run, (args, mode, d, out))
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(d)]
    step = statistics.median(max(r["seconds"][i] for r in ranks)
                             for i in range(len(ranks[0]["seconds"])))
    return dict(mode=mode, d=d, load=load, step=step,
                tokens_per_s=args.micro_batch * d * args.seq / step,
                peak_rss=max(r["peak_rss"] for r in ranks), **{k: ranks[0][k] for k in (
                    "measured", "predicted", "trainable")})


def run_all(args) -> list[dict]:
    runs = []
    for d in (1, 2):
        for pair in range(args.pairs):
            for mode in (MODES if pair % 2 == 0 else MODES[::-1]):
                runs.append(measure(args, mode, d))
    return runs


def _mib(count: float) -> str:
    return f"{count / 2**20:.1f}"


def table(args, runs: list[dict]) -> str:
    lines = [f"### {datetime.date.today()}", "",
             f"Command: `{' '.join(['python', Path(sys.argv[0]).as_posix()] + sys.argv[1:])}` — GPT {args.layers} × "
             f"{args.hidden}, s {args.seq}, vocab {args.vocab}, bf16, b {args.micro_batch} per "
             f"rank, LoRA rank {args.rank} on all four targets; d = 2 with the distributed "
             f"optimizer; {cpu_name()}, {os.cpu_count()} cores (shared), 1 thread a process", "",
             "| d | mode | load (1 min) | step s | tokens/s | peak RSS MiB (largest rank) | "
             "state MiB measured (frozen + weights, grads, optimizer) | predicted | "
             "trainable params |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        m, p = run["measured"], run["predicted"]
        state_m = m["weights"] + m["gradients"] + m["optimizer"]
        state_p = p["weights"] + p["gradients"] + p["optimizer"]
        lines.append(
            f"| {run['d']} | {run['mode']} | {run['load']:.1f} | {run['step']:.3f} | "
            f"{run['tokens_per_s']:,.0f} | {_mib(run['peak_rss'])} | {_mib(state_m)} "
            f"({_mib(m['frozen'])} frozen + {_mib(m['weights'] - m['frozen'])}, "
            f"{_mib(m['gradients'])}, {_mib(m['optimizer'])}) | {_mib(state_p)} "
            f"({'exact' if state_p == state_m else f'{state_p / state_m - 1:+.1%}'}) | "
            f"{run['trainable']:,} |")
    for d in (1, 2):
        by_mode = {mode: [r for r in runs if r["d"] == d and r["mode"] == mode] for mode in MODES}
        speed = (statistics.median(r["tokens_per_s"] for r in by_mode["lora"])
                 / statistics.median(r["tokens_per_s"] for r in by_mode["full"]))
        rss = (statistics.median(r["peak_rss"] for r in by_mode["lora"])
               / statistics.median(r["peak_rss"] for r in by_mode["full"]))
        state = (by_mode["lora"][0]["predicted"]["total"] - by_mode["lora"][0]["predicted"][
            "activations"]) / (by_mode["full"][0]["predicted"]["total"]
                               - by_mode["full"][0]["predicted"]["activations"])
        lines.append(f"\nd = {d}: LoRA / full tokens/s {speed:.2f}×, peak RSS {rss:.2f}×, "
                     f"state bytes {state:.2f}× (the model's)")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parser().parse_args()
    runs = run_all(args)
    publish("## LoRA against full fine-tuning", table(args, runs), write=args.write)


if __name__ == "__main__":
    main()
