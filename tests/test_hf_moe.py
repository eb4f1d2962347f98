"""Hugging Face Mixtral, Qwen3-MoE and Qwen2-MoE interop, against transformers.

For random-weight models of several small shapes per family (odd expert
counts, top-k from 1 to 4, experts of odd width, grouped-query attention,
tied and untied, head_dim other than h/a, dense layers among MoE layers
through decoder_sparse_step and mlp_only_layers, norm_topk_prob either way,
Qwen2-MoE's gated shared expert and q/k/v biases; fp32, CPU, dropless):

* HF -> ptdp through `ptdp convert --from-hf`: the one-process model built
  from the checkpoint gives transformers' logits within atol 1e-5, from the
  per-expert layout save_pretrained writes (one shape sharded) and from the
  fused layout transformers 5 holds in memory;
* ptdp -> HF through `ptdp convert --to-hf`: `from_pretrained` gives ours;
* what ptdp cannot compute is refused, naming the key.
"""

import json

import pytest
import torch
from torch.testing import assert_close

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.interop.hf_directory import load_hf_directory
from ptdp.interop.hf_moe import from_hf_state, to_hf_state
from ptdp.interop.hf_moe_config import (
    ConversionError,
    family_of_model,
    hf_config_from_model_config,
    model_config_from_hf_config,
)
from ptdp.interop.logical import logical_shapes
from ptdp.checkpoint.store import load_logical_model, save_logical_model
from tests.test_hf_llama import TOL, VOCAB, _hf_logits, _logical_of, _our_logits, _ours, _tokens

transformers = pytest.importorskip("transformers")

# transformers' default grouped_mm refuses expert widths whose rows are not
# 16-byte aligned on CPU; its eager loop computes the same function.
EAGER = dict(experts_implementation="eager")
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "qwen2_moe": "Qwen2MoeForCausalLM"}

# (name, model_type, config fields beyond the common ones)
HF_SHAPES = [
    ("mixtral-e3-k2-gqa-untied-odd-width-sharded", "mixtral",
     dict(num_local_experts=3, num_experts_per_tok=2, intermediate_size=13, num_key_value_heads=2,
          tie_word_embeddings=False, router_aux_loss_coef=0.02)),
    ("mixtral-e5-k4-tied-head-dim-12", "mixtral",
     dict(num_local_experts=5, num_experts_per_tok=4, intermediate_size=16, head_dim=12,
          num_key_value_heads=4,
          tie_word_embeddings=True, num_hidden_layers=1)),
    ("qwen3-e5-k1-unnormalised-step2-head-dim-12", "qwen3_moe",
     dict(num_experts=5, num_experts_per_tok=1, norm_topk_prob=False, moe_intermediate_size=11,
          intermediate_size=24, decoder_sparse_step=2, num_hidden_layers=3, head_dim=12,
          num_key_value_heads=1, tie_word_embeddings=True)),
    ("qwen3-e7-k3-normalised-dense-first-llama3-rope", "qwen3_moe",
     dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, moe_intermediate_size=9,
          intermediate_size=20, mlp_only_layers=[0], num_key_value_heads=2,
          tie_word_embeddings=False,
          rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})),
    ("qwen2-e3-k2-shared-qkv-bias-step2", "qwen2_moe",
     dict(num_experts=3, num_experts_per_tok=2, norm_topk_prob=False, moe_intermediate_size=7,
          shared_expert_intermediate_size=19, intermediate_size=24, decoder_sparse_step=2,
          num_key_value_heads=2, tie_word_embeddings=False, qkv_bias=True)),
    ("qwen2-e4-k4-shared-no-bias-dense-last", "qwen2_moe",
     dict(num_experts=4, num_experts_per_tok=4, norm_topk_prob=True, moe_intermediate_size=10,
          shared_expert_intermediate_size=12, intermediate_size=16, mlp_only_layers=[1],
          num_key_value_heads=4, tie_word_embeddings=True, qkv_bias=False)),
]


def _hf_config(model_type, **changes):
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    fields.update(changes)
    fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    return transformers.AutoConfig.for_model(model_type, **fields)


