"""The analytic performance model (ptdp.perf.analytic.counts) against PAPER.md's
formulas and against measurements of real CPU runs.

Formulas: parameters P, FLOPs F (72 and 96 forms), bubble fractions, the
tensor-parallel traffic 8·b·s·h·(t−1)/t per layer, the 1.7B calibration
point, microbatches in flight (PAPER.md's warm-up counts, the simulator and
the generators' own order).

Measurements: parameters, parameter buffer, gradient buffer and optimizer
state of Trainers of several layouts (t, p, d > 1; bf16 and fp32; plain and
distributed optimizer; buckets small enough to be padded) must equal the
model's figures exactly. Activations: bytes saved for backward are counted
with saved-tensor hooks (as tests/test_recompute.py does): per layer in one
process (two shapes, bf16 and fp32, every recomputation, dropout on and
attention dropout off), and the peak over a whole pipelined iteration of a
Trainer (the live saved storages sampled after every chunk forward),
together with the executor's measured peak of stored microbatches.
Predictions use kernels="cpu" (what these runs execute); the figures agree
exactly on torch 2.13, and the tolerance stated for each comparison is
what the test allows.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from fractions import Fraction

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.model.gpt import GPT
from ptdp.schedules.build import build_schedule
from ptdp.schedules.simulate import simulate
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.analytic.memory import (activation_bytes, korthikanti_activation_bytes_per_layer,
                                       memory_per_device, memory_per_rank)
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.analytic.saved import SavedTensorBytes
from ptdp.train.banner import count_parameters
from ptdp.train.loop import Trainer
from ptdp.perf.analytic.flops import model_flops_per_iteration

ACTIVATION_TOLERANCE = 0.01   # relative; the brief allows 20 %; the model is exact on torch 2.13


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ counting formulas

CALIBRATION = ModelConfig(num_layers=24, hidden_size=2304, num_attention_heads=24, seq_length=2048,
                          vocab_size=51200)


def test_parameter_count_is_the_papers_plus_the_final_layernorm():
    for model in (CALIBRATION, ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4,
                                           seq_length=32, vocab_size=1000)):
        l, h, V, s = model.num_layers, model.hidden_size, model.vocab_size, model.seq_length
        paper = 12 * l * h ** 2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
        assert analytic.paper_parameter_count(model) == pytest.approx(paper, rel=1e-12)
        assert analytic.parameter_count(model) == analytic.paper_parameter_count(model) + 2 * h
    # Calibration point: the "1.7B" GPT of PAPER.md.
    assert 1.6e9 < analytic.paper_parameter_count(CALIBRATION) < 1.7e9
    assert analytic.paper_parameter_count(CALIBRATION) == 1_652_226_048


@pytest.mark.parametrize("extra", [{}, {"ffn_hidden_size": 72, "max_position_embeddings": 40,
                                        "vocab_size": 1001},
                                   {"kv_channels": 12, "qk_layernorm": True, "add_qkv_bias": True,
                                    "disable_bias_linear": True},
                                   # Gemma 3's sandwich norms and geglu, gpt-oss's learnable sinks
                                   {"normalization": "RMSNorm", "sandwich_norm": True,
                                    "geglu": True, "softmax_type": "learnable",
                                    "window_size": "3,0", "attention_dropout": 0.0}],
                         ids=["default", "odd-sizes", "wide-heads-qk-norms-qkv-bias",
                              "sandwich-norms-geglu-sinks"])
def test_parameter_count_matches_a_built_model(extra):
    model = ModelConfig(**{**dict(num_layers=3, hidden_size=32, num_attention_heads=4,
                                  seq_length=16, vocab_size=1000, make_vocab_size_divisible_by=64),
                           **extra})
    gpt = GPT(model, ParallelContext.single(), RNGStreams(torch.device("cpu")))
    assert count_parameters(gpt) == analytic.parameter_count(model)  # logical, unpadded
    held = sum(p.numel() for p in gpt.parameters())                   # padded vocabulary
    assert held == analytic.parameters_per_device(model, Layout())
    padding = (model.padded_vocab_size(1) - model.vocab_size) * model.hidden_size
    assert held == analytic.parameter_count(model) + padding


def test_flops_reproduce_the_72_and_96_forms():
    model, B = CALIBRATION, 512
    l, h, V, s = model.num_layers, model.hidden_size, model.vocab_size, model.seq_length
    work = Workload(model, B)
    f72 = 72 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))
    f96 = 96 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert analytic.flops_per_iteration(work, Layout(d=32, b=16)) == pytest.approx(f72, rel=1e-12)
    assert analytic.flops_per_iteration(work, Layout(d=32, b=16, recompute="full")) == \
        pytest.approx(f96, rel=1e-12)
    selective = analytic.flops_per_iteration(work, Layout(d=32, b=16, recompute="selective"))
    assert selective == model_flops_per_iteration(model, B, recompute="selective")
    assert selective == pytest.approx(f72 + l * 4 * B * s * s * h, rel=1e-12)


# ------------------------------------------------------------------ pipeline

def _paper_in_flight(kind: str, p: int, m: int, v: int, rank: int) -> int:
    """PAPER.md: GPipe stashes all m; 1F1B rank r holds min(p − r, m); the
    interleaved schedule warms up with (p−r−1)·2 + (v−1)·p chunk-forwards and
    then holds one more (all m·v when m = p)."""
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - rank, m)
    if m == p:
        return m * v
    return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)


SCHEDULES = [("gpipe", 1, 3, 1), ("1f1b", 1, 3, 1), ("gpipe", 4, 6, 1), ("1f1b", 4, 2, 1),
             ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2),
             ("interleaved", 4, 8, 2), ("interleaved", 4, 12, 3), ("interleaved", 3, 9, 4)]


@pytest.mark.parametrize("kind,p,m,v", SCHEDULES,
                         ids=[f"{k}-p{p}-m{m}-v{v}" for k, p, m, v in SCHEDULES])
def test_bubble_and_in_flight_agree_with_the_simulator_and_the_paper(kind, p, m, v):
    layout = Layout(p=p, v=v, schedule="gpipe" if kind == "gpipe" else "1f1b")
    assert layout.schedule_kind == kind
    schedule = build_schedule(kind, p, m, v)
    result = simulate(schedule)
    assert analytic.bubble_fraction(layout, m) == pytest.approx((p - 1) / (m * v))
    if kind != "interleaved" or m > p:   # m = p interleaved runs all forwards first
        assert Fraction(analytic.bubble_fraction(layout, m)).limit_denominator(10_000) == \
            result.bubble_fraction
    per_rank = analytic.peak_in_flight_per_rank(layout, m)
    assert per_rank == result.peak_in_flight
    assert per_rank == [_paper_in_flight(kind, p, m, v, r) for r in range(p)]
    assert analytic.peak_in_flight(layout, m) == per_rank[0] == max(per_rank)
    for rank in range(p):
        computes = [("FBW".index(c.op), c.chunk) for c in schedule.computes(rank)]
        ops, chunks = analytic._compute_codes(kind, p, m, v, rank)
        assert list(zip(ops.tolist(), chunks.tolist())) == computes


def test_communication_volume_formulas():
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=1000)
    s, h, b, m, e = 32, 64, 2, 4, 2
    sbh = s * b * h
    for t in (1, 2, 4):
        layout = Layout(t=t, p=2, d=1, b=b)
        work = Workload(model, global_batch=b * m)
        per_layer = analytic.tensor_traffic_per_layer(work, layout)
        assert per_layer == pytest.approx(8 * b * s * h * (t - 1) / t * e)   # PAPER.md, in bytes
        full = analytic.tensor_traffic_per_layer(work,
                                                 dataclasses.replace(layout, recompute="full"))
        assert full == pytest.approx(1.5 * per_layer)
        ranks = analytic.communication_per_rank(work, layout)
        # Pipeline: one activation forward and one gradient backward per
        # microbatch over the single boundary; 1/t of it with scatter/gather.
        for r in ranks:
            assert r["pipeline"] == pytest.approx(m * sbh * e / t)
            assert r["pipeline_all_gather"] == pytest.approx(m * (t - 1) / t * sbh * e)
            assert r["data"] == 0
        off = analytic.communication_per_rank(work,
                                              dataclasses.replace(layout, scatter_gather=False))
        assert off[0]["pipeline"] == m * sbh * e and off[0]["pipeline_all_gather"] == 0
        # Tensor: 4 layers per stage plus the embedding's g (first) or the
        # output layer's f and the cross entropy's 3 fp32 [s, b] all-reduces (last).
        ring = 2 * (t - 1) / t
        assert ranks[0]["tensor"] == pytest.approx(m * (4 * per_layer + ring * sbh * e))
        assert ranks[1]["tensor"] == pytest.approx(m * (4 * per_layer + ring * sbh * e
                                                        + 3 * ring * s * b * 4))
        word = model.padded_vocab_size(t) * h // t
        assert ranks[0]["embedding"] == ranks[1]["embedding"] == word * 4
    # Interleaving: a middle rank sends v times as much; over the pipeline
    # the p·v − 1 boundaries replace p − 1, each crossed twice per microbatch.
    work = Workload(model, global_batch=b * m)
    plain = [r["pipeline"] for r in analytic.communication_per_rank(work, Layout(p=4, b=b))]
    interleaved = [r["pipeline"] for r in
                   analytic.communication_per_rank(work, Layout(p=4, b=b, v=2))]
    assert plain[1:3] == [2 * m * sbh * e] * 2 and interleaved[1:3] == [4 * m * sbh * e] * 2
    assert sum(plain) == 2 * (4 - 1) * m * sbh * e
    assert sum(interleaved) == 2 * (4 * 2 - 1) * m * sbh * e
    # Data parallelism: ring all-reduce of the fp32 gradients, 2·(d−1)/d; the
    # distributed optimizer: reduce-scatter fp32 plus all-gather of bf16 weights.
    n = analytic.buffer_elements(model, Layout(d=4), 0)
    assert n == analytic.parameters_per_device(model, Layout())
    assert analytic.communication_volume(work, Layout(d=4))["data"] == \
        pytest.approx(2 * 3 / 4 * n * 4)
    sharded = Layout(d=4, distributed_optimizer=True)
    n_padded = analytic.buffer_elements(model, sharded, 0)
    assert analytic.communication_volume(Workload(model, 16), sharded)["data"] == \
        pytest.approx(3 / 4 * n_padded * (4 + 2))


# ------------------------------------------------------------------ activations per layer

def _saved_bytes_of_one_layer(model: ModelConfig, b: int, dtype: torch.dtype) -> int:
    """Bytes of distinct storages saved for backward by one transformer
    layer (a pipeline piece without embeddings or output layer),
    parameters excluded."""
    ctx = ParallelContext.single()
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(5, ctx)
    layer = GPT(model, ctx, rng, pre_process=False, post_process=False).initialize(5)
    layer = layer.to(dtype).train()
    hidden = torch.randn(model.seq_length, b, model.hidden_size, dtype=dtype, requires_grad=True)
    with SavedTensorBytes(layer.parameters()) as saved:
        out = layer(hidden)
    out.float().sum().backward()
    return saved.bytes


SHAPES = [dict(hidden_size=128, num_attention_heads=4, seq_length=256, b=2),
          dict(hidden_size=256, num_attention_heads=8, seq_length=128, b=4)]
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("shape", SHAPES, ids=["h128-a4-s256-b2", "h256-a8-s128-b4"])
def test_activation_bytes_per_layer_match_saved_tensors(shape):
    shape = dict(shape)
    b = shape.pop("b")
    figures = {}
    for attention_dropout in (0.1, 0.0):
        model = ModelConfig(num_layers=1, vocab_size=1000, hidden_dropout=0.1,
                            attention_dropout=attention_dropout, **shape)
        for precision, dtype in PRECISIONS.items():
            for recompute in (None, "selective", "full"):
                config = dataclasses.replace(model, recompute_granularity=recompute)
                measured = _saved_bytes_of_one_layer(config, b, dtype)
                predicted = activation_bytes(
                    Workload(config, b, precision), Layout(b=b, recompute=recompute),
                    kernels="cpu")["layer"]
                key = (attention_dropout, precision, recompute)
                figures[key] = (measured, predicted)
                assert predicted == pytest.approx(measured, rel=ACTIVATION_TOLERANCE), \
                    (key, figures)
    # The s² terms are what selective recomputation removes.
    s, h, a = shape["seq_length"], shape["hidden_size"], shape["num_attention_heads"]
    sbh = s * b * h
    none, selective = figures[(0.1, "fp32", None)][0], figures[(0.1, "fp32", "selective")][0]
    assert none - selective == 12 * a * s * s * b            # 3 fp32 s×s tensors per head
    assert figures[(0.1, "fp32", "full")][0] == 4 * sbh      # the layer input only
    assert figures[(0.1, "bf16", "full")][0] == 2 * sbh


# ------------------------------------------------------------------ Trainer runs (8 ranks)

MODEL = ModelConfig(num_layers=8, hidden_size=34, num_attention_heads=2, seq_length=32,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.1,
                    attention_dropout=0.1)
B_MICRO = 2
BUCKET = 700   # several buckets per rank, some of odd size: padded for d > 1


def _config(layout: Layout, precision: str, m: int) -> Config:
    model = MODEL
    if layout.recompute:
        model = dataclasses.replace(model, recompute_granularity=layout.recompute)
    k = MODEL.num_layers // (layout.p * layout.v) if layout.v > 1 else None
    return Config(
        model=model,
        parallel=ParallelConfig(tensor_model_parallel_size=layout.t,
                                pipeline_model_parallel_size=layout.p,
                                data_parallel_size=layout.d,
                                num_layers_per_virtual_pipeline_stage=k,
                                pipeline_schedule=layout.schedule),
        train=TrainConfig(micro_batch_size=layout.b, global_batch_size=m * layout.b * layout.d,
                          train_iters=1, bf16=precision == "bf16", fp16=precision == "fp16",
                          use_distributed_optimizer=layout.distributed_optimizer,
                          ddp_bucket_size=BUCKET, seed=3),
        data=DataConfig(mock_data=True))


class _SavedStorages:
    """Storages saved for backward that are still alive (parameters
    excluded), sampled after every chunk forward; `peak` is the largest sum."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.refs: list[weakref.ref] = []
        self.peak = 0

    def pack(self, tensor):
        if tensor.untyped_storage().data_ptr() not in self.parameters:
            self.refs.append(weakref.ref(tensor))
        return tensor

    def sample(self, *_):
        live, alive = {}, []
        for ref in self.refs:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                live[storage.data_ptr()] = storage.nbytes()
                alive.append(ref)
        self.refs = alive
        self.peak = max(self.peak, sum(live.values()))


