"""Mixture of experts: throughput against the dense model with the same
active parameters, expert memory per rank under expert parallelism, the two
token dispatchers and grouped against looped expert GEMMs, in one run (CPU).

1. Throughput. An MoE GPT (E experts, top-k, SwiGLU experts of width F, no
   shared expert, every layer an MoE layer) against the dense GPT whose
   SwiGLU MLP width f gives the same active parameters
   (ptdp.perf.analytic.counts.active_parameter_count: the router and k routed
   experts per layer against the dense MLP; f is the integer width that
   comes closest, the difference is printed). One process (all cores),
   then 2 processes (gloo, one thread each) with the same global batch: the
   dense model at d = 2 and the MoE model at EP = 2 (d = 2, t = 1, each rank
   holding E/2 experts) under both dispatchers. Each job alternates its sides
   iteration by iteration (ABBA, a barrier around each step) so the
   machine's noise falls on all alike; median iteration times. The losses
   of the 2-process sides must equal the one-process model's.
2. Expert memory per rank for EP in 1, 2, 4 (d = EP, t = 1, so EDP = 1) and
   EP = 2 at d = 4 with the distributed optimizer (EDP = 2): bf16 Trainers
   built in one 4-process job (no step; the optimizer state exists from
   construction). Measured from each rank's Trainer: the routed experts'
   parameters (ptdp.parallel.sharding.is_expert) and, from GradBuffer's
   expert buckets, the bf16 weights, fp32 gradients (plus the gradient
   shard) and the optimizer state's share (fp32 main weights and Adam
   moments); against ptdp.perf.analytic.memory's model for the same Layout(ep=...)
   (its expert buckets; expert and dense parts together must give
   memory_per_rank's figures, which the rank totals are compared with too).
3. Dispatchers: allgather against alltoall, iteration time at EP = 2 (the
   2-process job of 1).
4. Expert GEMMs: one process, one MoE layer's forward and backward (the
   microbatch's tokens, random input) with --moe-grouped-gemm off (one
   product per expert) and on (torch's grouped_mm, where
   ptdp.model.grouped_experts.grouped_gemm_used says it runs), alternating,
   plus the whole training step of the one-process job of 1.

    python bench/moe.py            # prints the tables
    python bench/moe.py --write    # also appends them to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import cpu_name, publish  # noqa: E402  bench/results.py

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from ptdp.model.grouped_experts import grouped_gemm_used  # noqa: E402
from ptdp.model.moe import MoELayer  # noqa: E402
from ptdp.parallel.sharding import initialize_parameters, is_expert  # noqa: E402
from ptdp.parallel.tensor import RNGStreams  # noqa: E402
from ptdp.parallel.topology import ParallelContext, RankGrid  # noqa: E402
from ptdp.perf.analytic.counts import (active_parameter_count, cut_placed_buckets,  # noqa: E402
                                       owned_elements, padded_elements, parameter_count,
                                       placement_of_parameters)
from ptdp.perf.layout import ByValue, Layout, Workload  # noqa: E402
from ptdp.perf.analytic.memory import memory_per_rank  # noqa: E402

HEADING = ("## Mixture of experts: against the dense model, expert memory per rank, "
           "dispatchers, grouped GEMMs (CPU)")
MIB = 2 ** 20
FP32 = 4
LOSS_RTOL = 1e-4
# Expert memory: (EP, d, distributed optimizer); t = 1, so EDP = d / EP.
MEMORY_LAYOUTS = ((1, 1, False), (2, 2, False), (4, 4, False), (2, 4, True))
EP_SIDES = ("dense d=2", "MoE EP=2 allgather", "MoE EP=2 alltoall")


@dataclasses.dataclass(frozen=True)
class Run:
    micro_batch: int = 4
    global_batch: int = 16
    iters: int = 16
    warmup: int = 2
    layer_iters: int = 30


def moe_model(hidden=256, heads=8, layers=4, seq=256, vocab=4096, experts=8, topk=2,
              expert_ffn=256) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       seq_length=seq, vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0,
                       swiglu=True, disable_bias_linear=True, ffn_hidden_size=topk * expert_ffn,
                       num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn)


def matched_dense(moe: ModelConfig) -> ModelConfig:
    """The dense model with the MoE model's attention, embeddings and norms,
    its MLP width f chosen so that its parameters come closest to the MoE
    model's active ones (the router's h·E per layer is not a multiple of a
    SwiGLU column's 3h, so an exact match is rare)."""
    target = active_parameter_count(moe)

    def dense(f: int) -> ModelConfig:
        return dataclasses.replace(moe, num_experts=None, moe_ffn_hidden_size=None,
                                   moe_grouped_gemm=False, ffn_hidden_size=f)
    start = moe.moe_router_topk * moe.moe_ffn_hidden_size
    slope = parameter_count(dense(start + 1)) - parameter_count(dense(start))
    guess = start + round((target - parameter_count(dense(start))) / slope)
    best = min(range(max(1, guess - 1), guess + 2),
               key=lambda f: (abs(parameter_count(dense(f)) - target), f))
    return dense(best)


