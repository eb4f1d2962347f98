"""Multi-token prediction settings of the model section, with Megatron-LM's
flags, names and meanings (megatron/core/transformer/multi_token_prediction.py),
and their checks. ModelConfig inherits the fields, so they are model
settings on the command line and in --config files.

`--mtp-num-layers D` adds D sequential MTP modules after the model
(DeepSeek-V3's): module k predicts the token k + 1 places ahead of each
position from the previous module's output (the model's for k = 1) and the
embedding of the token k places ahead (ptdp.model.mtp). Their D cross
entropies, averaged and scaled by `--mtp-loss-scaling-factor`, train the
model beside the main loss; the reported loss stays the main one, and each
depth's is logged as "mtp_k loss" (Megatron-LM's name). The modules live on
the last pipeline stage, which then holds its own copy of the word
embedding (as a tied output layer's), kept equal by summing the two
copies' gradients."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ptdp.config.base import flag


@dataclass
class MTPFields:
    mtp_num_layers: int | None = flag(
        None, "--mtp-num-layers",
        "multi-token prediction (DeepSeek-V3's MTP): D modules after the model, module k "
        "predicting the token k + 1 places ahead from the previous module's hidden state and the "
        "embedding of the token k places ahead; each is a projection, one transformer layer and a "
        "final norm, with the model's word embedding and output layer (default: none)",
        metavar="D")
    mtp_loss_scaling_factor: float = flag(
        0.1, "--mtp-loss-scaling-factor",
        "with --mtp-num-layers: the weight of the MTP modules' mean loss added to the main loss "
        "(DeepSeek-V3: 0.3 early in training, then 0.1)")

    @property
    def mtp_depth(self) -> int:
        """D, the MTP modules (0 without --mtp-num-layers)."""
        depth = self.mtp_num_layers
        return depth if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0 else 0


def mtp_problems(m: Any, par: Any, lora: Any) -> list[str]:
    """The MTP settings' problems, one paragraph each (`m` a ModelConfig,
    `par` a ParallelConfig, `lora` a LoRAConfig)."""
    problems: list[str] = []
    depth = m.mtp_num_layers
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        problems.append(f"--mtp-num-layers {depth!r}: give the number of multi-token prediction "
                        f"modules, a whole number 1 or more (0 or leaving it out: none)")
        return problems
    factor = m.mtp_loss_scaling_factor
    if isinstance(factor, (int, float)) and math.isfinite(factor) and factor < 0:
        problems.append(f"--mtp-loss-scaling-factor {factor:g}: the MTP loss's weight must be 0 "
                        f"or more (Megatron-LM's default is 0.1)")
    if not m.mtp_depth:
        return problems
    if lora.enabled:
        problems.append(f"--mtp-num-layers {depth} with --lora-rank: ptdp's adapters do not reach "
                        f"the MTP modules (and their copy of the word embedding), so a LoRA "
                        f"fine-tune would train them frozen: drop --mtp-num-layers for a LoRA "
                        f"fine-tune")
    p = par.pipeline_model_parallel_size
    if not m.rope and isinstance(p, int) and p > 1:
        problems.append(f"--mtp-num-layers {depth} with --position-embedding-type "
                        f"{m.position_embedding_type} and --pipeline-model-parallel-size {p}: the "
                        f"MTP modules on the last stage would need their own copy of the learned "
                        f"position table, which ptdp does not keep in step with the first stage's "
                        f"(Megatron-LM's MTP allows only rope or no positions): use "
                        f"--position-embedding-type rope, or one pipeline stage")
    return problems
