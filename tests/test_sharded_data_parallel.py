"""Sharded data parallelism (issue 42): `--use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads` (ZeRO-2) trains as one
process does under every layout, over 5 AdamW steps with clipping (losses,
gradient norms, the weights' norm, final weights), with its gradients
reduce-scattered per microbatch as buckets complete and never held in full;
fp16 skips a step with an inf on one replica everywhere.

One pool of four processes runs every layout in one call, against the
one-process references the test computes once per model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from ptdp.parallel.sharded_grads import ShardedGradBuffer
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests import test_moe_parallel as moe
from tests import test_ptdp_step as step

CPU = torch.device("cpu")
STEPS = 5
MOE = dataclasses.replace(moe.MOE, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
MODELS = {"gpt": step.MODEL, "moe": MOE}


@dataclasses.dataclass(frozen=True)
class Layout:
    t: int = 1
    p: int = 1
    d: int = 4
    c: int = 1
    ep: int = 1
    k: int | None = None
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    model: str = "gpt"

    @property
    def name(self) -> str:
        return (f"t{self.t}p{self.p}d{self.d}c{self.c}ep{self.ep}-{self.schedule}"
                f"{'-sp' if self.sequence_parallel else ''}-{self.model}")


def _config(layout: Layout | None, strategy: str | None = "optim_grads", **train):
    layout = layout or Layout(d=1)
    fsdp = {} if strategy is None else dict(use_megatron_fsdp=True,
                                            data_parallel_sharding_strategy=strategy)
    config = step._config(layout.t, layout.p, layout.d, layout.k, MODELS[layout.model],
                          layout.sequence_parallel, **fsdp, **train)
    config.parallel = dataclasses.replace(config.parallel, context_parallel_size=layout.c,
                                          expert_model_parallel_size=layout.ep,
                                          pipeline_schedule=layout.schedule)
    return config


_serial: dict[str, tuple] = {}


def _one_process(model: str):
    if model not in _serial:
        trainer = Trainer(_config(Layout(d=1, model=model), strategy=None), ParallelContext.single(),
                          CPU)
        records = [trainer.step(i)[0] for i in range(STEPS)]
        assert any(r["grad_norm"] > step.TRAIN.clip_grad for r in records)  # clipping acts
        _serial[model] = records, step._logical_weights(trainer, ParallelContext.single())
    return _serial[model]


def _layouts_vs_one_process(rank: int, layouts: list[Layout], references: dict) -> list:
    results = []
    for layout in layouts:
        records, weights = references[layout.model]
        ctx = ParallelContext.build(RankGrid(tp=layout.t, dp=layout.d, pp=layout.p, cp=layout.c,
                                             ep=layout.ep))
        trainer = Trainer(_config(layout), ctx, CPU)
        assert isinstance(trainer.buffer, ShardedGradBuffer) and trainer.buffer.grad_data is None
        for i, want in enumerate(records):
            got = trainer.step(i)[0]
            assert not got["skipped"], layout.name
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), layout.name
            assert got["params_norm"] == pytest.approx(want["params_norm"], rel=1e-6), layout.name
            if trainer.holds_loss:
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), layout.name
        worst, compared = 0.0, set()
        for name, weight in step._logical_weights(trainer, ctx).items():
            assert_close(weight, weights[name], **step.WEIGHT_TOL,
                         msg=lambda m, n=name: f"{layout.name}: {n}: {m}")
            worst, _ = max(worst, (weight - weights[name]).abs().max().item()), compared.add(name)
        results.append((layout.name, compared, worst, trainer.buffer.peak_full_grad_bytes,
                        len(trainer.buffer.buckets), trainer.buffer.numel * 4))
        del trainer
        ctx.destroy()
    return results


LAYOUTS = [
    Layout(d=4),
    Layout(t=2, d=2, sequence_parallel=True),
    Layout(p=2, d=2),
    Layout(p=2, d=2, k=1),
    Layout(p=2, d=2, schedule="zbv"),
    Layout(c=2, d=2),
    Layout(d=4, ep=2, model="moe"),
]


def test_zero_2_trains_like_one_process_under_every_layout(pools):
    references = {layout.model: _one_process(layout.model) for layout in LAYOUTS}
    per_rank = pools(4).run(_layouts_vs_one_process, LAYOUTS, references)
    for i, layout in enumerate(LAYOUTS):
        names = set().union(*(results[i][1] for results in per_rank))
        assert names == set(references[layout.model][1]), layout.name
        assert max(results[i][2] for results in per_rank) < 1e-5, layout.name
        for _, _, _, peak, buckets, full in (results[i] for results in per_rank):
            # The full gradients held at once: the buckets being filled and
            # those being reduced (at most IN_FLIGHT), and the tied embedding's,
            # never the whole buffer ZeRO-1 keeps; at most half of it where a
            # rank has 16 buckets or more (these buckets: ~4,000 elements).
            assert 0 < peak < full, (layout.name, peak, full)
            if buckets >= 16:
                assert peak <= full / 2, (layout.name, peak, full)


def _skipped_step(rank: int) -> list:
    """fp16, d = 2: an inf in one replica's gradient shard skips the step on
    every rank, halves the scale and changes no weight."""
    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=1))
    trainer = Trainer(_config(Layout(d=2), fp16=True, initial_loss_scale=1024.0, hysteresis=1),
                      ctx, CPU)
    records = [trainer.step(0)[0]]
    before = trainer.buffer.param_data.clone()
    finish = trainer.buffer.finish

    def finish_then_inject():
        finish()
        if rank == 1:
            trainer.buffer.grad_shard[7] = float("inf")

    trainer.buffer.finish = finish_then_inject
    records.append(trainer.step(1)[0])
    trainer.buffer.finish = finish
    assert torch.equal(trainer.buffer.param_data, before)
    records.append(trainer.step(2)[0])
    assert not torch.equal(trainer.buffer.param_data, before)
    ctx.destroy()
    return [(r["skipped"], r["loss_scale"]) for r in records]


def test_fp16_overflow_on_one_replica_skips_the_step_everywhere(pools):
    for result in pools(2).run(_skipped_step):
        assert result == [(False, 1024.0), (True, 1024.0), (False, 512.0)]
