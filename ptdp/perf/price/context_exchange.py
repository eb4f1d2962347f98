"""What context parallelism's attention adds to a layer beyond its compute:
the key/value exchange of --cp-comm-type over the c context ranks, per
microbatch and tensor rank (ptdp.parallel.context_attention does the work).

Notation: b microbatch, s sequence, c context ranks, t tensor ranks, g
key/value groups, a heads, d head size, E bytes per element. A rank holds
s/c positions of each sequence; its K and V are 2·b·(s/c)·g·d/t elements.

  p2p (a ring): forward, c − 1 steps, each sending this rank's current K,V
    block to the next rank while the block in hand is computed; a step
    costs max(0, transfer − block's forward attention) beyond the
    attention (the block's compute is priced with the layer's). Backward:
    c − 1 steps of twice the bytes (the K,V blocks again and their
    gradients) against the block's backward attention. A windowed layer's
    steps compute what the window leaves of their blocks (ptdp.perf.
    analytic.context_window: with a short window most compute nothing and
    hide nothing, yet still pass their block on), differently on each rank:
    each rank's ring takes Σ_k max(transfer, block_k) over its first c − 1
    steps plus its last block, the slowest rank's ring sets the layer's
    time, and what it adds beyond the busiest rank's compute (priced with
    the layer's) is the exchange. A model whose layers mix windowed and
    full attention is priced at the mean of the two layers' exchange.
  all_gather: forward, an all-gather of K,V over the group ((c − 1)/c of
    2·b·s·g·d/t elements arrive); backward, the reduce-scatter of their
    gradients. Nothing overlaps them.
  a2a: forward, four all-to-alls (q, k, v to the head split, the output
    back), each moving (c − 1)/c of its tensor; backward four more. Not
    overlapped.

The link is the context group's slowest (ptdp.perf.price.machine.Machine.link):
the fast intra-server one while the t·c ranks it spans fit in a server.
"""

from __future__ import annotations

from typing import Any, Callable

from ptdp.perf.analytic.context_window import context_window_work

# the time category (simulate/predict.py's seconds_by_category)
CONTEXT_EXCHANGE = "context exchange"


def kv_block_bytes(ops: Any) -> float:
    """Bytes of one rank's K and V: 2·b·(s/c)·g·d/t elements."""
    return 2 * ops.b * ops.s * ops.g * ops.d // ops.t * ops.E


def ring_step_exposed(transfer: float, block: float) -> float:
    """What a ring step adds beyond the block it overlaps: the transfer's
    excess over the block's compute, never negative."""
    return max(0.0, transfer - block)


def windowed_ring_exposed(transfer: float, steps: tuple[tuple[float, ...], ...],
                          block_seconds: Callable[[float], float]) -> float:
    """What a ring of `transfer` seconds a step adds beyond the busiest
    rank's compute when rank r's step k computes the share `steps[r][k]` of
    a full block (`block_seconds(share)`): the slowest rank's ring time,
    each of its first c − 1 steps lasting max(transfer, block), less the
    busiest rank's blocks."""
    seconds: dict[float, float] = {}

    def block(share: float) -> float:
        if share not in seconds:
            seconds[share] = block_seconds(share)
        return seconds[share]

    computes = [sum(block(share) for share in row) for row in steps]
    rings = [compute + sum(ring_step_exposed(transfer, block(share)) for share in row[:-1])
             for compute, row in zip(computes, steps)]
    return max(rings) - max(computes)


def context_exchange_seconds(ops: Any, backward: bool) -> float:
    """Seconds the key/value exchange of one layer's attention adds to its
    forward (or backward) on one rank (`ops`: a pricing.OperatorModel);
    0 with c = 1."""
    c, machine = ops.c, ops.machine
    if c <= 1:
        return 0.0
    kv = kv_block_bytes(ops)
    if ops.cp_comm == "p2p":
        side = 1 if backward else 0   # (forward, backward) of attention_block_seconds
        transfer = machine.context_step(2 * kv if backward else kv)
        full = (c - 1) * ring_step_exposed(transfer, ops.attention_block_seconds()[side])
        model = ops.w.model
        windowed = sum(model.windowed_layers)
        if not windowed:
            return full
        work = context_window_work(model.seq_length, c, model.window[0], "p2p")
        exposed = windowed_ring_exposed(transfer, work.steps,
                                        lambda share: ops.attention_block_seconds(share)[side])
        return (windowed * exposed + (model.num_layers - windowed) * full) / model.num_layers
    if ops.cp_comm == "all_gather":
        return machine.context_gather(c * kv)   # of the whole sequence's K,V; reduce-scatter back
    if ops.cp_comm == "a2a":
        q = ops.b * ops.s * ops.a * ops.d // ops.t * ops.E   # q and the output, each
        return 2 * machine.context_all_to_all(q) + 2 * machine.context_all_to_all(kv / 2)
    raise ValueError(f"unknown --cp-comm-type {ops.cp_comm!r}: use p2p, all_gather or a2a")
