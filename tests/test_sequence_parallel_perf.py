"""The performance model under sequence parallelism (Layout.sequence_parallel):
activation bytes, tensor-group communication, memory, the simulator and
`ptdp plan`, against measurements of the real layers on tensor ranks.

- Activations: bytes saved for backward (saved-tensor hooks, as
  tests/test_analytic.py measures one process) by one transformer layer and
  by a whole model on every rank of a t = 2 and a t = 4 tensor group, with and
  without sequence parallelism, without, selective and full recomputation,
  for GPT-2 (attention dropout on: the CPU math kernel; off: flash) and a
  Llama-style layer, fp32 and bf16. The analytic figures must be exact (the
  whole model's on its most loaded tensor rank, the one holding the
  vocabulary padding).
- Communication: every tensor-group collective counted by kind and size
  around one layer's forward and backward (and the recomputation's) and
  around a whole model's, against `tensor_collectives_per_layer` and the
  "tensor" bytes of `communication_per_rank`; the buckets whose gradients a
  real GradBuffer sums over the tensor group against
  `partial_gradient_buckets`.
- Without processes: the closed forms (Korthikanti et al.'s
  s·b·h·(34/t + 5as/(ht)), the replicated part falling by t), the pipeline
  sends, the simulator's element-wise work and collectives, and the planner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

import ptdp.parallel.tensor as tensor_parallel
from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_args
from ptdp.config import ModelConfig, validate
from ptdp.model.gpt import GPT, build_chunks
from ptdp.parallel.data_parallel import GradBuffer
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.price.machine import Machine
from ptdp.perf.analytic.memory import (activation_bytes, korthikanti_activation_bytes_per_layer,
                                       layer_activation_bytes, memory_per_device)
from ptdp.perf.analytic.norm_bytes import norm_saved_bytes
from ptdp.perf.simulate.predict import simulate
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.plan.planner import candidate_layouts, evaluate_layout, explain, search
from ptdp.perf.price.profiles import load_profile
from ptdp.perf.analytic.saved import SavedTensorBytes

SEED = 5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GPT2 = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, seq_length=32,
                   vocab_size=197, make_vocab_size_divisible_by=8, hidden_dropout=0.1,
                   attention_dropout=0.1)
LLAMA = dataclasses.replace(GPT2, attention_dropout=0.0, normalization="RMSNorm", swiglu=True,
                            position_embedding_type="rope", group_query_attention=True,
                            num_query_groups=4, untie_embeddings_and_output_weights=True,
                            disable_bias_linear=True)
MODELS = {"gpt": GPT2, "gpt-flash": dataclasses.replace(GPT2, attention_dropout=0.0),
          "llama": LLAMA}
B = 2
BUCKET = 3000     # several buckets per rank, so some hold no partial gradient


# ------------------------------------------------------------------ measured on tensor ranks

@contextlib.contextmanager
def _counting(log: list):
    """Record (kind, elements, bytes per element) of every collective the
    tensor-parallel operators start (all-reduces of f, g and the cross
    entropy; the sequence's all-gathers and reduce-scatters)."""
    names = ("_all_reduce", "all_gather_flat", "reduce_scatter_flat")
    original = {name: getattr(tensor_parallel, name) for name in names}

    def all_reduce(x, group, *args, **kwargs):
        log.append(("all_reduce", x.numel(), x.element_size()))
        return original["_all_reduce"](x, group, *args, **kwargs)

    def all_gather(out, x, group, *args, **kwargs):
        log.append(("all_gather", out.numel(), out.element_size()))
        return original["all_gather_flat"](out, x, group, *args, **kwargs)

    def reduce_scatter(out, x, group, *args, **kwargs):
        log.append(("reduce_scatter", x.numel(), x.element_size()))
        return original["reduce_scatter_flat"](out, x, group, *args, **kwargs)

    tensor_parallel._all_reduce = all_reduce
    tensor_parallel.all_gather_flat = all_gather
    tensor_parallel.reduce_scatter_flat = reduce_scatter
    try:
        yield
    finally:
        for name, function in original.items():
            setattr(tensor_parallel, name, function)


def _one_layer(config: ModelConfig, ctx: ParallelContext, sp: bool, dtype: torch.dtype):
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(SEED, ctx)
    layer = GPT(config, ctx, rng, pre_process=False, post_process=False, sequence_parallel=sp)
    layer = layer.initialize(SEED).to(dtype).train()
    rows = config.seq_length // ctx.tp_size if sp else config.seq_length
    hidden = torch.randn(rows, B, config.hidden_size, generator=torch.Generator().manual_seed(1))
    return layer, hidden.to(dtype).requires_grad_()


def _whole_model(config: ModelConfig, ctx: ParallelContext, sp: bool, dtype: torch.dtype):
    model = build_chunks(config, ctx, torch.device("cpu"), SEED, sequence_parallel=sp)[0]
    sample = torch.randint(0, config.vocab_size, (B, config.seq_length + 1),
                           generator=torch.Generator().manual_seed(1))
    return model.to(dtype).train(), sample


def _measure(rank: int, t: int, layer_cases: list, model_cases: list, count_cases: list,
             bucket_cases: list) -> dict:
    """On each rank of a t-way tensor group: saved bytes of one layer and of
    a whole model, the collectives of one layer and of a whole model, and
    the partial gradients of each GradBuffer bucket."""
    torch.set_num_threads(1)
    ctx = ParallelContext.build(RankGrid(tp=t, dp=1, pp=1))
    results = {"layer": [], "model": [], "counts": [], "buckets": []}
    for config, precision, sp in layer_cases:
        layer, hidden = _one_layer(config, ctx, sp, DTYPES[precision])
        with SavedTensorBytes(layer.parameters()) as saved:
            out = layer(hidden)
        out.float().sum().backward()
        results["layer"].append(saved.bytes)
    for config, precision, sp in model_cases:
        model, sample = _whole_model(config, ctx, sp, DTYPES[precision])
        with SavedTensorBytes(model.parameters()) as saved:
            loss = model(sample[:, :-1], sample[:, 1:])
        loss.backward()
        results["model"].append(saved.bytes)
    for config, sp, whole in count_cases:
        forward, backward = [], []
        if whole:
            model, sample = _whole_model(config, ctx, sp, torch.float32)
            with _counting(forward):
                out = model(sample[:, :-1], sample[:, 1:])
        else:
            layer, hidden = _one_layer(config, ctx, sp, torch.float32)
            with _counting(forward):
                out = layer(hidden)
        with _counting(backward):
            out.float().sum().backward()
        results["counts"].append((forward, backward))
    for config in bucket_cases:
        chunks = build_chunks(config, ctx, torch.device("cpu"), SEED, sequence_parallel=True)
        buffer = GradBuffer([q for chunk in chunks for q in chunk.parameters()], ctx,
                            param_dtype=torch.float32, bucket_size=BUCKET, shard=False)
        results["buckets"].append([sum(q.numel() for q in bucket.partial)
                                   for bucket in buffer.buckets if bucket.partial])
    return results


LAYER_CASES = [(name, recompute, precision, sp)
               for name in MODELS for recompute in (None, "selective", "full")
               for precision in DTYPES for sp in (False, True)]
MODEL_CASES = [(name, precision, sp) for name in ("gpt", "llama") for precision in DTYPES
               for sp in (False, True)]
COUNT_CASES = [(hidden_dropout, recompute, sp, False) for hidden_dropout in (0.1, 0.0)
               for recompute in (None, "full") for sp in (False, True)]
COUNT_CASES += [(0.1, None, sp, True) for sp in (False, True)]


def _layer_config(name: str, recompute: str | None) -> ModelConfig:
    return dataclasses.replace(MODELS[name], recompute_granularity=recompute)


def _count_config(hidden_dropout: float, recompute: str | None, whole: bool) -> ModelConfig:
    return dataclasses.replace(GPT2, hidden_dropout=hidden_dropout, recompute_granularity=recompute,
                               num_layers=2 if whole else 1)


@pytest.fixture(scope="module", params=[2, 4], ids=["t2", "t4"])
def measured(request, pools):
    """(t, every rank's measurements), one pool call per t."""
    t = request.param
    layer_cases = [(_layer_config(name, recompute), precision, sp)
                   for name, recompute, precision, sp in LAYER_CASES]
    model_cases = [(dataclasses.replace(MODELS[name], num_layers=2), precision, sp)
                   for name, precision, sp in MODEL_CASES]
    count_cases = [(_count_config(dropout, recompute, whole), sp, whole)
                   for dropout, recompute, sp, whole in COUNT_CASES]
    bucket_cases = [dataclasses.replace(MODELS[name], num_layers=3) for name in ("gpt", "llama")]
    return t, pools(t).run(_measure, t, layer_cases, model_cases, count_cases, bucket_cases)


def test_layer_activation_bytes_equal_the_saved_tensors(measured):
    t, ranks = measured
    for i, (name, recompute, precision, sp) in enumerate(LAYER_CASES):
        saved = {rank["layer"][i] for rank in ranks}
        assert len(saved) == 1, (name, recompute, precision, sp, saved)   # every tensor rank alike
        predicted = layer_activation_bytes(_layer_config(name, recompute), B, t,
                                           sequence_parallel=sp, recompute=recompute,
                                           dtype=DTYPES[precision], kernels="cpu")
        assert predicted == saved.pop(), (name, recompute, precision, sp)


def test_replicated_part_falls_by_t(measured):
    """Measured: what sequence parallelism saves is the replicated part
    (norms' inputs, outputs and statistics, dropout masks; the layer input
    under full recomputation), (t − 1)/t of it."""
    t, ranks = measured
    saved = dict(zip(LAYER_CASES, ranks[0]["layer"]))
    for name, recompute, precision, sp in LAYER_CASES:
        if sp:
            continue
        config = _layer_config(name, recompute)
        e = 4 if precision == "fp32" else 2
        rows, h = config.seq_length * B, config.hidden_size
        norm = norm_saved_bytes(config, rows, e, cpu=True)
        replicated = rows * h * e if recompute == "full" else 2 * rows * h * e + 2 * norm + \
            2 * rows * h * e     # norm outputs, norms' saved tensors, the two dropout masks
        dropped = saved[(name, recompute, precision, False)] - saved[(name, recompute, precision,
                                                                      True)]
        assert dropped * t == replicated * (t - 1), (name, recompute, precision)


def test_model_activation_bytes_equal_the_saved_tensors(measured):
    """Layers, the first stage's extra (its position ids and dropout mask on
    s/t positions) and the last stage's (the final norm on s/t positions and
    the output layer's saved s/t input), on the most loaded tensor rank."""
    t, ranks = measured
    for i, (name, precision, sp) in enumerate(MODEL_CASES):
        config = dataclasses.replace(MODELS[name], num_layers=2)
        figures = activation_bytes(Workload(config, B, precision),
                                   Layout(t=t, b=B, sequence_parallel=sp), kernels="cpu")
        predicted = (config.num_layers * (figures["layer"] + figures["rotary_tables"])
                     + figures["embedding"] + figures["output"])
        assert max(rank["model"][i] for rank in ranks) == predicted, (name, precision, sp)


def _halves(collectives: list) -> dict:
    """Counts by kind of the [s, b, h]-sized collectives."""
    counts = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    for kind, _, _ in collectives:
        counts[kind] += 1
    return counts


def test_collectives_per_layer_are_counted(measured):
    t, ranks = measured
    for i, (dropout, recompute, sp, whole) in enumerate(COUNT_CASES):
        if whole:
            continue
        config = _count_config(dropout, recompute, whole)
        forward, backward = ranks[0]["counts"][i]
        sbh = config.seq_length * B * config.hidden_size
        assert all(elements == sbh for _, elements, _ in forward + backward)
        counted = {kind: n + _halves(backward)[kind] for kind, n in _halves(forward).items()}
        layout = Layout(t=t, b=B, recompute=recompute, sequence_parallel=sp)
        assert analytic.tensor_collectives_per_layer(Workload(config, B, "fp32"), layout) == \
            counted, (dropout, recompute, sp)
        if sp and recompute is None:   # forward: 2 all-gathers and 2 reduce-scatters
            assert _halves(forward) == {"all_reduce": 0, "all_gather": 2, "reduce_scatter": 2}


def test_tensor_traffic_of_a_whole_model(measured):
    """Bytes a rank sends in its tensor group over one microbatch's forward
    and backward (ring collectives: 2·(t−1)/t of an all-reduce's tensor,
    (t−1)/t of an all-gather's or reduce-scatter's), against the model's
    "tensor" traffic for p = 1 and one microbatch."""
    t, ranks = measured
    for i, (dropout, recompute, sp, whole) in enumerate(COUNT_CASES):
        if not whole:
            continue
        config = _count_config(dropout, recompute, whole)
        forward, backward = ranks[0]["counts"][i]
        sent = sum((2 if kind == "all_reduce" else 1) * (t - 1) / t * elements * size
                   for kind, elements, size in forward + backward)
        volume = analytic.communication_per_rank(Workload(config, B, "fp32"),
                                                 Layout(t=t, b=B, sequence_parallel=sp))[0]
        assert volume["tensor"] == pytest.approx(sent, rel=1e-12), sp


def test_partial_gradient_buckets_match_the_gradient_buffer(measured):
    t, ranks = measured
    for i, name in enumerate(("gpt", "llama")):
        config = dataclasses.replace(MODELS[name], num_layers=3)
        layout = Layout(t=t, sequence_parallel=True)
        expected = analytic.partial_gradient_buckets(config, layout, 0, BUCKET)
        assert len(expected) > 1 and all(rank["buckets"][i] == expected for rank in ranks), name
        assert analytic.partial_gradient_buckets(config, Layout(t=t), 0, BUCKET) == []


# ------------------------------------------------------------------ formulas

BIG = ModelConfig(num_layers=16, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                  vocab_size=51200, hidden_dropout=0.1, attention_dropout=0.1)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_closed_form(t):
    """Korthikanti et al.: s·b·h·(10 + 24/t + 5as/(ht)) without sequence
    parallelism, s·b·h·(34/t + 5as/(ht)) with it. Ours on GPUs (bf16, flash
    attention) is the same tensors without the s² term, plus the logsumexp
    (4·a·s·b/t) and the fp32 LayerNorm statistics (16·s·b, split by t too)."""
    model, b = BIG, 1
    s, h, a = model.seq_length, model.hidden_size, model.num_attention_heads
    sbh, sb = s * b * h, s * b
    reference = korthikanti_activation_bytes_per_layer(model, b, t, sequence_parallel=True)
    assert reference == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    ours = layer_activation_bytes(model, b, t, sequence_parallel=True, kernels="cuda")
    assert ours * t == 34 * sbh + 4 * a * sb + 16 * sb
    assert ours == pytest.approx(reference - 5 * a * s / (h * t) * sbh + (4 * a * sb + 16 * sb) / t)
    plain = layer_activation_bytes(model, b, t, kernels="cuda")
    assert plain - ours == (10 * sbh + 16 * sb) * (t - 1) / t      # the replicated part, by t
    assert (korthikanti_activation_bytes_per_layer(model, b, t)
            - reference) == pytest.approx(10 * sbh * (t - 1) / t)
    # Recomputation: full keeps the layer input's s/t; selective drops no
    # more under sequence parallelism than the attention core's tensors.
    assert layer_activation_bytes(model, b, t, sequence_parallel=True, recompute="full",
                                  kernels="cuda") == sbh * 2 // t


def test_layer_activation_bytes_arguments():
    model = dataclasses.replace(GPT2, seq_length=36)
    figures = {dtype: layer_activation_bytes(model, 2, 2, dtype=dtype)
               for dtype in ("bf16", torch.bfloat16, "bfloat16")}
    assert len(set(figures.values())) == 1
    assert layer_activation_bytes(model, 2, dtype=torch.float32) == \
        activation_bytes(Workload(model, 2, "fp32"), Layout(b=2), kernels="cpu")["layer"]
    # Recomputation: the model's own unless given.
    selective = dataclasses.replace(model, recompute_granularity="selective")
    assert layer_activation_bytes(selective, 2, 2, sequence_parallel=True) == \
        layer_activation_bytes(model, 2, 2, sequence_parallel=True, recompute="selective")
    assert layer_activation_bytes(selective, 2, 2, recompute=None) == \
        layer_activation_bytes(model, 2, 2)
    with pytest.raises(ValueError, match="t > 1"):
        layer_activation_bytes(model, 2, 1, sequence_parallel=True)
    with pytest.raises(ValueError, match="divide the sequence"):
        layer_activation_bytes(model, 2, 8, sequence_parallel=True)
    with pytest.raises(ValueError, match="dtype"):
        layer_activation_bytes(model, 2, dtype="int8")


def test_traffic_formulas():
    """Per layer 10·b·s·h·(t−1)/t elements instead of 8 (the backward's two
    re-gathers), 14 or 13 with full recomputation; pipeline sends of s/t
    without a gather; the partial gradients summed once per iteration."""
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=1000, hidden_dropout=0.1)
    s, h, b, m, e = 32, 64, 2, 4, 2
    sbh = s * b * h
    work = Workload(model, global_batch=b * m)
    for t in (2, 4):
        layout = Layout(t=t, p=2, b=b, sequence_parallel=True)
        per_layer = analytic.tensor_traffic_per_layer(work, layout)
        assert per_layer == pytest.approx(10 * sbh * (t - 1) / t * e)
        full = dataclasses.replace(layout, recompute="full")
        assert analytic.tensor_traffic_per_layer(work, full) == pytest.approx(14 / 10 * per_layer)
        quiet = Workload(dataclasses.replace(model, hidden_dropout=0.0), b * m)
        assert analytic.tensor_traffic_per_layer(quiet, full) == pytest.approx(13 / 10 * per_layer)
        first, last = analytic.communication_per_rank(work, layout)
        plain = analytic.communication_per_rank(work, dataclasses.replace(layout,
                                                                          sequence_parallel=False))
        for volume in (first, last):
            assert volume["pipeline"] == pytest.approx(m * sbh * e / t)
            assert volume["pipeline_all_gather"] == 0
        half = (t - 1) / t * sbh * e
        assert first["tensor"] == pytest.approx(m * (4 * per_layer + 2 * half))
        assert last["tensor"] == pytest.approx(m * (4 * per_layer + 3 * half
                                                    + 3 * 2 * (t - 1) / t * s * b * 4))
        assert last["tensor"] - plain[1]["tensor"] == pytest.approx(m * (4 * 2 * half + half))
        # Norms (2h each) and row-parallel biases (h each), twice per layer;
        # the position table on the first stage, the final norm on the last.
        per_layer_partial = 2 * 2 * h + 2 * h
        partial = [4 * per_layer_partial + model.max_positions * h, 4 * per_layer_partial + 2 * h]
        for volume, n in zip((first, last), partial):
            assert volume["tensor_gradients"] == pytest.approx(2 * (t - 1) / t * n * 4)
        assert plain[0]["tensor_gradients"] == 0


