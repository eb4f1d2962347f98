"""Hugging Face's Llama-like dense families, against transformers as the outside reference.

For random-weight Qwen2, Qwen3, Mistral, Llama 3.1 (rope_type llama3) and
linearly interpolated Llama and Qwen3 (rope_type linear) models of small
shapes (grouped-query attention, tied and untied, heads wider than h/a for
Qwen3, q/k/v biases for Qwen2, sliding windows shorter than the
sequence for Mistral and Qwen2; fp32, CPU):

* HF -> ptdp: save_pretrained, `ptdp convert --from-hf`, and the one-process
  model built from the checkpoint gives transformers' logits within 1e-5;
* ptdp -> HF: a random ptdp model with the family's flags, `ptdp convert
  --to-hf`, and transformers' `from_pretrained` (of the class export picked)
  gives ours;
* what ptdp cannot compute (other rescalings, Qwen3's attention biases, a
  Llama's window) is refused with the key named.

The convert -> train hint is tested at the end: the command the import
prints, run as printed, trains at t = 2.
"""

import json
import re
import shlex

import pytest
import torch
from torch.testing import assert_close

from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_args
from ptdp.config import Config, DataConfig
from ptdp.interop.hf_llama import (
    ConversionError,
    attention_name_pairs,
    from_hf_state,
    hf_config_from_model_config,
    mlp_name_pairs,
    model_config_from_hf_config,
    name_map,
    to_hf_state,
)
from ptdp.interop.logical import logical_shapes
from ptdp.checkpoint.store import load_logical_model, save_logical_model
from tests.test_hf_llama import (
    _exported,
    TOL,
    VOCAB,
    _hf_logits,
    _llama_model_config,
    _logical_of,
    _our_logits,
    _ours,
    _tokens,
)

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}

# (name, transformers config class, its fields beyond COMMON, tokens' length)
SHAPES = [
    ("qwen2-gqa-untied", "Qwen2Config", dict(num_key_value_heads=2, intermediate_size=37,
                                             tie_word_embeddings=False, use_sliding_window=False,
                                             sliding_window=4096, max_window_layers=1), 20),
    ("qwen2-mha-tied", "Qwen2Config", dict(num_key_value_heads=4, intermediate_size=48,
                                           tie_word_embeddings=True), 20),
    ("qwen3-gqa-untied-wide-heads", "Qwen3Config",
     dict(num_key_value_heads=2, head_dim=16, intermediate_size=40, tie_word_embeddings=False,
          rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 20),
    ("qwen3-mqa-tied-narrow-heads", "Qwen3Config",
     dict(num_key_value_heads=1, head_dim=4, intermediate_size=48, tie_word_embeddings=True), 20),
    ("mistral-gqa-untied", "MistralConfig", dict(num_key_value_heads=2, intermediate_size=48,
                                                 sliding_window=None, tie_word_embeddings=False),
     20),
    # Sliding windows shorter than the sequence: Mistral's on every layer,
    # Qwen2's from max_window_layers on (layer 0 full, layer 1 windowed).
    ("mistral-window", "MistralConfig", dict(num_key_value_heads=2, intermediate_size=48,
                                             sliding_window=5, tie_word_embeddings=False), 20),
    ("qwen2-window-from-layer-1", "Qwen2Config",
     dict(num_key_value_heads=2, intermediate_size=37, tie_word_embeddings=True,
          use_sliding_window=True, sliding_window=4, max_window_layers=1), 20),
    # Llama 3.1: with θ 500000 and 16-wide heads, 3 of 8 pairs turn slower than
    # once per 8192 positions and 1 lies in the blend; over 128 positions the
    # logits move by some 3e-3 without the rescaling.
    ("llama3.1-gqa-untied", "LlamaConfig",
     dict(num_key_value_heads=2, head_dim=16, intermediate_size=48, tie_word_embeddings=False,
          max_position_embeddings=256, rope_parameters={**LLAMA3, "rope_theta": 500000.0}), 128),
    # Linear interpolation (--rotary-seq-len-interpolation-factor): every
    # frequency divided by the factor; exported again, the same logits.
    ("llama-linear-gqa-untied", "LlamaConfig",
     dict(num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=False,
          rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}), 20),
    ("qwen3-linear-tied", "Qwen3Config",
     dict(num_key_value_heads=2, head_dim=16, intermediate_size=40, tie_word_embeddings=True,
          rope_parameters={"rope_type": "linear", "factor": 2.5, "rope_theta": 1e6}), 20),
]


