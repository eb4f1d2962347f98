"""`ptdp plan`'s layout flags: each fixes its dimension and the search covers
the others; `--fix-all` (or flags that leave one layout) prices one layout;
fixed values no layout has are refused with `ptdp train`'s own message; the
winner's printed flags price the same layout again. (The README example's
search time is reported by bench/published_runs.py, never asserted here.)"""

import json
import shlex

import pytest

from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_settings, settings_from_args
from ptdp.config import ModelConfig, ParallelConfig, validate
from ptdp.config.base import divisors
from ptdp.config.moe import expert_parallel_problems
from ptdp.perf.plan.candidates import candidate_layouts
from ptdp.perf.plan.fixed_dimensions import fixed_dimensions
from ptdp.perf.layout import Layout, Workload
from ptdp.commands.plan import model_from_args
from ptdp.perf.plan.planner import evaluate_layout
from ptdp.perf.price.profiles import load_profile

# A long-sequence model without attention dropout, so that c is searched too.
MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "4096", "--attention-dropout", "0", "--vocab-size", "51200"]
PLAN = ["plan", *MODEL, "--gpus", "16", "--gpu", "a100", "--global-batch-size", "32"]


def _plan(gpus: int = 16) -> list[str]:
    return ["plan", *MODEL, "--gpus", str(gpus), "--gpu", "a100", "--global-batch-size", "32"]


def _candidates(*flags: str) -> list[Layout]:
    """The layouts `ptdp plan PLAN flags` would search (no pricing)."""
    args = build_parser().parse_args([*PLAN, *flags])
    model = model_from_args(args)
    fixed = fixed_dimensions(args, model, args.gpus)
    return list(candidate_layouts(Workload(model, 32), 16, **fixed.restrictions))


