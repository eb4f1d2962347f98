"""Multi-latent attention (DeepSeek-V2/V3's MLA) settings of the model
section, with Megatron-LM's flags, names, defaults and meanings, and their
checks. ModelConfig inherits the fields, so they are model settings on the
command line and in --config files; ptdp.model.mla builds the module.

Each head's query and key are qk_head_dim + qk_pos_emb_head_dim wide: a
part without position (from low-rank latents) and a rotated part; the key's
rotated part is one vector per position shared by every head. Values are
v_head_dim wide. The queries come from a q_lora_rank latent (or straight
from the hidden state without --q-lora-rank), keys and values from one
kv_lora_rank latent. The softmax scale is (qk_head_dim +
qk_pos_emb_head_dim)^-½, times mscale(f, --mscale-all-dim)² for a YaRN
factor f > 1 (Megatron-Core's MultiLatentAttention.softmax_scale;
transformers' yarn_apply_mscale). The rotation is --rope-type's, yarn by
default, as Megatron-LM reads an MLA model's flags (MLATransformerConfig):
Megatron-LM's DeepSeek-V3 script gives --position-embedding-type rope with
--rotary-scaling-factor 40 and gets YaRN. --qk-layernorm means what it means for MLA in
Megatron-LM: a norm on each latent (the query's, when there is one, and
the keys' and values'), which DeepSeek's models have; without it the
latents go to the up projections unnormalized. Their epsilon is
--norm-epsilon's in Megatron-LM (which has no setting of its own for it);
transformers' DeepSeek-V3 (as DeepSeek's own code) uses 1e-6 there whatever
rms_norm_eps says, so ptdp has --mla-latent-norm-epsilon, its own setting,
which an import of such a config.json sets (Moonlight: rms_norm_eps 1e-5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ptdp.config.base import (flag, flag_in, is_count, is_finite_number,
                              positive_integer_problems)

# The widths, in the order their problems are reported.
_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


@dataclass
class MLAFields:
    multi_latent_attention: bool = flag(
        False, "--multi-latent-attention",
        "multi-latent attention (DeepSeek-V2/V3's MLA): queries, keys and values up-projected "
        "from low-rank latents, keys sharing one rotated part per position; the widths are "
        "--q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim, "
        "and --qk-layernorm puts a norm on each latent")
    q_lora_rank: int | None = flag(
        None, "--q-lora-rank",
        "with --multi-latent-attention: the query latent's width (DeepSeek-V3: 1536); unset: "
        "the queries are projected straight from the hidden state (DeepSeek-V2-Lite)")
    kv_lora_rank: int = flag(
        32, "--kv-lora-rank",
        "with --multi-latent-attention: the key/value latent's width (DeepSeek-V3: 512)")
    qk_head_dim: int = flag(
        128, "--qk-head-dim",
        "with --multi-latent-attention: the width of each head's query and key part without "
        "position (the attention's head width is this plus --qk-pos-emb-head-dim)")
    qk_pos_emb_head_dim: int = flag(
        64, "--qk-pos-emb-head-dim",
        "with --multi-latent-attention: the width of each head's rotated query and key part "
        "(the key's is one per position, shared by the heads); even")
    v_head_dim: int = flag(
        128, "--v-head-dim", "with --multi-latent-attention: each head's value width")
    rope_type: str | None = flag(
        None, "--rope-type",
        "with --multi-latent-attention: its rotation, rope or yarn (Megatron-LM's default for "
        "MLA: yarn, whatever --position-embedding-type says, with --rotary-scaling-factor, "
        "--mscale and --mscale-all-dim); ordinary attention takes rope only, its rotation "
        "being --position-embedding-type's", choices=("rope", "yarn"))
    mla_latent_norm_epsilon: float | None = flag(
        None, "--mla-latent-norm-epsilon",
        "with --multi-latent-attention --qk-layernorm: the latent norms' epsilon (ptdp's own "
        "setting; default: --norm-epsilon, as Megatron-LM's latent norms take it). transformers' "
        "DeepSeek-V3 and DeepSeek's code use 1e-6 whatever rms_norm_eps says, which ptdp "
        "convert --from-hf sets where rms_norm_eps differs (Moonlight)")

    def _mla_rotation(self) -> None:
        """Megatron-LM's reading: an MLA model rotates by --rope-type, yarn
        unless given (MLATransformerConfig.rope_type), not by
        --position-embedding-type, which ptdp's other consumers read, so
        that is set to it."""
        if self.multi_latent_attention and \
                self.position_embedding_type in ("rope", "yarn"):  # type: ignore[attr-defined]
            self.position_embedding_type = self.rope_type or "yarn"

    @property
    def latent_norm_epsilon(self) -> float:
        """The MLA latent norms' epsilon: --mla-latent-norm-epsilon, else --norm-epsilon."""
        if self.mla_latent_norm_epsilon is None:
            return self.epsilon  # type: ignore[attr-defined]  # ModelConfig's
        return self.mla_latent_norm_epsilon

    @property
    def mla_query_head_dim(self) -> int:
        """A query's (and a key's) width per head: qk_head_dim + qk_pos_emb_head_dim."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        """(qk_head_dim + qk_pos_emb_head_dim)^-½, times YaRN's mscale(f,
        --mscale-all-dim)² under --position-embedding-type yarn, mscale(f, m)
        = 0.1·m·ln f + 1 (1 for f <= 1), as ptdp.model.yarn. The rotated
        part's logits carry YaRN's attention factor² besides (it is in the
        rotation's cos/sin tables)."""
        scale = self.mla_query_head_dim ** -0.5
        factor = self.rotary_scaling_factor  # type: ignore[attr-defined]  # ModelConfig's
        # (Megatron-Core scales by it whatever the rotation: with --rope-type
        # rope too, where ptdp refuses a factor other than 1.)
        if factor > 1:
            mscale = 0.1 * self.mscale_all_dim * math.log(factor) + 1.0  # type: ignore[attr-defined]
            scale *= mscale * mscale
        return scale


def mla_problems(config: Any) -> list[str]:
    """The MLA settings' problems, one paragraph each (`config`: the whole
    Config; the model's settings, and --lora-rank)."""
    m = config.model
    if not m.multi_latent_attention:
        given = [f"{flag_in(type(m), name)} {getattr(m, name)}" for name in _WIDTHS
                 if getattr(m, name) != getattr(type(m), name)]
        problems = [f"{', '.join(given)}: these are multi-latent attention's widths and act only "
                    f"with --multi-latent-attention: add it or drop them"] if given else []
        if is_finite_number(m.mla_latent_norm_epsilon):  # (a non-finite one: refused once, as such)
            problems.append(f"--mla-latent-norm-epsilon {m.mla_latent_norm_epsilon}: it is the "
                            f"epsilon of multi-latent attention's latent norms and acts only with "
                            f"--multi-latent-attention --qk-layernorm: add them or drop it")
        if m.rope_type == "yarn":   # Megatron-LM asserts the same
            problems.append("--rope-type yarn: Megatron-LM takes it only with "
                            "--multi-latent-attention; YaRN with ordinary attention is "
                            "--position-embedding-type yarn: give that and drop --rope-type")
        return problems
    problems = positive_integer_problems(m, _WIDTHS, optional=("q_lora_rank",))
    rotated = m.qk_pos_emb_head_dim
    if is_count(rotated, 1) and rotated % 2:
        problems.append(f"--qk-pos-emb-head-dim {rotated}: the rotated part turns in pairs, so it "
                        f"must be even: use {rotated + 1} or {max(2, rotated - 1)}")
    return (problems + _latent_norm_problems(m) + _other_attention_problems(m)
            + _rotary_problems(m) + _lora_problems(config))


def _latent_norm_problems(m: Any) -> list[str]:
    """--mla-latent-norm-epsilon: a positive number, where there are latent norms."""
    epsilon = m.mla_latent_norm_epsilon
    if not is_finite_number(epsilon):  # unset, or non-finite: refused once, as such
        return []
    if not m.qk_layernorm:
        return [f"--mla-latent-norm-epsilon {epsilon} without --qk-layernorm: the latents have "
                f"no norms (Megatron-LM's --qk-layernorm puts them there for MLA): add "
                f"--qk-layernorm or drop --mla-latent-norm-epsilon"]
    if epsilon <= 0:
        return [f"--mla-latent-norm-epsilon {epsilon}: the latent norms' epsilon must be a "
                f"number above 0 (it keeps them finite on a zero latent; DeepSeek's: 1e-6)"]
    return []


def _other_attention_problems(m: Any) -> list[str]:
    """Settings of ptdp's other attention that MLA has no use for."""
    problems = []
    if m.group_query_attention:
        problems.append("--multi-latent-attention with --group-query-attention: MLA's keys and "
                        "values come per head from a shared latent (--kv-lora-rank), so there are "
                        "no key/value groups; Megatron-LM refuses the pair too: drop "
                        "--group-query-attention and --num-query-groups")
    if m.softmax_scale is not None:
        problems.append(f"--softmax-scale {m.softmax_scale:g} with --multi-latent-attention: MLA's "
                        f"scale is (--qk-head-dim + --qk-pos-emb-head-dim)^-0.5, times YaRN's "
                        f"mscale² for a --rotary-scaling-factor above 1, as Megatron-Core and "
                        f"DeepSeek compute it: drop --softmax-scale")
    if m.add_qkv_bias:
        problems.append("--add-qkv-bias with --multi-latent-attention: MLA's down and up "
                        "projections have no biases in Megatron-Core (only the output projection "
                        "follows --disable-bias-linear): drop --add-qkv-bias")
    if m.window_size is not None or m.has_sinks:
        what = "sliding windows (--window-size)" if m.window_size is not None else \
            f"attention sinks (--softmax-type {m.softmax_type})"
        problems.append(f"--multi-latent-attention with {what}: ptdp's MLA attends causally over "
                        f"the whole sequence with the vanilla softmax (DeepSeek's models have "
                        f"neither): drop the window and sink settings")
    return problems


def _rotary_problems(m: Any) -> list[str]:
    """MLA rotates its own part of each head, with rope or YaRN only (by
    --rope-type, yarn by default)."""
    problems = []
    if not m.rope:
        problems.append(f"--multi-latent-attention with --position-embedding-type "
                        f"{m.position_embedding_type}: MLA rotates the --qk-pos-emb-head-dim part "
                        f"of each query and key, and ptdp does not add a learned position table "
                        f"besides: give --position-embedding-type rope (the rotation is then "
                        f"--rope-type's, yarn by default, as in Megatron-LM)")
        return problems
    others = [text for text, given in (
        (f"--rotary-percent {m.rotary_percent}", m.rotary_percent != 1.0),
        ("--use-rope-scaling", m.use_rope_scaling),
        (f"--rotary-seq-len-interpolation-factor {m.rotary_seq_len_interpolation_factor}",
         m.rotary_seq_len_interpolation_factor is not None)) if given]
    if others:
        problems.append(f"{', '.join(others)} with --multi-latent-attention: MLA rotates its whole "
                        f"--qk-pos-emb-head-dim part with plain rope or YaRN (Megatron-Core's MLA "
                        f"has no other rotary variant): drop {'them' if len(others) > 1 else 'it'}")
    return problems


def _lora_problems(config: Any) -> list[str]:
    lora = getattr(config, "lora", None)
    if lora is None or not lora.enabled:
        return []
    return [f"--lora-rank {lora.lora_rank} with --multi-latent-attention: ptdp's adapters go on "
            f"ordinary attention's fused query/key/value product (linear_qkv), which MLA does not "
            f"have: drop --lora-rank, or train every parameter"]
