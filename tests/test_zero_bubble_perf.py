"""The performance model and planner under the zero-bubble schedules (zb-h1,
zbv): B + W is the fused backward, the bubble under uniform costs is the
schedule simulator's, memory follows the schedule's F -> B -> W order, and
`ptdp plan` searches and prints them."""

from fractions import Fraction

import pytest

from ptdp.cli import main
from ptdp.config import ModelConfig
from ptdp.schedules.build import build_schedule
from ptdp.schedules.simulate import simulate as simulate_unit_time
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.plan import planner as plan
from ptdp.perf.price.machine import Machine
from ptdp.perf.analytic.memory import activation_bytes, memory_per_rank
from ptdp.perf.simulate.predict import simulate, simulate_uniform
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.price.stage_costs import chunk_costs
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.price.profiles import load_profile

A100 = load_profile("a100")
GPT_18B = ModelConfig(num_layers=40, hidden_size=6144, num_attention_heads=48, seq_length=2048,
                      vocab_size=51200)
LLAMA = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=512,
                    vocab_size=32000, normalization="RMSNorm", swiglu=True,
                    position_embedding_type="rope", group_query_attention=True,
                    num_query_groups=4, untie_embeddings_and_output_weights=True,
                    disable_bias_linear=True)
TINY = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                   vocab_size=100)


@pytest.mark.parametrize("model, precision, sp", [(GPT_18B, "bf16", False), (GPT_18B, "fp32", True),
                                                  (LLAMA, "bf16", False), (LLAMA, "bf16", True)])
def test_b_plus_w_is_the_fused_backward(model, precision, sp):
    layout = Layout(t=4, p=2, b=2, sequence_parallel=sp)
    ops = OperatorModel(Workload(model, 8, precision), layout, A100, Machine(layout, A100))
    for fused, (b, w) in ((ops.layer_backward(), ops.layer_backward_parts()),):
        assert b.total_work + w.total_work == pytest.approx(fused.total_work, rel=1e-12)
        assert w.total_work > 0 and b.total_work > 0
        if sp:   # nothing overlaps any more: every collective exposed
            assert b.comm + w.comm >= fused.comm
        else:
            assert (b.comm, w.comm) == (pytest.approx(fused.comm, rel=1e-12), 0.0)
    # The same work on every rank, so the same model FLOPs per iteration.
    workload = Workload(model, 8, precision)
    zb = Layout(t=4, p=2, b=2, schedule="zb-h1", sequence_parallel=sp)
    for rank in range(2):
        fused, split = chunk_costs(ops, layout, rank, 0), chunk_costs(ops, zb, rank, 0)
        assert split.backward.total_work + split.weight.total_work == pytest.approx(
            fused.backward.total_work, rel=1e-12)
        assert split.parameters == fused.parameters
    assert simulate(workload, zb, A100).flops_per_iteration == \
        simulate(workload, layout, A100).flops_per_iteration


@pytest.mark.parametrize("kind, p, m, v", [("zb-h1", 4, 8, 1), ("zbv", 4, 8, 2), ("zbv", 3, 7, 2)])
def test_uniform_bubble_is_the_schedule_simulators(kind, p, m, v):
    """F = B = W (forward 1, backward 2, W half of it): (p−1)/(3m) for zb-h1,
    (p−1)/(6m) for zbv, from the cost model's event simulation and the
    unit-time simulator alike."""
    _, bubble = simulate_uniform(kind, p, m, v)
    assert bubble == simulate_unit_time(build_schedule(kind, p, m, v)).bubble_fraction
    assert bubble == Fraction(p - 1, (3 if kind == "zb-h1" else 6) * m)
    _, other = simulate_uniform(kind, p, m, v, weight=Fraction(1, 2))
    assert other == simulate_unit_time(build_schedule(kind, p, m, v),
                                       weight_cost=Fraction(1, 2)).bubble_fraction


def test_zero_bubble_beats_1f1b_and_interleaving_where_the_bubble_is_large():
    """18B, t = 8, p = 4, m = 8: 1F1B idles 36 % of its compute; zb-h1 and
    zbv fill most of it with W."""
    workload = Workload(GPT_18B, 8)
    times = {kind: simulate(workload, Layout(t=8, p=4, b=1, v=v, schedule=schedule), A100)
             for kind, v, schedule in (("1f1b", 1, "1f1b"), ("interleaved", 2, "1f1b"),
                                       ("zb-h1", 1, "zb-h1"), ("zbv", 2, "zbv"))}
    assert times["1f1b"].bubble_fraction > 0.3
    assert times["zb-h1"].iteration_seconds < times["1f1b"].iteration_seconds
    assert times["zbv"].iteration_seconds < times["interleaved"].iteration_seconds
    assert times["zbv"].bubble_fraction < times["zb-h1"].bubble_fraction


