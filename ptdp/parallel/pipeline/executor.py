"""Runs one pipeline rank's action list (see ptdp.schedules.actions).

- Compute F: take the microbatch's tokens (first virtual stage) or the
  received activation, run the chunk, keep (input, output) for the backward.
  The last virtual stage computes the loss, scaled by 1/m so that the
  gradients are those of the mean over microbatches. Under
  --calculate-per-token-loss (Megatron-LM's) it is instead the sum of the
  microbatch's per-token losses divided by the counted (loss-mask) tokens
  of the whole global batch, all microbatches and data-parallel replicas:
  the rank that computes the loss reads its microbatches and counts their
  tokens before the first backward (the replicas sum their counts), so the
  division happens in the loss, where it scales every gradient exactly as
  the one-process model's, whatever the schedule (Megatron-LM divides the
  reduced gradients instead; the same numbers up to rounding).
- Compute B: backpropagate the received output gradient (or the loss) through
  the chunk; the input's gradient is what goes to the previous stage.
- Compute W (zero-bubble schedules only): the chunk's weight gradients of
  that microbatch, deferred by its B (ptdp.parallel.weight_grad): under
  these schedules every chunk's matrix products leave their weight gradients
  to a per-chunk store, and after each B the executor moves what the store
  holds into that microbatch's W.
- A boundary inside the rank (the bottom of a V, stages p-1 and p on
  rank p-1) passes its activation and gradient locally, with no transfer.
- Exchange: all its sends and receives are posted as one batch
  (batch_isend_irecv), so two neighbours that send to each other at the same
  moment cannot deadlock. The receives are waited for; the sends are waited
  for at the next exchange, so they travel while this rank computes. Under
  a zero-bubble schedule a send never holds its rank up (with gloo, one
  request per operation): it is waited for at the end of the run, and what
  it carried is freed as soon as it is seen complete. Two busy ranks that
  fill their gaps with W's rarely reach an exchange at the same moment, so
  waiting for sends would add idle time at every transfer.

Scatter/gather (the paper's optimisation): the activation or gradient that
crosses a stage boundary is the same on every tensor rank, so each tensor
rank sends only its 1/t slice and the receiving tensor group all-gathers the
slices over its fast links. It falls back to whole tensors when the size
does not divide by t.

Packed sequences: a microbatch may carry its documents
(ptdp.parallel.document_attention.Documents: positions and document ids),
which every stage's chunk takes, so every stage reads its microbatches; the
boundaries travel with the microbatch and the activations sent between
stages keep their fixed shape.

Memory: a sent activation's storage is released once the send completes;
autograd needs only its shape to backpropagate into it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from ptdp.parallel.collectives import all_gather_flat
from ptdp.schedules.actions import Exchange, Schedule, Transfer
from ptdp.parallel.topology import ParallelContext
from ptdp.parallel.weight_grad import DeferredWeightGrads

# (op, microbatch, chunk, start, end): op is "F", "B", "W" or "comm"; seconds from
# the start of the run on this rank.
Box = tuple[str, int, int, float, float]


@dataclass
class PipelineStats:
    losses: list[torch.Tensor] = field(default_factory=list)   # last stage: one per microbatch
    # Last stage: the tokens each microbatch's loss averages over (its
    # loss-mask's count; every label without a mask).
    loss_tokens: list[torch.Tensor] = field(default_factory=list)
    peak_stored: int = 0                 # most (microbatch, chunk) activations held at once, F to B
    # Most (microbatch, chunk) whose W has not run, F to W: a zero-bubble
    # schedule's deferred weight gradients keep their inputs until W. Equal
    # to peak_stored under the other schedules.
    peak_awaiting_weight_grads: int = 0
    sent_elements: list[int] = field(default_factory=list)     # elements per point-to-point send
    timeline: list[Box] = field(default_factory=list)
    transfer_seconds: float = 0.0        # time in exchanges (transfers and waiting for peers)
    forward_seconds: float = 0.0         # time in forward computations
    backward_seconds: float = 0.0        # time in backward computations (B and W)
    weight_grad_seconds: float = 0.0     # of which in W (zero-bubble schedules)
    compute_seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (op, chunk) -> s
    released_bytes: int = 0              # storage of sent activations freed before their backward
    # Per-token loss, on the rank that computes it: the global batch's loss
    # tokens, summed over the data-parallel replicas (None otherwise).
    batch_tokens: torch.Tensor | None = None

    def count_stored(self, stored: int, awaiting_weight_grads: int) -> None:
        """A forward stored its activation: `stored` held until B, and
        `awaiting_weight_grads` more (B done) until W."""
        self.peak_stored = max(self.peak_stored, stored)
        self.peak_awaiting_weight_grads = max(self.peak_awaiting_weight_grads,
                                              stored + awaiting_weight_grads)


MicrobatchFn = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def counted_tokens(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tokens a microbatch's loss averages over (fp32, on its device):
    its loss mask's ones, or every label."""
    if len(batch) > 2 and batch[2] is not None:
        return batch[2].sum(dtype=torch.float32)
    labels = batch[1]
    return torch.tensor(float(labels.numel()), dtype=torch.float32, device=labels.device)