def train_config(model: ModelConfig, run: Run, *, d: int = 1, ep: int = 1,
                 dispatcher: str = "alltoall", grouped: bool = False, bf16: bool = False,
                 distributed: bool = False) -> Config:
    if model.is_moe:
        model = dataclasses.replace(model, moe_token_dispatcher_type=dispatcher,
                                    moe_grouped_gemm=grouped)
    return Config(model=model,
                  parallel=ParallelConfig(data_parallel_size=d, expert_model_parallel_size=ep),
                  train=TrainConfig(micro_batch_size=run.micro_batch,
                                    global_batch_size=run.global_batch,
                                    train_iters=run.warmup + run.iters, seed=5, bf16=bf16,
                                    use_distributed_optimizer=distributed),
                  data=DataConfig(mock_data=True))


# ------------------------------------------------------------------------------------------
# Time


def time_sides(sides: dict, run: Run, barrier=lambda: None) -> dict:
    """Step every Trainer of `sides` warmup + iters times, alternating the
    order every iteration (ABBA); the timed iterations' seconds, every
    iteration's loss and, for MoE sides, the busiest and idlest expert's
    share of the tokens over the timed iterations, per side."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    shares: dict[str, list[float]] = {}
    for iteration in range(run.warmup + run.iters):
        for name in (names if iteration % 2 == 0 else names[::-1]):
            barrier()
            start = time.perf_counter()
            record, _ = sides[name].step(iteration)
            barrier()
            elapsed = time.perf_counter() - start
            losses[name].append(record["loss"])
            if iteration < run.warmup:
                continue
            times[name].append(elapsed)
            if "moe_busiest_expert_share" in record:
                busiest, idlest = shares.setdefault(name, [0.0, 1.0])
                shares[name] = [max(busiest, record["moe_busiest_expert_share"]),
                                min(idlest, record["moe_idlest_expert_share"])]
    return {"times": times, "losses": losses, "shares": shares}


def moe_layer(model: ModelConfig, grouped: bool) -> MoELayer:
    """One MoE layer of one process, its logical weights from seed 3."""
    ctx = ParallelContext.single()
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(3, ctx)
    layer = MoELayer(dataclasses.replace(model, moe_grouped_gemm=grouped), ctx, rng)
    initialize_parameters(layer, 3)
    return layer.train()


def layer_times(model: ModelConfig, b: int, iters: int) -> dict:
    """Forward + backward of one MoE layer on [s, b, h] random input, looped
    and grouped experts alternating; also whether their outputs and input
    gradients agree."""
    layers = {grouped: moe_layer(model, grouped) for grouped in (False, True)}
    x = torch.randn(model.seq_length, b, model.hidden_size, generator=torch.Generator().manual_seed(7))
    times: dict[bool, list[float]] = {False: [], True: []}
    results = {}
    for iteration in range(iters + 1):
        for grouped in ((False, True) if iteration % 2 == 0 else (True, False)):
            layer = layers[grouped]
            layer.zero_grad(set_to_none=True)
            inp = x.clone().requires_grad_(True)
            start = time.perf_counter()
            out, _ = layer(inp)
            out.sum().backward()
            elapsed = time.perf_counter() - start
            if iteration:  # the first is warm-up
                times[grouped].append(elapsed)
            results[grouped] = (out.detach(), inp.grad)
    ffn = model.moe_ffn_hidden_size
    widths = (model.hidden_size, ffn, 2 * ffn if model.swiglu else ffn)
    return {"looped_s": statistics.median(times[False]), "grouped_s": statistics.median(times[True]),
            "paired": statistics.median(g / f for g, f in zip(times[True], times[False])),
            "grouped_used": grouped_gemm_used(widths, torch.float32),
            "max_diff": max((a - b).abs().max().item()
                            for a, b in zip(results[False], results[True]))}


def one_process(moe: ModelConfig, dense: ModelConfig, run: Run) -> dict:
    """Dense, MoE (looped experts) and MoE (grouped GEMM) trained in this
    process; then one MoE layer alone, looped against grouped."""
    ctx, cpu = ParallelContext.single(), torch.device("cpu")
    from ptdp.train.loop import Trainer
    sides = {"dense": Trainer(train_config(dense, run), ctx, cpu),
             "MoE": Trainer(train_config(moe, run), ctx, cpu),
             "MoE grouped GEMM": Trainer(train_config(moe, run, grouped=True), ctx, cpu)}
    figures = time_sides(sides, run)
    del sides
    figures["layer"] = layer_times(moe, run.micro_batch, run.layer_iters)
    figures["threads"] = torch.get_num_threads()
    return figures


def ep_sides(rank: int, moe: ModelConfig, dense: ModelConfig, run: Run) -> dict:
    """On 2 ranks (the default process group): dense at d = 2 and MoE at EP
    = 2 with each dispatcher, alternating; every rank's figures."""
    from ptdp.train.loop import Trainer
    cpu = torch.device("cpu")
    dense_ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=1))
    moe_ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=1, ep=2))
    sides = {EP_SIDES[0]: Trainer(train_config(dense, run, d=2), dense_ctx, cpu),
             EP_SIDES[1]: Trainer(train_config(moe, run, d=2, ep=2, dispatcher="allgather"),
                                  moe_ctx, cpu),
             EP_SIDES[2]: Trainer(train_config(moe, run, d=2, ep=2, dispatcher="alltoall"),
                                  moe_ctx, cpu)}
    try:
        return time_sides(sides, run, dist.barrier)
    finally:
        del sides
        dense_ctx.destroy()
        moe_ctx.destroy()


