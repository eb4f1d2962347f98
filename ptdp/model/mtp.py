"""Multi-token prediction (DeepSeek-V3's MTP, --mtp-num-layers D), as
Megatron-Core computes it (megatron/core/transformer/multi_token_prediction.py).

D modules run one after another on the last pipeline stage, after the
model's final norm. Module k (1-based) takes the previous hidden state h
(for k = 1 the model's final hidden state after its final norm, as
Megatron-Core hands its decoder's output on; then module k - 1's output)
and the embedding e of the token k places ahead of each position, and
computes

    final_norm(layer(gather(eh_proj([enorm(e), hnorm(h)]))))

with enorm, hnorm and final_norm norms of the model's kind, the
embedding first in the concatenation, eh_proj a column-parallel 2h -> h
projection without bias whose split output is gathered (and scattered
back to s/t positions under sequence parallelism), and `layer` one of
ptdp's transformer layers, built as the model's last layer (dense or MoE
alike). The model's output layer turns it into logits for the token k + 1
places ahead: the label k places on. Module k's loss is the masked mean
cross entropy over the positions that have that target: the main loss
mask k places on, within the position's own document (packed sequences),
and not past the sequence's end. The D losses' mean times
--mtp-loss-scaling-factor trains the model beside the main loss (its
gradient starts where the main loss's does), while the loss the model
returns, and the run reports, stays the main one; each depth's is kept for
the log ("mtp_k loss").

Shifts act on the whole sequence's labels, mask and documents, which every
rank reads (also under context parallelism, where each rank then keeps its
own two chunks of the shifted tensors): no exchange between context ranks
is needed. The token k places ahead is the label k - 1 places ahead, so
the last stage needs no input tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ptdp.config import ModelConfig
from ptdp.model.norms import layer_norm
from ptdp.model.recompute import checkpoint, recompute_active
from ptdp.parallel.document_attention import Documents
from ptdp.parallel.tensor import (ColumnParallelLinear, RNGStreams, gather_from_tensor_region,
                                  _gather_sequence)
from ptdp.parallel.topology import ParallelContext


def shifted(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """[b, s] -> [b, s] with position i holding x[:, i + k]; the last k
    positions (which have no such value) hold `fill`."""
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, :x.shape[1] - k] = x[:, k:]
    return out


def depth_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None,
                  documents: Documents | None, k: int) -> tuple[torch.Tensor, ...]:
    """Module k's whole-sequence (input tokens, labels, loss mask) [b, s]:
    the tokens k places ahead (the labels k - 1 places on), the labels k
    places on, and the main mask k places on where that position is in the
    same document (positions past the end: masked, token and label 0)."""
    tokens = shifted(labels, k - 1)
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
    mask = shifted(mask, k)
    if documents is not None and documents.document_ids is not None:
        ids = documents.document_ids.expand_as(labels)
        mask = mask * (shifted(ids, k, fill=-1) == ids)
    return tokens, shifted(labels, k), mask


def depth_positions(positions: torch.Tensor, k: int) -> torch.Tensor:
    """The learned-position ids of the tokens k places ahead (0 past the end)."""
    return shifted(positions, k)


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Keep this tensor rank's s/t positions forward; all-gather the
    sequence backward (Megatron's scatter_to_sequence_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=0)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class _MainLossValue(torch.autograd.Function):
    """The main loss's value; backward, its gradient also starts the
    added loss's (Megatron's MTPLossAutoScaler): the MTP loss trains as if
    added, whatever the main loss's backward scale, and is not reported."""

    @staticmethod
    def forward(ctx, main, added):
        return main.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