def read_and_count(microbatch: MicrobatchFn, m: int,
                   group) -> tuple[MicrobatchFn, torch.Tensor]:
    """--calculate-per-token-loss: read the iteration's m microbatches now
    (kept for the run, so each is read once) and count the tokens the
    global batch's loss averages over: theirs, summed over `group` (the
    data-parallel replicas). At least 1, as Megatron-LM's divisor."""
    batches = [microbatch(i) for i in range(m)]
    total = torch.stack([counted_tokens(batch) for batch in batches]).sum()
    if group is not None:
        dist.all_reduce(total, group=group)
    return batches.__getitem__, total.clamp(min=1.0)


def average_loss(losses: list[torch.Tensor], tokens: list[torch.Tensor] | None, group,
                 context_size: int = 1) -> float:
    """The reported loss over a rank's microbatch losses and its replicas'
    (`group`, the data × context group): without `tokens` the mean of the
    microbatch means; with their token counts the per-token mean,
    Σ mean·tokens / Σ tokens (Megatron-LM's under --calculate-per-token-loss).
    Under context parallelism each of the `context_size` ranks of a replica
    holds a part of each microbatch loss (they add up to it) and the whole
    microbatch's token count."""
    if tokens is None:
        loss_sum = torch.stack(losses).sum().float()
        if group is not None:
            dist.all_reduce(loss_sum, group=group)
        replicas = 1 if group is None else dist.get_world_size(group) // context_size
        return loss_sum.item() / (len(losses) * replicas)
    counts = torch.stack(tokens).float()
    totals = torch.stack([(torch.stack(losses).float() * counts).sum(),
                          counts.sum() / context_size])
    if group is not None:
        dist.all_reduce(totals, group=group)
    loss_sum, count = totals.tolist()
    return loss_sum / max(count, 1.0)


def _count_time(stats: "PipelineStats", op: str, chunk: int, began: float,
                synchronize: Callable[[], None] | None) -> None:
    """Add a compute's time to the stats. Host time: exact on CPU; on GPUs
    it measures kernel launches unless the device is synchronised."""
    if synchronize is not None:
        synchronize()
    elapsed = time.perf_counter() - began
    stats.compute_seconds[(op, chunk)] = stats.compute_seconds.get((op, chunk), 0.0) + elapsed
    if op == "F":
        stats.forward_seconds += elapsed
    else:
        stats.backward_seconds += elapsed
        if op == "W":
            stats.weight_grad_seconds += elapsed


