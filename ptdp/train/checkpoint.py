"""Checkpoints that load under any layout.

A checkpoint is a directory `SAVE/iter_0000005/` holding

* `part-pp{r}-tp{k}.safetensors`: logical (unsharded, unpadded) tensors under
  names that do not depend on the layout: `model/<parameter name>` and the
  optimizer's `optimizer/exp_avg/<name>`, `optimizer/exp_avg_sq/<name>` and,
  where the fp32 main weights are not the model's own, `optimizer/main/<name>`.
  Each tensor is stored once. Pipeline ranks write their own layers and the
  tensors of a stage are spread over its tensor ranks, so the files are
  written in parallel; data-parallel replicas write nothing.
* `rng/tp{k}-pp{r}-dp{j}.json`: each rank's random-number-generator states.
* `metadata.json`: the configuration, iteration, consumed samples, layout,
  optimizer step count, loss scaler, where each tensor is, and every file's
  sha256 (checked on load).

`SAVE/latest` names the newest complete checkpoint. A checkpoint is written
into `iter_0000005.partial/`, every file fsynced, renamed into place, and only
then does `latest` move (written to a temporary file and renamed), so a job
killed while saving leaves `latest` on the previous complete checkpoint. The
next save removes every `iter_*.partial` left behind. Files and directories
get the modes the process's umask gives (0644 and 0755 under umask 022).

Lineage: `metadata.json`'s `"lineage"` lists `[run id, last iteration]` pairs
from the origin to this checkpoint (run B loaded run A's iteration 5 and
saved iteration 8: `[[A, 5], [B, 8]]`). A trainer gets a new run id (uuid4
hex) at its first save and at every load; a load inherits the checkpoint's
pairs. A checkpoint of run r at iteration i is on a lineage when one of the
lineage's pairs (r, upto) has i <= upto; one without the key (written before
lineages existed) is a lineage of its own, named by its metadata.json's
sha256. Before a save publishes its checkpoint, every complete checkpoint in
SAVE not on its lineage that is newer than the iteration the run started from
(the loaded one; 0 for a fresh run), or that sits at the name being written,
is renamed into `SAVE/abandoned/<its run id, or legacy>-<UTC time>/iter_*`,
never deleted (`latest` is first moved off it). `--keep-last N` then removes
all but the N newest complete checkpoints of the lineage, never `latest`'s
target and never another lineage's.

Loading cuts each logical tensor into this rank's shard (padding the
vocabulary for this t), so a checkpoint written under one (t, p, d, v,
distributed optimizer or not) loads under any other. The random states are
restored when the layout is the same (resume is then bitwise exact); under
another layout the streams are reseeded from (seed, iteration), since a
rank's dropout stream has no counterpart there. No pickle anywhere: tensors
in safetensors, everything else JSON.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ptdp.config import Config, ModelConfig
from ptdp.parallel.collectives import all_gather_flat
from ptdp.parallel.sharding import COPY_ATTR, SHARD_ATTR, gather_logical, shard

FORMAT = "ptdp-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"
METADATA = "metadata.json"
LINEAGE = "lineage"
ABANDONED = "abandoned"
CHECKPOINT_NAME = re.compile(r"iter_\d{7}")
# Model settings that decide the tensors' shapes: a checkpoint must agree on them.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "vocab_size", "max_position_embeddings")
OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq", "main")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; says what is wrong and what to do."""


def iteration_dir(save: str | Path, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


# ------------------------------------------------------------------ lineage

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
        return cls(uuid.uuid4().hex, _recorded_lineage(directory, metadata),
                   int(metadata["iteration"]))

    def at(self, iteration: int) -> list[list]:
        """The lineage a checkpoint of this run at `iteration` records."""
        return self.inherited + [[self.run_id, iteration]]


def _trainer_lineage(trainer) -> Lineage:
    lineage = getattr(trainer, "checkpoint_lineage", None)
    if lineage is None:
        lineage = trainer.checkpoint_lineage = Lineage.fresh()
    return lineage


def _recorded_lineage(directory: Path, metadata: dict) -> list[list]:
    """The checkpoint's lineage; one written before lineages existed (or with
    a malformed one) is a lineage of its own, named by its metadata's hash."""
    pairs = metadata.get(LINEAGE)
    well_formed = (isinstance(pairs, list) and pairs
                   and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                           and isinstance(p[1], int) for p in pairs))
    if well_formed:
        return pairs
    return [[f"legacy-{_sha256(directory / METADATA)[:32]}", int(metadata["iteration"])]]