def _run_layouts(rank: int, cases: list[tuple[Layout, str, int]], step: bool) -> list:
    """Per case: this rank's pipeline rank and what its Trainer holds; with
    `step`, also one iteration's peak of saved bytes and stored microbatches."""
    results = []
    for layout, precision, m in cases:
        grid = RankGrid(tp=layout.t, dp=layout.d, pp=layout.p)
        ctx = ParallelContext.build(grid)
        if ctx is None:   # outside this layout's grid
            results.append(None)
            continue
        trainer = Trainer(_config(layout, precision, m), ctx, torch.device("cpu"))
        buffer = trainer.buffer
        result = dict(
            pp_rank=ctx.pp_rank, tp_rank=ctx.tp_rank,
            held=sum(p.numel() for p in trainer.model.parameters()),
            logical=count_parameters(trainer.model),
            numel=buffer.numel, weights=buffer.param_data.nbytes,
            gradients=buffer.grad_data.nbytes + (buffer.grad_shard.nbytes
                                                 if buffer.grad_shard is not None else 0),
            optimizer=trainer.optimizer.state_bytes)
        if step:
            saved = _SavedStorages(trainer.model)
            handles = [chunk.register_forward_hook(saved.sample) for chunk in trainer.chunks]
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
                record, _ = trainer.step(0)
            for handle in handles:
                handle.remove()
            result.update(activations=saved.peak, peak_stored=record["peak_stored_activations"])
        results.append(result)
    return results


