"""--recompute-modules: which parts of each layer selective recomputation
recomputes, with Megatron-LM's names and meanings (its TransformerConfig.
recompute_modules; ptdp.model.recompute says how each is recomputed). A
field of the model section (ModelConfig inherits it).

    core_attn       the attention core, softmax(QKᵀ)·V with its dropout (the default)
    layernorm       each layer's input norm and pre-MLP norm (their outputs are not kept)
    mlp             the dense MLP (not the MoE layers': "moe")
    moe             the whole MoE layer: router, dispatch, experts, combine
    moe_act         the routed experts' activation times the routing probability
    shared_experts  the MoE layers' shared experts
    mla_up_proj     multi-latent attention's up projections, latent norms and rotation

Megatron-LM's others name modules of models ptdp does not have (gated
delta nets, hyper-connections) and are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
# Megatron-LM's names for modules of models ptdp does not build.
OTHER_MODELS = ("gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")
DEFAULT = ["core_attn"]


@dataclass
class RecomputeModuleFields:
    recompute_modules: list[str] = field(default_factory=lambda: list(DEFAULT), metadata={
        "flag": "--recompute-modules", "metavar": "MODULE",
        "help": "with --recompute-granularity selective, the parts of each layer recomputed in "
                "backward (Megatron-LM's names): core_attn (the attention core), layernorm (the "
                "input and pre-MLP norms), mlp (the dense MLP), moe (the MoE layer), moe_act (the "
                "experts' activation), shared_experts, mla_up_proj (MLA's up projections) "
                "(default: core_attn)"})

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation covers `module` (a name of MODULES)."""
        return (getattr(self, "recompute_granularity", None) == "selective"
                and module in self.recompute_modules)


def recompute_module_problems(m: Any) -> list[str]:
    """--recompute-modules: its names, its granularity, what it needs."""
    modules = m.recompute_modules
    if not isinstance(modules, list) or not all(isinstance(name, str) for name in modules):
        return [f"--recompute-modules={modules!r} must be a list of module names: "
                f"{', '.join(MODULES)}"]
    problems = []
    other = [name for name in modules if name in OTHER_MODELS]
    unknown = [name for name in modules if name not in MODULES + OTHER_MODELS]
    if other:
        problems.append(f"--recompute-modules {' '.join(other)}: Megatron-LM's recomputation of "
                        f"modules of models ptdp does not build (gated delta nets, "
                        f"hyper-connections); recompute among {', '.join(MODULES)}, or drop them")
    if unknown:
        problems.append(f"--recompute-modules {' '.join(unknown)}: not a module name; the names "
                        f"are {', '.join(MODULES)} (Megatron-LM's)")
    if modules != DEFAULT and m.recompute_granularity != "selective":
        problems.append(f"--recompute-modules {' '.join(modules)} chooses what selective "
                        f"recomputation recomputes, but --recompute-granularity is "
                        f"{m.recompute_granularity}: add --recompute-granularity selective, or "
                        f"drop --recompute-modules (Megatron-LM ignores it there)")
    if "mla_up_proj" in modules and not m.multi_latent_attention:
        problems.append("--recompute-modules mla_up_proj recomputes multi-latent attention's up "
                        "projections, but the model has none: add --multi-latent-attention or "
                        "drop mla_up_proj (as Megatron-LM refuses it)")
    if "moe_act" in modules and m.moe_grouped_gemm:
        problems.append("--recompute-modules moe_act recomputes the experts' activation in ptdp's "
                        "one-product-per-expert path, not yet in --moe-grouped-gemm's grouped "
                        "products: drop --moe-grouped-gemm (the same numbers), or recompute the "
                        "whole layer with moe instead of moe_act")
    return problems
