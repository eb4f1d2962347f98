"""Sharded data parallelism (issue 42): `--use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads` (ZeRO-2) and
`optim_grads_params` (ZeRO-3) train as one process does under every layout
(d = 2 and 4, t = 2 with SP, p = 2 under 1F1B, interleaving and zbv with
both reshard policies, c = 2, EP = 2 over d = 2 and 4, recomputation), over 3
AdamW steps with clipping in each (losses, gradient norms, the weights' norm,
final weights: the sharded Adam state read back twice), with their
gradients reduce-scattered per microbatch as buckets complete and never
held in full; ZeRO-3 keeps 1/(d·c) of the state. fp16
skips a step with an inf on one replica everywhere; a resume under the
same strategy is bitwise, and a ZeRO-3 checkpoint resumes under ZeRO-1 and
in one process. With --main-grads-dtype bf16 (every gradient buffer bf16,
the optimizer's state fp32) plain data parallelism, ZeRO-1 (with t = 2),
ZeRO-2 (with EP = 2) and ZeRO-3 (with p = 2) train as one bf16 process
with bf16 main gradients does, to bf16's rounding, and resume exactly.

One pool of four processes runs the layouts in one call (and one of two
those at d = 2), against the one-process references the test computes once
per model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from ptdp.parallel.sharded_grads import ShardedGradBuffer
from ptdp.parallel.sharded_params import ShardedParamBuffer
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests import test_moe_parallel as moe
from tests import test_ptdp_step as step

CPU = torch.device("cpu")
STEPS = 3
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
    strategy: str = "optim_grads"
    reshard: bool = True          # optim_grads_params: --fsdp-reshard-after-forward
    recompute: str | None = None
    main_grads: str = "fp32"      # bf16: --bf16 --main-grads-dtype bf16 (its one process too)

    @property
    def name(self) -> str:
        return (f"{self.strategy}-t{self.t}p{self.p}d{self.d}c{self.c}ep{self.ep}-{self.schedule}"
                f"{'-sp' if self.sequence_parallel else ''}-{self.model}"
                f"{'' if self.reshard else '-kept'}{'-' + self.recompute if self.recompute else ''}"
                f"{'-bf16grads' if self.bf16_grads else ''}")

    @property
    def bf16_grads(self) -> bool:
        return self.main_grads == "bf16"


def _config(layout: Layout, sharded: bool = True, **train):
    fsdp = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=layout.strategy,
                fsdp_reshard_after_forward=layout.reshard) if sharded else {}
    model = dataclasses.replace(MODELS[layout.model], recompute_granularity=layout.recompute)
    if layout.bf16_grads:
        train = dict(bf16=True, main_grads_dtype="bf16", **train)
    config = step._config(layout.t, layout.p, layout.d, layout.k, model,
                          layout.sequence_parallel, **fsdp, **train)
    config.parallel = dataclasses.replace(config.parallel, context_parallel_size=layout.c,
                                          expert_model_parallel_size=layout.ep,
                                          pipeline_schedule=layout.schedule)
    return config


_serial: dict[tuple[str, str], tuple] = {}


def _one_process(model: str, main_grads: str = "fp32"):
    if (model, main_grads) not in _serial:
        trainer = Trainer(_config(Layout(d=1, model=model, main_grads=main_grads), sharded=False),
                          ParallelContext.single(), CPU)
        records = [trainer.step(i)[0] for i in range(STEPS)]
        assert all(r["grad_norm"] > step.TRAIN.clip_grad for r in records)  # clipping acts
        _serial[model, main_grads] = records, step._logical_weights(trainer,
                                                                    ParallelContext.single())
    return _serial[model, main_grads]


# bf16 main gradients (bf16 model, gradients accumulated and reduced in bf16)
# against one bf16 process: the layouts' bf16 products and bf16 sums of
# other shapes and orders round differently (bf16 keeps 8 bits), and Adam's
# normalised step turns a gradient element's rounding into up to lr of its
# weight; the losses and norms agree to well under 1%.
BF16_TOL = dict(loss=1e-3, grad_norm=1e-2, params_norm=1e-4, weight=dict(rtol=0.0, atol=3e-2))
FP32_TOL = dict(loss=1e-5, grad_norm=1e-5, params_norm=1e-6, weight=step.WEIGHT_TOL)


def _persistent_bytes(trainer: Trainer) -> int:
    """The bytes a rank holds across iterations for its parameters,
    gradients and optimizer state (ZeRO-3: the shards)."""
    buffer = trainer.buffer
    params = getattr(buffer, "param_shards", buffer.param_data)
    grads = buffer.grad_shard if buffer.grad_data is None else buffer.grad_data
    return params.nbytes + grads.nbytes + trainer.optimizer.state_bytes


def _layouts_vs_one_process(rank: int, layouts: list[Layout], references: dict) -> list:
    results = []
    for layout in layouts:
        records, weights = references[layout.model, layout.main_grads]
        tol = BF16_TOL if layout.bf16_grads else FP32_TOL
        ctx = ParallelContext.build(RankGrid(tp=layout.t, dp=layout.d, pp=layout.p, cp=layout.c,
                                             ep=layout.ep))
        trainer = Trainer(_config(layout), ctx, CPU)
        # (optim: ZeRO-1, the distributed optimizer; no_shard: plain data parallelism)
        shards_grads = layout.strategy not in ("optim", "no_shard")
        assert isinstance(trainer.buffer, ShardedGradBuffer) == shards_grads
        assert (trainer.buffer.grad_data is None) == shards_grads
        assert isinstance(trainer.buffer, ShardedParamBuffer) == (layout.strategy == ZERO_3)
        _check_main_grads_dtype(trainer, layout)
        for i, want in enumerate(records):
            got = trainer.step(i)[0]
            assert not got["skipped"], layout.name
            for key in ("grad_norm", "params_norm") + (("loss",) if trainer.holds_loss else ()):
                assert got[key] == pytest.approx(want[key], rel=tol[key]), (layout.name, key)
        worst, compared = 0.0, set()
        with trainer.buffer.gathered():  # (ZeRO-3: the parameters whole while read, copied)
            logical = {n: w.clone() for n, w in step._logical_weights(trainer, ctx).items()}
        for name, weight in logical.items():
            assert_close(weight, weights[name], **tol["weight"],
                         msg=lambda m, n=name: f"{layout.name}: {n}: {m}")
            worst, _ = max(worst, (weight - weights[name]).abs().max().item()), compared.add(name)
        _check_main_grads_dtype(trainer, layout)
        peak = trainer.buffer.peak_full_grad_bytes if shards_grads else None
        results.append((layout.name, compared, worst, peak,
                        len(trainer.buffer.buckets), trainer.buffer.numel * 4,
                        _persistent_bytes(trainer), _persistent_bytes(Trainer(
                            _config(layout, sharded=False), ctx, CPU))))
        del trainer
        ctx.destroy()
    return results


def _check_main_grads_dtype(trainer: Trainer, layout: Layout) -> None:
    """Every gradient buffer the rank holds is in the main gradients'
    dtype: 2 bytes an element for bf16 ones (the full buffer under ZeRO-1,
    the shard, the buckets a ZeRO-2/3 rank holds), and the optimizer's
    weights and moments stay fp32."""
    buffer, dtype = trainer.buffer, torch.bfloat16 if layout.bf16_grads else torch.float32
    size = 2 if layout.bf16_grads else 4
    held = [buffer.grad_data, buffer.grad_shard] + [b.grads for b in buffer.buckets]
    for grads in (g for g in held if g is not None):
        assert grads.dtype == dtype and grads.nbytes == grads.numel() * size, layout.name
    assert (buffer.grad_shard if buffer.shard else buffer.grad_data).numel() > 0, layout.name
    optimizer = trainer.optimizer
    assert {t.dtype for t in (optimizer.main, optimizer.exp_avg, optimizer.exp_avg_sq)} == \
        {torch.float32}, layout.name


ZERO_3 = "optim_grads_params"
LAYOUTS = [
    Layout(d=4),
    Layout(t=2, d=2, sequence_parallel=True),
    Layout(p=2, d=2),
    Layout(p=2, d=2, k=1, recompute="full"),
    Layout(p=2, d=2, schedule="zbv"),
    Layout(c=2, d=2),
    Layout(d=4, ep=2, model="moe"),
    Layout(d=4, strategy=ZERO_3),
    Layout(t=2, d=2, sequence_parallel=True, strategy=ZERO_3, recompute="full"),
    Layout(p=2, d=2, strategy=ZERO_3),
    Layout(p=2, d=2, k=1, strategy=ZERO_3, reshard=False),
    Layout(p=2, d=2, schedule="zbv", strategy=ZERO_3),
    Layout(c=2, d=2, strategy=ZERO_3, recompute="selective"),
    Layout(d=4, ep=2, model="moe", strategy=ZERO_3),
    # bf16 main gradients: ZeRO-1 with t = 2 and SP, ZeRO-3 with p = 2, ZeRO-2 with EP = 2.
    Layout(t=2, d=2, sequence_parallel=True, strategy="optim", main_grads="bf16"),
    Layout(p=2, d=2, strategy=ZERO_3, main_grads="bf16"),
    Layout(d=4, ep=2, model="moe", main_grads="bf16"),
]


# At d = 2 (the pool of two): data parallelism alone, and EP = 2 over it.
LAYOUTS_AT_2 = [
    Layout(d=2),
    Layout(d=2, strategy=ZERO_3),
    Layout(d=2, ep=2, model="moe"),
    Layout(d=2, ep=2, model="moe", strategy=ZERO_3),
    Layout(d=2, strategy="optim", main_grads="bf16"),   # the distributed optimizer, bf16 main grads
    Layout(d=2, strategy="no_shard", main_grads="bf16"),   # plain data parallelism
]


@pytest.mark.parametrize("world", [4, 2])
def test_zero_2_and_3_train_like_one_process_under_every_layout(pools, world):
    layouts = LAYOUTS if world == 4 else LAYOUTS_AT_2
    references = {(layout.model, layout.main_grads): _one_process(layout.model, layout.main_grads)
                  for layout in layouts}
    per_rank = pools(world).run(_layouts_vs_one_process, layouts, references)
    for i, layout in enumerate(layouts):
        names = set().union(*(results[i][1] for results in per_rank))
        assert names == set(references[layout.model, layout.main_grads][1]), layout.name
        worst = max(results[i][2] for results in per_rank)
        assert worst < (BF16_TOL if layout.bf16_grads else FP32_TOL)["weight"]["atol"], layout.name
        for _, _, _, peak, buckets, full, persistent, replicated in (r[i] for r in per_rank):
            if peak is None:   # ZeRO-1 or none: a full gradient buffer by design
                continue
            if layout.strategy == ZERO_3 and layout.model == "gpt":
                # 1/(d·c) of the replicated state, but for each bucket's padding
                # (under d - 1 elements); the MoE's experts shard over fewer ranks.
                shards = layout.d * layout.c
                padding = 1 + shards * 16 * buckets / replicated
                assert replicated / shards <= persistent <= replicated / shards * padding, \
                    (layout.name, persistent, replicated)
            # The full gradients held at once: the buckets being filled and
            # those being reduced (at most IN_FLIGHT), and the tied embedding's,
            # never the whole buffer ZeRO-1 keeps; at most half of it where a
            # rank has 16 buckets or more (these buckets: ~4,000 elements).
            assert 0 < peak < full, (layout.name, peak, full)
            if buckets >= 16:
                assert peak <= full / 2, (layout.name, peak, full)


@pytest.mark.parametrize("strategy", ["optim_grads", ZERO_3])
def test_fp16_overflow_on_one_replica_skips_the_step_everywhere(pools, strategy):
    for result in pools(2).run(step._overflow, use_megatron_fsdp=True,
                               data_parallel_sharding_strategy=strategy):
        assert result == [(False, 1024.0), (True, 1024.0), (False, 512.0)]


def test_a_zero_3_checkpoint_resumes_under_zero_1_and_in_one_process(tmp_path):
    """Saved at d = 4 under optim_grads_params, resumed at t = 2, d = 2 with
    the distributed optimizer and in one process: the losses go on as the
    run that never stopped (the same logical checkpoint under any strategy)."""
    import json

    from ptdp.cli import main

    model = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
             "4", "--seq-length", "16", "--vocab-size", "64", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--lr", "1e-2", "--train-iters", "4", "--ddp-bucket-size", "1000"]

    def losses(name: str, *flags: str) -> list[float]:
        metrics = tmp_path / f"{name}.jsonl"
        assert main(["train", *model, "--metrics-file", str(metrics), *flags]) == 0
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    straight = losses("straight")
    first = losses("zero3", "--use-megatron-fsdp", "--data-parallel-size", "4",
                   "--exit-interval", "2", "--save", str(tmp_path / "ck"))
    assert first == pytest.approx(straight[:2], rel=1e-5)
    resumed = [losses("zero1", "--load", str(tmp_path / "ck"), "--tensor-model-parallel-size", "2",
                      "--data-parallel-size", "2", "--use-distributed-optimizer"),
               losses("one", "--load", str(tmp_path / "ck"))]
    for run in resumed:
        assert run == pytest.approx(straight[2:], rel=1e-5)


def _resume_under_the_same_strategy(rank: int, save: str, layouts: list[Layout]) -> list:
    """Two steps, a save, two more; a new trainer loads the save and takes
    the same two: (layout, whether its records and final state equal the
    uninterrupted trainer's bitwise) for each layout."""
    results = []
    for layout in layouts:
        ctx = ParallelContext.build(RankGrid(tp=layout.t, dp=layout.d, pp=layout.p))
        directory = f"{save}/{layout.name}"
        straight = Trainer(_config(layout), ctx, CPU)
        for i in range(2):
            straight.step(i)
        straight.save(directory, 2)
        resumed = Trainer(_config(layout), ctx, CPU, start=(2, straight.consumed_before(2)))
        resumed.load(directory)
        same = True
        for i in range(2, 4):
            want, got = straight.step(i)[0], resumed.step(i)[0]
            same &= all(got[key] == want[key] for key in ("loss", "grad_norm", "params_norm"))
        for a, b in ((straight.buffer, resumed.buffer), (straight.optimizer, resumed.optimizer)):
            for name in ("param_shards", "param_data", "grad_shard", "main", "exp_avg",
                         "exp_avg_sq"):
                if hasattr(a, name):
                    same &= torch.equal(getattr(a, name), getattr(b, name))
        results.append((layout.name, same))
        ctx.destroy()
    return results


def test_a_resume_under_the_same_strategy_is_exact(pools, tmp_path):
    """(With bf16 main gradients too: their buffers are not saved, each
    iteration starts them at zero, and the fp32 state resumes exactly.)"""
    layouts = [Layout(d=4), Layout(p=2, d=2, strategy=ZERO_3),
               Layout(d=4, strategy="optim", main_grads="bf16")]
    for results in pools(4).run(_resume_under_the_same_strategy, str(tmp_path), layouts):
        assert results == [(layout.name, True) for layout in layouts]


def _default_buckets(rank: int) -> tuple[int, int]:
    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=1))
    trainer = Trainer(_config(Layout(d=2), ddp_bucket_size=40_000_000), ctx, CPU)
    trainer.step(0)
    result = trainer.buffer.peak_full_grad_bytes, trainer.buffer.numel * 4
    ctx.destroy()
    return result


def test_zero_2_holds_less_than_zero_1s_gradients_with_the_default_bucket_size(pools):
    """A bucket is one layer's parameters whatever --ddp-bucket-size allows:
    the full gradients held at once (a layer being filled, two being reduced,
    the tied embedding's) stay below ZeRO-1's whole buffer."""
    for peak, full in pools(2).run(_default_buckets):
        assert 0 < peak < full, (peak, full)
