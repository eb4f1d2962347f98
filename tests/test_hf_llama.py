"""Hugging Face Llama interop, against transformers as the outside reference.

For random-weight LlamaForCausalLM models of several small shapes (grouped
and one key/value head per query head, tied and untied, odd MLP width,
rope_theta other than 10000, with and without biases; fp32, CPU):

* HF -> ptdp through `ptdp convert --from-hf`: the one-process model built
  from the checkpoint gives transformers' logits within atol 1e-5;
* ptdp -> HF through `ptdp convert --to-hf`: `from_pretrained` gives ours;
* `ptdp generate` (one process, and t = 2, p = 2) gives transformers'
  greedy tokens, with the directory's tokenizer.json carried by the
  checkpoint and exported again;
* every setting ptdp cannot compute is refused, naming the key.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.interop.hf_llama import (
    ConversionError,
    from_hf_state,
    hf_config_from_model_config,
    model_config_from_hf_config,
    to_hf_state,
)
from ptdp.interop.logical import logical_shapes
from ptdp.model.gpt import build_chunks
from ptdp.parallel.topology import ParallelContext
from ptdp.checkpoint.store import load_logical_model, save_logical_model

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=0.0, atol=1e-5)
VOCAB = 97

# (name, LlamaConfig fields beyond the common ones)
SHAPES = [
    ("gqa-untied-odd-ffn-theta500", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                         intermediate_size=37, rope_theta=500.0)),
    ("mha-tied-biases", dict(num_key_value_heads=4, tie_word_embeddings=True,
                             intermediate_size=48, attention_bias=True, mlp_bias=True)),
    ("mqa-untied-biases-theta1e6", dict(num_key_value_heads=1, tie_word_embeddings=False,
                                        intermediate_size=40, attention_bias=True, mlp_bias=True,
                                        rope_theta=1e6)),
]


def _hf_config(**changes):
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    theta = changes.pop("rope_theta", 10000.0)
    fields.update(changes, rope_parameters={"rope_type": "default", "rope_theta": theta})
    return transformers.LlamaConfig(**fields)


def _hf_model(config, seed=3):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swap would show
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _ours(config, logical=None, seed=1):
    """The one-process model; with `logical`, holding those weights (the
    vocabulary rows beyond vocab_size stay zero)."""
    model = build_chunks(config, ParallelContext.single(), torch.device("cpu"), seed=seed)[0].eval()
    if logical is not None:
        params = dict(model.named_parameters())
        assert set(params) == set(logical)
        with torch.no_grad():
            for name, param in params.items():
                param.zero_()
                param[tuple(slice(0, n) for n in logical[name].shape)].copy_(logical[name])
    return model


def _logical_of(model, config):
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in state:
            state[name] = state[name][:config.vocab_size]
    return state


def _tokens(seed=5, batch=2, length=20):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _our_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).transpose(0, 1)[..., :VOCAB]


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _llama_model_config(**changes):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                  seq_length=32, hidden_dropout=0.0, attention_dropout=0.0,
                  normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    fields.update(changes)
    return ModelConfig(**fields)


# ------------------------------------------------------------------ HF -> ptdp

@pytest.mark.parametrize("name, changes", SHAPES, ids=[s[0] for s in SHAPES])
def test_hf_to_ours_through_convert(tmp_path, name, changes):
    hf = _hf_model(_hf_config(**changes))
    directory, save = tmp_path / "hf", tmp_path / "ckpt"
    # one shape as Hugging Face writes large models: several safetensors files
    hf.save_pretrained(str(directory), **({"max_shard_size": "20KB"} if "mqa" in name else {}))
    assert ("mqa" in name) == (directory / "model.safetensors.index.json").is_file()
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0

    config, weights, metadata = load_logical_model(save)
    model = config.model
    assert metadata["iteration"] == 0 and config.data.mock_data  # no tokenizer.json here
    assert (model.query_groups, model.ffn_size, model.tied_output, model.bias, model.rotary_base) \
        == (changes["num_key_value_heads"], changes["intermediate_size"],
            changes["tie_word_embeddings"], changes.get("attention_bias", False),
            changes.get("rope_theta", 10000.0))
    ours = _ours(model, seed=9)
    tokens = _tokens()
    assert (_our_logits(ours, tokens) - _hf_logits(hf, tokens)).abs().max() > 1e-2
    ours = _ours(model, weights)
    assert_close(_our_logits(ours, tokens), _hf_logits(hf, tokens), **TOL)


def test_bare_keys_and_rotary_buffers_are_read():
    hf = _hf_model(_hf_config(num_key_value_heads=2, intermediate_size=48))
    config = model_config_from_hf_config(hf.config.to_dict())
    prefixed = from_hf_state(hf.state_dict(), config)
    bare = dict(hf.model.state_dict(), **{"lm_head.weight": hf.lm_head.weight.detach()})
    bare["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # as older checkpoints carry
    logical = from_hf_state(bare, config)
    assert logical.keys() == prefixed.keys() == set(logical_shapes(config))
    for name in logical:
        assert torch.equal(logical[name], prefixed[name]), name


# ------------------------------------------------------------------ ptdp -> HF

def _exported(tmp_path, config):
    """(config, logical state, directory): a random one-process model, its
    norms and biases moved away from 1 and 0, saved and exported by `ptdp
    convert --to-hf`."""
    logical = _logical_of(_ours(config, seed=11), config)
    generator = torch.Generator().manual_seed(2)
    for name, tensor in logical.items():
        if "norm" in name or name.endswith("bias"):
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
    save, directory = tmp_path / "ckpt", tmp_path / "hf"
    save_logical_model(save, Config(model=config, data=DataConfig(mock_data=True)), logical)
    assert main(["convert", "--load", str(save), "--to-hf", str(directory)]) == 0
    return config, logical, directory


@pytest.mark.parametrize("changes", [
    dict(group_query_attention=True, num_query_groups=2, untie_embeddings_and_output_weights=True,
         disable_bias_linear=True, ffn_hidden_size=37, rotary_base=1234.0),
    dict(ffn_hidden_size=48, norm_epsilon=1e-6),
], ids=["gqa-untied-no-bias", "mha-tied-biases"])
def test_ours_to_hf_through_convert(tmp_path, changes):
    config, logical, directory = _exported(tmp_path, _llama_model_config(**changes))
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]

    hf = transformers.LlamaForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
    assert hf.config.num_key_value_heads == config.query_groups
    assert hf.config.tie_word_embeddings == config.tied_output
    assert hf.config.rope_parameters["rope_theta"] == config.rotary_base
    tokens = _tokens(seed=6)
    assert_close(_hf_logits(hf, tokens), _our_logits(_ours(config, logical), tokens), **TOL)
    # and back, exactly
    back = from_hf_state(to_hf_state(logical, config), config)
    assert all(torch.equal(back[name], logical[name]) for name in logical)


def test_config_round_trip():
    config = _llama_model_config(group_query_attention=True, num_query_groups=2,
                                 ffn_hidden_size=40, rotary_base=5e5, norm_epsilon=1e-6,
                                 max_position_embeddings=64, init_method_std=0.01,
                                 attention_dropout=0.1)
    hf = hf_config_from_model_config(config, bos_token_id=1, eos_token_id=2)
    transformers.LlamaConfig(**hf)  # transformers accepts every field we write
    back = model_config_from_hf_config(hf, seq_length=32)
    for field in ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "vocab_size",
                  "max_positions", "seq_length", "epsilon", "rotary_base", "query_groups",
                  "tied_output", "bias", "normalization", "swiglu", "position_embedding_type",
                  "init_method_std", "attention_dropout"):
        assert getattr(back, field) == getattr(config, field), field


@pytest.mark.parametrize("rope", [
    dict(rope_theta=250.0),  # transformers 4's top-level form
    dict(rope_theta=250.0, rope_scaling=None),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 250.0}),  # transformers 5
    dict(rope_parameters={"rope_type": "default", "rope_theta": 250.0}, rope_theta=250.0),
    dict(rope_scaling={"type": "default"}, rope_theta=250.0),
])
def test_both_forms_of_the_rotary_settings(rope):
    hf = hf_config_from_model_config(_llama_model_config())
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        del hf[key]
    assert model_config_from_hf_config(hf).rotary_base == 10000.0
    assert model_config_from_hf_config({**hf, **rope}).rotary_base == 250.0


@pytest.mark.parametrize("rope", [
    dict(rope_theta=250.0, rope_scaling={"type": "linear", "factor": 2.0}),  # transformers 4
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 250.0}),
])
def test_both_forms_of_linear_interpolation(rope):
    """rope_type 'linear' is --rotary-seq-len-interpolation-factor, and the
    model computes what transformers' LlamaForCausalLM of that file does."""
    hf = hf_config_from_model_config(_llama_model_config())
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        del hf[key]
    hf.update(rope)
    config = model_config_from_hf_config(hf)
    assert (config.rotary_seq_len_interpolation_factor, config.rotary_base) == (2.0, 250.0)
    theirs = _hf_model(transformers.LlamaConfig(**hf))
    assert theirs.config.rope_parameters["rope_type"] == "linear"
    tokens = _tokens()
    assert_close(_our_logits(_ours(config, from_hf_state(theirs.state_dict(), config)), tokens),
                 _hf_logits(theirs, tokens), **TOL)


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     r"rope_scaling.low_freq_factor=2.0 is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0}),  # transformers falls back to 32 positions
     r"rope_scaling.original_max_position_embeddings=32 is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     r"rope_scaling.factor=0.5 must be a number of at least 1"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"rope_scaling has rope_type 'dynamic'"),
    (dict(rope_scaling={"type": "linear", "factor": -2.0}),
     r"rope_scaling.factor=-2.0 must be a positive number"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
          rope_scaling={"rope_type": "linear", "factor": 4.0}), r"rope_scaling=\('linear', 4\.0\) "
     r"and rope_parameters=\('linear', 2\.0\) disagree"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     r"rope_parameters has rope_type 'yarn'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rope_theta=600.0),
     r"rope_parameters.rope_theta=500.0 and rope_theta=600.0 disagree"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"rope_parameters has partial_rotary_factor=0.5"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     r"rope_parameters=.* holds settings per layer type"),
    (dict(head_dim=7), r"head_dim=7 must be a positive even integer"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(attention_bias=True, mlp_bias=False), r"attention_bias=True differs from mlp_bias=False"),
    (dict(sliding_window=16), r"sliding_window=16 is not supported"),
    (dict(num_key_value_heads=3), r"num_key_value_heads 3 does not divide num_attention_heads 4"),
    (dict(model_type="gemma"), r"model_type 'gemma' is not a dense family ptdp converts"),
    (dict(layer_types=["full_attention", "sliding_attention"]), r"layer_types=.* is not supported"),
])
def test_refuses_what_ptdp_cannot_compute(changes, message):
    hf = hf_config_from_model_config(_llama_model_config())
    hf.update(changes)
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf_config(hf)


