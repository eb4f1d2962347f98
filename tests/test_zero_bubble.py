"""The zero-bubble schedules (zb-h1, zbv) compute what one process computes.

Executor level, for p in {2, 4} and every valid m in {p, 2p, 3p} (zb-h1:
m >= p; zbv: m >= 2p), alone and with t = 2 (also under sequence
parallelism): the loss and every parameter's gradient equal the one-process
model's. Measured while running: the stored activations counted F to B
peak at 1F1B's bound (zb-h1) and, counted F to W, at the schedule's own
bound; W really ran deferred work.

Full training step (Trainer: buckets, AdamW, clipping, 5 iterations) at
t = 2, p = 2, d = 2, with and without the distributed optimizer: losses,
gradient norms and weights equal one process's. With dropout, full or
selective recomputation, and fp16 loss scaling: a zero-bubble run is the same
as 1F1B on the same layout, which is itself tested against one process. For
zb-h1 bitwise and with dropout (the split backward does the fused backward's
arithmetic in the same order, and zb-h1 keeps 1F1B's placement); zbv puts
layers on other ranks (other dropout streams), so without dropout and to
rounding.

Tolerances are test_pipeline's and test_ptdp_step's, for the same reasons.
"""

import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import ConfigError, validate
from ptdp.model.gpt import build_chunks
from ptdp.parallel.pipeline.executor import PipelineExecutor
from ptdp.schedules.actions import peak_stored
from ptdp.schedules.build import build_forward_only, build_schedule
from ptdp.parallel.sharding import PARTIAL_GRAD_ATTR, SHARD_ATTR, gather_logical
from ptdp.parallel.tensor import sum_partial_grads
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests.test_pipeline import (B_MICRO, CONFIG, GRAD_TOL, LOSS_TOL, SEED, _microbatch_fn,
                                 _serial_reference, _tokens, all_reduce_tied_embedding_grads)
from tests.test_ptdp_step import MODEL, WEIGHT_TOL, _config, _logical_weights, computed_once


def _zero_bubble_vs_serial(rank, t, p, kind, m, sequence_parallel=False, config=CONFIG):
    ctx = ParallelContext.build(RankGrid(tp=t, dp=1, pp=p))
    schedule = build_schedule(kind, p, m, schedule_v := (2 if kind == "zbv" else 1))
    chunks = build_chunks(config, ctx, torch.device("cpu"), SEED, schedule_v,
                          sequence_parallel=sequence_parallel, kind=kind)
    positions = config.seq_length // t if sequence_parallel else config.seq_length
    executor = PipelineExecutor(chunks, ctx, activation_shape=(positions, B_MICRO,
                                                               config.hidden_size),
                                dtype=torch.float32, device=torch.device("cpu"),
                                scatter_gather=not sequence_parallel)
    stats = executor.run(schedule, _microbatch_fn(_tokens(m, config)))
    if kind != "zbv":  # zbv: rank 0 holds both ends, one shared parameter
        all_reduce_tied_embedding_grads(chunks, ctx)
    seen, params = set(), []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append((name, param))
    sum_partial_grads([param.grad for _, param in params
                       if getattr(param, PARTIAL_GRAD_ATTR, False)], ctx.tp_group)

    serial, serial_loss = _serial_reference(m, config)
    holds_loss = schedule.location(schedule.num_stages - 1)[0] == ctx.pp_rank
    if holds_loss:
        assert len(stats.losses) == m
        assert_close(torch.stack(stats.losses).mean(), serial_loss.detach(), **LOSS_TOL)
    else:
        assert stats.losses == []
    serial_params = dict(serial.named_parameters())
    for name, param in params:
        reference = serial_params[name]
        grad = gather_logical(param.grad, getattr(param, SHARD_ATTR, None), ctx.tp_group)
        want = gather_logical(reference.grad, getattr(reference, SHARD_ATTR, None), None)
        assert_close(grad, want, **GRAD_TOL, msg=lambda msg, name=name: f"{name}: {msg}")

    computes = schedule.computes(ctx.pp_rank)
    assert stats.peak_stored == peak_stored(computes, "B")
    assert stats.peak_awaiting_weight_grads == schedule.in_flight_bound(ctx.pp_rank)
    if kind == "zb-h1":  # 1F1B's activation bound, F to B
        assert stats.peak_stored == build_schedule("1f1b", p, m).in_flight_bound(ctx.pp_rank)
    assert stats.weight_grad_seconds > 0
    return [name for name, _ in params]


