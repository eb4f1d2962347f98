"""Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM) interop, MLA and MTP
layers included, against transformers.

Two random small DeepseekV3ForCausalLM models of unusual shapes (fp32, CPU),
saved by save_pretrained, with one MTP module (D = 1) added to the
safetensors in the published layout (layer L, random values, copies of the
embedding and output layer):

* "qlora-yarn-grouped": a query latent (q_lora_rank), YaRN with mscale and
  mscale_all_dim (different, so each shows), 2 dense layers then MoE
  layers, group-limited sigmoid routing with a nonzero
  e_score_correction_bias, a shared expert, a routed scaling factor,
  rope_interleave true, untied;
* "direct-query-rope-halves": q_lora_rank null (q_proj), plain rotary
  embeddings, rope_interleave false (the rotated rows in "rotate half"
  order), two shared experts' width, tied embeddings.

For each: `ptdp convert --from-hf` gives a one-process model whose logits
equal transformers' (atol 1e-5), the MTP tensors are ptdp's MTP parameters
unchanged (the rotated rows reordered for rope_interleave false), and its
MTP loss equals one computed from the tensors written with transformers'
own DeepseekV3DecoderLayer; `ptdp convert --to-hf` is reloaded by
transformers with equal logits and the MTP tensors present and unchanged;
greedy `ptdp generate` gives transformers' 20 tokens on one process, at
t = 2, p = 2 and at t = 2 with EP = 2 (the session's pool of four processes
in place of the launch). What ptdp cannot compute is refused, one key each.

Models of Moonlight's form (rms_norm_eps 1e-5, small latents, saved by
save_pretrained without the MTP layer config.json counts): the import gives
transformers' logits (its latent norms take 1e-6: --mla-latent-norm-epsilon),
latent norms at 1e-5 do not; the absent MTP layers are left out with a
note, a partial MTP layer is refused by name; export writes rms_norm_eps
1e-5 and num_nextn_predict_layers 0 and transformers reads it back.
Moonlight's and Kimi K2's config.json forms read and pass ptdp's checks.
"""

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from ptdp.checkpoint.store import load_logical_model
from ptdp import cli
from ptdp.cli import main
from ptdp.commands.train import config_from_args
from ptdp.config import Config, ConfigError, DataConfig, validate
from ptdp.interop.hf_deepseek_v3 import deepseek_v3_obstacles, model_config_from_hf_config
from ptdp.interop.hf_directory import family_for_import, load_hf_directory
from ptdp.interop.hf_files import ConversionError
from ptdp.model.mla import mla_rotary
from tests.test_generate_moe import EP_FLAGS, _generate_on_rank
from tests.test_hf_glm4_moe import _load_per_expert, _logits, _ours, _rms
from tests.test_hf_llama import TOL, VOCAB, _tokens

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

EAGER = dict(experts_implementation="eager")
LAYERS = 4
EPS = 1e-6
PROMPT, NEW = [5, 17, 3, 60, 41], 20
CASES = {
    "qlora-yarn-grouped": dict(
        q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
        rope_interleave=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 5e4, "factor": 4.0,
            "original_max_position_embeddings": 8, "beta_fast": 16.0, "beta_slow": 2.0,
            "mscale": 0.8, "mscale_all_dim": 0.6},
        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=10, routed_scaling_factor=2.5, first_k_dense_replace=2,
        tie_word_embeddings=False),
    "direct-query-rope-halves": dict(
        q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=4,
        rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        n_routed_experts=6, num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2,
        moe_intermediate_size=6, routed_scaling_factor=1.0, first_k_dense_replace=1,
        tie_word_embeddings=True),
}

# (each case's seed: one whose greedy continuation varies, top-2 logits at least 0.04 apart)
SEEDS = {"qlora-yarn-grouped": 6, "direct-query-rope-halves": 3}


def _hf_config(**changes):
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=4, intermediate_size=24,
                  max_position_embeddings=32, rms_norm_eps=EPS, num_nextn_predict_layers=1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    fields.update(changes)
    return transformers.DeepseekV3Config(**fields)


def _hf_model(config, seed=3):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, **EAGER).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from 1, so a swap would show
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):  # routers far from ties
                param.normal_(0.0, 1.0)
            else:  # sharper attention and logits: where positions look shows in the tokens
                param.mul_(8.0)
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


