"""Saving a training run's checkpoint (the format: store.py).

A save is three steps, every rank taking part: `take_snapshot` copies what
this rank writes to host memory (a collective: the tensors are gathered to
their logical shapes), `Snapshot.write` writes its files into
`iter_N.partial/`, and rank 0's `Snapshot.publish`, once every rank has
written, adds the sealed metadata with every file's sha256 and makes the
checkpoint visible (store.publish_directory), moves `latest` and prunes for
--keep-last. `save_checkpoint` runs them in line; --async-save runs the
middle one in the background (async_writer.py). What is saved is the
training state the trainer hands down (state.TrainingState).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch

from ptdp.checkpoint.adapters import LORA_BASE
from ptdp.checkpoint.carry import TOKENIZER_FILE, TOKENIZER_KEY, carry_hf_files
from ptdp.checkpoint.integrity import FORMAT, FORMAT_VERSION, OPTIMIZER_START, RUN_START, sha256_of
from ptdp.checkpoint.layout import (layout_record, part_name, rng_file, writes_state_buffers,
                                    writes_tensor)
from ptdp.checkpoint.retention import (LINEAGE, fsync_path, point_latest, prune, remove_leftovers,
                                       set_aside_other_lineages)
from ptdp.checkpoint.state import TrainingState, named_parameters, named_state_buffers, rng_state
from ptdp.checkpoint.store import (FINETUNED_FROM, barrier, iteration_dir, publish_directory,
                                   write_json, write_safetensors)
from ptdp.parallel.collectives import all_gather_flat
from ptdp.parallel.sharding import COPY_ATTR, SHARD_ATTR, gather_logical, is_expert, shard_group


def save_checkpoint(state: TrainingState, save: str | Path, *,
                    keep_last: int | None = None) -> Path:
    """Every rank calls this with the state after iteration `state.iteration`;
    returns the directory. (--async-save takes the same three steps, the
    writing in the background: async_writer.py.)"""
    ctx = state.ctx
    snapshot = take_snapshot(state, save, keep_last=keep_last)
    snapshot.write()
    barrier(ctx)
    if ctx.rank == 0:
        snapshot.publish(keep=state.loss_watch.good)
    barrier(ctx)
    return snapshot.final


def take_snapshot(state: TrainingState, save: str | Path, *,
                  keep_last: int | None = None) -> "Snapshot":
    """Every rank (collective): rank 0 clears a killed save's leftovers and
    makes `iter_N.partial/`; each rank copies what it writes to host memory.
    The trainer may change its tensors as soon as this returns."""
    ctx = state.ctx
    final = iteration_dir(save, state.iteration)
    snapshot = Snapshot(final=final, part=part_name(ctx), rng_file=rng_file(ctx))
    if ctx.rank == 0:
        Path(save).mkdir(parents=True, exist_ok=True)
        remove_leftovers(Path(save))
        (snapshot.partial / "rng").mkdir(parents=True)
    barrier(ctx)
    snapshot.tensors = _logical_tensors(state)  # collective over the tensor and data × context groups
    snapshot.rng = rng_state(state)
    if ctx.rank == 0:
        snapshot.metadata, snapshot.tokenizer = _metadata_draft(state)
        carry_hf_files(state.carried_hf_files, snapshot.partial, snapshot.metadata)  # beside the tokenizer
        snapshot.forked_at, snapshot.keep_last = state.lineage.forked_at, keep_last
    state.loss_watch.saved(final)  # good once the next iteration's loss is in range
    return snapshot


@dataclasses.dataclass
class Snapshot:
    """One rank's share of a checkpoint, held in host memory: its tensors
    (copies, so training may go on changing its own) and random states, and
    on rank 0 the metadata but for the list of files and their checksums."""

    final: Path
    part: str                                     # this rank's tensor file's stem
    rng_file: str
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    rng: dict[str, str] = dataclasses.field(default_factory=dict)
    metadata: dict | None = None                  # rank 0
    tokenizer: bytes | None = None                # rank 0: the tokenizer.json carried
    forked_at: int = 0                            # rank 0: for set_aside_other_lineages
    keep_last: int | None = None                  # rank 0

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.final.name + ".partial")

    def write(self, durable: bool = False) -> dict[str, str]:
        """This rank's files into `iter_N.partial/`; the host copy is freed.
        `durable`: also fsync each file and return its sha256 by name, so
        that publishing need not read it back (async_writer.py)."""
        written = []
        if self.tensors:
            written.append(self.partial / f"{self.part}.safetensors")
            write_safetensors(written[-1], self.tensors)
            write_json(self.partial / f"{self.part}.json", sorted(self.tensors))
        written.append(self.partial / self.rng_file)
        write_json(written[-1], self.rng)
        self.tensors = {}
        digests = {}
        for path in written if durable else ():
            fsync_path(path)
            digests[path.relative_to(self.partial).as_posix()] = sha256_of(path)
        return digests

    def publish(self, keep: Path | None, digests: dict[str, str] | None = None) -> Path:
        """Rank 0, once every rank's part is written: the metadata with the
        files' checksums (`digests`, else read here), sealed; fsync, rename
        into place, `latest`, then --keep-last's pruning (never `keep`, the
        newest checkpoint known good)."""
        partial, final, metadata = self.partial, self.final, copy.deepcopy(self.metadata)
        tensors: dict[str, str] = {}
        for listing in sorted(partial.glob("part-*.json")):
            data_file = listing.with_suffix(".safetensors").name
            for name in json.loads(listing.read_text()):
                if name in tensors:  # each tensor has one writer (layout.writes_tensor)
                    raise RuntimeError(f"{name} was written by two ranks ({tensors[name]} and "
                                       f"{data_file}): a bug in the choice of writers")
                tensors[name] = data_file
            listing.unlink()
        if self.tokenizer is not None:
            (partial / TOKENIZER_FILE).write_bytes(self.tokenizer)
        known = digests or {}
        files = {}
        for path in sorted(partial.rglob("*")):
            if path.is_file():
                name = path.relative_to(partial).as_posix()
                files[name] = known.get(name) or sha256_of(path)
        metadata.update(tensors=tensors, files=files)
        set_aside_other_lineages(final.parent, metadata[LINEAGE], self.forked_at, final)
        publish_directory(partial, final, metadata)
        point_latest(final.parent, final.name)
        if self.keep_last:
            prune(final.parent, self.keep_last, metadata[LINEAGE], keep=keep)
        return final


def _logical_tensors(state: TrainingState) -> dict[str, torch.Tensor]:
    """The logical tensors this rank writes: the first data × context
    replica's share of its stage's, spread over its tensor group (a routed
    expert's: the first expert-data-parallel replica's, spread over its
    expert tensor-parallel group): layout.writes_tensor."""
    ctx, buffer, optimizer = state.ctx, state.buffer, state.optimizer
    flats = {"exp_avg": _full_flat(optimizer.exp_avg, buffer, ctx),
             "exp_avg_sq": _full_flat(optimizer.exp_avg_sq, buffer, ctx)}
    if optimizer.main.data_ptr() != buffer.param_data.data_ptr():
        flats["main"] = _full_flat(optimizer.main, buffer, ctx)
    segments = {id(s.param): s for s in buffer.segments}
    with buffer.gathered():  # (ZeRO-3: the parameters whole while they are read)
        return _logical_tensors_gathered(state, flats, segments)


def _logical_tensors_gathered(state: TrainingState, flats: dict, segments: dict
                              ) -> dict[str, torch.Tensor]:
    ctx = state.ctx
    mine: dict[str, torch.Tensor] = {}
    index = {False: 0, True: 0}  # per kind, so every rank of a group counts alike
    for name, param in named_parameters(state.chunks):
        if getattr(param, COPY_ATTR, False) or id(param) not in segments:
            continue  # the tied embedding's second copy, stored once; LoRA's frozen base
        expert = is_expert(param)
        segment = segments[id(param)]
        spec = getattr(param, SHARD_ATTR, None)
        sources = {"model": param.detach()}
        sources.update({f"optimizer/{kind}": flat[segment.start:segment.end].view(param.shape)
                        for kind, flat in flats.items()})
        for prefix, local in sources.items():
            logical = gather_logical(local, spec, shard_group(param, ctx))
            if writes_tensor(ctx, expert, index[expert]):
                mine[f"{prefix}/{name}"] = logical.detach().clone().contiguous().cpu()
            index[expert] += 1
    if writes_state_buffers(ctx) and not state.config.lora.enabled:  # (LoRA: the base's)
        for name, tensor in named_state_buffers(state.chunks):
            mine[f"model/{name}"] = tensor.detach().clone().contiguous().cpu()
    return mine


def _full_flat(tensor: torch.Tensor, buffer, ctx) -> torch.Tensor:
    """An optimizer tensor in the coordinates of the whole flat buffer (the
    distributed optimizer holds 1/replicas of each bucket: gathered here)."""
    if not buffer.shard:
        return tensor
    full = torch.zeros(buffer.numel, dtype=tensor.dtype, device=tensor.device)
    for bucket in buffer.buckets:
        mine = tensor[bucket.shard_start:bucket.shard_start + bucket.size // bucket.replicas.size]
        if bucket.replicas.group is None:
            full[bucket.start:bucket.end].copy_(mine)
        else:
            all_gather_flat(full[bucket.start:bucket.end], mine, bucket.replicas.group)
    return full


def _metadata_draft(state: TrainingState) -> tuple[dict, bytes | None]:
    """Rank 0: the checkpoint's metadata as the run stands now, but for its
    files (listed when published), and the tokenizer file it carries."""
    tokenizer = state.carried_tokenizer
    optimizer = state.optimizer
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "iteration": state.iteration, "consumed_samples": state.consumed_samples,
        "config": state.config.to_dict(),
        "layout": layout_record(state),
        "optimizer": {"steps": optimizer.steps,
                      "loss_scaler": optimizer.scaler.state_dict(),
                      "skipped_iterations": state.skipped_iterations,
                      OPTIMIZER_START: (None if state.optimizer_start is None
                                        else list(state.optimizer_start))},
        RUN_START: list(state.run_start),
        **state.records,
        LINEAGE: state.lineage.at(state.iteration),
    }
    if state.finetuned_from:
        metadata[FINETUNED_FROM] = state.finetuned_from
    if state.config.lora.enabled:
        metadata[LORA_BASE] = state.lora_base
    if tokenizer is not None:
        metadata[TOKENIZER_KEY] = TOKENIZER_FILE
        # The run's path to it may be a resumed checkpoint's copy, soon pruned:
        # the carried file is the tokenizer (as in an imported checkpoint).
        metadata["config"]["data"]["tokenizer_model"] = None
    return copy.deepcopy(metadata), tokenizer  # (a copy: training goes on changing the records)
