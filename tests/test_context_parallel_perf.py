"""The performance model of context parallelism (issue 28, item 4): a
layout's c and --cp-comm-type in `ptdp plan`, activations per rank over c,
the replicated parts unchanged, the ring's traffic and its overlap with the
attention, and c = 1 priced exactly as before."""

import dataclasses
import json

import pytest

from ptdp.cli import main
from ptdp.config import ModelConfig
from ptdp.perf.price.context_exchange import (context_exchange_seconds, kv_block_bytes,
                                              ring_step_exposed)
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.price.machine import Machine
from ptdp.perf.analytic.memory import activation_bytes, memory_per_device
from ptdp.perf.plan.planner import context_sizes_to_search, evaluate_layout
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.price.profiles import load_profile

A100, H100 = load_profile("a100"), load_profile("h100")
GPT_39B = ModelConfig(num_layers=48, hidden_size=8192, num_attention_heads=64, seq_length=2048,
                      vocab_size=51200)
# A long-context Llama-style model (no attention dropout: `ptdp train` refuses it with c > 1).
LONG = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=16384,
                   vocab_size=32000, attention_dropout=0.0, normalization="RMSNorm", swiglu=True,
                   position_embedding_type="rope", group_query_attention=True,
                   num_query_groups=4)
SMALL_PLAN = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
              "--seq-length", "8192", "--attention-dropout", "0", "--gpus", "8", "--gpu", "h100",
              "--global-batch-size", "8"]


def test_c1_prices_what_the_model_prices_without_context_parallelism():
    """The README's winner on 64 A100s: c = 1 given or left out prices the
    same, to the last bit (the figure is the model's of 2026-12-05, with
    memory-bound passes at the HBM fraction kernels reach, gradient
    buckets overlapping the backward and the a100's e_max refitted beside
    the paper's attention core), and adds no context category or flag."""
    layout = Layout(t=4, p=2, d=8, b=4, v=8, sequence_parallel=True, distributed_optimizer=True)
    e = evaluate_layout(Workload(GPT_39B, 512), layout, A100)
    assert e.seconds == 21.22253523820025
    assert evaluate_layout(Workload(GPT_39B, 512), dataclasses.replace(layout, c=1),
                           A100).seconds == e.seconds
    assert e.memory == {"weights": 9909993472, "gradients": 22297485312,
                        "optimizer": 7432495104, "activations": 29187522560,
                        "total": 68827496448}
    assert "context exchange" not in e.prediction.seconds_by_category
    assert "--context-parallel-size" not in " ".join(layout.train_flags(GPT_39B, 512))
    assert "c" not in e.summary()["layout"]


def test_activations_per_rank_fall_by_c_and_replicated_parts_do_not():
    workload = Workload(LONG, 8)
    one, two = Layout(t=1, d=2, b=1), Layout(t=1, c=2, d=1, b=1)
    # Every term a layer saves is linear in the rank's s/c positions (flash attention).
    assert activation_bytes(workload, two)["layer"] * 2 == activation_bytes(workload, one)["layer"]
    m1, m2 = memory_per_device(workload, one), memory_per_device(workload, two)
    assert m2["activations"] < m1["activations"]
    for part in ("weights", "gradients", "optimizer"):   # replicated over the context ranks
        assert m2[part] == m1[part]
    # The distributed optimizer shards over d·c: c = 2, d = 1 owns what d = 2 does.
    sharded = [memory_per_device(workload, dataclasses.replace(layout, distributed_optimizer=True))
               for layout in (one, two)]
    assert sharded[0]["optimizer"] == sharded[1]["optimizer"] < m1["optimizer"]


def test_all_gather_keeps_the_gathered_keys_and_values():
    workload = Workload(LONG, 8)
    p2p = activation_bytes(workload, Layout(c=4))["layer"]
    gathered = activation_bytes(workload, Layout(c=4, cp_comm="all_gather"))["layer"]
    a, g, d, s, e = (LONG.num_attention_heads, LONG.query_groups, LONG.head_dim, LONG.seq_length,
                     2)
    # The whole sequence's K and V and its int64 reorder index; of the local q, k, v only the
    # rotated q (p2p keeps the QKV output and the rotated k too: (a + 2g + g)·d·(s/c)·e).
    assert gathered - p2p == 2 * g * d * s * e + 8 * s - (a + 3 * g) * d * s // 4 * e


def _ops(layout, profile):
    workload = Workload(LONG, 8)
    return OperatorModel(workload, layout, profile, Machine(layout, profile))


