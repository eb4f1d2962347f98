"""The adapter contract: every family the directory reader and writer use
provides what ptdp.interop.family.HFFamily says, and adding a family is one
object entered in HF_FAMILIES (a toy one here, in this test alone). The
directories are written by ptdp's own writer (no transformers needed)."""

import json
import re

import pytest
import torch

from ptdp.config import ModelConfig
from ptdp.interop import hf_gpt2
from ptdp.interop.family import HFFamily
from ptdp.interop.hf_directory import (HF_FAMILIES, family_for_export, family_for_import,
                                       load_hf_directory, save_hf_directory)
from ptdp.interop.hf_files import ConversionError
from ptdp.interop.logical import logical_shapes

TINY = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=10,
                   seq_length=4)


def test_every_registered_family_provides_the_contract():
    assert list(HF_FAMILIES) == ["GPT-2", "Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral",
                                 "Qwen3-MoE", "Qwen2-MoE", "Gemma 3", "gpt-oss", "GLM-4.5",
                                 "DeepSeek-V3"]
    for name, family in HF_FAMILIES.items():
        assert isinstance(family, HFFamily), name
        assert family.name == name
        assert family.classes[0].endswith(("ForCausalLM", "LMHeadModel")), family.classes
        assert isinstance(family.model_type, str) and isinstance(family.exported, bool)
        assert family.prefix.endswith(".") and isinstance(family.ignored, re.Pattern)
    assert all(family.exported for family in HF_FAMILIES.values())  # (Mistral: when windowed)


class ToyFamily:
    """GPT-2's tensors under another class and model_type: a family that
    exists only in this test."""
    name, classes, model_type, exported = "Toy", ("ToyLMHeadModel",), "toy", False
    prefix, ignored = hf_gpt2.GPT2.prefix, hf_gpt2.GPT2.ignored

    def obstacles(self, config):
        return ["the toy family is never written"]

    def hf_config(self, config, *, bos_token_id=None, eos_token_id=None):
        raise AssertionError("never exported")

    def model_config(self, hf_config, **overrides):
        return hf_gpt2.model_config_from_hf_config({**hf_config, "model_type": "gpt2"},
                                                   **overrides)

    to_hf_state = staticmethod(hf_gpt2.to_hf_state)
    check_hf_tensors = staticmethod(hf_gpt2.check_hf_tensors)
    from_hf_state = staticmethod(hf_gpt2.from_hf_state)


def test_a_family_is_one_registered_object(tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    logical = {name: torch.randn(shape, generator=generator)
               for name, shape in logical_shapes(TINY).items()}
    directory = tmp_path / "toy"
    save_hf_directory(directory, logical, TINY)
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(
        {**hf, "architectures": ["ToyLMHeadModel"], "model_type": "toy"}))
    with pytest.raises(ConversionError, match=r"architectures \['ToyLMHeadModel'\] with "
                                              r"model_type 'toy' is not an architecture"):
        load_hf_directory(directory)

    toy = ToyFamily()
    assert isinstance(toy, HFFamily)
    monkeypatch.setitem(HF_FAMILIES, toy.name, toy)
    assert family_for_import({"model_type": "toy"}, directory) is toy
    assert family_for_export(TINY) is hf_gpt2.GPT2  # the toy family exports nothing
    config, loaded = load_hf_directory(directory, seq_length=2)
    assert (config.num_layers, config.hidden_size, config.seq_length) == (1, 8, 2)
    assert loaded.keys() == logical.keys()
    for name in logical:
        assert torch.equal(loaded[name], logical[name]), name
