"""The --save directory: which checkpoints it keeps and which one `latest` names.

A checkpoint (ptdp/checkpoint/store.py) records its lineage in metadata.json:
`[run id, last iteration]` pairs from the origin to itself (run B loaded run
A's iteration 5 and saved iteration 8: `[[A, 5], [B, 8]]`). A trainer gets a
new run id when it is built and at every load; a load inherits the loaded
checkpoint's pairs, except a --finetune load: a fine-tune is a new run from
iteration 0 whose lineage is its own (its checkpoints record the loaded one
under "finetuned_from", which nothing here reads), so --keep-last never
counts the loaded run's checkpoints as its own, and validate refuses a
fine-tune whose --save is the loaded checkpoint's directory. A checkpoint of
run r at iteration i is on a lineage when one of its pairs (r, upto) has
i <= upto; one without the key (written before lineages existed) is a
lineage of its own, named by its metadata's sha256.

So a save can tell its own history from an abandoned branch: before a
checkpoint is published, every complete checkpoint in the directory that is
not on its lineage and is newer than the iteration the run started from (the
newer checkpoints a rollback abandons, or another run's that the new ones
would mix with), or that sits at the name about to be written, is renamed
into `SAVE/abandoned/<run id, or legacy>-<UTC time>/`, never deleted
(`latest` is moved off it first). `--keep-last N` removes all but the N newest
complete checkpoints of the lineage, never `latest`'s target and never
another lineage's. Leftovers of a killed save are cleared at the next one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path

LATEST = "latest"
METADATA = "metadata.json"
LINEAGE = "lineage"  # the metadata key
ABANDONED = "abandoned"
CHECKPOINT_NAME = re.compile(r"iter_\d{7}")


@dataclasses.dataclass
class Lineage:
    """Where a trainer stands in the history of checkpoints, so that a save
    can tell the checkpoints it descends from from an abandoned branch."""

    run_id: str
    inherited: list[list]  # [run id, last iteration taken from it], origin first
    forked_at: int  # the iteration this run started from: the loaded one, 0 for a fresh run

    @classmethod
    def fresh(cls) -> "Lineage":
        return cls(uuid.uuid4().hex, [], 0)

    @classmethod
    def loaded(cls, directory: Path, metadata: dict) -> "Lineage":
        """A new run continuing the checkpoint `directory` (whose lineage ends
        at its own iteration)."""
        return cls(uuid.uuid4().hex, recorded_lineage(directory, metadata),
                   int(metadata["iteration"]))

    def at(self, iteration: int) -> list[list]:
        """The lineage a checkpoint of this run at `iteration` records."""
        return self.inherited + [[self.run_id, iteration]]


def recorded_lineage(directory: Path, metadata: dict) -> list[list]:
    """The checkpoint's lineage; one written before lineages existed (or with
    a malformed one) is a lineage of its own, named by its metadata's hash."""
    pairs = metadata.get(LINEAGE)
    well_formed = (isinstance(pairs, list) and pairs
                   and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                           and isinstance(p[1], int) for p in pairs))
    if well_formed:
        return pairs
    digest = hashlib.sha256((directory / METADATA).read_bytes()).hexdigest()
    return [[f"legacy-{digest[:32]}", int(metadata["iteration"])]]


def on_lineage(identity: tuple[str, int], lineage: list[list]) -> bool:
    """Whether the checkpoint (run, iteration) is one the lineage descends from."""
    run, iteration = identity
    return any(r == run and iteration <= upto for r, upto in lineage)


@dataclasses.dataclass(frozen=True)
class Stored:
    """A complete checkpoint found in a save directory."""

    path: Path
    run_id: str
    iteration: int

    @property
    def identity(self) -> tuple[str, int]:
        return self.run_id, self.iteration


def stored_checkpoints(save: Path) -> list[Stored]:
    """The complete checkpoints in `save`, oldest first. A directory without
    readable metadata is not one: left alone unless it blocks a save's name."""
    found = []
    for path in save.glob("iter_*"):
        if not (CHECKPOINT_NAME.fullmatch(path.name) and path.is_dir()):
            continue
        try:
            metadata = json.loads((path / METADATA).read_text())
            run_id, iteration = recorded_lineage(path, metadata)[-1]
        except (OSError, AttributeError, KeyError, TypeError, ValueError,
                RecursionError):  # unreadable, not JSON
            continue
        found.append(Stored(path, run_id, int(iteration)))
    return sorted(found, key=lambda stored: stored.iteration)