def _hf_model(class_name, fields, seed=3):
    config = getattr(transformers, class_name)(**{**COMMON, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swap would show
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if re.search(r"\.[qk]_proj\.weight$", name):
                # Sharper attention than initialisation gives, so where each
                # position attends (rotary frequencies) shows in the logits.
                param.mul_(8.0)
    return model


# ------------------------------------------------------------------ HF -> ptdp

@pytest.mark.parametrize("name, class_name, fields, length", SHAPES, ids=[s[0] for s in SHAPES])
def test_hf_to_ours_through_convert(tmp_path, name, class_name, fields, length):
    hf = _hf_model(class_name, fields)
    directory, save = tmp_path / "hf", tmp_path / "ckpt"
    # one shape as Hugging Face writes large models: several safetensors files
    hf.save_pretrained(str(directory), **({"max_shard_size": "20KB"} if "qwen3-gqa" in name else {}))
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0

    config, weights, _ = load_logical_model(save)
    model = config.model
    assert model.query_groups == fields["num_key_value_heads"]
    assert model.tied_output == fields["tie_word_embeddings"]
    assert model.head_dim == fields.get("head_dim", 8)
    assert (model.qk_layernorm, model.add_qkv_bias, model.bias) \
        == ("qwen3" in name, "qwen2" in name, False)
    assert model.use_rope_scaling == ("llama3" in name)
    interpolation = fields["rope_parameters"]["factor"] if "linear" in name else None
    assert model.rotary_seq_len_interpolation_factor == interpolation
    tokens = _tokens(length=length)
    expected = _hf_logits(hf, tokens)
    assert_close(_our_logits(_ours(model, weights), tokens), expected, **TOL)
    if "window" in name or "linear" in name:  # exported again: the same class and logits
        assert main(["convert", "--load", str(save), "--to-hf", str(tmp_path / "back")]) == 0
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"),
                                                                 local_files_only=True).eval()
        assert type(back).__name__ == class_name.replace("Config", "ForCausalLM")
        assert back.config.rope_parameters == hf.config.rope_parameters
        assert_close(_hf_logits(back, tokens), expected, **TOL)
    # the feature each shape is for matters: without it the logits differ
    if "window" in name:  # (W keys, the query's own included: ptdp's W - 1 before it)
        assert model.window == (fields["sliding_window"] - 1, 0)
        assert model.windowed_layers == ([True, True] if "mistral" in name else [False, True])
        model.window_size = model.window_attn_skip_freq = None
    elif "linear" in name:
        model.rotary_seq_len_interpolation_factor = None
    elif "llama3" in name:
        model.use_rope_scaling = False
    elif "qwen3" in name:
        weights = {k: v.clone() if "q_layernorm" not in k else v.flip(0) for k, v in weights.items()}
    elif "qwen2" in name:
        weights = {k: v if not k.endswith("bias") else torch.zeros_like(v)
                   for k, v in weights.items()}
    else:  # Mistral: exported again, it is a Llama (the same architecture)
        assert main(["convert", "--load", str(save), "--to-hf", str(tmp_path / "back")]) == 0
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"),
                                                                 local_files_only=True).eval()
        assert type(back).__name__ == "LlamaForCausalLM"
        assert_close(_hf_logits(back, tokens), expected, **TOL)
        return
    assert (_our_logits(_ours(model, weights), tokens) - expected).abs().max() > 1e-4


