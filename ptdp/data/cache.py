"""Where ptdp keeps what it derives from data unless --data-cache-path
says otherwise: a dataset's indices (samples, shuffles, blends) in
index-cache/ next to the dataset, so that they travel with it; everything
else (the tokenized demo corpus, the local machine's measured profile) in
$PTDP_CACHE, else the user cache ($XDG_CACHE_HOME or ~/.cache) under ptdp/."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir(prefix: str | None = None) -> Path:
    """The cache directory of the indexed dataset at `prefix`, or without
    one ptdp's own cache directory."""
    if prefix is not None:
        return Path(prefix).resolve().parent / "index-cache"
    if os.environ.get("PTDP_CACHE"):
        return Path(os.environ["PTDP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ptdp"
