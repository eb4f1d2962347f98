"""Tokenized conversations into fixed-length training sequences.

A sequence of `seq_length` positions holds whole conversations (packed) or
one (unpacked), then padding. Each conversation of n tokens takes n
positions: input token i predicts label token i + 1 of the same
conversation, so no position predicts across a boundary, and the last
position of each conversation has no label (masked). This is ptdp's
sample shape (inputs, labels, a float loss mask over the inputs'
positions; see ptdp.data.microbatch.split_microbatch) with the shift done per
conversation rather than over the whole window: the loss mask at i is the
conversation's mask of token i + 1 (the token being predicted).

Per sequence: `tokens`, `labels`, `loss_mask`, `position_ids` (0, 1, ... per
conversation, and per padding run), `document_ids` (which segment each
position is in: conversations 0, 1, ..., the padding after them one more),
and `cu_seqlens` (segment boundaries, cumulative, starting at 0 and ending
at seq_length; the padding is the last segment). Attention that keeps to
equal document ids, or to the cu_seqlens segments, never crosses a
conversation. Every array has a fixed shape except cu_seqlens.

Packing is first fit in the conversations' order: each goes into the
first open sequence with room, else opens one. The result depends only on
the order given (deterministic; shuffling is the caller's, by seed). A
conversation longer than a sequence is cut to `seq_length` tokens and
counted (`truncated`), never split over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ptdp.data.sft.template import TokenizedConversation


@dataclass(frozen=True)
class PackedSequence:
    tokens: np.ndarray        # int64 [s]: input ids
    labels: np.ndarray        # int64 [s]: the next token of the same conversation (pad after its end)
    loss_mask: np.ndarray     # float32 [s]: 1 where labels[i] is a trained token
    position_ids: np.ndarray  # int64 [s]: restart at 0 for each conversation
    document_ids: np.ndarray  # int32 [s]: the segment of each position (padding: the last)
    cu_seqlens: np.ndarray    # int32 [segments + 1]: 0, ends of the segments, seq_length
    conversations: tuple[int, ...]  # the indices (in the input order) of its conversations

    @property
    def num_conversations(self) -> int:
        return len(self.conversations)


@dataclass
class PackingStats:
    """How well the sequences are used: the log's and the metrics' figures."""
    sequences: int = 0
    conversations: int = 0
    truncated: int = 0          # conversations cut to seq_length
    truncated_tokens: int = 0   # the tokens cut off them
    sequence_tokens: int = 0    # sequences * seq_length
    conversation_tokens: int = 0
    loss_tokens: int = 0        # positions the loss covers

    @property
    def padding_fraction(self) -> float:
        return 1 - self.conversation_tokens / self.sequence_tokens if self.sequence_tokens else 0.0

    @property
    def loss_token_fraction(self) -> float:
        """Loss tokens / sequence tokens: the share of computed positions that train."""
        return self.loss_tokens / self.sequence_tokens if self.sequence_tokens else 0.0

    def summary(self) -> str:
        cut = (f", {self.truncated} longer than a sequence cut to it ({self.truncated_tokens} "
               "tokens dropped)" if self.truncated else "")
        return (f"{self.conversations} conversations in {self.sequences} sequences: "
                f"{self.loss_token_fraction:.1%} of the tokens in the loss, "
                f"{self.padding_fraction:.1%} padding{cut}")


def _truncated(conversations: Iterable[TokenizedConversation], seq_length: int,
               stats: PackingStats) -> list[TokenizedConversation]:
    if seq_length < 2:
        raise ValueError(f"seq_length is {seq_length}: a sequence needs 2 positions to train on one")
    kept = []
    for conversation in conversations:
        n = len(conversation.ids)
        if n > seq_length:
            stats.truncated += 1
            stats.truncated_tokens += n - seq_length
            conversation = TokenizedConversation(conversation.ids[:seq_length],
                                                 conversation.loss_mask[:seq_length])
        kept.append(conversation)
    return kept


def first_fit(lengths: Sequence[int], seq_length: int) -> list[list[int]]:
    """Indices of the items of these lengths (each <= seq_length) per bin,
    first fit in the given order: each item goes into the lowest-numbered
    bin with room. The room of every bin that can exist (at most one per
    item; bins not yet opened have all of seq_length) sits in the leaves of
    a max-tree, so finding the first bin with room is a walk down from the
    root, O(log n) an item instead of a scan of the open bins (a million
    short conversations open hundreds of thousands of bins)."""
    leaves = 1
    while leaves < max(len(lengths), 1):
        leaves *= 2
    room = [seq_length] * (2 * leaves)  # room[1] is the root; a list: fast scalar reads
    bins: list[list[int]] = []
    for index, length in enumerate(lengths):
        node = 1
        while node < leaves:  # the leftmost child that has room
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(index)
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


def build_sequence(conversations: Sequence[TokenizedConversation], indices: Sequence[int],
                   seq_length: int, pad_id: int) -> PackedSequence:
    """One sequence of these conversations (each <= seq_length), then padding."""
    tokens = np.full(seq_length, pad_id, dtype=np.int64)
    labels = np.full(seq_length, pad_id, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    position_ids = np.zeros(seq_length, dtype=np.int64)
    document_ids = np.zeros(seq_length, dtype=np.int32)
    bounds = [0]
    for document, index in enumerate(indices):
        ids, mask = conversations[index].ids, conversations[index].loss_mask
        start, n = bounds[-1], len(ids)
        tokens[start:start + n] = ids
        labels[start:start + n - 1] = ids[1:]   # the last token predicts nothing here
        loss_mask[start:start + n - 1] = mask[1:]
        position_ids[start:start + n] = np.arange(n)
        document_ids[start:start + n] = document
        bounds.append(start + n)
    if bounds[-1] < seq_length:  # the padding: a segment of its own, attending only to itself
        position_ids[bounds[-1]:] = np.arange(seq_length - bounds[-1])
        document_ids[bounds[-1]:] = len(indices)
        bounds.append(seq_length)
    return PackedSequence(tokens, labels, loss_mask, position_ids, document_ids,
                          np.asarray(bounds, dtype=np.int32), tuple(indices))


def pack_conversations(conversations: Iterable[TokenizedConversation], seq_length: int,
                       pad_id: int, packing: bool = True
                       ) -> tuple[list[PackedSequence], PackingStats]:
    """Sequences of `seq_length` positions: whole conversations first fit
    in order (`packing`), or one per sequence; and their statistics."""
    stats = PackingStats()
    kept = _truncated(conversations, seq_length, stats)
    lengths = [len(c.ids) for c in kept]
    bins = first_fit(lengths, seq_length) if packing else [[i] for i in range(len(kept))]
    sequences = [build_sequence(kept, indices, seq_length, pad_id) for indices in bins]
    stats.sequences, stats.conversations = len(sequences), len(kept)
    stats.sequence_tokens = len(sequences) * seq_length
    stats.conversation_tokens = sum(lengths)
    stats.loss_tokens = int(sum(s.loss_mask.sum() for s in sequences))
    return sequences, stats


def stack_sequences(sequences: Sequence[PackedSequence]) -> dict[str, np.ndarray]:
    """A microbatch of sequences as [b, s] arrays, and `cu_seqlens` as
    [b, s + 1] with each row's unused tail holding s (Megatron-LM's SFT
    dataset pads it so): every shape is fixed by b and s, so pipeline
    stages can exchange the boundaries as a static message.
    `num_segments` [b] says how many entries of each row are boundaries."""
    seq_length = len(sequences[0].tokens)
    cu_seqlens = np.full((len(sequences), seq_length + 1), seq_length, dtype=np.int32)
    for row, sequence in enumerate(sequences):
        cu_seqlens[row, :len(sequence.cu_seqlens)] = sequence.cu_seqlens
    stacked = {name: np.stack([getattr(s, name) for s in sequences])
               for name in ("tokens", "labels", "loss_mask", "position_ids", "document_ids")}
    stacked["cu_seqlens"] = cu_seqlens
    stacked["num_segments"] = np.asarray([len(s.cu_seqlens) - 1 for s in sequences], np.int32)
    return stacked
