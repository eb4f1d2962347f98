"""Hugging Face GLM-4.5 (Glm4MoeForCausalLM) interop, MTP layers included,
against transformers.

Random small Glm4MoeForCausalLM models of unusual shapes (partial rotation
of heads wider than h/a, q/k/v biases, q/k norms on in one case, dense
first layers then MoE layers, group-limited sigmoid routing with a nonzero
e_score_correction_bias, a routed scaling factor, shared experts; fp32,
CPU), saved by save_pretrained, with one MTP module (D = 1) added to the
safetensors in the published layout (layer L, random values, and copies of
the embedding and output layer):

* `ptdp convert --from-hf`: the one-process model's logits equal
  transformers' (atol 1e-5), the MTP tensors are ptdp's MTP parameters
  unchanged, and the imported model's MTP loss equals one computed here
  from the tensors written (the main model's final-normed hidden state from
  transformers, enorm/hnorm, [embedding | hidden], eh_proj, transformers'
  own decoder layer holding the MTP layer's tensors, shared_head.norm, the
  output layer, cross entropy against the token two places ahead);
* `ptdp convert --to-hf`: transformers loads the export with the same
  logits, and the MTP tensors are written back equal (the copies equal to
  the model's own);
* a model trained in ptdp without an expert bias, with two MTP modules,
  exports as GLM-4.5 and imports back;
* a directory save_pretrained wrote (no MTP layers, num_nextn_predict_layers
  still 1) imports without MTP, with a note, and exports with 0; files
  with some of the MTP layers or tensors are refused, naming what is
  missing;
* what ptdp cannot compute is refused, one key each, naming it.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from ptdp.checkpoint.store import load_logical_model, save_logical_model
from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.interop.hf_directory import load_hf_directory
from ptdp.interop.hf_files import ConversionError
from ptdp.interop.hf_glm4_moe import glm4_moe_obstacles, model_config_from_hf_config
from ptdp.model.gpt import build_chunks
from ptdp.parallel.topology import ParallelContext
from tests.test_hf_llama import TOL, VOCAB, _tokens

transformers = pytest.importorskip("transformers")
from transformers.models.glm4_moe import modeling_glm4_moe  # noqa: E402

EAGER = dict(experts_implementation="eager")
LAYERS = 3
CASES = {
    # q/k norms, q/k/v biases, heads 12 wide (4·12 ≠ 32), half of each turned,
    # 8 experts in 4 groups (2 chosen, top-4), two shared experts' width, untied
    "qk-norm-bias-grouped-untied": dict(
        use_qk_norm=True, attention_bias=True, head_dim=12, num_key_value_heads=2,
        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
        moe_intermediate_size=10, routed_scaling_factor=2.5, first_k_dense_replace=1,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e4,
                                                    "partial_rotary_factor": 0.5}),
    # no q/k norms or biases, a quarter of each 16-wide head turned, 5 experts
    # ungrouped (top-3), two dense layers, tied embeddings
    "plain-quarter-rotary-tied-two-dense": dict(
        use_qk_norm=False, attention_bias=False, head_dim=16, num_key_value_heads=4,
        n_routed_experts=5, num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=7, routed_scaling_factor=1.0, first_k_dense_replace=2,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.25}),
}


def _hf_config(**changes):
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                  num_attention_heads=4, intermediate_size=24, max_position_embeddings=32,
                  rms_norm_eps=1e-5, num_nextn_predict_layers=1, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    fields.update(changes)
    return transformers.Glm4MoeConfig(**fields)


def _hf_model(config, seed=3):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, **EAGER).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # away from 0 and 1, so a swap would show
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):  # routers far from ties
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change choices
                buffer.copy_(torch.randn_like(buffer) * 0.3)
    return model


def _mtp_tensors(hf, written, seed=7):
    """One MTP module in the published layout (layer L): a decoder layer
    like the last one, enorm, hnorm, eh_proj, shared_head.norm (random),
    and copies of the embedding and output layer."""
    generator = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{LAYERS - 1}.", f"model.layers.{LAYERS}."
    state = hf.state_dict()
    h = hf.config.hidden_size
    tensors = {}
    for name, tensor in written.items():
        if name.startswith(last):
            values = torch.randn(tensor.shape, generator=generator)
            if "norm" in name:
                values = 1.0 + 0.1 * values
            elif not name.endswith("gate.weight"):  # (the router: far from ties)
                values = 0.3 * values
            tensors[mtp + name.removeprefix(last)] = values
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=generator)
    tensors[mtp + "eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=generator)
    tensors[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return tensors


def _save_with_mtp(hf, directory):
    hf.save_pretrained(str(directory))
    path = directory / "model.safetensors"
    written = load_file(str(path))  # (per expert, as published files)
    mtp = _mtp_tensors(hf, written)
    save_file({**written, **mtp}, str(path), metadata={"format": "pt"})
    return written, mtp


def _ours(config, weights):
    """The one-process model holding `weights` (parameters and the routers'
    expert biases)."""
    model = build_chunks(config, ParallelContext.single(), torch.device("cpu"), seed=1)[0].eval()
    state = model.state_dict()
    assert set(weights) <= set(state) and all(
        name in weights for name, p in model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            state[name].zero_()
            state[name][tuple(slice(0, n) for n in tensor.shape)].copy_(tensor)
    return model


def _logits(model, tokens):
    with torch.no_grad():
        if isinstance(model, torch.nn.Module) and hasattr(model, "lm_head"):
            return model(tokens).logits
        return model(tokens).transpose(0, 1)[..., :VOCAB]


def _rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_mtp_loss(hf, mtp, tokens):
    """The MTP loss for a [b, s + 1] sample from the tensors written: the
    positions 0 .. s - 2 have a target (the token two places ahead); the
    layer is causal, so it runs on those positions alone."""
    prefix = f"model.layers.{LAYERS}."
    s = tokens.shape[1] - 1
    n = s - 1
    with torch.no_grad():
        hidden = hf.model(tokens[:, :s]).last_hidden_state[:, :n]   # after the final norm
        embedded = F.embedding(tokens[:, 1:1 + n], hf.model.embed_tokens.weight)
        joined = torch.cat([_rms(embedded, mtp[prefix + "enorm.weight"]),
                            _rms(hidden, mtp[prefix + "hnorm.weight"])], dim=-1)
        x = joined @ mtp[prefix + "eh_proj.weight"].T
        layer = modeling_glm4_moe.Glm4MoeDecoderLayer(hf.config, LAYERS).eval()
        own = {name.removeprefix(prefix): tensor for name, tensor in mtp.items()}
        _load_per_expert(layer, own, hf.config.num_local_experts)
        positions = torch.arange(n).unsqueeze(0)
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=causal, position_ids=positions,
                  position_embeddings=hf.model.rotary_emb(x, positions))
        logits = _rms(x, mtp[prefix + "shared_head.norm.weight"]) @ hf.lm_head.weight.T
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:2 + n].flatten())


def _load_per_expert(layer, tensors, experts):
    """Load a decoder layer from per-expert tensors (transformers holds its
    experts fused: gate_up_proj [E, 2f, h], down_proj [E, h, f])."""
    state = dict(tensors)
    block = "mlp.experts."
    if block + "0.gate_proj.weight" in tensors:
        state[block + "gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{block}{e}.gate_proj.weight"], tensors[f"{block}{e}.up_proj.weight"]])
            for e in range(experts)])
        state[block + "down_proj"] = torch.stack([tensors[f"{block}{e}.down_proj.weight"]
                                                  for e in range(experts)])
    keys = set(layer.state_dict())
    layer.load_state_dict({k: v for k, v in state.items() if k in keys}, strict=True)


@pytest.mark.parametrize("name", list(CASES))
def test_glm4_moe_with_mtp_both_ways_through_convert(tmp_path, name):
    changes = CASES[name]
    hf = _hf_model(_hf_config(**changes))
    directory, save, export = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    written, mtp = _save_with_mtp(hf, directory)
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0

    config, weights, _ = load_logical_model(save)
    model = config.model
    rope = changes["rope_parameters"]
    assert (model.rotary_percent, model.mtp_num_layers, model.qk_layernorm, model.qkv_bias,
            model.tied_output) == (rope["partial_rotary_factor"], 1, changes["use_qk_norm"],
                                   changes["attention_bias"], changes["tie_word_embeddings"])
    assert model.moe_layer_pattern == [i >= changes["first_k_dense_replace"]
                                       for i in range(LAYERS)]
    assert (model.moe_router_score_function, model.moe_router_enable_expert_bias) == \
        ("sigmoid", True)
    grouped = changes["n_group"] > 1
    assert (model.moe_router_num_groups, model.moe_router_group_topk) == \
        ((changes["n_group"], changes["topk_group"]) if grouped else (None, None))
    assert model.moe_shared_expert_intermediate_size == \
        changes["n_shared_experts"] * changes["moe_intermediate_size"]

    tokens = _tokens()
    ours = _ours(model, weights)
    assert_close(_logits(ours, tokens), _logits(hf, tokens), **TOL)
    unbiased = {k: (torch.zeros_like(v) if k.endswith("expert_bias") else v)
                for k, v in weights.items()}
    assert (_logits(_ours(model, unbiased), tokens) - _logits(hf, tokens)).abs().max() > 1e-3

    # the MTP tensors are ptdp's MTP parameters, unchanged
    L = f"model.layers.{LAYERS}."
    k = "mtp.layers.0."
    same = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "final_layernorm.weight",
            "mlp.gate.weight": "transformer_layer.mlp.router.weight",
            "mlp.gate.e_score_correction_bias": "transformer_layer.mlp.router.expert_bias",
            "mlp.experts.1.down_proj.weight":
                "transformer_layer.mlp.experts.1.dense_4h_to_h.weight",
            "mlp.shared_experts.down_proj.weight":
                "transformer_layer.mlp.shared_expert.dense_4h_to_h.weight",
            "self_attn.o_proj.weight": "transformer_layer.attention.dense.weight",
            "input_layernorm.weight": "transformer_layer.input_layernorm.weight"}
    for theirs, mine in same.items():
        assert torch.equal(weights[k + mine], mtp[L + theirs]), theirs
    assert torch.equal(weights[k + "transformer_layer.attention.query_key_value.weight"],
                       torch.cat([mtp[L + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(weights[k + "transformer_layer.mlp.experts.4.dense_h_to_4h.weight"],
                       torch.cat([mtp[L + f"mlp.experts.4.{p}_proj.weight"]
                                  for p in ("gate", "up")]))
    if changes["use_qk_norm"]:
        assert torch.equal(weights[k + "transformer_layer.attention.k_layernorm.weight"],
                           mtp[L + "self_attn.k_norm.weight"])

    # the imported model's MTP loss is the definition's, from the tensors written
    sample = _tokens(seed=11, length=17)
    ours.train()(sample[:, :-1], sample[:, 1:])  # (MTP runs in training only; no dropout here)
    [losses] = ours.mtp.take_losses()
    assert_close(losses[0], _reference_mtp_loss(hf, mtp, sample), rtol=1e-5, atol=1e-6)

    # and back: transformers loads the export, the MTP tensors are written back equal
    assert main(["convert", "--load", str(save), "--to-hf", str(export)]) == 0
    hf_config = json.loads((export / "config.json").read_text())
    assert (hf_config["architectures"], hf_config["num_nextn_predict_layers"],
            hf_config["partial_rotary_factor"]) == (["Glm4MoeForCausalLM"], 1,
                                                    rope["partial_rotary_factor"])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True,
                                                             **EAGER).eval()
    assert type(back).__name__ == "Glm4MoeForCausalLM"
    assert_close(_logits(back, tokens), _logits(hf, tokens), **TOL)
    exported = load_file(str(export / "model.safetensors"))
    assert set(exported) == set(written) | set(mtp) - (
        {"lm_head.weight"} if changes["tie_word_embeddings"] else set())
    assert all(torch.equal(exported[name], tensor) for name, tensor in {**written, **mtp}.items()
               if name in exported)


def test_a_ptdp_model_without_an_expert_bias_exports_as_glm(tmp_path):
    """A sigmoid-routed model trained without --moe-router-enable-expert-bias
    and two MTP modules: GLM-4.5 with a zero e_score_correction_bias
    computes the same, and the import of the export gives the weights back."""
    config = ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=32,
        hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", rotary_percent=0.5, disable_bias_linear=True,
        add_qkv_bias=True, ffn_hidden_size=24, num_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=16, moe_layer_freq="[0,1]",
        moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=1.5,
        untie_embeddings_and_output_weights=True, mtp_num_layers=2)
    model = build_chunks(config, ParallelContext.single(), torch.device("cpu"), seed=4)[0].eval()
    generator = torch.Generator().manual_seed(2)
    logical = {}
    for name, param in model.named_parameters():
        tensor = param.detach().clone()[:VOCAB] if "word_embeddings" in name or \
            "output_layer" in name else param.detach().clone()
        if "norm" in name or name.endswith("bias"):
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
        elif name.endswith("router.weight"):
            tensor.normal_(0.0, 1.0, generator=generator)
        logical[name] = tensor
    save, directory = tmp_path / "ckpt", tmp_path / "hf"
    save_logical_model(save, Config(model=config, data=DataConfig(mock_data=True)), logical)
    assert main(["convert", "--load", str(save), "--to-hf", str(directory)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True,
                                                           **EAGER).eval()
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    tokens = _tokens(seed=6)
    assert_close(_logits(hf, tokens), _logits(_ours(config, logical), tokens), **TOL)
    stored = load_file(str(directory / "model.safetensors"))
    assert not stored["model.layers.2.mlp.gate.e_score_correction_bias"].any()
    for k in range(2):  # the two MTP modules after the 2 layers
        assert torch.equal(stored[f"model.layers.{2 + k}.eh_proj.weight"],
                           logical[f"mtp.layers.{k}.eh_proj.weight"])
        assert torch.equal(stored[f"model.layers.{2 + k}.shared_head.head.weight"],
                           logical["output_layer.weight"])
    again, weights = load_hf_directory(directory)
    assert again.moe_router_topk_scaling_factor == 1.5 and again.mtp_num_layers == 2
    assert all(torch.equal(weights[name], tensor) for name, tensor in logical.items())


# ------------------------------------------------------------------ refusals

_BASE = dict(model_type="glm4_moe", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=16, max_position_embeddings=32,
             moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=4,
             first_k_dense_replace=1, num_nextn_predict_layers=1)


@pytest.mark.parametrize("changes, message", [
    (dict(partial_rotary_factor=0.25, rope_parameters={"rope_type": "default",
                                                       "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor=0.25 and rope_parameters.partial_rotary_factor=0.5 disagree"),
    (dict(partial_rotary_factor=0.1), r"partial_rotary_factor=0.1 turns 0 of each head's 8"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor=1.5 must be a number in \(0, 1\]"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     r"rope_parameters has rope_type 'yarn'"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
     r"a rope_type other than 'default' is not supported for GLM-4.5"),
    (dict(norm_topk_prob=False), r"norm_topk_prob=false with num_experts_per_tok=4"),
    (dict(num_experts_per_tok=1), r"norm_topk_prob=true with num_experts_per_tok=1"),
    (dict(n_group=4, topk_group=1), r"n_group=4, topk_group=1 with num_experts_per_tok=4 is not"),
    (dict(n_group=2, topk_group=3), r"topk_group=3 exceeds n_group=2"),
    (dict(n_group=3, topk_group=1), r"n_group=3 does not divide the 8 experts"),
    (dict(first_k_dense_replace=2), r"first_k_dense_replace=2 leaves no MoE layer"),
    (dict(routed_scaling_factor=0), r"routed_scaling_factor=0 must be a positive number"),
    (dict(n_shared_experts=0), r"n_shared_experts=0 must be an integer of at least 1"),
    (dict(scoring_func="softmax"), r"scoring_func='softmax' is not supported"),
    (dict(topk_method="greedy"), r"topk_method='greedy' is not supported"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(attention_bias="yes"), r"attention_bias='yes' must be true or false"),
    (dict(num_local_experts=6), r"n_routed_experts=8 and num_local_experts=6 disagree"),
    (dict(num_nextn_predict_layers=-1), r"num_nextn_predict_layers=-1 must be an integer"),
    (dict(num_experts_per_tok=9, n_routed_experts=8), r"num_experts_per_tok 9 exceeds the 8"),
])
def test_refuses_what_ptdp_cannot_compute(changes, message):
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf_config({**_BASE, **changes})


def test_a_directory_saved_by_transformers_imports_without_its_mtp_layers(tmp_path, capsys):
    """save_pretrained drops the MTP layers and keeps num_nextn_predict_layers
    1: the import is the model without MTP, said in a note, with
    transformers' logits; export writes num_nextn_predict_layers 0 and the
    tensors the directory had, which transformers reads back."""
    hf = _hf_model(_hf_config(**CASES["qk-norm-bias-grouped-untied"]))
    directory, checkpoint = tmp_path / "hf", tmp_path / "ckpt"
    hf.save_pretrained(str(directory))
    written = load_file(str(directory / "model.safetensors"))
    assert json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(key.startswith(f"model.layers.{LAYERS}.") for key in written)
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(directory), "--save", str(checkpoint)]) == 0
    said = capsys.readouterr().out
    assert ("note: this GLM-4.5 directory's config.json says num_nextn_predict_layers=1, but its "
            "files hold no multi-token prediction layers (model.layers.3.*; transformers' "
            "save_pretrained drops them): imported without MTP (--mtp-num-layers 0)") in said
    config, weights, _ = load_logical_model(checkpoint)
    assert config.model.mtp_depth == 0 and not any(key.startswith("mtp.") for key in weights)
    tokens = _tokens()
    assert_close(_logits(_ours(config.model, weights), tokens), _logits(hf, tokens), **TOL)

    export = tmp_path / "back"
    assert main(["convert", "--load", str(checkpoint), "--to-hf", str(export)]) == 0
    assert json.loads((export / "config.json").read_text())["num_nextn_predict_layers"] == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True,
                                                             **EAGER).eval()
    assert_close(_logits(back, tokens), _logits(hf, tokens), **TOL)
    assert set(load_file(str(export / "model.safetensors"))) == set(written)


def test_refuses_mtp_tensors_that_disagree(tmp_path):
    """Files with some of the MTP layers or tensors config.json counts are
    refused, naming what is missing; so is a copy of the embedding that is
    not the model's."""
    hf = _hf_model(_hf_config(**CASES["plain-quarter-rotary-tied-two-dense"]))
    directory = tmp_path / "hf"
    _save_with_mtp(hf, directory)
    path, config_path = directory / "model.safetensors", directory / "config.json"
    tensors = load_file(str(path))
    hf_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**hf_config, "num_nextn_predict_layers": 2}))
    with pytest.raises(ConversionError, match=r"num_nextn_predict_layers=2 with num_hidden_"
                                              r"layers=3, but .* the tensors hold 1 \("
                                              r"layers.3 to layers.3\): give the files every "
                                              r"MTP layer config.json counts, or none of them"):
        load_hf_directory(directory)
    config_path.write_text(json.dumps(hf_config))
    mtp = f"model.layers.{LAYERS}."
    save_file({k: v for k, v in tensors.items() if k != mtp + "hnorm.weight"}, str(path),
              metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"missing: layers.3.hnorm.weight$"):
        load_hf_directory(directory)
    tensors[mtp + "embed_tokens.weight"] += 1.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"model.layers.3.embed_tokens.weight differs from "
                                              r"the model's embed_tokens.weight"):
        load_hf_directory(directory)


def test_export_names_what_a_model_lacks_to_be_glm():
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                         seq_length=32, normalization="RMSNorm", swiglu=True,
                         position_embedding_type="rope", disable_bias_linear=True, num_experts=4,
                         moe_layer_freq="[1,0]", moe_shared_expert_gate=True,
                         moe_shared_expert_intermediate_size=12, moe_ffn_hidden_size=8)
    found = "; ".join(glm4_moe_obstacles(config))
    for part in ("--moe-router-score-function softmax", "not a multiple of the experts' width 8",
                 "--moe-shared-expert-gate", "dense layers after an MoE layer"):
        assert part in found