def test_transformers_4_form_of_llama3_rope(tmp_path):
    """Llama 3.1's published config.json: rope_scaling + top-level rope_theta."""
    hf = _hf_model("LlamaConfig", dict(next(f for n, _, f, _ in SHAPES if n.startswith("llama3"))))
    fields = hf.config.to_dict()
    del fields["rope_parameters"]
    fields.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    config = model_config_from_hf_config(fields)
    assert (config.use_rope_scaling, config.rope_scaling_factor, config.rotary_base) \
        == (True, 8.0, 500000.0)
    logical = from_hf_state(hf.state_dict(), config)
    tokens = _tokens(length=128)
    assert_close(_our_logits(_ours(config, logical), tokens), _hf_logits(hf, tokens), **TOL)


# ------------------------------------------------------------------ ptdp -> HF

EXPORTS = [
    ("Qwen3ForCausalLM", dict(qk_layernorm=True, kv_channels=16, group_query_attention=True,
                              num_query_groups=2, disable_bias_linear=True,
                              untie_embeddings_and_output_weights=True, ffn_hidden_size=40)),
    ("Qwen3ForCausalLM", dict(qk_layernorm=True, disable_bias_linear=True, ffn_hidden_size=48,
                              apply_layernorm_1p=True)),
    ("Qwen2ForCausalLM", dict(add_qkv_bias=True, disable_bias_linear=True,
                              group_query_attention=True, num_query_groups=2,
                              untie_embeddings_and_output_weights=True, ffn_hidden_size=37)),
    ("Qwen2ForCausalLM", dict(add_qkv_bias=True, disable_bias_linear=True, kv_channels=4,
                              ffn_hidden_size=48)),
    ("LlamaForCausalLM", dict(use_rope_scaling=True, rope_scaling_factor=32.0,
                              rotary_base=500000.0, kv_channels=16, group_query_attention=True,
                              num_query_groups=2, disable_bias_linear=True, ffn_hidden_size=48,
                              seq_length=128)),
    ("LlamaForCausalLM", dict(rotary_seq_len_interpolation_factor=8.0, rotary_base=500.0,
                              disable_bias_linear=True, ffn_hidden_size=48)),
]


@pytest.mark.parametrize("hf_class, changes", EXPORTS,
                         ids=["qwen3-wide-untied", "qwen3-tied-1p", "qwen2-gqa-untied",
                              "qwen2-narrow-tied", "llama3.2-rope", "llama-linear-rope"])
def test_ours_to_hf_through_convert(tmp_path, hf_class, changes):
    config, logical, directory = _exported(tmp_path, _llama_model_config(**changes))

    written = json.loads((directory / "config.json").read_text())
    assert written["architectures"] == [hf_class]
    if config.use_rope_scaling:  # both forms, all four parameters
        assert written["rope_scaling"] == {**LLAMA3, "factor": 32.0}
        assert written["rope_parameters"] == {**LLAMA3, "factor": 32.0, "rope_theta": 500000.0}
    if config.rotary_seq_len_interpolation_factor is not None:
        assert written["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
        assert written["rope_parameters"] == {"rope_type": "linear", "factor": 8.0,
                                              "rope_theta": 500.0}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory),
                                                           local_files_only=True).eval()
    assert type(hf).__name__ == hf_class
    tokens = _tokens(seed=6, length=config.seq_length if config.use_rope_scaling else 20)
    assert_close(_hf_logits(hf, tokens), _our_logits(_ours(config, logical), tokens), **TOL)
    back = from_hf_state(to_hf_state(logical, config), config)  # and back (1 + w - 1: rounded)
    for name in logical:
        assert_close(back[name], logical[name], rtol=0.0,
                     atol=1e-7 if config.apply_layernorm_1p else 0.0)