def _hf_model(config, seed=3):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, **EAGER).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # away from 0 and 1, so a swap would show
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):  # routers (and the shared gate) far from ties
                param.normal_(0.0, 1.0)
    return model


# ------------------------------------------------------------------ HF -> ptdp

@pytest.mark.parametrize("name, model_type, changes", HF_SHAPES, ids=[s[0] for s in HF_SHAPES])
def test_hf_to_ours_through_convert(tmp_path, name, model_type, changes):
    hf = _hf_model(_hf_config(model_type, **changes))
    directory, save = tmp_path / "hf", tmp_path / "ckpt"
    sharded = "sharded" in name
    hf.save_pretrained(str(directory), **({"max_shard_size": "40KB"} if sharded else {}))
    assert sharded == (directory / "model.safetensors.index.json").is_file()
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0

    config, weights, _ = load_logical_model(save)
    model = config.model
    experts = changes.get("num_local_experts", changes.get("num_experts"))
    assert (model.num_experts, model.moe_router_topk, model.tied_output) == \
        (experts, changes["num_experts_per_tok"], changes["tie_word_embeddings"])
    assert model.moe_router_pre_softmax == (changes.get("norm_topk_prob", True) is False)
    assert model.moe_layer_pattern == [bool(x) for x in _hf_sparse_layers(hf)]
    assert family_of_model(model).lower().replace("-", "_") == model_type
    tokens = _tokens()
    assert (_our_logits(_ours(model, seed=9), tokens) - _hf_logits(hf, tokens)).abs().max() > 1e-2
    assert_close(_our_logits(_ours(model, weights), tokens), _hf_logits(hf, tokens), **TOL)

    # the fused layout transformers 5 holds in memory gives the same tensors
    fused = hf.state_dict()
    assert any(key.endswith("experts.gate_up_proj") for key in fused)
    logical = from_hf_state(fused, model, _family(model_type))
    assert logical.keys() == weights.keys() == set(logical_shapes(model))
    assert all(torch.equal(logical[key], weights[key]) for key in logical)


def _family(model_type):
    return {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE"}[model_type]


def _hf_sparse_layers(hf):
    return [int(hasattr(layer.mlp, "experts")) for layer in hf.model.layers]


def test_a_directory_in_the_fused_layout_is_read(tmp_path):
    from safetensors.torch import save_file

    hf = _hf_model(_hf_config("qwen2_moe", **HF_SHAPES[4][2]))
    hf.save_pretrained(str(tmp_path / "published"))
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_bytes((tmp_path / "published" / "config.json").read_bytes())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              str(fused / "model.safetensors"))
    config, fused_weights = load_hf_directory(fused)
    _, published = load_hf_directory(tmp_path / "published")
    assert all(torch.equal(fused_weights[k], published[k]) for k in published)
    tokens = _tokens(seed=8)
    assert_close(_our_logits(_ours(config, fused_weights), tokens), _hf_logits(hf, tokens), **TOL)


# ------------------------------------------------------------------ ptdp -> HF

def _moe_model_config(**changes):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                  seq_length=32, hidden_dropout=0.0, attention_dropout=0.0,
                  normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  disable_bias_linear=True, ffn_hidden_size=24)
    fields.update(changes)
    return ModelConfig(**fields)


OUR_SHAPES = [
    ("mixtral-e3-k2-gqa-untied-odd-width", "MixtralForCausalLM",
     dict(num_experts=3, moe_router_topk=2, moe_ffn_hidden_size=13, group_query_attention=True,
          num_query_groups=2, untie_embeddings_and_output_weights=True, moe_aux_loss_coeff=0.01)),
    ("qwen3-e5-k1-pre-softmax-dense-first-head-dim-12", "Qwen3MoeForCausalLM",
     dict(num_experts=5, moe_router_topk=1, moe_router_pre_softmax=True, moe_ffn_hidden_size=9,
          moe_layer_freq="[0,1]", qk_layernorm=True, kv_channels=12, rotary_base=500.0)),
    ("qwen2-e5-k3-shared-gate-qkv-bias-dense-last", "Qwen2MoeForCausalLM",
     dict(num_experts=5, moe_router_topk=3, moe_ffn_hidden_size=7, moe_layer_freq="[1,0]",
          moe_shared_expert_intermediate_size=19, moe_shared_expert_gate=True, add_qkv_bias=True,
          group_query_attention=True, num_query_groups=1,
          untie_embeddings_and_output_weights=True)),
]