STATE_CASES = [(Layout(t=2, p=2, d=2, b=B_MICRO, distributed_optimizer=sharded), precision, 2)
               for precision in ("bf16", "fp32") for sharded in (False, True)] + [
    (Layout(t=1, p=1, d=8, b=B_MICRO, distributed_optimizer=True), "bf16", 1),
    (Layout(t=1, p=4, d=2, b=B_MICRO, v=2, distributed_optimizer=True), "fp32", 4),
    (Layout(t=2, p=4, d=1, b=B_MICRO), "bf16", 4),
]


def test_parameters_and_state_bytes_are_exact(pools):
    outcomes = pools(8).run(_run_layouts, STATE_CASES, False)
    padded_somewhere = False
    for index, (layout, precision, m) in enumerate(STATE_CASES):
        work = Workload(MODEL, global_batch=m * layout.b * layout.d, precision=precision)
        memory = memory_per_rank(work, layout, kernels="cpu", bucket_size=BUCKET)
        held = analytic.parameters_per_rank(MODEL, layout)
        logical = {}
        for result in (rank_results[index] for rank_results in outcomes):
            if result is None:
                continue
            r = result["pp_rank"]
            what = f"{layout} {precision} pipeline rank {r}"
            assert result["held"] == held[r], what
            assert result["numel"] == analytic.buffer_elements(MODEL, layout, r, BUCKET), what
            for key in ("weights", "gradients", "optimizer"):
                assert result[key] == memory[r][key], (what, key, result[key], memory[r][key])
            padded_somewhere |= result["numel"] > held[r]
            logical[r] = result["logical"]
        # Stages together hold the model once (logical, the tied copy excluded).
        assert sum(logical.values()) == analytic.parameter_count(MODEL)
        assert analytic.parameters_per_device(MODEL, layout) == max(held)
    assert padded_somewhere  # the distributed optimizer's bucket padding was exercised