def test_ring_hides_its_transfer_behind_the_block_in_hand():
    assert ring_step_exposed(transfer=1.0, block=2.0) == 0.0
    assert ring_step_exposed(transfer=3.0, block=2.0) == 1.0
    layout = Layout(c=4)
    ops = _ops(layout, H100)
    forward_block, backward_block = ops.attention_block_seconds()
    # A 4096-position block of 16 heads computes far longer than 2·4096·4·64·2 bytes take on NVLink.
    assert ops.machine.context_step(kv_block_bytes(ops)) < forward_block
    assert context_exchange_seconds(ops, backward=False) == 0.0
    assert context_exchange_seconds(ops, backward=True) == 0.0
    # On a slow link the excess of each of the c - 1 steps shows.
    slow = dataclasses.replace(H100, intra_bandwidth=1e8, collective_seconds={})
    ops = _ops(layout, slow)
    transfer = ops.machine.context_step(kv_block_bytes(ops))
    assert transfer > ops.attention_block_seconds()[0]
    assert context_exchange_seconds(ops, backward=False) == pytest.approx(
        3 * (transfer - ops.attention_block_seconds()[0]))
    e = evaluate_layout(Workload(LONG, 8), Layout(c=4, d=2, b=1), slow)
    assert e.prediction.seconds_by_category["context exchange"] > 0


def test_context_group_link_and_attention_work():
    assert not Machine(Layout(t=4, c=2), H100).spans_servers(Machine(Layout(t=4, c=2), H100)
                                                             .context_group())
    wide = Machine(Layout(t=8, c=2), H100)
    assert wide.context_group() == [0, 8] and wide.spans_servers(wide.context_group())
    # Causal attention per rank: 1/c of the work (c blocks of s/c, or a/c heads for a2a).
    assert _ops(Layout(c=4), H100).score_elements() * 4 == _ops(Layout(), H100).score_elements()
    assert (_ops(Layout(c=4, cp_comm="a2a"), H100).score_elements() * 4
            == _ops(Layout(), H100).score_elements())
    # Gradients reduced over d·c: c = 2 with d = 1 still reduces them.
    e = evaluate_layout(Workload(LONG, 8), Layout(c=2, b=1), H100)
    assert e.prediction.seconds_by_category["data-parallel reduction"] > 0


def test_a2a_is_refused_where_heads_do_not_divide():
    model = dataclasses.replace(LONG, num_attention_heads=12, num_query_groups=6,
                                hidden_size=768)
    assert context_sizes_to_search(model, 8, "a2a") == [1, 2]
    assert context_sizes_to_search(model, 8, "p2p") == [1, 2, 4, 8]
    problems = Layout(c=4, cp_comm="a2a").valid_for(model, 8)
    assert problems and "--cp-comm-type a2a" in problems[0]


