"""Hugging Face GPT-2 interop: converted weights compute the same logits.

Against a randomly initialised transformers.GPT2LMHeadModel (fp32, CPU, no
dropout): HF -> ptdp and ptdp -> HF give logits equal to atol 1e-5 (observed
differences are rounding, about 1e-6), through state dicts and through a
directory that `from_pretrained` reads offline.
"""

import json
import re

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import ModelConfig
from ptdp.interop.hf_directory import load_hf_directory, save_hf_directory
from ptdp.interop.hf_gpt2 import (
    ConversionError,
    from_hf_state,
    hf_config_from_model_config,
    logical_shapes,
    model_config_from_hf_config,
    to_hf_state,
)
from ptdp.model.gpt import build_chunks
from ptdp.parallel.topology import ParallelContext

transformers = pytest.importorskip("transformers")

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                     seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
TOL = dict(rtol=0.0, atol=1e-5)


def _hf_config(**changes):
    fields = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=16, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
                  bos_token_id=None, eos_token_id=None)
    fields.update(changes)
    return transformers.GPT2Config(**fields)


def _hf_model(seed=3):
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(_hf_config()).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a swap would show
        for name, param in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _ours(config=CONFIG, seed=1):
    return build_chunks(config, ParallelContext.single(), torch.device("cpu"), seed=seed)[0].eval()


def _load_logical(model, logical):
    """Copy a logical state into a one-process model, padding the vocabulary with zeros."""
    params = dict(model.named_parameters())
    assert set(params) == set(logical)
    with torch.no_grad():
        for name, param in params.items():
            param.zero_()
            param[tuple(slice(0, n) for n in logical[name].shape)].copy_(logical[name])


def _logical_of(model, config=CONFIG):
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    name = "embedding.word_embeddings.weight"
    state[name] = state[name][:config.vocab_size]
    return state


def _tokens(seed=5, batch=3, length=16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (batch, length), generator=generator)


def _our_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).transpose(0, 1)[..., :CONFIG.vocab_size]


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_logical_shapes_match_the_model():
    shapes = {n: tuple(p.shape) for n, p in _ours().named_parameters()}
    shapes["embedding.word_embeddings.weight"] = (CONFIG.vocab_size, CONFIG.hidden_size)
    assert logical_shapes(CONFIG) == shapes


def test_hf_to_ours_same_logits():
    hf = _hf_model()
    config = model_config_from_hf_config(hf.config.to_dict())
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_size,
            config.vocab_size, config.max_positions) == (2, 32, 4, 128, 100, 16)
    ours = _ours(config, seed=9)
    tokens = _tokens()
    assert (_our_logits(ours, tokens) - _hf_logits(hf, tokens)).abs().max() > 1e-2
    _load_logical(ours, from_hf_state(hf.state_dict(), config))
    assert_close(_our_logits(ours, tokens), _hf_logits(hf, tokens), **TOL)


def test_ours_to_hf_same_logits():
    ours = _ours()
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**hf_config_from_model_config(CONFIG))).eval()
    hf.load_state_dict(to_hf_state(_logical_of(ours), CONFIG), strict=True)
    tokens = _tokens(seed=6)
    assert_close(_hf_logits(hf, tokens), _our_logits(ours, tokens), **TOL)


def test_bare_keys_and_mask_buffers():
    hf = _hf_model()
    bare = dict(hf.transformer.state_dict())
    assert not any(k.startswith("transformer.") for k in bare)
    # the causal-mask buffers that the original gpt2 checkpoints carry
    bare["h.0.attn.bias"] = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    bare["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    config = model_config_from_hf_config(hf.config.to_dict())
    logical = from_hf_state(bare, config)
    prefixed = from_hf_state(hf.state_dict(), config)
    assert logical.keys() == prefixed.keys()
    for name in logical:
        assert torch.equal(logical[name], prefixed[name]), name
    ours = _ours(config)
    _load_logical(ours, logical)
    tokens = _tokens(seed=7)
    assert_close(_our_logits(ours, tokens), _hf_logits(hf, tokens), **TOL)


def test_round_trip_through_state_is_exact():
    logical = _logical_of(_ours())
    back = from_hf_state(to_hf_state(logical, CONFIG), CONFIG)
    assert back.keys() == logical.keys()
    for name in logical:
        assert torch.equal(back[name], logical[name]), name


def test_directory_round_trip_and_from_pretrained(tmp_path):
    ours = _ours()
    logical = _logical_of(ours)
    directory = tmp_path / "export"
    save_hf_directory(directory, logical, CONFIG)
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary left behind

    config, loaded = load_hf_directory(directory)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.vocab_size,
            config.max_positions, config.ffn_size) == (2, 32, 4, 100, 16, 128)
    for name in logical:
        assert torch.equal(loaded[name], logical[name]), name

    hf = transformers.GPT2LMHeadModel.from_pretrained(str(directory), local_files_only=True).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    tokens = _tokens(seed=8)
    assert_close(_hf_logits(hf, tokens), _our_logits(ours, tokens), **TOL)

    # and a directory Hugging Face wrote, sharded into several safetensors files
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    _, from_shards = load_hf_directory(sharded)
    for name in logical:
        assert_close(from_shards[name], logical[name], rtol=0, atol=0)


def test_save_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "old.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="not an empty directory"):
        save_hf_directory(tmp_path, _logical_of(_ours()), CONFIG)
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]