def test_export_refuses_what_no_family_has(tmp_path, capsys):
    config = _llama_model_config(qk_layernorm=True, add_qkv_bias=True, disable_bias_linear=True)
    with pytest.raises(ConversionError, match=r"not a Llama, Qwen2, Qwen3 or Mistral: .*--add-qkv-bias "
                                              r"\(Qwen3 as ptdp writes it has no biases\)"):
        hf_config_from_model_config(config)
    save = tmp_path / "ckpt"
    save_logical_model(save, Config(model=config, data=DataConfig(mock_data=True)),
                       _logical_of(_ours(config), config))
    assert main(["convert", "--load", str(save), "--to-hf", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert "  - not Llama: --qk-layernorm (Llama has no query/key norms); --add-qkv-bias with " \
           "--disable-bias-linear (Llama's biases are on all linear layers or none)" in error
    assert "  - not Qwen2: --qk-layernorm (Qwen2 has no query/key norms)" in error


def test_name_pairs_cover_the_model_once():
    """attention_name_pairs + mlp_name_pairs is every logical tensor, once,
    and every Hugging Face name of the family, once."""
    config = _llama_model_config(qk_layernorm=True, add_qkv_bias=True, kv_channels=16,
                                 disable_bias_linear=True, untie_embeddings_and_output_weights=True)
    attention, mlp = attention_name_pairs(config), mlp_name_pairs(config)
    assert [ours for ours, _ in attention + mlp] == [ours for ours, _ in name_map(config)]
    assert sorted(ours for ours, _ in name_map(config)) == sorted(logical_shapes(config))
    assert not any(".mlp." in ours for ours, _ in attention)
    theirs = {name: rows for _, pieces in attention for name, rows in pieces}
    assert theirs["model.layers.1.self_attn.q_norm.weight"] == 16
    assert (theirs["model.layers.0.self_attn.q_proj.bias"],
            theirs["model.layers.0.self_attn.k_proj.bias"]) == (64, 64)
    assert "lm_head.weight" in theirs and "model.layers.0.self_attn.o_proj.bias" not in theirs


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("class_name, changes, message", [
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=0,
                         layer_types=["sliding_attention"] * 2),
     r"sliding_window=0 must be a positive integer"),
    ("Qwen3Config", dict(layer_types=["full_attention", "chunked_attention"]),
     r"layer_types=\['full_attention', 'chunked_attention'\] is not supported: each layer is "
     r"'full_attention' or 'sliding_attention'"),
    ("LlamaConfig", dict(sliding_window=16), r"sliding_window=16 is not supported: ptdp computes "
                                             r"no attention limited to a sliding window"),
    ("Qwen3Config", dict(attention_bias=True), r"attention_bias=True is not supported: Qwen3's "
                                               r"o_proj then has a bias"),
    ("Qwen2Config", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     r"rope_parameters has rope_type 'yarn'"),
    ("LlamaConfig", dict(rope_parameters={**LLAMA3, "high_freq_factor": 2.0, "rope_theta": 1e4}),
     r"rope_parameters.high_freq_factor=2.0 is not supported: ptdp computes Llama 3.1's "
     r"rescaling with high_freq_factor 4"),
    ("LlamaConfig", dict(rope_parameters={**LLAMA3, "original_max_position_embeddings": 4096,
                                          "rope_theta": 1e4}),
     r"rope_parameters.original_max_position_embeddings=4096 is not supported"),
])
def test_refuses_what_ptdp_cannot_compute(class_name, changes, message):
    hf = getattr(transformers, class_name)(**COMMON, intermediate_size=48,
                                           num_key_value_heads=2).to_dict()
    hf.update(changes)
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf_config(hf)


def test_family_from_architectures_alone():
    hf = transformers.Qwen2Config(**COMMON, intermediate_size=48, num_key_value_heads=2).to_dict()
    del hf["model_type"]
    hf["architectures"] = ["Qwen2ForCausalLM"]
    assert model_config_from_hf_config(hf).add_qkv_bias