def _on_lineage(identity: tuple[str, int], lineage: list[list]) -> bool:
    """Whether the checkpoint (run, iteration) is one the lineage descends from."""
    run, iteration = identity
    return any(r == run and iteration <= upto for r, upto in lineage)


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A complete checkpoint found in a save directory."""

    path: Path
    run_id: str
    iteration: int

    @property
    def identity(self) -> tuple[str, int]:
        return self.run_id, self.iteration


def _stored_checkpoints(save: Path) -> list[_Stored]:
    """The complete checkpoints in `save`, oldest first. A directory without
    readable metadata is not one: left alone unless it blocks a save's name."""
    found = []
    for path in save.glob("iter_*"):
        if not (CHECKPOINT_NAME.fullmatch(path.name) and path.is_dir()):
            continue
        try:
            metadata = read_metadata(path)
            run_id, iteration = _recorded_lineage(path, metadata)[-1]
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
        found.append(_Stored(path, run_id, int(iteration)))
    return sorted(found, key=lambda stored: stored.iteration)


# ------------------------------------------------------------------ saving

def save_checkpoint(trainer, save: str | Path, *, iteration: int, consumed_samples: int,
                    keep_last: int | None = None) -> Path:
    """Every rank calls this after iteration `iteration`; returns the directory."""
    ctx = trainer.ctx
    final = iteration_dir(save, iteration)
    partial = final.with_name(final.name + ".partial")
    lineage = _trainer_lineage(trainer)
    if ctx.rank == 0:
        Path(save).mkdir(parents=True, exist_ok=True)
        _remove_partials(Path(save))
        (partial / "rng").mkdir(parents=True)
    _barrier(ctx)

    tensors = _logical_tensors(trainer)  # collective over the tensor and data groups
    if ctx.dp_rank == 0 and tensors:
        name = f"part-pp{ctx.pp_rank}-tp{ctx.tp_rank}"
        _write_safetensors(partial / f"{name}.safetensors", tensors)
        _write_json(partial / f"{name}.json", sorted(tensors))
    c = ctx.coord
    _write_json(partial / "rng" / f"tp{c.tp}-pp{c.pp}-dp{c.dp}.json", _rng_state(trainer))
    _barrier(ctx)

    if ctx.rank == 0:
        _finish(trainer, partial, final, iteration, consumed_samples)
        _point_latest(Path(save), final.name)
        if keep_last:
            _prune(Path(save), keep_last, lineage.at(iteration))
    _barrier(ctx)
    return final


def _remove_partials(save: Path) -> None:
    """Every `iter_*.partial` is left by a job killed while saving (one save
    at a time writes into a directory): never complete, never named by
    `latest`."""
    for leftover in save.glob("iter_*.partial"):
        shutil.rmtree(leftover, ignore_errors=True)
    # A re-save killed between its two renames (_publish): the complete old
    # checkpoint goes back where `latest` expects it.
    for replaced in save.glob("iter_*.replaced"):
        final = replaced.with_suffix("")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.replace(replaced, final)