# ------------------------------------------------------------------------------------------
# Expert memory per rank


def memory_layout(ep: int, d: int, distributed: bool) -> Layout:
    return Layout(d=d, ep=ep, distributed_optimizer=distributed)


def held_expert_memory(rank: int, moe: ModelConfig, layouts=MEMORY_LAYOUTS) -> list[dict | None]:
    """Per (EP, d, distributed), what this rank's bf16 Trainer holds (None
    outside the layout's ranks)."""
    from ptdp.train.loop import Trainer
    run = Run(micro_batch=1, global_batch=max(d for _, d, _ in layouts), iters=1, warmup=0)
    held = []
    for ep, d, distributed in layouts:
        ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=1, ep=ep))
        if ctx is None:
            held.append(None)
            continue
        trainer = Trainer(train_config(moe, run, d=d, ep=ep, bf16=True, distributed=distributed),
                          ctx, torch.device("cpu"))
        held.append(expert_bytes_held(trainer))
        del trainer
        ctx.destroy()
    return held


def expert_bytes_held(trainer) -> dict:
    """The routed experts' share of a Trainer's parameters, gradients and
    optimizer state, from its tensors; the rank's totals beside."""
    buffer, optimizer = trainer.buffer, trainer.optimizer
    buckets = [b for b in buffer.buckets if is_expert(b.params[0])]
    elements = sum(b.size for b in buckets)                       # padded under sharding
    owned = sum(b.size // b.replicas.size for b in buckets) if buffer.shard else elements
    state_per_element = optimizer.state_bytes / optimizer.exp_avg.numel()
    shard_grads = buffer.grad_shard.element_size() * owned if buffer.grad_shard is not None else 0
    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters() if is_expert(p)),
        "weights": elements * buffer.param_data.element_size(),
        "gradients": elements * buffer.grad_data.element_size() + shard_grads,
        "optimizer": round(owned * state_per_element),
        "rank_total": (buffer.param_data.nbytes + buffer.grad_data.nbytes
                       + (buffer.grad_shard.nbytes if buffer.grad_shard is not None else 0)
                       + optimizer.state_bytes)}


