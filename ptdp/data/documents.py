"""Documents inside pretraining sequences: Megatron-LM's --reset-position-ids
and --reset-attention-mask.

A GPT-dataset sample runs across document boundaries, each document ended
by the end-of-document (EOD) token. Megatron-LM
(get_ltor_masks_and_position_ids) counts the EOD as the last token of the
document before it: positions restart at 0 on the token after an EOD, and
with --reset-attention-mask no token after an EOD attends to the EOD or
anything before it. The same boundaries here come as document ids in
ptdp.data.sft.packing's format (0, 1, ... per position, a new one after
each EOD; attention keeps to equal ids), with per-document positions and
fixed-shape cu_seqlens, so packed conversations and split pretraining
text reach the attention the same way.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """[b, s] int32: how many EOD tokens come before each position in its row."""
    is_eod = (tokens == eod_id).to(torch.int32)
    return torch.cumsum(is_eod, dim=-1, dtype=torch.int32) - is_eod


def reset_position_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """[b, s] int64: each position's distance from its document's first token."""
    s = tokens.shape[-1]
    positions = torch.arange(s, device=tokens.device).expand(tokens.shape)
    # A document starts at 0 and after each EOD: the latest start at or before i.
    after_eod = torch.zeros(tokens.shape, dtype=torch.long, device=tokens.device)
    after_eod[..., 1:] = torch.where(tokens[..., :-1] == eod_id, positions[..., 1:], 0)
    return positions - torch.cummax(after_eod, dim=-1).values


def cu_seqlens(document_ids_: torch.Tensor) -> torch.Tensor:
    """[b, s + 1] int32: each row's document boundaries (0, the ends of its
    documents), the unused tail holding s, as packing.stack_sequences pads
    them: a fixed shape, whatever the number of documents."""
    b, s = document_ids_.shape
    ends = torch.full((b, s + 1), s, dtype=torch.int32, device=document_ids_.device)
    ends[:, 0] = 0
    for row in range(b):
        starts = torch.nonzero(document_ids_[row, 1:] != document_ids_[row, :-1]).flatten() + 1
        ends[row, 1:1 + len(starts)] = starts.to(torch.int32)
    return ends


def documents_from_eod(tokens: torch.Tensor, eod_id: int, *, reset_positions: bool = True
                       ) -> dict[str, torch.Tensor]:
    """position_ids (restarting after each EOD with `reset_positions`, else
    0..s-1), document_ids and cu_seqlens of a [b, s] batch of input tokens."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; give a [b, s] batch")
    ids = document_ids(tokens, eod_id)
    positions = (reset_position_ids(tokens, eod_id) if reset_positions
                 else torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape))
    return {"position_ids": positions, "document_ids": ids, "cu_seqlens": cu_seqlens(ids)}