def _logical_tensors(trainer) -> dict[str, torch.Tensor]:
    """The logical tensors this rank writes (its share of its stage's)."""
    ctx, buffer, optimizer = trainer.ctx, trainer.buffer, trainer.optimizer
    flats = {"exp_avg": _full_flat(optimizer.exp_avg, buffer, ctx),
             "exp_avg_sq": _full_flat(optimizer.exp_avg_sq, buffer, ctx)}
    if optimizer.main.data_ptr() != buffer.param_data.data_ptr():
        flats["main"] = _full_flat(optimizer.main, buffer, ctx)
    segments = {id(s.param): s for s in buffer.segments}
    mine: dict[str, torch.Tensor] = {}
    index = 0
    for name, param in _named_parameters(trainer):
        if getattr(param, COPY_ATTR, False):
            continue  # the tied embedding's second copy: stored once
        segment = segments[id(param)]
        spec = getattr(param, SHARD_ATTR, None)
        sources = {"model": param.detach()}
        sources.update({f"optimizer/{kind}": flat[segment.start:segment.end].view(param.shape)
                        for kind, flat in flats.items()})
        for prefix, local in sources.items():
            logical = gather_logical(local, spec, ctx.tp_group)
            if index % ctx.tp_size == ctx.tp_rank:
                mine[f"{prefix}/{name}"] = logical.detach().clone().contiguous().cpu()
            index += 1
    return mine


def _full_flat(tensor: torch.Tensor, buffer, ctx) -> torch.Tensor:
    """An optimizer tensor in the coordinates of the whole flat buffer (the
    distributed optimizer holds 1/d of each bucket: gathered here)."""
    if not buffer.shard:
        return tensor
    d = ctx.dp_size
    full = torch.zeros(buffer.numel, dtype=tensor.dtype, device=tensor.device)
    for bucket in buffer.buckets:
        mine = tensor[bucket.start // d:bucket.end // d]
        if ctx.dp_group is None:
            full[bucket.start:bucket.end].copy_(mine)
        else:
            all_gather_flat(full[bucket.start:bucket.end], mine, ctx.dp_group)
    return full


def _finish(trainer, partial: Path, final: Path, iteration: int, consumed_samples: int) -> None:
    """Rank 0, once every rank has written: metadata with checksums, fsync,
    rename into place."""
    config = trainer.config
    lineage = _trainer_lineage(trainer)
    tensors: dict[str, str] = {}
    files: dict[str, str] = {}
    for listing in sorted(partial.glob("part-*.json")):
        data_file = listing.with_suffix(".safetensors").name
        for name in json.loads(listing.read_text()):
            tensors[name] = data_file
        listing.unlink()
    for path in sorted(partial.rglob("*")):
        if path.is_file():
            files[path.relative_to(partial).as_posix()] = _sha256(path)
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "iteration": iteration, "consumed_samples": consumed_samples,
        "config": config.to_dict(),
        "layout": _layout(trainer),
        "optimizer": {"steps": trainer.optimizer.steps,
                      "loss_scaler": trainer.optimizer.scaler.state_dict(),
                      "skipped_iterations": trainer.skipped_iterations},
        "tensors": tensors,
        "files": files,
        LINEAGE: lineage.at(iteration),
    }
    _set_aside_other_lineages(final.parent, metadata[LINEAGE], lineage.forked_at, final)
    _publish(partial, final, metadata)


