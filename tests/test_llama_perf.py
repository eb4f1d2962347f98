"""The performance model under the Llama family's options (RMSNorm, SwiGLU,
rotary embeddings, grouped-query attention, untied output layer, no linear
biases): parameters, FLOPs, activations and `ptdp plan`, each against an
independent count.

- Parameters: a count written out here from the model's tensor list, the
  logical parameters of the real one-process model, the tensors each rank's
  model holds under t and p (built without communication), and the published
  totals of Llama 2 7B and Llama 3 8B through `ptdp plan --json`.
- FLOPs: torch's FlopCounterMode around one forward and backward of the
  one-process model. It counts the matrix products (mm, addmm, bmm, baddbmm)
  and, through the mapping tests/test_report.py adds, the CPU flash attention
  kernel (Q·Kᵀ and scores·V for every query head, grouped or not; backward
  twice that). It counts no element-wise work: RMSNorm, the rotary rotation,
  SwiGLU's gate and biases are outside both its count and the paper's
  formula, so the two must agree exactly.
- Activations: bytes saved for backward by one layer (saved-tensor hooks, as
  tests/test_analytic.py measures GPT-2's layer) and by a whole
  one-process model (embedding and output extras).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ptdp.cli import build_parser, main
from ptdp.config import ModelConfig
from ptdp.model.gpt import GPT, build_chunks
from ptdp.parallel.data_parallel import GradBuffer
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.price.machine import Machine
from ptdp.perf.analytic.memory import activation_bytes, memory_per_device, memory_per_rank
from ptdp.perf.simulate.predict import simulate
from ptdp.perf.price.pricing import OperatorModel
from ptdp.perf.layout import Layout, Workload
from ptdp.commands.plan import model_from_args
from ptdp.perf.analytic.saved import SavedTensorBytes
from ptdp.perf.price.profiles import load_profile
from ptdp.train.banner import count_parameters
from ptdp.perf.analytic.flops import configured_flops_per_iteration, model_flops_per_iteration
from tests.test_analytic import _saved_bytes_of_one_layer
from tests.test_report import CPU_ATTENTION

SEED = 3
BASE = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=16,
                   vocab_size=200, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                   attention_dropout=0.0)
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, disable_bias_linear=True)
GQA = dict(group_query_attention=True, num_query_groups=2)

OPTIONS = {
    "gpt2": {},
    "rmsnorm": dict(normalization="RMSNorm"),
    "swiglu": dict(swiglu=True),
    "swiglu-ffn-96": dict(swiglu=True, ffn_hidden_size=96),
    "rope": dict(position_embedding_type="rope"),
    "gqa": GQA,
    "untied": dict(untie_embeddings_and_output_weights=True),
    "no-bias": dict(disable_bias_linear=True),
    "llama": LLAMA,
    "llama-gqa": {**LLAMA, **GQA},
    "swiglu-gqa-biases": dict(swiglu=True, **GQA),
}


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: threads only contend for the two cores tests share.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(options: dict) -> ModelConfig:
    return dataclasses.replace(BASE, **options)


# ------------------------------------------------------------------ parameters

def _hand_count(m: ModelConfig) -> int:
    """The logical tensors, one by one, as the model is described: word
    embedding [V, h]; position table [s, h] (learned positions only); per
    layer an input norm (weight [h], bias [h] for LayerNorm), QKV [(a+2g)·d,
    h] (+ bias), dense [h, a·d] (+ bias [h]), a post-attention norm, the
    first MLP matrix [2f, h] with SwiGLU or [f, h] (+ bias), the second
    [h, f] (+ bias [h]); a final norm; an untied output layer [V, h]."""
    V, h, s, l = m.vocab_size, m.hidden_size, m.max_positions, m.num_layers
    a, d, f = m.num_attention_heads, m.hidden_size // m.num_attention_heads, m.ffn_size
    g = m.num_query_groups if m.group_query_attention else a
    beta = 0 if m.disable_bias_linear else 1          # one bias per linear layer, or none
    norm = h + (h if m.normalization == "LayerNorm" else 0)
    first = 2 * f if m.swiglu else f
    layer = (norm
             + (a + 2 * g) * d * h + beta * (a + 2 * g) * d
             + h * a * d + beta * h
             + norm
             + first * h + beta * first
             + h * f + beta * h)
    return (V * h + (0 if m.position_embedding_type == "rope" else s * h) + l * layer + norm
            + (V * h if m.untie_embeddings_and_output_weights else 0))


def test_swiglu_default_width_is_megatrons():
    assert _model(dict(swiglu=True)).ffn_size == 128       # int(4·64·2/3 / 64)·64: 170 → 128
    assert dataclasses.replace(BASE, hidden_size=4096, swiglu=True).ffn_size == 10880


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_parameter_count_matches_the_built_model_and_a_hand_count(options):
    model = _model(options)
    gpt = GPT(model, ParallelContext.single(), RNGStreams(torch.device("cpu")))
    assert analytic.parameter_count(model) == _hand_count(model)
    assert count_parameters(gpt) == analytic.parameter_count(model)       # logical, unpadded
    held = sum(p.numel() for p in gpt.parameters())                       # padded vocabulary
    assert held == analytic.parameters_per_device(model, Layout())
    if options == {}:   # GPT-2's options: the paper's P plus the final LayerNorm
        assert analytic.parameter_count(model) == (analytic.paper_parameter_count(model)
                                                   + 2 * model.hidden_size)


def _held_by_each_rank(model: ModelConfig, t: int, p: int, v: int) -> dict[tuple[int, int], int]:
    """(pipeline rank, tensor rank) -> elements its model chunks hold, built
    with a context that has the grid but no process groups (building shards
    needs no communication)."""
    held = {}
    groups = {"tensor": None, "data": None, "pipeline": None, "model_parallel": None}
    grid = RankGrid(tp=t, dp=1, pp=p)
    for pp in range(p):
        for tp in range(t):
            ctx = ParallelContext(grid=grid, rank=grid.rank(tp, 0, pp), groups=groups)
            chunks = build_chunks(model, ctx, torch.device("cpu"), SEED, v)
            held[(pp, tp)] = sum(q.numel() for chunk in chunks for q in chunk.parameters())
    return held


@pytest.mark.parametrize("t, p, v", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)])
@pytest.mark.parametrize("options", ["llama-gqa", "swiglu-gqa-biases", "untied", "gpt2"])
def test_parameters_per_rank_match_the_rank_models(options, t, p, v):
    model = dataclasses.replace(_model(OPTIONS[options]), num_layers=4)
    layout = Layout(t=t, p=p, v=v)
    assert not layout.valid_for(model, global_batch=p)
    held = _held_by_each_rank(model, t, p, v)
    per_rank = analytic.parameters_per_rank(model, layout)
    for (pp, tp), count in held.items():
        assert count == per_rank[pp], (options, t, p, v, pp, tp)
    # The stages together hold what one pipeline rank would, plus the last
    # stage's copy of a tied word embedding (an untied output layer is no copy).
    word = model.padded_vocab_size(t) * model.hidden_size // t
    last_only = analytic.parameters_per_rank(model, Layout(t=t))[0]
    assert sum(per_rank) == last_only + (word if p > 1 and model.tied_output else 0)


@pytest.mark.parametrize("t, p, v", [(2, 2, 1), (1, 2, 2)])
@pytest.mark.parametrize("options", ["llama-gqa", "untied", "gpt2"])
def test_buffer_elements_match_the_gradient_buffer(options, t, p, v):
    """The flat buffers of each rank (d = 2, the distributed optimizer's
    padding, buckets small enough to cut the layers): the analytic bucket
    cutting follows the model's parameter order (an untied output layer
    after the final norm, in the ordinary buckets; a tied copy apart)."""
    model = dataclasses.replace(_model(OPTIONS[options]), num_layers=4)
    layout = Layout(t=t, p=p, d=2, v=v, distributed_optimizer=True)
    bucket = 3001
    grid = RankGrid(tp=t, dp=2, pp=p)
    groups = {"tensor": None, "data": None, "pipeline": None, "model_parallel": None}
    for pp in range(p):
        ctx = ParallelContext(grid=grid, rank=grid.rank(0, 0, pp), groups=groups)
        chunks = build_chunks(model, ctx, torch.device("cpu"), SEED, v)
        # As the Trainer marks them: the word embeddings a tied output layer shares.
        tied = {chunk.embedding.word_embeddings.weight for chunk in chunks
                if hasattr(chunk, "embedding") and p > 1 and model.tied_output}
        params = [q for chunk in chunks for q in chunk.parameters()]
        buffer = GradBuffer(params, ctx, param_dtype=torch.float32, bucket_size=bucket, shard=True,
                            tied=tied)
        cut = analytic._buckets(model, layout, pp, bucket)
        assert [sum(q.numel() for q in b.params) for b in buffer.buckets] == cut, (options, pp)
        assert buffer.numel == analytic.buffer_elements(model, layout, pp, bucket)


def test_untied_output_drops_the_embedding_gradient_sum():
    """With p > 1 a tied word embedding's gradient is summed between the first
    and the last stage; an untied output layer has no such sum (and no bucket
    of its own)."""
    model = _model(OPTIONS["llama"])
    tied = dataclasses.replace(model, untie_embeddings_and_output_weights=False)
    layout = Layout(p=2, d=2)
    work = Workload(model, global_batch=4)
    assert all(r["embedding"] == 0 for r in analytic.communication_per_rank(work, layout))
    tied_volume = analytic.communication_per_rank(Workload(tied, 4), layout)
    assert all(r["embedding"] > 0 for r in tied_volume)
    # One bucket for everything when untied (bucket larger than the rank),
    # the tied copy apart when tied.
    big = 10 ** 9
    assert len(analytic._buckets(model, layout, 1, big)) == 1
    assert len(analytic._buckets(tied, layout, 1, big)) == 2


# ------------------------------------------------------------------ FLOPs

def _counted_flops(config: ModelConfig, batch: int) -> int:
    """Matrix-product FLOPs of one forward and backward of the one-process
    model (recomputation included, as configured; torch's default early-stop
    checkpoint off, so every recomputed GEMM runs, as the formula counts)."""
    model = build_chunks(config, ParallelContext.single(), torch.device("cpu"), seed=SEED)[0]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1),
                           generator=generator)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), \
            FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return counter.get_total_flops()


FLOP_CASES = {
    "swiglu": dict(swiglu=True),
    "gqa": GQA,
    "untied-rope-rmsnorm": dict(untie_embeddings_and_output_weights=True,
                                position_embedding_type="rope", normalization="RMSNorm"),
    "llama-gqa": {**LLAMA, **GQA},
    "llama-gqa-ffn-96-full": {**LLAMA, **GQA, "ffn_hidden_size": 96,
                              "recompute_granularity": "full"},
    "llama-gqa-selective": {**LLAMA, **GQA, "recompute_granularity": "selective"},
    # attention dropout: the math kernel (bmm), k and v repeated to every head
    "llama-gqa-attention-dropout": {**LLAMA, **GQA, "attention_dropout": 0.1},
}


@pytest.mark.parametrize("options", FLOP_CASES.values(), ids=FLOP_CASES.keys())
def test_flops_equal_the_counted_matmuls(options):
    config = _model(options)
    counted = _counted_flops(config, 2)
    assert configured_flops_per_iteration(config, 2, num_model_chunks=1) == counted


def test_flops_closed_form():
    """F = 6·B·s·h·(l·((a + 2g)·d + h + (k + 1)·f + 2s) + V) without
    recomputation, 8·B·s·h·(l·(…) + 3V/4) with full recomputation; with
    GPT-2's options the paper's 72 and 96 forms."""
    B = 5
    for options in (OPTIONS["llama-gqa"], OPTIONS["gpt2"], dict(swiglu=True, ffn_hidden_size=96)):
        m = _model(options)
        s, h, l, V, a, f = (m.seq_length, m.hidden_size, m.num_layers, m.vocab_size,
                            m.num_attention_heads, m.ffn_size)
        g, d, k = m.query_groups, m.head_dim, 2 if m.swiglu else 1
        inner = l * ((a + 2 * g) * d + h + (k + 1) * f + 2 * s)
        assert model_flops_per_iteration(m, B, recompute=None) == 6 * B * s * h * (inner + V)
        assert model_flops_per_iteration(m, B, recompute="full") == \
            pytest.approx(8 * B * s * h * (inner + 3 * V / 4), rel=1e-12)
    m = _model({})
    s, h, l, V = m.seq_length, m.hidden_size, m.num_layers, m.vocab_size
    assert model_flops_per_iteration(m, B, recompute=None) == \
        pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)
    # Grouped queries shrink only the key/value projections: 2·B·s·h·2·(a − g)·d
    # per layer and forward, three times over an iteration.
    gqa, mha = _model(GQA), _model({})
    a, g, d = mha.num_attention_heads, gqa.query_groups, mha.head_dim
    saved = 3 * l * 2 * B * s * h * 2 * (a - g) * d
    assert model_flops_per_iteration(mha, B, recompute=None) - \
        model_flops_per_iteration(gqa, B, recompute=None) == saved


# ------------------------------------------------------------------ activations

ACTIVATION_CASES = {
    "rmsnorm": dict(normalization="RMSNorm"),
    "swiglu": dict(swiglu=True),
    "rope": dict(position_embedding_type="rope"),
    "gqa": GQA,
    "llama-gqa": {**LLAMA, **GQA},
    "llama-gqa-dropout": {**LLAMA, **GQA, "hidden_dropout": 0.1, "attention_dropout": 0.1},
}


@pytest.mark.parametrize("options", ACTIVATION_CASES.values(), ids=ACTIVATION_CASES.keys())
def test_activation_bytes_per_layer_match_saved_tensors(options):
    b = 2
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for recompute in (None, "selective", "full"):
            config = dataclasses.replace(_model(options), num_layers=1, seq_length=32,
                                         recompute_granularity=recompute)
            measured = _saved_bytes_of_one_layer(config, b, dtype)
            figures = activation_bytes(Workload(config, b, precision),
                                       Layout(b=b, recompute=recompute), kernels="cpu")
            # The rotary tables are saved by the layer's forward (outside a
            # full-recomputation checkpoint, which saves only the input).
            tables = figures["rotary_tables"] if recompute != "full" else 0
            assert figures["layer"] + tables == measured, (precision, recompute)


def _saved_bytes_of_a_model(model: ModelConfig, b: int, dtype: torch.dtype) -> int:
    """Bytes of distinct storages saved for backward by the whole one-process
    model (embedding, layers, final norm, output layer and loss), parameters
    excluded."""
    gpt = build_chunks(model, ParallelContext.single(), torch.device("cpu"), SEED)[0].to(dtype)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randint(0, model.vocab_size, (b, model.seq_length + 1), generator=generator)
    with SavedTensorBytes(gpt.parameters()) as saved:
        loss = gpt(sample[:, :-1], sample[:, 1:])
    loss.backward()
    return saved.bytes


@pytest.mark.parametrize("options", ["llama-gqa", "untied", "rope"])
def test_activation_bytes_of_a_whole_model(options):
    """Layers, the first stage's extra (no position ids under rope) and the
    last stage's (the final norm's tensors, the output layer's input, the
    loss's), exactly, in one process."""
    b = 2
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = dataclasses.replace(_model(OPTIONS[options]), vocab_size=197)   # padded to 200
        figures = activation_bytes(Workload(model, b, precision), Layout(b=b),
                                   kernels="cpu")
        predicted = (model.num_layers * (figures["layer"] + figures["rotary_tables"])
                     + figures["embedding"] + figures["output"])
        assert _saved_bytes_of_a_model(model, b, dtype) == predicted, precision


