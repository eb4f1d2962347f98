"""What each hot-path change bought, measured before/after in one run.

The changes made while profiling ptdp against PyTorch's own parallelism
(bench/peers.py), each timed both ways in the same process, alternating, on
the shapes of the peer benchmark's GPT (h = 256, s = 128, micro batch 2,
about 5.2 M parameters on the last of two pipeline stages), one thread per
process as in a two-process job on this machine:

1. biases on CPU: the layers left their bias to the fused element-wise
   node, which on CPU ran eagerly: the tanh GeLU formula as eight operations
   each way, and a separate bias pass before the residual add -> the bias
   rides in the matrix product (addmm) and the GeLU is ATen's kernel (one
   pass each way; it saves one tensor, as the fused node did). Where kernels
   are compiled (GPUs with Triton) the bias is still fused as before;
2. overflow check and gradient norm: an isfinite pass, a pow-sum pass and two
   reductions -> one dot product per range, the non-finite norm being the
   overflow signal (one reduction);
3. AdamW: seven element-wise passes -> PyTorch's fused AdamW kernel;
4. microbatch read: a stage that is both first and last (p·v = 1) read each
   microbatch twice (tokens, then labels) -> once;
5. pipeline sends: waited for at once -> completed while the rank computes its
   next action (gloo); ours, p = 2 and 4, 1F1B, whole iterations alternating.

    python bench/hot_path.py            # prints the table
    python bench/hot_path.py --write    # appends it to bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import peers  # noqa: E402
from local_job import free_port  # noqa: E402
from results import cpu_name, publish  # noqa: E402

from ptdp.model import fused  # noqa: E402
from ptdp.train import optimizer as optimizer_module  # noqa: E402

HEADING = "## Hot-path changes, each measured before and after"
PARAMETERS = 5_200_000      # the last stage of the peer benchmark's GPT at p = 2


def alternating(before: Callable[[], object], after: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of each, run alternately (ABBA) after one warm-up each."""
    before(), after()
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeats):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            fn = (before, after)[which]
            start = time.perf_counter()
            fn()
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


class _FormulaGeLU(torch.autograd.Function):
    """The fused node as it was on CPU: the tanh formula, eager, both ways."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return fused._bias_gelu_forward(x, bias)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        grad_x = fused._bias_gelu_backward(grad, x, bias)
        return grad_x, grad_x.reshape(-1, grad_x.shape[-1]).sum(dim=0)


def _layer_tensors(fan_in: int, fan_out: int):
    s, b = peers.MODEL.seq_length, 2
    x = torch.randn(s, b, fan_in, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(fan_out, fan_in) * 0.02)
    bias = torch.nn.Parameter(torch.randn(fan_out) * 0.02)
    return x, weight, bias, torch.randn(s, b, fan_out)


def gelu_change(repeats: int) -> tuple[float, float]:
    """h -> 4h linear layer and its GeLU, forward and backward."""
    h = peers.MODEL.hidden_size
    x, weight, bias, grad = _layer_tensors(h, 4 * h)

    def before():   # bias left for the fused node, which ran the formula
        _FormulaGeLU.apply(F.linear(x, weight), bias).backward(grad)

    def after():    # bias in the matrix product, ATen's GeLU
        fused.bias_gelu(F.linear(x, weight, bias), None, True).backward(grad)

    torch.testing.assert_close(_FormulaGeLU.apply(F.linear(x, weight), bias),
                               fused.bias_gelu(F.linear(x, weight, bias), None, True))
    return alternating(before, after, repeats)


def bias_add_change(repeats: int) -> tuple[float, float]:
    """4h -> h linear layer, its bias and the residual add (no dropout)."""
    h = peers.MODEL.hidden_size
    x, weight, bias, grad = _layer_tensors(4 * h, h)
    residual = torch.randn_like(grad, requires_grad=True)

    def before():   # bias returned, added in the residual step: two passes
        fused.bias_dropout_add(F.linear(x, weight), bias, residual, 0.0, True, True).backward(grad)

    def after():    # bias in the matrix product, one residual pass
        fused.bias_dropout_add(F.linear(x, weight, bias), None, residual, 0.0, True, True).backward(grad)

    return alternating(before, after, repeats)


def norm_change(repeats: int) -> tuple[float, float]:
    grads = torch.randn(PARAMETERS) * 1e-3

    def before():
        found_inf = (~torch.isfinite(grads)).any().float().reshape(1)
        found_inf.item()
        norm_sq = torch.zeros(1)
        norm_sq += grads.pow(2).sum()
        return norm_sq.sqrt().item()

    def after():
        norm_sq = torch.zeros(())
        norm_sq += torch.dot(grads, grads)
        value = norm_sq.item()
        return math.sqrt(value) if math.isfinite(value) else math.nan

    assert math.isclose(before(), after(), rel_tol=1e-4)
    return alternating(before, after, repeats)


def adamw_change(repeats: int) -> tuple[float, float]:
    from ptdp.config import TrainConfig

    config = TrainConfig()
    grads = torch.randn(PARAMETERS) * 1e-3
    state = {name: [torch.randn(PARAMETERS), torch.zeros(PARAMETERS), torch.zeros(PARAMETERS)]
             for name in ("before", "after")}
    steps = {"before": 0, "after": 0}

    def op_by_op():
        main, exp_avg, exp_avg_sq = state["before"]
        steps["before"] += 1
        bias_correction1 = 1.0 - config.adam_beta1 ** steps["before"]
        bias_correction2 = 1.0 - config.adam_beta2 ** steps["before"]
        exp_avg.lerp_(grads, 1.0 - config.adam_beta1)
        exp_avg_sq.mul_(config.adam_beta2).addcmul_(grads, grads, value=1.0 - config.adam_beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(config.adam_eps)
        main.addcdiv_(exp_avg, denom, value=-1e-4 / bias_correction1)

    def fused_kernel():
        main, exp_avg, exp_avg_sq = state["after"]
        steps["after"] += 1
        if not optimizer_module._fused_adamw(main, grads, exp_avg, exp_avg_sq, steps["after"],
                                             1e-4, config):
            raise RuntimeError("this PyTorch has no fused AdamW kernel for the CPU")

    return alternating(op_by_op, fused_kernel, repeats)


def read_change(repeats: int) -> tuple[float, float]:
    """One iteration's reads of a p·v = 1 stage (m = 8 microbatches)."""
    from ptdp.parallel.topology import ParallelContext
    from ptdp.train.loop import Trainer

    row = peers.Row("tensor")
    trainer = Trainer(peers.config_for(row, peers.MODEL), ParallelContext.single(), torch.device("cpu"))
    read = trainer.microbatch_fn(0)
    m = row.microbatches
    return alternating(lambda: [read(i) for i in range(m) for _ in range(2)],
                       lambda: [read(i) for i in range(m)], repeats)