def _publish(partial: Path, final: Path, metadata: dict) -> None:
    """Metadata last, everything fsynced, then one rename makes it visible."""
    _write_json(partial / METADATA, metadata)
    for path in [*partial.rglob("*"), partial]:
        _fsync(path)
    replaced = None
    if final.exists():  # the same checkpoint of this lineage, saved again
        _check_replaceable(final, metadata[LINEAGE])
        # Two renames, then the deletion: `latest` names a missing directory
        # only between the renames, never while a large tree is removed.
        replaced = final.with_name(final.name + ".replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    _fsync(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _check_replaceable(final: Path, lineage: list[list]) -> None:
    """Only a checkpoint of the lineage being saved may be overwritten
    (_set_aside_other_lineages moved any other one away)."""
    stored = next((s for s in _stored_checkpoints(final.parent) if s.path == final), None)
    if stored is None or not _on_lineage(stored.identity, lineage):
        raise CheckpointError(f"{final} appeared while saving and is not of this run's lineage; "
                              "refusing to overwrite it (is another job saving here?)")


def _point_latest(save: Path, name: str) -> None:
    temporary = save / f"{LATEST}.tmp"
    temporary.write_text(name + "\n")
    _fsync(temporary)
    os.replace(temporary, save / LATEST)
    _fsync(save)


def _latest_name(save: Path) -> str | None:
    try:
        return (save / LATEST).read_text().strip()
    except OSError:
        return None


def _prune(save: Path, keep_last: int, lineage: list[list]) -> None:
    """All but the `keep_last` newest complete checkpoints of `lineage` (the
    one just saved among them); never `latest`'s target, never another
    lineage's checkpoints."""
    ours = [s for s in _stored_checkpoints(save) if _on_lineage(s.identity, lineage)]
    protected = _latest_name(save)
    for old in ours[:-keep_last]:
        if old.path.name != protected:
            shutil.rmtree(old.path, ignore_errors=True)


def _set_aside_other_lineages(save: Path, lineage: list[list], forked_at: int,
                              final: Path) -> None:
    """Rename into SAVE/abandoned/ every checkpoint not on `lineage` that is
    newer than the iteration this run started from (a rolled-back branch, or
    another run's checkpoints the new ones would mix with), and whatever
    else occupies the name about to be written. Nothing is deleted."""
    stored = _stored_checkpoints(save)
    strays = [s for s in stored if not _on_lineage(s.identity, lineage)
              and (s.iteration > forked_at or s.path == final)]
    if final.exists() and not any(s.path == final for s in stored):
        strays.append(_Stored(final, "unreadable", -1))  # not a complete checkpoint
    if not strays:
        return
    _move_latest_off(save, strays, [s for s in stored if _on_lineage(s.identity, lineage)])
    moved = _move_into_abandoned(save, strays)
    print("ptdp: moved checkpoints that are not on this run's lineage out of the way, nothing "
          "deleted: " + "; ".join(f"{', '.join(names)} -> {group}"
                                  for group, names in moved.items()), flush=True)


def _move_latest_off(save: Path, strays: list[_Stored], ours: list[_Stored]) -> None:
    """`latest` must never name a directory that is about to move: point it
    at this lineage's newest checkpoint here, or remove it when there is none
    (until the new checkpoint is published)."""
    if _latest_name(save) not in {s.path.name for s in strays}:
        return
    if ours:
        _point_latest(save, ours[-1].path.name)
    else:
        (save / LATEST).unlink()
        _fsync(save)


def _move_into_abandoned(save: Path, strays: list[_Stored]) -> dict[Path, list[str]]:
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
        _fsync(group)
    _fsync(save)
    return moved


def _unused(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


# ------------------------------------------------------------------ loading

def resolve(load: str | Path) -> Path:
    """The checkpoint directory `--load` points at: SAVE (through `latest`)
    or one iter_* directory."""
    load = Path(load)
    if (load / METADATA).is_file():
        return load
    pointer = load / LATEST
    if pointer.is_file():
        target = load / pointer.read_text().strip()
        if not (target / METADATA).is_file():
            raise CheckpointError(f"--load {load}: {LATEST} names {target.name}, which is not a "
                                  "complete checkpoint (deleted?); point --load at an iter_* "
                                  "directory that is")
        return target
    if not load.exists():
        raise CheckpointError(f"--load {load}: no such directory")
    raise CheckpointError(f"--load {load}: no checkpoint here (neither {LATEST} nor {METADATA})")


def read_metadata(directory: Path) -> dict[str, Any]:
    try:
        metadata = json.loads((directory / METADATA).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{directory / METADATA}: unreadable ({error}); the checkpoint is "
                              "damaged") from None
    if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: not a {FORMAT} version {FORMAT_VERSION} checkpoint")
    return metadata


def check_model_fits(metadata: dict, model: ModelConfig, directory: Path) -> None:
    saved = metadata["config"]["model"]
    ours = dataclasses.asdict(model)
    differences = [f"--{name.replace('_', '-')}: checkpoint {_effective(saved, name)}, "
                   f"requested {_effective(ours, name)}"
                   for name in SHAPE_FIELDS if _effective(saved, name) != _effective(ours, name)]
    if differences:
        raise CheckpointError(f"--load {directory} holds another model size:\n    "
                              + "\n    ".join(differences)
                              + "\n  use the checkpoint's settings or another checkpoint")


def _effective(model: dict, name: str):
    """Defaults resolved: ffn 4h, positions = sequence length."""
    value = model.get(name)
    if value is None and name == "ffn_hidden_size":
        return 4 * model["hidden_size"]
    if value is None and name == "max_position_embeddings":
        return model["seq_length"]
    return value


class _Reader:
    """Opens the checkpoint's safetensors files on demand, each verified
    against its sha256 the first time."""

    def __init__(self, directory: Path, metadata: dict):
        self.directory, self.metadata = directory, metadata
        self.handles: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.metadata["tensors"]

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if not self.has(name):
            raise CheckpointError(f"{self.directory}: has no tensor {name!r} (a checkpoint of "
                                  "another model?)")
        file = self.metadata["tensors"][name]
        if file not in self.handles:
            verify_file(self.directory, file, self.metadata)
            self.handles[file] = safe_open(str(self.directory / file), framework="pt")
        return self.handles[file].get_tensor(name)


def verify_file(directory: Path, file: str, metadata: dict) -> None:
    expected = metadata["files"].get(file)
    path = directory / file
    if expected is None or not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    if _sha256(path) != expected:
        raise CheckpointError(f"{path}: sha256 differs from {METADATA}; the file is damaged "
                              "(load an earlier checkpoint)")


def load_checkpoint(trainer, load: str | Path) -> dict[str, Any]:
    """Load into this rank's model, optimizer and random streams; returns the
    metadata (iteration, consumed_samples, ...). Every rank calls it."""
    directory = resolve(load)
    metadata = read_metadata(directory)
    check_model_fits(metadata, trainer.config.model, directory)
    reader = _Reader(directory, metadata)
    ctx, buffer, optimizer = trainer.ctx, trainer.buffer, trainer.optimizer
    segments = {id(s.param): s for s in buffer.segments}
    has_optimizer = reader.has(f"optimizer/exp_avg/{_first_name(trainer)}")
    flats = {kind: torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.param_data.device)
             for kind in OPTIMIZER_KINDS}
    with torch.no_grad():
        for name, param in _named_parameters(trainer):
            spec = getattr(param, SHARD_ATTR, None)
            segment = segments[id(param)]
            # The fp32 main weights, where saved, are the exact values.
            main_name = f"optimizer/main/{name}"
            weights = reader.get(main_name if reader.has(main_name) else f"model/{name}")
            local = _local(weights, spec, param.shape, name, directory)
            param.copy_(local.to(param.dtype))
            flats["main"][segment.start:segment.end].copy_(local.reshape(-1))
            if has_optimizer:
                for kind in ("exp_avg", "exp_avg_sq"):
                    moment = _local(reader.get(f"optimizer/{kind}/{name}"), spec, param.shape,
                                    name, directory)
                    flats[kind][segment.start:segment.end].copy_(moment.reshape(-1))
        kinds = OPTIMIZER_KINDS if has_optimizer else ("main",)
        for kind in kinds:
            target = getattr(optimizer, kind)
            if kind == "main" and target.data_ptr() == buffer.param_data.data_ptr():
                continue  # fp32 without sharding: the main weights are the model's
            target.copy_(_owned(flats[kind], buffer, ctx))
    if has_optimizer:
        optimizer.steps = int(metadata["optimizer"]["steps"])
        optimizer.scaler.load_state_dict(metadata["optimizer"]["loss_scaler"])
        trainer.skipped_iterations = int(metadata["optimizer"].get("skipped_iterations", 0))
    _restore_rng(trainer, directory, metadata)
    trainer.checkpoint_lineage = Lineage.loaded(directory, metadata)
    _barrier(ctx)
    return metadata


def _local(logical: torch.Tensor, spec, shape: torch.Size, name: str, directory: Path) -> torch.Tensor:
    local = shard(logical, spec) if spec is not None else logical
    if tuple(local.shape) != tuple(shape):
        raise CheckpointError(f"{directory}: {name} has shape {tuple(logical.shape)}, which does "
                              f"not fit this model (this rank's piece is {tuple(shape)})")
    return local


def _owned(full: torch.Tensor, buffer, ctx) -> torch.Tensor:
    """The inverse of _full_flat: this rank's part in the optimizer's coordinates."""
    if not buffer.shard:
        return full
    return torch.cat([full[slice(*buffer.owned_range(bucket))] for bucket in buffer.buckets])


def _first_name(trainer) -> str:
    return next(name for name, _ in _named_parameters(trainer))


# ------------------------------------------------------------------ model only

def load_logical_model(load: str | Path) -> tuple[Config, dict[str, torch.Tensor], dict]:
    """The configuration and logical weights of a checkpoint (for generation
    and export), in fp32 where the main weights were saved."""
    directory = resolve(load)
    metadata = read_metadata(directory)
    reader = _Reader(directory, metadata)
    names = sorted(n[len("model/"):] for n in metadata["tensors"] if n.startswith("model/"))
    weights = {}
    for name in names:
        main = f"optimizer/main/{name}"
        weights[name] = reader.get(main if reader.has(main) else f"model/{name}")
    return Config.from_dict(metadata["config"]), weights, metadata


def save_logical_model(save: str | Path, config: Config, weights: dict[str, torch.Tensor], *,
                       iteration: int = 0) -> Path:
    """A model-only checkpoint from logical weights (one process; e.g. an
    imported GPT-2), the start of a lineage of its own. Training from it
    starts a fresh optimizer."""
    final = iteration_dir(save, iteration)
    partial = final.with_name(final.name + ".partial")
    lineage = Lineage.fresh()
    Path(save).mkdir(parents=True, exist_ok=True)
    _remove_partials(Path(save))
    partial.mkdir(parents=True)
    tensors = {f"model/{name}": tensor.detach().contiguous().cpu() for name, tensor in weights.items()}
    _write_safetensors(partial / "part-pp0-tp0.safetensors", tensors)
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration,
                "consumed_samples": 0, "config": config.to_dict(), "layout": None,
                "optimizer": None, "tensors": {name: "part-pp0-tp0.safetensors" for name in tensors},
                "files": {"part-pp0-tp0.safetensors": _sha256(partial / "part-pp0-tp0.safetensors")},
                LINEAGE: lineage.at(iteration)}
    _set_aside_other_lineages(Path(save), metadata[LINEAGE], lineage.forked_at, final)
    _publish(partial, final, metadata)
    _point_latest(Path(save), final.name)
    return final