def modelled_expert_bytes(moe: ModelConfig, layout: Layout, precision: str = "bf16") -> dict:
    """ptdp.perf.analytic.memory's figures for one rank, split into the expert
    buckets' part and the rest (memory_per_rank's formulas on each); their
    sum is checked against memory_per_rank itself."""
    workload = Workload(moe, global_batch=layout.d, precision=precision)
    bucket_size = TrainConfig().ddp_bucket_size
    buckets = cut_placed_buckets(ByValue(moe), placement_of_parameters(layout), 0, bucket_size)

    def part(selected) -> dict:
        n, owned = padded_elements(selected, layout), owned_elements(selected, layout)
        sharded = layout.distributed_optimizer
        optimizer = (3 * owned * FP32 if sharded else
                     (2 if precision == "fp32" else 3) * n * FP32)
        return {"parameters": sum(b.size for b in selected), "weights": n * workload.bytes_per_element,
                "gradients": n * FP32 + (owned * FP32 if sharded else 0), "optimizer": optimizer}
    experts = part(tuple(b for b in buckets if b.expert))
    rest = part(tuple(b for b in buckets if not b.expert))
    whole = memory_per_rank(workload, layout, kernels="cpu", bucket_size=bucket_size)[0]
    for key in ("weights", "gradients", "optimizer"):
        if experts[key] + rest[key] != whole[key]:
            raise AssertionError(f"expert + dense {key} differ from memory_per_rank: "
                                 f"{experts[key]} + {rest[key]} != {whole[key]}")
    experts["rank_total"] = whole["weights"] + whole["gradients"] + whole["optimizer"]
    return experts


def memory_rows(moe: ModelConfig, held: list[list[dict | None]], layouts=MEMORY_LAYOUTS) -> list[dict]:
    """Per layout: every rank's measured figures (which must agree across
    ranks: each holds E/EP experts) and the model's."""
    rows = []
    for index, (ep, d, distributed) in enumerate(layouts):
        ranks = [r[index] for r in held if r[index] is not None]
        layout = memory_layout(ep, d, distributed)
        rows.append({"ep": ep, "d": d, "edp": layout.edp, "distributed": distributed,
                     "ranks": len(ranks), "measured": max(ranks, key=lambda r: r["weights"]),
                     "ranks_agree": all(r == ranks[0] for r in ranks),
                     "model": modelled_expert_bytes(moe, layout)})
    return rows


# ------------------------------------------------------------------------------------------
# Processes


def _entry(env, payload) -> None:
    """A launched rank: join the job, run `fn(rank, *args)`, write its result."""
    from ptdp.distributed import init_process_group

    fn, args, threads, out = payload
    torch.set_num_threads(threads)
    init_process_group(env, "gloo", timedelta(minutes=10))
    Path(out, f"{env.rank}.json").write_text(json.dumps(fn(env.rank, *args)))


def launch(world: int, fn, *args) -> list:
    """fn(rank, *args) on `world` local gloo processes, one thread each; every rank's result."""
    from ptdp.launch import launch_local

    with tempfile.TemporaryDirectory() as out:
        launch_local(world, _entry, (fn, args, 1, out))
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(world)]


# ------------------------------------------------------------------------------------------
# Report


def _rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def paired(a: list[float], b: list[float]) -> float:
    """The median over the timed iterations of a's time / b's in the same
    iteration (run back to back): a slow spell of the shared machine falls
    on both sides of a pair, where a ratio of medians can catch it on one."""
    return statistics.median(x / y for x, y in zip(a, b))


def spread(times: list[float]) -> str:
    return f"{100 * (max(times) - min(times)) / statistics.median(times):.0f} %"


def throughput_rows(one: dict, ep: dict | None, run: Run, seq: int) -> list[dict]:
    """One row per side: median seconds, tokens/s, and the losses against
    the one-process model of the same kind."""
    tokens = run.global_batch * seq
    rows = []
    for job, figures in (("1 process", one), ("2 processes", ep)):
        if figures is None:
            continue
        for name, times in figures["times"].items():
            reference = one["losses"]["dense" if name.startswith("dense") else "MoE"]
            median = statistics.median(times)
            rows.append({"job": job, "side": name, "seconds": median, "tokens_per_s": tokens / median,
                         "spread": spread(times),
                         "loss_diff": _rel_diff(figures["losses"][name], reference)})
    return rows


