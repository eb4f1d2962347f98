"""The rank grid: tensor innermost, then data, then pipeline; every kind of
group partitions the ranks; the real process groups connect exactly the
ranks the grid says."""

import itertools

import pytest
import torch
import torch.distributed as dist

from ptdp.parallel.topology import GROUP_KINDS, ParallelContext, RankGrid, group_table

LAYOUTS = [RankGrid(t, d, p) for t, d, p in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 4])]


@pytest.mark.parametrize("grid", LAYOUTS, ids=lambda g: f"t{g.tp}d{g.dp}p{g.pp}")
def test_groups_partition_the_ranks(grid):
    world = set(range(grid.world_size))
    sizes = {"tensor": grid.tp, "data": grid.dp, "pipeline": grid.pp,
             "model_parallel": grid.tp * grid.pp}
    for kind, size in sizes.items():
        groups = grid.groups_of(kind)
        assert len(groups) == grid.world_size // size
        assert all(len(g) == size for g in groups)
        assert sorted(itertools.chain.from_iterable(groups)) == sorted(world), kind

    for rank in world:
        c = grid.coord(rank)
        assert grid.rank(c.tp, c.dp, c.pp) == rank
        # Tensor innermost: a tensor group is t consecutive ranks.
        assert grid.group_containing("tensor", rank) == list(range(rank - c.tp, rank - c.tp + grid.tp))
        # Members of a group differ only in that group's coordinate.
        for member in grid.group_containing("data", rank):
            m = grid.coord(member)
            assert (m.tp, m.pp) == (c.tp, c.pp)
        for member in grid.group_containing("pipeline", rank):
            m = grid.coord(member)
            assert (m.tp, m.dp) == (c.tp, c.dp)
        for member in grid.group_containing("model_parallel", rank):
            assert grid.coord(member).dp == c.dp

    # Embedding groups: first and last stage of each pipeline.
    for pipeline, embedding in zip(grid.pipeline_groups(), grid.embedding_groups()):
        assert embedding == sorted({pipeline[0], pipeline[-1]})


