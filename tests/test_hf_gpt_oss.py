"""Hugging Face gpt-oss (GptOssForCausalLM) interop, against transformers.

A random small gpt-oss (alternating sliding-window and full layers whose
window is shorter than the sequence, learnable sinks, experts and router
with biases, the clamped quick-GeGLU reached on both sides, YaRN without
truncation; fp32, CPU):

* HF -> ptdp through `ptdp convert --from-hf`: the one-process model gives
  transformers' logits within atol 1e-5;
* ptdp -> HF through `ptdp convert --to-hf`: `from_pretrained` gives the
  same logits;
* MXFP4 experts (published checkpoints) are dequantized as transformers'
  own convert_moe_packed_tensors does, and a directory holding them
  imports to the same model;
* what ptdp cannot compute is refused, naming the key.
"""

import json

import pytest
import torch
from torch.testing import assert_close

from ptdp.checkpoint.store import load_logical_model
from ptdp.cli import main
from ptdp.interop.hf_directory import family_for_export, load_hf_directory
from ptdp.interop.hf_files import ConversionError
from ptdp.interop.hf_gpt_oss import dequantize_mxfp4, model_config_from_hf_config
from tests.test_hf_llama import TOL, VOCAB, _hf_logits, _our_logits, _ours, _tokens

transformers = pytest.importorskip("transformers")

EAGER = dict(experts_implementation="eager", attn_implementation="eager")
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


def _hf_config(**changes):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=5,
                  num_experts_per_tok=2, sliding_window=5, max_position_embeddings=64,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters=dict(YARN), tie_word_embeddings=False, swiglu_limit=3.0,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    fields.update(changes)
    return transformers.GptOssConfig(**fields)


def _hf_model(config, seed=3):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, **EAGER).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # away from 0 and 1, so a swap would show
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("sinks") or name.endswith("router.weight"):
                param.normal_(0.0, 1.0)  # sinks that matter, routers far from ties
            elif "experts" in name:
                param.normal_(0.0, 0.3)  # the gate's clamp reached
    return model


