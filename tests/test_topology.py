"""The rank grid: tensor innermost, then context, then data, then pipeline;
every kind of group partitions the ranks and equals Megatron-Core's (computed
here independently from its order, tp-cp-ep-dp-pp); the real process groups
connect exactly the ranks the grid says."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from ptdp.parallel.topology import CONTEXT_GROUP_KINDS, EXPERT_GROUP_KINDS, GROUP_KINDS, \
    ParallelContext, RankGrid, group_table

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


def megatron_groups(sizes: dict[str, int], order: str, token: str) -> list[list[int]]:
    """Megatron-Core's groups of the dimensions in `token` ("tp-cp"), with
    the ranks laid out in `order` ("tp-cp-dp-pp": the first innermost):
    rank = Σ coordinate · (product of the sizes before it). Groups are listed
    with the other dimensions' coordinates, the first fastest; the ranks of a
    group with its own dimensions' coordinates, the first fastest."""
    names = order.split("-")
    strides = [math.prod(sizes[n] for n in names[:i]) for i in range(len(names))]
    inside = [i for i, n in enumerate(names) if n in token.split("-")]
    outside = [i for i in range(len(names)) if i not in inside]

    def enumerate_fastest_first(dims):  # itertools.product varies its last factor fastest
        for values in itertools.product(*(range(sizes[names[i]]) for i in reversed(dims))):
            yield dict(zip(reversed(dims), values))

    return [[sum(strides[i] * {**fixed, **free}[i] for i in range(len(names)))
             for free in enumerate_fastest_first(inside)]
            for fixed in enumerate_fastest_first(outside)]


CONTEXT_LAYOUTS = [RankGrid(t, d, p, ep=ep, etp=etp, cp=c)
                   for t, c, d, p in itertools.product([1, 2, 4], [1, 2, 3, 4], [1, 2], [1, 2, 3])
                   for ep in (1, 2, 4) for etp in (None, 1, 2)
                   if (t * c * d) % (ep * (t if etp is None else etp)) == 0]


@pytest.mark.parametrize("grid", CONTEXT_LAYOUTS,
                         ids=lambda g: f"t{g.tp}c{g.cp}d{g.dp}p{g.pp}ep{g.ep}etp{g.etp}")
def test_every_group_is_megatron_cores(grid):
    """Every kind of group, dense and expert, with context parallelism: the
    same groups in the same order as Megatron-Core's rank generators (dense:
    tp-cp-dp-pp; experts: tp-ep-dp-pp over the same ranks, cp folded into
    the expert data-parallel size), and each kind partitions the ranks."""
    dense = {"tp": grid.tp, "cp": grid.cp, "dp": grid.dp, "pp": grid.pp}
    expert = {"tp": grid.expert_tp, "ep": grid.ep, "dp": grid.expert_dp, "pp": grid.pp}
    assert math.prod(expert.values()) == math.prod(dense.values()) == grid.world_size
    expected = {
        "tensor": megatron_groups(dense, "tp-cp-dp-pp", "tp"),
        "context": megatron_groups(dense, "tp-cp-dp-pp", "cp"),
        "data": megatron_groups(dense, "tp-cp-dp-pp", "dp"),
        "data_context": megatron_groups(dense, "tp-cp-dp-pp", "dp-cp"),
        "tensor_context": megatron_groups(dense, "tp-cp-dp-pp", "tp-cp"),
        "pipeline": megatron_groups(dense, "tp-cp-dp-pp", "pp"),
        "model_parallel": megatron_groups(dense, "tp-cp-dp-pp", "tp-pp"),
        "expert_tensor": megatron_groups(expert, "tp-ep-dp-pp", "tp"),
        "expert": megatron_groups(expert, "tp-ep-dp-pp", "ep"),
        "expert_data": megatron_groups(expert, "tp-ep-dp-pp", "dp"),
        "expert_dispatch": megatron_groups(expert, "tp-ep-dp-pp", "tp-ep"),
    }
    assert set(expected) == set(GROUP_KINDS + EXPERT_GROUP_KINDS + CONTEXT_GROUP_KINDS) - {"embedding"}
    for kind, groups in expected.items():
        assert grid.groups_of(kind) == groups, kind
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(grid.world_size)), kind
    # Megatron-Core's pipeline groups are the same for the experts: no expert group leaves a stage.
    assert megatron_groups(expert, "tp-ep-dp-pp", "pp") == expected["pipeline"]
    assert grid.embedding_groups() == [sorted({g[0], g[-1]}) for g in expected["pipeline"]]
    for rank in range(grid.world_size):
        x = grid.coord(rank)
        assert rank == x.tp + grid.tp * (x.cp + grid.cp * (x.dp + grid.dp * x.pp))
        assert grid.rank(x.tp, x.dp, x.pp, x.cp) == rank
        # Member i of the gradients' group is (cp, dp) = (i mod c, i div c).
        assert grid.group_containing("data_context", rank).index(rank) == x.cp + grid.cp * x.dp
        e = grid.expert_coord(rank)
        assert grid.expert_rank(e.etp, e.ep, e.edp, e.pp) == rank and e.pp == x.pp


