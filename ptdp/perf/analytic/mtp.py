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