class PipelineExecutor:
    def __init__(self, chunks: list[torch.nn.Module], ctx: ParallelContext, *,
                 activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 scatter_gather: bool = True, documents_on_every_stage: bool = False):
        """`documents_on_every_stage`: the microbatches carry their documents
        (packed sequences): every stage reads them, not only the first and last."""
        self.chunks, self.ctx = chunks, ctx
        self.documents = documents_on_every_stage
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        numel = 1
        for size in activation_shape:
            numel *= size
        self.split = (scatter_gather and ctx.tp_size > 1 and numel % ctx.tp_size == 0)
        self.slice_numel = numel // ctx.tp_size if self.split else numel
        # (send requests with their payloads, outputs to free once they are sent)
        self._pending_sends: list[tuple[list, list[torch.Tensor]]] = []
        # Off: wait for sends at once, as before (bench/hot_path.py measures the difference).
        self.overlap_sends = True
        # Per chunk, the store its layers defer weight gradients to (zero-bubble
        # schedules), or None: weight gradients in the backward.
        self._stores: list[DeferredWeightGrads | None] = [None] * len(chunks)

    def _defer_weight_grads(self, defer: bool) -> None:
        """Give every chunk its own store of deferred weight gradients, or take them away."""
        if defer == (self._stores[0] is not None):
            return
        for c, chunk in enumerate(self.chunks):
            if not hasattr(chunk, "defer_weight_grads"):
                raise TypeError(f"a zero-bubble schedule needs chunks that can defer their weight "
                                f"gradients; {type(chunk).__name__} has no defer_weight_grads")
            self._stores[c] = DeferredWeightGrads() if defer else None
            chunk.defer_weight_grads(self._stores[c])

    def _global_rank(self, pipeline_rank: int) -> int:
        c = self.ctx.coord
        return self.ctx.grid.rank(c.tp, c.dp, pipeline_rank, cp=c.cp)

    def run(self, schedule: Schedule, microbatch: MicrobatchFn, *, forward_only: bool = False,
            record_timeline: bool = False, loss_scale: float = 1.0,
            synchronize: Callable[[], None] | None = None,
            per_token_loss: bool = False,
            on_batch_tokens: Callable[[torch.Tensor], None] | None = None) -> PipelineStats:
        """Execute this rank's actions of `schedule`. `microbatch(i)` gives the
        tokens and labels [b, s] of microbatch i, optionally its loss mask
        (first and last virtual stage; may be None) and its documents (every
        stage; see the module's docstring). Backward starts from loss · loss_scale / m;
        with `per_token_loss` from loss · tokens · loss_scale / (the global
        batch's tokens, counted over this rank's data-parallel group).
        `synchronize`, called after every compute, makes the measured times
        those of the device's work (on a GPU, not only of the launches).
        `on_batch_tokens` (with `per_token_loss`): called on every rank with
        that count before the first microbatch (the last stage's, sent over
        the pipeline group), for losses computed on other stages (MoE's)."""
        ctx, m = self.ctx, schedule.m
        last_stage = schedule.num_stages - 1
        batch_tokens = None
        if per_token_loss and not forward_only:
            microbatch, batch_tokens = self._count_batch_tokens(schedule, microbatch,
                                                                on_batch_tokens)
        stats = PipelineStats(batch_tokens=batch_tokens)
        stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        outgoing: dict[tuple, torch.Tensor] = {}
        received: dict[tuple, torch.Tensor] = {}
        # (microbatch, chunk) -> its weight gradients, from its B until its W.
        deferred: dict[tuple[int, int], DeferredWeightGrads] = {}
        if not forward_only:
            self._defer_weight_grads(schedule.zero_bubble)
        start_time = time.perf_counter()

        def record(op: str, mb: int, chunk: int, began: float) -> None:
            if record_timeline:
                stats.timeline.append((op, mb, chunk, began - start_time,
                                       time.perf_counter() - start_time))

        def incoming(kind: str, mb: int, boundary: int) -> torch.Tensor:
            # Across a boundary inside this rank the producer's tensor is at hand.
            if schedule.is_local_boundary(boundary):
                return outgoing.pop((kind, mb, boundary))
            return received.pop((kind, mb, boundary))

        for action in schedule.ranks[ctx.pp_rank]:
            began = time.perf_counter()
            if isinstance(action, Exchange):
                self._exchange(action, outgoing, received, stats, lazy_sends=schedule.zero_bubble)
                stats.transfer_seconds += time.perf_counter() - began
                record("comm", -1, -1, began)
                continue
            i, c = action.microbatch, action.chunk
            stage = schedule.virtual_stage(ctx.pp_rank, c)
            if action.op == "F":
                # Read once: a stage that is first and last needs tokens and labels.
                batch = microbatch(i) if stage in (0, last_stage) or self.documents else None
                documents = batch[3] if batch is not None and len(batch) > 3 else None
                if stage == 0:
                    x = batch[0]
                else:
                    # detach: a local hand-off keeps each stage's backward its own.
                    x = incoming("activation", i, stage - 1).detach()
                    x.requires_grad_(not forward_only)
                with torch.set_grad_enabled(not forward_only):
                    if stage == last_stage:
                        loss = self.chunks[c](x, *batch[1:])
                        stats.losses.append(loss.detach())
                        tokens = counted_tokens(batch)
                        stats.loss_tokens.append(tokens)
                        if batch_tokens is None:
                            out = loss * (loss_scale / m)
                        else:  # the microbatch's token sum over the batch's tokens
                            out = loss * tokens * (loss_scale / batch_tokens)
                    else:
                        out = self._middle_forward(c, x, documents)
                        outgoing[("activation", i, stage)] = out
                if not forward_only:
                    stash[(i, c)] = (x if stage > 0 else None, out)
                    stats.count_stored(len(stash), len(deferred))
            elif action.op == "B":
                x, out = stash.pop((i, c))
                grad = None if stage == last_stage else incoming("grad", i, stage)
                # (A LoRA stage with no adapter and no trained input has nothing to differentiate.)
                if out.requires_grad:
                    out.backward(grad)
                if stage > 0:
                    outgoing[("grad", i, stage - 1)] = x.grad
                if schedule.zero_bubble:
                    deferred[(i, c)] = self._stores[c].take()
            else:  # W
                deferred.pop((i, c)).run()
            _count_time(stats, action.op, c, began, synchronize)
            record(action.op, i, c, began)
            # Drop this action's references now: through its autograd graph a
            # finished microbatch's output would otherwise keep its stage
            # input alive until the next action reassigns the names.
            x = out = loss = batch = documents = grad = None

        self._finish_sends(stats)
        self._check_done(stash, outgoing, received, deferred)
        return stats

    def _middle_forward(self, c: int, x: torch.Tensor, documents) -> torch.Tensor:
        """Chunk `c` on `x`, not the last stage (no loss); chunks other than
        the GPT's (in tests) take x alone."""
        return self.chunks[c](x) if documents is None else self.chunks[c](x, documents=documents)

    def _check_done(self, stash: dict, outgoing: dict, received: dict, deferred: dict) -> None:
        if stash or outgoing or received or deferred:
            raise RuntimeError(f"pipeline rank {self.ctx.pp_rank}: the schedule left work undone "
                               f"(stashed {list(stash)}, unsent {list(outgoing)}, unused "
                               f"{list(received)}, weight gradients {list(deferred)})")

    def _count_batch_tokens(self, schedule: Schedule, microbatch: MicrobatchFn,
                            on_batch_tokens: Callable[[torch.Tensor], None] | None
                            ) -> tuple[MicrobatchFn, torch.Tensor | None]:
        """--calculate-per-token-loss: the rank that computes the loss reads
        its microbatches and counts the global batch's tokens; with
        `on_batch_tokens` every rank of the pipeline receives the count."""
        ctx, batch_tokens = self.ctx, None
        loss_rank = schedule.location(schedule.num_stages - 1)[0]
        if loss_rank == ctx.pp_rank:
            microbatch, batch_tokens = read_and_count(microbatch, schedule.m, ctx.dp_group)
        if on_batch_tokens is not None:
            counted = batch_tokens if batch_tokens is not None else \
                torch.zeros((), dtype=torch.float32, device=self.device)
            if ctx.pp_group is not None:
                dist.broadcast(counted, src=self._global_rank(loss_rank), group=ctx.pp_group)
            on_batch_tokens(counted)
        return microbatch, batch_tokens

    # Point-to-point -------------------------------------------------------------

    def _tag(self, t: Transfer) -> int:
        # gloo matches messages by tag; unique per (kind, microbatch, boundary).
        return (t.microbatch * 2 + (t.kind == "grad")) * 4096 + t.boundary

    def _exchange(self, exchange: Exchange, outgoing: dict, received: dict,
                  stats: PipelineStats, lazy_sends: bool = False) -> None:
        if lazy_sends:
            self._release_finished_sends(stats)
        else:
            self._finish_sends(stats)   # the previous exchange's sends: long done, as a rule
        ops: list = []
        sent_outputs: list[torch.Tensor] = []
        buffers: list[tuple[Transfer, torch.Tensor]] = []
        for t in exchange.transfers:
            peer = self._global_rank(t.peer)
            if t.op == "send":
                tensor = outgoing.pop(t.tag)
                payload = self._my_slice(tensor) if self.split else tensor.detach().contiguous()
                if t.kind == "activation":
                    sent_outputs.append(tensor)
                stats.sent_elements.append(payload.numel())
                ops.append(dist.P2POp(dist.isend, payload, peer, tag=self._tag(t)))
            else:
                shape = (self.slice_numel,) if self.split else self.activation_shape
                buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
                buffers.append((t, buffer))
                ops.append(dist.P2POp(dist.irecv, buffer, peer, tag=self._tag(t)))
        works = dist.batch_isend_irecv(ops)
        sends: list = []
        if len(works) == len(ops) and self.overlap_sends:
            # One request per operation (gloo): wait for the receives only; the
            # sends complete while this rank computes its next action.
            for op, work in zip(ops, works):
                if op.op is dist.isend:
                    sends.append((work, op.tensor))
                else:
                    work.wait()
        else:
            # One request for the batch (NCCL): waiting only orders the device
            # streams, the host goes on at once.
            for work in works:
                work.wait()
        if sends:
            self._pending_sends.append((sends, sent_outputs))
        else:  # nothing in flight (NCCL's batch was waited for): free at once
            self._release(sent_outputs, stats)
        for t, buffer in buffers:
            received[t.tag] = self._gather(buffer) if self.split else buffer

    def _finish_sends(self, stats: PipelineStats) -> None:
        """Wait for the sends still in flight and free the sent activations."""
        for sends, sent_outputs in self._pending_sends:
            for work, _payload in sends:
                work.wait()
            self._release(sent_outputs, stats)
        self._pending_sends.clear()

    def _release_finished_sends(self, stats: PipelineStats) -> None:
        """Free what completed sends carried, waiting for none (zero-bubble
        schedules: a send never holds its rank up; what is still in flight
        is waited for at the end of the run)."""
        still = []
        for sends, sent_outputs in self._pending_sends:
            if all(work.is_completed() for work, _payload in sends):
                for work, _payload in sends:
                    work.wait()  # completed: returns at once, and surfaces an error
                self._release(sent_outputs, stats)
            else:
                still.append((sends, sent_outputs))
        self._pending_sends = still

    @staticmethod
    def _release(sent_outputs: list[torch.Tensor], stats: PipelineStats) -> None:
        for output in sent_outputs:
            # Autograd keeps only the shape of a chunk's output (its last op
            # is an addition, which saves no tensors): its data can go now.
            storage = output.untyped_storage()
            stats.released_bytes += storage.nbytes()
            storage.resize_(0)

    def _my_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.detach().reshape(-1)
        return flat.narrow(0, self.ctx.tp_rank * self.slice_numel, self.slice_numel).clone()

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.slice_numel * self.ctx.tp_size, dtype=piece.dtype, device=piece.device)
        all_gather_flat(full, piece, self.ctx.tp_group)
        return full.view(self.activation_shape)

