"""A checkpoint as ptdp wrote it before the seal (format version 1), made
from a sealed one: no seal, none of the arithmetic records, tensor files
whose headers record no version, and the files' checksums updated (as the
old writer computed them). Only such a checkpoint loads unsealed."""

import hashlib
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from ptdp.checkpoint.integrity import FORMAT


def make_version_1(directory: Path) -> None:
    path = directory / "metadata.json"
    metadata = json.loads(path.read_text())
    for key in ("metadata_sha256", "run_start"):
        metadata.pop(key, None)
    if metadata.get("optimizer"):
        metadata["optimizer"].pop("started_at", None)
    metadata["format_version"] = 1
    for file in sorted(set(metadata["tensors"].values())):
        save_file(load_file(str(directory / file)), str(directory / file),
                  metadata={"format": FORMAT})
        metadata["files"][file] = hashlib.sha256((directory / file).read_bytes()).hexdigest()
    path.write_text(json.dumps(metadata))
