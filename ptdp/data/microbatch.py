"""A microbatch as the pipeline executor takes it, from the samples read:
(inputs, labels, loss mask or None, documents or None).

- GPT-dataset samples are [b, s + 1] tokens: inputs and labels are the two
  shifted views; --eod-mask-loss leaves out positions whose input is the
  end-of-document token; --reset-position-ids and --reset-attention-mask
  split the sequences at those tokens (ptdp.data.documents), as
  Megatron-LM's get_ltor_masks_and_position_ids does.
- SFT samples (ptdp.data.sft.dataset) are dicts of [b, s] arrays: tokens,
  labels, the assistant-only loss mask, and the packed conversations'
  positions and document ids, which always go with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.data.documents import document_ids, reset_position_ids
from ptdp.parallel.document_attention import Documents


@dataclass(frozen=True)
class MicrobatchSettings:
    """How samples become a microbatch: the data section's settings."""
    eod: int | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def from_config(cls, config, eod: int | None) -> "MicrobatchSettings":
        data = config.data
        return cls(eod=eod, eod_mask_loss=data.eod_mask_loss,
                   reset_position_ids=data.reset_position_ids,
                   reset_attention_mask=data.reset_attention_mask)


def carries_documents(config) -> bool:
    """Whether this run's microbatches carry documents (every pipeline stage reads them)."""
    data = config.data
    return bool(data.sft or data.reset_position_ids or data.reset_attention_mask)


def split_microbatch(tokens: torch.Tensor, eod: int | None, eod_mask_loss: bool):
    """(inputs, labels) or (inputs, labels, loss_mask) from [b, s + 1] tokens.
    With --eod-mask-loss a position whose input is the end-of-document token
    is left out (predicting the next document from its end), as Megatron-LM."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if not eod_mask_loss or eod is None:
        return inputs, labels
    return inputs, labels, (inputs != eod).to(torch.float32)


def to_microbatch(samples, settings: MicrobatchSettings, device: torch.device) -> tuple:
    """The executor's microbatch of `samples` (read_samples' result) on `device`."""
    if isinstance(samples, dict):
        documents = Documents(samples["position_ids"], samples["document_ids"])
        return (samples["tokens"].to(device), samples["labels"].to(device),
                samples["loss_mask"].to(device), documents.to(device))
    parts = tuple(t.to(device) for t in split_microbatch(samples, settings.eod,
                                                          settings.eod_mask_loss))
    if not (settings.reset_position_ids or settings.reset_attention_mask) or settings.eod is None:
        return parts
    # (not documents_from_eod: its cu_seqlens, a loop over the rows, no kernel here reads)
    inputs = parts[0]
    positions = (reset_position_ids(inputs, settings.eod) if settings.reset_position_ids
                 else torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape))
    documents = Documents(positions, document_ids(inputs, settings.eod)
                          if settings.reset_attention_mask else None)
    return parts[0], parts[1], parts[2] if len(parts) > 2 else None, documents