def _peak_from_schedule(schedule, rank, held, deferred):
    """Walk the schedule's computes: F adds a chunk's saved activations, B
    swaps them for what W needs, W frees that."""
    now = peak = 0
    for c in schedule.computes(rank):
        now += {"F": held[c.chunk], "B": deferred[c.chunk] - held[c.chunk],
                "W": -deferred[c.chunk]}[c.op]
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("kind, v", [("zbv", 2), ("zb-h1", 1)])
def test_memory_is_the_peak_counted_from_the_schedule(kind, v):
    p, batch = 4, 16
    workload = Workload(TINY, batch)
    layout = Layout(p=p, v=v, schedule=kind, b=1)
    acts = activation_bytes(workload, layout)
    per_chunk = TINY.num_layers // (p * v)
    schedule = build_schedule(kind, p, batch, v)
    memory = memory_per_rank(workload, layout)
    for rank in range(p):
        stages = [schedule.virtual_stage(rank, c) for c in range(v)]
        held = [per_chunk * acts["layer"] + (acts["embedding"] if s == 0 else 0)
                + (acts["output"] if s == p * v - 1 else 0) for s in stages]
        deferred = [per_chunk * acts["weight_grad_layer"] for s in stages]
        assert memory[rank]["activations"] == _peak_from_schedule(schedule, rank, held, deferred)
    assert analytic.peak_in_flight_per_rank(layout, batch) == [schedule.in_flight_bound(r)
                                                                for r in range(p)]
    if kind == "zbv":
        # Rank 0 holds the first and the last stage: one word embedding, no
        # embedding-group sum, and no transfer across the bottom of the V.
        assert sum(analytic.parameters_per_rank(TINY, layout)) == sum(
            analytic.parameters_per_rank(TINY, Layout(p=1)))
        traffic = analytic.communication_per_rank(workload, layout)
        looped = analytic.communication_per_rank(workload, Layout(p=p, v=2, b=1))
        assert all(rank["embedding"] == 0 for rank in traffic)
        # Rank p−1 sends 2 tensors per microbatch, not the looped schedule's 3.
        assert traffic[p - 1]["pipeline"] == looped[p - 1]["pipeline"] * 2 / 3


def test_plan_picks_a_zero_bubble_schedule_and_prints_its_flags(capsys, monkeypatch):
    workload = Workload(GPT_18B, 8)
    restrictions = dict(microbatch_sizes=(1,), recompute=(None,), distributed_optimizer=(False,),
                        sequence_parallel=(False,), chunk_counts=(1, 2))
    everything = plan.search(workload, 32, A100, **restrictions)
    best = everything[0].layout
    assert best.schedule == "zbv" and best.v == 2, plan.table(everything, 5)
    flags = best.train_flags(GPT_18B, 8)
    assert flags[-2:] == ["--pipeline-schedule", "zbv"]
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    assert any("vs schedule" in line for line in plan.explain(everything, A100))
    # Pruned by the lower bound: the first EXACT_ROWS rows stay exact.
    monkeypatch.setattr(plan, "EXACT_ROWS", 3)
    pruned = plan.search(workload, 32, A100, **restrictions)
    assert len(pruned) < len(everything)
    assert [e.layout for e in pruned[:3]] == [e.layout for e in everything[:3]]

    argv = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "1024", "--gpus", "8", "--global-batch-size", "16", "-t", "2",
            "-p", "4", "--print-flags", "--fix-all"]
    assert main(argv + ["--pipeline-schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "| zb-h1 |" in out and "--pipeline-schedule zb-h1" in out
    assert main(argv + ["--pipeline-schedule", "zbv"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | zbv |" in out and out.rstrip().endswith("--pipeline-schedule zbv")


@pytest.mark.parametrize("layout, batch, message", [
    (Layout(p=4, schedule="zb-h1"), 2, "zb-h1 needs m=2 to be at least p=4"),
    (Layout(p=4, v=2, schedule="zbv"), 4, "zbv needs m=4 to be at least 2p=8"),
    (Layout(p=4, v=1, schedule="zbv"), 8, "zbv has v=2 chunks per rank in a V, not v=1"),
    (Layout(p=1, v=2, schedule="zbv"), 8, "zbv needs p >= 2"),
    (Layout(p=8, v=2, schedule="zbv"), 16, "zbv needs 2p=16 to divide the 8 layers"),
    (Layout(p=2, v=2, schedule="zb-h1"), 8, "zb-h1 has one chunk per rank, not v=2"),
    (Layout(p=2, schedule="1f2b"), 8, "unknown schedule '1f2b'"),
])
def test_valid_for_states_the_zero_bubble_rules(layout, batch, message):
    assert message in "; ".join(layout.valid_for(TINY, batch))
    ok = Layout(p=4, v=2, schedule="zbv")
    assert ok.valid_for(TINY, 8) == [] and ok.schedule_kind == "zbv"
    assert Layout(p=4, v=2).schedule_kind == "interleaved"