def test_refuses_missing_unexpected_and_misshapen_keys():
    state = _hf_model().state_dict()
    missing = {k: v for k, v in state.items() if k != "transformer.h.1.mlp.c_fc.bias"}
    with pytest.raises(ConversionError, match=r"missing: h\.1\.mlp\.c_fc\.bias"):
        from_hf_state(missing, CONFIG)
    extra = dict(state, **{"transformer.h.1.ln_3.weight": torch.ones(32)})
    with pytest.raises(ConversionError, match=r"unexpected: h\.1\.ln_3\.weight"):
        from_hf_state(extra, CONFIG)
    # a layer more than config.json says: the config is named, not the tensors
    extra = dict(state, **{"transformer.h.2.ln_1.weight": torch.ones(32)})
    with pytest.raises(ConversionError, match=r"n_layer=2, but the tensors hold 3 layers "
                                              r"\(h\.0 to h\.2\)"):
        from_hf_state(extra, CONFIG)
    wrong = dict(state, **{"transformer.h.0.attn.c_attn.weight": torch.zeros(96, 32)})
    with pytest.raises(ConversionError, match=r"h\.0\.attn\.c_attn\.weight: \(96, 32\), expected \(32, 96\)"):
        from_hf_state(wrong, CONFIG)
    untied = dict(state, **{"lm_head.weight": state["lm_head.weight"] + 1})
    with pytest.raises(ConversionError, match="lm_head.weight differs"):
        from_hf_state(untied, CONFIG)
    # ours -> HF wants the logical (unpadded) word embedding
    padded = _logical_of(_ours())
    padded["embedding.word_embeddings.weight"] = torch.zeros(128, 32)
    with pytest.raises(ConversionError, match="unpadded"):
        to_hf_state(padded, CONFIG)


@pytest.mark.parametrize("changes, message", [
    (dict(activation_function="relu"), "activation_function 'relu' is not supported"),
    (dict(activation_function="gelu"), "activation_function 'gelu' is not supported"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    (dict(scale_attn_weights=False), "scale_attn_weights"),
    (dict(tie_word_embeddings=False), "untied"),
    (dict(model_type="llama"), "model_type 'llama'"),
    (dict(n_head=5), "not divisible by n_head 5"),
    (dict(embd_pdrop=0.2), "embd_pdrop"),
])
def test_refuses_unsupported_configs(changes, message):
    hf = hf_config_from_model_config(CONFIG)
    hf.update(changes)
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf_config(hf)


def test_config_round_trip_and_defaults():
    config = ModelConfig(num_layers=3, hidden_size=48, num_attention_heads=6, ffn_hidden_size=100,
                         vocab_size=50257, seq_length=32, max_position_embeddings=64,
                         hidden_dropout=0.05, attention_dropout=0.02, layernorm_epsilon=1e-6)
    hf = hf_config_from_model_config(config)
    assert hf["eos_token_id"] == hf["bos_token_id"] == 50256
    assert hf["activation_function"] == "gelu_new" and hf["tie_word_embeddings"]
    back = model_config_from_hf_config(hf, seq_length=32)
    for field in ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "vocab_size",
                  "max_positions", "seq_length", "hidden_dropout", "attention_dropout",
                  "layernorm_epsilon"):
        assert getattr(back, field) == getattr(config, field), field
    # n_inner null means 4·n_embd; gelu_pytorch_tanh is the same function
    hf.update(n_inner=None, activation_function="gelu_pytorch_tanh")
    assert model_config_from_hf_config(hf).ffn_size == 4 * 48


def test_load_refuses_pickle_only_and_bad_directories(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model_config(CONFIG)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConversionError, match="pytorch_model.bin.*safetensors"):
        load_hf_directory(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ConversionError, match="neither model.safetensors"):
        load_hf_directory(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="no config.json"):
        load_hf_directory(tmp_path / "empty")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"wte.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConversionError, match="missing from"):
        load_hf_directory(tmp_path)


def test_load_reports_the_directory_on_a_mismatch(tmp_path):
    directory = tmp_path / "m"
    save_hf_directory(directory, _logical_of(_ours()), CONFIG)
    config = json.loads((directory / "config.json").read_text())
    config["n_layer"] = 3
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=re.escape(f"{directory}: config.json does not "
                                                        f"match the tensors of the weight files: "
                                                        f"n_layer=3, but the tensors hold 2 layers")):
        load_hf_directory(directory)


def test_convert_carries_the_directory_tokenizer(tmp_path):
    """A tokenizer.json beside the weights goes into the checkpoint and out
    again, with a tokenizer_config.json and bos/eos from its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ptdp.cli import main
    from ptdp.checkpoint.store import checkpoint_tokenizer, load_logical_model

    directory, save, export = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    _hf_model().save_pretrained(str(directory))
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(CONFIG.vocab_size - 1)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))

    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0
    carried = checkpoint_tokenizer(save)
    assert carried.read_bytes() == (directory / "tokenizer.json").read_bytes()
    assert load_logical_model(save)[0].data.tokenizer_type == "HuggingFaceTokenizer"
    assert main(["convert", "--load", str(save), "--to-hf", str(export)]) == 0
    assert (export / "tokenizer.json").read_bytes() == carried.read_bytes()
    config = json.loads((export / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 0
    auto = transformers.AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    assert auto.encode("w3 w7", add_special_tokens=False) == [4, 8]
    assert auto.eos_token == auto.bos_token == "<|endoftext|>"