def _plan_json(capsys, *flags: str) -> dict:
    assert main([*PLAN, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_fixing_t_and_p_searches_every_other_dimension(capsys):
    data = _plan_json(capsys, "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2", "--top", "30")
    layouts = [r["layout"] for r in data["results"]]
    assert len(layouts) == 30
    assert all((layout["t"], layout["p"]) == (2, 2) for layout in layouts)
    # What the search considers (not what ranks first: that follows the prices).
    searched = _candidates("--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2")
    assert all((layout.t, layout.p) == (2, 2) for layout in searched)
    for key in ("b", "v", "recompute", "schedule", "sequence_parallel", "c",
                "sharding"):
        assert len({repr(getattr(layout, key)) for layout in searched}) > 1, key
    assert len({json.dumps(layout["b"]) for layout in layouts}) > 1
    assert data["fixed"] == {"t": "t=2", "p": "p=2"}
    assert data["dimensions"] == (
        "dimensions: fixed t=2, p=2; searched c, d, b, v, schedule, split, recompute, "
        "sequence-parallel, sharding")


# Each flag, what it fixes in every candidate, a dimension it leaves to the
# search, and whether the candidates are then exactly the unfixed search's
# that have that value (not where the value is one the search never tries:
# gpipe, a2a, zb-h1 at p = 1, a split it would not try, whole-tensor sends).
SINGLE_FLAGS = [
    (["-t", "4"], lambda l: l.t == 4, lambda l: l.p, True),
    (["-p", "4"], lambda l: l.p == 4, lambda l: l.t, True),
    (["--data-parallel-size", "4"], lambda l: l.d == 4, lambda l: (l.t, l.c, l.p), True),
    (["--context-parallel-size", "2"], lambda l: l.c == 2, lambda l: l.t, True),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
     lambda l: (l.c, l.cp_comm) == (2, "a2a"), lambda l: l.b, False),
    (["--micro-batch-size", "2"], lambda l: l.b == 2, lambda l: l.recompute, True),
    (["--num-layers-per-virtual-pipeline-stage", "2"],
     lambda l: l.v * l.p * 2 == 8 and l.p > 1 and l.schedule in ("1f1b", "zbv")
     and l.split.even, lambda l: l.p, True),
    (["--pipeline-schedule", "zb-h1"], lambda l: l.schedule == "zb-h1", lambda l: l.p, False),
    (["--pipeline-schedule", "gpipe"], lambda l: l.schedule == "gpipe" and l.v == 1,
     lambda l: l.b, False),
    (["--recompute-granularity", "selective"], lambda l: l.recompute == "selective",
     lambda l: l.t, True),
    (["--sequence-parallel"], lambda l: l.sequence_parallel and l.t > 1, lambda l: l.t, True),
    # (at d·c = 1, where the search has nothing to shard, the flag keeps it on: train accepts it)
    (["--use-distributed-optimizer"], lambda l: l.distributed_optimizer, lambda l: l.b, False),
    (["--decoder-first-pipeline-num-layers", "1"],
     lambda l: (l.split.first, l.split.last) == (1, None) and l.p > 1, lambda l: l.p, False),
    (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
     lambda l: l.split.loss and l.split.embedding, lambda l: l.p, False),
    (["--no-scatter-gather-tensors-in-pipeline"], lambda l: not l.scatter_gather,
     lambda l: l.t, False),
]


@pytest.mark.parametrize("flags, holds, searched, same_as_search", SINGLE_FLAGS,
                         ids=[" ".join(flags) for flags, *_ in SINGLE_FLAGS])
def test_each_flag_fixes_its_dimension_and_leaves_the_others_searched(
        flags, holds, searched, same_as_search):
    layouts = _candidates(*flags)
    assert layouts and all(holds(layout) for layout in layouts)
    assert len({searched(layout) for layout in layouts}) > 1
    if same_as_search:
        assert set(layouts) == {layout for layout in _candidates() if holds(layout)}


def test_without_flags_the_search_covers_what_it_did():
    """No flag: gpipe and scatter/gather off stay out (never better), every
    other dimension is searched."""
    layouts = _candidates()
    assert {layout.schedule for layout in layouts} == {"1f1b", "zb-h1", "zbv"}
    assert {layout.c for layout in layouts} == {1, 2, 4}
    assert all(layout.scatter_gather and (layout.ep, layout.etp) == (1, None)
               for layout in layouts)


def test_fix_all_prices_exactly_the_given_layout_with_the_rest_at_train_defaults(capsys):
    flags = ["-t", "2", "-p", "2", "--micro-batch-size", "2"]
    data = _plan_json(capsys, *flags, "--fix-all")
    (result,) = data["results"]
    model = model_from_args(build_parser().parse_args(PLAN))
    layout = Layout(t=2, p=2, d=4, b=2)   # v = 1, 1f1b, even, no recomputation, c = 1, ...
    assert result == evaluate_layout(Workload(model, 32), layout, load_profile("a100")).summary()
    assert data["dimensions"] == ("dimensions: fixed t=2, p=2, b=2; the others at ptdp train's "
                                  "defaults (--fix-all); searched none")
    assert main([*PLAN, *flags, "--fix-all"]) == 0
    out = capsys.readouterr().out
    assert "\nt=2 p=2 d=4 b=2: " in out and "  tensor all-reduce" in out and "best:" not in out


def test_flags_that_leave_one_layout_price_it_as_fix_all_does(capsys):
    """Every dimension given: no search, the same output as --fix-all but for
    the dimensions line."""
    flags = ["-t", "2", "-p", "1", "--micro-batch-size", "2", "--context-parallel-size", "1",
             "--recompute-granularity", "full", "--sequence-parallel",
             "--use-distributed-optimizer", "--pipeline-schedule", "1f1b"]
    assert len(_candidates(*flags)) == 1
    assert main([*PLAN, *flags]) == 0
    alone = capsys.readouterr()
    assert main([*PLAN, *flags, "--fix-all"]) == 0
    fixed = capsys.readouterr().out
    assert "ptdp plan: searching" not in alone.err
    lines = [line for line in alone.out.splitlines() if not line.startswith("dimensions:")]
    assert lines == [line for line in fixed.splitlines() if not line.startswith("dimensions:")]
    assert "; the only valid layout; searched none" in alone.out


@pytest.mark.parametrize("gpus, flags, message", [
    # train's own messages (ptdp.config.checks), before any layout is priced
    (12, ["-t", "3"], "--num-attention-heads 16 is not divisible by "
                      "--tensor-model-parallel-size 3"),
    (16, ["-p", "16"], "--num-layers 8 is not divisible by --pipeline-model-parallel-size 16"),
    (16, ["--micro-batch-size", "64"], "--global-batch-size 32 is not divisible by "
                                       "--micro-batch-size 64"),
    (16, ["--expert-model-parallel-size", "2"], "expert parallelism is for MoE models"),
    (16, ["-t", "5"], "--gpus 16 is not a multiple of t·p = 5"),
])
def test_invalid_fixed_values_are_refused_with_trains_message_before_the_search(
        capsys, gpus, flags, message):
    assert main([*_plan(gpus), *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert "searching" not in captured.err


def test_the_printed_flags_are_trains_and_price_the_same_layout_again(capsys):
    """The winner's `ptdp train` command parses with train's parser and
    passes its checks, and planned again with --fix-all it prices the same
    layout to the same time."""
    flags = ["-t", "2", "-p", "2", "--recompute-granularity", "full"]
    assert main([*PLAN, *flags, "--json", "--print-flags"]) == 0
    out = capsys.readouterr().out
    winner = json.loads(out[:out.rindex("}") + 1])["results"][0]
    command = shlex.split(out.strip().splitlines()[-1])
    assert command[:2] == ["ptdp", "train"]
    config = config_from_settings(settings_from_args(build_parser().parse_args(command[1:])))
    validate(config, world_size=16)
    assert config.model.recompute_granularity == "full"
    assert main(["plan", *command[2:], "--gpus", "16", "--gpu", "a100", "--fix-all",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"] == [winner]


MOE = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                  vocab_size=1024, disable_bias_linear=True, num_experts=8, moe_router_topk=2)


def test_expert_layouts_are_enumerated_only_where_train_allows_them():
    """EP and ETP fold over each stage's t·c·d ranks: every candidate passes
    `ptdp train`'s expert checks, and every (EP, ETP) train allows with ETP
    dividing t (the search's range; None is train's default, t) is there."""
    workload = Workload(MOE, 16)
    layouts = list(candidate_layouts(workload, 8, recompute=(None,),
                                     distributed_optimizer=(False,), layer_splits=False))
    seen = {(l.t, l.p, l.d, l.sequence_parallel, l.ep, l.etp) for l in layouts}
    assert {ep for *_, ep, _ in seen} == {1, 2, 4, 8}
    assert any(t > 1 and etp == 1 for t, *_, etp in seen)   # ETP below t is searched too
    for layout in layouts:
        par = layout._parallel_config()
        assert expert_parallel_problems(MOE, par, 8) == [], layout
        assert MOE.num_experts % layout.ep == 0
        assert (layout.t * layout.d) % (layout.ep * layout.expert_tensor) == 0
    for t, p, d, split in {(l.t, l.p, l.d, l.sequence_parallel) for l in layouts}:
        for ep in divisors(8):
            for etp in [None] + [x for x in divisors(t) if x != t]:
                par = ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                     data_parallel_size=d, sequence_parallel=split,
                                     expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)
                allowed = not expert_parallel_problems(MOE, par, 8)
                assert ((t, p, d, split, ep, etp) in seen) == allowed, (t, p, d, split, ep, etp)
    # A dense model has no expert layouts to search.
    dense = list(candidate_layouts(Workload(ModelConfig(num_layers=4, hidden_size=256,
                                                        num_attention_heads=8, seq_length=256,
                                                        vocab_size=1024), 16), 8))
    assert all((l.ep, l.etp) == (1, None) for l in dense)


def test_an_moe_plan_searches_ep_and_fixing_ep_keeps_it(capsys):
    moe = ["plan", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
           "--seq-length", "256", "--vocab-size", "1024", "--disable-bias-linear",
           "--num-experts", "8", "--gpus", "8", "--gpu", "h100", "--global-batch-size", "16",
           "--json", "--top", "30"]
    assert main(moe) == 0
    data = json.loads(capsys.readouterr().out)
    assert len({r["layout"]["ep"] for r in data["results"]}) > 1
    assert "ep, etp" in data["dimensions"]
    assert main(moe + ["--expert-model-parallel-size", "4", "--print-flags"]) == 0
    out = capsys.readouterr().out
    results = json.loads(out[:out.rindex("}") + 1])["results"]
    assert {r["layout"]["ep"] for r in results} == {4}
    assert "--expert-model-parallel-size 4" in out.splitlines()[-1]


def _played_by_the_player(key, compute, exchange):
    """predict's shortcut replaced by the one player (ptdp.schedules.player)."""
    from ptdp.perf.simulate import predict
    from ptdp.schedules.player import play

    schedule = predict._schedule(*key)
    return predict._played_from_records(play(schedule, compute, exchange),
                                        schedule.splits_backward)


def test_the_unshared_play_is_the_players_and_the_shared_plays_price_as_pricing_each(monkeypatch):
    """Without processor sharing (GPU profiles) predict plays a schedule as a
    dataflow in flat lists and shares a play among the layouts with the same
    prices (the sharding strategies); its records, every prediction and the
    search's first rows are those of the one player pricing every layout
    alone (an 18B-wide model on 8 A100s, one server: every link inside it, each kind of
    schedule, uneven splits, ZeRO-3's first-forward gathers, each reshard policy)."""
    from ptdp.perf.plan.planner import EXACT_ROWS, search
    from ptdp.perf.simulate import predict

    model = ModelConfig(num_layers=8, hidden_size=6144, num_attention_heads=48,
                        seq_length=2048, vocab_size=51200)
    workload, a100 = Workload(model, 16), load_profile("a100")
    predict._PLAYS.clear()
    shared = {e.layout: e.prediction for e in search(workload, 8, a100, exhaustive=True)}
    assert len(predict._PLAYS) < len(shared)   # some layouts shared a play
    pruned = search(workload, 8, a100)
    monkeypatch.setattr(predict, "_play_unshared", _played_by_the_player)
    everything = search(workload, 8, a100, exhaustive=True)
    layouts = [e.layout for e in everything]
    assert {"1f1b", "interleaved", "zb-h1", "zbv"} <= {layout.schedule_kind for layout in layouts}
    assert any(not layout.split.even for layout in layouts)
    assert {(layout.sharding, layout.reshard_after_forward) for layout in layouts} >= {
        ("optim_grads_params", True), ("optim_grads_params", False), ("no_shard", True)}
    assert [(e.layout, e.seconds) for e in pruned[:EXACT_ROWS]] == \
        [(e.layout, e.seconds) for e in everything[:EXACT_ROWS]]
    assert set(shared) == set(layouts)
    for e in everything:
        mine = shared[e.layout]
        assert (mine.iteration_seconds, mine.bubble_fraction, mine.critical_rank,
                mine.categories_by_rank, mine.timelines) == (
            e.prediction.iteration_seconds, e.prediction.bubble_fraction,
            e.prediction.critical_rank, e.prediction.categories_by_rank,
            e.prediction.timelines), e.layout


@pytest.mark.parametrize("t,c,d,p", [(1, 1, 8, 2), (2, 1, 16, 3), (8, 1, 6, 4), (4, 2, 3, 2),
                                     (1, 4, 5, 1), (8, 2, 12, 2)])
def test_data_parallel_rings_from_cached_server_groups_equal_the_direct_ones(t, c, d, p):
    """Machine.data_parallel reads its replicas' servers from a cache by
    (t, c, d, pp, devices per server): the same seconds as grouping the
    replicas Machine.rank places, server by server, for every stage."""
    from ptdp.perf.price.machine import Machine

    profile = load_profile("a100")
    machine = Machine(Layout(t=t, c=c, d=d, p=p), profile)
    for pp in range(p):
        group = [machine.rank(0, dp, pp, cp) for dp in range(d) for cp in range(c)]
        servers = {}
        for r in group:
            servers.setdefault(machine.server(r), []).append(r)
        if len(servers) == 1:
            direct = machine.allreduce(1e8, group)
        else:
            local = max(servers.values(), key=len)
            direct = (2 * machine.gather(1e8, local)
                      + machine.allreduce(1e8 / len(local), [m[0] for m in servers.values()]))
        assert machine.data_parallel(1e8, pp) == direct
        assert machine.data_parallel(1e8, pp, reduce_scatter_only=True) == direct / 2


def test_memory_shares_states_only_among_layouts_that_differ_in_b_or_recomputation():
    """memory_per_rank keeps each layout's weights, gradients and optimizer
    state for the layouts that differ from it only in b or recomputation:
    every rank's figures equal state_bytes computed for that layout alone,
    across sharding strategies (ZeRO-3's units included), d, and both."""
    from ptdp.config import TrainConfig
    from ptdp.perf.analytic import memory
    from ptdp.perf.analytic.counts import cut_placed_buckets, placement_of_parameters
    from ptdp.perf.analytic.sharding import state_bytes, unit_buckets
    from ptdp.perf.layout import ByValue

    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16,
                        seq_length=1024, vocab_size=32000)
    workload, size = Workload(model, 64), TrainConfig().ddp_bucket_size
    memory._STATES.clear()
    for sharding in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        for d in (2, 4):
            for b, recompute in ((1, None), (2, "full"), (4, "selective")):
                layout = Layout(t=2, p=2, d=d, b=b, recompute=recompute, sharding=sharding)
                for rank, figures in enumerate(memory.memory_per_rank(workload, layout)):
                    buckets = (unit_buckets(model, layout, rank, size) if layout.shards_parameters
                               else cut_placed_buckets(ByValue(model),
                                                       placement_of_parameters(layout), rank,
                                                       size))
                    alone = state_bytes(model, layout, rank, buckets, workload.bytes_per_element,
                                        workload.precision, 0, size, workload.main_grads_bytes)
                    assert {k: figures[k] for k in alone} == alone, (layout, rank)
    assert len(memory._STATES) == 8   # one per (sharding, d)


def _buckets_done_by_the_loop(backwards, row_end, after, rank):
    """predict._buckets_done as it read every field per backward (round 2):
    the reference for its per-chunk precomputation."""
    total = after.bucketed[rank]
    if total <= 0:
        return 0.0
    last = {backward[0]: backward for backward in backwards}
    if not after.overlapped:
        rounds = len(backwards) / max(1, len(last)) if after.per_microbatch else 1
        return row_end + total * rounds
    released = (backwards if after.per_microbatch else
                sorted(last.values(), key=lambda backward: backward[2]))
    free = 0.0
    for chunk, start, end in sorted(released, key=lambda backward: backward[2]):
        work = total * after.chunk_shares[rank][chunk]
        if work <= 0:
            continue
        free = max(max(free, start) + work, end + min(work, after.last_bucket[rank]))
    return free


def test_buckets_done_equals_the_per_backward_loop_bit_for_bit():
    """_buckets_done reads each chunk's work and last bucket once: the same
    floats as reading them for every backward, in every mode (overlapped or
    not, per microbatch or per chunk's last backward, a chunk without
    parameters, ties in the ends, a rank with nothing bucketed)."""
    import random
    from types import SimpleNamespace

    from ptdp.perf.simulate.predict import _buckets_done, _Played

    rng = random.Random(45)
    checked = 0
    for _ in range(300):
        v, m = rng.choice([1, 2, 3]), rng.randint(1, 24)
        clock, backwards = rng.random(), []
        for i in range(m * v):
            start = clock + rng.choice([0.0, rng.random()])
            clock = start + rng.choice([0.0, rng.random() * 0.1])
            backwards.append((rng.randrange(v), start, clock))
        shares = tuple(rng.choice([0.0, rng.random()]) for _ in range(v))
        after = SimpleNamespace(bucketed=[rng.choice([0.0, rng.random() * 0.5])],
                                chunk_shares=[shares], last_bucket=[rng.random() * 0.05],
                                overlapped=rng.random() < 0.8, per_microbatch=rng.random() < 0.5)
        played = _Played([clock], [0.0], [0.0], [backwards], lambda: [])
        mine = _buckets_done(played, 0, clock, after)
        reference = _buckets_done_by_the_loop(backwards, clock, after, 0)
        assert mine == reference and type(mine) is type(reference), (backwards, after)
        checked += mine > clock
    assert checked > 50   # most cases release buckets past the rank's last backward


@pytest.mark.parametrize("switches", [0, 2, 16])
def test_the_links_free_time_is_the_loops_bit_for_bit(switches):
    """predict._link_free (the per-microbatch buckets' link, vectorised by
    its idle and busy stretches) gives the loop's float exactly, whether
    the link idles between backwards, stays busy, or switches often
    (and past `switches` changes, where the loop finishes the work)."""
    import random

    import numpy as np

    from ptdp.perf.simulate.predict import _link_free

    rng = random.Random(switches)
    for case in range(200):
        n = rng.randint(1, 60)
        busy = rng.random()   # how often the link is still busy when a backward ends
        clock, starts, ends, works, tails = rng.random(), [], [], [], []
        for _ in range(n):
            start = clock + rng.choice([0.0, rng.random() * 0.1])
            clock = start + rng.random() * 0.1
            work = rng.random() * (0.3 if rng.random() < busy else 0.01)
            starts.append(start), ends.append(clock), works.append(work)
            tails.append(min(work, rng.random() * 0.05))
        free = 0.0
        for start, end, work, tail in zip(starts, ends, works, tails):
            free = max(max(free, start) + work, end + tail)
        mine = _link_free(*(np.asarray(values) for values in (starts, ends, works, tails)),
                          switches=switches)
        assert mine == free and type(mine) is float, case


def _rank_boxes_by_lookups(row, r, chunks, priced, exposed, pipeline_end, embedding_start,
                           embedding, gathered):
    """predict._rank_boxes as it looked every compute's prices up (round 2):
    the reference for its per-kind table."""
    from ptdp.perf.simulate.predict import CATEGORIES, GATHER_CATEGORY, Box, Compute

    boxes, categories = [], {name: 0.0 for name in CATEGORIES + (GATHER_CATEGORY,)}
    for rec in row:
        action = rec.action
        if isinstance(action, Compute):
            boxes.append(Box(action.op, action.microbatch, action.chunk,
                             float(rec.start), float(rec.end)))
            cost = chunks[(r, action.chunk)].of(action.op)
            stretched = float(rec.work_end - rec.start)
            total = priced[(r, action.chunk, action.op)][0] or 1.0
            for category, seconds in cost.work.items():
                categories[category] = (categories.get(category, 0.0)
                                        + stretched * seconds / total)
            gather = min(float(rec.end - rec.work_end), gathered(r, action))
            categories[GATHER_CATEGORY] += gather
            categories["tensor all-reduce"] += float(rec.end - rec.work_end) - gather
        else:
            if rec.ready > rec.start:
                boxes.append(Box("wait", -1, -1, float(rec.start), float(rec.ready)))
            if rec.end > rec.ready:
                boxes.append(Box("comm", -1, -1, float(rec.ready), float(rec.end)))
            categories["bubble/idle"] += float(rec.ready - rec.start)
            categories["pipeline transfer"] += float(rec.end - rec.ready)
    if exposed > 0:
        boxes.append(Box("comm", -1, -1, float(pipeline_end), float(pipeline_end) + exposed))
    if embedding:
        boxes.append(Box("comm", -1, -1, float(embedding_start),
                         float(embedding_start) + embedding))
    return boxes, categories


def test_breakdowns_from_the_per_kind_table_equal_looking_up_every_compute(monkeypatch):
    """The breakdowns and timelines of printed rows read each (chunk, op,
    first forward)'s prices once: the same floats as looking them up for
    every compute (each kind of schedule, context parallelism's exchange
    category, ZeRO-3's gathers)."""
    from ptdp.perf.simulate import predict

    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16,
                        seq_length=4096, vocab_size=51200, attention_dropout=0.0)
    workload, a100 = Workload(model, 16), load_profile("a100")
    kinds = {}   # one layout of each schedule, with and without c > 1 and ZeRO-3
    for layout in candidate_layouts(workload, 8):
        if layout.p > 1:
            kinds.setdefault((layout.schedule_kind, layout.c > 1, layout.shards_parameters,
                              layout.reshard_after_forward), layout)
    layouts = list(kinds.values())
    assert {"1f1b", "interleaved", "zb-h1", "zbv"} <= {layout.schedule_kind for layout in layouts}
    assert any(layout.c > 1 for layout in layouts) and any(layout.shards_parameters
                                                           for layout in layouts)
    mine = [(p.categories_by_rank, p.timelines)
            for p in [predict.simulate(workload, layout, a100) for layout in layouts]]
    monkeypatch.setattr(predict, "_rank_boxes", _rank_boxes_by_lookups)
    again = [predict.simulate(workload, layout, a100) for layout in layouts]
    assert mine == [(p.categories_by_rank, p.timelines) for p in again]


def test_spans_servers_from_the_lowest_and_highest_rank_equals_counting_servers():
    """Machine.spans_servers reads the lowest and the highest rank's server
    alone: the same answer as counting the servers of every rank, for any
    group (unsorted, repeated, empty) and server size."""
    import random

    from ptdp.perf.price.machine import Machine

    rng = random.Random(45)
    answers = set()
    for per_server in (1, 2, 4, 8):
        machine = Machine(Layout(), load_profile("a100"))
        machine.per_server = per_server
        for _ in range(200):
            ranks = [rng.randrange(64) for _ in range(rng.randint(0, 6))]
            counted = len({r // per_server for r in ranks}) > 1
            assert machine.spans_servers(ranks) == counted, (ranks, per_server)
            answers.add(counted)
    assert answers == {True, False}


def test_the_lazy_bounds_hand_layouts_out_as_sorting_the_whole_bounds_does():
    """planner._Bounds gives every layout its bound without reductions and
    prices a layout's reductions only when its turn may have come: the
    order is that of sorting every whole bound (ties in the given order),
    for the candidates and for a subset of them (the rivals' searches),
    and a search that stops early prices few whole bounds."""
    import itertools

    from ptdp.perf.layout import ByValue
    from ptdp.perf.plan import planner
    from ptdp.perf.simulate.bounds import compute_lower_bound

    args = build_parser().parse_args(PLAN)
    workload, a100 = Workload(model_from_args(args), 32), load_profile("a100")
    layouts = _candidates()
    whole = {layout: compute_lower_bound(workload, layout, a100) for layout in layouts}
    assert len(set(whole.values())) < len(layouts)   # (ties to break)
    bounds = planner._Bounds(workload, a100, ByValue(workload))
    for layout in layouts:
        bounds.add(layout)
        assert bounds.partial[layout] <= whole[layout]
    first = list(itertools.islice(bounds.in_order(layouts), 20))
    assert first == sorted(layouts, key=whole.__getitem__)[:20]
    assert len(bounds.whole) < len(layouts) / 2     # the rest were never priced whole
    subset = layouts[::3]
    assert list(bounds.in_order(subset)) == sorted(subset, key=whole.__getitem__)
    assert all(bounds.whole[layout] == whole[layout] for layout in subset)


def test_a_best_only_search_with_a_cutoff_finds_what_pricing_every_layout_finds(monkeypatch):
    """The note on context parallelism wants the fastest c > 1 layout only
    where it beats a cutoff: its search stops at the first bound the cutoff
    rejects, and finds the exhaustive search's best when that passes the
    cutoff, nothing when it does not, pricing nothing past the cutoff."""
    from ptdp.perf.plan import planner
    from ptdp.perf.simulate.bounds import compute_lower_bound

    args = build_parser().parse_args(PLAN)
    model = model_from_args(args)
    workload, a100 = Workload(model, 32), load_profile("a100")
    layouts = [layout for layout in _candidates() if layout.c > 1 and layout.p == 1
               and layout.sharding == "optim"]
    everything = planner.search(workload, 16, a100, exhaustive=True, candidates=layouts)
    best = everything[0].seconds
    priced = []
    evaluate = planner._evaluate_if_fits
    monkeypatch.setattr(planner, "_evaluate_if_fits",
                        lambda w, layout, p, *keys: priced.append(layout)
                        or evaluate(w, layout, p, *keys))
    for cutoff in (best * 1.02, best, best * 0.98):
        priced.clear()
        found = planner.search(workload, 16, a100, best_only=True, candidates=layouts,
                               beyond=lambda seconds: seconds >= cutoff)
        # (the caller drops what the cutoff rejects: the note does)
        assert [(e.layout, e.seconds) for e in found if e.seconds < cutoff] == \
            [(e.layout, e.seconds) for e in everything[:1] if e.seconds < cutoff]
        assert found == [] or found[0].layout == everything[0].layout
        assert all(compute_lower_bound(workload, layout, a100) < cutoff for layout in priced)
        if cutoff < best:   # (what passes a cutoff below the best is left unpriced)
            assert len(priced) < len(layouts)


@pytest.mark.parametrize("restrictions", [
    {}, {"layer_splits": False}, {"layers_per_chunk": 1}, {"chunk_counts": (2, 3)},
    {"schedules": ("zbv", "zb-h1"), "microbatch_sizes": (1, 3)}, "splits"])
def test_the_candidates_skip_only_what_every_layout_of_theirs_refuses(restrictions, monkeypatch):
    """The enumeration drops a (b, schedule, v) before making its layouts
    where its microbatch count or (with no other split tried) its even
    split breaks the schedule's rules (candidates._may_run): the layouts
    are those of checking every one, in the same order."""
    from ptdp.perf.layout import Layout
    from ptdp.perf.plan import candidates as module

    model = ModelConfig(num_layers=12, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=128)
    workload = Workload(model, 24)
    if restrictions == "splits":
        restrictions = {"splits": module.split_candidates(Layout(p=4, v=1, schedule="1f1b"),
                                                          model.num_layers)[:3]}
    may_run, dropped = module._may_run, []

    def counted(*args):
        runs = may_run(*args)
        dropped.append(not runs)
        return runs

    monkeypatch.setattr(module, "_may_run", counted)
    skipping = list(module.candidate_layouts(workload, 16, **restrictions))
    assert any(dropped)   # (the case has pairs to skip)
    monkeypatch.setattr(module, "_may_run", lambda *args: True)
    every = list(module.candidate_layouts(workload, 16, **restrictions))
    assert skipping == every and len(every) > 10


def test_memory_fits_is_memory_per_device_under_the_limit_and_none_over_it():
    """The search checks memory rank by rank and stops at the first rank
    over the limit: what it keeps is memory_per_device's, and it rejects
    exactly the layouts whose largest rank is over the limit."""
    from ptdp.perf.analytic.memory import memory_fits, memory_per_device

    args = build_parser().parse_args(PLAN)
    workload = Workload(model_from_args(args), 32)
    layouts = [layout for layout in _candidates() if layout.p > 1][::7]
    whole = [memory_per_device(workload, layout) for layout in layouts]
    limit = sorted(memory["total"] for memory in whole)[len(whole) // 2]
    kept = [memory_fits(workload, layout, limit) for layout in layouts]
    assert kept == [memory if memory["total"] <= limit else None for memory in whole]
    assert 0 < kept.count(None) < len(kept)


@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
                                        ("zb-h1", 4, 8, 1), ("zbv", 3, 6, 2), ("1f1b", 1, 3, 1)])
def test_the_level_by_level_play_is_the_loops_bit_for_bit(kind, p, m, v):
    """A schedule played again is played level by level in numpy
    (ptdp.perf.simulate.levels): every start and end equals the loop's,
    bit for bit, under prices that differ by rank, chunk, op and exchange."""
    import random

    from ptdp.perf.simulate import codes as play_codes, predict
    from ptdp.perf.simulate.levels import ends_table, unit_levels
    from ptdp.schedules.build import build_schedule

    rng = random.Random(f"{kind}{p}{m}{v}")
    codes = predict._codes((kind, p, m, v, None))
    for _ in range(3):
        computes = tuple(tuple((rng.uniform(0.1, 3.0), rng.choice([0.0, rng.uniform(0, 0.5)]))
                               for _ in row) for row in codes.compute_slots)
        exchanges = tuple(tuple(rng.uniform(0.0, 0.7) for _ in row)
                          for row in codes.exchange_slots)
        starts, ends, posted = play_codes.flat_times(codes, computes, exchanges)
        level_starts, level_ends = play_codes.level_times(codes, computes, exchanges)
        assert level_ends.tolist() == [end for row in ends for end in row]
        assert level_starts.tolist() == [start for row in starts for start in row]
        # (an exchange is posted when it starts)
        assert all(starts[r][i] == when for r, row in enumerate(posted)
                   for i, when in enumerate(row) if when is not None)
    # The levels found wave by wave are the ends of the loop's play at unit prices.
    fresh = play_codes.codes_of(build_schedule(kind, p, m, v))
    units = tuple(((1, 0),) * len(row) for row in codes.compute_slots)
    waits = tuple((1,) * len(row) for row in codes.exchange_slots)
    level = unit_levels([len(row) for row in fresh.slots], ends_table(fresh.ends))
    assert level.tolist() == [end for row in play_codes.flat_times(codes, units, waits)[1]
                              for end in row]


def test_levels_find_a_deadlock_at_the_loops_ranks():
    """A schedule whose exchanges wait on each other in a cycle gets no
    level for what follows them, and level_times names the ranks the loop
    names."""
    import dataclasses

    from ptdp.perf.simulate import codes as play_codes
    from ptdp.schedules.actions import Compute, ScheduleError
    from ptdp.schedules.build import build_schedule

    schedule = build_schedule("1f1b", 3, 6, 1)
    # rank 1 takes its first exchange last: ranks 0 to 2 wait on each other
    row = list(schedule.ranks[1])
    first = next(i for i, action in enumerate(row) if not isinstance(action, Compute))
    row.append(row.pop(first))
    schedule = dataclasses.replace(schedule, ranks=(schedule.ranks[0], tuple(row),
                                                    *schedule.ranks[2:]))
    with pytest.raises(ScheduleError) as loop:
        codes = play_codes.codes_of(schedule)
        prices = (tuple(tuple((1.0, 0.0) for _ in r) for r in codes.compute_slots),
                  tuple(tuple(0.5 for _ in r) for r in codes.exchange_slots))
        play_codes.flat_times(codes, *prices)
    with pytest.raises(ScheduleError) as levels:
        play_codes.level_times(play_codes.codes_of(schedule), *prices)
    assert str(levels.value) == str(loop.value) and "deadlocks at ranks" in str(loop.value)


CODES_FIELDS = ("p", "label", "splits_backward", "slots", "compute_slots", "exchange_slots",
                "ends", "computes", "of_op", "first_forwards", "released_chunks", "peers")


@pytest.mark.parametrize("kind,p,m,v", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 1, 3, 1), ("1f1b", 4, 3, 1),
    ("1f1b", 3, 7, 1), ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3),
    ("interleaved", 4, 4, 2), ("interleaved", 3, 9, 3), ("zb-h1", 4, 8, 1),
    ("zb-h1", 1, 3, 1), ("zbv", 3, 6, 2), ("zbv", 4, 9, 2), ("gpipe", 3, 5, 1),
    ("1f1b", 8, 20, 1), ("interleaved", 8, 16, 2), ("zb-h1", 8, 21, 1), ("zbv", 8, 24, 2)])