@pytest.mark.parametrize("name, hf_class, changes", OUR_SHAPES, ids=[s[0] for s in OUR_SHAPES])
def test_ours_to_hf_through_convert(tmp_path, name, hf_class, changes):
    config = _moe_model_config(**changes)
    logical = _logical_of(_ours(config, seed=11), config)
    generator = torch.Generator().manual_seed(2)
    for key, tensor in logical.items():
        if "norm" in key or key.endswith("bias"):
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
        elif key.endswith("router.weight") or key.endswith("shared_expert_gate"):
            tensor.normal_(0.0, 1.0, generator=generator)
    save, directory = tmp_path / "ckpt", tmp_path / "hf"
    save_logical_model(save, Config(model=config, data=DataConfig(mock_data=True)), logical)
    assert main(["convert", "--load", str(save), "--to-hf", str(directory)]) == 0
    hf_config = json.loads((directory / "config.json").read_text())
    assert hf_config["architectures"] == [hf_class]

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True,
                                                           **EAGER).eval()
    assert type(hf).__name__ == hf_class
    assert _hf_sparse_layers(hf) == [int(x) for x in config.moe_layer_pattern]
    tokens = _tokens(seed=6)
    assert_close(_hf_logits(hf, tokens), _our_logits(_ours(config, logical), tokens), **TOL)
    back = from_hf_state(to_hf_state(logical, config), config)
    assert all(torch.equal(back[key], logical[key]) for key in logical)
    # and its config.json reads back as the same model
    again = model_config_from_hf_config(hf_config)
    for field in ("num_experts", "moe_router_topk", "moe_ffn_size", "moe_layer_pattern",
                  "moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
                  "moe_shared_expert_gate", "qk_layernorm", "qkv_bias", "head_dim",
                  "query_groups", "tied_output", "rotary_base", "moe_aux_loss_coeff",
                  *(() if all(config.moe_layer_pattern) else ("ffn_size",))):  # dense layers' width
        assert getattr(again, field) == getattr(config, field), field


def test_export_refuses_a_model_no_family_fits():
    config = _moe_model_config(num_experts=4, moe_router_pre_softmax=True)
    with pytest.raises(ConversionError) as error:
        hf_config_from_model_config(config)
    message = str(error.value)
    assert "not Mixtral: --moe-router-pre-softmax (Mixtral renormalises" in message
    assert "not Qwen3-MoE: no --qk-layernorm" in message
    assert "not Qwen2-MoE: no --moe-shared-expert-intermediate-size" in message


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("model_type, changes, message", [
    ("mixtral", dict(sliding_window=16), r"sliding_window=16 is not supported"),
    ("mixtral", dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1 is not supported"),
    ("mixtral", dict(num_experts_per_tok=1), r"num_experts_per_tok=1 with renormalised"),
    ("qwen3_moe", dict(use_sliding_window=True), r"use_sliding_window=True is not supported"),
    ("qwen3_moe", dict(attention_bias=True), r"attention_bias=True is not supported"),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     r"rope_parameters has rope_type 'yarn'"),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                        "low_freq_factor": 2.0}),
     r"rope_parameters.low_freq_factor=2.0 is not supported"),
    ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=True), r"norm_topk_prob=true"),
    ("qwen3_moe", dict(decoder_sparse_step=5), r"decoder_sparse_step=5 .* leave no MoE layer"),
    ("qwen2_moe", dict(layer_types=["sliding_attention", "full_attention"]),
     r"layer_types=.* is not supported"),
    ("qwen2_moe", dict(num_experts_per_tok=9), r"num_experts_per_tok 9 exceeds the 4 experts"),
    ("deepseek_v3", dict(), r"model_type 'deepseek_v3' is not an MoE family"),
])
def test_refuses_what_ptdp_cannot_compute(model_type, changes, message):
    base = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
            "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              intermediate_size=16),
            "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              intermediate_size=16, shared_expert_intermediate_size=8),
            "deepseek_v3": dict()}[model_type]
    hf = dict(model_type=model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=32, **base)
    hf.update(changes)
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf_config(hf)


