"""What a normalization layer saves for backward (shared by the layer,
MLA and MTP activation models: ptdp.perf.analytic.memory, .mla, .mtp)."""

from __future__ import annotations

from ptdp.config import ModelConfig

FP32 = 4


def norm_saved_bytes(model: ModelConfig, tokens: int, e: int, cpu: bool,
                     frozen: bool = False) -> int:
    """Bytes a normalization layer saves for backward over `tokens` = s·b
    positions, besides its output (which the next layer saves as its
    input). LayerNorm: its input and the mean and rstd per position
    (statistics in the activation dtype on the CPU, fp32 on GPUs). RMSNorm on
    the CPU (torch.rms_norm decomposed into element-wise ops, which compute in
    fp32): the fp32 input, the fp32 normalized input and rstd; on GPUs (the
    fused kernel): the input and rstd in fp32."""
    h = model.hidden_size
    if model.normalization == "LayerNorm":
        return tokens * h * e + 2 * tokens * (e if cpu else FP32)
    if cpu:   # a frozen weight's product keeps no normalized input (LoRA's base)
        return (1 if frozen else 2) * tokens * h * FP32 + tokens * FP32
    return tokens * h * e + tokens * FP32