def test_hf_to_ours_and_back_through_convert(tmp_path):
    hf = _hf_model(_hf_config())
    directory, save, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf.save_pretrained(str(directory))
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0
    config, weights, _ = load_logical_model(save)
    model = config.model
    assert (model.window, model.windowed_layers, model.softmax_type, model.yarn) == \
        ((4, 0), [True, False, True], "learnable", True)
    assert not model.yarn_correction_range_round_to_int and model.activation_func_clamp_value == 3
    tokens = _tokens(length=20)
    theirs = _hf_logits(hf, tokens)
    assert (_our_logits(_ours(model, seed=9), tokens) - theirs).abs().max() > 1e-2
    assert_close(_our_logits(_ours(model, weights), tokens), theirs, **TOL)

    assert main(["convert", "--load", str(save), "--to-hf", str(back)]) == 0
    assert json.loads((back / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(back), local_files_only=True,
                                                              **EAGER).eval()
    assert_close(_hf_logits(again, tokens), theirs, **TOL)


# ------------------------------------------------------------------ MXFP4

def _random_mxfp4(shape, seed):
    """Blocks [..., G, 16] of every FP4 code and scales [..., G] around 2^-3."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.int32)
    scales = torch.randint(127 - 6, 127, shape, generator=generator, dtype=torch.int32)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 10, 2), seed=1)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 64, 10)
    assert_close(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32),
                 rtol=0, atol=0)
    # by hand: code 0x21 is 0.5 (low nibble) then 1.0, scale 128 doubles them; 0xF8 is -0, -6
    by_hand = dequantize_mxfp4(torch.tensor([[[[0x21, 0xF8] + [0] * 14]]], dtype=torch.uint8),
                               torch.tensor([[[128]]], dtype=torch.uint8))
    assert by_hand[0, :4, 0].tolist() == [1.0, 2.0, 0.0, -12.0]


def _mxfp4_directory(tmp_path, hf):
    """`hf` saved with its experts' matrices replaced by random MXFP4 ones
    (stored as blocks and scales, as published checkpoints are); the model
    gets their dequantized values, computed by transformers."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory = tmp_path / "mxfp4"
    hf.save_pretrained(str(directory))
    tensors = load_file(str(directory / "model.safetensors"))
    for i, layer in enumerate(hf.model.layers):
        for j, name in enumerate(("gate_up_proj", "down_proj")):
            param = getattr(layer.mlp.experts, name)
            E, rows, columns = param.shape
            blocks, scales = _random_mxfp4((E, columns, rows // 32), seed=10 * i + j)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_published_mxfp4_directory_imports_dequantized(tmp_path):
    hf = _hf_model(_hf_config(intermediate_size=32, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"]))
    directory = _mxfp4_directory(tmp_path, hf)
    config, weights = load_hf_directory(directory)
    tokens = _tokens(seed=7, length=12)
    assert_close(_our_logits(_ours(config, weights), tokens), _hf_logits(hf, tokens), **TOL)

    # a format ptdp does not know is refused, naming it
    hf_config = json.loads((directory / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8"}
    (directory / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ConversionError, match="quant_method 'mxfp4'"):
        load_hf_directory(directory)


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("change, named", [
    (dict(attention_bias=False), "attention_bias=False"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "rope_type 'llama3'"),
    (dict(rope_parameters={**YARN, "attention_factor": 2.0}), "attention_factor=2.0"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types="),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config="),
])
def test_what_ptdp_cannot_compute_is_refused_naming_the_key(change, named):
    hf = _hf_config().to_dict()
    hf.update(change)
    with pytest.raises(ConversionError, match=named.replace("(", r"\(").replace("[", r"\[")):
        model_config_from_hf_config(hf)


def test_export_picks_gpt_oss_and_names_what_keeps_another_model_from_it():
    model = model_config_from_hf_config(_hf_config().to_dict())
    assert family_for_export(model).name == "gpt-oss"
    model.softmax_type = "off-by-one"
    with pytest.raises(ConversionError, match=r"not gpt-oss: .*--softmax-type off-by-one"):
        family_for_export(model)


def test_yarn_mscales_and_attention_factor_round_trip():
    """DeepSeek-style mscales: export writes the factor they give, which
    transformers uses and import reads back to the same flags."""
    from ptdp.interop.hf_gpt_oss import hf_config_from_model_config

    model = model_config_from_hf_config(_hf_config().to_dict())
    model.mscale, model.mscale_all_dim = 2.0, 0.5
    written = hf_config_from_model_config(model)
    again = model_config_from_hf_config(written)
    assert (again.mscale, again.mscale_all_dim) == (2.0, 0.5)
    rotary = transformers.GptOssConfig(**{k: v for k, v in written.items()
                                          if k not in ("architectures", "model_type")})
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    from ptdp.model.yarn import YarnScaling
    ours = YarnScaling(32.0, 4096, mscale=2.0, mscale_all_dim=0.5).attention_factor
    assert ours != pytest.approx(YarnScaling(32.0).attention_factor)
    assert GptOssRotaryEmbedding(rotary).attention_scaling == pytest.approx(ours, rel=1e-12)


def test_the_published_config_form_reads_as_the_documented_flags():
    """gpt-oss-20b's config.json as published (transformers 4.55: rope_scaling
    + rope_theta, MXFP4 quantization_config, keys transformers ignores),
    shrunk to 4 layers: the flag set docs/generation-and-export.md gives."""
    published = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 4, "num_key_value_heads": 8, "num_local_experts": 32,
        "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
        "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088}
    m = model_config_from_hf_config(published)
    assert (m.window_size, m.windowed_layers) == ("127,0", [True, False, True, False])
    assert (m.num_query_groups, m.kv_channels, m.num_experts, m.moe_router_topk,
            m.moe_ffn_hidden_size) == (8, 64, 32, 4, 2880)
    assert (m.rotary_base, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings,
            m.yarn_correction_range_round_to_int, m.mscale, m.mscale_all_dim) == \
        (150000.0, 32.0, 4096, False, 1.0, 0.0)
    assert (m.quick_geglu, m.glu_linear_offset, m.activation_func_clamp_value, m.bias,
            m.softmax_type, m.moe_router_pre_softmax, m.tied_output) == \
        (True, 1.0, 7.0, True, "learnable", False, False)
