"""What low-rank adapters on a frozen base (Workload.lora) change in the
operator prices of ptdp.perf.price.pricing, for one layer, one microbatch,
one tensor rank:

  - the base's linear layers (QKV, projection, the MLP's two GEMMs) run
    their forward and only their input gradient in the backward: no
    weight-gradient GEMM, nothing accumulated into a buffer (the score and
    context products keep both halves of their backward, whose operands
    both carry gradients);
  - each adapted layer adds its adapter's two small GEMMs forward, [b·s, in]
    × [in, R] and [b·s, R] × [R, out] (A whole and B split by rows for a
    column-parallel base, A split by columns and B whole for a row-parallel
    one), and four backward (the down projection's gradient, B's and A's
    weight gradients, the input's gradient), their gradients accumulated
    into the fp32 buffer; a layer is priced as the mean over the model's
    dense layers of the targets they adapt (routed experts' adapters are
    left out of the MoE layers' prices);
  - the output layer: the logits' input gradient only, nothing for the
    tied or untied table; the embedding: no backward at all (its output
    carries no gradient);
  - zero-bubble schedules: nothing is deferred to W (the adapters'
    gradients are computed in B, as ptdp's LoRA layer does).
The data-parallel reduction and the optimizer step cover the adapters'
buffer only (ptdp.perf.price.after_flush).
"""

from __future__ import annotations

from ptdp.perf.analytic.lora import adapted_targets

TARGET_GEMMS = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "mlp_up",
                "linear_fc2": "mlp_down"}


def adapter_shares(ops) -> dict[str, float]:
    """Per target, the share of the model's dense layers that adapt it."""
    model, lora = ops.w.model, ops.w.lora
    pattern = model.moe_layer_pattern if model.is_moe else [False] * model.num_layers
    per_layer = adapted_targets(model, lora)
    return {target: sum(target in targets and not (moe and target in ("linear_fc1", "linear_fc2"))
                        for targets, moe in zip(per_layer, pattern)) / model.num_layers
            for target in TARGET_GEMMS}


def adapter_gemm_shapes(ops) -> list[tuple[float, tuple[int, int, int], tuple[int, int, int]]]:
    """(share of layers, A's forward (m, n, k), B's forward (m, n, k)) of
    each target's adapter on one tensor rank."""
    shapes, r = ops.layer_gemms(), ops.w.lora.rank
    found = []
    for target, share in adapter_shares(ops).items():
        if not share:
            continue
        # The base's local product [m, k] × [k, n]: a column-parallel base's
        # k is the whole input (A whole) and n its rows (B split as they
        # are); a row-parallel base's k its columns (A split), n whole (B).
        m, n, k, _ = shapes[TARGET_GEMMS[target]]
        found.append((share, (m, r, k), (m, n, r)))
    return found


def adapter_parameters(ops) -> float:
    """The adapters' elements of a mean layer on one tensor rank."""
    return sum(share * (a[1] * a[2] + b[1] * b[2]) for share, a, b in adapter_gemm_shapes(ops))


def adapter_forward_seconds(ops) -> float:
    return sum(share * (ops.gemm(*a) + ops.gemm(*b)) for share, a, b in adapter_gemm_shapes(ops))


def adapter_backward_seconds(ops) -> float:
    """Input and weight gradients of both adapter products."""
    return sum(share * (ops.gemm_backward(*a) + ops.gemm_backward(*b))
               for share, a, b in adapter_gemm_shapes(ops))


def frozen_base_backward_gemm_seconds(ops, linear_gemms: tuple[str, ...]) -> float:
    """A layer's backward GEMMs with a frozen base: the linear layers' input
    gradients; both halves of the score and context products."""
    seconds = 0.0
    for name, (m, n, k, batch) in ops.unfused_gemms().items():
        seconds += ops.gemm(m, k, n, batch)
        if name not in linear_gemms:
            seconds += ops.gemm(k, n, m, batch)
    return seconds
