"""Gemma 3's and gpt-oss's pieces around attention (issue 43, item 4), each
against transformers' own module given the same weights: the output and
every gradient.

Gemma 3: --scale-embeddings (Gemma3TextScaledWordEmbedding, the factor in
the embedding's dtype), --apply-layernorm-1p with RMSNorm (Gemma3RMSNorm),
and one whole Gemma3DecoderLayer: --sandwich-norm, --geglu, --softmax-scale
(query_pre_attn_scalar), heads 256 wide (--kv-channels), q/k norms.
gpt-oss: biases on q, k, v and o with heads wider than h/a
(GptOssAttention, its sinks made negligible: sinks are not this file's), and
the MoE block (GptOssMLP): the router's bias, the experts' biases and
--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7 (gpt-oss's
interleaved gate/up columns mapped to ptdp's [gate | up] rows), by one
product per expert and by the grouped product. Rotary embeddings are not
this file's either: ptdp's models here have none and transformers' get the
identity rotation (cos 1, sin 0). Under tensor parallelism with sequence
parallelism (t = 2) every piece computes what one process computes: one
pooled call. Bad combinations: one paragraph each, before launch.
"""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from ptdp.checkpoint.args import CHECKPOINT_ARCHITECTURE
from ptdp.cli import build_parser
from ptdp.commands.train import config_from_args
from ptdp.config import ConfigError, ModelConfig, validate
from ptdp.config.megatron import given
from ptdp.model.fused import gated_unit
from ptdp.model.gpt import GPT, Embedding, TransformerLayer, layer_norm
from ptdp.model.moe import MoELayer
from ptdp.model.shapes import logical_shapes
from ptdp.parallel.sharding import EXPERT_ATTR, PARTIAL_GRAD_ATTR, SHARD_ATTR, gather_logical, logical_shape
from ptdp.parallel.tensor import RNGStreams, sum_partial_grads
from ptdp.parallel.topology import ParallelContext, RankGrid

SEED = 5
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
# Gemma 3's layer, small: heads 256 wide (not h/a = 16), one key/value group,
# a query_pre_attn_scalar other than the head width so the scale matters.
GEMMA = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=6,
                    vocab_size=50, make_vocab_size_divisible_by=8, ffn_hidden_size=40,
                    normalization="RMSNorm", norm_epsilon=1e-6, apply_layernorm_1p=True,
                    geglu=True, sandwich_norm=True, scale_embeddings=True, qk_layernorm=True,
                    kv_channels=256, softmax_scale=48 ** -0.5, group_query_attention=True,
                    num_query_groups=1, disable_bias_linear=True, **NO_DROPOUT)
# gpt-oss's attention (biases everywhere, heads wider than h/a) and MoE block.
GPT_OSS = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=6,
                      vocab_size=50, make_vocab_size_divisible_by=8, normalization="RMSNorm",
                      kv_channels=16, group_query_attention=True, num_query_groups=2,
                      num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, quick_geglu=True,
                      glu_linear_offset=1.0, activation_func_clamp_value=7.0, **NO_DROPOUT)


def _single():
    ctx = ParallelContext.single()
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(SEED, ctx)
    return ctx, rng


def _randomize(module, std=0.3):
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def _load(ours, mapping, theirs):
    """Our parameters from transformers' through `mapping` (our name ->
    a function of a getter of theirs), every one of ours mapped."""
    params = dict(theirs.named_parameters())
    assert set(mapping) == {name for name, _ in ours.named_parameters()}
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(mapping[name](lambda n: params[n]))


def _assert_grads(ours, mapping, theirs, **tol):
    grads = {name: param.grad for name, param in theirs.named_parameters()}
    for name, param in ours.named_parameters():
        assert_close(param.grad, mapping[name](lambda n: grads[n]), **tol,
                     msg=lambda m, name=name: f"{name}: {m}")


def _causal_mask(s, dtype=torch.float32):
    return torch.full((s, s), torch.finfo(dtype).min).triu(1)[None, None]


def _same(name):
    return lambda get: get(name)


def _rows(*names):
    return lambda get: torch.cat([get(n) for n in names])