def test_memory_follows_the_options():
    """Llama's options against GPT-2's at the same shape: SwiGLU at f ≈ 8h/3,
    grouped queries and no biases cut the weights; the rotary tables are
    held once per layer, not per microbatch in flight."""
    shape = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                 vocab_size=32000, hidden_dropout=0.0, attention_dropout=0.0)
    gpt = ModelConfig(**shape)
    llama = ModelConfig(**shape, **LLAMA, **GQA, ffn_hidden_size=2816)
    layout = Layout(t=2, p=2, d=2, b=2)
    plain = memory_per_rank(Workload(gpt, 16), layout)
    gated = memory_per_rank(Workload(llama, 16), layout)
    assert gated[0]["weights"] < plain[0]["weights"]
    acts = activation_bytes(Workload(llama, 16), layout)
    assert acts["rotary_tables"] == 2 * 1024 * 64 * 2
    in_flight = analytic.peak_in_flight_per_rank(layout, 4)
    layers = 8 // 2
    assert gated[1]["activations"] == (in_flight[1] * (layers * acts["layer"] + acts["output"])
                                       + layers * acts["rotary_tables"])


def test_simulator_follows_the_options():
    """The operator model's GEMMs and parameters, the predicted FLOPs and the
    end-of-iteration reductions under the Llama options."""
    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                        vocab_size=32000, ffn_hidden_size=2816, **LLAMA, group_query_attention=True,
                        num_query_groups=4)
    layout = Layout(t=2, p=2, d=1, b=2)
    a100 = load_profile("a100")
    workload = Workload(model, 8)
    ops = OperatorModel(workload, layout, a100, Machine(layout, a100))
    gemms = ops.layer_gemms()
    assert gemms["qkv"] == (2 * 1024, (16 + 2 * 4) * 64 // 2, 1024, 1)
    assert gemms["mlp_up"] == (2 * 1024, 2 * 2816 // 2, 1024, 1)
    assert gemms["scores"][3] == 2 * 16 // 2                 # every query head
    assert ops.stage_parameters(False, True, 4) == analytic.parameters_per_rank(model, layout)[1]
    untied = simulate(workload, layout, a100)
    assert untied.flops_per_iteration == model_flops_per_iteration(model, 8, recompute=None)
    # d = 1: the only end-of-iteration reduction is the tied embedding's.
    tied = simulate(Workload(dataclasses.replace(model, untie_embeddings_and_output_weights=False),
                             8), layout, a100)
    assert untied.seconds_by_category["data-parallel reduction"] == 0
    assert tied.rank_categories(0)["data-parallel reduction"] > 0


# ------------------------------------------------------------------ ptdp plan

LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--hidden-dropout", "0", "--attention-dropout", "0"]
LLAMA_2_7B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
              "--ffn-hidden-size", "11008", "--vocab-size", "32000", "--seq-length", "4096",
              *LLAMA_FLAGS]
LLAMA_3_8B = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
              "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
              "--vocab-size", "128256", "--seq-length", "8192", "--rotary-base", "500000",
              "--norm-epsilon", "1e-5", *LLAMA_FLAGS]