ACTIVATION_CASES = [
    (Layout(t=2, p=2, d=2, b=B_MICRO), "bf16", 4),
    (Layout(t=2, p=4, d=1, b=B_MICRO, v=2, recompute="selective"), "fp32", 8),
    (Layout(t=1, p=4, d=2, b=B_MICRO, schedule="gpipe"), "bf16", 3),
    (Layout(t=1, p=8, d=1, b=B_MICRO, recompute="full"), "fp32", 4),
]


def test_pipeline_activation_peak_matches_the_model(pools):
    outcomes = pools(8).run(_run_layouts, ACTIVATION_CASES, True)
    figures = []
    for index, (layout, precision, m) in enumerate(ACTIVATION_CASES):
        work = Workload(MODEL, global_batch=m * layout.b * layout.d, precision=precision)
        predicted = memory_per_rank(work, layout, kernels="cpu", bucket_size=BUCKET)
        in_flight = analytic.peak_in_flight_per_rank(layout, m)
        measured: dict[int, int] = {}
        for result in (rank_results[index] for rank_results in outcomes):
            if result is None:
                continue
            r = result["pp_rank"]
            assert result["peak_stored"] == in_flight[r], (layout, r)
            # The output layer's padding mask is on the last tensor rank only.
            measured[r] = max(measured.get(r, 0), result["activations"])
        # The executor's local variables keep the graph of the last
        # backwarded microbatch (its `out`, and on the last stage its `loss`)
        # until the next forward ends, and through it that microbatch's stage
        # input (a leaf): at most two b·s·h tensors more than the model counts.
        linger = 2 * MODEL.seq_length * layout.b * MODEL.hidden_size * work.bytes_per_element
        for r, value in sorted(measured.items()):
            figures.append((layout, r, value, predicted[r]["activations"]))
            assert 0 <= value - predicted[r]["activations"] <= linger, figures[-1]
        device = memory_per_device(work, layout, kernels="cpu", bucket_size=BUCKET)
        assert device == max(predicted, key=lambda x: x["total"])
        assert device["total"] == sum(v for k, v in device.items() if k != "total")


