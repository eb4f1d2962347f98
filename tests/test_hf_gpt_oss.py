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