def _send_worker(rank: int, world: int, port: int, row, iters: int, out: str) -> None:
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = ParallelContext.build(RankGrid(tp=row.t, dp=row.d, pp=row.p))
        trainer = Trainer(peers.config_for(row, peers.MODEL), ctx, torch.device("cpu"))
        times: dict[bool, list[float]] = {False: [], True: []}
        for iteration in range(2 + 2 * iters):
            overlap = iteration % 4 in (1, 2)   # ABBA
            trainer.executor.overlap_sends = overlap
            dist.barrier()
            start = time.perf_counter()
            trainer.step(iteration)
            dist.barrier()
            if iteration >= 2:
                times[overlap].append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(f"{statistics.median(times[False])} {statistics.median(times[True])}")
    finally:
        dist.destroy_process_group()


def send_change(p: int, v: int, iters: int) -> tuple[float, float]:
    import tempfile

    row = peers.Row("pipeline", p=p, v=v)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.start_processes(_send_worker, args=(p, free_port(), row, iters, out), nprocs=p,
                           join=True, start_method="spawn")
        before, after = map(float, Path(out).read_text().split())
    return before, after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per side (kernels)")
    parser.add_argument("--iters", type=int, default=6, help="timed iterations per side (pipeline)")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    rows = []

    def add(change: str, unit: str, times: tuple[float, float]) -> None:
        before, after = times
        rows.append(f"| {change} | {unit} | {before * 1e3:.2f} | {after * 1e3:.2f} | "
                    f"{before / after:.2f}x |")
        print(rows[-1], file=sys.stderr)

    h, s = peers.MODEL.hidden_size, peers.MODEL.seq_length
    add("h->4h bias + GeLU: bias left to the fused node (eager tanh formula) -> bias in addmm, ATen GeLU",
        f"ms per forward + backward, [{s}, 2, {h}] -> [{s}, 2, {4 * h}]", gelu_change(args.repeats))
    add("4h->h bias + residual: bias added in the residual step -> in addmm",
        f"ms per forward + backward, [{s}, 2, {4 * h}] -> [{s}, 2, {h}]", bias_add_change(args.repeats))
    add("overflow check + norm -> norm only (dot)", f"ms per step, {PARAMETERS / 1e6:.1f} M gradients",
        norm_change(args.repeats))
    add("AdamW: op by op -> fused kernel", f"ms per step, {PARAMETERS / 1e6:.1f} M parameters",
        adamw_change(args.repeats))
    add("microbatch read twice -> once (p·v = 1)", "ms per iteration, m = 8", read_change(args.repeats))
    for p, v in ((2, 1), (4, 1), (2, 2)):
        schedule = f"interleaved v = {v}" if v > 1 else "1F1B"
        add(f"sends waited at once -> during the next computation (p = {p}, {schedule})",
            "ms per iteration (whole job)", send_change(p, v, args.iters))

    block = (f"### {datetime.date.today().isoformat()}\n\n"
             f"Command: `python bench/hot_path.py --repeats {args.repeats} --iters {args.iters}`  \n"
             f"torch {torch.__version__}, {cpu_name()}, one thread per process; GPT of "
             f"bench/peers.py (l={peers.MODEL.num_layers}, h={peers.MODEL.hidden_size}, "
             f"s={peers.MODEL.seq_length}, V={peers.MODEL.vocab_size}, micro batch 2, global batch 16). "
             f"Medians, before and after alternating in the same run.\n\n"
             "| change | measured | before (ms) | after (ms) | speed-up |\n|---|---|---:|---:|---:|\n"
             + "\n".join(rows) + "\n")
    publish(HEADING, block, write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
