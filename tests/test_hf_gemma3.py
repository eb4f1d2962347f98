"""Gemma 3's text model (Gemma3ForCausalLM) against transformers as the outside reference.

A random small Gemma 3 (7 layers, five sliding-window layers then a full
one, as Gemma's 5:1 pattern, and one more sliding; a window of 4 keys over
20 tokens; two rotary bases; heads 16 wide, not h/a = 8; grouped-query
attention; a query_pre_attn_scalar other than the head width; fp32, CPU):

* HF -> ptdp: save_pretrained, `ptdp convert --from-hf`, and the one-process
  model gives transformers' logits within 1e-5; without the window or the
  local rotary base they differ, so both are really read;
* ptdp -> HF: that checkpoint exported by `ptdp convert --to-hf` loads as
  Gemma3ForCausalLM with the same logits and tensors; a random ptdp model
  with Gemma's flags (tied, every third layer full, the default scale)
  exports and computes what ptdp computes;
* the published checkpoints' linear interpolation (rope_type 'linear',
  factor 8, on the full layers only): imported, transformers' logits over
  more tokens than the window; exported, transformers reads it back with the
  same logits; without the factor the logits differ; transformers 4's
  top-level rope_scaling reads as the same model;
* what ptdp cannot compute (other rope scalings, 'linear' on the sliding
  layers, soft-capping, ...) is refused with the key named, and a model
  missing one of Gemma's pieces is not written as Gemma 3.
"""

import dataclasses
import json

import pytest
import torch
from torch.testing import assert_close

from ptdp.checkpoint.store import load_logical_model
from ptdp.cli import main
from ptdp.interop.hf_directory import family_for_export
from ptdp.interop.hf_files import ConversionError
from ptdp.interop.hf_gemma3 import (
    from_hf_state,
    gemma3_obstacles,
    hf_config_from_model_config,
    model_config_from_hf_config,
    to_hf_state,
)
from tests.test_hf_llama import TOL, VOCAB, _exported, _hf_logits, _our_logits, _ours, _tokens

transformers = pytest.importorskip("transformers")

S, F = "sliding_attention", "full_attention"
HF_FIELDS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=7,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 query_pre_attn_scalar=24, sliding_window=4, layer_types=[S] * 5 + [F, S],
                 max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 rope_parameters={F: {"rope_type": "default", "rope_theta": 10000.0},
                                  S: {"rope_type": "default", "rope_theta": 50.0}},
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
# ptdp's flags for a Gemma 3 (the model section of a checkpoint's config).
GEMMA_FLAGS = dict(normalization="RMSNorm", apply_layernorm_1p=True, geglu=True,
                   sandwich_norm=True, scale_embeddings=True, qk_layernorm=True,
                   position_embedding_type="rope", disable_bias_linear=True)


def _hf_gemma(**changes):
    config = transformers.Gemma3TextConfig(**{**HF_FIELDS, **changes})
    torch.manual_seed(3)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 + 0; q/k norms sharpen attention
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1 + (1.0 if "_norm" in name else 0.0))
    return model


def test_gemma3_from_hf_and_back(tmp_path):
    hf = _hf_gemma()
    directory, save, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf.save_pretrained(str(directory))
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0
    config, weights, _ = load_logical_model(save)
    model = config.model
    assert (model.window, model.windowed_layers) == ((3, 0), [True] * 5 + [False, True])
    assert (model.rotary_base, model.rotary_base_local, model.head_dim, model.query_groups) \
        == (10000.0, 50.0, 16, 2)
    assert model.softmax_scale == 24 ** -0.5 and not model.tied_output
    tokens = _tokens(length=20)
    expected = _hf_logits(hf, tokens)
    assert_close(_our_logits(_ours(model, weights), tokens), expected, **TOL)
    for missing in (dict(window_size=None), dict(rotary_base_local=None)):
        other = dataclasses.replace(model, **missing)
        assert (_our_logits(_ours(other, weights), tokens) - expected).abs().max() > 1e-3

    assert main(["convert", "--load", str(save), "--to-hf", str(back)]) == 0
    written = json.loads((back / "config.json").read_text())
    assert (written["architectures"], written["model_type"]) == (["Gemma3ForCausalLM"],
                                                                 "gemma3_text")
    assert (written["layer_types"], written["query_pre_attn_scalar"]) == (HF_FIELDS["layer_types"],
                                                                          24)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(back),
                                                              local_files_only=True).eval()
    assert type(again).__name__ == "Gemma3ForCausalLM"
    assert_close(_hf_logits(again, tokens), expected, **TOL)
    theirs = again.state_dict()
    for name, tensor in hf.state_dict().items():  # the norms' w copied as it is, not 1 + w
        assert torch.equal(theirs[name], tensor), name


def test_a_ptdp_gemma_exports_as_gemma3(tmp_path):
    config = dataclasses.replace(
        _model_config(), num_layers=3, window_size="5,0", window_attn_skip_freq=3,
        untie_embeddings_and_output_weights=False, softmax_scale=None, rotary_base=500.0,
        rotary_base_local=20.0)
    config, logical, directory = _exported(tmp_path, config)
    written = json.loads((directory / "config.json").read_text())
    assert (written["layer_types"], written["sliding_window"], written["sliding_window_pattern"],
            written["query_pre_attn_scalar"]) == ([S, S, F], 6, 3, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                           local_files_only=True).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    tokens = _tokens(seed=6, length=20)
    assert_close(_hf_logits(hf, tokens), _our_logits(_ours(config, logical), tokens), **TOL)
    back = from_hf_state(to_hf_state(logical, config), config)
    assert all(torch.equal(back[name], logical[name]) for name in logical)
    # and the written config.json reads back as the same model
    read = model_config_from_hf_config(written)
    assert (read.windowed_layers, read.window, read.rotary_base_local) == ([True, True, False],
                                                                           (5, 0), 20.0)


