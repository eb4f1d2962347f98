"""The lora section: low-rank adapters (LoRA) on chosen linear layers of a
frozen base model (ptdp.model.adapters builds them, ptdp.parallel.lora
holds the layer).

Target names are Megatron-Bridge's: `linear_qkv` (attention's fused
query/key/value product), `linear_proj` (attention's output), `linear_fc1`
and `linear_fc2` (the MLP's two products, and those of every routed and
shared expert of an MoE layer). A name given alone matches every such
layer; a name with wildcards (fnmatch's `*`, `?`, `[0-3]`) matches the
layer's full Megatron-Core name, as `decoder.layers.3.self_attention.
linear_qkv` or `decoder.layers.1.mlp.experts.local_experts.7.linear_fc1`
(`*.layers.1[0-5].*.linear_qkv`: layers 10 to 15), or its ptdp name
(`layers.3.attention.query_key_value`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptdp.config.base import finite_or_none, flag, is_count, is_finite_number

TARGET_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoRAConfig:
    lora_rank: int = flag(
        0, "--lora-rank",
        "train low-rank adapters of this rank R on the --lora-target-modules layers, every "
        "other parameter frozen (0: train every parameter)", metavar="R")
    lora_alpha: float = flag(
        32.0, "--lora-alpha",
        "the adapters' scale is ALPHA / R (Megatron-Bridge's and peft's alpha)", metavar="ALPHA")
    lora_dropout: float = flag(0.0, "--lora-dropout",
                               "dropout on the adapters' input, probability p", metavar="P")
    lora_target_modules: list[str] = field(default_factory=lambda: list(TARGET_NAMES), metadata={
        "flag": "--lora-target-modules", "metavar": "NAME",
        "help": "the layers given adapters, by Megatron-Bridge's names: linear_qkv linear_proj "
                "linear_fc1 linear_fc2 (the last two include the routed and shared experts), or "
                "wildcard patterns of a layer's full name, e.g. '*.layers.[0-3].*.linear_qkv' "
                "(default: all four)"})
    lora_share_expert_adapters: bool = flag(
        False, "--lora-share-expert-adapters",
        "one adapter per MoE layer and matrix for all its routed experts (Megatron-Bridge's "
        "share_expert_adapters), instead of one per expert")

    @property
    def enabled(self) -> bool:
        return is_count(self.lora_rank, 1)

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank


def lora_problems(lora: LoRAConfig) -> list[str]:
    """The section's own checks (the model-dependent ones, a target that
    matches nothing or a rank larger than a layer, are
    ptdp.model.adapters.adapter_problems)."""
    problems = []
    if not is_count(lora.lora_rank, 0):
        problems.append(f"--lora-rank must be a whole number ≥ 0 (0: no adapters), not "
                        f"{lora.lora_rank!r}")
    if not lora.enabled:
        changed = [flag for flag, value, default in (
            ("--lora-dropout", lora.lora_dropout, 0.0),
            ("--lora-target-modules", lora.lora_target_modules, list(TARGET_NAMES)),
            ("--lora-share-expert-adapters", lora.lora_share_expert_adapters, False))
            if value != default and finite_or_none(value if isinstance(value, float) else None)]
        # (a nan or inf is reported once, as such: checks._float_problems)
        if changed and is_count(lora.lora_rank, 0):
            problems.append(f"{', '.join(changed)} set without adapters: give --lora-rank R "
                            f"(R ≥ 1) to train adapters, or leave these out")
        return problems
    if is_finite_number(lora.lora_alpha) and lora.lora_alpha <= 0:
        problems.append(f"--lora-alpha must be a positive number, not {lora.lora_alpha!r}")
    if is_finite_number(lora.lora_dropout) and not 0 <= lora.lora_dropout < 1:
        problems.append(f"--lora-dropout must be in [0, 1), not {lora.lora_dropout!r}")
    targets = lora.lora_target_modules
    if not isinstance(targets, list) or not targets \
            or not all(isinstance(t, str) and t.strip() for t in targets):
        problems.append(f"--lora-target-modules needs one or more names ({' '.join(TARGET_NAMES)}) "
                        f"or wildcard patterns, not {targets!r}")
    return problems