def test_cuda_estimate_drops_the_s_squared_terms():
    """kernels="cuda" (flash attention, bool masks, fp32 LayerNorm statistics)
    is the Korthikanti figure without its 5·a·s/h term, plus the logsumexp
    and the fp32 LayerNorm statistics."""
    model = CALIBRATION
    b, s, h, a = 1, model.seq_length, model.hidden_size, model.num_attention_heads
    layer = activation_bytes(Workload(model, 8, "bf16"), Layout(b=b))["layer"]
    reference = korthikanti_activation_bytes_per_layer(model, b)
    assert reference == s * b * h * (34 + 5 * a * s / h)
    assert layer == s * b * h * 34 + 4 * a * s * b + 2 * 2 * s * b * 4
    cpu = activation_bytes(Workload(model, 8, "bf16"), Layout(b=b), kernels="cpu")["layer"]
    assert cpu == s * b * h * (42 + 12 * a * s / h) + 4 * 2 * s * b
    with pytest.raises(ValueError, match="kernels"):
        activation_bytes(Workload(model, 8), Layout(), kernels="tpu")
    assert math.isclose(analytic.bubble_fraction(Layout(p=8, v=1), 64), 7 / 64)


# ------------------------------------------------------------------ MLA, MTP, --recompute-modules

# DeepSeek-V3's pieces in small: MLA (a = 4 heads of d_n 6 + d_r 4, d_v 5,
# latents 12 and 8, normed), SwiGLU, RMSNorm, hidden dropout on.
MLA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                  vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.1,
                  attention_dropout=0.0, normalization="RMSNorm", position_embedding_type="rope",
                  swiglu=True, ffn_hidden_size=24, multi_latent_attention=True, q_lora_rank=12,
                  kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5,
                  qk_layernorm=True)
