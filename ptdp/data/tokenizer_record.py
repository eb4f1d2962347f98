"""Which tokenizer made an indexed dataset: `PREFIX.tokenizer-record.json`.

A `.bin`/`.idx` pair is token ids and nothing else: data preprocessed with
the byte-level tokenizer trains without complaint as GPT-2 tokens (ids below
257 are valid GPT-2 ids), and the model learns nothing useful. `ptdp
preprocess` therefore writes, next to each dataset, a small JSON record of
its tokenizer, and `ptdp train` compares it with the run's tokenizer before
launching (ptdp.data.loader.check_datasets). Megatron-LM writes only the
`.bin` and `.idx`, so the name clashes with none of its files; a dataset
without a record (Megatron-LM's, an older ptdp's) is accepted as before.

The record holds
- `tokenizer_type`, `vocab_size` and `eod` (the end-of-document id);
- `vocabulary_sha256`: a hash of what every id stands for (its bytes, for
  the byte-level tokenizers; its text otherwise), the end-of-document id
  apart. Two tokenizers with the same hash give every id the same meaning,
  however they were given (the shipped GPT-2 ranks or GPT-2's vocab.json and
  merges.txt; a tokenizer.json saved again with other formatting), so the
  comparison is of the vocabulary, not of file bytes;
- `files`: each tokenizer file's name and sha256, said in the refusal;
- `data`: the `.bin` and `.idx` sizes and a hash of the `.idx`'s first and
  last MiB, so that a record left beside files another tool rewrote is
  not believed (it is refused, saying so).

A run with --tokenizer-type NullTokenizer declares the ids opaque: only the
vocabulary size and end-of-document id are compared. A record that cannot be
read is refused (delete it to train without the check).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

from ptdp.data.indexed import data_file_path, index_file_path

RECORD_SUFFIX = ".tokenizer-record.json"
RECORD_FORMAT = 1
MAX_RECORD_BYTES = 1 << 16
_EDGE = 1 << 20          # bytes of the .idx hashed at each end
_FILE_FLAGS = (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file"),
               ("tokenizer_model", "--tokenizer-model"))


class TokenizerRecordError(ValueError):
    """A dataset's tokenizer record refuses the run's tokenizer, or cannot be read."""


def record_path(prefix: str | Path) -> str:
    return f"{prefix}{RECORD_SUFFIX}"


def _sha256_of_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@lru_cache(maxsize=8)
def vocabulary_sha256(tokenizer) -> str | None:
    """A hash of what each id of `tokenizer` stands for (see the module
    docstring); None for a tokenizer without text (NullTokenizer)."""
    from ptdp.data.tokenizer import token_pieces

    pieces = token_pieces(tokenizer, decoded_only=False)
    if pieces is None:
        return None
    digest = hashlib.sha256(f"vocabulary {tokenizer.vocab_size} eod {tokenizer.eod}\n".encode())
    for i in range(tokenizer.vocab_size):
        piece = b"" if i == tokenizer.eod else pieces.get(i, b"")
        digest.update(len(piece).to_bytes(4, "little") + piece)
    return digest.hexdigest()


def describe(tokenizer, tokenizer_type: str, files: dict[str, str | None]) -> dict[str, Any]:
    """The record's tokenizer fields for `tokenizer`, built from
    `tokenizer_type` and `files` ({"vocab_file": path, ...})."""
    return {"tokenizer_type": tokenizer_type, "vocab_size": tokenizer.vocab_size,
            "eod": tokenizer.eod, "vocabulary_sha256": vocabulary_sha256(tokenizer),
            "files": {flag: {"name": Path(files[name]).name, "sha256": _sha256_of_file(files[name])}
                      for name, flag in _FILE_FLAGS if files.get(name)}}


def data_identity(prefix: str | Path) -> dict[str, Any]:
    """Sizes of the pair and a hash of the `.idx`'s ends: cheap for any size,
    and different for nearly any rewrite."""
    idx, bin_ = index_file_path(prefix), data_file_path(prefix)
    size = os.path.getsize(idx)
    digest = hashlib.sha256()
    with open(idx, "rb") as file:
        digest.update(file.read(_EDGE))
        if size > _EDGE:
            file.seek(max(_EDGE, size - _EDGE))
            digest.update(file.read(_EDGE))
    return {"bin_bytes": os.path.getsize(bin_), "idx_bytes": size,
            "idx_ends_sha256": digest.hexdigest()}


def remove_record(prefix: str | Path) -> None:
    """Before a dataset is (re)written: no moment shows an old record next
    to new data."""
    try:
        os.unlink(record_path(prefix))
    except FileNotFoundError:
        pass


def write_record(prefix: str | Path, tokenizer_fields: dict[str, Any], **extra: Any) -> str:
    """Record the tokenizer of the finished dataset `prefix` (written under
    a temporary name and renamed). Returns the record's path."""
    record = {"format": RECORD_FORMAT, "written_by": "ptdp preprocess", **tokenizer_fields,
              **extra, "data": data_identity(prefix)}
    path = record_path(prefix)
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(temporary, "x", encoding="utf-8") as file:
            json.dump(record, file, indent=1)
            file.write("\n")
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return path


