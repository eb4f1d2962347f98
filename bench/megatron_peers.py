"""ptdp against Megatron-Core, side by side in the same processes (CPU, gloo).

Megatron-Core is the `megatron-core` package, not a ptdp dependency: `--install`
puts it into bench/.megatron-core without its dependencies (so this
environment's torch stays); bench/megatron_shims.py lists the shims it needs
on a CPU (no CUDA, triton, Transformer Engine or apex), and every row's
output counts them.

Each row starts one local gloo job (world = the layout's process count).
Every process builds both sides from the same logical weights (ptdp's
one-process initialisation, copied into Megatron-Core's modules by name,
bench/megatron_side.py):

- ptdp: its Trainer's model, pipeline executor and gradient buffer;
- Megatron-Core: GPTModel with the local layer spec (SequentialMLP experts
  for MoE), its DistributedDataParallel and its own forward-backward
  schedule (get_forward_backward_func, finalize_model_grads at its end).

One iteration is the forward and backward of one global batch with the
gradients reduced, no optimizer step, on the same batches on both sides.
Iterations alternate between the sides (ABBA order, a barrier around each),
so machine noise hits both alike; the ratio is Megatron-Core's median
iteration time over ptdp's (> 1: ptdp faster). The first iteration's losses
are shown side by side; with the same weights they agree within 1e-3.

    python bench/megatron_peers.py --install     # install megatron-core if missing, run every row
    python bench/megatron_peers.py dense         # the dense rows only (or: moe)
    python bench/megatron_peers.py --write       # append the table to bench/RESULTS.md
    python bench/megatron_peers.py --device cuda # on GPUs: NCCL, one GPU per process, the rows
                                                 # that fit the GPUs, plus dense in one process

On GPUs Megatron-Core runs natively (no device, RNG or host-copy shims), with
the same local layer spec as on the CPU: its Transformer Engine spec names
its weights differently, and ptdp uses no Transformer Engine either.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import megatron_shims  # noqa: E402
from megatron_side import Layout  # noqa: E402
from local_job import free_port  # noqa: E402
from results import cpu_name, publish  # noqa: E402

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402

HEADING = "## Megatron-Core as a peer: ptdp against Megatron-Core's GPT and MoE (CPU)"
GPU_HEADING = "## Megatron-Core as a peer on a GPU: ptdp against Megatron-Core's GPT and MoE"
LOSS_ATOL = 1e-3
MODEL = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128,
                    vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0)
# 8 experts, top-2, the load-balancing loss; Megatron-Core's MoE layers
# take no linear biases, so neither side has any in the MoE model.
MOE_MODEL = replace(MODEL, num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                    disable_bias_linear=True)
# For checking the harness in seconds (tests): its figures are not results.
TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=512)
MICRO_BATCH, GLOBAL_BATCH, SEED = 2, 16, 1234


@dataclass(frozen=True)
class Row:
    family: str                 # dense | moe
    layout: Layout = Layout()

    def describe(self) -> str:
        lay = self.layout
        parts = [f"{k}={getattr(lay, k)}" for k in ("t", "p", "d") if getattr(lay, k) > 1]
        if lay.sequence_parallel:
            parts.append("SP")
        if lay.ep > 1:
            parts.append(f"EP={lay.ep}" + (f" (ETP={lay.etp})" if lay.etp else ""))
        if lay.p > 1:
            parts.append(f"interleaved v={lay.v}" if lay.v > 1 else "1F1B")
        if self.family == "moe" and lay.ep > 1:
            parts.append(lay.dispatcher)
        return " ".join(parts) or "one process"


ROWS = {
    "dense": [Row("dense", Layout(t=2)), Row("dense", Layout(p=2)), Row("dense", Layout(p=2, v=2))],
    "moe": [Row("moe"),
            Row("moe", Layout(d=2, ep=2, dispatcher="alltoall")),
            Row("moe", Layout(d=2, ep=2, dispatcher="allgather")),
            # EP over the tensor ranks: each expert whole on its rank (ETP = 1)
            Row("moe", Layout(t=2, sequence_parallel=True, ep=2, etp=1, dispatcher="alltoall")),
            Row("moe", Layout(p=2, d=2, ep=2, dispatcher="alltoall"))],
}


def rows_for(families: list[str], device: str) -> tuple[dict[str, list[Row]], list[str]]:
    """The rows to run per family, and why any are left out: on GPUs those
    with more processes than GPUs (one GPU each); there the dense model gets
    a one-process row too."""
    if device == "cpu":
        return {family: ROWS[family] for family in families}, []
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("--device cuda: this machine has no CUDA GPU; run without --device")
    rows, skipped = {}, []
    for family in families:
        candidates = ([Row("dense")] if family == "dense" else []) + ROWS[family]
        rows[family] = [row for row in candidates if row.layout.world <= gpus]
        skipped += [f"{family} {row.describe()} (needs {row.layout.world} GPUs, this machine has "
                    f"{gpus})" for row in candidates if row.layout.world > gpus]
    return rows, skipped


def model_of(row: Row, tiny: bool = False) -> ModelConfig:
    model = MOE_MODEL if row.family == "moe" else MODEL
    if row.family == "moe":
        model = replace(model, moe_token_dispatcher_type=row.layout.dispatcher)
    return replace(model, **TINY) if tiny else model


def ptdp_config(row: Row, model: ModelConfig, device: str = "cpu") -> Config:
    lay = row.layout
    return Config(
        model=model,
        parallel=ParallelConfig(
            tensor_model_parallel_size=lay.t, pipeline_model_parallel_size=lay.p,
            data_parallel_size=lay.d, pipeline_schedule="1f1b", device=device,
            num_layers_per_virtual_pipeline_stage=(model.num_layers // (lay.p * lay.v)
                                                   if lay.v > 1 else None),
            sequence_parallel=lay.sequence_parallel, expert_model_parallel_size=lay.ep,
            expert_tensor_parallel_size=lay.etp),
        train=TrainConfig(micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, lr=1e-4,
                          lr_decay_style="constant", clip_grad=0.0, seed=SEED),
        data=DataConfig(mock_data=True))


# ------------------------------------------------------------------------------------------
# One row: a local gloo job


def _logical_weights(model: ModelConfig, seed: int) -> dict:
    from ptdp.model.gpt import build_chunks
    from ptdp.parallel.topology import ParallelContext

    [full] = build_chunks(model, ParallelContext.single(), torch.device("cpu"), seed)
    return {name: tensor.detach() for name, tensor in full.state_dict().items()
            if not name.endswith("expert_bias")}


def run_sides(row: Row, model: ModelConfig, iters: int, warmup: int, device: str = "cpu") -> dict:
    """This rank's part of a row, in a process group of the layout's ranks
    already started: every timed iteration's seconds and every loss, per side."""
    import megatron_side
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    lay = row.layout
    ctx = ParallelContext.build(RankGrid(tp=lay.t, dp=lay.d, pp=lay.p, ep=lay.ep, etp=lay.etp))
    cuda = device == "cuda"
    trainer = Trainer(ptdp_config(row, model, device), ctx, torch.device(device))
    megatron_side.initialize_megatron(lay, SEED, cuda=cuda)
    if not cuda:
        megatron_shims.install_cpu_device()  # modules the model's construction imported
    microbatches = GLOBAL_BATCH // (MICRO_BATCH * lay.d)
    theirs = megatron_side.MegatronSide(model, lay, _logical_weights(model, SEED), MICRO_BATCH,
                                        microbatches, torch.device(device))
    if not cuda:
        megatron_shims.install_cpu_device()  # and those its modules imported as they were built
    # (a GPU's queued work is done before a time is read)
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    reads = ctx.is_first_stage or trainer.holds_loss

    def batches(iteration: int) -> list[tuple]:
        if not reads:
            return []
        fn = trainer.microbatch_fn(iteration)
        out = []
        for i in range(microbatches):
            parts = fn(i)
            out.append((parts[0], parts[1], parts[2] if len(parts) > 2 else None))
        return out

    times: dict[str, list[float]] = {"ptdp": [], "megatron": []}
    # This process's CPU seconds (all its threads) per iteration: the work
    # done, which other jobs on a shared machine barely change (waiting in a
    # collective costs none), beside the wall time they do change.
    cpu: dict[str, list[float]] = {"ptdp": [], "megatron": []}
    losses: dict[str, list[float | None]] = {"ptdp": [], "megatron": []}
    for iteration in range(warmup + iters):
        data = batches(iteration)
        for side in (("ptdp", "megatron") if iteration % 2 == 0 else ("megatron", "ptdp")):  # ABBA
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = (megatron_side.ptdp_forward_backward(trainer, iteration) if side == "ptdp"
                    else theirs.step(data))
            synchronize()
            cpu_end = time.process_time()
            dist.barrier()
            if iteration >= warmup:
                times[side].append(time.perf_counter() - start)
                cpu[side].append(cpu_end - cpu_start)
            losses[side].append(loss)
    if lay.d > 1:  # Megatron-Core's loss is its data-parallel replica's: average them
        for i, value in enumerate(losses["megatron"]):
            if value is not None:
                mean = torch.tensor([value], dtype=torch.float64)
                dist.all_reduce(mean, group=ctx.dp_group)
                losses["megatron"][i] = mean.item() / lay.d
    megatron_side.destroy_megatron()
    gathered = [None] * lay.world
    dist.all_gather_object(gathered, {"times": times, "cpu": cpu, "losses": losses,
                                      "last": trainer.holds_loss,
                                      "shims": megatron_shims.shims()})
    return gathered


