"""What `ptdp calibrate` measures on a CPU (ptdp.perf.calibrate.profile
makes a hardware profile of it).

What is measured (fp32, CPU, each rate per process with the thread counts
`ptdp train` uses, see ptdp.device.configure_threads):

- GEMM time for a few shapes like the ones a small GPT runs, with 1 thread,
  fitted (least squares on relative error) by time = W / peak + ramp: the
  profile's `peak_tflops_fp32` (gemm_efficiency 1) and `gemm_ramp_seconds`;
- `thread_speedup`: a mid-sized GEMM on all cores over 1 thread, measured
  alternately, the fastest of each (and `op_thread_speedup`, the same for
  each memory-bound class below); at least 1;
- memory-bound operator throughput by class, forward + backward of ptdp's own
  operators at a small GPT's sizes (REFERENCE), inputs cycled through 64 MB
  so they come from memory: LayerNorm, bias+GeLU, bias+dropout+add
  (residual), a permute copy (elementwise), the attention core (SDPA with
  dropout, less its GEMMs as the fitted GEMM model prices them), the
  vocabulary-parallel cross entropy, and ptdp's AdamW passes (optimizer);
  bytes as price/operator_bytes.py counts them over the time -> `op_bandwidth`
  (`memory_bandwidth` = the elementwise rate), and each class's forward
  alone and the rest of the pair, its backward, likewise -> `op_bandwidth`
  under "class:forward" and "class:backward" (dropout's mask is drawn in the
  forward only, and on a CPU drawing it costs far more than its bytes);
- the fixed cost of one eager operator with autograd (forward and backward
  of a chain of tiny operators) -> `launch_overhead`;
- gloo between two local processes started by `ptdp.launch.launch_local`
  (1 thread each): all-reduce time for message sizes from 4 B to 4 MB, each
  call right after the forward and backward of a small MLP block, as in
  training (so it includes waking the waiting process, caches the
  computation filled and waiting for the later rank; the mean over many
  calls, as training pays the sum of a heavy-tailed distribution), and the
  pipeline executor's batched send + receive likewise ->
  `collective_seconds` (the simulator interpolates these tables), and
  their fit as latency + bytes / bandwidth -> `intra_*` (and `inter_*`, the
  same: one machine).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ptdp.device import synchronize
from ptdp.distributed import init_process_group
from ptdp.model.fused import bias_dropout_add, bias_gelu
from ptdp.parallel.tensor import vocab_parallel_cross_entropy
from ptdp.perf.price import operator_bytes

LOCAL_DEVICES = 256     # local processes all share one machine: every link is loopback

GEMM_SHAPES = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (256, 768, 256),
               (256, 1024, 256), (256, 256, 1024), (512, 512, 512), (1024, 1024, 256)]
GEMM_SHAPES_QUICK = [(128, 128, 128), (256, 768, 256), (512, 512, 512)]
# Operator sizes measured: a small GPT's microbatch (b, s, h, heads, MLP, vocabulary).
REFERENCE = {"b": 2, "s": 128, "h": 256, "a": 8, "f": 1024, "V": 1024}
COLD_BYTES = 64 << 20    # cycle through this much input so operators run from memory


def _median_seconds(fn: Callable[[], Any], *, budget: float, min_runs: int = 3,
                    max_runs: int = 200) -> float:
    fn()  # warm up
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < min_runs or (time.perf_counter() < deadline and len(times) < max_runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of y = slope·x + intercept, minimising relative
    error (weights 1/y²); the intercept is kept non-negative."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else sy / sx
    intercept = (sy - slope * sx) / sw
    if intercept < 0 or slope <= 0:
        slope, intercept = sxy / sxx, 0.0
    return slope, intercept


def _rotation(make: Callable[[], Any], set_bytes: int, cold_bytes: int = COLD_BYTES) -> list[Any]:
    """Enough independent copies of an operator's inputs that cycling through
    them streams `cold_bytes` through the caches (training's working set
    does not fit them either)."""
    return [make() for _ in range(max(2, min(64, -(-cold_bytes // max(1, set_bytes)))))]


def _cycle(sets: list[Any], fn: Callable[[Any], Any]) -> Callable[[], Any]:
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(sets[state["i"]])
    return run


def measure_gemms(shapes: list[tuple[int, int, int]], threads: int, budget: float,
                  cold_bytes: int = COLD_BYTES) -> list[dict]:

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = []
        for m, n, k in shapes:
            sets = _rotation(lambda: (torch.randn(m, k), torch.randn(k, n)), 4 * (m * k + k * n),
                             cold_bytes)
            seconds = _median_seconds(_cycle(sets, lambda ab: torch.mm(*ab)), budget=budget)
            rows.append({"m": m, "n": n, "k": k, "threads": threads, "seconds": seconds,
                         "gflops": 2 * m * n * k / seconds / 1e9})
        return rows
    finally:
        torch.set_num_threads(previous)


def _operators(gemm_seconds: Callable[..., float], cold_bytes: int = COLD_BYTES,
               optimizer_elements: int = 1 << 22) -> dict[str, dict[str, Any]]:
    """class -> {"run": forward + backward of ptdp's operator on
    REFERENCE-sized inputs, "bytes": what price/operator_bytes.py counts for both,
    "gemms": seconds of GEMMs inside them, "forward": (its forward alone,
    the forward's bytes, the forward's GEMM seconds) or None (the optimizer,
    which has one direction)}."""


    b, s, h, a, f, V = (REFERENCE[k] for k in ("b", "s", "h", "a", "f", "V"))
    n, ffn, scores = b * s * h, b * s * f, b * a * s * s
    E = 4

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    weight, bias_h, bias_f = torch.ones(h), torch.zeros(h), torch.zeros(f)
    g_n, g_f = torch.randn(s, b, h), torch.randn(s, b, f)
    ops: dict[str, dict[str, Any]] = {}

    def add(name: str, sets: list[Any], forward: Callable[[Any], Any], grad: Any,
            nbytes: tuple[float, float], gemms: tuple[float, float] = (0.0, 0.0)) -> None:
        """The class measured as training runs it: `forward` with autograd
        recording, then the backward of its output against `grad`."""
        ops[name] = {"run": _cycle(sets, lambda x: forward(x).backward(grad)),
                     "bytes": sum(nbytes), "gemms": sum(gemms),
                     "forward": (_cycle(sets, forward), nbytes[0], gemms[0])}

    add("layer_norm", _rotation(lambda: leaf(s, b, h), 3 * n * E),
        lambda x: F.layer_norm(x, (h,), weight, bias_h), g_n, operator_bytes.layer_norm_bytes(n, E))
    add("gelu", _rotation(lambda: leaf(s, b, f), 3 * ffn * E),
        lambda x: bias_gelu(x, bias_f, True), g_f, operator_bytes.gelu_bytes(ffn, E))
    add("residual", _rotation(lambda: (leaf(s, b, h), leaf(s, b, h)), 5 * n * E),
        lambda xr: bias_dropout_add(xr[0], bias_h, xr[1], 0.1, True, True), g_n,
        operator_bytes.residual_bytes(n, E, True))
    add("elementwise", _rotation(lambda: leaf(b, a, s, h // a), 3 * n * E),
        lambda x: x.permute(2, 0, 1, 3).reshape(s, b, h), g_n, operator_bytes.copy_bytes(n, E))
    g_ctx = torch.randn(b, a, s, h // a)
    # QKᵀ and PV forward; four more backward (the fitted GEMM model's prices).
    products = (gemm_seconds(s, s, h // a, batch=b * a) + gemm_seconds(s, h // a, s, batch=b * a))
    add("attention_core",
        _rotation(lambda: (leaf(b, a, s, h // a), leaf(b, a, s, h // a), leaf(b, a, s, h // a)),
                  (3 * n + 3 * scores) * E),
        lambda qkv: F.scaled_dot_product_attention(*qkv, dropout_p=0.1, is_causal=True), g_ctx,
        operator_bytes.attention_core_bytes(scores, E, True), (products, 2 * products))
    labels = torch.randint(0, V, (s, b))
    add("cross_entropy", _rotation(lambda: leaf(s, b, V), 3 * b * s * V * E),
        lambda x: vocab_parallel_cross_entropy(x, labels, 0, None), torch.ones(s, b),
        operator_bytes.cross_entropy_bytes(b * s * V, E))

    elements = optimizer_elements
    main, grad = torch.randn(elements), torch.randn(elements)
    exp_avg, exp_avg_sq = torch.zeros(elements), torch.zeros(elements)

    def adamw():  # ptdp.train.optimizer: inf check, norm, clip, AdamW
        (~torch.isfinite(grad)).any()
        grad.pow(2).sum()
        grad.mul_(1.0)
        main.mul_(0.999)
        exp_avg.lerp_(grad, 0.1)
        exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=0.001)
        denom = (exp_avg_sq.sqrt() / 0.9).add_(1e-8)
        main.addcdiv_(exp_avg, denom, value=-1e-3)

    ops["optimizer"] = {"run": adamw, "bytes": operator_bytes.OPTIMIZER_BYTES_PER_PARAMETER * elements,
                        "gemms": 0.0, "forward": None}
    return ops


def _rate(nbytes: float, seconds: float, gemms: float) -> float:
    """Bytes per second of `seconds` less the GEMMs inside (at least a tenth
    of them left: the fitted GEMM price can exceed a noisy measurement)."""
    return nbytes / max(seconds - gemms, 0.1 * seconds)


def measure_memory_ops(budget: float, gemm_seconds: Callable[..., float], threads: int = 1, *,
                       rounds: int = 3, cold_bytes: int = COLD_BYTES,
                       optimizer_elements: int = 1 << 22) -> list[dict]:
    """Bytes per second of each class of memory-bound operator (1 thread):
    the bytes price/operator_bytes.py counts for it over the time its forward + backward
    takes (less the time of the GEMMs inside, for the attention core), and the
    same of its forward alone and of the rest, its backward: the two
    directions can differ far more than their bytes do (on a CPU, drawing a
    dropout mask costs more than the pass that applies it, and only the
    forward, or a recomputation, draws one). With `threads` > 1 also its
    speed-up on that many threads ("speedup"), the two measured in
    alternation so that both see the same background load."""

    previous = torch.get_num_threads()
    try:
        rows = []
        operators = _operators(gemm_seconds, cold_bytes, optimizer_elements)
        for name, op in operators.items():
            single, multi, forward = [], [], []
            for _ in range(rounds if threads > 1 else 1):
                torch.set_num_threads(1)
                single.append(_median_seconds(op["run"], budget=budget / rounds))
                if op["forward"]:
                    forward.append(_median_seconds(op["forward"][0], budget=budget / rounds))
                if threads > 1:
                    torch.set_num_threads(threads)
                    multi.append(_median_seconds(op["run"], budget=budget / rounds))
            seconds, nbytes, gemms = statistics.median(single), op["bytes"], op["gemms"]
            row = {"op": name, "seconds": seconds, "gemm_seconds": gemms, "bytes": nbytes,
                   "gbytes_per_s": _rate(nbytes, seconds, gemms) / 1e9}
            if forward:
                _, forward_bytes, forward_gemms = op["forward"]
                # The backward: the rest of the pair (at least a tenth of it).
                forward_seconds = min(statistics.median(forward), 0.9 * seconds)
                row.update(forward_seconds=forward_seconds,
                           forward_gbytes_per_s=_rate(forward_bytes, forward_seconds,
                                                      forward_gemms) / 1e9,
                           backward_gbytes_per_s=_rate(nbytes - forward_bytes,
                                                       seconds - forward_seconds,
                                                       gemms - forward_gemms) / 1e9)
            if multi:   # the least disturbed runs: others' load is available_cores' business
                row["speedup"] = min(single) / min(multi)
            rows.append(row)
        return rows
    finally:
        torch.set_num_threads(previous)


def measure_gemm_speedup(threads: int, budget: float, cold_bytes: int = COLD_BYTES) -> dict:
    """A mid-sized GEMM ([b·s, h]×[h, 4h] of REFERENCE) on `threads` threads
    over 1 thread, measured alternately."""

    m, k, n = REFERENCE["b"] * REFERENCE["s"], REFERENCE["h"], REFERENCE["f"]
    sets = _rotation(lambda: (torch.randn(m, k), torch.randn(k, n)), 4 * (m * k + k * n), cold_bytes)
    fn = _cycle(sets, lambda ab: torch.mm(*ab))
    previous = torch.get_num_threads()
    single, multi = [], []
    try:
        for _ in range(3):
            torch.set_num_threads(1)
            single.append(_median_seconds(fn, budget=budget / 6))
            torch.set_num_threads(threads)
            multi.append(_median_seconds(fn, budget=budget / 6))
    finally:
        torch.set_num_threads(previous)
    one, many = min(single), min(multi)
    return {"m": m, "n": n, "k": k, "threads": threads, "one_thread_seconds": one,
            "seconds": many, "speedup": one / many}


def measure_launch_overhead(budget: float, ops: int = 100, device=None) -> dict:
    """Seconds per tiny eager operator: forward and backward of `ops`
    multiplications on a 16-element tensor, over 3·ops (one forward and
    about two backward operators each); on `device` (default: the CPU)."""


    x = torch.randn(16, requires_grad=True, device=device)

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()
        synchronize(x.device)

    seconds = _median_seconds(chain, budget=budget)
    return {"ops": ops, "seconds": seconds, "per_op": seconds / (3 * ops)}


# ---- gloo between two local processes ------------------------------------------------------

def _mlp_block() -> Callable[[], None]:
    """Forward + backward of a small MLP block (REFERENCE's activations, an
    h -> h MLP: a few ms), as a closure."""


    b, s, h = (REFERENCE[k] for k in ("b", "s", "h"))
    f = h
    x = torch.randn(s, b, h, requires_grad=True)
    w1 = (torch.randn(f, h) * 0.02).requires_grad_()
    w2 = (torch.randn(h, f) * 0.02).requires_grad_()
    bias, ln_w, ln_b = torch.zeros(f), torch.ones(h), torch.zeros(h)

    def block() -> None:
        y = bias_gelu(F.linear(F.layer_norm(x, (h,), ln_w, ln_b), w1), bias, True)
        F.dropout(F.linear(y, w2), 0.1).sum().backward()
    return block


def _parallel_capacity(block: Callable[[], None], rank: int, rounds: int = 3,
                       blocks: int = 8) -> dict[str, float]:
    """How much of two cores two computing processes get: each rank times
    `blocks` runs of `block` alone (the other waiting in a barrier) and with
    the other computing too; the sum over the ranks of alone / together is
    2 on two free cores and 1 when they share one (other load)."""

    def timed() -> float:
        start = time.perf_counter()
        for _ in range(blocks):
            block()
        return time.perf_counter() - start

    alone, together = [], []
    for _ in range(rounds):
        for turn in (0, 1):
            dist.barrier()
            if rank == turn:
                alone.append(timed())
            dist.barrier()
        dist.barrier()
        together.append(timed())
    share = torch.tensor([min(alone) / statistics.median(together)])
    dist.all_reduce(share)
    return {"alone_seconds": min(alone), "together_seconds": statistics.median(together),
            "two_processes": float(share.item())}


def _comm_worker(env, payload) -> None:


    out, sizes, repeats = payload
    torch.set_num_threads(1)
    init_process_group(env, "gloo", timedelta(minutes=2))
    try:
        rank, peer = env.rank, 1 - env.rank
        # Training computes between its collectives; so does this loop: the
        # forward and backward of a small MLP block (LayerNorm, Linear,
        # bias+GeLU, Linear, dropout), a few ms. The times then include
        # what a collective costs there: waking the waiting process, caches the
        # computation has filled, waiting for the later of the two ranks.
        between = _mlp_block()
        results: dict[str, dict[str, float]] = {"allreduce": {}, "exchange": {},
                                                "cores": _parallel_capacity(between, rank)}
        for numel in sizes:
            source = torch.randn(numel)
            receive = torch.empty(numel)

            def allreduce():
                tensor = source.clone()
                begin = time.perf_counter()
                dist.all_reduce(tensor)
                return time.perf_counter() - begin

            def exchange():  # the pipeline executor's batched send + receive
                tensor = source.clone()
                begin = time.perf_counter()
                ops = [dist.P2POp(dist.isend, tensor, peer, tag=1),
                       dist.P2POp(dist.irecv, receive, peer, tag=1)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                return time.perf_counter() - begin

            for name, fn in (("allreduce", allreduce), ("exchange", exchange)):
                dist.barrier()
                times = []
                for _ in range(repeats):
                    between()
                    times.append(fn())
                # The mean: training pays the sum of many calls, and these
                # times are heavy-tailed (a woken process may wait for a core).
                results[name][str(numel * 4)] = statistics.fmean(times)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def measure_gloo(sizes: list[int], repeats: int) -> dict:
    return timed_by_two_processes(_comm_worker, sizes, repeats)


def timed_by_two_processes(worker, *settings) -> dict:
    """Run `worker` on two local processes; the timings its rank 0 writes."""
    from ptdp.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="ptdp-calibrate-") as folder:
        out = Path(folder) / "timings.json"
        launch_local(2, worker, (str(out), *settings))
        return json.loads(out.read_text())


def latency_bandwidth(timings: dict[str, float]) -> tuple[float, float]:
    """(latency, bytes/s) of seconds = latency + bytes / bandwidth fitted to {bytes: seconds}."""
    sizes = sorted(timings, key=int)
    slope, intercept = fit_line([float(size) for size in sizes], [timings[size] for size in sizes])
    return intercept, 1.0 / slope
