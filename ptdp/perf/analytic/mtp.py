"""Multi-token prediction's parameters on one rank (--mtp-num-layers D;
ptdp.model.mtp): the D modules live on the last virtual stage, each with
its two input norms, its 2h -> h projection (column-parallel, no bias), a
transformer layer of the model's last layer's kind and its final norm, in
the order the model lists them; with an untied output layer a last stage
that is not the first keeps a copy of the word embedding for them (summed
with the first stage's, as a tied embedding's copy is)."""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.perf.analytic.layer_params import Param, _layer_parameter_list, _norm_parameters
from ptdp.perf.analytic.norm_bytes import norm_saved_bytes

FP32, INT64 = 4, 8


def mtp_parameter_list(model: ModelConfig, t: int, sequence_parallel: bool, first: bool,
                       word: int, *, ep: int = 1, etp: int | None = None) -> list:
    """The last stage's MTP parameters (ptdp.perf.analytic.counts.Param
    each); `first`: the stage is also the first (p = 1); `word`: this
    rank's share of the word embedding."""
    depth = model.mtp_depth
    if not depth:
        return []
    h, sp = model.hidden_size, sequence_parallel

    def norm() -> list[Param]:
        return [Param(n, partial=sp) for n in _norm_parameters(model)]

    moe = bool(model.moe_layer_pattern[-1]) if model.is_moe else False
    layer = _layer_parameter_list(model, t, sp, moe=moe, ep=ep, etp=etp)
    module = norm() + norm() + [Param(2 * h * h // t)] + layer + norm()
    copy = [Param(word, tied=True)] if not first and not model.tied_output else []
    return copy + module * depth


def mtp_activation_bytes(model: ModelConfig, acts: dict[str, int], *, t: int, b: int, c: int,
                         sequence_parallel: bool, recompute: str | None, e: int, cpu: bool,
                         moe_delta: int = 0) -> int:
    """What the D MTP modules keep for backward per microbatch on the last
    stage (ptdp.model.mtp; measured on CPU, tests/test_analytic.py), from
    the figures ptdp.perf.analytic.memory.activation_bytes gives one layer
    ("layer", "rotary_tables") and the output layer ("output": the final
    norm, the logits' fp32 softmax, the targets). Per module: the token ids
    looked up again (int64, and the out-of-range mask at t > 1; with
    learned positions their position ids, per sequence), the
    embedding's dropout mask, the embedding's norm and the hidden state's
    (whose input, the previous final norm's output, is kept already unless
    a CPU RMSNorm makes an fp32 copy of a 16-bit input), the 2h-wide
    concatenation eh_proj keeps (R rows), a transformer layer (under
    sequence parallelism its first norm may keep the whole gathered
    projection its input is a slice of) of the last
    layer's kind (`moe_delta`: its MoE part, if it is an MoE layer; its own
    rotary tables are made once, `mtp_rotary_tables`), its final norm and the output layer over the
    vocabulary again, and the module's loss mask (fp32) and count. Full
    recomputation checkpoints each module whole (its inputs: the
    embedding's output), leaving the output layer's tensors."""
    depth = model.mtp_depth
    if not depth:
        return 0
    h = model.hidden_size
    sb = model.seq_length // c * b
    rows = sb // t if sequence_parallel and t > 1 else sb
    mask = (e if cpu else 1) if model.hidden_dropout > 0 else 0
    ids = INT64 * sb + (sb if t > 1 else 0)
    if not model.rope:   # the learned positions' ids of the tokens ahead, [b, s] (R of them)
        ids += INT64 * rows
    loss_mask = FP32 * sb + FP32
    norm = norm_saved_bytes(model, rows, e, cpu)
    if recompute == "full":
        output = acts["output"] - norm   # the final norm runs inside the checkpoint
        return depth * (ids + rows * h * mask + rows * h * e + output + loss_mask)
    fp32_copy = cpu and model.normalization == "RMSNorm" and e != FP32
    hidden_norm = norm - (0 if fp32_copy else rows * h * e)
    # Under sequence parallelism the layer's input is this rank's s/t slice
    # of the gathered projection, a view: where the first norm keeps its
    # input itself (not an fp32 copy), the whole gathered [s, b, h] stays.
    # (--recompute-modules layernorm: the norm's checkpoint keeps its input itself)
    keeps_input = not fp32_copy or (recompute == "selective"
                                    and "layernorm" in model.recompute_modules)
    gathered = (t - 1) * rows * h * e if sequence_parallel and t > 1 and keeps_input else 0
    module = (ids + rows * h * mask + norm + hidden_norm + rows * 2 * h * e + acts["layer"]
              + moe_delta + acts["output"] + loss_mask + gathered)
    return depth * module


def mtp_rotary_tables(model: ModelConfig, acts: dict[str, int]) -> int:
    """The cos and sin tables of the D modules' layers (once per layer,
    cached by each layer's Rotary as the model's own)."""
    return model.mtp_depth * acts["rotary_tables"]