CASES = [(p, kind, m) for p in (2, 4) for kind in ("zb-h1", "zbv")
         for m in (p, 2 * p, 3 * p) if m >= (2 * p if kind == "zbv" else p)]


@pytest.mark.parametrize("p,kind,m", CASES, ids=[f"p{p}-{k}-m{m}" for p, k, m in CASES])
def test_zero_bubble_equals_one_process(pools, p, kind, m):
    names = pools(p).run(_zero_bubble_vs_serial, 1, p, kind, m)
    checked = {name for rank_names in names for name in rank_names}
    assert checked == set(dict(_serial_reference(1)[0].named_parameters()))


T2_CASES = [(2, "zb-h1", 2, False), (2, "zbv", 4, False), (4, "zb-h1", 8, False),
            (4, "zbv", 8, False), (2, "zb-h1", 4, True), (2, "zbv", 6, True)]


@pytest.mark.parametrize("p,kind,m,sequence_parallel", T2_CASES,
                         ids=[f"t2-p{p}-{k}-m{m}" + ("-sp" if sp else "") for p, k, m, sp in T2_CASES])
def test_zero_bubble_with_tensor_parallelism_equals_one_process(pools, p, kind, m,
                                                                sequence_parallel):
    pools(2 * p).run(_zero_bubble_vs_serial, 2, p, kind, m, sequence_parallel)


def _forward_only_zbv(rank, p, m):
    """Evaluation under the V placement: the mean loss of m microbatches."""
    ctx = ParallelContext.build(RankGrid(tp=1, dp=1, pp=p))
    chunks = build_chunks(CONFIG, ctx, torch.device("cpu"), SEED, 2, kind="zbv")
    executor = PipelineExecutor(chunks, ctx, activation_shape=(CONFIG.seq_length, B_MICRO,
                                                               CONFIG.hidden_size),
                                dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        stats = executor.run(build_forward_only(p, m, 2, placement="zbv"),
                             _microbatch_fn(_tokens(m)), forward_only=True)
    _, serial_loss = _serial_reference(m)
    if rank == 0:
        assert_close(torch.stack(stats.losses).mean(), serial_loss.detach(), **LOSS_TOL)
    return len(stats.losses)


def test_zbv_forward_only_evaluation(pools):
    assert pools(2).run(_forward_only_zbv, 2, 3) == [3, 0]


# ------------------------------------------------------------ the full training step

def _zero_bubble_config(kind, t=1, p=1, d=1, model=MODEL, **train):
    config = _config(t, p, d, None, model, **train)
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                    pipeline_schedule=kind))


