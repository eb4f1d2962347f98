"""PEFT adapter directories (ptdp.interop.hf_peft) against PEFT itself:
an exported adapter, loaded by peft.PeftModel.from_pretrained on the base
model ptdp's --to-hf writes, gives the logits of that model with the
adapters merged into its weights (ptdp.model.adapters.merged, written by
the same export); an adapter trained in PEFT (its own A for q, k and v)
imports to adapters whose merged weights give PEFT's logits; the round
trip keeps every tensor; what ptdp cannot compute is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from ptdp.config.lora import LoRAConfig  # noqa: E402
from ptdp.interop.hf_directory import load_hf_directory, save_hf_directory  # noqa: E402
from ptdp.interop.hf_files import ConversionError  # noqa: E402
from ptdp.interop.hf_peft import from_peft, save_peft_directory, to_peft  # noqa: E402
from ptdp.model.adapters import adapted_layers, adapter_shapes, merged  # noqa: E402

TOLERANCE = 1e-5
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _hf_model(kind: str):
    torch.manual_seed(1)
    if kind == "llama":  # Llama 3.1's rope scaling
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **SMALL, intermediate_size=48, max_position_embeddings=16384,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2))
    if kind == "gemma3":  # windows shorter than the 12 tokens, two rotary bases
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **SMALL, intermediate_size=40, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}))
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SMALL, intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=4,
            num_experts_per_tok=2))
    # Qwen2-MoE with a shared expert and a dense second layer: both MLPs are
    # written as PEFT parameter targets (hf_peft_names says why).
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        mlp_only_layers=[1], num_experts=4, num_experts_per_tok=2))


@pytest.fixture(scope="module", params=["llama", "mixtral", "qwen3_moe", "qwen2_moe", "gemma3"])
def base(request, tmp_path_factory):
    """(ModelConfig, logical state, the --to-hf directory of the base model)."""
    root = tmp_path_factory.mktemp(request.param)
    _hf_model(request.param).save_pretrained(root / "source")
    config, logical = load_hf_directory(root / "source")
    save_hf_directory(root / "base", logical, config)
    return config, logical, root


def _random_adapters(config, lora, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.2 * torch.randn(shape, generator=generator)
            for name, shape in adapter_shapes(config, lora).items()}


def _logits(model, seed=3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=generator)
    with torch.no_grad():
        return model.eval()(ids).logits


def _load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory)


def _merged_logits(base, adapters, lora, directory):
    config, logical, _ = base
    save_hf_directory(directory, merged(logical, adapters, config, lora), config)
    return _logits(_load(directory))


def test_exported_adapter_in_peft_gives_the_merged_model(base, tmp_path):
    config, _, root = base
    lora = LoRAConfig(lora_rank=2, lora_alpha=6.0)  # all four targets, the experts' too
    adapters = _random_adapters(config, lora)
    save_peft_directory(tmp_path / "peft", adapters, config, lora)
    adapted = peft.PeftModel.from_pretrained(_load(root / "base"), tmp_path / "peft")
    expected = _merged_logits(base, adapters, lora, tmp_path / "merged")
    assert (expected - _logits(_load(root / "base"))).abs().max() > 1e-2  # the adapters act
    torch.testing.assert_close(_logits(adapted), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("targets, share", [
    (["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], False),
    (["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], True),
    (["*.layers.1.*.linear_qkv", "linear_fc2"], False),
])
def test_round_trip(base, tmp_path, targets, share):
    config = base[0]
    if share and not config.is_moe:
        pytest.skip("shared expert adapters need routed experts")
    lora = LoRAConfig(lora_rank=3, lora_alpha=5.0, lora_target_modules=targets,
                      lora_share_expert_adapters=share)
    adapters = _random_adapters(config, lora)
    save_peft_directory(tmp_path / "peft", adapters, config, lora)
    back, settings = from_peft(tmp_path / "peft", config)
    assert (settings.lora_rank, settings.lora_alpha) == (3, 5.0)
    assert settings.lora_share_expert_adapters == share
    assert adapted_layers(config, settings) == adapted_layers(config, lora)
    assert back.keys() == adapters.keys()
    for name, tensor in adapters.items():
        assert torch.equal(back[name], tensor), name
    # The dictionary form agrees with the directory.
    adapter_config, tensors = to_peft(adapters, config, lora)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text()) == adapter_config
    assert load_file(tmp_path / "peft" / "adapter_model.safetensors").keys() == tensors.keys()


def _trained_in_peft(base, directory):
    """A PEFT adapter with its own random A and B on every layer (q, k and
    v differ, as training makes them), saved by PEFT."""
    config, _, root = base
    mlp = ["gate_proj", "up_proj", "down_proj"]
    if config.is_moe:
        dense = [f"{name}.weight" for name in mlp]
        parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        settings = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=parameters + (dense if "qwen2" in str(root) else []))
    else:
        settings = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", *mlp])
    model = peft.get_peft_model(_load(root / "base"),
                                peft.LoraConfig(r=2, lora_alpha=5, **settings))
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory)
    return _logits(model)


def test_import_of_an_adapter_trained_in_peft(base, tmp_path):
    config = base[0]
    expected = _trained_in_peft(base, tmp_path / "peft")
    adapters, lora = from_peft(tmp_path / "peft", config)
    # q, k and v (and gate, up of the dense MLPs) have their own A: rank 3r, α/R kept.
    assert lora.lora_rank == 6 and lora.lora_alpha == pytest.approx(15.0)
    torch.testing.assert_close(_merged_logits(base, adapters, lora, tmp_path / "merged"),
                               expected, atol=TOLERANCE, rtol=0)


# ------------------------------------------------------------------ refusals

def _config_change(key, value):
    def change(adapter_config, tensors):
        adapter_config[key] = value
    return change


def _add_tensor(name, shape):
    def change(adapter_config, tensors):
        tensors[name] = torch.zeros(shape)
    return change


def _reshape_first_a(adapter_config, tensors):
    name = sorted(name for name in tensors if name.endswith("q_proj.lora_A.weight"))[0]
    tensors[name] = torch.zeros(2, 48)  # another model's hidden size


REFUSALS = [
    (_config_change("use_dora", True), "use_dora"),
    (_config_change("rank_pattern", {"q_proj": 4}), "rank_pattern"),
    (_config_change("alpha_pattern", {"q_proj": 4}), "alpha_pattern"),
    (_config_change("bias", "lora_only"), "bias is 'lora_only'"),
    (_config_change("use_rslora", True), "use_rslora"),
    (_config_change("modules_to_save", ["lm_head"]), "modules_to_save"),
    (_config_change("layers_to_transform", [0]), "layers_to_transform"),
    (_config_change("layers_pattern", "layers"), "layers_pattern"),
    (_config_change("fan_in_fan_out", True), "fan_in_fan_out"),
    (_add_tensor("base_model.model.lm_head.lora_A.weight", (2, 32)), "lm_head.lora_A.weight"),
    (_add_tensor("base_model.model.model.embed_tokens.lora_A.weight", (2, 64)), "embed_tokens"),
    (_add_tensor("base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight", (2, 32)),
     "layers.5.self_attn.q_proj"),
    (_reshape_first_a, r"q_proj.lora_A.weight has shape \(2, 48\), expected \(2, 32\)"),
]


@pytest.mark.parametrize("change, message", REFUSALS, ids=[m.split()[0] for _, m in REFUSALS])
def test_import_refuses_what_ptdp_cannot_compute(change, message, llama_config, tmp_path):
    config = llama_config
    lora = LoRAConfig(lora_rank=2, lora_alpha=4.0)
    adapter_config, tensors = to_peft(_random_adapters(config, lora), config, lora)
    change(adapter_config, tensors)
    directory = tmp_path / "changed"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    with pytest.raises(ConversionError, match=message):
        from_peft(directory, config)


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_source")
    _hf_model("llama").save_pretrained(directory)
    return load_hf_directory(directory)[0]


def test_export_refuses_some_of_a_layers_experts(tmp_path):
    _hf_model("qwen3_moe").save_pretrained(tmp_path / "source")
    config, _ = load_hf_directory(tmp_path / "source")
    lora = LoRAConfig(lora_rank=2, lora_target_modules=["*.local_experts.[01].linear_fc1"])
    with pytest.raises(ConversionError, match="adapts 2 of the 4 routed experts' linear_fc1"):
        to_peft(_random_adapters(config, lora), config, lora)


def test_import_of_an_adapter_with_experts_per_expert(base, tmp_path):
    """Adapters saved before transformers 5 fused the experts name each
    expert's layers (`mlp.experts.3.gate_proj`); PEFT converts them on
    load, ptdp reads them as they are."""
    config, _, root = base
    if "qwen3_moe" not in str(root):
        pytest.skip("Qwen3-MoE's per-expert names")
    lora = LoRAConfig(lora_rank=2, lora_alpha=6.0, lora_target_modules=["linear_fc1", "linear_fc2"])
    adapters = _random_adapters(config, lora)
    f = config.moe_ffn_size
    tensors = {}
    for i in range(config.num_layers):
        for e in range(config.num_experts):
            ours = f"layers.{i}.mlp.experts.{e}."
            theirs = f"base_model.model.model.layers.{i}.mlp.experts.{e}."
            fc1_a = adapters[ours + "dense_h_to_4h.lora.A"]
            fc1_b = adapters[ours + "dense_h_to_4h.lora.B"]
            for name, rows in (("gate_proj", fc1_b[:f]), ("up_proj", fc1_b[f:])):
                tensors[theirs + f"{name}.lora_A.weight"] = fc1_a.clone()
                tensors[theirs + f"{name}.lora_B.weight"] = rows.clone()
            tensors[theirs + "down_proj.lora_A.weight"] = adapters[ours + "dense_4h_to_h.lora.A"]
            tensors[theirs + "down_proj.lora_B.weight"] = adapters[ours + "dense_4h_to_h.lora.B"]
    directory = tmp_path / "peft"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 6,
        "target_modules": ["gate_proj", "up_proj", "down_proj"]}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    back, settings = from_peft(directory, config)
    assert adapted_layers(config, settings) == adapted_layers(config, lora)
    assert settings.lora_rank == 2 and back.keys() == adapters.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in adapters.items())
    adapted = peft.PeftModel.from_pretrained(_load(root / "base"), directory)
    expected = _merged_logits(base, adapters, lora, tmp_path / "merged")
    torch.testing.assert_close(_logits(adapted), expected, atol=TOLERANCE, rtol=0)