@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory):
    """(case, transformers' model, the files' tensors, the MTP tensors added,
    the ptdp checkpoint, transformers' greedy ids after PROMPT)."""
    folder = tmp_path_factory.mktemp(request.param)
    changes = CASES[request.param]
    hf = _hf_model(_hf_config(**changes), seed=SEEDS[request.param])
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT),
                                                                            dtype=torch.long),
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    directory, checkpoint = folder / "hf", folder / "ckpt"
    hf.save_pretrained(str(directory))
    path = directory / "model.safetensors"
    written = load_file(str(path))  # (per expert, as published files)
    mtp = _mtp_tensors(hf, written)
    save_file({**written, **mtp}, str(path), metadata={"format": "pt"})
    assert main(["convert", "--from-hf", str(directory), "--save", str(checkpoint)]) == 0
    return (request.param, hf, written, mtp, checkpoint,
            ",".join(map(str, out[0, len(PROMPT):].tolist())))


def _interleaved(rows, rotated):
    """[..., d_r, n] rows in "rotate half" order -> interleaved pairs (2i: i, 2i+1: i + d_r/2)."""
    return rows.unflatten(-2, (2, rotated // 2)).transpose(-3, -2).flatten(-3, -2)


def _as_ptdp_rows(name, tensor, changes):
    """A stored tensor as ptdp holds it: rope_interleave false's rotated rows reordered."""
    if changes["rope_interleave"]:
        return tensor
    nope, rotated = changes["qk_nope_head_dim"], changes["qk_rope_head_dim"]
    if name.endswith("q_proj.weight"):
        heads = tensor.unflatten(0, (-1, nope + rotated))
        return torch.cat([heads[:, :nope], _interleaved(heads[:, nope:], rotated)], 1).flatten(0, 1)
    if name.endswith("kv_a_proj_with_mqa.weight"):
        return torch.cat([tensor[:-rotated], _interleaved(tensor[-rotated:], rotated)])
    return tensor


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
        joined = torch.cat([_rms(embedded, mtp[prefix + "enorm.weight"], EPS),
                            _rms(hidden, mtp[prefix + "hnorm.weight"], EPS)], dim=-1)
        x = joined @ mtp[prefix + "eh_proj.weight"].T
        layer = modeling_deepseek_v3.DeepseekV3DecoderLayer(hf.config, LAYERS).eval()
        own = {name.removeprefix(prefix): tensor for name, tensor in mtp.items()}
        _load_per_expert(layer, own, hf.config.num_local_experts)
        positions = torch.arange(n).unsqueeze(0)
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=causal, position_ids=positions,
                  position_embeddings=hf.model.rotary_emb(x, positions))
        logits = _rms(x, mtp[prefix + "shared_head.norm.weight"], EPS) @ hf.lm_head.weight.T
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:2 + n].flatten())


