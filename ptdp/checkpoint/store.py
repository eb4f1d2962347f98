"""Checkpoints that load under any layout.

A checkpoint is a directory `SAVE/iter_0000005/` holding

* `part-pp{r}-tp{k}.safetensors`: logical (unsharded, unpadded) tensors under
  names that do not depend on the layout: `model/<parameter name>` and the
  optimizer's `optimizer/exp_avg/<name>`, `optimizer/exp_avg_sq/<name>` and,
  where the fp32 main weights are not the model's own, `optimizer/main/<name>`.
  Each tensor is stored once. Pipeline ranks write their own layers and the
  tensors of a stage are spread over its tensor ranks, so the files are
  written in parallel; data-parallel replicas and context ranks (which hold
  the same parameters) write nothing. A file is named after its writer's
  context and data ranks too (`-cp{c}`, `-dp{j}`) where these are not 0:
  routed experts are written by their first expert-data-parallel replica.
* `rng/tp{k}-pp{r}-dp{j}.json`: each rank's random-number-generator states;
  `rng/tp{k}-cp{c}-pp{r}-dp{j}.json` under context parallelism (c > 1).
* `metadata.json`: the configuration, iteration, consumed samples, layout,
  optimizer step count, loss scaler, where each tensor is, every file's
  sha256 (checked on load), and its own sha256: a checkpoint proves itself
  before it is loaded (integrity.py).
* `tokenizer.json`, where the model has a Hugging Face tokenizer (a run
  with HuggingFaceTokenizer, or an imported model): `metadata["tokenizer"]`
  names it, and `checkpoint_tokenizer` returns it, checked.
* `hf/`, an imported model's other Hugging Face files (chat template,
  special tokens, generation settings: ptdp/interop/hf_carried.py), kept
  for export; `metadata["hf_files"]` names them. Training carries them on
  while it keeps the tokenizer they describe (carry.py).

`SAVE/latest` names the newest complete checkpoint. A checkpoint is written
into `iter_0000005.partial/`, every file fsynced, renamed into place, and only
then does `latest` move (written to a temporary file and renamed), so a job
killed while saving leaves `latest` on the previous complete checkpoint. The
next save removes every `iter_*.partial` left behind. Files and directories
get the modes the process's umask gives (0644 and 0755 under umask 022).

`metadata.json` also records the checkpoint's lineage, so that a save never
deletes or overwrites a checkpoint it should keep (`--keep-last`, rollbacks,
another run's checkpoints in the same directory): see retention.py.

A training run saves and loads through a typed TrainingState (state.py,
snapshot.py). Loading cuts each logical tensor into this rank's shard (padding the
vocabulary for this t), so a checkpoint written under one (t, c, p, d, v,
distributed optimizer or not) loads under any other. The random states are
restored when the layout is the same (resume is then bitwise exact); under
another layout the streams are reseeded from (seed, iteration), since a
rank's dropout stream has no counterpart there. No pickle anywhere: tensors
in safetensors, everything else JSON.

Megatron-LM's load controls: --finetune (the weights only, for a new run
from iteration 0 with a lineage of its own), --no-load-optim and
--no-load-rng (ptdp.train.resume.load_checkpoint), and --use-checkpoint-args (the
model's settings from metadata.json, before validation: args.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ptdp.checkpoint.carry import HF_FILES_KEY, TOKENIZER_FILE, TOKENIZER_KEY, write_hf_files
from ptdp.checkpoint.errors import CheckpointError
from ptdp.checkpoint.integrity import (CHECKPOINT_NAME, FORMAT, FORMAT_VERSION, damaged, seal,
                                       sha256_of, tensor_file_metadata, verify, verify_file)
from ptdp.checkpoint.lock import SaveLock
from ptdp.checkpoint.retention import (LATEST, LINEAGE, METADATA, Lineage, fsync_path, on_lineage,
                                       point_latest, remove_leftovers, set_aside_other_lineages,
                                       stored_checkpoints)
from ptdp.config import Config, ModelConfig
from ptdp.file_modes import give_ordinary_mode

# Model settings that decide the tensors' shapes: a checkpoint must agree on them.
# The settings that decide which tensors a model has and their shapes, with
# defaults resolved (ffn 4·h or SwiGLU's, positions = sequence length).
SHAPE_SETTINGS = (
    ("--num-layers", lambda m: m.num_layers),
    ("--hidden-size", lambda m: m.hidden_size),
    ("--num-attention-heads", lambda m: m.num_attention_heads),
    ("--num-query-groups", lambda m: m.query_groups),
    ("--kv-channels", lambda m: None if m.multi_latent_attention else m.head_dim),
    ("--ffn-hidden-size", lambda m: m.ffn_size),
    ("--vocab-size", lambda m: m.vocab_size),
    ("--max-position-embeddings", lambda m: None if m.rope else m.max_positions),  # rope: no table
    ("--normalization", lambda m: m.normalization),
    ("--swiglu", lambda m: m.swiglu),
    ("--geglu or --quick-geglu", lambda m: m.gated_linear_unit and not m.swiglu),
    ("--sandwich-norm", lambda m: m.sandwich_norm),
    ("--position-embedding-type", lambda m: m.position_embedding_type),
    ("--untie-embeddings-and-output-weights", lambda m: m.untie_embeddings_and_output_weights),
    ("--disable-bias-linear", lambda m: m.disable_bias_linear),
    ("--add-qkv-bias", lambda m: m.qkv_bias and not m.bias),
    ("--qk-layernorm", lambda m: m.qk_layernorm),
    # Same shapes, other meaning: the norms' weights hold scale - 1 under it.
    ("--apply-layernorm-1p", lambda m: m.apply_layernorm_1p),
    # Mixtures of experts: which layers, how many experts, their widths.
    ("--num-experts", lambda m: m.num_experts),
    ("--moe-layer-freq",
     lambda m: "".join("1" if moe else "0" for moe in m.moe_layer_pattern) if m.is_moe else None),
    ("--moe-ffn-hidden-size", lambda m: m.moe_ffn_size if m.is_moe else None),
    ("--moe-shared-expert-intermediate-size",
     lambda m: m.moe_shared_expert_intermediate_size if m.is_moe else None),
    ("--moe-shared-expert-gate", lambda m: m.is_moe and m.moe_shared_expert_gate),
    # Multi-latent attention's projections and their widths.
    ("--multi-latent-attention", lambda m: m.multi_latent_attention),
    *((flag, lambda m, name=name: getattr(m, name) if m.multi_latent_attention else None)
      for flag, name in (("--q-lora-rank", "q_lora_rank"), ("--kv-lora-rank", "kv_lora_rank"),
                         ("--qk-head-dim", "qk_head_dim"),
                         ("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim"),
                         ("--v-head-dim", "v_head_dim"))),
    # Multi-token prediction's modules (a model without them would drop them).
    ("--mtp-num-layers", lambda m: m.mtp_depth),
)
OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq", "main")
# Metadata key of a fine-tune's checkpoints: the checkpoint whose weights it
# started from ({"checkpoint", "iteration", "lineage"}); a record only, which
# retention never reads (a fine-tune's lineage is its own).
FINETUNED_FROM = "finetuned_from"


def iteration_dir(save: str | Path, iteration: int) -> Path:
    return Path(save) / f"iter_{iteration:07d}"


# ------------------------------------------------------------------ publishing

def publish_directory(partial: Path, final: Path, metadata: dict) -> None:
    """Metadata last (sealed), everything fsynced, then one rename makes it visible."""
    write_json(partial / METADATA, seal(metadata))
    for path in [*partial.rglob("*"), partial]:
        fsync_path(path)
    replaced = None
    if final.exists():  # the same checkpoint of this lineage, saved again
        _check_replaceable(final, metadata[LINEAGE])
        # Two renames, then the deletion: `latest` names a missing directory
        # only between the renames, never while a large tree is removed.
        replaced = final.with_name(final.name + ".replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    fsync_path(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _check_replaceable(final: Path, lineage: list[list]) -> None:
    """Only a checkpoint of the lineage being saved may be overwritten
    (set_aside_other_lineages moved any other one away)."""
    stored = next((s for s in stored_checkpoints(final.parent) if s.path == final), None)
    if stored is None or not on_lineage(stored.identity, lineage):
        raise CheckpointError(f"{final} appeared while saving and is not of this run's lineage; "
                              "refusing to overwrite it (is another job saving here?)")


# ------------------------------------------------------------------ loading

def resolve(load: str | Path) -> Path:
    """The checkpoint directory `--load` points at: SAVE (through `latest`)
    or one iter_* directory."""
    load = Path(load)
    if (load / METADATA).is_file():
        return load
    pointer = load / LATEST
    if pointer.is_file():
        target = load / _latest_name(pointer)
        if not (target / METADATA).is_file():
            raise CheckpointError(f"--load {load}: {LATEST} names {target.name}, which is not a "
                                  "complete checkpoint (deleted?); point --load at an iter_* "
                                  "directory that is")
        return target
    if not load.exists():
        raise CheckpointError(f"--load {load}: no such directory")
    raise CheckpointError(f"--load {load}: no checkpoint here (neither {LATEST} nor {METADATA})")


def _latest_name(pointer: Path) -> str:
    """The checkpoint `latest` names: only an iter_* directory beside it
    (never a path elsewhere, which would load another run's checkpoint)."""
    try:
        name = pointer.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        name = None
    if name is None or not CHECKPOINT_NAME.fullmatch(name):
        shown = "unreadable bytes" if name is None else repr(name[:80])
        raise CheckpointError(f"{pointer}: holds {shown}, not the name of an iter_* checkpoint in "
                              f"{pointer.parent}; the file is damaged: point --load at an iter_* "
                              f"directory (or write its name into {pointer.name})")
    return name


def save_inside_a_checkpoint(save: str | Path) -> str | None:
    """Why --save cannot be used because it is (or is inside) a checkpoint
    directory: new checkpoints would nest in it, and retention would treat
    them as part of it. None when it is not."""
    path = Path(save).absolute()
    for directory in (path, *path.parents):
        name = directory.name.removesuffix(".partial")
        if CHECKPOINT_NAME.fullmatch(name) or _holds_checkpoint_metadata(directory):
            return (f"--save {save} is {'' if directory == path else 'inside '}the checkpoint "
                    f"{directory}: --save is the directory that holds the iter_* checkpoints "
                    f"(and `latest`); use --save {directory.parent}")
    return None


def _holds_checkpoint_metadata(directory: Path) -> bool:
    """A ptdp checkpoint's metadata.json is there (another program's file of
    that name is not)."""
    try:
        return json.loads((directory / METADATA).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def nothing_to_train(config: Config) -> str | None:
    """The note when --load's checkpoint is already at or past the run's last
    iteration (resuming a finished run trains nothing); None otherwise."""
    from ptdp.data.batches import GlobalBatches

    tr = config.train
    if not tr.load or tr.finetune:
        return None
    directory = resolve(tr.load)
    done = int(read_metadata(directory)["iteration"])
    total = GlobalBatches(tr, config.parallel.dp).train_iters
    if total > done:
        return None
    length = (f"--train-samples {tr.train_samples:,} gives {total} iterations"
              if tr.train_samples is not None else f"--train-iters {total}")
    return (f"ptdp: nothing to train: --load {directory} is at iteration {done}, and {length} "
            f"{'ends there' if total == done else 'ended before it'}; give a larger "
            f"{'--train-samples' if tr.train_samples is not None else '--train-iters'} to train on "
            f"(nothing was started or written)")


def read_metadata(directory: Path) -> dict[str, Any]:
    """The checkpoint's metadata, verified (integrity.verify)."""
    try:
        metadata = json.loads((directory / METADATA).read_text())
    # UnicodeDecodeError and JSONDecodeError are ValueErrors; RecursionError:
    # nested too deeply for json's decoder
    except (OSError, ValueError, RecursionError) as error:
        raise damaged(directory, f"{METADATA} is unreadable ({error})") from None
    verify(directory, metadata)
    return metadata


def check_model_fits(metadata: dict, model: ModelConfig, directory: Path) -> None:
    saved = saved_model_config(metadata)
    differences = [f"{flag}: checkpoint {_shown(flag, value(saved))}, requested "
                   f"{_shown(flag, value(model))}"
                   for flag, value in SHAPE_SETTINGS if value(saved) != value(model)]
    if differences:
        raise CheckpointError(f"--load {directory} holds another model:\n    "
                              + "\n    ".join(differences)
                              + "\n  use the checkpoint's settings (--use-checkpoint-args takes "
                                "them from it) or another checkpoint")


def _shown(flag: str, value: Any) -> str:
    """A shape setting's value as the mismatch message shows it."""
    if value is None:
        return {"--max-position-embeddings": "none (rotary positions: no table)",
                "--num-experts": "none (dense)"}.get(flag, "none")
    if flag == "--moe-layer-freq":
        return f"MoE layers {[i for i, c in enumerate(value) if c == '1']}"
    return str(value)


def saved_model_config(metadata: dict) -> ModelConfig:
    """The checkpoint's model settings; those it predates take their defaults
    (a checkpoint without `swiglu` is GPT-2's MLP)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in metadata["config"]["model"].items() if k in known})


class Reader:
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


# ------------------------------------------------------------------ model only

def load_logical_model(load: str | Path) -> tuple[Config, dict[str, torch.Tensor], dict]:
    """The configuration and logical weights of a checkpoint (for generation
    and export), in fp32 where the main weights were saved."""
    directory = resolve(load)
    metadata = read_metadata(directory)
    reader = Reader(directory, metadata)
    names = sorted(n[len("model/"):] for n in metadata["tensors"] if n.startswith("model/"))
    weights = {}
    for name in names:
        main = f"optimizer/main/{name}"
        weights[name] = reader.get(main if reader.has(main) else f"model/{name}")
    return Config.from_dict(metadata["config"]), weights, metadata


def save_logical_model(save: str | Path, config: Config, weights: dict[str, torch.Tensor], *,
                       iteration: int = 0, tokenizer_file: Path | str | None = None,
                       hf_files: Mapping[str, bytes] | None = None,
                       records: Mapping[str, Any] | None = None) -> Path:
    """A model-only checkpoint from logical weights (one process; e.g. an
    imported GPT-2), the start of a lineage of its own. Training from it
    starts a fresh optimizer. `tokenizer_file` (a Hugging Face
    tokenizer.json) travels with it as TOKENIZER_FILE, `hf_files` (name ->
    contents: an imported model's other Hugging Face files) under
    HF_FILES_DIR. `records`: more metadata under their keys (an imported
    adapter's base). A failed write (a full disk) leaves no partial checkpoint."""
    with SaveLock(save):  # no job may be saving there meanwhile
        return _save_logical_model(save, config, weights, iteration, tokenizer_file, hf_files,
                                   records or {})


def _save_logical_model(save, config: Config, weights: dict[str, torch.Tensor], iteration: int,
                        tokenizer_file: Path | str | None,
                        hf_files: Mapping[str, bytes] | None, records: Mapping[str, Any]) -> Path:
    final = iteration_dir(save, iteration)
    partial = final.with_name(final.name + ".partial")
    lineage = Lineage.fresh()
    remove_leftovers(Path(save))
    partial.mkdir(parents=True)
    try:
        tensors = {f"model/{name}": tensor.detach().contiguous().cpu()
                   for name, tensor in weights.items()}
        write_safetensors(partial / "part-pp0-tp0.safetensors", tensors)
        carried = copy_tokenizer(tokenizer_file, partial)
        carried_hf = write_hf_files(hf_files, partial)
        files = {name: sha256_of(partial / name)
                 for name in ["part-pp0-tp0.safetensors", *([carried] if carried else []),
                              *carried_hf]}
        metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration,
                    "consumed_samples": 0, "config": config.to_dict(), "layout": None,
                    "optimizer": None,
                    "tensors": {name: "part-pp0-tp0.safetensors" for name in tensors},
                    "files": files, LINEAGE: lineage.at(iteration), **records}
        if carried:
            metadata[TOKENIZER_KEY] = carried
        if carried_hf:
            metadata[HF_FILES_KEY] = carried_hf
        set_aside_other_lineages(Path(save), metadata[LINEAGE], lineage.forked_at, final)
        publish_directory(partial, final, metadata)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-written stays visible
        raise
    point_latest(Path(save), final.name)
    return final


# ------------------------------------------------------------------ the tokenizer

def copy_tokenizer(tokenizer_file: Path | str | None, directory: Path) -> str | None:
    """Copy a tokenizer file into a checkpoint being written; returns its name
    there (None without one). Its sha256 goes into metadata["files"] with
    the tensors' files, so a damaged copy is refused on load."""
    if tokenizer_file is None:
        return None
    source = Path(tokenizer_file)
    if not source.is_file():
        raise CheckpointError(f"tokenizer file {source}: no such file; give the tokenizer.json "
                              "the model was trained with (or none)")
    shutil.copyfile(source, directory / TOKENIZER_FILE)
    return TOKENIZER_FILE


def checkpoint_tokenizer(load: str | Path) -> Path | None:
    """The tokenizer file a checkpoint carries (`--load` SAVE or an iter_*
    directory), checked against its sha256; None if it carries none."""
    directory = resolve(load)
    metadata = read_metadata(directory)
    name = metadata.get(TOKENIZER_KEY)
    if not name:
        return None
    verify_file(directory, name, metadata)
    return directory / name


# ------------------------------------------------------------------ helpers

def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    # The tensor files record the format version too, where an edit of
    # metadata.json cannot reach: a sealed checkpoint cannot pass as an older one.
    save_file(tensors, str(path), metadata=tensor_file_metadata())
    # safetensors writes through a private (0600) temporary file: give it the
    # mode of a normally created file, so whoever may read SAVE may read it.
    give_ordinary_mode(path)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def barrier(ctx) -> None:
    if ctx.grid.world_size > 1 and dist.is_initialized():
        dist.barrier()