def test_memory_and_flags():
    work = Workload(BIG, 64)
    layout = Layout(t=8, p=2, b=1)
    split = dataclasses.replace(layout, sequence_parallel=True)
    plain, ours = memory_per_device(work, layout), memory_per_device(work, split)
    assert ours["activations"] < plain["activations"] / 2
    assert {k: ours[k] for k in ("weights", "gradients", "optimizer")} == \
        {k: plain[k] for k in ("weights", "gradients", "optimizer")}
    assert Layout(t=1, sequence_parallel=True).valid_for(BIG, 8) == ["sequence parallelism needs "
                                                                    "t > 1"]
    assert Layout(t=3, sequence_parallel=True).valid_for(
        dataclasses.replace(BIG, num_attention_heads=48, hidden_size=4608, ffn_hidden_size=3 * 4096,
                            seq_length=1000), 8)
    flags = split.train_flags(BIG, 64)
    assert "--sequence-parallel" in flags
    argv = ["train", "--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32",
            "--seq-length", "2048", "--vocab-size", "51200", *flags]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.parallel.sequence_parallel
    validate(config, world_size=split.devices)


def test_simulator_splits_the_elementwise_work_and_prices_the_collectives():
    a100 = load_profile("a100")
    work = Workload(BIG, 32)
    layout = Layout(t=8, p=2, b=1)
    split = dataclasses.replace(layout, sequence_parallel=True)
    plain_ops = OperatorModel(work, layout, a100, Machine(layout, a100))
    split_ops = OperatorModel(work, split, a100, Machine(split, a100))
    outside = {"layer_norm", "residual"}
    for (kind, forward, backward), (_, f_split, b_split) in zip(plain_ops.layer_memory(),
                                                                split_ops.layer_memory()):
        divisor = 8 if kind in outside else 1
        assert (f_split, b_split) == (forward / divisor, backward / divisor), kind
    gather = Machine(split, a100).tensor_allgather(BIG.seq_length * BIG.hidden_size * 2)
    assert split_ops.layer_forward().comm == pytest.approx(4 * gather)
    # Full recomputation reruns them all under hidden dropout (BIG's), and
    # stops before the MLP's reduce-scatter without it.
    assert split_ops.layer_recompute("full").comm == pytest.approx(4 * gather)
    no_dropout = Workload(dataclasses.replace(BIG, hidden_dropout=0.0), 32)
    assert OperatorModel(no_dropout, split, a100, Machine(split, a100)).layer_recompute(
        "full").comm == pytest.approx(3 * gather)
    # Backward: the row-parallel layers' 2 all-gathers, and the re-gathers
    # and reduce-scatters of QKV and the MLP's first GEMM, 4 more, hidden
    # under those layers' backward GEMMs (NVLink: entirely) ...
    assert split_ops.layer_backward().comm == pytest.approx(2 * gather)
    # ... or, on a slow link, exposed beyond them.
    slow = dataclasses.replace(a100, intra_bandwidth=a100.intra_bandwidth / 1000)
    slow_ops = OperatorModel(work, split, slow, Machine(split, slow))
    slow_gather = Machine(split, slow).tensor_allgather(BIG.seq_length * BIG.hidden_size * 2)
    shapes = slow_ops.layer_gemms()
    hidden = sum(slow_ops.gemm_backward(*shapes[name][:3], shapes[name][3])
                 for name in ("qkv", "mlp_up"))
    assert slow_ops.layer_backward().comm == pytest.approx(6 * slow_gather - hidden)
    plain, ours = simulate(work, layout, a100), simulate(work, split, a100)
    forward = "forward compute"
    assert ours.seconds_by_category[forward] < plain.seconds_by_category[forward]
    assert ours.seconds_by_category["pipeline transfer"] < \
        plain.seconds_by_category["pipeline transfer"]     # no all-gather of what arrives
    # The same forward volume, and in backward 2 exposed all-gathers instead
    # of 2 all-reduces: less time on NVLink; on a slow link the re-gathers
    # and reduce-scatters outlast their GEMMs and it is more.
    category = "tensor all-reduce"
    assert ours.seconds_by_category[category] < plain.seconds_by_category[category]
    assert simulate(work, split, slow).seconds_by_category[category] > \
        simulate(work, layout, slow).seconds_by_category[category]
    # d = 1: only the tied embedding's sum, as without sequence parallelism.
    assert ours.seconds_by_category["data-parallel reduction"] == \
        plain.seconds_by_category["data-parallel reduction"]


