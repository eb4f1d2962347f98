"""The rank grid and its process groups.

Ranks are laid out with the tensor dimension innermost, then data, then
pipeline (Megatron-LM's default order), so a tensor group is t consecutive
ranks, i.e. GPUs of one server joined by the fastest links:

    rank = tp_rank + t · (dp_rank + d · pp_rank)

`RankGrid` is pure arithmetic (no torch.distributed), so its groups can be
checked for any layout without processes. `ParallelContext` is the one object
a rank passes around: its grid coordinates plus the torch process groups it
belongs to. There are no module-level globals for parallel state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ptdp.plural import plural


@dataclass(frozen=True)
class Coord:
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class RankGrid:
    tp: int
    dp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return Coord(tp=rank % self.tp, dp=(rank // self.tp) % self.dp,
                     pp=rank // (self.tp * self.dp))

    # Each *_groups method returns every group of that kind, each a sorted list
    # of ranks; together the groups of one kind partition the world.
    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def data_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """All ranks holding one replica of the model: tensor × pipeline."""
        return [sorted(self.rank(t, d, p) for p in range(self.pp) for t in range(self.tp))
                for d in range(self.dp)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: the two copies of the tied
        word embedding, whose gradients are summed. One rank when p == 1."""
        return [sorted({g[0], g[-1]}) for g in self.pipeline_groups()]

    def groups_of(self, kind: str) -> list[list[int]]:
        return getattr(self, f"{kind}_groups")()

    def group_containing(self, kind: str, rank: int) -> list[int]:
        for group in self.groups_of(kind):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in no {kind} group")  # only embedding groups skip ranks


GROUP_KINDS = ("tensor", "data", "pipeline", "model_parallel", "embedding")


@dataclass
class ParallelContext:
    """What one rank knows about the layout. Build with `ParallelContext.build`
    (collective: every rank must call it) or `ParallelContext.single()`."""

    grid: RankGrid
    rank: int
    # kind -> ProcessGroup, None for a group of one rank; a middle pipeline
    # stage has no "embedding" entry (it holds no copy of the word embedding).
    groups: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def single(cls) -> "ParallelContext":
        """One process computing the whole model: the serial reference."""
        return cls(grid=RankGrid(1, 1, 1), rank=0, groups={k: None for k in GROUP_KINDS})

    @classmethod
    def build(cls, grid: RankGrid, rank: int | None = None,
              timeout: timedelta | None = None) -> "ParallelContext | None":
        """Create the process groups of `grid` on the default process group.

        Every rank of the default group must call this in the same order, as
        torch.distributed.new_group requires; ranks outside the grid (world
        larger than the grid, as in the test pool) get no context. `timeout`
        bounds every collective of the groups (give the job's: without it
        torch's default, 30 minutes, applies to them).
        """
        import torch.distributed as dist

        if rank is None:
            rank = dist.get_rank()
        if dist.get_world_size() < grid.world_size:
            raise ValueError(f"the layout needs {plural(grid.world_size, 'process')}, the job "
                             f"has {dist.get_world_size()}")
        groups: dict[str, Any] = {}
        for kind in GROUP_KINDS:
            for ranks in grid.groups_of(kind):
                # new_group is collective over the whole default group, so it is
                # called for every group, also those this rank is not part of.
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[kind] = group
        if rank >= grid.world_size:
            return None
        return cls(grid=grid, rank=rank, groups=groups)

    def destroy(self) -> None:
        """Release this context's process groups (each holds communicator
        threads): for a process that builds one layout after another."""
        import torch.distributed as dist

        released = set()
        for group in self.groups.values():
            if group is not None and id(group) not in released:
                released.add(id(group))
                dist.destroy_process_group(group)
        self.groups = {kind: None for kind in self.groups}

    @property
    def coord(self) -> Coord:
        return self.grid.coord(self.rank)

    # Sizes and this rank's coordinates.
    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def dp_size(self) -> int:
        return self.grid.dp

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def tp_group(self) -> Any:
        return self.groups["tensor"]

    @property
    def dp_group(self) -> Any:
        return self.groups["data"]

    @property
    def pp_group(self) -> Any:
        return self.groups["pipeline"]

    @property
    def mp_group(self) -> Any:
        return self.groups["model_parallel"]

    @property
    def embedding_group(self) -> Any:
        return self.groups.get("embedding")

    @property
    def world_group(self) -> Any:
        """Every rank of the layout (None for one process)."""
        if self.grid.world_size == 1:
            return None
        import torch.distributed as dist

        return dist.group.WORLD

    @property
    def holds_word_embedding(self) -> bool:
        return "embedding" in self.groups

    # Pipeline neighbours.
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int | None:
        c = self.coord
        return None if self.is_last_stage else self.grid.rank(c.tp, c.dp, c.pp + 1)

    @property
    def prev_rank(self) -> int | None:
        c = self.coord
        return None if self.is_first_stage else self.grid.rank(c.tp, c.dp, c.pp - 1)



def group_table(grid: RankGrid) -> str:
    """A Markdown table of which ranks form which groups (used in the README)."""
    lines = ["| group kind | groups |", "|---|---|"]
    for kind in GROUP_KINDS:
        groups = " ".join("[" + ",".join(map(str, g)) + "]" for g in grid.groups_of(kind))
        lines.append(f"| {kind} | {groups} |")
    return "\n".join(lines)
