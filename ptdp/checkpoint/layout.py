"""Which rank writes what into a checkpoint, under which name, and the
layout the checkpoint records.

Every rank writes its random states to a file of its own (`rng_file`). Each
logical tensor is written once: a dense one by the first replica of the data
× context group (context ranks hold the same parameters as data-parallel
replicas do, so they write nothing more), spread over its tensor group; a
routed expert's by the first expert-data-parallel replica, spread over its
expert tensor-parallel group (`writes_tensor`). A rank that writes puts its
tensors in one file (`part_name`). At c = 1 the names and the layout record
are the ones written before context parallelism existed, so those
checkpoints load, and resume bitwise, as before.
"""

from __future__ import annotations

from typing import Any


def rng_file(ctx) -> str:
    """The checkpoint's file of this rank's random states: one per rank, the
    context rank named only when there are several."""
    c = ctx.coord
    if ctx.cp_size == 1:
        return f"rng/tp{c.tp}-pp{c.pp}-dp{c.dp}.json"
    return f"rng/tp{c.tp}-cp{c.cp}-pp{c.pp}-dp{c.dp}.json"


def part_name(ctx) -> str:
    """The stem of the tensor file this rank writes (where it writes any).
    The context and data ranks are named only when not 0: a routed expert's
    first expert-data-parallel replica may be any of them."""
    name = f"part-pp{ctx.pp_rank}-tp{ctx.tp_rank}"
    if ctx.cp_rank:
        name += f"-cp{ctx.cp_rank}"
    if ctx.dp_rank:
        name += f"-dp{ctx.dp_rank}"
    return name


def writes_tensor(ctx, expert: bool, index: int) -> bool:
    """Whether this rank writes the `index`-th logical tensor of its kind
    (dense, or routed expert) that its stage holds: the first replica over
    which the kind's gradients are reduced, and of its split group the rank
    whose turn it is (every rank of a group counts alike)."""
    if expert:
        return ctx.edp_rank == 0 and index % ctx.etp_size == ctx.etp_rank
    return ctx.dp_cp_rank == 0 and index % ctx.tp_size == ctx.tp_rank


def writes_state_buffers(ctx) -> bool:
    """Whether this rank writes its stage's saved state that is not a
    parameter (replicated over tensor, context and data ranks)."""
    return ctx.dp_cp_rank == 0 and ctx.tp_rank == 0


def layout_record(state) -> dict[str, Any]:
    """The layout a checkpoint of `state` (a state.TrainingState) records:
    its random states are restored only under the same one (any other
    reseeds the streams)."""
    ctx = state.ctx
    layout = {"tensor": ctx.tp_size, "pipeline": ctx.pp_size, "data": ctx.dp_size,
              "chunks": state.num_chunks,
              "distributed_optimizer": bool(state.buffer.shard)}
    if ctx.cp_size > 1:  # (absent: no context parallelism, as before it existed)
        layout["context"] = ctx.cp_size
    if (ctx.ep_size, ctx.etp_size) != (1, ctx.tp_size):  # (absent: the dense folding)
        layout.update(expert=ctx.ep_size, expert_tensor=ctx.etp_size)
    return layout
