"""Activation memory under context parallelism (issue 28): the bytes one
transformer layer and a whole model save for backward on each rank of a
context group of c ∈ {1, 2, 4}, measured with saved-tensor hooks
(ptdp.perf.analytic.saved.SavedTensorBytes, as tests/test_sequence_parallel_perf.py
measures tensor ranks), against the analytic model (ptdp.perf.analytic.memory)
exactly: each --cp-comm-type (p2p, all_gather, a2a), a grouped-query
rotary Llama-style model and a learned-position GPT, without, selective and
full recomputation, fp32 and bf16, and t = 2 with sequence parallelism at
c = 2. And what a layer saves outside attention's exchange falls by c.

One pool call of 4 processes measures every case on several grids in turn:
c = 1 (d = 4), c = 2 (two context groups of 2), c = 4, and t = 2 at c = 1
and c = 2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config import ModelConfig
from ptdp.model.gpt import GPT, Attention, build_chunks
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.layout import Layout, Workload
from ptdp.perf.analytic.memory import activation_bytes, layer_activation_bytes
from ptdp.perf.analytic.saved import HeldTensorBytes

SEED = 7
B = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMMS = ("p2p", "all_gather", "a2a")
# Attention dropout is refused with c > 1; hidden dropout is on (its masks
# are part of what falls by c).
GPT2 = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, seq_length=32,
                   vocab_size=197, make_vocab_size_divisible_by=8, hidden_dropout=0.1,
                   attention_dropout=0.0)
LLAMA = dataclasses.replace(GPT2, normalization="RMSNorm", swiglu=True,
                            position_embedding_type="rope", group_query_attention=True,
                            num_query_groups=4, untie_embeddings_and_output_weights=True,
                            disable_bias_linear=True)
MODELS = {"gpt": GPT2, "llama": LLAMA}
# Multi-latent attention (DeepSeek-V3's in small: latents 12 and 8, normed,
# heads of 6 + 4 and 5), measured at t = 2 with sequence parallelism (c = 1;
# one process: tests/test_analytic.py); "mla-up" recomputes its up
# projections and norms (--recompute-modules, selective only). The whole
# model has an MTP module.
MLA = dataclasses.replace(LLAMA, group_query_attention=False, num_query_groups=None,
                          multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8,
                          qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True)
MLA_MODELS = {"mla": MLA, "mla-up": dataclasses.replace(
    MLA, recompute_modules=["mla_up_proj", "layernorm", "core_attn"])}
# (t, d, c) of each grid over the pool's 4 ranks.
GRIDS = [(1, 4, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1), (2, 1, 2)]


def _grid_cases(t: int, c: int):
    """(model, recompute, precision, sequence parallel, comm) of a grid."""
    comms = COMMS if c > 1 else ("p2p",)
    cases = [(name, recompute, precision, t > 1, comm)
             for name in MODELS for recompute in (None, "selective", "full")
             for precision in DTYPES
             for comm in (comms if recompute != "full" else ("p2p",))]   # full: the input only
    if c == 1 and t > 1:   # (one process: tests/test_analytic.py)
        cases += [(name, recompute, precision, t > 1, "p2p") for name in MLA_MODELS
                  for recompute in ((None, "selective", "full") if name == "mla" else
                                    ("selective",)) for precision in DTYPES]
    return cases


LAYER_CASES = [((t, d, c), case) for t, d, c in GRIDS for case in _grid_cases(t, c)]
MODEL_CASES = [((t, d, c), (name, precision, t > 1, comm))
               for t, d, c in GRIDS for name in MODELS for precision in DTYPES
               for comm in (COMMS if c > 1 else ("p2p",))]
MLA_MODEL_CASES = [((2, 2, 1), (name, recompute, precision, True)) for precision in DTYPES
                   for name, recompute in (("mla", None), ("mla-up", "selective"))]


def _config(name: str, recompute: str | None = None, layers: int = 1) -> ModelConfig:
    return dataclasses.replace({**MODELS, **MLA_MODELS}[name], recompute_granularity=recompute,
                               num_layers=layers)


def _one_layer(config, ctx, sp, comm, dtype):
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(SEED, ctx)
    layer = GPT(config, ctx, rng, pre_process=False, post_process=False, sequence_parallel=sp,
                cp_comm_type=comm)
    layer = layer.initialize(SEED).to(dtype).train()
    rows = config.seq_length // ctx.cp_size // (ctx.tp_size if sp else 1)
    hidden = torch.randn(rows, B, config.hidden_size, generator=torch.Generator().manual_seed(1))
    return layer, hidden.to(dtype).requires_grad_()


class _SplitAtTheCore(HeldTensorBytes):
    """HeldTensorBytes that also sums the storages first saved inside the
    attention core (Attention._core: one rank's kernel, or context_attention
    with its exchange), and with `debug` lists every new storage's shape,
    dtype, bytes and producer, to find what a disagreeing case saves."""

    def __init__(self, parameters, debug: bool = False):
        super().__init__(parameters)
        self.inside, self.core, self.debug, self.log = False, set(), debug, []

    def _pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in self._excluded and key not in self._storages:
            if self.inside:
                self.core.add(key)
            if self.debug:
                self.log.append((tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                                 tensor.untyped_storage().nbytes(), self.inside,
                                 tensor.grad_fn.name() if tensor.grad_fn else None))
        return super()._pack(tensor)

    def __enter__(self):
        original = self._original = Attention._core
        split = self

        def core(attention, q, k, v, documents=None):
            split.inside = True
            try:
                return original(attention, q, k, v, documents)
            finally:
                split.inside = False

        Attention._core = core
        return super().__enter__()

    def __exit__(self, *exc_info):
        Attention._core = self._original
        super().__exit__(*exc_info)

    @property
    def core_bytes(self) -> int:
        return sum(self._storages[key] for key in self.core)


def _measure(rank: int, layer_cases: list, model_cases: list, debug: bool = False) -> dict:
    """On one rank, for each (grid, config, precision, sp, comm): the bytes
    one layer saves and those saved inside its attention core, and the bytes
    a whole model saves. `debug=True` also returns, per layer case, the
    (shape, dtype, bytes, inside the core, producer) of each saved storage:
    `pools(4).run(_measure, cases, [], True)[0]["log"]`."""
    torch.set_num_threads(1)
    results = {"layer": [], "core": [], "model": [], "log": []}
    contexts = {}
    for (t, d, c), *_ in layer_cases + model_cases:
        if (t, d, c) not in contexts:
            contexts[(t, d, c)] = ParallelContext.build(RankGrid(tp=t, dp=d, pp=1, cp=c))
    for grid, config, precision, sp, comm in layer_cases:
        layer, hidden = _one_layer(config, contexts[grid], sp, comm, DTYPES[precision])
        with _SplitAtTheCore(layer.parameters(), debug) as saved:
            out = layer(hidden)
        out.float().sum().backward()
        # (MLA's output-discarding recomputation frees storages it saved:
        # what is held when the forward returns)
        results["layer"].append(saved.held_bytes if config.multi_latent_attention
                                else saved.bytes)
        results["core"].append(saved.core_bytes)
        results["log"].append(saved.log)
    for grid, config, precision, sp, comm in model_cases:
        ctx = contexts[grid]
        model = build_chunks(config, ctx, torch.device("cpu"), SEED, sequence_parallel=sp,
                             cp_comm_type=comm)[0].to(DTYPES[precision]).train()
        sample = torch.randint(0, config.vocab_size, (B, config.seq_length + 1),
                               generator=torch.Generator().manual_seed(1))
        with HeldTensorBytes(model.parameters()) as saved:
            loss = model(sample[:, :-1], sample[:, 1:])
        loss.backward()
        results["model"].append(saved.held_bytes if config.multi_latent_attention
                                else saved.bytes)
    return results


def _layout(grid, recompute, sp, comm) -> Layout:
    t, _, c = grid
    return Layout(t=t, c=c, cp_comm=comm, b=B, recompute=recompute, sequence_parallel=sp)


def _predicted_layer(grid, name, recompute, precision, sp, comm) -> int:
    t, _, c = grid
    return layer_activation_bytes(_config(name, recompute), B, t, sequence_parallel=sp,
                                  recompute=recompute, dtype=DTYPES[precision], kernels="cpu",
                                  c=c, cp_comm=comm)


def _predicted_model(grid, name, precision, sp, comm) -> int:
    """Layers (and their rotary tables), the first stage's extra and the
    last stage's, on the most loaded rank (a tensor rank holding vocabulary
    padding)."""
    config = _config(name, layers=2)
    figures = activation_bytes(Workload(config, B, precision), _layout(grid, None, sp, comm),
                               kernels="cpu")
    return (config.num_layers * (figures["layer"] + figures["rotary_tables"])
            + figures["embedding"] + figures["output"])


def _mla_model(name: str, recompute: str | None) -> ModelConfig:
    return dataclasses.replace(_config(name, recompute, layers=2), mtp_num_layers=1)


def _predicted_mla_model(grid, name, recompute, precision, sp) -> int:
    """memory_per_rank's activations of one stage holding the whole MLA
    model and its MTP module (one microbatch), less the rotary tables the
    layers cache but do not save under full recomputation or mla_up_proj."""
    from ptdp.perf.analytic.memory import memory_per_rank, tables_saved

    t, _, c = grid
    config = _mla_model(name, recompute)
    workload, layout = Workload(config, B, precision), _layout(grid, recompute, sp, "p2p")
    activations = max(memory["activations"]
                      for memory in memory_per_rank(workload, layout, kernels="cpu"))
    if tables_saved(config, recompute):
        return activations
    tables = activation_bytes(workload, layout, kernels="cpu")["rotary_tables"]
    return activations - (config.num_layers + config.mtp_depth) * tables


@pytest.fixture(scope="module")
def measured(pools):
    """Every rank's measurements, in one call of the 4-process pool."""
    layer_cases = [(grid, _config(name, recompute), precision, sp, comm)
                   for grid, (name, recompute, precision, sp, comm) in LAYER_CASES]
    model_cases = [(grid, _config(name, layers=2), precision, sp, comm)
                   for grid, (name, precision, sp, comm) in MODEL_CASES]
    model_cases += [(grid, _mla_model(name, recompute), precision, sp, "p2p")
                    for grid, (name, recompute, precision, sp) in MLA_MODEL_CASES]
    return pools(4).run(_measure, layer_cases, model_cases)