@pytest.mark.parametrize("flags, published", [(LLAMA_2_7B, 6_738_415_616),
                                              (LLAMA_3_8B, 8_030_261_248)],
                         ids=["llama-2-7b", "llama-3-8b"])
def test_plan_reports_the_published_parameter_counts(capsys, flags, published):
    """Llama 2 7B: 6.74B; Llama 3 8B: 8.03B (Meta's totals; the exact
    figures are the parameters of the released checkpoints)."""
    layout = ["-t", "8", "-p", "1", "--micro-batch-size", "1", "--recompute-granularity",
              "selective", "--use-distributed-optimizer", "--fix-all"]
    argv = ["plan", *flags, "--gpus", "16", "--gpu", "h100", "--global-batch-size", "32",
            "--json", *layout]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] == published
    result = data["results"][0]
    # What plan reports is the analytic model of the ModelConfig its flags give.
    args = build_parser().parse_args(argv)
    config = model_from_args(args)
    assert config.rope and config.swiglu and not config.tied_output and not config.bias
    assert analytic.parameter_count(config) == published
    layout = Layout(t=8, d=2, b=1, recompute="selective", distributed_optimizer=True)
    assert result["parameters_per_device"] == analytic.parameters_per_device(config, layout)
    assert result["parameters_per_device"] < published / 7          # t = 8 splits nearly all
    assert result["flops_per_iteration"] == model_flops_per_iteration(config, 32,
                                                                      recompute="selective")
    workload = Workload(config, 32)
    assert result["memory_per_device_bytes"] == \
        memory_per_device(workload, layout)["total"]


def test_plan_checks_the_options(capsys):
    argv = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--gpus", "8", "--global-batch-size", "32", "--group-query-attention",
            "--num-query-groups", "3"]
    assert main(argv) == 2
    assert "--num-query-groups 3 does not divide --num-attention-heads 16" in \
        capsys.readouterr().err
    # t = 4 does not divide 2 key/value groups: that layout is refused.
    argv[-1] = "2"
    assert main(argv + ["-t", "4"]) == 2
    assert "key/value groups" in capsys.readouterr().err