def test_deepseek_v3_with_mtp_both_ways_through_convert(imported, tmp_path):
    name, hf, written, mtp, checkpoint, _ = imported
    changes = CASES[name]
    config, weights, _ = load_logical_model(checkpoint)
    model = config.model
    assert (model.multi_latent_attention, model.q_lora_rank, model.kv_lora_rank,
            model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim, model.qk_layernorm,
            model.mtp_num_layers, model.tied_output) == (
        True, changes["q_lora_rank"], changes["kv_lora_rank"], changes["qk_nope_head_dim"],
        changes["qk_rope_head_dim"], changes["v_head_dim"], True, 1,
        changes["tie_word_embeddings"])
    rope = changes["rope_parameters"]
    assert model.yarn == (rope["rope_type"] == "yarn")
    if model.yarn:
        assert (model.rotary_scaling_factor, model.yarn_original_max_position_embeddings,
                model.yarn_beta_fast, model.yarn_beta_slow, model.mscale_all_dim) == \
            (rope["factor"], rope["original_max_position_embeddings"], rope["beta_fast"],
             rope["beta_slow"], rope["mscale_all_dim"])
        assert model.mscale == pytest.approx(rope["mscale"])
    assert model.moe_layer_pattern == [i >= changes["first_k_dense_replace"]
                                       for i in range(LAYERS)]
    assert (model.moe_router_score_function, model.moe_router_enable_expert_bias) == \
        ("sigmoid", True)

    tokens = _tokens()
    ours = _ours(model, weights)
    assert_close(_logits(ours, tokens), _logits(hf, tokens), **TOL)
    unbiased = {k: (torch.zeros_like(v) if k.endswith("expert_bias") else v)
                for k, v in weights.items()}
    assert (_logits(_ours(model, unbiased), tokens) - _logits(hf, tokens)).abs().max() > 1e-3

    # the MTP tensors are ptdp's MTP parameters, unchanged (rotated rows in ptdp's order)
    L, k = f"model.layers.{LAYERS}.", "mtp.layers.0."
    query = "query_up" if changes["q_lora_rank"] else "query"
    same = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "final_layernorm.weight",
            "mlp.gate.weight": "transformer_layer.mlp.router.weight",
            "mlp.gate.e_score_correction_bias": "transformer_layer.mlp.router.expert_bias",
            "mlp.experts.1.down_proj.weight":
                "transformer_layer.mlp.experts.1.dense_4h_to_h.weight",
            "mlp.shared_experts.down_proj.weight":
                "transformer_layer.mlp.shared_expert.dense_4h_to_h.weight",
            f"self_attn.{'q_b_proj' if changes['q_lora_rank'] else 'q_proj'}.weight":
                f"transformer_layer.attention.{query}.weight",
            "self_attn.kv_a_proj_with_mqa.weight":
                "transformer_layer.attention.key_value_down.weight",
            "self_attn.kv_a_layernorm.weight":
                "transformer_layer.attention.key_value_latent_layernorm.weight",
            "self_attn.kv_b_proj.weight": "transformer_layer.attention.key_value_up.weight",
            "self_attn.o_proj.weight": "transformer_layer.attention.dense.weight",
            "input_layernorm.weight": "transformer_layer.input_layernorm.weight"}
    for theirs, mine in same.items():
        assert torch.equal(weights[k + mine], _as_ptdp_rows(theirs, mtp[L + theirs], changes)), \
            theirs
    assert torch.equal(weights[k + "transformer_layer.mlp.experts.4.dense_h_to_4h.weight"],
                       torch.cat([mtp[L + f"mlp.experts.4.{p}_proj.weight"]
                                  for p in ("gate", "up")]))

    # the imported model's MTP loss is the definition's, from the tensors written
    sample = _tokens(seed=11, length=17)
    ours.train()(sample[:, :-1], sample[:, 1:])  # (MTP runs in training only; no dropout here)
    [losses] = ours.mtp.take_losses()
    assert_close(losses[0], _reference_mtp_loss(hf, mtp, sample), rtol=1e-5, atol=1e-6)

    # and back: transformers loads the export, the MTP tensors are written back
    export = tmp_path / "back"
    assert main(["convert", "--load", str(checkpoint), "--to-hf", str(export)]) == 0
    hf_config = json.loads((export / "config.json").read_text())
    assert (hf_config["architectures"], hf_config["num_nextn_predict_layers"],
            hf_config["rope_interleave"], hf_config["q_lora_rank"]) == (
        ["DeepseekV3ForCausalLM"], 1, True, changes["q_lora_rank"])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True,
                                                             **EAGER).eval()
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert_close(_logits(back, tokens), _logits(hf, tokens), **TOL)
    exported = load_file(str(export / "model.safetensors"))
    assert set(exported) == set(written) | set(mtp) - (
        {"lm_head.weight"} if changes["tie_word_embeddings"] else set())
    for stored_name, tensor in {**written, **mtp}.items():
        if stored_name in exported:
            assert torch.equal(exported[stored_name],
                               _as_ptdp_rows(stored_name, tensor, changes)), stored_name


def _generate(capsys, checkpoint, *flags) -> str:
    assert main(["generate", "--load", str(checkpoint), "--prompt-ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", str(NEW), "--temperature", "0", "--output-ids", *flags]) == 0
    return capsys.readouterr().out.strip()


def test_greedy_tokens_equal_transformers_under_layouts(imported, pools, capsys, monkeypatch):
    checkpoint, expected = imported[4], imported[5]
    assert len(expected.split(",")) == NEW and len(set(expected.split(","))) > 3
    assert _generate(capsys, checkpoint) == expected
    launched = []

    def launch_on_the_pool(world, worker, request, **options):
        launched.append(world)
        texts = pools(4).run(_generate_on_rank, request)[:world]
        assert texts == [texts[0]] * world  # every rank extends the same context
        print(texts[0])

    monkeypatch.setattr("ptdp.launch.launch_local", launch_on_the_pool)
    assert _generate(capsys, checkpoint, "-t", "2", "-p", "2") == expected
    assert _generate(capsys, checkpoint, "-t", "2", *EP_FLAGS) == expected
    assert launched == [4, 2]