def test_plan_search_keeps_a_given_c_and_prints_its_flags(capsys):
    assert main([*SMALL_PLAN, "--context-parallel-size", "2", "--json", "--print-flags"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[:out.rindex("}") + 1])
    assert data["results"] and all(r["layout"]["c"] == 2 for r in data["results"])
    command = out.strip().splitlines()[-1]
    assert command.startswith("ptdp train ")
    assert "--context-parallel-size 2 --cp-comm-type p2p" in command


def test_plan_searches_c_and_refuses_a2a_that_cannot_split(capsys):
    assert main([*SMALL_PLAN, "--top", "40", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["layout"].get("c", 1) for r in data["results"]} >= {1, 2}
    assert main([*SMALL_PLAN, "--num-attention-heads", "12", "--hidden-size", "768",
                 "--context-parallel-size", "8", "--cp-comm-type", "a2a"]) == 2
    assert "--cp-comm-type a2a splits each tensor rank's 12 attention heads" in \
        capsys.readouterr().err


# ------------------------------------------------------------------ sliding windows under c > 1

def _plan_work(blocks) -> float:
    """Score entries context_attention's blocks compute: a causal square of
    n at n²/2, any other rectangle (masked or not) whole."""
    return sum((q1 - q0) ** 2 / 2 if causal else (q1 - q0) * (k1 - k0)
               for _, q0, q1, k0, k1, causal, _ in blocks)


@pytest.mark.parametrize("seq, c, left", [(1024, 4, 100), (1024, 4, 300), (1536, 3, 50),
                                          (1024, 2, 700), (2048, 4, 0), (1024, 4, 1022),
                                          (1024, 4, 5000)])
def test_window_work_counts_what_the_context_plans_compute(seq, c, left):
    """context_window_work's shares are the block areas of context_attention's
    own plans (its _Window, or no window where it holds every key), per rank
    and ring step (p2p), for the busiest rank's gathered attention
    (all_gather) and for the whole sequence (a2a)."""
    from ptdp.parallel import context_attention as ca
    from ptdp.perf.analytic import context_window

    assert context_window.WINDOW_BLOCK == ca.WINDOW_BLOCK
    half, full_step = seq // (2 * c), (seq // c) ** 2 / 2
    window = ca._Window(left, seq, "cpu") if left < seq - 1 else None
    p2p = context_window.context_window_work(seq, c, left, "p2p")
    for rank in range(c):
        for step in range(c):
            blocks = ca._ring_blocks(rank, (rank - step) % c, c, half, None, window)
            assert p2p.steps[rank][step] == pytest.approx(_plan_work(blocks) / full_step)
    assert p2p.busiest == pytest.approx(max(map(sum, p2p.steps)) / c)
    gathered = max(_plan_work(ca._whole_sequence_blocks(
        ca._chunk_spans(rank, c, half), None, ca._gathered_pairs(rank, c, half), window))
        for rank in range(c))
    assert context_window.context_window_work(seq, c, left, "all_gather").busiest == \
        pytest.approx(gathered / (c * full_step))
    chunks = [(start, start, half) for start in range(0, seq, half)]
    whole = _plan_work(ca._whole_sequence_blocks(chunks, None, [(0, seq, 0, seq, True)], window))
    assert context_window.context_window_work(seq, c, left, "a2a").busiest == \
        pytest.approx(whole / (c * c * full_step))
    if left >= seq - 1:   # no window: every step a full causal one
        assert all(share == 1.0 for row in p2p.steps for share in row)
    if left < half and c > 2:   # a short window: some ring steps compute nothing
        assert any(share == 0.0 for row in p2p.steps for share in row[1:-1])


def test_windowed_ring_exposes_the_transfers_its_empty_steps_cannot_hide():
    from ptdp.perf.price.context_exchange import windowed_ring_exposed

    # Full steps: the c − 1 excesses of the unwindowed ring.
    assert windowed_ring_exposed(3.0, ((1.0,) * 4,) * 4, lambda share: 2.0 * share) == \
        pytest.approx(3 * ring_step_exposed(3.0, 2.0))
    # Rank 0: steps of 2, 0, 1 seconds take 2 + 1 + 1; rank 1: 2 + 1 + 0. Both
    # compute 3 seconds, so the slowest ring adds 1.
    assert windowed_ring_exposed(1.0, ((1.0, 0.0, 0.5), (1.0, 0.5, 0.0)),
                                 lambda share: 2.0 * share) == pytest.approx(1.0)


def _ring_time(transfer, blocks):
    """One rank's ring, step by step: each step but the last lasts as long
    as the longer of its block and the next block's transfer."""
    return sum(max(transfer, block) for block in blocks[:-1]) + blocks[-1]


def test_a_windowed_model_under_c4_computes_less_and_exposes_more_of_its_ring():
    """With L = 127 at c = 4 (chunks of 2048), each rank computes its own
    block and its neighbours' edges; the steps between hide nothing. The
    plan is faster than full attention's, its context exchange larger, and
    a layer's exchange is the slowest rank's ring beyond the busiest rank's
    attention, priced from the model's own block times."""
    from ptdp.perf.analytic.context_window import context_window_work

    windowed_model = dataclasses.replace(LONG, window_size="127,0")
    layout = Layout(c=4, d=2, b=1)
    full, windowed = _ops(layout, H100), OperatorModel(
        Workload(windowed_model, 8), layout, H100, Machine(layout, H100))
    work = context_window_work(LONG.seq_length, 4, 127, "p2p")
    assert windowed.window_share == work.busiest < 0.05
    assert windowed.fused_attention_seconds()[0] < full.fused_attention_seconds()[0]
    for backward in (False, True):
        kv = kv_block_bytes(windowed)
        transfer = windowed.machine.context_step(2 * kv if backward else kv)
        blocks = [[windowed.attention_block_seconds(share)[backward] for share in row]
                  for row in work.steps]
        expected = max(_ring_time(transfer, row) for row in blocks) - max(map(sum, blocks))
        exposed = context_exchange_seconds(windowed, backward)
        assert exposed == pytest.approx(expected)
        # Each rank has an empty step before its last: at least one whole transfer shows.
        assert exposed >= transfer * (1 - 1e-9)
        assert context_exchange_seconds(full, backward) == 0.0
    e_full = evaluate_layout(Workload(LONG, 8), layout, H100)
    e_windowed = evaluate_layout(Workload(windowed_model, 8), layout, H100)
    assert e_windowed.seconds < e_full.seconds
    assert (e_windowed.prediction.seconds_by_category["context exchange"]
            > e_full.prediction.seconds_by_category["context exchange"])
    # Every other layer windowed: the mean of the two layers' exchange.
    mixed = OperatorModel(Workload(dataclasses.replace(windowed_model, window_attn_skip_freq=2),
                                   8), layout, H100, Machine(layout, H100))
    assert context_exchange_seconds(mixed, False) == pytest.approx(
        (context_exchange_seconds(windowed, False) + context_exchange_seconds(full, False)) / 2)