# ------------------------------------------------------------------ Gemma 3

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_embeddings_are_gemmas(dtype):
    """√h in the embedding's dtype (√32 rounds to 5.65625 in bf16), exactly."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    ctx, rng = _single()
    ours = Embedding(GEMMA, ctx, rng).to(dtype)
    theirs = Gemma3TextScaledWordEmbedding(GEMMA.vocab_size, 32, 0, embed_scale=32 ** 0.5).to(dtype)
    _randomize(theirs, 1.0)
    with torch.no_grad():
        ours.word_embeddings.weight[:GEMMA.vocab_size].copy_(theirs.weight)
        ours.position_embeddings.weight.zero_()  # Gemma's positions are rotary (not here)
    tokens = torch.randint(0, GEMMA.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    out = ours(tokens).transpose(0, 1)
    expected = theirs(tokens)
    assert out.dtype == dtype and torch.equal(out, expected)
    grad = torch.randn(expected.shape).to(dtype)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(ours.word_embeddings.weight.grad[:GEMMA.vocab_size], theirs.weight.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_1p_is_gemmas_rmsnorm(dtype):
    """--apply-layernorm-1p with RMSNorm is Gemma3RMSNorm: x normalized in
    fp32, times 1 + w in fp32, rounded once."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    ours = layer_norm(GEMMA).to(dtype)
    theirs = Gemma3RMSNorm(32, eps=1e-6).to(dtype)
    _randomize(theirs)
    ours.load_state_dict(theirs.state_dict())
    x = (torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = ours(x1), theirs(x2)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    assert out.dtype == dtype
    assert_close(out, expected, **tol)
    grad = torch.randn(x.shape).to(dtype)
    out.backward(grad)
    expected.backward(grad)
    assert_close(x1.grad, x2.grad, **tol)
    assert_close(ours.weight.grad, theirs.weight.grad, **tol)


def _gemma_layer():
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    config = Gemma3TextConfig(hidden_size=32, intermediate_size=40, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=48,
                              num_hidden_layers=1, layer_types=["full_attention"],
                              rms_norm_eps=1e-6, vocab_size=50)
    config._attn_implementation = "eager"
    return Gemma3DecoderLayer(config, 0)


GEMMA_NAMES = {
    "input_layernorm.weight": _same("input_layernorm.weight"),
    "attention.query_key_value.weight": _rows("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight"),
    "attention.q_layernorm.weight": _same("self_attn.q_norm.weight"),
    "attention.k_layernorm.weight": _same("self_attn.k_norm.weight"),
    "attention.dense.weight": _same("self_attn.o_proj.weight"),
    # Gemma's post-norms are ptdp's output norms; ptdp's post_attention_layernorm
    # is the norm before the MLP (Gemma's pre_feedforward_layernorm).
    "attention_output_layernorm.weight": _same("post_attention_layernorm.weight"),
    "post_attention_layernorm.weight": _same("pre_feedforward_layernorm.weight"),
    "mlp.dense_h_to_4h.weight": _rows("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.dense_4h_to_h.weight": _same("mlp.down_proj.weight"),
    "mlp_output_layernorm.weight": _same("post_feedforward_layernorm.weight"),
}


def test_a_layer_of_gemma_pieces_is_gemmas_decoder_layer():
    """Sandwich norms in Gemma's order, GeGLU, the query pre-attention
    scalar's softmax scale, 256-wide heads and 1 + w norms: the layer's
    output and every weight's and the input's gradient."""
    ctx, rng = _single()
    ours = TransformerLayer(GEMMA, ctx, rng)
    theirs = _gemma_layer()
    _randomize(theirs)
    _load(ours, GEMMA_NAMES, theirs)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    identity = (torch.ones(2, 6, 256), torch.zeros(2, 6, 256))
    expected = theirs(x2, position_embeddings=identity, attention_mask=_causal_mask(6))
    out = ours(x1.transpose(0, 1)).transpose(0, 1)
    assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(4))
    out.backward(grad)
    expected.backward(grad)
    assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    _assert_grads(ours, GEMMA_NAMES, theirs, rtol=1e-4, atol=1e-5)
    # Without the pieces it is another layer: each is really applied.
    for off in ({"sandwich_norm": False}, {"softmax_scale": None}, {"geglu": False,
                                                                     "swiglu": True}):
        other = TransformerLayer(dataclasses.replace(GEMMA, **off), ctx, rng)
        other.load_state_dict(ours.state_dict(), strict=False)
        assert not torch.allclose(other(x.transpose(0, 1)).transpose(0, 1), expected, atol=1e-3)


# ------------------------------------------------------------------ gpt-oss

def test_biases_on_every_attention_linear_are_gpt_osss():
    """Without --disable-bias-linear ptdp's attention has biases on q, k, v
    and o, as gpt-oss's; with heads 16 wide (h/a = 8) and 2 key/value groups."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    config = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_hidden_layers=1, layer_types=["full_attention"],
                          vocab_size=50)
    config._attn_implementation = "eager"
    theirs = GptOssAttention(config, 0)
    _randomize(theirs)
    with torch.no_grad():
        theirs.sinks.fill_(-1e9)  # no sink: sinks are tested with the attention kernels
    ctx, rng = _single()
    ours = GPT(GPT_OSS, ctx, rng).layers["0"].attention
    names = {"query_key_value." + kind: _rows(*(f"{p}_proj.{kind}" for p in "qkv"))
             for kind in ("weight", "bias")}
    names |= {"dense." + kind: _same("o_proj." + kind) for kind in ("weight", "bias")}
    _load(ours, names, theirs)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    identity = (torch.ones(2, 6, 8), torch.zeros(2, 6, 8))
    expected, _ = theirs(x2, position_embeddings=identity, attention_mask=_causal_mask(6))
    out, bias = ours(x1.transpose(0, 1))
    out = (out if bias is None else out + bias).transpose(0, 1)  # (the bias may be added already)
    assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(4))
    out.backward(grad)
    expected.backward(grad)
    assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    _assert_grads(ours, names, theirs, rtol=1e-4, atol=1e-5)


def _expert_names(e):
    """gpt-oss's fused [h, 2f] gate_up columns interleave gate and up
    ([..., ::2] and [..., 1::2]); ptdp's first matrix is [gate | up] rows."""
    return {
        f"experts.{e}.dense_h_to_4h.weight": lambda get: torch.cat(
            [get("experts.gate_up_proj")[e][:, ::2].t(), get("experts.gate_up_proj")[e][:, 1::2].t()]),
        f"experts.{e}.dense_h_to_4h.bias": lambda get: torch.cat(
            [get("experts.gate_up_proj_bias")[e][::2], get("experts.gate_up_proj_bias")[e][1::2]]),
        f"experts.{e}.dense_4h_to_h.weight": lambda get: get("experts.down_proj")[e].t(),
        f"experts.{e}.dense_4h_to_h.bias": lambda get: get("experts.down_proj_bias")[e],
    }


@pytest.mark.parametrize("grouped", [False, True])
def test_gpt_oss_experts_with_biases_and_the_clamped_gate_are_gpt_osss(grouped):
    """The router with its bias, experts with biases, quick-GeGLU with the
    offset 1 and the clamp 7 (which the inputs reach on both sides)."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                          num_experts_per_tok=2, num_hidden_layers=1, vocab_size=50)
    theirs = GptOssMLP(config)
    _randomize(theirs)
    ctx, rng = _single()
    ours = MoELayer(dataclasses.replace(GPT_OSS, moe_grouped_gemm=grouped), ctx, rng)
    names = {"router.weight": _same("router.weight"), "router.bias": _same("router.bias")}
    for e in range(4):
        names |= _expert_names(e)
    _load(ours, names, theirs)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3)) * 5
    gate_up = x @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]
    assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, _ = theirs(x2)
    out, _ = ours(x1.transpose(0, 1))
    out = out.transpose(0, 1)
    assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(4))
    out.backward(grad)
    expected.backward(grad)
    assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    _assert_grads(ours, names, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu", "quick_gelu"])
def test_the_gated_unit_node_matches_autograd(activation):
    """The node that saves only [gate | up] gives autograd's gradient, with
    the clamp reached on both sides and an offset."""
    y = (torch.randn(5, 16, generator=torch.Generator().manual_seed(6)) * 6).requires_grad_()
    reference = y.detach().clone().requires_grad_()
    gate, up = reference.chunk(2, dim=-1)
    gate, up = gate.clamp(max=4.0), up.clamp(-4.0, 4.0) + 0.5
    act = {"silu": torch.nn.functional.silu,
           "gelu": lambda g: torch.nn.functional.gelu(g, approximate="tanh"),
           "quick_gelu": lambda g: g * torch.sigmoid(1.702 * g)}[activation]
    expected = act(gate) * up
    out = gated_unit(y, activation, 0.5, 4.0)
    assert_close(out, expected, rtol=0, atol=0)
    grad = torch.randn(out.shape)
    out.backward(grad)
    expected.backward(grad)
    assert_close(y.grad, reference.grad, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ every piece at t = 2

def _pieces_under_tensor_parallelism(rank, configs):
    """Each config's GPT at t = 2 with sequence parallelism (experts at
    ETP = 1: biases) against one process: the loss and every gradient."""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=1, etp=1))
    for config in configs:
        rng = RNGStreams(torch.device("cpu"))
        rng.seed(SEED, ctx)
        parallel = GPT(config, ctx, rng, sequence_parallel=True).initialize(SEED)
        serial_ctx, serial_rng = _single()
        serial = GPT(config, serial_ctx, serial_rng).initialize(SEED)
        tokens = torch.randint(0, config.vocab_size, (3, config.seq_length + 1),
                               generator=torch.Generator().manual_seed(11))
        losses = [model(tokens[:, :-1], tokens[:, 1:]) for model in (serial, parallel)]
        for loss in losses:
            loss.backward()
        assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
        sum_partial_grads([p.grad for p in parallel.parameters()
                           if getattr(p, PARTIAL_GRAD_ATTR, False)], ctx.tp_group)
        reference = dict(serial.named_parameters())
        for name, param in parallel.named_parameters():
            spec, theirs = getattr(param, SHARD_ATTR, None), reference[name]
            if getattr(param, EXPERT_ATTR, False):  # whole experts on both ranks, other tokens
                torch.distributed.all_reduce(param.grad, group=ctx.expert_data_group)
                spec = None
            assert logical_shape(param) == logical_shape(theirs), name
            assert_close(gather_logical(param.grad, spec, ctx.tp_group),
                         gather_logical(theirs.grad, getattr(theirs, SHARD_ATTR, None), None),
                         rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_every_piece_under_tensor_and_sequence_parallelism_equals_one_process(pools):
    gemma = dataclasses.replace(GEMMA, num_layers=2, kv_channels=64, seq_length=8,
                                softmax_scale=0.2, num_query_groups=2)
    gpt_oss = dataclasses.replace(GPT_OSS, num_layers=2, seq_length=8, sandwich_norm=True,
                                  moe_layer_freq=[0, 1], init_method_std=0.3)
    pools(2).run(_pieces_under_tensor_parallelism, [gemma, gpt_oss])


# ------------------------------------------------------------------ settings

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "64", "--seq-length", "16", "--train-iters", "1"]
GPT_OSS_FLAGS = ["--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7"]


def _config(*flags):
    return config_from_args(build_parser().parse_args(["train", *TINY, *flags]))


def test_megatron_lms_activation_flags_are_settings_recorded_in_checkpoints():
    args = build_parser().parse_args(["train", *TINY, *GPT_OSS_FLAGS])
    assert given(args) == []  # no longer in the accepted/refused tables
    config = _config(*GPT_OSS_FLAGS, "--softmax-scale", "0.0625", "--scale-embeddings",
                     "--sandwich-norm")
    validate(config)
    model = config.model
    assert model.gated_linear_unit and model.gated_activation == "quick_gelu"
    views = {fields[0]: view for fields, view in CHECKPOINT_ARCHITECTURE}
    assert [views[name](model) for name in (
        "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "softmax_scale",
        "scale_embeddings", "sandwich_norm", "geglu")] == [True, 1.0, 7.0, 0.0625, True, True,
                                                            False]
    assert views["glu_linear_offset"](ModelConfig()) is None  # no gated MLP: does not apply
    shapes = logical_shapes(model)
    assert shapes["layers.1.attention_output_layernorm.weight"] == (32,)
    assert shapes["layers.1.mlp_output_layernorm.bias"] == (32,)
    assert shapes["layers.0.mlp.dense_h_to_4h.weight"] == (2 * 128, 32)  # gated, 4·h wide


@pytest.mark.parametrize("flags, says", [
    (["--swiglu", "--geglu"], "--swiglu and --geglu each choose the gated MLP's activation"),
    (["--glu-linear-offset", "1"], "--glu-linear-offset 1 acts on a gated MLP's gate"),
    (["--activation-func-clamp-value", "7"], "add --quick-geglu (gpt-oss), --swiglu or --geglu"),
    (["--geglu", "--activation-func-clamp-value", "0"], "must be > 0"),
    (["--softmax-scale", "-1"], "--softmax-scale=-1 must be > 0"),
])
def test_bad_combinations_are_one_paragraph_each(flags, says):
    with pytest.raises(ConfigError) as raised:
        validate(_config(*flags))
    assert len(raised.value.problems) == 1 and says in raised.value.problems[0]