def test_codes_from_tables_are_the_built_schedules_codes(kind, p, m, v):
    """The planner's codes, made from arrays without the schedule's actions
    (schedule_tables.planned_codes), equal codes_of of the schedule
    build_schedule builds, field by field, and each rank's actions made on
    demand are the schedule's; zero-bubble kinds under unit costs and under
    costs that differ by rank, chunk and op (which move their exchanges)."""
    import random

    from ptdp.perf.simulate.codes import codes_of
    from ptdp.perf.simulate.levels import ends_table
    from ptdp.perf.simulate.schedule_tables import planned_codes
    from ptdp.schedules.build import build_schedule

    rng = random.Random(f"{kind}{p}{m}{v}")
    costs = [None]
    if kind.startswith("zb"):
        costs.append(tuple(((r, c, op), rng.uniform(0.5, 2.0)) for r in range(p)
                           for c in range(v) for op in "FBW"))
    for cost in costs:
        schedule = build_schedule(kind, p, m, v, cost)
        built, planned = codes_of(schedule), planned_codes(kind, p, m, v, cost)
        for name in CODES_FIELDS:
            assert getattr(planned, name) == getattr(built, name), name
        assert [tuple(planned.actions(r)) for r in range(p)] == list(schedule.ranks)
        # and the flat arrays the levels are found from, as made from the lists
        assert planned.flat_slot.tolist() == [slot for row in built.slots for slot in row]
        for planned_column, built_column in zip(planned.flat_ends, ends_table(built.ends)):
            assert planned_column.tolist() == built_column.tolist()
        assert any(planned.ends[r][i] for r in range(p) for i in range(len(planned.slots[r]))
                   ) == (p > 1)