# ------------------------------------------------------------------ rms_norm_eps, no MTP tensors

# Random models of Moonlight's form (rms_norm_eps 1e-5, plain rotation at θ
# 5e4, one dense layer, ungrouped routing, two shared experts, untied), saved
# by save_pretrained, whose latents have a mean square near 1e-6, where the
# latent norms' 1e-6 and rms_norm_eps' 1e-5 differ plainly:
# * "moonlight": no query latent (q_proj), config.json counting one MTP
#   layer that save_pretrained dropped (a fine-tune saved by transformers);
# * "query-latent": a query latent too (Kimi K2's form), no MTP.
SMALL_LATENTS = {
    "moonlight": dict(
        q_lora_rank=None, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6,
        num_nextn_predict_layers=1),
    "query-latent": dict(
        q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8,
        num_nextn_predict_layers=0),
}
_MOONLIGHT_FORM = dict(
    rms_norm_eps=1e-5, rope_interleave=True, rope_parameters={"rope_type": "default",
                                                              "rope_theta": 5e4},
    n_routed_experts=6, num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2,
    moe_intermediate_size=8, routed_scaling_factor=2.446, first_k_dense_replace=1,
    tie_word_embeddings=False)


@pytest.mark.parametrize("name", list(SMALL_LATENTS))
def test_rms_norm_eps_and_absent_mtp_layers_import_as_transformers_computes(tmp_path, capsys,
                                                                          name):
    """transformers' latent norms take 1e-6 whatever rms_norm_eps says: the
    import (--norm-epsilon 1e-5, --mla-latent-norm-epsilon 1e-6) gives its
    logits, latent norms at 1e-5 do not; MTP layers config.json counts but
    the files lack are left out with a note; export writes rms_norm_eps
    1e-5 and num_nextn_predict_layers 0, and transformers reads it back."""
    changes = {**_MOONLIGHT_FORM, **SMALL_LATENTS[name]}
    hf = _hf_model(_hf_config(**changes), seed=4)
    with torch.no_grad():
        for layer in hf.model.layers:
            attention = layer.self_attn
            attention.kv_a_proj_with_mqa.weight[:changes["kv_lora_rank"]].mul_(1e-3)
            if changes["q_lora_rank"]:
                attention.q_a_proj.weight.mul_(1e-3)
    directory, checkpoint = tmp_path / "hf", tmp_path / "ckpt"
    hf.save_pretrained(str(directory))
    written = load_file(str(directory / "model.safetensors"))
    assert not any(key.startswith(f"model.layers.{LAYERS}.") for key in written)
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(directory), "--save", str(checkpoint)]) == 0
    said = capsys.readouterr().out
    depth = changes["num_nextn_predict_layers"]
    assert ("note: this DeepSeek-V3 directory's config.json says num_nextn_predict_layers=1, but "
            "its files hold no multi-token prediction layers (model.layers.4.*" in said) == \
        bool(depth)
    config, weights, _ = load_logical_model(checkpoint)
    model = config.model
    assert (model.norm_epsilon, model.mla_latent_norm_epsilon, model.mtp_depth) == (1e-5, 1e-6, 0)
    assert not any(key.startswith("mtp.") for key in weights)
    # --use-checkpoint-args carries the latent norms' epsilon into a fine-tune.
    from ptdp.checkpoint.args import with_checkpoint_shape
    from ptdp.config import TrainConfig

    fine_tune = with_checkpoint_shape(
        Config(data=DataConfig(mock_data=True),
               train=TrainConfig(load=str(checkpoint), use_checkpoint_args=True)),
        explicit=["train.load", "train.use_checkpoint_args"])
    assert (fine_tune.model.norm_epsilon, fine_tune.model.mla_latent_norm_epsilon) == (1e-5, 1e-6)

    tokens = _tokens()
    expected = _logits(hf, tokens)
    assert_close(_logits(_ours(model, weights), tokens), expected, **TOL)
    at_norm_epsilon = dataclasses.replace(model, mla_latent_norm_epsilon=None)
    assert (_logits(_ours(at_norm_epsilon, weights), tokens) - expected).abs().max() > 1e-2

    export = tmp_path / "back"
    assert main(["convert", "--load", str(checkpoint), "--to-hf", str(export)]) == 0
    hf_config = json.loads((export / "config.json").read_text())
    assert (hf_config["rms_norm_eps"], hf_config["num_nextn_predict_layers"],
            hf_config["q_lora_rank"]) == (1e-5, 0, changes["q_lora_rank"])
    back = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True,
                                                             **EAGER).eval()
    assert_close(_logits(back, tokens), expected, **TOL)
    assert set(load_file(str(export / "model.safetensors"))) == set(written)
    if depth:  # some of the MTP layer's tensors: refused, naming those missing
        h = hf.config.hidden_size
        save_file({**written, f"model.layers.{LAYERS}.eh_proj.weight": torch.zeros(h, 2 * h)},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ConversionError, match=rf"missing: layers\.{LAYERS}\.enorm\.weight, "
                                                  rf"layers\.{LAYERS}\.hnorm\.weight"):
            load_hf_directory(directory)