def read_record(prefix: str | Path) -> dict[str, Any] | None:
    """The dataset's record; None without one. TokenizerRecordError for one
    that cannot be believed: unreadable, malformed, or beside other data."""
    path = record_path(prefix)
    if not os.path.lexists(path):
        return None
    fix = (f"rerun `ptdp preprocess` to write the dataset and its record again, or delete {path} "
           f"to train without the tokenizer check")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"larger than {MAX_RECORD_BYTES:,} bytes")
        record = json.loads(data.decode("utf-8"))
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        if record.get("format") != RECORD_FORMAT:
            raise ValueError(f"format {record.get('format')!r}, not {RECORD_FORMAT}")
        for key, kind in (("tokenizer_type", str), ("vocab_size", int), ("eod", int),
                          ("files", dict), ("data", dict)):
            if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
                raise ValueError(f"{key!r} is missing or not a {kind.__name__}")
        if not isinstance(record.get("vocabulary_sha256"), (str, type(None))):
            raise ValueError("'vocabulary_sha256' is not a string")
    except (OSError, ValueError, RecursionError) as error:  # JSON and UTF-8 errors are ValueErrors
        raise TokenizerRecordError(f"--data-path {prefix}: its tokenizer record {path} cannot be "
                                   f"read ({error}); {fix}") from None
    try:
        current = data_identity(prefix)
    except OSError as error:
        raise TokenizerRecordError(f"--data-path {prefix}: {error}") from None
    if record["data"] != current:
        raise TokenizerRecordError(
            f"--data-path {prefix}: its tokenizer record {path} describes other data than "
            f"{data_file_path(prefix)} and {index_file_path(prefix)} hold now (their sizes or "
            f"index differ: rewritten since by another tool?), so it cannot say which tokenizer "
            f"made them; {fix}")
    return record


def _said(fields: dict[str, Any]) -> str:
    """'the GPT2BPETokenizer (50,257 tokens)', with its files."""
    files = fields.get("files") or {}
    named = [f"{flag} {entry.get('name')} (sha256 {str(entry.get('sha256'))[:12]}...)"
             for flag, entry in files.items() if isinstance(entry, dict)]
    return (f"the {fields['tokenizer_type']} ({fields['vocab_size']:,} tokens"
            + (", " + ", ".join(named) if named else "") + ")")


def mismatch(record: dict[str, Any], run: dict[str, Any]) -> str | None:
    """Why the run's tokenizer (`describe`'s fields) is not the recorded
    one; None when they give every id the same meaning."""
    null = run["tokenizer_type"] == "NullTokenizer"
    same_size = record["vocab_size"] == run["vocab_size"] and record["eod"] == run["eod"]
    if null:
        if same_size:
            return None
        return (f"--tokenizer-type NullTokenizer --vocab-size {run['eod']} says the ids are "
                f"0..{run['eod'] - 1} with the end of document {run['eod']}, but the data was "
                f"tokenized with {_said(record)}, end of document {record['eod']}; give "
                f"--vocab-size {record['eod']}")
    recorded_vocabulary = record.get("vocabulary_sha256")
    if recorded_vocabulary is not None and run["vocabulary_sha256"] is not None:
        if same_size and recorded_vocabulary == run["vocabulary_sha256"]:
            return None
    elif same_size and record["tokenizer_type"] == run["tokenizer_type"] and \
            {f: e.get("sha256") for f, e in record["files"].items() if isinstance(e, dict)} == \
            {f: e["sha256"] for f, e in run["files"].items()}:
        return None
    return (f"it was tokenized with {_said(record)}, but this run's tokenizer is {_said(run)}: "
            f"its token ids would stand for other text. Train with the tokenizer it was "
            f"preprocessed with (--tokenizer-type {record['tokenizer_type']}"
            + "".join(f" {flag} {entry.get('name')}" for flag, entry in record["files"].items()
                      if isinstance(entry, dict))
            + "), or preprocess the data again with this one")