class MTPLayer(nn.Module):
    """One MTP module (its parameters' logical names are Megatron-Core's
    mtp.layers.{k-1}.{enorm,hnorm,eh_proj,transformer_layer,final_layernorm})."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool, transformer_layer: nn.Module):
        super().__init__()
        self.ctx, self.rng, self.sequence_parallel = ctx, rng, sequence_parallel
        self.full_recompute = config.recompute_granularity == "full"
        h = config.hidden_size
        self.enorm = layer_norm(config, sequence_parallel)
        self.hnorm = layer_norm(config, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(2 * h, h, ctx, bias=False,
                                            init_std=config.init_method_std,
                                            sequence_parallel=sequence_parallel)
        self.transformer_layer = transformer_layer
        self.final_layernorm = layer_norm(config, sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor,
                positions: torch.Tensor | None, documents: Documents | None) -> torch.Tensor:
        """hidden, embedded: [s, b, h] ([s/t, b, h] under sequence parallelism)."""
        if self.full_recompute and recompute_active(self):
            return checkpoint(self._forward, self.rng, hidden, embedded, positions, documents)
        return self._forward(hidden, embedded, positions, documents)

    def _forward(self, hidden, embedded, positions, documents):
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = gather_from_tensor_region(self.eh_proj(x), self.ctx.tp_group)
        if self.sequence_parallel:
            x = _ScatterToSequenceRegion.apply(x, self.ctx.tp_group)
        return self.final_layernorm(self.transformer_layer(x, positions, documents))


class MultiTokenPrediction(nn.Module):
    """The D modules of --mtp-num-layers, on the model's last stage."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool, make_layer: Callable[[], nn.Module]):
        """`make_layer()`: a new transformer layer of the model's last layer's
        kind (gpt.py's TransformerLayer, which this module does not import)."""
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(config, ctx, rng, sequence_parallel, make_layer())
                                    for _ in range(config.mtp_depth))
        self.loss_weight = config.mtp_loss_scaling_factor / config.mtp_depth
        self.learned_positions = not config.rope
        # Each trained microbatch's D losses ([D], detached), until the trainer takes them.
        self.losses: list[torch.Tensor] = []

    def forward(self, model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                loss_mask: torch.Tensor | None, documents: Documents | None,
                positions: torch.Tensor | None) -> torch.Tensor:
        """The weighted sum of the D losses for `model`'s microbatch
        (`hidden`: its final hidden state after the final norm; `labels`,
        `loss_mask`, `documents`: whole-sequence, as GPT.forward takes
        them; `positions`: this rank's positions in their documents, as the
        model's layers take them)."""
        losses = []
        attention_documents = documents if documents is not None and \
            documents.document_ids is not None else None
        for k, layer in enumerate(self.layers, start=1):
            tokens, labels_k, mask = depth_targets(labels, loss_mask, documents, k)
            embedded = model.embedding(model._own_positions(tokens),
                                       self._embedding_positions(model, labels, documents, k))
            hidden = layer(hidden, embedded, positions, attention_documents)
            losses.append(model.loss(model.logits(hidden), labels_k, mask))
        self.losses.append(torch.stack(losses).detach())
        return torch.stack(losses).sum() * self.loss_weight

    def _embedding_positions(self, model: nn.Module, labels: torch.Tensor,
                             documents: Documents | None, k: int) -> torch.Tensor | None:
        """The learned-position ids of this rank's tokens k places ahead
        (None with rotary positions: the embedding adds none)."""
        if not self.learned_positions:
            return None
        b, s = labels.shape
        whole = (documents.position_ids.expand(b, s) if documents is not None
                 else torch.arange(s, device=labels.device).expand(b, s))
        return model._own_positions(depth_positions(whole, k))

    @staticmethod
    def attach(main_loss: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        """The main loss's value, whose backward also trains `mtp_loss`."""
        return _MainLossValue.apply(main_loss, mtp_loss)

    def take_losses(self) -> list[torch.Tensor]:
        """The [D] losses of the microbatches trained since the last call."""
        taken, self.losses = self.losses, []
        return taken


def mtp_logged(chunks: list[nn.Module]) -> list[torch.Tensor]:
    """This rank's MTP losses since the last call ([D] per microbatch;
    empty where no chunk holds the MTP modules)."""
    return [loss for chunk in chunks if getattr(chunk, "mtp", None) is not None
            for loss in chunk.mtp.take_losses()]


def mtp_names(depth: int) -> list[str]:
    """Megatron-LM's names of the D losses in its log and TensorBoard."""
    return [f"mtp_{k} loss" for k in range(1, depth + 1)]