def test_the_tokenizer_travels_both_ways(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = _hf_model(_hf_config("qwen2_moe", **HF_SHAPES[5][2], bos_token_id=0, eos_token_id=1))
    directory, save, export = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf.save_pretrained(str(directory))
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0
    assert load_logical_model(save)[0].data.tokenizer_type == "HuggingFaceTokenizer"
    assert main(["convert", "--load", str(save), "--to-hf", str(export)]) == 0
    assert (export / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    config = json.loads((export / "config.json").read_text())
    assert (config["architectures"], config["bos_token_id"], config["eos_token_id"]) == \
        (["Qwen2MoeForCausalLM"], 0, 1)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True,
                                                             **EAGER).eval()
    tokens = _tokens(seed=9)
    assert_close(_hf_logits(back, tokens), _hf_logits(hf, tokens), **TOL)


def test_refuses_tensors_that_disagree_with_the_config():
    hf = _hf_model(_hf_config("qwen3_moe", **HF_SHAPES[3][2]))
    state = hf.state_dict()  # the fused layout
    wrong = model_config_from_hf_config({**hf.config.to_dict(), "num_experts": 6,
                                         "num_local_experts": 6})
    with pytest.raises(ConversionError, match=r"num_experts=6, but the tensors' number of "
                                              r"experts is 7 \(layers\.1\.mlp\.gate\.weight"):
        from_hf_state(state, wrong, "Qwen3-MoE")
    config = model_config_from_hf_config(hf.config.to_dict())
    state["model.layers.1.mlp.experts.down_proj"] = torch.zeros(7, 32, 8)
    with pytest.raises(ConversionError, match=r"moe_intermediate_size=9, but the tensors' expert "
                                              r"width is 8"):
        from_hf_state(state, config, "Qwen3-MoE")
    state = hf.state_dict()
    del state["model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(ConversionError, match=r"missing: layers\.1\.mlp\.experts\.0\."
                                              r"down_proj\.weight"):
        from_hf_state(state, config, "Qwen3-MoE")


def test_a_mixtral_trained_at_t2_ep2_with_the_printed_command_exports_what_it_learned(
        tmp_path, capsys):
    """`ptdp convert --from-hf` on a Mixtral, then the command it prints
    (5 iterations filled in), at t = 2 with EP = 2 over the tensor ranks;
    the trained checkpoint exported again: transformers' logits equal the
    one-process model's of that checkpoint, which differ from the imported
    weights' (it trained)."""
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    hf = _hf_model(_hf_config("mixtral", num_local_experts=4, num_experts_per_tok=2,
                              intermediate_size=16, num_key_value_heads=2,
                              tie_word_embeddings=False))
    directory, save, trained, export = (tmp_path / name for name in ("hf", "ck", "run", "back"))
    hf.save_pretrained(str(directory))
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0
    printed = capsys.readouterr().out
    command = re.search(r"train with: (ptdp train .*?)(?:$| \()", printed, re.M).group(1)
    assert "--use-checkpoint-args" in command and "N" in shlex.split(command)
    words = [("5" if word == "N" else word) for word in shlex.split(command)]
    assert words[:2] == ["ptdp", "train"]
    layout = ["-t", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
              "--sequence-parallel", "--seq-length", "16", "--lr", "1e-3", "--save", str(trained)]
    result = subprocess.run([sys.executable, "-m", "ptdp", *words[1:], *layout],
                            cwd=Path(__file__).resolve().parents[1], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(t=2, p=1, d=1), experts over EP=2 × ETP=1" in result.stdout
    assert "iteration     5/5" in result.stdout

    assert main(["convert", "--load", str(trained), "--to-hf", str(export)]) == 0
    config, weights, _ = load_logical_model(trained)
    tokens = _tokens()
    ours = _our_logits(_ours(config.model, weights), tokens)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export), **EAGER).eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    assert_close(_hf_logits(back, tokens), ours, **TOL)
    assert (_hf_logits(hf, tokens) - ours).abs().max() > 1e-3  # the weights moved