def trains_like_one_process(trainer, ctx, serial_config, iterations=5):
    """Train `trainer` and one process on `serial_config` for `iterations`:
    no step skipped, gradient norms, losses (where held) and final weights
    equal. Returns the trainer's records."""
    records = [trainer.step(i)[0] for i in range(iterations)]

    def serial_run():
        serial = Trainer(serial_config, ParallelContext.single(), torch.device("cpu"))
        serial_records = [serial.step(i)[0] for i in range(iterations)]
        return serial_records, _logical_weights(serial, ParallelContext.single())
    serial_records, serial_weights = computed_once(serial_run)
    for got, want in zip(records, serial_records):
        assert not got["skipped"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        if trainer.holds_loss:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    for name, weight in _logical_weights(trainer, ctx).items():
        assert_close(weight, serial_weights[name], **WEIGHT_TOL,
                     msg=lambda msg, name=name: f"{name}: {msg}")
    return records


def _trainer_vs_serial(rank, kind, distributed):
    ctx = ParallelContext.build(RankGrid(tp=2, dp=2, pp=2))
    config = _zero_bubble_config(kind, 2, 2, 2, use_distributed_optimizer=distributed)
    validate(config, world_size=8)
    trainer = Trainer(config, ctx, torch.device("cpu"))
    records = trains_like_one_process(trainer, ctx, _config(use_distributed_optimizer=distributed))
    # After the second iteration the exchanges were placed for the measured
    # times: the same table on every rank, the same computes in the same order.
    assert trainer.measured_costs is not None
    unit = build_schedule(kind, 2, trainer.num_micro, trainer.num_chunks)
    assert all(trainer.schedule.computes(r) == unit.computes(r) for r in range(2))
    everyone = [None] * 8
    torch.distributed.all_gather_object(everyone, trainer.measured_costs)
    assert all(costs == everyone[0] for costs in everyone)
    return trainer.holds_loss, records[-1]["loss"]


@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed-optimizer"])
@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_zero_bubble_trains_like_one_process(pools, kind, distributed):
    results = pools(8).run(_trainer_vs_serial, kind, distributed)
    holders = [loss for holds, loss in results if holds]
    assert len(holders) == 4 and all(math.isfinite(loss) for loss in holders)  # t·d loss ranks


def _model_weights(trainer, ctx):
    """Every logical weight of the model, from all pipeline ranks (the
    placements differ)."""
    everyone = [None] * ctx.grid.world_size
    torch.distributed.all_gather_object(everyone, _logical_weights(trainer, ctx))
    return {name: weight for weights in everyone for name, weight in weights.items()}


def _same_as_1f1b(rank, kind, model_changes, train_changes):
    """t = 2, p = 2 (4 processes): the zero-bubble run equals the 1F1B run.
    zb-h1, with dropout on, bitwise. zbv places the layers on other ranks,
    whose dropout streams differ, so without dropout, to rounding (the tied
    embedding's two gradients are summed in another order)."""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=2))
    dropout = 0.1 if kind == "zb-h1" else 0.0
    model = dataclasses.replace(MODEL, hidden_dropout=dropout, attention_dropout=dropout,
                                **model_changes)
    runs = {}
    for schedule in ("1f1b", kind):
        config = _zero_bubble_config(schedule, 2, 2, 1, model, train_iters=3, **train_changes)
        trainer = Trainer(config, ctx, torch.device("cpu"))
        records = [trainer.step(i)[0] for i in range(3)]
        runs[schedule] = (trainer, records)
    (base, base_records), (zb, zb_records) = runs["1f1b"], runs[kind]
    base_weights, zb_weights = _model_weights(base, ctx), _model_weights(zb, ctx)
    # fp16 under another placement: fp16 rounding of other sums (interleaved
    # and 1F1B differ by 1e-4 after 3 steps here, one process by 3e-3; weights
    # by up to two fp16 steps at magnitude 1, 2e-3).
    rel, atol = (1e-3, 2e-3) if kind == "zbv" and train_changes.get("fp16") else (1e-5, 1e-5)
    for got, want in zip(zb_records, base_records):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rel)
        assert got["loss_scale"] == want["loss_scale"] and got["skipped"] == want["skipped"]
    for name, weight in zb_weights.items():
        if kind == "zb-h1":
            assert torch.equal(weight, base_weights[name]), name
        else:
            assert_close(weight, base_weights[name], rtol=0.0, atol=atol)
    losses = {k: [r["loss"] for r in records] for k, (trainer, records) in runs.items()
              if trainer.holds_loss}
    return losses


COMPOSED = [
    ("full-recompute", dict(recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1), {}),
    ("selective-recompute", dict(recompute_granularity="selective"), {}),
    ("fp16", {}, dict(fp16=True, initial_loss_scale=2.0 ** 12)),
]


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
@pytest.mark.parametrize("name,model_changes,train_changes", COMPOSED, ids=[c[0] for c in COMPOSED])
def test_zero_bubble_composes_with_recompute_and_fp16(pools, kind, name, model_changes,
                                                     train_changes):
    results = pools(4).run(_same_as_1f1b, kind, model_changes, train_changes)
    losses = {schedule: run for rank_losses in results for schedule, run in rank_losses.items()}
    fp16_zbv = kind == "zbv" and train_changes.get("fp16")
    assert losses[kind] == pytest.approx(losses["1f1b"], rel=1e-3 if fp16_zbv else 1e-6)
    assert all(math.isfinite(x) for x in losses[kind])


