"""Multi-latent attention (issue 44; ptdp.model.mla, ptdp.config.mla).

- Against transformers' DeepseekV3Attention given the same weights (one
  process, fp32, 1e-5): with and without --q-lora-rank, rope and YaRN
  (mscale and mscale_all_dim equal, as DeepSeek-V3, and apart), DeepSeek's
  interleaved rotary layout (rope_interleave True, no permutation) and the
  "rotate half" one (rope_interleave False, through the row permutation
  the module's docstring gives).
- A small MLA GPT trains as one process does in one pooled call of four
  ranks: t = 2 with sequence parallelism and p = 2 under ZB-V (deferred
  weight gradients) with selective recomputation; p = 2 interleaved with
  full recomputation and d = 2 with the distributed optimizer; c = 2 under
  a2a (with t = 2), all_gather and p2p (with packed documents); with MTP
  (D = 2) under t = 2 with sequence parallelism and p = 2; DeepSeek-V3's
  MoE layers (sigmoid group-limited routing with expert biases, a shared
  expert) and one MTP depth at EP = 2 with t = 2 and d = 2. Losses (main
  and MTP) and gradient norms over three AdamW steps agree to rel 1e-5,
  final weights and expert biases to 1e-5 (tests.layouts_runner).
- The checkpoint saved under the first layout loads into one process with
  the same logical weights; the parameter counts match built models; the
  settings' bad values are refused before launch, one paragraph each.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import ConfigError, ModelConfig, validate
from ptdp.model.gpt import GPT, TransformerLayer
from ptdp.model.mla import MultiLatentAttention
from ptdp.parallel.sharding import PARTIAL_GRAD_ATTR
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic import counts as analytic
from ptdp.perf.layout import Layout as PerfLayout
from ptdp.train.banner import count_parameters
from tests import layouts_runner as runner
from tests import test_ptdp_step as step

hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

CPU = torch.device("cpu")
# DeepSeek's shape in small: a = 4 heads of d_n 6 + d_r 4 (query/key) and d_v 5.
WIDTHS = dict(kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5)
MLA = dataclasses.replace(step.MODEL, multi_latent_attention=True, q_lora_rank=12, **WIDTHS,
                          qk_layernorm=True, normalization="RMSNorm",
                          position_embedding_type="rope")


# ------------------------------------------------------------------ transformers

def _hf_config(q_lora_rank: int | None, rope: dict, interleave: bool):
    return hf.DeepseekV3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=64,
        rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
        rope_parameters={"rope_theta": 10000.0, **rope}, rope_interleave=interleave,
        attn_implementation="eager")


def _ptdp_config(q_lora_rank: int | None, rope: dict) -> ModelConfig:
    yarn = {} if rope["rope_type"] == "default" else dict(
        position_embedding_type="yarn", rotary_scaling_factor=rope["factor"],
        yarn_original_max_position_embeddings=rope["original_max_position_embeddings"],
        mscale=rope["mscale"], mscale_all_dim=rope["mscale_all_dim"])
    return dataclasses.replace(MLA, q_lora_rank=q_lora_rank, norm_epsilon=1e-6,
                               disable_bias_linear=True, **yarn)


def _rotate_half_rows(weight: torch.Tensor, heads: int, before: int, rotated: int) -> torch.Tensor:
    """Each head's block of `before` rows then `rotated` rows, the rotated
    ones from "rotate half" order to interleaved pairs: row 2i <- row i,
    row 2i + 1 <- row i + d_r/2 (ptdp.model.mla's docstring)."""
    order = torch.stack([torch.arange(rotated // 2), torch.arange(rotated // 2) + rotated // 2],
                        dim=1).reshape(-1)
    blocks = weight.view(heads, before + rotated, -1)
    return torch.cat([blocks[:, :before], blocks[:, before:][:, order]], dim=1).reshape_as(weight)


def _hf_weights_as_ptdp(attention, interleave: bool) -> dict[str, torch.Tensor]:
    """transformers' DeepseekV3Attention's weights under ptdp's names."""
    names = {"q_a_proj": "query_down", "q_a_layernorm": "query_latent_layernorm",
             "q_b_proj": "query_up", "q_proj": "query", "kv_a_proj_with_mqa": "key_value_down",
             "kv_a_layernorm": "key_value_latent_layernorm", "kv_b_proj": "key_value_up",
             "o_proj": "dense"}
    state = {}
    for name, tensor in attention.state_dict().items():
        module, kind = name.split(".")
        state[f"{names[module]}.{kind}"] = tensor.clone()
    if not interleave:
        heads, rotated = attention.num_heads, attention.qk_rope_head_dim
        query = "query" if "query.weight" in state else "query_up"
        state[f"{query}.weight"] = _rotate_half_rows(state[f"{query}.weight"], heads,
                                                     attention.qk_nope_head_dim, rotated)
        state["key_value_down.weight"] = _rotate_half_rows(
            state["key_value_down.weight"], 1, attention.kv_lora_rank, rotated)
    return state


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    "q-lora-yarn-deepseek-v3": (12, YARN, True),
    "direct-query-yarn-mscales-apart": (None, {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7},
                                        True),
    "q-lora-rope-rotate-half": (12, {"rope_type": "default"}, False),
    "direct-query-yarn-rotate-half": (None, YARN, False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_module_computes_what_transformers_deepseek_v3_attention_does(case):
    q_lora_rank, rope, interleave = CASES[case]
    hf_config = _hf_config(q_lora_rank, rope, interleave)
    torch.manual_seed(3)
    theirs = hf.DeepseekV3Attention(hf_config, layer_idx=0).eval()
    with torch.no_grad():  # the norms away from 1, so their mapping counts
        for name, param in theirs.named_parameters():
            param.normal_(1.0 if "layernorm" in name else 0.0, 0.3)
    config = _ptdp_config(q_lora_rank, rope)
    validate(step._config(model=config))
    ours = MultiLatentAttention(config, ParallelContext.single(), RNGStreams(CPU)).eval()
    ours.load_state_dict(_hf_weights_as_ptdp(theirs, interleave))

    b, s = 2, 16
    x = torch.randn(b, s, 32)
    position_ids = torch.arange(s).expand(b, s)
    cos_sin = hf.DeepseekV3RotaryEmbedding(hf_config)(x, position_ids)
    causal = torch.full((s, s), -math.inf).triu(1).expand(b, 1, s, s)
    with torch.no_grad():
        want, _ = theirs(x, cos_sin, causal)
        out, bias = ours(x.transpose(0, 1).contiguous())
    assert bias is None
    assert_close(out.transpose(0, 1), want, rtol=0, atol=1e-5)
    assert want.abs().max() > 0.1  # (a real output, not a vanishing one)


# ------------------------------------------------------------------ layouts


MODELS = {
    # DeepSeek-V3's kind: a query latent, the latents normed, plain rope
    "latent": MLA,
    # DeepSeek-V2-Lite's kind: the query straight from h, YaRN with both
    # mscales (the softmax scale grows), LayerNorm (the norms have biases)
    "direct": dataclasses.replace(MLA, q_lora_rank=None, normalization="LayerNorm",
                                  position_embedding_type="yarn", rotary_scaling_factor=4.0,
                                  yarn_original_max_position_embeddings=8, mscale=0.9,
                                  mscale_all_dim=0.7),
    # DeepSeek-V3's multi-token prediction: two depths, each module's layer
    # an MLA layer
    "latent-mtp": dataclasses.replace(MLA, mtp_num_layers=2, mtp_loss_scaling_factor=0.3),
    # DeepSeek-V3's MoE layers after a dense first one: E = 8 routed SwiGLU
    # experts, each token's top 2 from its best 2 of 4 groups by sigmoid
    # scores plus expert biases (moved 1e-2 a step, so that they count within
    # the steps), their weights scaled by 2.5; an ungated shared expert; and
    # one MTP depth, as DeepSeek-V3 has
    "deepseek-moe": dataclasses.replace(
        MLA, swiglu=True, ffn_hidden_size=64, disable_bias_linear=True, num_experts=8,
        moe_ffn_hidden_size=32, moe_router_topk=2, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
        moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_shared_expert_intermediate_size=32, moe_layer_freq="([0]+[1]*3)", mtp_num_layers=1),
}


# The settings of each layout: tests.layouts_runner.Layout, this file's model by default.
Layout = functools.partial(runner.Layout, model="latent")

LAYOUTS = [
    Layout(t=2, p=2, sequence_parallel=True, recompute="selective", schedule="zbv"),
    Layout(p=2, d=2, k=1, recompute="full", distributed=True),
    Layout(t=2, c=2, comm="a2a"),
    Layout(c=2, d=2, comm="all_gather"),
    Layout(c=2, d=2, documents=True, model="direct"),  # p2p
    Layout(t=2, p=2, sequence_parallel=True, model="latent-mtp"),  # MTP on the last stage
    Layout(t=2, d=2, ep=2, sequence_parallel=True, model="deepseek-moe"),  # ETP = t = 2
]


def test_an_mla_gpt_trains_like_one_process_under_every_layout_and_reshards(pools, tmp_path):
    """The layouts, then the checkpoint the first (t = 2 with sequence
    parallelism, p = 2 under ZB-V) saved, loaded by one process: the same logical
    weights, bit for bit."""
    references = runner.one_process_runs(MODELS, LAYOUTS)
    assert len({records[-1]["loss"] for records, _ in references.values()}) == len(references)
    assert all("mtp_2 loss" in record for record in references["latent-mtp", False][0])
    biases = [bias for name, bias in references["deepseek-moe", False][1].items()
              if name.endswith("expert_bias")]
    assert len(biases) == 4 and all(bias.abs().max() > 0 for bias in biases)  # 3 layers, MTP's: moved
    per_rank = runner.train_under_layouts(pools, MODELS, LAYOUTS, references, str(tmp_path))

    resumed = runner.trainer(MODELS, Layout(model=LAYOUTS[0].model), ParallelContext.single())
    resumed.load(str(tmp_path))
    saved = {name: weight for results in per_rank for name, weight in results[0].saved.items()}
    loaded = runner.logical_state(resumed, ParallelContext.single())
    assert set(loaded) == set(saved)
    for name, weight in loaded.items():
        assert torch.equal(weight, saved[name]), name


# ------------------------------------------------------------------ counts


@pytest.mark.parametrize("model", MODELS)
def test_parameter_counts_match_built_models(model):
    """The whole model's logical count, and one layer's parameters on a
    tensor rank of t = 2 with sequence parallelism, in module order, with
    their sizes and which have partial gradients."""
    config = MODELS[model]
    gpt = GPT(config, ParallelContext.single(), RNGStreams(CPU))
    assert count_parameters(gpt) == analytic.parameter_count(config)
    assert sum(p.numel() for p in gpt.parameters()) == \
        analytic.parameters_per_device(config, PerfLayout())
    grid = RankGrid(tp=2, dp=1, pp=1)
    groups = {"tensor": None, "data": None, "pipeline": None, "model_parallel": None}
    ctx = ParallelContext(grid=grid, rank=grid.rank(1, 0, 0), groups=groups)
    layer = TransformerLayer(config, ctx, RNGStreams(CPU), sequence_parallel=True)
    # (row-parallel biases are marked partial only where a tensor group exists)
    built = [(p.numel(), getattr(p, PARTIAL_GRAD_ATTR, False)
              or name.endswith(("dense.bias", "dense_4h_to_h.bias")))
             for name, p in layer.named_parameters()]
    counted = [(p.numel, p.partial) for p in analytic._layer_parameter_list(config, 2, True)]
    assert counted == built
    assert sum(partial for _, partial in built) >= 4  # the down projections, latent norms, ...


# ------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("settings, says", [
    ({"kv_lora_rank": 0}, "--kv-lora-rank=0 must be a positive integer"),
    ({"q_lora_rank": -4}, "--q-lora-rank=-4 must be a positive integer"),
    ({"qk_pos_emb_head_dim": 5}, "--qk-pos-emb-head-dim 5: the rotated part turns in pairs"),
    ({"group_query_attention": True, "num_query_groups": 2},
     "--multi-latent-attention with --group-query-attention"),
    ({"rope_type": "rope", "rotary_scaling_factor": 4.0},
     "--rotary-scaling-factor 4.0: YaRN's settings act only with YaRN, which --rope-type rope "
     "turns off for multi-latent attention"),
    ({"softmax_scale": 0.1}, "--softmax-scale 0.1 with --multi-latent-attention"),
    ({"add_qkv_bias": True}, "--add-qkv-bias with --multi-latent-attention"),
    ({"window_size": "3,0"}, "--multi-latent-attention with sliding windows"),
    ({"softmax_type": "learnable"}, "--multi-latent-attention with attention sinks"),
    ({"position_embedding_type": "learned_absolute"},
     "--multi-latent-attention with --position-embedding-type learned_absolute"),
    ({"rotary_percent": 0.5}, "--rotary-percent 0.5 with --multi-latent-attention"),
    ({"multi_latent_attention": False}, "--q-lora-rank 12, --kv-lora-rank 8, --qk-head-dim 6, "
                                        "--qk-pos-emb-head-dim 4, --v-head-dim 5: these are "
                                        "multi-latent attention's widths"),
])
def test_bad_mla_settings_are_refused_in_one_paragraph(settings, says):
    config = step._config(model=dataclasses.replace(MLA, **settings))
    with pytest.raises(ConfigError) as refused:
        validate(config)
    assert len(refused.value.problems) == 1 and says in refused.value.problems[0], \
        refused.value.problems


def test_mla_with_adapters_is_refused_and_heads_must_split_over_t():
    config = step._config(model=MLA)
    config.lora = dataclasses.replace(config.lora, lora_rank=4)
    with pytest.raises(ConfigError) as refused:
        validate(config)
    assert refused.value.problems == [refused.value.problems[0]]
    assert "--lora-rank 4 with --multi-latent-attention" in refused.value.problems[0]
    with pytest.raises(ConfigError) as refused:
        validate(step._config(t=3, model=MLA))
    assert any("--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" in p
               for p in refused.value.problems)


@pytest.mark.parametrize("model", MODELS)
def test_a_packed_sequence_computes_each_document_alone(model):
    """Three documents in one sequence (positions restarting, attention kept
    inside each: the padded per-document path) give each document's logits
    run alone (PyTorch's attention, values of their own width)."""
    from ptdp.parallel.document_attention import Documents

    config, lengths = MODELS[model], (5, 7, 4)
    torch.manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, sum(lengths)))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    gpt = GPT(config, ParallelContext.single(), RNGStreams(CPU)).initialize(5)
    with torch.no_grad():
        packed = gpt(tokens, documents=Documents(positions, ids))
        start = 0
        for n in lengths:
            alone = gpt(tokens[:, start:start + n])
            assert_close(packed[start:start + n], alone, rtol=0, atol=1e-5)
            start += n