def test_megatron_order_example():
    # 16 ranks, t = 2, d = 2, p = 4: the example layout in the README.
    grid = RankGrid(tp=2, dp=2, pp=4)
    assert grid.tensor_groups()[:3] == [[0, 1], [2, 3], [4, 5]]
    assert grid.data_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
    assert grid.pipeline_groups()[:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert grid.model_parallel_groups() == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert grid.embedding_groups()[0] == [0, 12]
    assert "| tensor | [0,1] [2,3]" in group_table(grid)


EXPERT_LAYOUTS = [RankGrid(t, d, p, ep=ep, etp=etp)
                  for t, d, p in itertools.product([1, 2, 4], [1, 2, 4], [1, 2])
                  for ep in (1, 2, 4, 8) for etp in (1, 2, 4)
                  if (t * d) % (ep * etp) == 0]


@pytest.mark.parametrize("grid", EXPERT_LAYOUTS,
                         ids=lambda g: f"t{g.tp}d{g.dp}p{g.pp}ep{g.ep}etp{g.etp}")
def test_expert_groups_fold_the_ranks_of_each_stage(grid):
    """Megatron-Core's folding (etp innermost, then ep, then edp, then the
    same pipeline stages): every kind of expert group partitions the ranks,
    its members differ only in its coordinate, and no group leaves a stage."""
    ETP, EP, EDP = grid.expert_tp, grid.ep, grid.expert_dp
    assert ETP * EP * EDP == grid.tp * grid.dp
    world = set(range(grid.world_size))
    sizes = {"expert_tensor": ETP, "expert": EP, "expert_data": EDP, "expert_dispatch": ETP * EP}
    for kind, size in sizes.items():
        groups = grid.groups_of(kind)
        assert all(len(g) == size for g in groups), kind
        assert sorted(itertools.chain.from_iterable(groups)) == sorted(world), kind
        for group in groups:  # within one pipeline stage, as the dense groups of a stage
            assert len({grid.coord(r).pp for r in group}) == 1, kind
    for rank in world:
        e = grid.expert_coord(rank)
        assert grid.expert_rank(e.etp, e.ep, e.edp, e.pp) == rank
        assert e.pp == grid.coord(rank).pp
        for kind, same in (("expert_tensor", ("ep", "edp")), ("expert", ("etp", "edp")),
                           ("expert_data", ("etp", "ep")), ("expert_dispatch", ("edp",))):
            for member in grid.group_containing(kind, rank):
                m = grid.expert_coord(member)
                assert all(getattr(m, f) == getattr(e, f) for f in same), (kind, rank, member)


def test_expert_folding_example():
    # t = 2, d = 2: EP 4 with ETP 1 spans the tensor and data-parallel ranks of a stage.
    grid = RankGrid(tp=2, dp=2, pp=2, ep=4, etp=1)
    assert grid.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.expert_data_groups()[:2] == [[0], [1]]
    # EP 2 with ETP 2 (= t): the experts' tensor groups are the dense ones, EP spans d.
    grid = RankGrid(tp=2, dp=2, pp=1, ep=2)
    assert grid.expert_tensor_groups() == grid.tensor_groups() == [[0, 1], [2, 3]]
    assert grid.expert_groups() == [[0, 2], [1, 3]]
    assert "| expert | [0,2] [1,3] |" in group_table(grid)
    # The defaults fold nothing: the expert groups are the dense ones.
    grid = RankGrid(tp=2, dp=2, pp=2)
    assert grid.expert_data_groups() == grid.data_groups()
    assert "expert" not in group_table(grid)
    with pytest.raises(ValueError, match="EP 4 × ETP 2 does not divide the 4 ranks"):
        RankGrid(tp=2, dp=2, pp=1, ep=4)


def test_coordinates_outside_the_grid_are_rejected():
    with pytest.raises(ValueError, match="rank 8 outside a world of 8"):
        RankGrid(2, 2, 2).coord(8)


def _probe_groups(rank, t, d, p):
    """Sum each rank's id over each of its groups; return what it saw."""
    ctx = ParallelContext.build(RankGrid(tp=t, dp=d, pp=p))
    seen = {}
    for kind in GROUP_KINDS:
        if kind not in ctx.groups:  # middle pipeline stages hold no embedding copy
            continue
        group = ctx.groups[kind]
        value = torch.tensor([float(1 << rank)])
        if group is not None:
            dist.all_reduce(value, group=group)
        seen[kind] = int(value.item())
    c = ctx.coord
    return seen, (c.tp, c.dp, c.pp), ctx.prev_rank, ctx.next_rank, ctx.is_first_stage, ctx.is_last_stage


@pytest.mark.parametrize("t,d,p", [(2, 2, 2), (4, 1, 2), (1, 2, 4), (2, 4, 1), (8, 1, 1), (1, 1, 8)])
def test_process_groups_connect_the_grid_ranks(pools, t, d, p):
    grid = RankGrid(t, d, p)
    results = pools(8).run(_probe_groups, t, d, p)
    for rank, (seen, coord, prev_rank, next_rank, first, last) in enumerate(results):
        c = grid.coord(rank)
        assert coord == (c.tp, c.dp, c.pp)
        for kind in GROUP_KINDS:
            if kind == "embedding" and 0 < c.pp < p - 1:
                assert kind not in seen
                continue
            members = grid.group_containing(kind, rank)
            assert seen[kind] == sum(1 << m for m in members), (kind, rank)
        assert first == (c.pp == 0) and last == (c.pp == p - 1)
        assert prev_rank == (None if c.pp == 0 else grid.rank(c.tp, c.dp, c.pp - 1))
        assert next_rank == (None if c.pp == p - 1 else grid.rank(c.tp, c.dp, c.pp + 1))


def test_single_context_has_no_groups():
    ctx = ParallelContext.single()
    assert ctx.tp_size == ctx.dp_size == ctx.pp_size == 1
    assert all(ctx.groups[k] is None for k in GROUP_KINDS)
    assert ctx.is_first_stage and ctx.is_last_stage and ctx.next_rank is None