def test_refuses_an_unknown_architecture(tmp_path, capsys):
    hf = hf_config_from_model_config(_llama_model_config())
    hf.update(architectures=["GemmaForCausalLM"], model_type="gemma")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert main(["convert", "--from-hf", str(tmp_path), "--save", str(tmp_path / "c")]) == 2
    error = capsys.readouterr().err
    assert "architectures ['GemmaForCausalLM'] with model_type 'gemma' is not an architecture" \
        in error
    for supported in ("LlamaForCausalLM", "GPT2LMHeadModel", "MistralForCausalLM",
                      "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in error


def test_refuses_mismatched_tensors():
    hf = _hf_model(_hf_config(num_key_value_heads=2, intermediate_size=48))
    config = model_config_from_hf_config(hf.config.to_dict())
    state = hf.state_dict()
    del state["lm_head.weight"]  # untied: the output layer is needed
    with pytest.raises(ConversionError, match="lm_head.weight is missing"):
        from_hf_state(state, config)
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.k_proj\.weight: \(32, 32\), "
                                              r"expected \(16, 32\)"):
        from_hf_state(state, config)


def test_export_refuses_a_model_of_neither_architecture(tmp_path, capsys):
    config = _llama_model_config(position_embedding_type="learned_absolute")
    save = tmp_path / "ckpt"
    save_logical_model(save, Config(model=config, data=DataConfig(mock_data=True)),
                       _logical_of(_ours(config), config))
    assert main(["convert", "--load", str(save), "--to-hf", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert "fits none of the Hugging Face classes ptdp writes (GPT-2, Llama, Mistral, Qwen2, " \
        "Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE, Gemma 3, gpt-oss, GLM-4.5, DeepSeek-V3)" in error
    assert "--normalization RMSNorm (GPT-2 has LayerNorm)" in error
    assert "--position-embedding-type learned_absolute (Llama has rotary embeddings)" in error
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------ generation, tokenizer

def _word_tokenizer(path, size):
    """A word-level tokenizer.json: <s>, </s>, then the words w0, w1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(size - 2)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(path))
    return tokenizer


def _generate(checkpoint, prompt, *flags, capsys=None):
    """`ptdp generate`'s greedy text. With `capsys` (one process: no launch),
    through ptdp's entry point in this process; else as a command of its own."""
    argv = ["generate", "--load", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "12",
            "--temperature", "0", *flags]
    if capsys is not None:
        capsys.readouterr()
        status = main(argv)
        out, err = capsys.readouterr()
        assert status == 0, err
        return out.strip()
    result = subprocess.run([sys.executable, "-m", "ptdp", *argv], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_greedy_generation_and_the_tokenizer_travel(tmp_path, capsys):
    hf = _hf_model(_hf_config(num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=False,
                              rope_theta=5000.0, bos_token_id=0, eos_token_id=1), seed=4)
    directory, save, export = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf.save_pretrained(str(directory))
    tokenizer = _word_tokenizer(directory / "tokenizer.json", VOCAB)
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0

    prompt = "w5 w17 w60 w3"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, pad_token_id=1)
    new = out[0, len(ids):].tolist()
    new = new[:new.index(1)] if 1 in new else new  # ptdp stops before the end-of-text token
    assert len(new) >= 6
    expected = tokenizer.decode(new, skip_special_tokens=False)
    # The prompt is echoed before the continuation (--no-echo-prompt: the continuation alone).
    assert _generate(save, prompt, capsys=capsys) == tokenizer.decode(ids + new,
                                                                      skip_special_tokens=False)
    assert _generate(save, prompt, "-t", "2", "-p", "2", "--no-echo-prompt") == expected

    # exported again: the tokenizer goes along, with bos/eos in both configs
    assert main(["convert", "--load", str(save), "--to-hf", str(export)]) == 0
    assert (export / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    config = json.loads((export / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    auto = transformers.AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    assert auto.encode(prompt, add_special_tokens=False) == ids
    assert (auto.bos_token, auto.eos_token) == ("<s>", "</s>")
    back = transformers.LlamaForCausalLM.from_pretrained(str(export), local_files_only=True).eval()
    tokens = _tokens(seed=9)
    assert_close(_hf_logits(back, tokens), _hf_logits(hf, tokens), **TOL)