# ------------------------------------------------------------------ ptdp plan

PLAN_MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
              "--seq-length", "1024", "--vocab-size", "51200", "--gpus", "8", "--gpu", "a100",
              "--global-batch-size", "32"]


def test_search_considers_sequence_parallelism_where_valid():
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=12,
                        vocab_size=100)
    layouts = list(candidate_layouts(Workload(model, 8), 8))
    split = {(layout.t, layout.sequence_parallel) for layout in layouts}
    assert split == {(1, False), (2, False), (2, True), (4, False), (4, True), (8, False)}
    assert sum(layout.sequence_parallel for layout in layouts) == \
        sum(layout.t in (2, 4) for layout in layouts) // 2


def test_plan_explains_sequence_parallelism():
    """A 39B GPT on 64 A100s without recomputation: only sequence
    parallelism fits, and the explanation says so."""
    model = ModelConfig(num_layers=48, hidden_size=8192, num_attention_heads=64, seq_length=2048,
                        vocab_size=51200)
    a100 = load_profile("a100")
    results = search(Workload(model, 512), 64, a100, microbatch_sizes=(4,), chunk_counts=(1, 2),
                     recompute=(None,), distributed_optimizer=(True,))
    best = results[0]
    assert best.layout.sequence_parallel
    lines = explain(results, a100)
    assert any("vs sequence parallelism   off" in line and "does not fit" in line
               for line in lines), lines
    # Where both fit, the comparison is a time.
    small = search(Workload(dataclasses.replace(model, num_layers=8), 64), 8, a100,
                   microbatch_sizes=(1,), chunk_counts=(1,), recompute=(None,),
                   distributed_optimizer=(False,))
    off = next(e for e in small if e.layout.t > 1)
    lines = explain([off] + [e for e in small if e is not off], a100)
    assert any(line.startswith("  vs sequence parallelism") and "time" in line
               for line in lines), lines


