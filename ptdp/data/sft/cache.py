"""A conversation file tokenized once: token ids, offsets and loss masks as
.npy arrays, reused while nothing they depend on has changed.

The cache sits in index-cache/ beside the file (ptdp.data.cache), or in
ptdp's own cache directory when that is not writable. Its name is a digest
of everything the tokens depend on: the file's size and the SHA-256 of its
whole content, the tokenizer.json's SHA-256, the chat template's text and
the special tokens it renders with, train_on_prompt and FORMAT_VERSION.
Not skip_bad_rows: the rows kept are the same either way, and a cache that
left bad rows out refuses to serve a caller that does not skip them. The whole file is hashed, not its head and tail as the GPT
dataset's fingerprint does, because a conversation file is edited in the
middle (a reply fixed) without changing its size, and a stale cache would
train on the old text silently; hashing reads the file at hundreds of MB/s,
far faster than tokenizing it. The modification time is recorded, not
keyed: a copy on another node (which changes it) names the same cache.

Arrays are written each to a temporary file and renamed, the description
last (ptdp.data.gpt_dataset's index cache): an interrupted build (Ctrl-C,
a bad row) leaves no description, so nothing half-written is ever loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ptdp.data.cache import default_cache_dir
from ptdp.data.gpt_dataset import DataError, cached_or_built, IndexCache, safe_label
from ptdp.data.sft.rows import ConversationError, read_records
from ptdp.data.sft.template import ChatTemplate, TokenizedConversation, tokenize_record
from ptdp.data.sft.template_files import TOKENIZER_JSON, ChatTemplateError
from ptdp.status import Periodic, phase

FORMAT_VERSION = 1
ARRAYS = ("ids", "offsets", "loss_mask")
HASH_CHUNK = 1 << 22
PROGRESS_INTERVAL_S = 10.0


@dataclass
class TokenizedFile:
    """The conversations of one file: conversation k is
    ids[offsets[k]:offsets[k + 1]] with loss_mask over the same range."""
    path: Path
    ids: np.ndarray        # int32 [tokens] (int64 for vocabularies past 2**31)
    offsets: np.ndarray    # int64 [conversations + 1]
    loss_mask: np.ndarray  # int8 [tokens], aligned with ids (not shifted)
    skipped_rows: int      # bad rows left out (skip_bad_rows)
    cache_key: str
    cache_dir: Path
    built: bool            # tokenized now, rather than loaded

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def conversation(self, k: int) -> TokenizedConversation:
        start, stop = int(self.offsets[k]), int(self.offsets[k + 1])
        return TokenizedConversation(np.asarray(self.ids[start:stop], dtype=np.int64),
                                     np.asarray(self.loss_mask[start:stop]))


def _sha256_and_lines(path: Path) -> tuple[str, int]:
    digest, lines = hashlib.sha256(), 0
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK):
            digest.update(chunk)
            lines += chunk.count(b"\n")
    return digest.hexdigest(), lines


def _file_sha256(path: Path) -> str:
    return _sha256_and_lines(path)[0]


def _template_digest(template: ChatTemplate) -> str:
    text = json.dumps({"source": template.source, "special_tokens": template.special_tokens},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _cache_directory(path: Path) -> Path:
    """index-cache/ beside the file where it can be written, else ptdp's cache."""
    beside = default_cache_dir(str(path))
    probe = beside if beside.exists() else beside.parent
    return beside if os.access(probe, os.W_OK | os.X_OK) else default_cache_dir() / "sft"


def _rows_expected(path: Path, lines: int) -> int:
    if path.suffix.lower() != ".parquet":
        return lines
    try:
        import pyarrow.parquet as parquet
        return parquet.ParquetFile(str(path)).metadata.num_rows
    except Exception:  # not a Parquet file: reading it says so, with the file's name
        return 0


