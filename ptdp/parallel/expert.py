"""Expert parallelism: the token dispatchers, and their communication
(all-to-all with variable splits and all-gather of variable row counts, as
autograd functions in picotron's style: the backward of each is the reverse
exchange). A group of None is one rank: nothing moves.

The MoE layer (ptdp.model.moe) routes its tokens, hands them to a dispatcher
(`dispatch`: the rows its local experts take, one per (token, expert) pair),
runs its experts on those rows, and hands the outputs back (`combine`: each
token's outputs summed onto the token, on the token's own rank). Each
--moe-token-dispatcher-type is one `TokenDispatcher` subclass, registered
under its name by `class ...(TokenDispatcher, name=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from ptdp.parallel.tensor import gather_from_sequence_region, reduce_scatter_to_sequence_region

if TYPE_CHECKING:
    from ptdp.parallel.topology import ParallelContext


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
              group: Any) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows [sum(input_splits), ...]: input_splits[r] of them go to rank r of
    the group, output_splits[r] come from it. Backward: the gradients go
    back the same way reversed."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: Any) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, output_splits, input_splits, group)


def exchange_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """counts [n, m] (int64): row r is what this rank sends to rank r of the
    group; returns [n, m], row r what rank r sends to this one."""
    if group is None:
        return counts
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def gather_rows(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, list[int]]:
    """All-gather rows whose number differs between the group's ranks:
    ([Σ n_r, ...] in rank order, [n_r]). The rows are padded to the largest
    count for an all-gather of equal parts; the backward reduce-scatters
    the gradients (see `scatter_rows`, its conjugate)."""
    if group is None:
        return x, [x.shape[0]]
    counts = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    gathered = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, counts, group=group)
    sizes = [int(c.item()) for c in gathered]
    largest = max(sizes)
    padded = torch.cat([x, x.new_zeros((largest - x.shape[0], *x.shape[1:]))]) \
        if largest > x.shape[0] else x
    whole = gather_from_sequence_region(padded, group)
    keep = torch.cat([torch.arange(r * largest, r * largest + n, device=x.device)
                      for r, n in enumerate(sizes)])
    return whole.index_select(0, keep), sizes


def scatter_rows(x: torch.Tensor, sizes: list[int], rank: int, group: Any) -> torch.Tensor:
    """The conjugate of `gather_rows`: x [Σ n_r, ...] partial sums on every
    rank of the group; returns this rank's n_rank rows of their sum."""
    if group is None:
        return x
    largest = max(sizes)
    padded = x.new_zeros((largest * len(sizes), *x.shape[1:]))
    place = torch.cat([torch.arange(r * largest, r * largest + n, device=x.device)
                       for r, n in enumerate(sizes)])
    padded = padded.index_copy(0, place, x)
    return reduce_scatter_to_sequence_region(padded, group)[:sizes[rank]]


@dataclass
class Dispatched:
    """What a dispatcher hands this rank's experts: rows [N, h], one per
    (token, local expert) pair, each with its probability [N] and the local
    number of its expert [N]; `by_expert`: the rows are already in expert
    order. `plan` is the dispatcher's own record of how to bring them back."""
    tokens: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    by_expert: bool
    plan: Any


def local_pairs(tokens: torch.Tensor, probs: torch.Tensor, routed: torch.Tensor,
                first: int, count: int) -> Dispatched:
    """The (token, expert) pairs of tokens [T, h] (probs [T, E], routed
    [T, E] bool) whose expert is one of this rank's `count` experts from
    global number `first`, expert by expert."""
    experts, rows = routed[:, first:first + count].t().nonzero(as_tuple=True)
    pair_probs = probs[:, first:first + count].t()[experts, rows]
    return Dispatched(tokens.index_select(0, rows), pair_probs, experts, True, (tokens, rows))