# ------------------------------------------------------------------ convert, then train

def test_the_printed_command_is_one_to_fill_in(tmp_path, capsys):
    """`ptdp convert --from-hf DIR --save CK` prints a train command with only
    the iteration count to fill in (tests/test_hf_moe.py runs that command,
    for a Mixtral, at t = 2 with EP = 2)."""
    hf = _hf_model("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, intermediate_size=40,
                                       tie_word_embeddings=False))
    directory, save = tmp_path / "hf", tmp_path / "ckpt"
    hf.save_pretrained(str(directory))
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0
    printed = capsys.readouterr().out
    command = re.search(r"train with: (ptdp train .*?)(?:$| \()", printed, re.M).group(1)
    assert "--use-checkpoint-args" in command and "N" in shlex.split(command)
    words = [("2" if word == "N" else word) for word in shlex.split(command)]
    assert words[:2] == ["ptdp", "train"]
    config = config_from_args(build_parser().parse_args(words[1:]))
    assert (config.train.load, config.train.use_checkpoint_args, config.data.mock_data) == (
        str(save), True, True)


@pytest.mark.parametrize("settings, named", [
    ({"position_embedding_type": "yarn"}, "--position-embedding-type yarn"),
    ({"rotary_percent": 0.5}, "--rotary-percent 0.5"),
    ({"rotary_base_local": 10000.0}, "--rotary-base-local"),
    ({"sandwich_norm": True}, "--sandwich-norm"), ({"scale_embeddings": True}, "--scale-embeddings"),
    ({"softmax_type": "learnable"}, "--softmax-type learnable"),
    ({"softmax_scale": 0.0625}, "--softmax-scale 0.0625"),
    ({"glu_linear_offset": 1.0}, "--glu-linear-offset 1"),
    ({"activation_func_clamp_value": 7.0}, "--activation-func-clamp-value")])
def test_export_refuses_rotary_variants_no_family_writes(settings, named):
    """YaRN, partial rotation, a local rotary base and the Gemma 3 and
    gpt-oss pieces on a Llama: an export would be another model; every
    rotary family names the setting instead (GPT-2 has no rotary embeddings
    to begin with; its own check names the pieces below; Gemma 3 writes its
    pieces only all together, and names what else a Llama lacks)."""
    from ptdp.interop.hf_directory import family_for_export

    import dataclasses

    config = dataclasses.replace(_llama_model_config(), **settings)
    with pytest.raises(ConversionError) as refused:
        family_for_export(config)
    # (Gemma 3 and gpt-oss have several of these pieces, GLM-4.5 partial rotation and
    # DeepSeek-V3 YaRN: their lines name what else they lack)
    rotary = [line for line in str(refused.value).splitlines()[1:]
              if not any(family in line for family in ("GPT-2", "Gemma 3", "gpt-oss", "GLM-4.5",
                                                         "DeepSeek-V3"))]
    assert rotary and all(named in line for line in rotary), str(refused.value)


@pytest.mark.parametrize("settings, named", [
    ({"geglu": True}, "--geglu"), ({"quick_geglu": True}, "--quick-geglu"),
    ({"sandwich_norm": True}, "--sandwich-norm"), ({"softmax_type": "off-by-one"}, "--softmax-type"),
    ({"window_size": "3,0"}, "--window-size")])
def test_a_gpt2_shaped_model_with_a_newer_piece_is_not_written_as_gpt2(settings, named):
    import dataclasses

    from ptdp.config import ModelConfig
    from ptdp.interop.hf_gpt2 import gpt2_obstacles

    gpt2 = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    assert gpt2_obstacles(gpt2) == []
    obstacles = gpt2_obstacles(dataclasses.replace(gpt2, **settings))
    assert len(obstacles) == 1 and named in obstacles[0], obstacles