def test_the_rotation_is_rope_types_as_megatron_lm_reads_an_mla_model():
    """Megatron-LM's DeepSeek-V3 script gives --position-embedding-type rope
    with --rotary-scaling-factor 40 and no --rope-type: MLA's rotation is then
    YaRN (MLATransformerConfig.rope_type), with the softmax scaled by mscale²;
    --rope-type rope keeps plain rope; --rope-type yarn without MLA is refused,
    and --kv-channels with MLA is a note (MLA's widths are its own)."""
    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_args
    from ptdp.config.megatron import config_notes

    script = ["--multi-latent-attention", "--q-lora-rank", "12", "--position-embedding-type",
              "rope", "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim",
              "1.0", "--kv-channels", "128", "--num-layers", "2", "--hidden-size", "32",
              "--num-attention-heads", "4", "--mock-data"]
    config = config_from_args(build_parser().parse_args(["train", *script]))
    m = config.model
    assert m.yarn and m.rotary_scaling_factor == 40.0
    mscale = 0.1 * math.log(40.0) + 1.0
    assert m.mla_softmax_scale == pytest.approx((128 + 64) ** -0.5 * mscale ** 2)
    assert any(line.startswith("ptdp: --kv-channels 128 has no effect with "
                               "--multi-latent-attention") for line in config_notes(config))
    plain = dataclasses.replace(MLA, rope_type="rope", position_embedding_type="yarn")
    assert plain.rope and not plain.yarn
    with pytest.raises(ConfigError) as refused:
        validate(step._config(model=dataclasses.replace(step.MODEL, rope_type="yarn")))
    assert refused.value.problems == [
        "--rope-type yarn: Megatron-LM takes it only with --multi-latent-attention; YaRN with "
        "ordinary attention is --position-embedding-type yarn: give that and drop --rope-type"]


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_model_flops_count_the_built_attentions_products(q_lora_rank):
    """The FLOP count's attention projections are, per token, the
    multiply-adds of the built MLA module's matrices (every 2-D weight of
    the attention: down and up projections, the output), and its core is
    a·(qk + pos) for the scores and a·v for the context per pair."""
    from ptdp.perf.analytic.flops import (attention_core_columns, attention_projection_macs,
                                          model_flops_per_iteration)

    config = dataclasses.replace(MLA, q_lora_rank=q_lora_rank)
    layer = TransformerLayer(config, ParallelContext.single(), RNGStreams(CPU))
    attention = next(m for m in layer.modules() if isinstance(m, MultiLatentAttention))
    matrices = sum(p.numel() for p in attention.parameters() if p.dim() == 2)
    assert attention_projection_macs(config) == matrices
    a = config.num_attention_heads
    assert attention_core_columns(config) == a * (WIDTHS["qk_head_dim"]
                                                  + WIDTHS["qk_pos_emb_head_dim"]
                                                  + WIDTHS["v_head_dim"])
    B, s, h, l = 2, config.seq_length, config.hidden_size, config.num_layers
    mlp = 2 * B * s * h * 2 * config.ffn_size
    forward = l * (2 * B * s * matrices + 2 * B * s * s * attention_core_columns(config) + mlp) \
        + 2 * B * s * h * config.vocab_size
    assert model_flops_per_iteration(config, B, recompute=None) == pytest.approx(3 * forward)


def test_an_mla_or_mtp_model_never_exports_as_a_family_without_them():
    """A dense MLA model (Qwen3's other settings) or a Llama with MTP modules
    is refused by every family that would drop those tensors, each naming
    the setting: no export writes another model."""
    from ptdp.interop.hf_directory import family_for_export
    from ptdp.interop.hf_files import ConversionError

    llama = dict(normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                 untie_embeddings_and_output_weights=True, position_embedding_type="rope")
    for config, named in [(dataclasses.replace(MLA, **llama), "--multi-latent-attention"),
                          (dataclasses.replace(step.MODEL, **llama, mtp_num_layers=1),
                           "--mtp-num-layers 1")]:
        with pytest.raises(ConversionError) as refused:
            family_for_export(config)
        lines = str(refused.value).splitlines()[1:]
        for family in ("Llama", "Qwen3", "Mistral", "Mixtral", "gpt-oss", "Gemma 3"):
            line = next(line for line in lines if line.startswith(f"  - not {family}:"))
            assert named in line, line
