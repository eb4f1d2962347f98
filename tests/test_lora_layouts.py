"""LoRA trains as one process does, under every layout (issue 41's acceptance).

A Llama-style model (adapters on attention and the MLP) and an MoE model
(adapters on attention, each routed expert and the shared expert; or one
adapter per matrix shared by a layer's routed experts) fine-tune on packed
conversations (the --sft data path) for three AdamW steps. Under each
layout the losses, gradient norms, first gradients of every adapter and
final adapter weights equal the one-process run's; every base parameter
ends bitwise equal to its initial value, on every rank; and the gradient
buffers hold the adapters only.

One pool of four processes runs every layout in one call, against the
one-process references the test computes once per model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config.lora import LoRAConfig
from ptdp.parallel.sharding import SHARD_ATTR, gather_logical, shard_group
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests import test_context_parallel as cp
from tests import test_ptdp_step as step
from tests import test_sft_layouts as sft

CPU = torch.device("cpu")
STEPS = sft.STEPS
GRAD_TOL = sft.GRAD_TOL
ADAPTERS = {
    "all": LoRAConfig(lora_rank=4, lora_alpha=8.0),
    # layers 1-3 only: layer 0 (and under p = 2 a whole stage) has none
    "some": LoRAConfig(lora_rank=4, lora_alpha=8.0,
                       lora_target_modules=["*.layers.[1-3].*", "linear_proj"]),
    "shared": LoRAConfig(lora_rank=4, lora_alpha=8.0, lora_share_expert_adapters=True),
}


@dataclasses.dataclass(frozen=True)
class Case:
    layout: sft.Layout
    adapters: str = "all"
    sharding: str | None = None  # --use-megatron-fsdp's --data-parallel-sharding-strategy

    @property
    def name(self) -> str:
        return f"{self.layout.name}-{self.adapters}" + (f"-{self.sharding}" if self.sharding else "")

    @property
    def reference(self) -> tuple[str, str]:
        return self.layout.model, self.adapters


def _trainer(case: Case, ctx: ParallelContext) -> Trainer:
    config = sft._config(case.layout, sft.PACKS)
    config.lora = ADAPTERS[case.adapters]
    if case.sharding:
        config.train = dataclasses.replace(config.train, use_megatron_fsdp=True,
                                           data_parallel_sharding_strategy=case.sharding)
    return Trainer(config, ctx, CPU, data=sft.TrainingData(train=sft._packed(), eod=sft.PAD))


def _logical(trainer: Trainer, ctx: ParallelContext) -> tuple[dict, dict]:
    """(every parameter's logical value, every trained one's gradient as the
    optimizer steps it), gathered over the tensor shards."""
    weights, grads = {}, {}
    segments = {id(s.param): s for s in trainer.buffer.segments}
    with trainer.buffer.gathered():  # (ZeRO-3: the parameters whole while read, copied)
        for chunk in trainer.chunks:
            for name, param in chunk.named_parameters():
                spec, group = getattr(param, SHARD_ATTR, None), shard_group(param, ctx)
                weights[name] = gather_logical(param.detach().float().clone(), spec, group)
    for chunk in trainer.chunks:
        for name, param in chunk.named_parameters():
            spec, group = getattr(param, SHARD_ATTR, None), shard_group(param, ctx)
            if id(param) in segments and trainer.buffer.grad_data is not None:  # (ZeRO-2/3: none)
                segment = segments[id(param)]
                grad = trainer.buffer.grad_data[segment.start:segment.end].view(param.shape)
                grads[name] = gather_logical(grad.clone(), spec, group)
    return weights, grads


def _run(trainer: Trainer, ctx: ParallelContext, gradients: bool = True):
    """Three steps: the records, the first step's gradients, the final weights."""
    records = [trainer.step(0)[0]]
    first = _logical(trainer, ctx)[1] if gradients else {}
    records += [trainer.step(i)[0] for i in range(1, STEPS)]
    return records, first, _logical(trainer, ctx)[0]


_serial: dict[tuple, tuple] = {}