# ------------------------------------------------------------------ random states

def _layout(trainer) -> dict[str, Any]:
    ctx = trainer.ctx
    return {"tensor": ctx.tp_size, "pipeline": ctx.pp_size, "data": ctx.dp_size,
            "chunks": trainer.num_chunks,
            "distributed_optimizer": bool(trainer.buffer.shard)}


def _rng_state(trainer) -> dict[str, str]:
    states = trainer.chunks[0].rng.get_states()
    states["cpu"] = torch.get_rng_state()
    return {name: base64.b64encode(state.cpu().numpy().tobytes()).decode() for name, state in
            states.items()}


def _restore_rng(trainer, directory: Path, metadata: dict) -> None:
    c = trainer.ctx.coord
    file = f"rng/tp{c.tp}-pp{c.pp}-dp{c.dp}.json"
    same_layout = metadata.get("layout") == _layout(trainer)
    rng = trainer.chunks[0].rng
    if same_layout and file in metadata["files"]:
        verify_file(directory, file, metadata)
        saved = json.loads((directory / file).read_text())
        states = {name: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
                  for name, text in saved.items()}
        torch.set_rng_state(states.pop("cpu"))
        rng.set_states(states)
    else:
        # No counterpart for this rank's streams: a fresh, reproducible seed.
        seed = trainer.config.train.seed + int(metadata["iteration"])
        rng.seed(seed, trainer.ctx)
        torch.manual_seed(seed)


# ------------------------------------------------------------------ helpers

def _named_parameters(trainer):
    for chunk in trainer.chunks:
        yield from chunk.named_parameters()


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": FORMAT})
    # safetensors writes through a private (0600) temporary file: give it the
    # mode of a normally created file, so whoever may read SAVE may read it.
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
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


def _barrier(ctx) -> None:
    if ctx.grid.world_size > 1 and dist.is_initialized():
        dist.barrier()
