"""Tensor (intra-layer) parallelism: the paper's f and g operators, column-,
row- and vocabulary-parallel layers, the vocabulary-parallel cross entropy and
the per-rank random streams for dropout.

Sequence parallelism (Korthikanti et al., 2022) splits the activations
between the tensor-parallel regions (norms, dropout, residual adds) along the
sequence, s/t positions per tensor rank. Its conjugate operators replace f
and g at the regions' edges: an all-gather of the sequence where f copied
(its backward a reduce-scatter where f's all-reduced), a reduce-scatter where
g all-reduced (its backward an all-gather). The same bytes move; nothing
outside the regions is held or computed t times. A column-parallel layer
keeps only its s/t input slice for the weight gradient and gathers it again
in backward, so its input is stored split too.

A process group of None means the tensor group has one rank: every
communication below is then skipped (torch.distributed reads group=None as
the whole world, so the check is explicit).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ptdp import device as devices
from ptdp.parallel.collectives import all_gather_flat, reduce_scatter_flat
from ptdp.parallel.sharding import PARTIAL_GRAD_ATTR, SHARD_ATTR, TensorShard, name_seed, set_init
from ptdp.parallel.topology import ParallelContext
from ptdp.parallel.weight_grad import DeferredWeightGrads, deferrable_linear, accumulate_weight_grads


def _all_reduce(x: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM,
                async_op: bool = False):
    """x summed (or `op`) over `group`, in place. With `async_op`, (x, the
    collective's work): wait() before reading x."""
    if async_op:
        return x, dist.all_reduce(x, op=op, group=group, async_op=True)
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None:
        return x
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=-1)[rank].contiguous()


class _CopyToTensorRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward.

    Reduces in place: its inputs (outputs of a matmul or a masked lookup) are
    not saved by any other autograd node, so no copy is needed."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _all_reduce(x.contiguous(), group)
        ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorRegion(torch.autograd.Function):
    """All-gather along the last dimension forward, keep own slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToTensorRegion(torch.autograd.Function):
    """Keep own slice of the last dimension forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


def _gather_sequence(x: torch.Tensor, group: Any, async_op: bool = False):
    """[s/t, ...] on each rank -> [s, ...], in rank order; with `async_op`
    (the output, a handle to wait on before reading it)."""
    x = x.contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    handle = all_gather_flat(out, x, group, async_op=async_op)
    return (out, handle) if async_op else out


def _reduce_scatter_sequence(x: torch.Tensor, group: Any, async_op: bool = False):
    """[s, ...] partial sums on each rank -> this rank's [s/t, ...] of the
    sum; with `async_op` (the output, a handle or None when already done)."""
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel "
                         f"size {size}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    handle = reduce_scatter_flat(out, x, group, async_op=async_op)
    return (out, handle) if async_op else out


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Sum over the tensor group and keep own s/t positions forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class _SequenceParallelLinear(torch.autograd.Function):
    """y = gather(x) Wᵀ + b for a column-parallel W under sequence parallelism.

    Saves x, this rank's [s/t, b, h] slice, not the gathered [s, b, h]
    (autograd's own graph would keep the gathered copy), and all-gathers it
    again in backward for the weight gradient. The input gradient, partial
    over the tensor ranks, is reduce-scattered back to s/t positions. In
    backward each collective overlaps a matrix product, as in Megatron-LM:
    the re-gather runs under the input gradient's product, the
    reduce-scatter under the weight gradient's.

    With a DeferredWeightGrads store (zero-bubble schedules) the backward
    gives only the input gradient, and W gathers the slice again itself: W
    keeps s/t positions, not s, between B and W. Every tensor rank runs the
    same W's in the same order, so W's all-gather matches across them."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, store, params):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.store, ctx.params = store, params
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.store is not None:
            group, (real_weight, real_bias) = ctx.group, ctx.params
            if real_weight.requires_grad or (real_bias is not None and real_bias.requires_grad):
                ctx.store.add(lambda: accumulate_weight_grads(_gather_sequence(x, group), grad,
                                                              real_weight, real_bias))
            return _reduce_scatter_sequence(grad.matmul(weight), group), None, None, None, None, None
        if not ctx.needs_input_grad[1]:  # a frozen weight (LoRA's base): the input's gradient only
            return _reduce_scatter_sequence(grad.matmul(weight), ctx.group), None, None, None, None, None
        gathered, gathering = _gather_sequence(x, ctx.group, async_op=True)
        partial_input = grad.matmul(weight)
        gathering.wait()
        grad_input, scattering = _reduce_scatter_sequence(partial_input, ctx.group, async_op=True)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(gathered.reshape(-1, gathered.shape[-1]))
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        if scattering is not None:
            scattering.wait()
        return grad_input, grad_weight.to(weight.dtype), grad_bias, None, None, None


class _TensorParallelLinear(torch.autograd.Function):
    """y = x Wᵀ + b for a column-parallel W whose input x is replicated over
    the tensor ranks: f (copy_to_tensor_region) and the product in one.

    Backward all-reduces the input gradient while the weight gradient's
    product runs, as Megatron-LM does, where f then F.linear would run the
    two products first and the all-reduce after them."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_input, reducing = _all_reduce(grad.matmul(weight), ctx.group, async_op=True)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_2d = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_weight = grad_2d.t().matmul(x.reshape(-1, x.shape[-1])).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = grad_2d.sum(dim=0)
        reducing.wait()
        return grad_input, grad_weight, grad_bias, None


