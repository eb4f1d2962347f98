"""docs/megatron-flags.md's flag set for each model family (issue 43) is the
model ptdp's import of the published config.json gives: each command of the
`family-flags` block, parsed as `ptdp train` parses it, has every model
setting equal to `ptdp convert --from-hf`'s reading of that family's
config.json as published (gpt-oss-20b, Gemma 3 1B, Mistral 7B v0.1), its
keys transformers ignores included. Aside: --seq-length, a training setting
(an import sets it to max_position_embeddings), and the window pattern's
form (--window-attn-skip-freq 2 or the import's explicit list), compared
as the layers it windows."""

import dataclasses
import shlex

import pytest

from ptdp import cli
from ptdp.commands.train import config_from_args
from ptdp.config import validate
from ptdp.interop.hf_directory import family_for_import
from tests.doc_commands import commands

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}
GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}
PUBLISHED = [GPT_OSS_20B, GEMMA_3_1B, MISTRAL_7B]


ASIDE = {"seq_length", "window_attn_skip_freq"}


def _differences(got, want) -> dict:
    return {field.name: (getattr(got, field.name), getattr(want, field.name))
            for field in dataclasses.fields(want)
            if field.name not in ASIDE and getattr(got, field.name) != getattr(want, field.name)}


@pytest.mark.parametrize("index", range(len(PUBLISHED)))
def test_each_documented_flag_set_is_the_imported_model(index):
    shown = commands("family-flags")
    assert len(shown) == len(PUBLISHED)
    words = shlex.split(shown[index])
    assert words[:2] == ["ptdp", "train"]
    config = config_from_args(cli.build_parser().parse_args(words[1:]))
    hf = PUBLISHED[index]
    imported = family_for_import(hf, "config.json").model_config(hf)
    assert _differences(config.model, imported) == {}
    # the layers' windows as the file gives them (the pattern written either way)
    assert config.model.windowed_layers == imported.windowed_layers
    config.data = dataclasses.replace(config.data, mock_data=True)
    validate(config)   # a command that runs (on enough memory)


def test_ptdp_plan_takes_each_flag_set(capsys):
    """`ptdp plan` takes the flag sets as they are (the MoE loss coefficient
    too: the balancing loss's softmax is part of what the router keeps)."""
    for command in commands("family-flags"):
        words = shlex.split(command)[2:]
        assert cli.main(["plan", *words, "--gpus", "8", "--global-batch-size", "16",
                         "--seq-length", "4096", "--data-parallel-size", "8",
                         "--micro-batch-size", "1", "--fix-all"]) == 0, capsys.readouterr().err
    assert "TFLOP/s" in capsys.readouterr().out


def test_sinks_and_sandwich_norms_are_priced():
    """A layer's memory-bound passes gain a read and a write of the attention
    output each way for the sinks' rescale, and two norms for --sandwich-norm."""
    from ptdp.config import ModelConfig
    from ptdp.perf.layout import Layout, Workload
    from ptdp.perf.price.machine import Machine
    from ptdp.perf.price.operator_bytes import layer_norm_bytes
    from ptdp.perf.price.pricing import OperatorModel
    from ptdp.perf.price.profiles import load_profile

    base = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                       vocab_size=32000, normalization="RMSNorm", attention_dropout=0.0)
    layout, profile = Layout(t=2, b=1, d=1), load_profile("h100")

    def ops(model):
        return OperatorModel(Workload(model, 8, "bf16"), layout, profile,
                             Machine(layout, profile)).layer_memory()

    plain = ops(base)
    sinks = ops(dataclasses.replace(base, softmax_type="learnable"))
    output = 1 * 2048 * 16 * 64 // 2                     # b·s·a·d/t, bf16
    assert [op for op in sinks if op not in plain] == [("elementwise", 2 * output * 2,
                                                         2 * output * 2)]
    sandwich = ops(dataclasses.replace(base, sandwich_norm=True))
    assert sandwich[:len(plain)] == plain
    assert sandwich[len(plain):] == [("layer_norm", *layer_norm_bytes(2048 * 1024, 2))] * 2