# ------------------------------------------------------------ refused before launch

@pytest.mark.parametrize("kind,p,layers,batch,k,expected", [
    ("zbv", 1, 4, 8, None, "needs --pipeline-model-parallel-size >= 2"),
    ("zbv", 2, 6, 8, None, "2p = 4 equal chunks"),
    ("zbv", 2, 8, 8, 1, "--num-layers-per-virtual-pipeline-stage 1 disagrees: drop it or use 2"),
    ("zbv", 2, 8, 2, None, "needs at least 4 microbatches"),
    ("zb-h1", 4, 8, 2, None, "needs at least 4 microbatches"),
    ("zb-h1", 2, 8, 8, 2, "zb-h1 has one model chunk per rank"),
])
def test_zero_bubble_refusals_name_the_fix(kind, p, layers, batch, k, expected):
    config = _zero_bubble_config(kind, 1, p, 1, dataclasses.replace(MODEL, num_layers=layers),
                                 global_batch_size=batch)
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, num_layers_per_virtual_pipeline_stage=k))
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        validate(config, world_size=p)


def test_zbv_and_zero_bubble_kinds_reach_the_trainer():
    config = _zero_bubble_config("zbv", 1, 2, 1, global_batch_size=8)
    assert config.parallel.schedule_kind == "zbv"
    assert config.parallel.virtual_stages(MODEL.num_layers) == 2
    config = _zero_bubble_config("zbv", 1, 2, 1, global_batch_size=8)
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, num_layers_per_virtual_pipeline_stage=1))
    validate(config, world_size=2)  # 4 layers, 2p = 4 chunks of 1: agrees


# ------------------------------------------------------------ checkpoints

def train_leg(rank, save, leg, legs):
    """Leg `leg` of `legs` [(t, p, d, config)]: load the previous leg's
    checkpoint (after the first), train two iterations, save. Returns the
    losses on the rank that holds them."""
    from ptdp.checkpoint.store import read_metadata, resolve

    t, p, d, config = legs[leg]
    ctx = ParallelContext.build(RankGrid(tp=t, dp=d, pp=p))
    start = (0, 0)
    if leg:
        metadata = read_metadata(resolve(save))
        start = (metadata["iteration"], metadata["consumed_samples"])
    trainer = Trainer(config, ctx, torch.device("cpu"), start=start)
    if leg:
        trainer.load(save)
    records = [trainer.step(i)[0] for i in range(2 * leg, 2 * leg + 2)]
    trainer.save(save, 2 * leg + 2)
    return [r["loss"] for r in records] if trainer.holds_loss else None


def legs_equal_one_process(pools, save, legs):
    """The legs' losses are those of one process training straight; returns
    that one-process trainer."""
    serial = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    expected = [serial.step(i)[0]["loss"] for i in range(2 * len(legs))]
    got = []
    for leg, (t, p, d, _) in enumerate(legs):
        got += next(r for r in pools(t * p * d).run(train_leg, str(save), leg, legs) if r)
    assert got == pytest.approx(expected, rel=1e-5)
    return serial


def test_checkpoints_reshard_between_zero_bubble_layouts(pools, tmp_path):
    """zbv, t = 1, p = 2, d = 2 (rank 0 holds both ends of the V and one
    shared word embedding), then zb-h1, t = 2, p = 2 with the distributed
    optimizer, loading its checkpoint."""
    from ptdp.checkpoint.store import load_logical_model

    legs = [(1, 2, 2, _zero_bubble_config("zbv", 1, 2, 2)),
            (2, 2, 1, _zero_bubble_config("zb-h1", 2, 2, 1, use_distributed_optimizer=True))]
    serial = legs_equal_one_process(pools, tmp_path, legs)
    _, weights, metadata = load_logical_model(tmp_path)
    assert metadata["iteration"] == 4
    for name, param in serial.chunks[0].named_parameters():
        logical = gather_logical(param.detach(), getattr(param, SHARD_ATTR, None), None)
        assert_close(weights[name], logical, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