def _worker(rank: int, row: Row, model: ModelConfig, port: int, iters: int, warmup: int,
            threads: int, out: str, device: str) -> None:
    torch.set_num_threads(threads)
    # Megatron-Core's advice for GPUs and its fallbacks' notices (apex, CUDA
    # connections, deprecated collectives): not about this run's results.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if row.layout.sequence_parallel:
        megatron_shims.install_apex_layer_norm()
    megatron_shims.install_import_shims()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        megatron_shims.install_cpu_device()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=row.layout.world)
    try:
        if not cuda:  # (a GPU has Megatron-Core's own RNG tracker and device-to-host copies)
            megatron_shims.install_rng_tracker()
            megatron_shims.install_host_splits()
        megatron_shims.install_missing_names()
        gathered = run_sides(row, model, iters, warmup, device)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def run_row(row: Row, model: ModelConfig, iters: int, warmup: int, device: str = "cpu") -> dict:
    threads = max(1, (os.cpu_count() or 1) // row.layout.world)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(row, model, free_port(), iters, warmup, threads, out,
                                          device),
                           nprocs=row.layout.world, join=True, start_method="spawn")
        ranks = json.loads(Path(out).read_text())
    # On a GPU the host's CPU time is not the work done: not shown
    return summarise(row, model, ranks, (load_before, os.getloadavg()[0]),
                     threads if device == "cpu" else 0)


