"""Low-rank adapters on the tensor-parallel linear layers (issue 41, first
step: the layer; flags, freezing, checkpoints and PEFT files come next).

- One process: a column- and a row-parallel layer with an adapter compute
  what peft's LoRA layer computes on the same nn.Linear, forward and every
  gradient (input, A, B), with lora_alpha / r as the scale.
- t = 2, with and without sequence parallelism: the sharded adapters (column
  base: A whole, B split by the base's blocks; row base: A split, B whole)
  give the one-process output and gradients, the partial gradients summed
  over the tensor group as training sums them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ptdp.parallel.lora import LoRA, attach
from ptdp.parallel.sharding import (PARTIAL_GRAD_ATTR, SHARD_ATTR, TensorShard,
                                    gather_logical, shard)
from ptdp.parallel.tensor import (ColumnParallelLinear, RowParallelLinear,
                                  gather_from_sequence_region, sum_partial_grads)
from ptdp.parallel.topology import ParallelContext, RankGrid

IN, OUT, RANK, ALPHA = 12, 18, 4, 8.0
BLOCKS = 3            # the column layer's output as three blocks (q, k, v)
SEQ, BATCH = 6, 2


def _logical(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    return {"column.weight": draw(OUT, IN), "column.bias": draw(OUT), "column.A": draw(RANK, IN),
            "column.B": draw(OUT, RANK), "row.weight": draw(IN, OUT), "row.bias": draw(IN),
            "row.A": draw(RANK, OUT), "row.B": draw(IN, RANK),
            "column.x": draw(SEQ, BATCH, IN), "column.grad": draw(SEQ, BATCH, OUT),
            "row.x": draw(SEQ, BATCH, OUT), "row.grad": draw(SEQ, BATCH, IN)}


def _layers(ctx: ParallelContext, values: dict, sequence_parallel: bool = False):
    """A column-parallel (h -> out, three blocks) and a row-parallel (out -> h)
    layer with adapters, from the logical values, sharded for this rank."""
    column = ColumnParallelLinear(IN, OUT, ctx, blocks=BLOCKS, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(OUT, IN, ctx, sequence_parallel=sequence_parallel)
    for name, layer in (("column", column), ("row", row)):
        lora = attach(layer, RANK, ALPHA)
        with torch.no_grad():
            for param, key in ((layer.weight, "weight"), (layer.bias, "bias"),
                               (lora.A, "A"), (lora.B, "B")):
                spec = getattr(param, SHARD_ATTR, None)
                full = values[f"{name}.{key}"]
                param.copy_(full if spec is None else shard(full, spec))
    return column, row


# ------------------------------------------------------------------ against peft

def _peft_linear(weight, bias, a, b, alpha=ALPHA):
    peft = pytest.importorskip("peft")

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(weight.shape[1], weight.shape[0])

    holder = Holder()
    with torch.no_grad():
        holder.proj.weight.copy_(weight)
        holder.proj.bias.copy_(bias)
    model = peft.get_peft_model(holder, peft.LoraConfig(r=RANK, lora_alpha=alpha,
                                                        target_modules=["proj"], lora_dropout=0.0))
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
    return layer, layer.lora_A["default"].weight, layer.lora_B["default"].weight


@pytest.mark.parametrize("kind", ["column", "row"])
def test_an_adapted_layer_computes_what_peft_computes(kind):
    values = _logical()
    ctx = ParallelContext.single()
    column, row = _layers(ctx, values)
    ours = column if kind == "column" else row
    x = values[f"{kind}.x"]
    theirs, a, b = _peft_linear(values[f"{kind}.weight"], values[f"{kind}.bias"],
                                values[f"{kind}.A"], values[f"{kind}.B"])
    assert theirs.scaling["default"] == ours.lora.scale == ALPHA / RANK
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = ours(x_ours), theirs(x_theirs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    for mine, peft_grad, what in ((x_ours.grad, x_theirs.grad, "input"),
                                  (ours.lora.A.grad, a.grad, "A"),
                                  (ours.lora.B.grad, b.grad, "B")):
        torch.testing.assert_close(mine, peft_grad, rtol=1e-5, atol=1e-6, msg=what)
    # The adapter changed the layer: without it the output differs.
    ours.lora = None
    assert not torch.allclose(ours(x), want, atol=1e-3)


def test_b_starts_at_zero_so_the_adapted_layer_starts_as_the_base():
    ctx = ParallelContext.single()
    layer = ColumnParallelLinear(IN, OUT, ctx)
    lora = attach(layer, RANK, ALPHA)
    from ptdp.parallel.sharding import initialize_parameters

    initialize_parameters(layer, seed=3)
    assert torch.count_nonzero(lora.B) == 0 and torch.count_nonzero(lora.A) > 0
    x = torch.randn(SEQ, BATCH, IN)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), expected)
    # peft's default A: kaiming_uniform_(a=√5), bound 1/√in: variance 1/(3·in).
    assert lora.A.var().item() == pytest.approx(1 / (3 * IN), rel=0.5)


def test_a_rank_larger_than_the_layer_is_refused():
    layer = RowParallelLinear(OUT, IN, ParallelContext.single())
    with pytest.raises(ValueError, match=f"larger than the layer it adapts .* use at most {IN}"):
        LoRA(layer, IN + 1, 1.0, 0.0, column=False)
    with pytest.raises(TypeError, match="not Linear"):
        attach(nn.Linear(2, 2), 1, 1.0)


# ------------------------------------------------------------------ t = 2 against one process

def _features(t: int, rank: int, blocks: int = 1) -> TensorShard:
    """How an activation's last dimension is split like a layer's weight."""
    return TensorShard(dim=2, parts=t, index=rank, blocks=blocks)


def _positions(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    return x.chunk(ctx.tp_size)[ctx.tp_rank]


def _tensor_parallel_run(ctx: ParallelContext, values: dict, sequence_parallel: bool = False):
    """Both layers forward and backward on this rank's part of the logical
    inputs; returns the logical outputs, input gradients and adapter
    gradients (partial ones summed over the tensor group, as training does)."""
    column, row = _layers(ctx, values, sequence_parallel)
    t, r, group = ctx.tp_size, ctx.tp_rank, ctx.tp_group
    x_column = values["column.x"]                       # whole, or s/t positions under SP
    x_row = shard(values["row.x"], _features(t, r))     # split features (whole sequence)
    grad_column = shard(values["column.grad"], _features(t, r, BLOCKS))
    grad_row = values["row.grad"]
    if sequence_parallel and t > 1:
        x_column, grad_row = _positions(x_column, ctx), _positions(grad_row, ctx)
    x_column, x_row = x_column.clone().requires_grad_(), x_row.clone().requires_grad_()
    out_column, out_row = column(x_column), row(x_row)
    torch.autograd.backward([out_column, out_row], [grad_column, grad_row])
    partial = [p.grad for layer in (column, row) for p in layer.lora.parameters()
               if getattr(p, PARTIAL_GRAD_ATTR, False)]
    sum_partial_grads(partial, group)                   # as the gradient buffer does
    found = {"column.out": gather_logical(out_column.detach(), _features(t, r, BLOCKS), group),
             "row.x_grad": gather_logical(x_row.grad, _features(t, r), group)}
    found["row.out"], found["column.x_grad"] = out_row.detach(), x_column.grad
    if sequence_parallel and t > 1:
        for key in ("row.out", "column.x_grad"):
            found[key] = gather_from_sequence_region(found[key], group)
    for name, layer in (("column", column), ("row", row)):
        for key, param in (("A", layer.lora.A), ("B", layer.lora.B)):
            found[f"{name}.{key}_grad"] = gather_logical(param.grad,
                                                         getattr(param, SHARD_ATTR, None), group)
    return found


def _tensor_parallel_vs_one_process(rank: int, sequence_parallel: bool) -> list[str]:
    values = _logical(seed=1)
    want = _tensor_parallel_run(ParallelContext.single(), values)
    got = _tensor_parallel_run(ParallelContext.build(RankGrid(tp=2, dp=1, pp=1)), values,
                               sequence_parallel)
    for name, expected in want.items():
        assert expected.abs().max() > 0, name
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-5, msg=name)
    return sorted(got)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_sharded_adapters_equal_one_process(pools, sequence_parallel):
    names = pools(2).run(_tensor_parallel_vs_one_process, sequence_parallel)
    assert names[0] == names[1] == ["column.A_grad", "column.B_grad", "column.out",
                                    "column.x_grad", "row.A_grad", "row.B_grad", "row.out",
                                    "row.x_grad"]
