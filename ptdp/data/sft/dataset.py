"""Fixed-shape training samples from tokenized conversation files.

One file and one split (SFTDataset): the split's conversations are a
seeded random holdout of whole conversations (--split's proportions, with
the GPT dataset's rounding), so train, valid and test never share one.
Each epoch visits the split's conversations in a seeded order, and packs
them first fit (ptdp.data.sft.packing) within windows of `pack_window`
consecutive conversations of that order, so a window's packs are final
before the next one starts; without packing each conversation is a sample.
Epochs follow each other until `num_samples` samples exist.

The pack index (which conversations each sample holds) depends only on the
seed, the file's tokens and the settings, and is cached beside the token
cache as the GPT dataset caches its sample index: sample i is the same on
every rank and layout, and a run resumed at consumed samples N reads
samples N, N + 1, ... exactly as the first run would have. Building more
samples appends epochs and leaves the earlier samples as they were.

Several files blend by weight with the GPT dataset's BlendedDataset.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ptdp.data.gpt_dataset import (BLEND_MARGIN, SPLIT_NAMES, BlendedDataset, DataError,
                                   IndexCache, cached_or_built, parse_weighted_paths, safe_label,
                                   settings_hash, split_document_ranges)
from ptdp.data.sft.cache import TokenizedFile, tokenized_file
from ptdp.data.sft.packing import PackingStats, build_sequence, first_fit
from ptdp.data.sft.template import ChatTemplate, TokenizedConversation

PACK_FORMAT = 1
PACK_WINDOW = 4096  # conversations first fit together: larger packs tighter, builds slower
_RNG_SPLIT, _RNG_EPOCH = 2, 3  # SeedSequence streams apart from the GPT dataset's 0 and 1


def _rng(seed: int, stream: int, file_key: str, epoch: int = 0) -> np.random.Generator:
    # The file's cache key (its content and tokenization), not its place in
    # the blend, seeds its orders: reordering --data-path changes no sample.
    return np.random.default_rng(np.random.SeedSequence(
        [seed, stream, int(file_key[:16], 16), epoch]))


def split_conversations(num_conversations: int, split, seed: int, file_key: str
                        ) -> list[np.ndarray]:
    """The conversation indices of train, valid and test: a seeded random
    holdout of whole conversations, disjoint, each sorted."""
    order = _rng(seed, _RNG_SPLIT, file_key).permutation(num_conversations)
    return [np.sort(order[r.start:r.stop]) for r in split_document_ranges(num_conversations, split)]


def build_pack_index(lengths: np.ndarray, conversations: np.ndarray, *, seq_length: int,
                     seed: int, file_key: str, num_samples: int, packing: bool,
                     pack_window: int) -> dict[str, np.ndarray]:
    """Whole epochs of packs until there are `num_samples`: sample j holds
    conversations pack_conversations[pack_offsets[j]:pack_offsets[j + 1]]
    (file indices, in their order in the pack)."""
    clipped = np.minimum(lengths, seq_length)
    packs: list[np.ndarray] = []
    epoch = 0
    while len(packs) < num_samples or epoch == 0:
        order = conversations[_rng(seed, _RNG_EPOCH, file_key, epoch).permutation(len(conversations))]
        if not packing:
            packs.extend(order[k:k + 1] for k in range(len(order)))
        for start in range(0, len(order) if packing else 0, pack_window):
            window = order[start:start + pack_window]
            packs.extend(window[b] for b in first_fit(clipped[window].tolist(), seq_length))
        epoch += 1
    offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in packs], out=offsets[1:])
    return {"pack_offsets": offsets, "pack_conversations": np.concatenate(packs).astype(np.int64),
            "epochs": np.asarray([epoch], dtype=np.int64)}


def packing_stats(tokenized: TokenizedFile, index: dict, seq_length: int) -> PackingStats:
    """The statistics of every sample in the index (packing.PackingStats)."""
    chosen = np.asarray(index["pack_conversations"])
    starts = np.asarray(tokenized.offsets[:-1])[chosen]
    lengths = np.asarray(tokenized.lengths)[chosen]
    kept = np.minimum(lengths, seq_length)
    mask_sums = np.concatenate([[0], np.cumsum(tokenized.loss_mask, dtype=np.int64)])
    # label i is token i + 1: a conversation trains on its mask from its second token on
    loss = mask_sums[starts + kept] - mask_sums[np.minimum(starts + 1, starts + kept)]
    sequences = len(index["pack_offsets"]) - 1
    return PackingStats(sequences=sequences, conversations=len(chosen),
                        truncated=int(np.sum(lengths > seq_length)),
                        truncated_tokens=int(np.sum(lengths - kept)),
                        sequence_tokens=sequences * seq_length,
                        conversation_tokens=int(kept.sum()), loss_tokens=int(loss.sum()))


class SFTDataset:
    """One split of one tokenized file: sample i is a dict of [s] arrays
    tokens, labels (int64), loss_mask (float32), position_ids (int64),
    document_ids (int32), and cu_seqlens (int32 [s + 1], the unused tail s)."""

    def __init__(self, tokenized: TokenizedFile, *, split: str, split_name: str, num_samples: int,
                 seq_length: int, pad_id: int, seed: int, packing: bool = True,
                 pack_window: int = PACK_WINDOW, cache_dir: str | Path | None = None,
                 build: bool = True, announce: Callable[[Path], None] | None = None):
        if seq_length < 2:
            raise DataError(f"--seq-length {seq_length}: a sample needs 2 positions to train on one")
        if seed < 0 or num_samples < 0 or pack_window < 1:
            raise DataError(f"seed {seed}, {num_samples} samples and a pack window of "
                            f"{pack_window}: none can be negative, the window at least 1")
        self.tokenized, self.split_name = tokenized, split_name
        self.seq_length, self.pad_id = seq_length, pad_id
        split_index = SPLIT_NAMES.index(split_name)
        conversations = split_conversations(len(tokenized), split, seed,
                                            tokenized.cache_key)[split_index]
        if len(conversations) == 0:
            raise DataError(f"{tokenized.path}: --split {split} leaves the {split_name} split none "
                            f"of the {len(tokenized)} conversations; give it a larger share")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else tokenized.cache_dir
        settings = {"kind": "SFTDataset", "format": PACK_FORMAT, "tokens": tokenized.cache_key,
                    "split": split, "split_name": split_name, "num_samples": num_samples,
                    "seq_length": seq_length, "seed": seed, "packing": packing,
                    "pack_window": pack_window}
        self.cache_key = settings_hash(settings)
        cache = IndexCache(self.cache_dir, f"{self.cache_key}-SFTDataset-"
                            f"{safe_label(tokenized.path.stem)}-{split_name}", settings,
                            {"file": str(tokenized.path)})
        self.index, self.built = cached_or_built(
            cache, ("pack_offsets", "pack_conversations", "epochs"), self._check_index,
            (lambda: build_pack_index(tokenized.lengths, conversations, seq_length=seq_length,
                                      seed=seed, file_key=tokenized.cache_key,
                                      num_samples=num_samples, packing=packing,
                                      pack_window=pack_window)) if build else None, announce)
        self._stats: PackingStats | None = None

    def _check_index(self, arrays: dict) -> None:
        offsets, chosen = arrays["pack_offsets"], arrays["pack_conversations"]
        if offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != len(chosen):
            raise ValueError("pack_offsets do not cover pack_conversations")
        if len(chosen) and (chosen.min() < 0 or chosen.max() >= len(self.tokenized)):
            raise ValueError("pack_conversations name conversations the file does not hold")

    @property
    def stats(self) -> PackingStats:
        if self._stats is None:
            self._stats = packing_stats(self.tokenized, self.index, self.seq_length)
        return self._stats

    def __len__(self) -> int:
        return len(self.index["pack_offsets"]) - 1

    def conversations_of(self, i: int) -> np.ndarray:
        offsets = self.index["pack_offsets"]
        return np.asarray(self.index["pack_conversations"][int(offsets[i]):int(offsets[i + 1])])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {self!r} is out of range (it has {len(self)})")
        chosen = self.conversations_of(i)
        conversations: list[TokenizedConversation] = []
        for k in chosen:
            conversation = self.tokenized.conversation(int(k))
            conversations.append(TokenizedConversation(conversation.ids[:self.seq_length],
                                                       conversation.loss_mask[:self.seq_length]))
        sequence = build_sequence(conversations, range(len(conversations)), self.seq_length,
                                  self.pad_id)
        cu_seqlens = np.full(self.seq_length + 1, self.seq_length, dtype=np.int32)
        cu_seqlens[:len(sequence.cu_seqlens)] = sequence.cu_seqlens
        return {"tokens": sequence.tokens, "labels": sequence.labels,
                "loss_mask": sequence.loss_mask, "position_ids": sequence.position_ids,
                "document_ids": sequence.document_ids, "cu_seqlens": cu_seqlens}

    def __repr__(self) -> str:
        return f"SFTDataset({self.tokenized.path}, {self.split_name}: {len(self)} samples)"


def build_sft_datasets(data_path: Sequence[str], template: ChatTemplate, *, split: str,
                       num_samples: tuple[int, int, int], seq_length: int, pad_id: int, seed: int,
                       packing: bool = True, train_on_prompt: bool = False,
                       skip_bad_rows: bool = False, pack_window: int = PACK_WINDOW,
                       cache_dir: str | Path | None = None, build: bool = True) -> list:
    """Train, valid and test datasets (None where no samples are asked):
    an SFTDataset, or a BlendedDataset of one per file."""
    weighted = parse_weighted_paths(data_path, "file")
    files = [tokenized_file(path, template, train_on_prompt=train_on_prompt,
                            skip_bad_rows=skip_bad_rows, cache_dir=cache_dir, build=build)
             for _, path in weighted]
    datasets = []
    for split_name, wanted in zip(SPLIT_NAMES, num_samples):
        if wanted <= 0:
            datasets.append(None)
            continue
        shares = [math.ceil(weight * wanted * BLEND_MARGIN) + 1 if len(files) > 1 else wanted
                  for weight, _ in weighted]
        parts = [SFTDataset(tokenized, split=split, split_name=split_name, num_samples=share,
                            seq_length=seq_length, pad_id=pad_id, seed=seed, packing=packing,
                            pack_window=pack_window, cache_dir=cache_dir, build=build)
                 for tokenized, share in zip(files, shares)]
        datasets.append(parts[0] if len(parts) == 1 else BlendedDataset(
            parts, [weight for weight, _ in weighted], wanted, seed=seed, cache_dir=cache_dir,
            build=build, description=f"sft-{split_name}"))
    return datasets


def blend_stats(dataset) -> PackingStats:
    """The packing statistics of an SFTDataset or of a blend of them (summed)."""
    parts = getattr(dataset, "datasets", [dataset])
    total = PackingStats()
    for part in parts:
        for name, value in vars(part.stats).items():
            setattr(total, name, getattr(total, name) + value)
    return total