def test_layer_activation_bytes_equal_the_saved_tensors(measured):
    for i, (grid, case) in enumerate(LAYER_CASES):
        saved = {rank["layer"][i] for rank in measured}
        assert len(saved) == 1, (grid, case, saved)        # every rank alike
        assert saved.pop() == _predicted_layer(grid, *case), (grid, case)


def test_model_activation_bytes_equal_the_saved_tensors(measured):
    """Whole-sequence tokens and labels in; each rank keeps its chunks."""
    for i, (grid, case) in enumerate(MODEL_CASES):
        assert max(rank["model"][i] for rank in measured) == _predicted_model(grid, *case), \
            (grid, case)


def test_mla_and_mtp_model_activation_bytes_equal_the_saved_tensors(measured):
    """A two-layer MLA model with one MTP module at t = 2 with sequence
    parallelism: what each rank holds when the forward returns is
    memory_per_rank's figure (its most loaded rank)."""
    for i, (grid, case) in enumerate(MLA_MODEL_CASES, start=len(MODEL_CASES)):
        assert max(rank["model"][i] for rank in measured) == _predicted_mla_model(grid, *case), \
            (grid, case)


def test_replicated_part_falls_by_c(measured):
    """Measured only: what a layer saves at c is 1/c of what it saves at
    c = 1 (same t, sequence parallelism as there), but for its attention
    core's own tensors (q, k, v as kept, output, log-sum-exp, what the
    exchange keeps) and, under a2a, the dense layer's copy of its head-split
    output, a·d·(s/c)·b/t·e (p2p's, all_gather's and one rank's outputs are
    laid out as the dense input itself). With recomputation nothing of the
    core is kept: exactly 1/c."""
    rank = measured[0]
    layer = {key: (rank["layer"][i], rank["core"][i]) for i, key in enumerate(LAYER_CASES)}
    checked = 0
    for (t, d, c), case in LAYER_CASES:
        if c == 1:   # (the MLA cases are all at c = 1)
            continue
        name, recompute, precision, sp, comm = case
        whole, whole_core = layer[((t, 4 // t, 1), (name, recompute, precision, sp, "p2p"))]
        saved, core = layer[((t, d, c), case)]
        if recompute is not None:
            assert core == whole_core == 0 and saved * c == whole, ((t, c), case)
            continue
        config = MODELS[name]
        # a2a's output is head-split: the dense layer's input is a copy of it
        copy = (config.num_attention_heads * config.head_dim * config.seq_length // c * B // t
                * DTYPES[precision].itemsize) if comm == "a2a" else 0
        assert 0 < whole_core and 0 < core
        assert (saved - core - copy) * c == whole - whole_core, ((t, c), case)
        checked += 1
    assert checked == 2 * 2 * 3 * 3      # models, precisions, comm types, grids with c > 1