@pytest.mark.parametrize("grid", LAYOUTS, ids=lambda g: f"t{g.tp}d{g.dp}p{g.pp}")
def test_one_context_rank_is_the_grid_without_context(grid):
    """c = 1: Megatron-Core's tp-dp-pp grid; the context groups are single
    ranks and the gradients' group is the data-parallel one."""
    sizes = {"tp": grid.tp, "dp": grid.dp, "pp": grid.pp}
    for kind, token in (("tensor", "tp"), ("data", "dp"), ("pipeline", "pp"),
                        ("model_parallel", "tp-pp")):
        assert grid.groups_of(kind) == megatron_groups(sizes, "tp-dp-pp", token), kind
    assert grid.context_groups() == [[r] for r in range(grid.world_size)]
    assert grid.data_context_groups() == grid.data_groups()
    assert grid.tensor_context_groups() == grid.tensor_groups()
    assert grid == RankGrid(grid.tp, grid.dp, grid.pp, cp=1)
    assert group_table(grid) == group_table(RankGrid(grid.tp, grid.dp, grid.pp, cp=1))
    assert "context" not in group_table(grid)


def test_context_example():
    # 16 ranks, t = 2, c = 2, d = 2, p = 2.
    grid = RankGrid(tp=2, dp=2, pp=2, cp=2)
    assert grid.tensor_groups()[:3] == [[0, 1], [2, 3], [4, 5]]
    assert grid.context_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
    assert grid.data_groups()[:3] == [[0, 4], [1, 5], [2, 6]]
    assert grid.data_context_groups()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.tensor_context_groups()[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.pipeline_groups()[:2] == [[0, 8], [1, 9]]
    assert grid.model_parallel_groups()[:2] == [[0, 1, 8, 9], [2, 3, 10, 11]]
    assert "| context | [0,2] [1,3] [4,6]" in group_table(grid)
    # EP 4 with ETP 1 folds the t·c·d = 8 ranks of a stage: EDP 2 spans data and context ranks.
    grid = RankGrid(tp=2, dp=1, pp=1, cp=2, ep=4, etp=1)
    assert grid.expert_groups() == [[0, 1, 2, 3]]
    grid = RankGrid(tp=2, dp=2, pp=1, cp=2, ep=2, etp=2)
    assert grid.expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.expert_data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"EP 8 × ETP 1 does not divide the 4 ranks \(t·c·d\)"):
        RankGrid(tp=1, dp=2, pp=1, cp=2, ep=8, etp=1)
    with pytest.raises(ValueError, match="a grid with 2 context ranks needs the context coordinate"):
        RankGrid(tp=1, dp=1, pp=2, cp=2).rank(0, 0, 1)


def test_coordinates_outside_the_grid_are_rejected():
    with pytest.raises(ValueError, match="rank 8 outside a world of 8"):
        RankGrid(2, 2, 2).coord(8)


def _probe_groups(rank, t, d, p, c=1):
    """Sum each rank's id over each of its groups; return what it saw."""
    ctx = ParallelContext.build(RankGrid(tp=t, dp=d, pp=p, cp=c))
    seen = {}
    for kind in GROUP_KINDS + CONTEXT_GROUP_KINDS:
        if kind not in ctx.groups:  # middle pipeline stages hold no embedding copy
            continue
        group = ctx.groups[kind]
        value = torch.tensor([float(1 << rank)])
        if group is not None:
            dist.all_reduce(value, group=group)
        seen[kind] = int(value.item())
    c = ctx.coord
    # The gradients' replicas: the data group at c = 1 (the same process group).
    same = ctx.grad_reduce_group is ctx.dp_group
    sizes = (ctx.cp_size, ctx.cp_rank, ctx.grad_reduce_size, ctx.grad_reduce_rank, same)
    return (seen, (c.tp, c.dp, c.pp, c.cp), ctx.prev_rank, ctx.next_rank, ctx.is_first_stage,
            ctx.is_last_stage, sizes)


@pytest.mark.parametrize("t,d,p,c", [(2, 2, 2, 1), (4, 1, 2, 1), (1, 2, 4, 1), (2, 4, 1, 1),
                                     (8, 1, 1, 1), (1, 1, 8, 1), (2, 2, 1, 2), (1, 2, 2, 2)])
def test_process_groups_connect_the_grid_ranks(pools, t, d, p, c):
    grid = RankGrid(t, d, p, cp=c)
    results = pools(8).run(_probe_groups, t, d, p, c)
    for rank, (seen, coord, prev_rank, next_rank, first, last, sizes) in enumerate(results):
        x = grid.coord(rank)
        assert coord == (x.tp, x.dp, x.pp, x.cp)
        members = grid.group_containing("data_context", rank)
        assert sizes == (c, x.cp, d * c, members.index(rank), c == 1)
        for kind in GROUP_KINDS + CONTEXT_GROUP_KINDS:
            if kind == "embedding" and 0 < x.pp < p - 1:
                assert kind not in seen
                continue
            members = grid.group_containing(kind, rank)
            assert seen[kind] == sum(1 << m for m in members), (kind, rank)
        assert first == (x.pp == 0) and last == (x.pp == p - 1)
        assert prev_rank == (None if x.pp == 0 else grid.rank(x.tp, x.dp, x.pp - 1, x.cp))
        assert next_rank == (None if x.pp == p - 1 else grid.rank(x.tp, x.dp, x.pp + 1, x.cp))


def test_single_context_has_no_groups():
    ctx = ParallelContext.single()
    assert ctx.tp_size == ctx.dp_size == ctx.pp_size == ctx.cp_size == ctx.grad_reduce_size == 1
    assert ctx.cp_rank == ctx.grad_reduce_rank == 0
    assert all(ctx.groups[k] is None for k in GROUP_KINDS + CONTEXT_GROUP_KINDS)
    assert ctx.cp_group is ctx.grad_reduce_group is ctx.tp_cp_group is None
    assert ctx.is_first_stage and ctx.is_last_stage and ctx.next_rank is None