def summarise(row: Row, model: ModelConfig, ranks: list[dict], load: tuple, threads: int) -> dict:
    """A row's figures from every rank's run_sides; `load`: the 1-minute
    load average before and after it; `threads`: each process's intra-op
    threads (with more than one, the CPU time also counts their spinning
    between parallel regions, so it is not shown)."""
    times = ranks[0]["times"]
    last = next(r for r in ranks if r["last"])
    ptdp_s, megatron_s = statistics.median(times["ptdp"]), statistics.median(times["megatron"])
    # CPU seconds of every rank together, per iteration, then the median
    cpu = {side: statistics.median(map(sum, zip(*(rank["cpu"][side] for rank in ranks))))
           for side in ("ptdp", "megatron")}
    first = (last["losses"]["ptdp"][0], last["losses"]["megatron"][0])
    return {"family": row.family, "layout": row.describe(), "row": asdict(row.layout),
            "ptdp_s": ptdp_s, "megatron_s": megatron_s, "ratio": megatron_s / ptdp_s,
            "ptdp_cpu_s": cpu["ptdp"], "megatron_cpu_s": cpu["megatron"],
            "cpu_ratio": cpu["megatron"] / cpu["ptdp"], "threads": threads,
            "ratios": [m / p for p, m in zip(times["ptdp"], times["megatron"])],
            "first_losses": first, "losses_agree": abs(first[0] - first[1]) <= LOSS_ATOL,
            "ln_vocab": math.log(model.vocab_size), "load": load,
            "shims": [tuple(shim) for shim in ranks[0]["shims"]]}


