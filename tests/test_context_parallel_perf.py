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