def sum_onto_tokens(out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
    """The conjugate of `local_pairs`: each pair's output summed onto its
    token, [T, h] (zero for a token none of these experts took)."""
    tokens, rows = dispatched.plan
    return torch.zeros_like(tokens).index_add(0, rows, out.to(tokens.dtype))


class TokenDispatcher:
    """Brings a rank's tokens to the experts that routing chose for them
    (`dispatch`) and their outputs back (`combine`). Built once per MoE
    layer; `name` is its --moe-token-dispatcher-type value."""

    registry: ClassVar[dict[str, type[TokenDispatcher]]] = {}

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            TokenDispatcher.registry[name] = cls

    def __init__(self, ctx: ParallelContext, num_experts: int):
        self.ctx, self.num_experts = ctx, num_experts
        self.per_rank = num_experts // ctx.ep_size  # this rank's experts

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routed: torch.Tensor) -> Dispatched:
        """tokens [T, h] of this rank with their routing (probs [T, E],
        routed [T, E] bool) -> the rows this rank's experts take."""
        raise NotImplementedError

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The experts' outputs [N, h] for `dispatched`'s rows -> [T, h], each
        of this rank's tokens with the sum of its experts' outputs."""
        raise NotImplementedError


def token_dispatcher(name: str, ctx: ParallelContext, num_experts: int) -> TokenDispatcher:
    """The dispatcher --moe-token-dispatcher-type `name` selects."""
    if name not in TokenDispatcher.registry:
        raise ValueError(f"--moe-token-dispatcher-type {name}: ptdp dispatches by "
                         f"{' or '.join(TokenDispatcher.registry)}")
    return TokenDispatcher.registry[name](ctx, num_experts)


class LocalExperts(TokenDispatcher):
    """No dispatch, for experts split exactly like the dense MLP (EP = 1,
    ETP = t): every tensor rank runs its 1/t of every expert on all of the
    microbatch's tokens, and the tensor group's reduction (the MoE layer's)
    completes the outputs."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routed: torch.Tensor) -> Dispatched:
        return local_pairs(tokens, probs, routed, self.ctx.ep_rank * self.per_rank, self.per_rank)

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return sum_onto_tokens(out, dispatched)


class AllGatherDispatcher(TokenDispatcher, name="allgather"):
    """This rank's tokens with their routing, gathered over the expert
    dispatch group (ETP × EP ranks holding every expert once; gradients
    reduce-scattered back), through this rank's experts, and the group's
    partial outputs reduce-scattered onto their own ranks (gradients
    gathered)."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routed: torch.Tensor) -> Dispatched:
        group = self.ctx.expert_dispatch_group
        tokens = gather_from_sequence_region(tokens, group)
        probs = gather_from_sequence_region(probs, group)
        with torch.no_grad():
            routed = gather_from_sequence_region(routed.to(torch.uint8), group).bool()
        return local_pairs(tokens, probs, routed, self.ctx.ep_rank * self.per_rank, self.per_rank)

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return reduce_scatter_to_sequence_region(sum_onto_tokens(out, dispatched),
                                                 self.ctx.expert_dispatch_group)


@dataclass
class _AllToAllPlan:
    local: torch.Tensor            # this rank's tokens [T, h]
    tokens_of_pairs: torch.Tensor  # the token of each pair sent, in the order sent
    to_ranks: list[int]            # pairs sent to each expert-parallel rank
    from_ranks: list[int]          # pairs received from each
    sizes: list[int]               # rows of each expert tensor-parallel peer


class AllToAllDispatcher(TokenDispatcher, name="alltoall"):
    """Each (token, expert) pair of this rank's tokens goes, in expert order,
    to the expert-parallel rank holding the expert (an all-to-all with
    variable splits over the EP group); the expert tensor-parallel ranks
    gather what their peers received and run their 1/ETP of each expert;
    `combine` reduce-scatters the partial outputs and returns them the same
    way, summed onto their tokens."""

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routed: torch.Tensor) -> Dispatched:
        ctx, per_rank = self.ctx, self.per_rank
        experts_of_pairs, tokens_of_pairs = routed.t().nonzero(as_tuple=True)
        pair_probs = probs.t()[experts_of_pairs, tokens_of_pairs]
        sent = torch.bincount(experts_of_pairs, minlength=self.num_experts)
        sent = sent.view(ctx.ep_size, per_rank)                  # to each EP rank, per expert
        received = exchange_counts(sent, ctx.expert_group)       # from each EP rank, per expert
        to_ranks, from_ranks = sent.sum(dim=1).tolist(), received.sum(dim=1).tolist()
        rows = all_to_all(tokens.index_select(0, tokens_of_pairs), from_ranks, to_ranks,
                          ctx.expert_group)
        pair_probs = all_to_all(pair_probs, from_ranks, to_ranks, ctx.expert_group)
        with torch.no_grad():  # the local expert of each received row
            expert_ids = torch.arange(per_rank, device=tokens.device).repeat(ctx.ep_size)
            expert_ids = expert_ids.repeat_interleave(received.reshape(-1))
            expert_ids, _ = gather_rows(expert_ids, ctx.expert_tensor_group)
        rows, sizes = gather_rows(rows, ctx.expert_tensor_group)
        pair_probs, _ = gather_rows(pair_probs, ctx.expert_tensor_group)
        plan = _AllToAllPlan(tokens, tokens_of_pairs, to_ranks, from_ranks, sizes)
        return Dispatched(rows, pair_probs, expert_ids, False, plan)

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        ctx, plan = self.ctx, dispatched.plan
        out = out.to(dispatched.tokens.dtype)
        out = scatter_rows(out, plan.sizes, ctx.etp_rank, ctx.expert_tensor_group)
        out = all_to_all(out, plan.to_ranks, plan.from_ranks, ctx.expert_group)
        return torch.zeros_like(plan.local).index_add(0, plan.tokens_of_pairs,
                                                      out.to(plan.local.dtype))