# ------------------------------------------------------------------ the directory

def remove_leftovers(save: Path) -> None:
    """Every `iter_*.partial` is left by a job killed while saving (one save
    at a time writes into a directory): never complete, never named by
    `latest`."""
    for leftover in save.glob("iter_*.partial"):
        shutil.rmtree(leftover, ignore_errors=True)
    # A re-save killed between its two renames (store.publish_directory): the complete old
    # checkpoint goes back where `latest` expects it.
    for replaced in save.glob("iter_*.replaced"):
        final = replaced.with_suffix("")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.replace(replaced, final)


def point_latest(save: Path, name: str) -> None:
    temporary = save / f"{LATEST}.tmp"
    temporary.write_text(name + "\n")
    fsync_path(temporary)
    os.replace(temporary, save / LATEST)
    fsync_path(save)


def latest_name(save: Path) -> str | None:
    try:
        return (save / LATEST).read_text().strip()
    except OSError:
        return None


def prune(save: Path, keep_last: int, lineage: list[list], keep: Path | None = None) -> None:
    """All but the `keep_last` newest complete checkpoints of `lineage` (the
    one just saved among them); never `latest`'s target, never `keep` (the
    newest checkpoint known good: loss_range.py), never another lineage's
    checkpoints."""
    ours = [s for s in stored_checkpoints(save) if on_lineage(s.identity, lineage)]
    protected = {latest_name(save), None if keep is None or keep.parent.resolve() != save.resolve()
                 else keep.name}
    for old in ours[:-keep_last]:
        if old.path.name not in protected:
            shutil.rmtree(old.path, ignore_errors=True)


def set_aside_other_lineages(save: Path, lineage: list[list], forked_at: int,
                             final: Path) -> None:
    """Rename into SAVE/abandoned/ every checkpoint not on `lineage` that is
    newer than the iteration this run started from (a rolled-back branch, or
    another run's checkpoints the new ones would mix with), and whatever
    else occupies the name about to be written. Nothing is deleted."""
    stored = stored_checkpoints(save)
    strays = [s for s in stored if not on_lineage(s.identity, lineage)
              and (s.iteration > forked_at or s.path == final)]
    if final.exists() and not any(s.path == final for s in stored):
        strays.append(Stored(final, "unreadable", -1))  # not a complete checkpoint
    if not strays:
        return
    _move_latest_off(save, strays, [s for s in stored if on_lineage(s.identity, lineage)])
    moved = _move_into_abandoned(save, strays)
    print("ptdp: moved checkpoints that are not on this run's lineage out of the way, nothing "
          "deleted: " + "; ".join(f"{', '.join(names)} -> {group}"
                                  for group, names in moved.items()), flush=True)


def _move_latest_off(save: Path, strays: list[Stored], ours: list[Stored]) -> None:
    """`latest` must never name a directory that is about to move: point it
    at this lineage's newest checkpoint here, or remove it when there is none
    (until the new checkpoint is published)."""
    if latest_name(save) not in {s.path.name for s in strays}:
        return
    if ours:
        point_latest(save, ours[-1].path.name)
    else:
        (save / LATEST).unlink()
        fsync_path(save)


def _move_into_abandoned(save: Path, strays: list[Stored]) -> dict[Path, list[str]]:
    """One directory per run: SAVE/abandoned/<run id or legacy>-<UTC time>/."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    groups: dict[str, Path] = {}
    moved: dict[Path, list[str]] = {}
    for stray in strays:
        label = "legacy" if stray.run_id.startswith("legacy-") else stray.run_id
        if label not in groups:
            groups[label] = _unused(save / ABANDONED / f"{label}-{stamp}")
            groups[label].mkdir(parents=True)
        group = groups[label]
        os.rename(stray.path, group / stray.path.name)  # same filesystem: atomic
        moved.setdefault(group, []).append(stray.path.name)
    for group in moved:
        fsync_path(group)
    fsync_path(save)
    return moved


def _unused(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def fsync_path(path: Path) -> None:
    """Durable before the rename that publishes it (directories too, where
    the platform allows opening them)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
