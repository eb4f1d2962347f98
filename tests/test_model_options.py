"""The model options of Qwen and Llama 3.1 and Megatron-LM's older position
switches, as settings: --kv-channels, --qk-layernorm, --add-qkv-bias,
--use-rope-scaling / --rope-scaling-factor, --use-rotary-position-embeddings,
--no-position-embedding. That they compute under every layout what one
process computes: tests/test_llama.py (its Qwen-style model); that they
compute what transformers computes: the Hugging Face conversion tests."""

import math

import pytest
import torch

from ptdp.cli import build_parser
from ptdp.commands.train import config_from_args
from ptdp.config import ConfigError, validate
from ptdp.model.rotary import Rotary, llama3_frequencies
from ptdp.model.shapes import logical_shapes

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "64", "--seq-length", "16", "--train-iters", "1"]


def _config(*flags):
    return config_from_args(build_parser().parse_args(["train", *TINY, *flags]))


def _problems(*flags) -> str:
    with pytest.raises(ConfigError) as raised:
        validate(_config(*flags))
    return str(raised.value)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_frequencies_are_transformers(factor):
    """Against transformers' own llama3 rope initialisation, for a head width
    and base whose frequencies fall in all three bands."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": factor, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    ours = llama3_frequencies(plain, factor)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0.0)
    wavelengths = 2 * math.pi / plain
    assert (wavelengths < 2048).any() and (wavelengths > 8192).any() \
        and ((wavelengths > 2048) & (wavelengths < 8192)).any()
    cos, _ = Rotary(128, 500000.0, scaling_factor=factor).tables(4, torch.device("cpu"),
                                                                torch.float32)
    assert torch.allclose(cos[1, :64], torch.cos(expected.float()))


def test_wider_heads_qk_norms_and_qkv_biases_shape_the_model():
    config = _config("--kv-channels", "16", "--qk-layernorm", "--add-qkv-bias",
                     "--disable-bias-linear", "--normalization", "RMSNorm")
    validate(config)
    shapes = logical_shapes(config.model)
    assert shapes["layers.0.attention.query_key_value.weight"] == (3 * 4 * 16, 32)
    assert shapes["layers.0.attention.query_key_value.bias"] == (3 * 4 * 16,)
    assert shapes["layers.0.attention.dense.weight"] == (32, 4 * 16)
    assert "layers.0.attention.dense.bias" not in shapes
    assert shapes["layers.0.attention.q_layernorm.weight"] == (16,)
    assert shapes["layers.0.attention.k_layernorm.weight"] == (16,)
    assert "layers.0.attention.q_layernorm.bias" not in shapes  # RMSNorm
    assert "layers.0.mlp.dense_h_to_4h.bias" not in shapes


def test_megatrons_older_position_switches():
    """--use-rotary-position-embeddings is rope; --no-position-embedding goes
    with it (Megatron-LM's older scripts give both) and is refused alone."""
    config = _config("--use-rotary-position-embeddings", "--no-position-embedding")
    validate(config)
    assert config.model.rope
    assert "embedding.position_embeddings.weight" not in logical_shapes(config.model)
    assert ("--no-position-embedding leaves the model without positions"
            in _problems("--no-position-embedding"))


def test_bad_option_values_are_refused_with_the_fix():
    assert ("--use-rope-scaling rescales rotary frequencies, but the model has "
            "--position-embedding-type learned_absolute" in _problems("--use-rope-scaling"))
    assert "--rope-scaling-factor=0.5 must be at least 1" in _problems(
        "--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "0.5")
    assert ("rope needs an even head dimension, but --kv-channels is 7: use an even "
            "--kv-channels" in _problems("--position-embedding-type", "rope", "--kv-channels", "7"))