def _tokenize_file(path: Path, template: ChatTemplate, train_on_prompt: bool,
                   skip_bad_rows: bool, rows_expected: int) -> tuple[dict, list]:
    """The arrays of every good row, and the errors of the bad ones (skipped)."""
    bad_rows: list = [] if skip_bad_rows else None
    ids, masks, lengths = [], [], []
    # held as int32 while the file is read: half the memory of int64
    dtype = np.int32 if template.text_tokenizer.vocab_size < np.iinfo(np.int32).max else np.int64
    progress = Periodic(f"tokenizing {path}", rows_expected, "rows",
                        interval=PROGRESS_INTERVAL_S)
    for row, record in read_records(path, bad_rows):
        progress.advance(1)
        try:
            conversation = tokenize_record(template, record, path, row, train_on_prompt)
        except (ChatTemplateError, ConversationError) as error:
            if bad_rows is None:
                raise
            bad_rows.append(error)
            continue
        ids.append(conversation.ids.astype(dtype, copy=False))
        masks.append(conversation.loss_mask)
        lengths.append(len(conversation.ids))
    if not lengths:
        raise ConversationError(f"{path} holds no conversation to train on"
                                + (f" ({len(bad_rows)} bad rows skipped)" if bad_rows else ""))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    arrays = {"ids": np.concatenate(ids),
              "offsets": offsets,
              "loss_mask": np.concatenate(masks).astype(np.int8, copy=False)}
    return arrays, bad_rows or []


def _check(arrays: dict) -> None:
    offsets = arrays["offsets"]
    if offsets.ndim != 1 or len(offsets) < 2 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise ValueError("offsets are not a rising sequence from 0")
    for name in ("ids", "loss_mask"):
        if arrays[name].shape != (int(offsets[-1]),):
            raise ValueError(f"{name} has shape {arrays[name].shape}, not ({int(offsets[-1])},)")


def tokenized_file(path: str | Path, template: ChatTemplate, *, train_on_prompt: bool = False,
                   skip_bad_rows: bool = False, cache_dir: str | Path | None = None,
                   build: bool = True,
                   announce: Callable[[Path], None] | None = None) -> TokenizedFile:
    """The file's conversations tokenized, from the cache, or tokenized now
    and cached (`build`: the building rank; others load what it wrote).
    A bad row raises its ConversationError / ChatTemplateError naming file
    and row, or with `skip_bad_rows` is counted (TokenizedFile.skipped_rows,
    and the cache's description) and left out."""
    path = Path(path)
    if not path.is_file():
        raise ConversationError(f"{path}: no such file; give a JSON lines (.jsonl) or Parquet "
                                "(.parquet) file of conversations")
    content_sha256, lines = _sha256_and_lines(path)
    stat = path.stat()
    settings = {"kind": "TokenizedConversations", "format": FORMAT_VERSION,
                "file_bytes": stat.st_size, "file_sha256": content_sha256,
                "tokenizer_sha256": _file_sha256(template.tokenizer_path / TOKENIZER_JSON
                                                 if template.tokenizer_path.is_dir()
                                                 else template.tokenizer_path),
                "template_sha256": _template_digest(template),
                "train_on_prompt": bool(train_on_prompt)}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]
    directory = Path(cache_dir) if cache_dir is not None else _cache_directory(path)
    cache = IndexCache(directory, f"{key}-sft-{safe_label(path.stem)}", settings,
                        {"file": str(path), "file_mtime_ns": stat.st_mtime_ns})

    def build_arrays() -> dict:
        with (phase(f"tokenizing {path} into {directory}") if announce is None
              else contextlib.nullcontext()):
            arrays, bad_rows = _tokenize_file(path, template, train_on_prompt, skip_bad_rows,
                                             _rows_expected(path, lines))
        cache.info.update(skipped_rows=len(bad_rows),
                          first_bad_row=str(bad_rows[0]) if bad_rows else None,
                          conversations=len(arrays["offsets"]) - 1,
                          tokens=int(arrays["offsets"][-1]))
        return arrays

    # The build announces itself as tokenizing (above), not as an index.
    arrays, built = cached_or_built(cache, ARRAYS, _check, build_arrays if build else None,
                                     announce or (lambda directory: None))
    info = cache.info if built else _recorded_info(cache)
    skipped = int(info["skipped_rows"])
    if skipped and not skip_bad_rows:
        raise ConversationError(f"{info['first_bad_row']} ({skipped} rows of {path} are not "
                                "conversations; fix them, or skip and count them with "
                                "--sft-skip-bad-rows)")
    return TokenizedFile(path, arrays["ids"], arrays["offsets"], arrays["loss_mask"],
                         skipped, key, directory, built)


def _recorded_info(cache: IndexCache) -> dict:
    try:
        info = json.loads(cache.description_path.read_text())["info"]
        int(info["skipped_rows"])
        return info
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{cache.description_path} does not say how many rows were skipped "
                        f"({error}); delete it and run again") from None
