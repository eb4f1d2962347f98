"""An imported model's other Hugging Face files in its checkpoints.

Beside the tokenizer.json it carries, a checkpoint imported from Hugging
Face keeps the files that say how the model is used (tokenizer_config.json
with its chat template and special tokens, chat_template.jinja,
special_tokens_map.json, generation_config.json, config.json: see
ptdp/interop/hf_carried.py) under `hf/`, listed in metadata["hf_files"] and
checked by their sha256 like every file of a checkpoint; an export writes
them back. A training run that loads such a checkpoint carries them into its
own checkpoints as long as it trains with the tokenizer they describe.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path, PurePosixPath
from typing import Mapping

# A checkpoint may carry the Hugging Face tokenizer.json its model was trained
# with, so that generation, export and resumed training need no tokenizer flags.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_KEY = "tokenizer"  # metadata key naming the carried file
HF_FILES_DIR = "hf"  # the other files, under their Hugging Face names
HF_FILES_KEY = "hf_files"  # metadata key listing them (paths in the checkpoint)


def write_hf_files(hf_files: Mapping[str, bytes] | None, directory: Path) -> list[str]:
    """Write an imported model's other Hugging Face files (name -> contents)
    under HF_FILES_DIR of a checkpoint being written; returns their paths
    there, for metadata["files"] (sha256) and metadata[HF_FILES_KEY]."""
    if not hf_files:
        return []
    (directory / HF_FILES_DIR).mkdir(exist_ok=True)
    written = []
    for name, contents in sorted(hf_files.items()):
        if Path(name).name != name or name.startswith("."):
            raise ValueError(f"{name!r} is not the name of a Hugging Face file")
        (directory / HF_FILES_DIR / name).write_bytes(contents)
        written.append(f"{HF_FILES_DIR}/{name}")
    return written


def carry_hf_files(carried: Mapping[str, bytes] | None, partial: Path, metadata: dict) -> None:
    """Rank 0, at a training run's save: the files the run carries (from
    the checkpoint it loaded: hf_files_to_carry) into the checkpoint being
    written (`partial`, whose file list and checksums come later), listed
    in its `metadata`."""
    written = write_hf_files(carried, partial)
    if written:
        metadata[HF_FILES_KEY] = written


def checkpoint_hf_files(directory: Path, metadata: dict) -> dict[str, bytes]:
    """The other Hugging Face files the checkpoint in `directory` (whose
    verified `metadata` is given) carries, name -> contents, each checked
    against its sha256; empty if it carries none."""
    from ptdp.checkpoint.integrity import damaged, verify_file

    listed = metadata.get(HF_FILES_KEY) or []
    if not isinstance(listed, list) or not all(isinstance(path, str) for path in listed):
        raise damaged(directory, f"metadata.json: {HF_FILES_KEY!r} is not a list of files")
    files = {}
    for path in listed:
        verify_file(directory, path, metadata)
        files[PurePosixPath(path).name] = (directory / path).read_bytes()
    return files


def hf_files_to_carry(state, directory: Path, metadata: dict) -> dict[str, bytes]:
    """The loaded checkpoint's other Hugging Face files, for the run's
    checkpoints: they describe the checkpoint's tokenizer, so a run that
    trains with another (`state.carried_tokenizer`, a state.TrainingState's:
    none under --mock-data) drops them, and says so."""
    files = checkpoint_hf_files(directory, metadata)
    loaded = metadata.get(TOKENIZER_KEY)
    ours = getattr(state, "carried_tokenizer", None)
    if files and (hashlib.sha256(ours).hexdigest() if ours is not None else None) != \
            (metadata["files"].get(loaded) if loaded else None):
        print(f"ptdp: note: --load {directory} carries its Hugging Face tokenizer settings (chat "
              f"template, special tokens, generation config), which belong to its tokenizer; this "
              f"run trains with another, so its checkpoints do not carry them and an export "
              f"writes the tokenizer's own", file=sys.stderr, flush=True)
        return {}
    return files