MLA_CASES = {  # the model's settings, the recompute_modules tried under selective
    "mla": ({}, [["core_attn"], ["mla_up_proj"], ["mla_up_proj", "core_attn", "layernorm"],
                 ["mlp", "layernorm"]]),
    # without the query latent and the latent norms; attention dropout
    # (the math kernel's three s×s tensors)
    "mla-direct-query": (dict(q_lora_rank=None, qk_layernorm=False, attention_dropout=0.1),
                         [["mla_up_proj"], ["core_attn", "mlp"]]),
    # keys and values of one width: PyTorch's CPU flash kernel; LayerNorm
    "mla-one-width": (dict(v_head_dim=10, normalization="LayerNorm"), [["mla_up_proj"]]),
}


def _held_bytes_of_one_model(model: ModelConfig, b: int, dtype: torch.dtype) -> int:
    """Bytes of the storages a whole model's forward (embedding, layers,
    output layer, MTP modules) leaves saved for its backward when it
    returns (ptdp.perf.analytic.saved.HeldTensorBytes: the output-discarding
    recomputations free some after saving them)."""
    from ptdp.model.gpt import build_chunks
    from ptdp.perf.analytic.saved import HeldTensorBytes

    chunk = build_chunks(model, ParallelContext.single(), torch.device("cpu"), 5)[0]
    chunk = chunk.to(dtype).train()
    sample = torch.randint(0, model.vocab_size, (b, model.seq_length + 1),
                           generator=torch.Generator().manual_seed(1))
    with HeldTensorBytes(chunk.parameters()) as saved:
        loss = chunk(sample[:, :-1], sample[:, 1:])
    loss.backward()
    return saved.held_bytes


def _model_activations(model: ModelConfig, b: int, precision: str, recompute) -> int:
    """The analytic model's activations of one process holding the whole
    model, one microbatch in flight (memory_per_rank), less the rotary
    tables of the layers whose autograd does not save them (each layer's
    Rotary caches them: memory_per_rank counts them whatever the
    recomputation, the saved tensors only where autograd keeps them)."""
    from ptdp.perf.analytic.memory import tables_saved

    workload = Workload(model, b, precision)
    layout = Layout(b=b, recompute=recompute)
    activations = memory_per_rank(workload, layout, kernels="cpu")[0]["activations"]
    if tables_saved(model, recompute):
        return activations
    tables = activation_bytes(workload, layout, kernels="cpu")["rotary_tables"]
    return activations - (model.num_layers + model.mtp_depth) * tables


@pytest.mark.parametrize("case", MLA_CASES)
def test_mla_and_mtp_activations_equal_the_saved_tensors(case):
    """A model with MLA and D = 1 and 2 MTP modules (each a third
    transformer layer, its norms, projection and a second pass through the
    output layer on the last stage): what its forward leaves saved equals
    memory_per_rank's activations exactly, fp32 and bf16, without, full and
    selective recomputation (each --recompute-modules list of the case)."""
    settings, module_lists = MLA_CASES[case]
    base = dataclasses.replace(MLA, **settings)
    runs = [(None, ["core_attn"]), ("full", ["core_attn"])] + [
        ("selective", modules) for modules in module_lists]
    for depth in (None, 1, 2):
        for recompute, modules in runs:
            model = dataclasses.replace(base, mtp_num_layers=depth, recompute_granularity=recompute,
                                        recompute_modules=modules)
            for precision, dtype in PRECISIONS.items():
                measured = _held_bytes_of_one_model(model, 2, dtype)
                assert _model_activations(model, 2, precision, recompute) == measured, \
                    (case, depth, recompute, modules, precision)