def _one_process(model: str, adapters: str):
    """A model's one-process run with these adapters, and its initial weights.
    Checked here: only adapters train, their B starts at zero, the base
    stays as it was drawn, and the adapters change the loss after a step."""
    key = (model, adapters)
    if key not in _serial:
        ctx = ParallelContext.single()
        trainer = _trainer(Case(sft.Layout(model=model), adapters), ctx)
        initial = _logical(trainer, ctx)[0]
        trained = {s.param for s in trainer.buffer.segments}
        names = {name for chunk in trainer.chunks for name, p in chunk.named_parameters()
                 if p in trained}
        assert names and all(".lora." in n or ".experts_adapter." in n for n in names), key
        assert all(initial[n].count_nonzero() == 0 for n in names if n.endswith(".B")), key
        records, first, final = _run(trainer, ctx)
        assert all(first[n].abs().max() > 0 for n in names if n.endswith(".B")), key
        for name, weight in final.items():
            assert (name in names) != torch.equal(weight, initial[name]), (key, name)
        assert records[2]["loss"] != pytest.approx(records[0]["loss"], rel=1e-4), key
        _serial[key] = records, first, final, initial
    return _serial[key]


def _cases_vs_one_process(rank: int, cases: list[Case], references: dict) -> list[tuple]:
    """Each case against `references` ((model, adapters) -> _one_process's):
    (name, the parameters this rank compared, the largest weight difference)."""
    results = []
    for case in cases:
        records, first, final, initial = references[case.reference]
        layout = case.layout
        ctx = ParallelContext.build(RankGrid(tp=layout.t, dp=layout.d, pp=layout.p, cp=layout.c,
                                             ep=layout.ep))
        trainer = _trainer(case, ctx)
        got, grads, weights = _run(trainer, ctx,
                                   gradients=not layout.distributed and not case.sharding)
        if case.sharding == ZERO_3:  # the frozen base sharded too: 1/d of it kept
            _base_is_sharded(trainer, ctx, case.name)
        for name, grad in grads.items():  # (sharded optimizer: each rank holds a part)
            cp._close(grad, first[name], GRAD_TOL, f"{case.name}: {name} gradient")
        for record, want in zip(got, records):
            assert not record["skipped"], case.name
            assert record["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), case.name
            if trainer.holds_loss:
                assert record["loss"] == pytest.approx(want["loss"], rel=1e-5), case.name
        worst = 0.0
        for name, weight in weights.items():
            if ".lora." in name or ".experts_adapter." in name:
                torch.testing.assert_close(weight, final[name], **step.WEIGHT_TOL,
                                           msg=lambda m, n=name: f"{case.name}: {n}: {m}")
                worst = max(worst, (weight - final[name]).abs().max().item())
            else:
                assert torch.equal(weight, initial[name]), (case.name, name)
        results.append((case.name, set(weights), worst))
        del trainer
        ctx.destroy()
    return results


def _base_is_sharded(trainer: Trainer, ctx: ParallelContext, name: str) -> None:
    """ZeRO-3: between iterations no parameter is whole, and a rank keeps
    its share of the frozen base: 1/(d·c) of the dense part, 1/edp of the
    routed experts', but for each bucket's padding."""
    from ptdp.parallel.sharding import is_expert

    frozen = [p for chunk in trainer.chunks for p in chunk.parameters() if not p.requires_grad]
    dense = sum(p.numel() for p in frozen if not is_expert(p))
    experts = sum(p.numel() for p in frozen if is_expert(p))
    kept = trainer.buffer.frozen_shards.numel()
    share = dense / (ctx.dp_size * ctx.cp_size) + experts / ctx.edp_size
    assert trainer.buffer.full_param_bytes == 0, name
    assert share <= kept <= share + 2 * ctx.dp_size * len(trainer.buffer._unit_buckets), \
        (name, kept, share)


ZERO_3 = "optim_grads_params"
Layout = sft.Layout
CASES = [
    Case(Layout(t=2, d=2, sequence_parallel=True, recompute="selective")),
    Case(Layout(p=2, d=2, schedule="interleaved", k=1, recompute="full"), "some"),
    Case(Layout(t=2, p=2, schedule="zbv", sequence_parallel=True)),
    Case(Layout(c=2, d=2)),
    Case(Layout(d=4, distributed=True, model="moe")),
    Case(Layout(d=4, ep=2, model="moe")),
    Case(Layout(t=2, d=2, sequence_parallel=True, model="moe")),
    Case(Layout(t=2, d=2, ep=2, sequence_parallel=True, model="moe"), "shared"),
    # ZeRO-3: the base sharded with the adapters; "some": a stage without adapters
    Case(Layout(p=2, d=2), "some", sharding=ZERO_3),
    Case(Layout(d=4, ep=2, model="moe"), sharding=ZERO_3),
]


def test_lora_trains_as_one_process_under_every_layout(pools):
    references = {case.reference: _one_process(*case.reference) for case in CASES}
    per_rank = pools(4).run(_cases_vs_one_process, CASES, references)
    for i, case in enumerate(CASES):
        names = set().union(*(results[i][1] for results in per_rank))
        assert names == set(references[case.reference][3]), case.name  # every parameter, some rank
        assert max(results[i][2] for results in per_rank) < 1e-5, case.name


# ------------------------------------------------------------------ one process: precision, kernels

def _one_process_run(adapters: str, model: str = "rotary", **settings):
    """Three steps of a one-process LoRA run with some settings changed."""
    ctx = ParallelContext.single()
    config = sft._config(sft.Layout(model=model), sft.PACKS)
    config.lora = ADAPTERS[adapters]
    model_settings = {k: v for k, v in settings.items() if k.startswith("moe_")}
    config.model = dataclasses.replace(config.model, **model_settings)
    config.train = dataclasses.replace(config.train, **{k: v for k, v in settings.items()
                                                         if k not in model_settings})
    trainer = Trainer(config, ctx, CPU, data=sft.TrainingData(train=sft._packed(), eod=sft.PAD))
    before = {name: p.detach().clone() for chunk in trainer.chunks
              for name, p in chunk.named_parameters() if not p.requires_grad}
    records = [trainer.step(i)[0] for i in range(STEPS)]
    after = {name: p for chunk in trainer.chunks for name, p in chunk.named_parameters()}
    assert all(torch.equal(after[name], value) for name, value in before.items())
    return records, trainer


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lora_in_half_precision_follows_fp32_to_its_rounding(precision):
    """bf16/fp16: the frozen base held in the half type (no fp32 copy: it
    never steps), the adapters with fp32 main weights and Adam states; the
    losses follow the fp32 run's to half precision's rounding, no step skipped."""
    if "fp32" not in _serial:
        _serial["fp32"] = _one_process_run("all")[0]
    want = _serial["fp32"]
    got, trainer = _one_process_run("all", **{precision: True}, initial_loss_scale=2.0 ** 12)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    frozen = [p for chunk in trainer.chunks for p in chunk.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == dtype for p in frozen)
    assert trainer.optimizer.main.dtype == torch.float32
    assert trainer.optimizer.main.numel() == trainer.buffer.numel  # the adapters only
    for record, reference in zip(got, want):
        assert not record["skipped"]
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-2)


def test_lora_on_attention_keeps_grouped_expert_products_and_their_numbers():
    """Frozen experts under --moe-grouped-gemm (adapters on attention only):
    the grouped products compute no weight gradient and the run equals the
    one-product-per-expert run; adapted experts run one product each."""
    from ptdp.model.grouped_experts import grouped_gemm_used

    if not grouped_gemm_used((32, 32, 64), torch.float32):
        pytest.skip("this torch has no grouped_mm")
    ADAPTERS["attention"] = LoRAConfig(lora_rank=4, lora_alpha=8.0,
                                       lora_target_modules=["*.self_attention.*"])
    want, _ = _one_process_run("attention", model="moe")
    got, trainer = _one_process_run("attention", model="moe", moe_grouped_gemm=True)
    assert all(layer.grouped_gemm for layer in trainer.moe_layers)
    for record, reference in zip(got, want):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    _, adapted = _one_process_run("all", model="moe", moe_grouped_gemm=True)
    assert not any(layer.grouped_gemm for layer in adapted.moe_layers)