def tensor_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: Any) -> torch.Tensor:
    """F.linear(copy_to_tensor_region(x, group), weight, bias), with the
    input gradient's all-reduce under the weight gradient's product."""
    if group is None:
        return F.linear(x, weight, bias)
    return _TensorParallelLinear.apply(x, weight, bias, group)


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group: Any, store: DeferredWeightGrads | None = None) -> torch.Tensor:
    """[s/t, b, h] -> [s, b, out/t]: the sequence gathered into a column-parallel
    product; with `store`, its weight gradients wait for the store's W."""
    if store is None:
        return _SequenceParallelLinear.apply(x, weight, bias, group, None, None)
    return _SequenceParallelLinear.apply(x, weight.detach(), None if bias is None else bias.detach(),
                                         group, store, (weight, bias))


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ReduceScatterToSequenceRegion.apply(x, group)


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather the sequence forward ([s/t, ...] -> [s, ...]); backward,
    reduce-scatter the gradient (each rank's is partial over the tensor group)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


def gather_from_sequence_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _GatherFromSequenceRegion.apply(x, group)


def mark_partial_grad(param: nn.Parameter) -> nn.Parameter:
    """A replicated parameter used on s/t positions per tensor rank (norm
    weights and biases, row-parallel biases under sequence parallelism): each
    rank's gradient is a partial sum, completed by `sum_partial_grads`."""
    setattr(param, PARTIAL_GRAD_ATTR, True)
    return param


def sum_partial_grads(grads: list[torch.Tensor], group: Any) -> None:
    """Sum these gradients over the tensor group, in place, in one all-reduce."""
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def copy_to_tensor_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ReduceFromTensorRegion.apply(x, group)


def gather_from_tensor_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _GatherFromTensorRegion.apply(x, group)


def scatter_to_tensor_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _ScatterToTensorRegion.apply(x, group)


def defers_bias(device: torch.device) -> bool:
    """Whether a layer asked to skip its bias add leaves it to the caller:
    where element-wise kernels are fused (compiled), adding the bias there
    costs nothing; in eager mode it is one more pass over the output, while
    in the matrix product (addmm) it is free."""
    return devices.can_compile_kernels(device)


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} {n} is not divisible by the tensor-parallel size {parts}")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: rank i holds A_i and computes X A_i.

    `blocks` > 1 treats the output dimension as that many equal blocks split
    separately (q, k and v for attention; SwiGLU's gate and up), so each rank
    gets matching parts of each; a tuple gives blocks of those sizes
    (grouped-query attention's q, k and v). The input passes through f; the output stays split unless
    `gather_output`. With `skip_bias_add` the layer returns (output, bias)
    and leaves the bias for the caller to fuse into its next element-wise
    kernel where kernels are fused (see `defers_bias`); elsewhere the bias
    rides in the matrix product (addmm) and None is returned in its place.
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *,
                 bias: bool = True, gather_output: bool = False,
                 blocks: int | tuple[int, ...] = 1,
                 skip_bias_add: bool = False, init_std: float = 0.02,
                 sequence_parallel: bool = False):
        super().__init__()
        if gather_output and skip_bias_add:
            raise ValueError("gather_output with skip_bias_add would return a split bias")
        self.group, self.gather_output, self.skip_bias_add = ctx.tp_group, gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel and ctx.tp_group is not None
        # A DeferredWeightGrads store (zero-bubble schedules) or None: weight
        # gradients computed in the same backward.
        self.weight_grads = None
        self.lora = None  # a low-rank adapter (ptdp.parallel.lora.attach)
        t = ctx.tp_size
        sizes = (out_features // blocks,) * blocks if isinstance(blocks, int) else blocks
        if sum(sizes) != out_features:
            raise ValueError(f"blocks {sizes} do not add up to {out_features} output features")
        local_out = sum(_divide(size, t, "output features per block") for size in sizes)
        spec = TensorShard(dim=0, parts=t, index=ctx.tp_rank, blocks=blocks)
        self.weight = set_init(nn.Parameter(torch.empty(local_out, in_features)), "normal", init_std)
        setattr(self.weight, SHARD_ATTR, spec)
        if bias:
            self.bias = set_init(nn.Parameter(torch.empty(local_out)), "zeros")
            setattr(self.bias, SHARD_ATTR, spec)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel:  # x: this rank's s/t positions
            return self._sequence_parallel_forward(x)
        deferred = self.skip_bias_add and defers_bias(x.device)
        bias = None if deferred else self.bias
        if self.weight_grads is None and self.lora is None:
            y = tensor_parallel_linear(x, self.weight, bias, self.group)
        else:  # (the adapter's input gradient is summed by f too)
            x = copy_to_tensor_region(x, self.group)
            y = deferrable_linear(x, self.weight, bias, self.weight_grads)
        if self.lora is not None:
            y = y + self.lora.column_delta(x)
        if self.skip_bias_add:
            return (y, self.bias) if deferred else (y, None)
        return gather_from_tensor_region(y, self.group) if self.gather_output else y

    def _sequence_parallel_forward(self, x: torch.Tensor):
        deferred = self.skip_bias_add and defers_bias(x.device)
        y = sequence_parallel_linear(x, self.weight, None if deferred else self.bias, self.group,
                                     self.weight_grads)
        if self.lora is not None:
            y = y + self.lora.column_delta(x)
        if self.skip_bias_add:
            return (y, self.bias) if deferred else (y, None)
        return gather_from_tensor_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: rank i computes X_i A_i, then g sums.

    The bias is replicated and added after the reduction (in the matrix
    product when there is no reduction, t = 1). `skip_bias_add` works as in
    ColumnParallelLinear.
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *,
                 bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False,
                 init_std: float = 0.02, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel, self.skip_bias_add = (
            ctx.tp_group, input_is_parallel, skip_bias_add)
        # The output is reduce-scattered to s/t positions instead of all-reduced.
        self.sequence_parallel = sequence_parallel and ctx.tp_group is not None
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs a row-parallel input already split")
        self.weight_grads = None  # as in ColumnParallelLinear
        self.lora = None
        local_in = _divide(in_features, ctx.tp_size, "input features")
        self.weight = set_init(nn.Parameter(torch.empty(out_features, local_in)), "normal", init_std)
        setattr(self.weight, SHARD_ATTR, TensorShard(dim=1, parts=ctx.tp_size, index=ctx.tp_rank))
        if bias:
            self.bias = set_init(nn.Parameter(torch.empty(out_features)), "zeros")
            if self.sequence_parallel:
                mark_partial_grad(self.bias)
        else:
            self.register_parameter("bias", None)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(y, self.group)
        return reduce_from_tensor_region(y, self.group)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.group)
        deferred = self.skip_bias_add and defers_bias(x.device)
        # The bias rides in the product only where nothing is reduced after it.
        inside = self.bias if self.group is None and not deferred else None
        y = deferrable_linear(x, self.weight, inside, self.weight_grads)
        if self.lora is not None:  # partial like the product: reduced with it
            y = y + self.lora.row_delta(x)
        if deferred:
            return self._reduce(y), self.bias
        if self.group is not None:
            y = self._reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return (y, None) if self.skip_bias_add else y


class VocabParallelEmbedding(nn.Module):
    """Embedding split along the vocabulary: rank i holds rows
    [i·V'/t, (i+1)·V'/t) of the table padded to V' rows. Tokens outside a
    rank's range contribute zero there; g sums the parts. Padding rows are
    zero and never looked up."""

    def __init__(self, vocab_size: int, padded_vocab_size: int, embedding_dim: int,
                 ctx: ParallelContext, *, init_std: float = 0.02):
        super().__init__()
        self.group = ctx.tp_group
        self.vocab_size = vocab_size
        local = _divide(padded_vocab_size, ctx.tp_size, "padded vocabulary size")
        self.vocab_start = ctx.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = set_init(nn.Parameter(torch.empty(local, embedding_dim)), "normal", init_std)
        setattr(self.weight, SHARD_ATTR, TensorShard(
            dim=0, parts=ctx.tp_size, index=ctx.tp_rank, logical_size=vocab_size,
            padded_size=padded_vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_region(self.partial(tokens), self.group)

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of the lookup: the rows it holds, zeros elsewhere
        (the tensor group's parts sum to the embedding)."""
        if self.group is None:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_tokens = (tokens - self.vocab_start).masked_fill(outside, 0)
        return F.embedding(local_tokens, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)

    def mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of padding entries to -inf, so the padding never
        changes the loss, its gradient or a sampled token."""
        first_pad = self.vocab_size - self.vocab_start
        if first_pad >= logits.shape[-1]:
            return logits
        pad = torch.arange(logits.shape[-1], device=logits.device) >= first_pad
        return logits.masked_fill(pad, float("-inf"))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split along the vocabulary, without gathering
    them: the max, the target's logit and the sum of exponentials are each
    reduced across the tensor group (3 all-reduces of [s, b] scalars)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        _all_reduce(logits_max, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        local_size = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + local_size)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        _all_reduce(target_logit, group)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, group)
        loss = torch.log(sum_exp) - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target), in place
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 vocab_start: int, group: Any) -> torch.Tensor:
    """Per-token loss [...] from this rank's logits [..., V'/t] whose first
    column is vocabulary entry `vocab_start`."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)


class RNGStreams:
    """Named random streams for dropout.

    The device's default generator is the *replicated* stream: seeded the
    same on every tensor rank, so dropout on activations that every tensor
    rank holds in full (embeddings, residual branches) drops the same
    elements everywhere. The *tensor* stream is seeded per tensor rank, for
    dropout inside a tensor-parallel region (attention probabilities of each
    rank's own heads), where equal masks would correlate the shards.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.states: dict[str, torch.Tensor] = {}
        # True while activation recomputation repeats a forward (ptdp.model.recompute).
        self.replaying = False

    def seed(self, seed: int, ctx: ParallelContext) -> None:
        c = ctx.coord
        # Context ranks hold other positions: streams of their own (the names
        # without context parallelism are as before, so runs replay).
        where = f"pp{c.pp}/dp{c.dp}" + (f"/cp{c.cp}" if ctx.cp_size > 1 else "")
        devices.manual_seed(name_seed(seed, f"replicated/{where}"), self.device)
        saved = devices.get_rng_state(self.device)
        devices.manual_seed(name_seed(seed, f"tensor/{where}/tp{c.tp}"), self.device)
        self.states["tensor"] = devices.get_rng_state(self.device)
        devices.set_rng_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = "tensor") -> Iterator[None]:
        """Draw from stream `name` inside the block, then return to the default."""
        saved = devices.get_rng_state(self.device)
        devices.set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = devices.get_rng_state(self.device)
            devices.set_rng_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {"default": devices.get_rng_state(self.device),
                **{k: v.clone() for k, v in self.states.items()}}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        devices.set_rng_state(states["default"], self.device)
        self.states = {k: v.clone() for k, v in states.items() if k != "default"}


def scaled_init_std(std: float, num_layers: int) -> float:
    """GPT-2's init for projections that feed the residual stream."""
    return std / math.sqrt(2.0 * num_layers)
