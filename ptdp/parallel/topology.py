"""The rank grid and its process groups.

Ranks are laid out with the tensor dimension innermost, then context, then
data, then pipeline (Megatron-Core's default order, tp-cp-ep-dp-pp), so a
tensor group is t consecutive ranks, i.e. GPUs of one server joined by the
fastest links, and a context group, whose ring passes key/value blocks every
layer, comes next:

    rank = tp_rank + t · (cp_rank + c · (dp_rank + d · pp_rank))

Context ranks hold the same parameters (each computes other positions of
the same sequences), so gradients are reduced, and the distributed optimizer
shards, over the data × context group ("data_context", Megatron-Core's
dp-cp); with c = 1 it is the data-parallel group.

Expert layers fold the same t·c·d ranks of a pipeline stage differently
(Megatron-Core's "parallel folding"): expert tensor-parallel innermost, then
expert-parallel, then expert-data-parallel, over the same pipeline groups:

    rank = etp_rank + ETP · (ep_rank + EP · (edp_rank + EDP · pp_rank)),
    EDP = t·c·d / (ETP·EP)

so an expert-parallel group may span tensor, context and data-parallel
ranks (experts see tokens, not sequences: there is no expert context
dimension). With the defaults (ETP = t, EP = 1, c = 1) the expert groups are
the dense ones.

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
    cp: int = 0


@dataclass(frozen=True)
class ExpertCoord:
    etp: int
    ep: int
    edp: int
    pp: int


@dataclass(frozen=True)
class RankGrid:
    tp: int
    dp: int
    pp: int
    ep: int = 1               # expert-parallel size EP
    etp: int | None = None    # expert tensor-parallel size ETP (None: tp)
    cp: int = 1               # context-parallel size c

    def __post_init__(self):
        if self.stage_size % (self.ep * self.expert_tp):
            ranks = "t·d" if self.cp == 1 else "t·c·d"
            raise ValueError(f"EP {self.ep} × ETP {self.expert_tp} does not divide the "
                             f"{self.stage_size} ranks ({ranks}) of a pipeline stage")

    @property
    def stage_size(self) -> int:
        """t·c·d: the ranks of one pipeline stage."""
        return self.tp * self.cp * self.dp

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """EDP: the replicas of one expert shard within a pipeline stage."""
        return self.stage_size // (self.ep * self.expert_tp)

    def expert_rank(self, etp: int, ep: int, edp: int, pp: int) -> int:
        return etp + self.expert_tp * (ep + self.ep * (edp + self.expert_dp * pp))

    def expert_coord(self, rank: int) -> ExpertCoord:
        self.coord(rank)  # range check
        ETP, EP = self.expert_tp, self.ep
        return ExpertCoord(etp=rank % ETP, ep=(rank // ETP) % EP,
                           edp=(rank // (ETP * EP)) % self.expert_dp,
                           pp=rank // self.stage_size)

    def rank(self, tp: int, dp: int, pp: int, cp: int | None = None) -> int:
        """The rank at these coordinates. `cp` may be left out only without
        context parallelism, so that no caller drops it by mistake."""
        if cp is None:
            if self.cp > 1:
                raise ValueError(f"a grid with {self.cp} context ranks needs the context "
                                 f"coordinate of a rank")
            cp = 0
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return Coord(tp=rank % self.tp, cp=(rank // self.tp) % self.cp,
                     dp=(rank // (self.tp * self.cp)) % self.dp, pp=rank // self.stage_size)

    # Each *_groups method returns every group of that kind, each a sorted list
    # of ranks; together the groups of one kind partition the world.
    # The loops run over every coordinate but the group's, the slowest first,
    # so the groups come in the order of their first ranks, as Megatron-Core
    # lists them (tests/test_topology.py compares them with its order).
    def tensor_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p, c) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def context_groups(self) -> list[list[int]]:
        """The c ranks that split each sequence (Megatron-Core's cp group)."""
        return [[self.rank(t, d, p, c) for c in range(self.cp)]
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def data_groups(self) -> list[list[int]]:
        """The d ranks that read different samples (no context ranks)."""
        return [[self.rank(t, d, p, c) for d in range(self.dp)]
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def data_context_groups(self) -> list[list[int]]:
        """The d·c replicas of the same parameters (Megatron-Core's dp-cp):
        gradients are reduced and the distributed optimizer shards over them.
        Member i is (cp_rank, dp_rank) = (i mod c, i div c)."""
        return [[self.rank(t, d, p, c) for d in range(self.dp) for c in range(self.cp)]
                for p in range(self.pp) for t in range(self.tp)]

    def tensor_context_groups(self) -> list[list[int]]:
        """The t·c ranks that together compute one microbatch of one stage
        (Megatron-Core's tp-cp)."""
        return [[self.rank(t, d, p, c) for c in range(self.cp) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def pipeline_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p, c) for p in range(self.pp)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """All ranks holding one replica of the model: tensor × pipeline."""
        return [sorted(self.rank(t, d, p, c) for p in range(self.pp) for t in range(self.tp))
                for d in range(self.dp) for c in range(self.cp)]

    def expert_tensor_groups(self) -> list[list[int]]:
        """The ranks holding the ETP shards of the same experts."""
        return [[self.expert_rank(t, e, d, p) for t in range(self.expert_tp)]
                for p in range(self.pp) for d in range(self.expert_dp) for e in range(self.ep)]

    def expert_groups(self) -> list[list[int]]:
        """Expert-parallel groups: the EP ranks among which the experts are split."""
        return [[self.expert_rank(t, e, d, p) for e in range(self.ep)]
                for p in range(self.pp) for d in range(self.expert_dp)
                for t in range(self.expert_tp)]

    def expert_data_groups(self) -> list[list[int]]:
        """The replicas of one expert shard: its gradients are reduced over them."""
        return [[self.expert_rank(t, e, d, p) for d in range(self.expert_dp)]
                for p in range(self.pp) for e in range(self.ep) for t in range(self.expert_tp)]

    def expert_dispatch_groups(self) -> list[list[int]]:
        """ETP × EP consecutive ranks that hold every expert once between
        them: their tokens are exchanged in an MoE layer."""
        size = self.expert_tp * self.ep
        return [list(range(start, start + size)) for start in range(0, self.world_size, size)]

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
EXPERT_GROUP_KINDS = ("expert_tensor", "expert", "expert_data", "expert_dispatch")
# With c = 1 these are one-rank groups or the data and tensor groups again,
# so building them creates no process group.
CONTEXT_GROUP_KINDS = ("context", "data_context", "tensor_context")
ALL_GROUP_KINDS = GROUP_KINDS + EXPERT_GROUP_KINDS + CONTEXT_GROUP_KINDS


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
        return cls(grid=RankGrid(1, 1, 1), rank=0,
                   groups={k: None for k in ALL_GROUP_KINDS})

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
        made: dict[tuple[int, ...], Any] = {}  # an expert group equal to a dense one is that one
        for kind in ALL_GROUP_KINDS:
            for ranks in grid.groups_of(kind):
                key = tuple(ranks)
                if key not in made:
                    # new_group is collective over the whole default group, so it is
                    # called for every group, also those this rank is not part of.
                    made[key] = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[kind] = made[key]
        if grid.world_size > 1:  # every rank of the layout, which may be fewer than the job's
            whole = (dist.group.WORLD if grid.world_size == dist.get_world_size()
                     else dist.new_group(list(range(grid.world_size)), timeout=timeout))
            if rank < grid.world_size:
                groups["grid"] = whole
        if rank >= grid.world_size:
            return None
        return cls(grid=grid, rank=rank, groups=groups)

    def destroy(self) -> None:
        """Release this context's process groups (each holds communicator
        threads): for a process that builds one layout after another."""
        import torch.distributed as dist

        released = {id(dist.group.WORLD)}  # the job's own group stays
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
    def cp_size(self) -> int:
        return self.grid.cp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def cp_rank(self) -> int:
        return self.coord.cp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    # The expert layers' folding of the same ranks.
    @property
    def expert_coord(self) -> ExpertCoord:
        return self.grid.expert_coord(self.rank)

    @property
    def etp_size(self) -> int:
        return self.grid.expert_tp

    @property
    def etp_rank(self) -> int:
        return self.expert_coord.etp

    @property
    def ep_size(self) -> int:
        return self.grid.ep

    @property
    def ep_rank(self) -> int:
        return self.expert_coord.ep

    @property
    def edp_size(self) -> int:
        return self.grid.expert_dp

    @property
    def edp_rank(self) -> int:
        return self.expert_coord.edp

    @property
    def expert_tensor_group(self) -> Any:
        return self.groups["expert_tensor"]

    @property
    def expert_group(self) -> Any:
        return self.groups["expert"]

    @property
    def expert_data_group(self) -> Any:
        return self.groups["expert_data"]

    @property
    def expert_dispatch_group(self) -> Any:
        return self.groups["expert_dispatch"]

    @property
    def tp_group(self) -> Any:
        return self.groups["tensor"]

    @property
    def dp_group(self) -> Any:
        return self.groups["data"]

    @property
    def pp_group(self) -> Any:
        return self.groups["pipeline"]

    # Context parallelism. Context ranks replicate the parameters, so what
    # reduces gradients or shards the optimizer uses the data × context group
    # (grad_reduce_*); what counts samples uses the data group alone.
    # At c = 1 they are the dense groups: a context built by hand with only
    # those (a cost-model check, a test) still answers.
    @property
    def cp_group(self) -> Any:
        return self.groups["context"] if self.grid.cp > 1 else self.groups.get("context")

    @property
    def tp_cp_group(self) -> Any:
        """Tensor × context: the ranks computing one microbatch of one stage."""
        if self.grid.cp > 1:
            return self.groups["tensor_context"]
        return self.groups.get("tensor_context", self.tp_group)

    @property
    def dp_cp_group(self) -> Any:
        """Data × context (Megatron-Core's dp-cp); the data group when c = 1."""
        if self.grid.cp > 1:
            return self.groups["data_context"]
        return self.groups.get("data_context", self.dp_group)

    @property
    def dp_cp_size(self) -> int:
        return self.grid.dp * self.grid.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.cp_rank + self.cp_size * self.dp_rank

    @property
    def grad_reduce_group(self) -> Any:
        """Where the replicas of a dense parameter's gradient are reduced and
        the distributed optimizer shards: data × context."""
        return self.dp_cp_group

    @property
    def grad_reduce_size(self) -> int:
        return self.dp_cp_size

    @property
    def grad_reduce_rank(self) -> int:
        return self.dp_cp_rank

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
        if "grid" in self.groups:
            return self.groups["grid"]
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
        return None if self.is_last_stage else self.grid.rank(c.tp, c.dp, c.pp + 1, c.cp)

    @property
    def prev_rank(self) -> int | None:
        c = self.coord
        return None if self.is_first_stage else self.grid.rank(c.tp, c.dp, c.pp - 1, c.cp)



def group_table(grid: RankGrid) -> str:
    """A Markdown table of which ranks form which groups (used in the README)."""
    lines = ["| group kind | groups |", "|---|---|"]
    kinds = (GROUP_KINDS + (CONTEXT_GROUP_KINDS if grid.cp > 1 else ())
             + (EXPERT_GROUP_KINDS if (grid.ep, grid.expert_tp) != (1, grid.tp) else ()))
    for kind in kinds:
        groups = " ".join("[" + ",".join(map(str, g)) + "]" for g in grid.groups_of(kind))
        lines.append(f"| {kind} | {groups} |")
    return "\n".join(lines)