@pytest.mark.parametrize("kind,p,m", [("zb-h1", 4, 8), ("zbv", 3, 6)])
def test_zero_bubble_costs_that_place_alike_share_one_schedule_and_only_they(kind, p, m):
    """build_zero_bubble gives the schedule of earlier costs again when its
    exchanges land in the same places: the shared schedule's actions are
    those a fresh placement makes for the new costs, and costs that place
    differently get their own schedule."""
    import random

    from ptdp.schedules import zero_bubble as zb

    rng = random.Random(kind)
    v = zb.chunks_of(kind)
    tables = [{(r, c, op): rng.uniform(0.5, 2.0) for r in range(p) for c in range(v)
               for op in "FBW"} for _ in range(3)]
    built = []
    for table in tables:
        for scale in (1.0, 2.0, 0.25):   # (times scaled by a power of two place alike)
            cost = zb.costs_from_table({key: seconds * scale for key, seconds in table.items()})
            schedule = zb.build_zero_bubble(kind, p, m, cost)
            fresh = zb._with_timed_exchanges(kind, p, v, zb.plan_timed(kind, p, m, cost=cost))
            assert schedule.ranks == fresh
            built.append(schedule)
    assert [len({id(s) for s in built[i:i + 3]}) for i in (0, 3, 6)] == [1, 1, 1]
    distinct = {id(schedule): schedule.ranks for schedule in built}
    assert len({ranks for ranks in distinct.values()}) == len(distinct)