def test_plan_command_one_layout_with_sequence_parallelism(capsys):
    argv = PLAN_MODEL + ["-t", "4", "-p", "2", "--micro-batch-size", "2", "--sequence-parallel",
                         "--fix-all"]
    assert main(["plan", *argv, "--json", "--print-flags"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[:out.rindex("}") + 1])
    result = data["results"][0]
    assert result["layout"]["sequence_parallel"] is True
    layout = Layout(t=4, p=2, d=1, b=2, sequence_parallel=True)
    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                        vocab_size=51200)
    expected = memory_per_device(Workload(model, 32), layout)
    assert result["memory_per_device_bytes"] == expected["total"]
    assert result["memory_breakdown_bytes"]["activations"] == expected["activations"]
    assert "--sequence-parallel" in out.splitlines()[-1]
    plain = evaluate_layout(Workload(model, 32), dataclasses.replace(layout,
                                                                     sequence_parallel=False),
                            load_profile("a100"))
    assert result["memory_per_device_bytes"] < plain.memory["total"]

    assert main(["plan", *argv]) == 0
    assert "t=4 p=2 d=1 b=2 sequence-parallel" in capsys.readouterr().out
    # --fix-all prices t = 1 (train's default), which train refuses with sequence parallelism.
    assert main(["plan", *PLAN_MODEL, "--sequence-parallel", "--fix-all"]) == 2
    assert ("--sequence-parallel splits the sequence over the tensor-parallel ranks and needs "
            "--tensor-model-parallel-size > 1") in capsys.readouterr().err
