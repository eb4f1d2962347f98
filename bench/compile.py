"""--compile against eager: a Llama-style model's training step with each
layer's element-wise work compiled (ptdp.model.compiled) and without, in the
same processes, alternating, one process and t = 2 with sequence
parallelism (CPU, fp32, gloo).

Every side is built in the same processes from the same seed and trains on
the same batches; the sides' steps alternate ABBA after warm-up steps (the
first compiled steps pay the compilation, reported on its own). Sides:

* eager: ptdp as without --compile;
* pieces: --compile, the pure-computation pieces between the collectives;
* layers: each TransformerLayer's forward compiled whole with
  torch.compile (torchtitan's way), the collectives graph breaks; the
  alternative --compile did not take, measured here to compare.

Each row's losses must agree with eager's (relative 1e-4) for its times to
count. The load average before and after each row is recorded with it.

    python bench/compile.py            # l=8 h=256 a=8 s=128 V=8192 b=2 B=8, 10 steps per side
    python bench/compile.py --write    # also append the table to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from local_job import free_port  # noqa: E402
from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig

HEADING = "## --compile: compiled layer pieces against eager (CPU, Llama-style)"
SIDES = ("eager", "pieces", "layers")


def llama(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.heads, seq_length=args.seq, vocab_size=args.vocab,
                       hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                       swiglu=True, position_embedding_type="rope", group_query_attention=True,
                       num_query_groups=max(1, args.heads // 4),
                       untie_embeddings_and_output_weights=True, disable_bias_linear=True)


def config(model: ModelConfig, t: int, args: argparse.Namespace, compile: bool) -> Config:
    return Config(model=model,
                  parallel=ParallelConfig(tensor_model_parallel_size=t, sequence_parallel=t > 1),
                  train=TrainConfig(micro_batch_size=args.micro_batch, global_batch_size=args.batch,
                                    train_iters=args.warmup + args.steps, seed=5, compile=compile),
                  data=DataConfig(mock_data=True))


def compile_whole_layers(trainer) -> None:
    """torchtitan's way: each TransformerLayer's forward compiled as a whole."""
    from ptdp.model.gpt import TransformerLayer

    for chunk in trainer.chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                module.compile()


def run_sides(t: int, args: argparse.Namespace) -> dict:
    """This rank's times and losses of every side (a process group of t ranks started)."""
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    ctx = ParallelContext.single() if t == 1 else ParallelContext.build(RankGrid(tp=t, dp=1, pp=1))
    model = llama(args)
    trainers = {"eager": Trainer(config(model, t, args, False), ctx, torch.device("cpu")),
                "pieces": Trainer(config(model, t, args, True), ctx, torch.device("cpu"))}
    layers = Trainer(config(model, t, args, False), ctx, torch.device("cpu"))
    compile_whole_layers(layers)
    trainers["layers"] = layers
    times = {side: [] for side in trainers}
    losses = {side: [] for side in trainers}
    first = {}
    for iteration in range(args.warmup + args.steps):
        order = list(trainers) if iteration % 2 == 0 else list(trainers)[::-1]  # ABBA
        for side in order:
            if t > 1:
                dist.barrier()
            start = time.perf_counter()
            try:
                record = trainers[side].step(iteration)[0]
            except Exception as error:  # noqa: BLE001 - a side that cannot run is reported
                times[side] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                trainers = {name: run for name, run in trainers.items() if name != side}
                continue
            if t > 1:
                dist.barrier()
            elapsed = time.perf_counter() - start
            if iteration == 0:
                first[side] = elapsed
            elif iteration >= args.warmup:
                times[side].append(elapsed)
            losses[side].append(record["loss"])
    return {"times": times, "losses": losses, "first": first}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = run_sides(world, args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_row(t: int, args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    if t == 1:
        torch.set_num_threads(args.threads)
        result = run_sides(1, args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(_worker, args=(t, free_port(), args, out), nprocs=t, join=True,
                               start_method="spawn")
            result = json.loads(Path(out).read_text())
    result["load"] = (load_before, os.getloadavg())
    return result


def row_lines(name: str, result: dict) -> list[str]:
    times, losses = result["times"], result["losses"]
    if isinstance(times["eager"], str):
        return [f"| {name} | eager | failed: {times['eager']} | | | |"]
    eager = statistics.median(times["eager"])
    lines = []
    for side in SIDES:
        got = times.get(side)
        if isinstance(got, str) or not got:
            lines.append(f"| {name} | {side} | failed: {got} | | | |")
            continue
        median = statistics.median(got)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses[side], losses["eager"]))
        agrees = "yes" if worst <= 1e-4 else f"NO ({worst:.1e})"
        lines.append(f"| {name} | {side} | {median * 1e3:.0f} ({min(got) * 1e3:.0f}–"
                     f"{max(got) * 1e3:.0f}) | {eager / median:.2f} | "
                     f"{result['first'].get(side, 0.0):.1f} | {agrees} |")
    before, after = result["load"]
    lines.append(f"| {name} | load | {before[0]:.2f} before, {after[0]:.2f} after | | | |")
    return lines


def piece_cases(args: argparse.Namespace) -> dict:
    """Each compiled piece at the model's shapes: (eager function, the
    piece, its inputs' shapes, the piece's arguments from the inputs)."""
    import torch.nn.functional as F

    from ptdp.model import compiled
    from ptdp.model.fused import swiglu
    from ptdp.model.rotary import Rotary, rotate

    model = llama(args)
    s, b, h, d = args.seq, args.micro_batch, args.hidden, model.head_dim
    heads, groups = args.heads, model.query_groups
    cos, sin = Rotary(d, 10000.0).tables(s, torch.device("cpu"), torch.float32)
    weight = torch.ones(h, requires_grad=True)

    def residual_norm(out, residual):
        x = residual + out
        return x, F.rms_norm(x, (h,), weight, 1e-5)

    return {
        "RMSNorm": (lambda x: F.rms_norm(x, (h,), weight, 1e-5), compiled._rms_norm,
                    [(s, b, h)], lambda x: (x, weight, 1e-5)),
        "residual add + RMSNorm": (residual_norm, compiled._residual_norm, [(s, b, h)] * 2,
                                   lambda out, residual: (out, None, residual, weight, None, 1e-5)),
        "rotary q and k": (lambda q, k: (rotate(q, cos, sin, d), rotate(k, cos, sin, d)),
                           compiled._rotate_queries_and_keys, [(b, heads, s, d), (b, groups, s, d)],
                           lambda q, k: (q, k, cos, sin, d, None)),
        "SwiGLU": (swiglu, compiled._gated_unit, [(s, b, 2 * model.ffn_size)],
                   lambda y: (y, "silu", 0.0, None)),
    }


def time_pieces(args: argparse.Namespace, repeats: int = 40) -> list[str]:
    """Forward + backward of each piece, eager and compiled, alternating (one
    thread); the inputs are made before each timing."""
    torch.set_num_threads(args.threads)
    lines = []
    for name, (eager, piece, shapes, piece_args) in piece_cases(args).items():
        compiled_piece = torch.compile(piece, fullgraph=True)
        sides = {"eager": lambda *xs: eager(*xs),
                 "compiled": lambda *xs: compiled_piece(*piece_args(*xs))}
        times: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(repeats + 3):
            for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                inputs = [torch.randn(*shape, requires_grad=True) for shape in shapes]
                start = time.perf_counter()
                out = sides[side](*inputs)
                sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
                if i >= 3:
                    times[side].append(time.perf_counter() - start)
        eager_ms, compiled_ms = (statistics.median(times[side]) * 1e3 for side in sides)
        lines.append(f"| {name} | {eager_ms:.3f} | {compiled_ms:.3f} | "
                     f"{eager_ms / compiled_ms:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument("--tensor", type=int, nargs="+", default=[1, 2],
                        help="the rows' tensor-parallel sizes (1: one process)")
    parser.add_argument("--threads", type=int, default=1,
                        help="the one-process row's threads (default 1, as each rank of t = 2 "
                             "on two cores; more threads thrash on a loaded machine)")
    parser.add_argument("--pieces", action="store_true",
                        help="also time each compiled piece alone against its eager form")
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()

    load_before = os.getloadavg()
    pieces = time_pieces(args) if args.pieces else []
    pieces_load = (load_before, os.getloadavg())
    rows = []
    for t in args.tensor:
        name = "one process" if t == 1 else f"t = {t}, sequence parallel"
        rows += row_lines(name, run_row(t, args))
    a = args.heads
    command = ("python bench/compile.py" + (" --pieces" if args.pieces else "")
               + (" --write" if args.write else ""))
    block = "\n".join([
        f"### {datetime.date.today()}: Llama-style l={args.layers}, h={args.hidden}, a={a}, "
        f"s={args.seq}, V={args.vocab}, b={args.micro_batch}, B={args.batch}, fp32, "
        f"{args.threads} thread(s) in one process and 1 per rank at t = 2, torch "
        f"{torch.__version__}, {cpu_name()} ({os.cpu_count()} cores)",
        "",
        f"RMSNorm, SwiGLU, rope, {max(1, a // 4)} key/value groups, untied output, no biases. "
        f"Median step of {args.steps} alternating (ABBA) steps per side after {args.warmup} "
        f"warm-up steps; the first step (compilation included) on its own. Command: "
        f"`{command}`.",
        "",
        "| layout | side | step (ms, range) | eager / side | first step (s) | losses = eager |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ] + ([
        f"Each piece alone at these shapes (one microbatch's, one layer), forward + backward, "
        f"median of 40 alternating calls (load {pieces_load[0][0]:.2f} before, "
        f"{pieces_load[1][0]:.2f} after):",
        "",
        "| piece | eager (ms) | compiled (ms) | eager / compiled |",
        "|---|---|---|---|",
        *pieces,
        "",
    ] if pieces else []))
    publish(HEADING, block, write=args.write)


if __name__ == "__main__":
    main()