def throughput_table(rows: list[dict], moe: ModelConfig, dense: ModelConfig) -> str:
    counts = {"dense": (parameter_count(dense), active_parameter_count(dense)),
              "MoE": (parameter_count(moe), active_parameter_count(moe))}
    dense_time = {row["job"]: row["seconds"] for row in rows if row["side"].startswith("dense")}
    lines = ["| job | model | parameters | active | iteration (ms) | tokens/s | dense / this "
             "(time) | spread | loss vs one process (max rel. diff) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        total, active = counts["dense" if row["side"].startswith("dense") else "MoE"]
        same = "yes" if row["loss_diff"] <= LOSS_RTOL else "**NO**"
        lines.append(f"| {row['job']} | {row['side']} | {total / 1e6:.3f} M | {active / 1e6:.3f} M | "
                     f"{row['seconds'] * 1e3:.0f} | {row['tokens_per_s']:,.0f} | "
                     f"{dense_time[row['job']] / row['seconds']:.3f} | {row['spread']} | "
                     f"{same} ({row['loss_diff']:.1e}) |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| EP | d | EDP | optimizer | expert parameters per rank (measured / model) | weights MiB "
             "| gradients MiB | optimizer MiB | expert total MiB (measured) | model | vs EP = 1 "
             "| rank total MiB (measured / memory_per_rank) |",
             "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]

    def total(figures: dict) -> int:
        return figures["weights"] + figures["gradients"] + figures["optimizer"]
    for row in rows:
        m, p = row["measured"], row["model"]
        kind = "distributed" if row["distributed"] else "plain"
        lines.append(
            f"| {row['ep']} | {row['d']} | {row['edp']} | {kind} | {m['parameters']:,} / "
            f"{p['parameters']:,} | {m['weights'] / MIB:.2f} | {m['gradients'] / MIB:.2f} | "
            f"{m['optimizer'] / MIB:.2f} | {total(m) / MIB:.2f} | {total(p) / MIB:.2f} | "
            f"{total(m) / total(base['measured']):.3f} | {m['rank_total'] / MIB:.2f} / "
            f"{p['rank_total'] / MIB:.2f} |")
    return "\n".join(lines)


def memory_verdict(rows: list[dict]) -> str:
    exact = all(row["measured"][key] == row["model"][key] for row in rows
                for key in ("parameters", "weights", "gradients", "optimizer", "rank_total"))
    agree = all(row["ranks_agree"] for row in rows)
    return (f"Measured {'equals' if exact else '**differs from**'} the model in every figure; "
            f"every rank of a layout holds {'the same' if agree else '**different**'} expert bytes.")


def grouped_table(one: dict, run: Run, seq: int) -> str:
    layer, times = one["layer"], one["times"]
    step = {name: statistics.median(times[name]) for name in ("MoE", "MoE grouped GEMM")}
    path = "grouped_mm" if layer["grouped_used"] else "one product per expert (fallback)"
    return "\n".join([
        "| expert GEMMs | path that ran | one MoE layer, forward + backward (ms) | training step (ms) |",
        "|---|---|---:|---:|",
        f"| looped (default) | one product per expert | {layer['looped_s'] * 1e3:.1f} | "
        f"{step['MoE'] * 1e3:.0f} |",
        f"| --moe-grouped-gemm | {path} | {layer['grouped_s'] * 1e3:.1f} | "
        f"{step['MoE grouped GEMM'] * 1e3:.0f} |",
        f"| grouped / looped (time) | | **{layer['grouped_s'] / layer['looped_s']:.3f}** "
        f"(pairs: {layer['paired']:.3f}) | **{step['MoE grouped GEMM'] / step['MoE']:.3f}** "
        f"(pairs: {paired(times['MoE grouped GEMM'], times['MoE']):.3f}) |",
        "",
        f"The layer's output and input gradient, grouped against looped: max abs. difference "
        f"{layer['max_diff']:.1e}. Layer input: {seq} × {run.micro_batch} tokens (one microbatch)."])


def load(shares: list[float], experts: int) -> str:
    """How evenly the experts were loaded, for the reader of a throughput figure."""
    return (f"expert load over the timed iterations: the busiest expert's share of a layer's "
            f"tokens at most {shares[0]:.3f}, the idlest's at least {shares[1]:.3f} "
            f"(balanced: 1/E = {1 / experts:.3f})")


def report(moe: ModelConfig, dense: ModelConfig, run: Run, one: dict, ep: dict | None,
           memory: list[dict] | None, command: str, seconds: float) -> str:
    rows = throughput_rows(one, ep, run, moe.seq_length)
    diff = active_parameter_count(dense) - active_parameter_count(moe)
    h, e, k, f = moe.hidden_size, moe.num_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size
    blocks = [
        f"### {datetime.date.today()}: GPT l={moe.num_layers}, h={h}, a={moe.num_attention_heads}, "
        f"s={moe.seq_length}, V={moe.vocab_size}, SwiGLU, fp32; MoE E={e}, k={k}, F={f} in every "
        f"layer; dense f={dense.ffn_hidden_size}\n\n"
        f"Command: `{command}`  \n"
        f"torch {torch.__version__}, gloo, {cpu_name()}, {os.cpu_count()} cores: one process with "
        f"{one['threads']} threads, or 2 processes with one thread each. Global batch "
        f"{run.global_batch}, micro batch {run.micro_batch}; median of {run.iters} iterations per "
        f"side after {run.warmup} warm-up ones, the sides of a job alternating (ABBA). The dense "
        f"model's MLP width f = {dense.ffn_hidden_size} is the integer that brings its parameters "
        f"(ptdp.perf.analytic.counts.active_parameter_count) closest to the MoE model's active ones: "
        f"{active_parameter_count(dense):,} against {active_parameter_count(moe):,} "
        f"({diff:+,}; per layer the router's h·E = {h * e:,} against 3h·(f - k·F) = "
        f"{3 * h * (dense.ffn_hidden_size - k * f):,}).",
        "Throughput (the MoE rows run one product per expert, Megatron-LM's default, unless "
        f"named; {load(one['shares']['MoE'], e)}):\n\n" + throughput_table(rows, moe, dense)]
    one_moe = next(r for r in rows if r["job"] == "1 process" and r["side"] == "MoE")
    one_dense = next(r for r in rows if r["job"] == "1 process" and r["side"] == "dense")
    ratio = one_moe["tokens_per_s"] / one_dense["tokens_per_s"]
    times = one["times"]
    summary = (f"MoE / dense tokens/s, one process: **{ratio:.3f}** (per-iteration pairs: "
               f"{paired(times['dense'], times['MoE']):.3f})")
    if ep is not None:
        by_side = {r["side"]: r for r in rows if r["job"] == "2 processes"}
        dense2 = by_side[EP_SIDES[0]]
        summary += "; 2 processes: " + ", ".join(
            f"{name.split()[-1]} **{by_side[name]['tokens_per_s'] / dense2['tokens_per_s']:.3f}** "
            f"({paired(ep['times'][EP_SIDES[0]], ep['times'][name]):.3f})" for name in EP_SIDES[1:])
        ag, a2a = (by_side[name]["seconds"] for name in EP_SIDES[1:])
        pairs = paired(ep["times"][EP_SIDES[2]], ep["times"][EP_SIDES[1]])
        summary += (f". MoE at EP = 2 against MoE in one process (tokens/s): "
                    f"{by_side[EP_SIDES[2]]['tokens_per_s'] / one_moe['tokens_per_s']:.3f} (alltoall), "
                    f"{by_side[EP_SIDES[1]]['tokens_per_s'] / one_moe['tokens_per_s']:.3f} (allgather)."
                    f"\n\nDispatchers at EP = 2: alltoall / allgather iteration time **{a2a / ag:.3f}** "
                    f"(per-iteration pairs: {pairs:.3f})")
    blocks.append(summary + ".")
    blocks.append("Expert GEMMs, one process:\n\n" + grouped_table(one, run, moe.seq_length))
    if memory is not None:
        blocks.append(
            "Expert memory per rank (routed experts only: bf16 weights, fp32 gradients and "
            "gradient shard, fp32 main weights and Adam moments), measured from built Trainers "
            "(t = 1; EDP = d / EP), against ptdp.perf.analytic.memory's model of the same Layout(d, ep); "
            "the rank totals (all parameters) against memory_per_rank:\n\n"
            + memory_table(memory) + "\n\n" + memory_verdict(memory))
    blocks.append(f"Run time {seconds:.0f} s.")
    return "\n\n".join(blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=256, help="--moe-ffn-hidden-size")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--iters", type=int, default=16, help="timed iterations per side")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layer-iters", type=int, default=30, help="timed MoE layer passes per side")
    parser.add_argument("--no-processes", action="store_true",
                        help="one process only: no EP = 2 job, no memory job")
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args(argv)

    started = time.time()
    moe = moe_model(args.hidden, args.heads, args.layers, args.seq, args.vocab, args.experts,
                    args.topk, args.expert_ffn)
    dense = matched_dense(moe)
    run = Run(args.micro_batch, args.batch, args.iters, args.warmup, args.layer_iters)
    one = one_process(moe, dense, run)
    ep = memory = None
    if not args.no_processes:
        ep = launch(2, ep_sides, moe, dense, run)[0]
        memory = memory_rows(moe, launch(4, held_expert_memory, moe))
    command = " ".join(["python", "bench/moe.py", *(argv if argv is not None else sys.argv[1:])])
    publish(HEADING, report(moe, dense, run, one, ep, memory, command, time.time() - started),
            write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