def test_the_busiest_ranks_categories_alone_are_those_of_every_ranks_walk():
    """A plan's rows need the busiest rank's categories only: walked alone
    (Prediction.rank_details), they are what walking every rank gives."""
    from ptdp.perf.simulate.predict import simulate

    args = build_parser().parse_args(PLAN)
    workload, a100 = Workload(model_from_args(args), 32), load_profile("a100")
    layouts = [layout for layout in _candidates() if layout.p > 1][::40]
    assert {layout.schedule_kind for layout in layouts} >= {"1f1b", "interleaved"}
    for layout in layouts:
        alone = simulate(workload, layout, a100).seconds_by_category
        every = simulate(workload, layout, a100)
        assert alone == every.categories_by_rank[every.critical_rank] == \
            every.seconds_by_category, layout


@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 4, 8, 1), ("1f1b", 4, 3, 1), ("gpipe", 3, 5, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3),
                                        ("zb-h1", 4, 8, 1), ("zbv", 3, 8, 2)])
def test_stash_peaks_from_the_op_chunks_equal_walking_every_compute(kind, p, m, v):
    """The memory model's peaks, from each rank's (op, chunk) made without
    its computes and only the states that can be peaks, equal the plain
    walk of the kind's own order over every state, for any weights."""
    import random

    from ptdp.perf.analytic.counts import _held_states, stash_peaks
    from ptdp.schedules.kinds import kind_named

    rng = random.Random(kind)
    record = kind_named(kind)
    for rank in range(p):
        order = record.order(p, m, v, rank)
        ops, chunks = record.op_codes(p, m, v, rank)
        assert list(zip(ops.tolist(), chunks.tolist())) == [("FBW".index(c.op), c.chunk)
                                                            for c in order]
        weights = tuple(rng.randint(1, 9) for _ in range(v))
        deferred = tuple(rng.randint(0, 9) for _ in range(v)) if record.splits_backward else None
        held, states = [0] * (2 * v), []
        for c in order:   # every state, after every compute
            if c.op == "F":
                held[c.chunk] += 1
            elif c.op == "B":
                held[c.chunk] -= 1
                held[v + c.chunk] += record.splits_backward
            else:
                held[v + c.chunk] -= 1
            states.append(list(held))
        both = (*weights, *(weights if deferred is None else deferred))
        want = (max(map(sum, states)), max(sum(n * w for n, w in zip(s, both)) for s in states))
        _held_states.cache_clear()
        stash_peaks.cache_clear()
        assert stash_peaks(kind, p, m, v, rank, weights, deferred) == want


@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 8, 16, 1), ("interleaved", 4, 8, 3),
                                        ("zbv", 4, 8, 2), ("zb-h1", 4, 8, 1), ("gpipe", 3, 5, 1)])
def test_last_backwards_from_the_arrays_are_the_rows(kind, p, m, v):
    """A play's last backward of each chunk, read from its arrays, is what
    the (chunk, start, end) rows give, in the order the chunks first come."""
    import random

    from ptdp.perf.simulate import predict
    from ptdp.perf.simulate.codes import level_times

    codes = predict._codes((kind, p, m, v, None))
    rng = random.Random(f"{kind}{p}")
    computes = tuple(tuple((rng.uniform(0.1, 2.0), 0.0) for _ in row)
                     for row in codes.compute_slots)
    exchanges = tuple(tuple(rng.uniform(0.0, 0.3) for _ in row) for row in codes.exchange_slots)
    played = predict._played_of(codes, computes, *level_times(codes, computes, exchanges))
    for r in range(p):
        rows = played.backwards[r]
        assert len(rows) == m * v   # a backward (W) of each microbatch on each chunk
        want = dict(zip([row[0] for row in rows], rows))
        got = played.last_backwards(r)
        assert got == want and list(got) == list(want) and len(want) == v
