"""Logical tensors and their tensor-parallel shards.

Every parameter has a logical (unsharded, unpadded) form that does not depend
on the layout. A sharded parameter carries a `TensorShard` saying how its
local tensor was cut from the logical one; a parameter without it is
replicated across the tensor group. Initialisation, gradient checks and
checkpoints all go through `shard` and `unshard`, so the same seed gives the
same logical weights under any (t, p, d).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

SHARD_ATTR = "tensor_shard"
INIT_ATTR = "init_rule"
# Marks a second copy of a logical tensor (the last pipeline stage's tied word
# embedding): it is kept equal to the first, so norms and checkpoints skip it.
COPY_ATTR = "is_logical_copy"
# Marks a replicated parameter whose gradient each tensor rank computes from
# its own s/t positions only (sequence parallelism): summed over the tensor
# group before use.
PARTIAL_GRAD_ATTR = "grad_is_partial_over_tensor_ranks"
# Marks a routed expert's parameter: split over the expert tensor-parallel
# group (its TensorShard counts ETP parts), held by one expert-parallel rank,
# replicated over the expert-data-parallel group.
EXPERT_ATTR = "is_routed_expert"


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, EXPERT_ATTR, False)


def shard_group(param: torch.Tensor, ctx):
    """The group over which `param` is split: the expert tensor-parallel
    group for a routed expert's, the tensor group otherwise."""
    return ctx.expert_tensor_group if is_expert(param) else ctx.tp_group


@dataclass(frozen=True)
class TensorShard:
    dim: int                 # dimension that is split
    parts: int               # tensor-parallel size t
    index: int               # this rank's part
    # The dimension holds `blocks` equal blocks (q, k, v), each split; or, as a
    # tuple, blocks of these logical sizes (grouped-query attention's q, k, v).
    blocks: int | tuple[int, ...] = 1
    # The vocabulary dimension is padded with zeros from logical_size to
    # padded_size before splitting; the padding is not part of the logical tensor.
    logical_size: int | None = None
    padded_size: int | None = None

    def logical_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = (self.logical_size if self.logical_size is not None
                           else local_shape[self.dim] * self.parts)
        return tuple(shape)


def shard(full: torch.Tensor, spec: TensorShard) -> torch.Tensor:
    """This rank's part of the logical tensor `full`."""
    if spec.padded_size is not None:
        pad = spec.padded_size - full.shape[spec.dim]
        if pad < 0:
            raise ValueError(f"logical size {full.shape[spec.dim]} exceeds padded size {spec.padded_size}")
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = pad
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    blocks = _blocks(full, spec, 1)
    return torch.cat([b.chunk(spec.parts, dim=spec.dim)[spec.index] for b in blocks], dim=spec.dim)


def unshard(parts: list[torch.Tensor], spec: TensorShard) -> torch.Tensor:
    """The logical tensor from all ranks' parts (in tensor-rank order)."""
    per_rank = [_blocks(p, spec, spec.parts) for p in parts]
    full = torch.cat([torch.cat([r[b] for r in per_rank], dim=spec.dim)
                      for b in range(len(per_rank[0]))], dim=spec.dim)
    if spec.logical_size is not None:
        full = full.narrow(spec.dim, 0, spec.logical_size)
    return full


def _blocks(tensor: torch.Tensor, spec: TensorShard, parts: int) -> tuple[torch.Tensor, ...]:
    """`tensor`'s blocks along the split dimension; `parts` is how many ranks
    share each block (1 for the logical tensor, t for one rank's shard)."""
    if isinstance(spec.blocks, int):
        return tensor.chunk(spec.blocks, dim=spec.dim)
    return tensor.split([size // parts for size in spec.blocks], dim=spec.dim)


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for the logical tensor `name` (independent of layout,
    process and Python's hash randomisation)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class InitRule:
    kind: str                # "normal" | "zeros" | "ones"
    std: float = 0.0


def set_init(param: torch.nn.Parameter, kind: str, std: float = 0.0) -> torch.nn.Parameter:
    setattr(param, INIT_ATTR, InitRule(kind, std))
    return param


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    spec: TensorShard | None = getattr(param, SHARD_ATTR, None)
    return tuple(param.shape) if spec is None else spec.logical_shape(param.shape)


def make_logical(param: torch.Tensor, name: str, seed: int) -> torch.Tensor:
    """The logical value of parameter `name` at initialisation, on CPU in fp32."""
    rule: InitRule = getattr(param, INIT_ATTR)
    shape = logical_shape(param)
    if rule.kind == "zeros":
        return torch.zeros(shape)
    if rule.kind == "ones":
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, rule.std, generator=generator)


@torch.no_grad()
def initialize_parameters(module: torch.nn.Module, seed: int) -> None:
    """Give every parameter its layout-independent initial value.

    Each logical tensor is drawn in full from a generator seeded by its name and
    then cut to this rank's shard: one logical tensor in memory at a time.
    """
    for name, param in module.named_parameters():
        if not hasattr(param, INIT_ATTR):
            raise ValueError(f"parameter {name} has no initialisation rule (set_init)")
        full = make_logical(param, name, seed)
        spec = getattr(param, SHARD_ATTR, None)
        local = shard(full, spec) if spec is not None else full
        param.copy_(local.to(param.dtype))


def gather_logical(local: torch.Tensor, spec: TensorShard | None, group) -> torch.Tensor:
    """The logical tensor from this rank's shard and its tensor group's."""
    if spec is None or group is None:
        return local if spec is None else unshard([local], spec)
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(spec.parts)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return unshard(parts, spec)