def test_the_latent_norms_epsilon_is_checked_and_export_names_it():
    """--mla-latent-norm-epsilon: only with MLA's latent norms, above 0; a
    model whose latent norms take another epsilon than 1e-6 (--norm-epsilon
    1e-5 without it) is no DeepSeek-V3 for transformers."""
    imported = model_config_from_hf_config({**_BASE, "rms_norm_eps": 1e-5})
    assert (imported.norm_epsilon, imported.mla_latent_norm_epsilon) == (1e-5, 1e-6)
    assert deepseek_v3_obstacles(imported) == []
    published = model_config_from_hf_config(_BASE)  # (1e-6 both: no setting of its own)
    assert (published.norm_epsilon, published.mla_latent_norm_epsilon) == (1e-6, None)
    for changes, says in [
            (dict(mla_latent_norm_epsilon=0.0), "--mla-latent-norm-epsilon 0.0: the latent norms' "
                                                "epsilon must be a number above 0"),
            (dict(qk_layernorm=False), "--mla-latent-norm-epsilon 1e-06 without --qk-layernorm"),
            (dict(multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=32,
                  qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, rope_type=None),
             "--mla-latent-norm-epsilon 1e-06: it is the epsilon of multi-latent attention's "
             "latent norms and acts only with --multi-latent-attention --qk-layernorm")]:
        with pytest.raises(ConfigError) as refused:
            validate(Config(model=dataclasses.replace(imported, **changes),
                            data=DataConfig(mock_data=True)))
        assert [says in problem for problem in refused.value.problems] == [True]
    following = dataclasses.replace(imported, mla_latent_norm_epsilon=None)
    assert "MLA latent norms of epsilon 1e-05 (--norm-epsilon's: no --mla-latent-norm-epsilon" in \
        "; ".join(deepseek_v3_obstacles(following))


# ------------------------------------------------------------------ refusals