# ------------------------------------------------------------------------------------------
# Report


def cpu_cell(result: dict) -> str:
    if result["threads"] == 0:
        return "— (GPU)"
    if result["threads"] > 1:
        return f"— ({result['threads']} threads)"
    return (f"{result['ptdp_cpu_s']:.3f} / {result['megatron_cpu_s']:.3f} "
            f"({result['cpu_ratio']:.2f})")


def table(results: list[dict]) -> str:
    lines = ["| model | layout | ptdp s | Megatron-Core s | Megatron-Core / ptdp (range of pairs) | "
             "CPU s ptdp / Megatron-Core (ratio) | "
             "first-iteration loss ptdp / Megatron-Core | agree (1e-3) | load before→after |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in results:
        low, high = min(r["ratios"]), max(r["ratios"])
        lines.append(f"| {r['family']} | {r['layout']} | {r['ptdp_s']:.3f} | {r['megatron_s']:.3f} | "
                     f"{r['ratio']:.2f} ({low:.2f}–{high:.2f}) | {cpu_cell(r)} | "
                     f"{r['first_losses'][0]:.5f} / "
                     f"{r['first_losses'][1]:.5f} | {'yes' if r['losses_agree'] else '**NO**'} | "
                     f"{r['load'][0]:.1f}→{r['load'][1]:.1f} |")
    return "\n".join(lines)


def shim_list(results: list[dict]) -> str:
    """Every shim any row needed, with the rows that needed it."""
    rows_of: dict[str, tuple[str, list[str]]] = {}
    for r in results:
        for what, why in r["shims"]:
            rows_of.setdefault(what, (why, []))[1].append(f"{r['family']} {r['layout']}")
    lines = [f"- {what} ({'every row' if len(rows) == len(results) else 'only ' + ', '.join(rows)}): "
             f"{why}" for what, (why, rows) in rows_of.items()]
    return f"Shims Megatron-Core needed on this CPU ({len(lines)}):\n\n" + "\n".join(lines)


def report(results: list[dict], header: str, seconds: float) -> str:
    load = [value for r in results for value in r["load"]]
    cores = os.cpu_count() or 1
    # The load average also counts this run's own processes (a row runs one
    # per rank, up to 4, on the cores) and lags a minute: only the reading
    # before the first row tells whether other work was running.
    if not load:
        note = ""
    elif load[0] > cores:
        note = (f"Measured under load: the 1-minute load average was {load[0]:.1f} on {cores} "
                f"cores before the first row ({min(load):.1f}–{max(load):.1f} in all); rerun on "
                f"a quiet machine before reading the ratios closely.")
    else:
        note = (f"The 1-minute load average was {load[0]:.1f} on {cores} cores before the first "
                f"row; the later readings ({min(load):.1f}–{max(load):.1f}) include this run's own "
                f"processes, one per rank.")
    return "\n\n".join(part for part in [header, table(results), note, shim_list(results),
                                         f"Run time {seconds:.0f} s."] if part) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", metavar="MODEL", help="dense, moe (default: both)")
    parser.add_argument("--iters", type=int, default=4, help="timed iterations per side and row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--tiny", action="store_true", help="a small model, for checking the harness")
    parser.add_argument("--install", action="store_true",
                        help=f"install megatron-core {megatron_shims.VERSION} into "
                             f"bench/.megatron-core if it is missing")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL, one GPU per process; rows needing more GPUs than the "
                             "machine has are skipped, and a one-process dense row is added")
    args = parser.parse_args(argv)
    unknown = [name for name in args.families if name not in ROWS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(ROWS)}")
    megatron_shims.ensure_installed(args.install)
    families = args.families or list(ROWS)
    rows, skipped = rows_for(families, args.device)
    started = time.time()
    results = []
    for family in families:
        for row in rows[family]:
            result = run_row(row, model_of(row, args.tiny), args.iters, args.warmup, args.device)
            results.append(result)
            print(f"{family}: {result['layout']}: ptdp {result['ptdp_s']:.3f} s, Megatron-Core "
                  f"{result['megatron_s']:.3f} s, ratio {result['ratio']:.2f} (CPU time "
                  f"{result['cpu_ratio']:.2f}), first losses "
                  f"{result['first_losses'][0]:.5f} / {result['first_losses'][1]:.5f}, "
                  f"load {result['load'][1]:.1f}", file=sys.stderr)
    from importlib.metadata import version
    megatron_version = version("megatron-core")
    command = "python bench/megatron_peers.py" + "".join(f" {f}" for f in args.families) \
        + (" --tiny" if args.tiny else "") + f" --iters {args.iters} --warmup {args.warmup}" \
        + (" --device cuda" if args.device == "cuda" else "")
    where = (f"nccl, {torch.cuda.get_device_name()} ({torch.cuda.device_count()} GPU(s)), fp32 "
             f"with PyTorch's default matmul precision" if args.device == "cuda"
             else f"gloo, {cpu_name()}, {os.cpu_count()} cores shared by the processes")
    m = MODEL if not args.tiny else replace(MODEL, **TINY)
    header = (f"### {datetime.date.today().isoformat()}: l={m.num_layers}, h={m.hidden_size}, "
              f"a={m.num_attention_heads}, s={m.seq_length}, V={m.vocab_size}, fp32, micro batch "
              f"{MICRO_BATCH}, global batch {GLOBAL_BATCH}; MoE: {MOE_MODEL.num_experts} experts, "
              f"top-{MOE_MODEL.moe_router_topk}, aux loss {MOE_MODEL.moe_aux_loss_coeff}, no linear "
              f"biases\n\n"
              f"Command: `{command}`  \n"
              f"megatron-core {megatron_version} (local layer spec, SequentialMLP experts, its "
              f"DistributedDataParallel and get_forward_backward_func), torch {torch.__version__}, "
              f"{where}. Forward + "
              f"backward of one global batch with the gradients reduced, no optimizer; median of "
              f"{args.iters} iterations per side, alternating (ABBA); ratio = Megatron-Core's time / "
              f"ptdp's (> 1: ptdp faster). CPU s: the CPU time of all ranks together per "
              f"iteration (median), the work done, which other jobs on the machine barely "
              f"change (shown where each process runs one thread). Both sides start from ptdp's initialisation (copied into "
              f"Megatron-Core by name); ln V = {math.log(m.vocab_size):.3f}.\n")
    if skipped:
        header += "\nSkipped: " + "; ".join(skipped) + ".\n"
    publish(HEADING if args.device == "cpu" else GPU_HEADING,
            report(results, header, time.time() - started), write=args.write)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    disagree = [r["layout"] for r in results if not r["losses_agree"]]
    if disagree:
        print(f"first-iteration losses differ by more than {LOSS_ATOL} in: {disagree}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