# Gemma 3 4B's rotary settings (transformers 5's form): the full layers
# interpolated 8 times, at θ 1e6; the sliding ones plain, at θ 1e4.
LINEAR = {F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
          S: {"rope_type": "default", "rope_theta": 1e4}}


def test_linear_interpolation_of_the_full_layers_both_ways():
    hf = _hf_gemma(rope_parameters=LINEAR)
    config = model_config_from_hf_config(hf.config.to_dict())
    assert (config.rotary_seq_len_interpolation_factor, config.rotary_base,
            config.rotary_base_local) == (8.0, 1e6, 1e4)
    logical = from_hf_state(hf.state_dict(), config)
    tokens = _tokens(length=20)  # five times the window
    expected = _hf_logits(hf, tokens)
    assert_close(_our_logits(_ours(config, logical), tokens), expected, **TOL)
    plain = dataclasses.replace(config, rotary_seq_len_interpolation_factor=None)
    assert (_our_logits(_ours(plain, logical), tokens) - expected).abs().max() > 1e-3

    written = hf_config_from_model_config(config)
    assert written["rope_parameters"] == LINEAR
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}  # transformers 4's
    again = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**written)).eval()
    again.load_state_dict(to_hf_state(logical, config))
    assert again.config.rope_parameters == LINEAR
    assert_close(_hf_logits(again, tokens), expected, **TOL)
    # transformers 4's form of the same settings reads as the same model
    older = {k: v for k, v in HF_FIELDS.items() if k != "rope_parameters"}
    older.update(rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})  # (as published)
    assert model_config_from_hf_config(older) == config
    assert transformers.Gemma3TextConfig(**older).rope_parameters == LINEAR
    # an interpolated model whose sliding layers have no base of their own
    # interpolates them too, which Gemma 3 cannot say
    assert any("--rotary-base-local" in obstacle for obstacle in gemma3_obstacles(
        dataclasses.replace(config, rotary_base_local=None)))


def _model_config():
    return model_config_from_hf_config(transformers.Gemma3TextConfig(**HF_FIELDS).to_dict())


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={F: LINEAR[F], S: {"rope_type": "linear", "factor": 8.0}}),
     r"rope_parameters\.sliding_attention has rope_type 'linear'"),
    (dict(rope_parameters={F: {**LINEAR[F], "factor": 0.0}, S: LINEAR[S]}),
     r"rope_parameters\.full_attention\.factor=0\.0 must be a positive number"),
    (dict(rope_parameters=LINEAR, rope_scaling={"rope_type": "linear", "factor": 4.0}),
     r"rope_scaling factor 4\.0 and rope_parameters\.full_attention factor 8\.0 disagree"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 8.0}, rope_parameters=None),
     r"rope_scaling has rope_type 'dynamic'"),
    (dict(final_logit_softcapping=30.0), r"final_logit_softcapping=30\.0 is not supported"),
    (dict(attn_logit_softcapping=50.0), r"attn_logit_softcapping=50\.0 is not supported"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True"),
    (dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported"),
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(layer_types=[S] * 3), r"layer_types has 3 entries for 7 layers"),
])
def test_refuses_what_ptdp_cannot_compute(changes, message):
    hf = {**HF_FIELDS, "model_type": "gemma3_text", **changes}
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf_config(hf)


def test_default_layer_pattern_and_rope_keys_of_older_files():
    """transformers 4's form: no layer_types (every 6th layer full), rope_theta
    and rope_local_base_freq at the top."""
    hf = {k: v for k, v in HF_FIELDS.items() if k not in ("layer_types", "rope_parameters")}
    config = model_config_from_hf_config({**hf, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert config.windowed_layers == [True] * 5 + [False, True]
    assert config.window_attn_skip_freq == 6
    assert (config.rotary_base, config.rotary_base_local) == (1e6, 1e4)


@pytest.mark.parametrize("changes, named", [
    (dict(geglu=False, swiglu=True), "no --geglu"),
    (dict(sandwich_norm=False), "no --sandwich-norm"),
    (dict(apply_layernorm_1p=False), "no --apply-layernorm-1p"),
    (dict(scale_embeddings=False), "no --scale-embeddings"),
    (dict(qk_layernorm=False), "no --qk-layernorm"),
    (dict(softmax_scale=0.3), "--softmax-scale 0.3"),
    (dict(use_rope_scaling=True), "--use-rope-scaling"),
    (dict(softmax_type="off-by-one"), "--softmax-type off-by-one"),
    (dict(normalization="LayerNorm"), "--normalization LayerNorm"),
])
def test_export_names_what_gemma3_lacks(changes, named):
    config = dataclasses.replace(_model_config(), **changes)
    assert any(named in obstacle for obstacle in gemma3_obstacles(config))
    with pytest.raises(ConversionError, match=r"not Gemma 3: .*" + named.replace("-", r"\-")):
        family_for_export(config)


def test_gemma_flags_are_what_the_import_sets():
    """GEMMA_FLAGS (the docs' flag set) is what an import gives."""
    config = _model_config()
    assert all(getattr(config, name) == value for name, value in GEMMA_FLAGS.items())
    assert not gemma3_obstacles(config) and family_for_export(config).name == "Gemma 3"
