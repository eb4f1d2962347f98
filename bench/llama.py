"""Training throughput of a GPT and a Llama-style model of the same width and
depth, side by side in one run (CPU, one process, fp32).

Both models are built in this process and their training steps alternate
(GPT, Llama, GPT, ...), so that the machine's noise falls on both alike; the
median step time of each gives its tokens/s, and the ratio is the figure to
read. The Llama-style model has RMSNorm, a SwiGLU MLP of Megatron-LM's
default width (int(4h·2/3/64)·64, which keeps the MLP's parameters near
GPT's 8h²), rotary embeddings, grouped-query attention (a/4 key/value
heads), an untied output layer and no linear biases.

    python bench/llama.py                 # l=8 h=256 a=8 s=256 V=8192 b=4 B=8, 6 steps each
    python bench/llama.py --write         # also append the table to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import time

import torch

from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.parallel.topology import ParallelContext
from ptdp.train.banner import count_parameters
from ptdp.train.loop import Trainer
from ptdp.perf.analytic.flops import model_flops_per_iteration

HEADING = "## GPT and Llama-style model, same width and depth (CPU, one process)"


def models(args: argparse.Namespace) -> dict[str, ModelConfig]:
    gpt = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0,
                      attention_dropout=0.0)
    llama = dataclasses.replace(gpt, normalization="RMSNorm", swiglu=True,
                                position_embedding_type="rope", group_query_attention=True,
                                num_query_groups=max(1, args.heads // 4),
                                untie_embeddings_and_output_weights=True, disable_bias_linear=True)
    return {"GPT": gpt, "Llama-style": llama}


def trainer(model: ModelConfig, args: argparse.Namespace) -> Trainer:
    config = Config(model=model, parallel=ParallelConfig(),
                    train=TrainConfig(micro_batch_size=args.micro_batch, global_batch_size=args.batch,
                                      train_iters=args.warmup + args.steps, seed=5),
                    data=DataConfig(mock_data=True))
    return Trainer(config, ParallelContext.single(), torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()

    configs = models(args)
    trainers = {name: trainer(model, args) for name, model in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for step in range(args.warmup + args.steps):
        for name, run in trainers.items():
            start = time.perf_counter()
            run.step(step)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)

    tokens = args.batch * args.seq
    rows, rates, flop_rates = [], {}, {}
    for name, model in configs.items():
        median = statistics.median(times[name])
        rates[name] = tokens / median
        params = sum(count_parameters(chunk) for chunk in trainers[name].chunks)
        flops = model_flops_per_iteration(model, args.batch, recompute=None)
        flop_rates[name] = flops / median
        rows.append(f"| {name} | {params / 1e6:.2f} M | {model.ffn_size} | "
                    f"{flops / tokens / 1e6:.1f} | {median * 1e3:.0f} | {rates[name]:,.0f} | "
                    f"{flop_rates[name] / 1e9:.1f} |")
    ratio = rates["Llama-style"] / rates["GPT"]
    flop_ratio = flop_rates["Llama-style"] / flop_rates["GPT"]
    a = args.heads
    block = "\n".join([
        f"### {datetime.date.today()}: l={args.layers}, h={args.hidden}, a={a}, s={args.seq}, "
        f"V={args.vocab}, b={args.micro_batch}, B={args.batch}, fp32, {torch.get_num_threads()} "
        f"threads, {cpu_name()}",
        "",
        f"Llama-style: RMSNorm, SwiGLU, rope, {max(1, a // 4)} key/value groups for {a} heads, "
        f"untied output, no biases. Median of {args.steps} alternating steps each, after "
        f"{args.warmup} warm-up steps. Command: `python bench/llama.py"
        + (" --write`" if args.write else "`") + ".",
        "",
        "| model | parameters | ffn | model FLOPs per token (M) | step (ms) | tokens/s | "
        "model GFLOP/s |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Llama-style / GPT tokens/s: **{ratio:.2f}**; model FLOP/s: {flop_ratio:.2f}. The model "
        f"FLOPs count matrix products only; the Llama-style model's element-wise work (RMSNorm, "
        f"which runs as several fp32 passes on a CPU, the rotations of q and k, SwiGLU's gate) "
        f"is not in them, so its FLOP/s is lower for the same kernels.",
        "",
    ])
    publish(HEADING, block, write=args.write)


if __name__ == "__main__":
    main()