_BASE = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=16, max_position_embeddings=32,
             q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
             moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
             topk_group=2, first_k_dense_replace=1, num_nextn_predict_layers=1)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize("changes, message", [
    (dict(attention_bias=True), r"attention_bias=true is not supported"),
    (dict(num_key_value_heads=2), r"num_key_value_heads=2 with num_attention_heads=4"),
    (dict(qk_rope_head_dim=5), r"qk_rope_head_dim=5 must be even"),
    (dict(kv_lora_rank=0), r"kv_lora_rank=0 must be an integer of at least 1"),
    (dict(rope_interleave="no"), r"rope_interleave='no' must be true or false"),
    (dict(rope_interleave=False, quantization_config={"quant_method": "fp8"}),
     r"rope_interleave=false with quantization_config"),
    (dict(moe_layer_freq=2), r"moe_layer_freq=2 is not supported"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
     r"rope_type 'linear' is not supported"),
    (dict(rope_parameters={**_YARN, "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor=0.5 is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     r"original_max_position_embeddings=None must be a positive integer"),
    (dict(rope_parameters={**_YARN, "factor": 0.5}), r"rope_parameters.factor=0.5 must be"),
    (dict(rope_parameters={**_YARN, "truncate": "yes"}), r"truncate='yes' must be true or false"),
    (dict(rope_parameters={**_YARN, "mscale": -1.0}), r"mscale=-1.0 must be a non-negative"),
    (dict(rope_parameters={**_YARN, "factor": 1.0, "attention_factor": 2.0}),
     r"attention_factor=2.0 with factor 1 is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_theta=5e4),
     r"rope_parameters.rope_theta=10000.0 and rope_theta=50000.0 disagree"),
    (dict(rope_parameters={"rope_type": "default"}, rope_scaling=_YARN),
     r"rope_parameters=.* and rope_scaling=.* disagree"),
    (dict(topk_method="group_limited_greedy"),
     r"topk_method='group_limited_greedy' is not supported: DeepSeek-V3's router"),
    (dict(scoring_func="softmax"), r"scoring_func='softmax' is not supported"),
    (dict(norm_topk_prob=False), r"norm_topk_prob=false with num_experts_per_tok=4"),
    (dict(n_group=4, topk_group=1), r"n_group=4, topk_group=1 with num_experts_per_tok=4"),
    (dict(first_k_dense_replace=2), r"first_k_dense_replace=2 leaves no MoE layer"),
    (dict(routed_scaling_factor=-1), r"routed_scaling_factor=-1 must be a positive number"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(num_mtp_layers=2), r"num_nextn_predict_layers=1 and num_mtp_layers=2 disagree"),
])
def test_refuses_what_ptdp_cannot_compute(changes, message):
    with pytest.raises(ConversionError, match=message):
        model_config_from_hf_config({**_BASE, **changes})


def test_reads_deepseek_defaults_and_the_published_rope_scaling():
    """DeepseekV3Config's defaults where keys are missing (256 experts in 8
    groups, top-8 of 4 groups, scaling 2.5, 3 dense layers), and DeepSeek's
    own rope_scaling form (type yarn, equal mscales: attention factor 1)."""
    hf = {key: value for key, value in _BASE.items()
          if key not in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                         "first_k_dense_replace", "moe_intermediate_size")}
    hf.update(num_hidden_layers=4, rope_theta=1e4, rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    config = model_config_from_hf_config(hf)
    assert (config.num_experts, config.moe_router_topk, config.moe_router_num_groups,
            config.moe_router_group_topk, config.moe_router_topk_scaling_factor,
            config.moe_layer_pattern, config.moe_ffn_size) == (256, 8, 8, 4, 2.5,
                                                               [False] * 3 + [True], 2048)
    assert (config.yarn, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim,
            config.rotary_base) == (True, 40.0, 1.0, 1.0, 1e4)


def test_kimi_k2_model_type_reads_as_deepseek_v3():
    """Kimi K2's config.json: DeepseekV3ForCausalLM with model_type kimi_k2."""
    named = {"architectures": ["DeepseekV3ForCausalLM"]}
    assert family_for_import({**named, "model_type": "kimi_k2"}, "kimi").name == "DeepSeek-V3"
    assert family_for_import({**named, "model_type": "deepseek_v3"}, "v3").name == "DeepSeek-V3"
    with pytest.raises(ConversionError, match="not an architecture ptdp converts"):
        family_for_import({**named, "model_type": "kimi_linear"}, "other")


def test_the_published_config_form_reads_as_the_documented_flags():
    """DeepSeek-V3's config.json as published (transformers 4.33's form:
    rope_scaling + rope_theta, FP8 quantization_config, DeepSeek's own keys):
    the flag set docs/generation-and-export.md gives (with the sizes), as
    `ptdp train` parses it, which ptdp's checks accept."""
    m = model_config_from_hf_config(PUBLISHED)
    assert (m.multi_latent_attention, m.qk_layernorm, m.q_lora_rank, m.kv_lora_rank,
            m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.norm_epsilon, m.bias) == \
        (True, True, 1536, 512, 128, 64, 128, 1e-6, False)
    assert (m.rope_type, m.rotary_base, m.rotary_scaling_factor,
            m.yarn_original_max_position_embeddings, m.yarn_beta_fast, m.yarn_beta_slow,
            m.mscale, m.mscale_all_dim) == ("yarn", 1e4, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size,
            m.moe_shared_expert_intermediate_size, m.moe_layer_pattern, m.ffn_hidden_size,
            m.moe_router_num_groups, m.moe_router_group_topk,
            m.moe_router_topk_scaling_factor, m.mtp_num_layers, m.tied_output) == \
        (256, 8, 2048, 2048, [False] * 3 + [True] * 58, 18432, 8, 4, 2.5, 1, False)
    text = (Path(__file__).parent.parent / "docs" / "generation-and-export.md").read_text()
    documented = re.search(r"\*\*DeepSeek-V3\.\*\* An imported DeepSeek-V3 is, in "
                           r"Megatron-LM's flags: `([^`]*)`", text).group(1)
    sizes = ("--num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size "
             "18432 --vocab-size 129280 --max-position-embeddings 163840 --seq-length 163840 "
             "--hidden-dropout 0 --attention-dropout 0")
    words = ["train", *shlex.split(sizes), *shlex.split(documented)]
    config = config_from_args(cli.build_parser().parse_args(words))
    differences = {field.name: (getattr(config.model, field.name), getattr(m, field.name))
                   for field in dataclasses.fields(m) if field.name != "moe_layer_freq"
                   and getattr(config.model, field.name) != getattr(m, field.name)}
    assert differences == {}  # (the MoE layers given in either form:)
    assert config.model.moe_layer_pattern == m.moe_layer_pattern
    config.data = dataclasses.replace(config.data, mock_data=True)
    validate(config)


def test_moonlights_and_kimi_k2s_config_forms_read():
    """Moonlight's config.json (deepseek_v3: no query latent, rms_norm_eps
    1e-5, one dense layer, ungrouped routing, two shared experts, θ 5e4, no
    MTP) and Kimi K2's form (kimi_k2: YaRN with beta_fast = beta_slow = 1,
    384 experts, FP8): every key reads, ptdp's checks accept the result, and
    Kimi K2's step-shaped YaRN frequencies are transformers' (its own
    _compute_yarn_parameters)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    moon = model_config_from_hf_config(MOONLIGHT)
    assert (moon.q_lora_rank, moon.kv_lora_rank, moon.norm_epsilon, moon.mla_latent_norm_epsilon,
            moon.rope_type, moon.rotary_base, moon.num_experts, moon.moe_router_topk,
            moon.moe_router_num_groups, moon.moe_shared_expert_intermediate_size,
            moon.moe_router_topk_scaling_factor, moon.moe_layer_pattern, moon.mtp_depth,
            moon.tied_output, moon.max_position_embeddings) == (
        None, 512, 1e-5, 1e-6, "rope", 5e4, 64, 6, None, 2 * 1408, 2.446,
        [False] + [True] * 26, 0, False, 8192)
    kimi = model_config_from_hf_config(KIMI_K2)
    assert (kimi.q_lora_rank, kimi.norm_epsilon, kimi.mla_latent_norm_epsilon, kimi.rope_type,
            kimi.rotary_scaling_factor, kimi.yarn_beta_fast, kimi.yarn_beta_slow, kimi.mscale,
            kimi.mscale_all_dim, kimi.num_experts, kimi.moe_router_topk,
            kimi.moe_router_num_groups, kimi.moe_router_topk_scaling_factor, kimi.mtp_depth) == (
        1536, 1e-6, None, "yarn", 32.0, 1.0, 1.0, 1.0, 1.0, 384, 8, None, 2.827, 0)
    for model in (moon, kimi):
        validate(Config(model=model, data=DataConfig(mock_data=True)))
    theirs = transformers.DeepseekV3Config(**{
        key: value for key, value in KIMI_K2.items()
        if key not in ("architectures", "auto_map", "model_type", "quantization_config")})
    frequencies, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    rotary = mla_rotary(kimi)
    assert_close(rotary.yarn.inverse_frequencies(64, 5e4, torch.device("cpu")), frequencies,
                 rtol=0, atol=0)
    assert rotary.yarn.attention_factor == attention_factor == 1.0


# Moonlight-16B-A3B's config.json; Kimi-K2-Instruct's keys (the sizes and
# settings as published; its auto_map and transformers_version left out).
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 11264, "kv_lora_rank": 512,
    "max_position_embeddings": 8192, "model_type": "deepseek_v3", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "num_nextn_predict_layers": 0,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.48.2", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 163840}
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 163584,
    "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "model_type": "kimi_k2",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {
        "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840}
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280}
