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
    gradients) against the block's backward attention.
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

from typing import Any

# the time category (simulate/predict.py's seconds_by_category)
CONTEXT_EXCHANGE = "context exchange"


def kv_block_bytes(ops: Any) -> float:
    """Bytes of one rank's K and V: 2·b·(s/c)·g·d/t elements."""
    return 2 * ops.b * ops.s * ops.g * ops.d // ops.t * ops.E


def ring_step_exposed(transfer: float, block: float) -> float:
    """What a ring step adds beyond the block it overlaps: the transfer's
    excess over the block's compute, never negative."""
    return max(0.0, transfer - block)


def context_exchange_seconds(ops: Any, backward: bool) -> float:
    """Seconds the key/value exchange of one layer's attention adds to its
    forward (or backward) on one rank (`ops`: a pricing.OperatorModel);
    0 with c = 1."""
    c, machine = ops.c, ops.machine
    if c <= 1:
        return 0.0
    kv = kv_block_bytes(ops)
    if ops.cp_comm == "p2p":
        forward_block, backward_block = ops.attention_block_seconds()
        if backward:
            return (c - 1) * ring_step_exposed(machine.context_step(2 * kv), backward_block)
        return (c - 1) * ring_step_exposed(machine.context_step(kv), forward_block)
    if ops.cp_comm == "all_gather":
        return machine.context_gather(c * kv)   # of the whole sequence's K,V; reduce-scatter back
    if ops.cp_comm == "a2a":
        q = ops.b * ops.s * ops.a * ops.d // ops.t * ops.E   # q and the output, each
        return 2 * machine.context_all_to_all(q) + 2 * machine.context_all_to_all(kv / 2)
    raise ValueError(f"unknown --cp-comm-type {ops.cp_comm!r}: use p2p, all_gather or a2a")