def test_mtp_keeps_a_layer_and_an_output_layer_more_per_module():
    """Measured alone: each MTP module keeps at least a transformer layer's
    and the output layer's logits (4·s·b·V' bytes) more, D = 2 twice D = 1."""
    layer = activation_bytes(Workload(MLA, 2, "fp32"), Layout(b=2), kernels="cpu")["layer"]
    logits = 4 * MLA.seq_length * 2 * MLA.padded_vocab_size(1)
    plain, one, two = (_held_bytes_of_one_model(dataclasses.replace(MLA, mtp_num_layers=depth),
                                                2, torch.float32) for depth in (None, 1, 2))
    assert one - plain > layer + logits
    assert two - plain == 2 * (one - plain)


def test_mla_products_priced_are_the_model_flops():
    """The products the operator model prices for an MLA layer (down and
    up projections, scores over d_qk, context over d_v, output projection,
    the MLP) are, at t = 1, the model FLOP count's forward of one layer
    (whose attention terms tests/test_mla.py holds against the built
    module), with and without the query latent; at t = 2 the split ones
    halve and the replicated down projections stay whole."""
    from ptdp.perf.price.machine import Machine
    from ptdp.perf.price.pricing import OperatorModel
    from ptdp.perf.price.profiles import load_profile

    profile = load_profile("h100")
    for q_lora_rank in (12, None):
        model = dataclasses.replace(MLA, num_layers=1, q_lora_rank=q_lora_rank, vocab_size=104)
        b, s = 2, model.seq_length
        output_layer = 2 * b * s * model.hidden_size * model.vocab_size
        per_layer = (model_flops_per_iteration(model, b, recompute=None) - 3 * output_layer) / 3

        def gemms(t):
            layout = Layout(t=t, b=b)
            return OperatorModel(Workload(model, b), layout, profile,
                                 Machine(layout, profile)).layer_gemms()

        one = gemms(1)
        assert sum(2 * m * n * k * batch for m, n, k, batch in one.values()) == per_layer
        two = gemms(2)
        for name, (m, n, k, batch) in two.items():
            replicated = name in ("q_down", "kv_down")
            assert 2 * m * n * k * batch == (1 if replicated else 0.5) * (
                2 * one[name][0] * one[name][1] * one[name][2] * one[name][3]), name


def test_recompute_modules_and_mtp_are_priced():
    """Selective recomputation prices what its modules run again (each
    module more, none beyond the layer's forward); MTP adds to the last
    stage at least a layer's and the output layer's forward per module."""
    from ptdp.perf.price.machine import Machine
    from ptdp.perf.price.pricing import OperatorModel
    from ptdp.perf.price.profiles import load_profile
    from ptdp.perf.price.stage_costs import stage_costs

    profile = load_profile("h100")
    big = dataclasses.replace(MLA, hidden_size=1024, num_attention_heads=8, seq_length=1024,
                              ffn_hidden_size=4096, kv_lora_rank=128, q_lora_rank=256,
                              qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64)
    layout = Layout(t=1, b=1)

    def ops(model):
        return OperatorModel(Workload(model, 8), layout, profile, Machine(layout, profile))

    def recompute(modules):
        model = dataclasses.replace(big, recompute_modules=modules)
        return ops(model).layer_recompute("selective").total_work

    core, up, every = (recompute(["core_attn"]), recompute(["core_attn", "mla_up_proj"]),
                       recompute(["core_attn", "mla_up_proj", "layernorm", "mlp"]))
    assert 0 < core < up < every < ops(big).layer_forward().total_work
    assert recompute(["mlp"]) > recompute(["layernorm"]) > 0
    plain = stage_costs(ops(big), None, False, True, True, 2)
    model = dataclasses.replace(big, mtp_num_layers=2)
    with_mtp = stage_costs(ops(model), None, False, True, True, 2)
    added = with_mtp.forward.total_work - plain.forward.total_work
    priced = ops(big)
    assert added > 2 * (priced.layer_forward().total_work + priced.head_forward().total_work)
