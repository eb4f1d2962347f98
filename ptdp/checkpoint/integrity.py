"""A checkpoint proves itself: what its metadata says is checked against
what the directory holds before anything is loaded.

* The metadata is sealed: `metadata.json` carries the sha256 of its own
  content (every other key, as canonical JSON), so a hand edit or a damaged
  byte is refused, not believed.
* What it says must fit together and fit what is there: the directory's name
  (`iter_0000006` holds iteration 6); every stored tensor in the file the
  metadata names, under the names, shapes and dtypes of the model its
  configuration describes (every one of them, none else: a configuration
  that says 3 layers over files that hold 4 is refused); files named inside
  the directory only; the consumed samples and the optimizer's step count
  equal to what the run's own arithmetic gives from where the run began.
* The data files' sha256 are checked as they are read (store.Reader).

Checkpoints written before the seal (format version 1) are checked for
everything but the seal and the arithmetic, whose records they lack, and
load with a note. A sealed checkpoint cannot pass as one of them: its
tensor files' own headers record the format version (where an edit of
metadata.json does not reach), and a metadata.json that declares version 1
while holding the records only a sealing ptdp writes is refused too.
Everything here reads metadata.json and the safetensors headers only: it is
cheap, and `ptdp train` runs it before launching.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

from ptdp.checkpoint.errors import CheckpointError

FORMAT = "ptdp-checkpoint"
FORMAT_VERSION = 2   # 2: the sealed metadata and its arithmetic records
READABLE_VERSIONS = (1, 2)
SEAL = "metadata_sha256"
# Where the run that saved a checkpoint began counting: (iteration, consumed
# samples) it resumed from, and (iteration, skipped iterations) at which its
# optimizer state began (a fresh one: a new run, --no-load-optim, --finetune).
RUN_START = "run_start"
OPTIMIZER_START = "started_at"
CHECKPOINT_NAME = re.compile(r"iter_(\d{7})")
FLOATING = {"F16", "BF16", "F32", "F64"}
TRAINING_DTYPE = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
# What only a sealing ptdp (format version 2 on) writes into metadata.json.
SEALED_ONLY_KEYS = (SEAL, RUN_START)
# The tensor files' safetensors header records "ptdp-checkpoint N" under
# "format" (version 1 wrote the bare name). One key: safetensors writes a
# header's keys in no fixed order, and the files of equal states are equal.
TENSOR_FILE_FORMAT = "format"
UNSEALED_NOTE = ("written before checkpoints were sealed (format version 1): its metadata is "
                 "believed as written, and its consumed samples and optimizer steps are not "
                 "checked against the run's arithmetic")


def tensor_file_metadata() -> dict[str, str]:
    """The safetensors header metadata of a checkpoint's tensor files."""
    return {TENSOR_FILE_FORMAT: f"{FORMAT} {FORMAT_VERSION}"}


def seal(metadata: dict) -> dict:
    """`metadata` with its checksum added (the last thing written)."""
    return {**metadata, SEAL: _digest(metadata)}


def _digest(metadata: dict) -> str:
    content = {key: value for key, value in metadata.items() if key != SEAL}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def damaged(directory: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{directory}: {what}; the checkpoint is damaged (load another one, "
                           f"e.g. an earlier iter_* directory)")


def verify(directory: Path, metadata: Any) -> None:
    """Raise CheckpointError naming the file and the field when the
    checkpoint's metadata is not what a ptdp checkpoint writes, does not
    match its seal, or disagrees with the directory's name or the tensors
    stored there."""
    where = directory / "metadata.json"
    if not isinstance(metadata, dict):
        raise damaged(directory, f"{where.name} holds {type(metadata).__name__}, not a mapping")
    if metadata.get("format") != FORMAT or metadata.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{directory}: not a {FORMAT} checkpoint of a version this ptdp reads "
                              f"({', '.join(map(str, READABLE_VERSIONS))}); format "
                              f"{metadata.get('format')!r}, version {metadata.get('format_version')!r}")
    sealed = metadata["format_version"] >= 2
    if not sealed:
        _check_truly_unsealed(directory, metadata)
    if sealed:
        if not isinstance(metadata.get(SEAL), str):
            raise damaged(directory, f"{where.name} has no {SEAL}")
        if metadata[SEAL] != _digest(metadata):
            raise damaged(directory, f"{where.name} differs from its {SEAL} (edited or corrupted "
                                     f"after it was written)")
    _check_fields(directory, metadata)
    match = CHECKPOINT_NAME.fullmatch(directory.name)
    if match and int(match.group(1)) != metadata["iteration"]:
        raise damaged(directory, f"{where.name} says iteration {metadata['iteration']}, but the "
                                 f"directory is {directory.name}")
    model = _model_config(directory, metadata)
    _check_tensors(directory, metadata, model)
    if sealed:
        _check_arithmetic(directory, metadata)


def is_unsealed(metadata: dict) -> bool:
    """A verified checkpoint from before the seal (load it with UNSEALED_NOTE)."""
    return metadata.get("format_version") == 1


def _check_truly_unsealed(directory: Path, metadata: dict) -> None:
    """A metadata.json declaring format version 1 must be one: no record
    that only a sealing ptdp writes, and tensor files whose headers do not
    record a sealed version."""
    def downgraded(evidence: str) -> CheckpointError:
        return damaged(directory, f"metadata.json declares format version 1 (from before "
                                  f"checkpoints were sealed), but {evidence}: it was written "
                                  f"sealed and its seal was removed, so nothing it says can be "
                                  f"believed")

    records = [key for key in SEALED_ONLY_KEYS if key in metadata]
    optimizer = metadata.get("optimizer")
    if isinstance(optimizer, dict) and OPTIMIZER_START in optimizer:
        records.append(f"optimizer.{OPTIMIZER_START}")
    if records:
        raise downgraded(f"it holds {', '.join(records)}, which only sealed checkpoints record")
    tensors = metadata.get("tensors")
    files = sorted(set(tensors.values())) if isinstance(tensors, dict) else []
    for file in files:
        if not (isinstance(file, str) and _inside(file)):
            continue  # _check_fields names it
        recorded = _tensor_file_version(directory / file)
        if recorded is not None and recorded != "1":
            raise downgraded(f"its tensor file {file} records format version {recorded}")


def _tensor_file_version(path: Path) -> str | None:
    """The format version a tensor file's safetensors header records (None:
    none, or the file is unreadable, which the later checks report)."""
    try:
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if not 0 < length <= min(path.stat().st_size - 8, MAX_HEADER_BYTES):
                return None
            header = json.loads(file.read(length))
    except (OSError, ValueError, RecursionError):
        return None
    marks = header.get("__metadata__") if isinstance(header, dict) else None
    recorded = marks.get(TENSOR_FILE_FORMAT) if isinstance(marks, dict) else None
    match = re.fullmatch(re.escape(FORMAT) + r" (\d+)", recorded) if isinstance(recorded, str) \
        else None
    return match.group(1) if match else None


def _check_fields(directory: Path, metadata: dict) -> None:
    def need(key: str, kind, what: str) -> Any:
        value = metadata.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise damaged(directory, f"metadata.json: {key!r} is {value!r}, not {what}")
        return value

    for key in ("iteration", "consumed_samples"):
        if need(key, int, "a count") < 0:
            raise damaged(directory, f"metadata.json: {key!r} is negative")
    config = need("config", dict, "the run's configuration")
    if not isinstance(config.get("model"), dict):
        raise damaged(directory, "metadata.json: 'config' has no model settings")
    tensors = need("tensors", dict, "a mapping of tensor names to files")
    files = need("files", dict, "a mapping of file names to sha256")
    for file, digest in files.items():
        if not _inside(file) or not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise damaged(directory, f"metadata.json: files entry {file!r}: {digest!r} is not a file "
                                     f"of the checkpoint with its sha256")
    for name, file in tensors.items():
        if not isinstance(file, str) or file not in files or not file.endswith(".safetensors"):
            raise damaged(directory, f"metadata.json: tensor {name!r} is in {file!r}, which is not "
                                     f"one of the checkpoint's tensor files")
    optimizer = metadata.get("optimizer")
    if optimizer is not None and not (isinstance(optimizer, dict)
                                      and isinstance(optimizer.get("steps"), int)):
        raise damaged(directory, f"metadata.json: 'optimizer' is {optimizer!r}")


def _inside(name: Any) -> bool:
    """A relative path that stays inside the checkpoint directory."""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def _model_config(directory: Path, metadata: dict):
    from ptdp.config import ModelConfig

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in metadata["config"]["model"].items() if k in known})
    except (TypeError, ValueError) as error:
        raise damaged(directory, f"metadata.json: the model settings do not describe a model "
                                 f"({error})") from None


def _check_tensors(directory: Path, metadata: dict, model) -> None:
    """The stored tensors are the model's, each where the metadata says,
    with its logical shape and a dtype the checkpoint can have written."""
    from ptdp.config.lora import LoRAConfig
    from ptdp.model.adapters import adapter_shapes
    from ptdp.model.shapes import logical_shapes, state_shapes

    try:
        known = {f.name for f in dataclasses.fields(LoRAConfig)}
        lora = LoRAConfig(**{k: v for k, v in (metadata["config"].get("lora") or {}).items()
                             if k in known})
        if lora.enabled:  # adapters only (ptdp.checkpoint.adapters): the base is elsewhere
            state, expected = {}, adapter_shapes(model, lora)
        else:
            state = state_shapes(model)
            expected = {**logical_shapes(model), **state}
    except (TypeError, ValueError, ArithmeticError) as error:
        raise damaged(directory, f"metadata.json: the model settings do not describe a model "
                                 f"({error})") from None
    tensors: dict[str, str] = metadata["tensors"]
    model_names = {name[len("model/"):] for name in tensors if name.startswith("model/")}
    missing = sorted(set(expected) - model_names)
    extra = sorted(model_names - set(expected))
    if missing or extra:
        said = "; ".join(part for part in (
            f"no model/{_few(missing)}" if missing else "",
            f"model/{_few(extra)}, which it has no place for" if extra else "") if part)
        raise damaged(directory, f"metadata.json describes a model ({model.num_layers} layers, hidden "
                                 f"size {model.hidden_size}) whose tensors are not the stored ones: {said}")
    precision = metadata["config"].get("train", {})
    training = "bf16" if precision.get("bf16") else "fp16" if precision.get("fp16") else "fp32"
    headers = {file: read_header(directory / file, directory) for file in set(tensors.values())}
    for name, file in sorted(tensors.items()):
        kind, _, rest = name.partition("/")
        if kind == "model":
            logical = rest
        elif kind == "optimizer" and rest.partition("/")[0] in ("exp_avg", "exp_avg_sq", "main"):
            logical = rest.partition("/")[2]
        else:
            raise damaged(directory, f"metadata.json names a tensor {name!r} ptdp does not write")
        if logical not in expected:
            raise damaged(directory, f"metadata.json: {name!r} belongs to no tensor of the model")
        entry = headers[file].get(name)
        if entry is None:
            raise damaged(directory, f"{file} does not hold {name!r}, which metadata.json places "
                                     f"there")
        shape, dtype = tuple(entry.get("shape", ())), entry.get("dtype")
        if shape != tuple(expected[logical]):
            raise damaged(directory, f"{file}: {name!r} has shape {list(shape)}, but the model of "
                                     f"metadata.json needs {list(expected[logical])}")
        if kind == "optimizer" and dtype != "F32":
            raise damaged(directory, f"{file}: {name!r} is {dtype}; optimizer state is float32")
        if dtype not in FLOATING:
            raise damaged(directory, f"{file}: {name!r} is {dtype}, not a floating-point weight")
        if logical in state and dtype != "F32":
            raise damaged(directory, f"{file}: {name!r} is {dtype}; it is float32 state")
        if kind == "model" and logical not in state and metadata.get("optimizer") is not None \
                and dtype != TRAINING_DTYPE[training]:
            raise damaged(directory, f"{file}: {name!r} is {dtype}, but a {training} run stores "
                                     f"{TRAINING_DTYPE[training]} weights")
    for file, header in sorted(headers.items()):
        strays = sorted(set(header) - {n for n, f in tensors.items() if f == file})
        if strays:
            raise damaged(directory, f"{file} holds {_few(strays)}, which metadata.json does not "
                                     f"place there")


def verify_file(directory: Path, file: str, metadata: dict) -> None:
    """A file of the checkpoint, as it is about to be read: present, and
    with the sha256 metadata.json lists for it."""
    expected = metadata["files"].get(file)
    path = directory / file
    if expected is None or not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    if sha256_of(path) != expected:
        raise CheckpointError(f"{path}: sha256 differs from metadata.json; the file is damaged "
                              "(load an earlier checkpoint)")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_header(path: Path, directory: Path) -> dict[str, dict]:
    """A safetensors file's table of tensors (name -> dtype, shape, offsets),
    read without its data; the file's own consistency checked."""
    try:
        with open(path, "rb") as file:
            size = path.stat().st_size
            length = int.from_bytes(file.read(8), "little")
            if size < 8 or length > min(size - 8, MAX_HEADER_BYTES):
                raise damaged(directory, f"{path.name} is not a safetensors file (truncated?)")
            header = json.loads(file.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete (load another one, "
                              f"e.g. an earlier iter_* directory)") from None
    except OSError as error:
        raise damaged(directory, f"{path.name} cannot be read ({error.strerror or error})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise damaged(directory, f"{path.name} is not a safetensors file") from None
    if not isinstance(header, dict):
        raise damaged(directory, f"{path.name} is not a safetensors file")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]
                <= data_bytes and isinstance(entry.get("shape"), list)):
            raise damaged(directory, f"{path.name}: the entry of {name!r} points outside the file")
    return header


def _check_arithmetic(directory: Path, metadata: dict) -> None:
    """Consumed samples and optimizer steps, as the saving run's settings
    give them from where that run began."""
    from ptdp.config import TrainConfig
    from ptdp.data.batches import GlobalBatches

    iteration, consumed = metadata["iteration"], metadata["consumed_samples"]
    layout, start = metadata.get("layout"), metadata.get(RUN_START)
    if layout is None:  # a model-only checkpoint (an import): nothing was trained
        if consumed != 0 or metadata.get("optimizer") is not None:
            raise damaged(directory, "metadata.json: a model-only checkpoint with consumed samples "
                                     "or optimizer state")
        return
    if not (isinstance(start, list) and len(start) == 2 and all(isinstance(x, int) for x in start)
            and 0 <= start[0] <= iteration and 0 <= start[1] <= consumed):
        raise damaged(directory, f"metadata.json: {RUN_START!r} is {start!r}")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        train = TrainConfig(**{k: v for k, v in metadata["config"].get("train", {}).items()
                               if k in known})
        batches = GlobalBatches(train, int(layout["data"]))
        expected = batches.consumed_after(start[1], iteration - start[0])
    except (TypeError, ValueError, KeyError, ZeroDivisionError, ArithmeticError) as error:
        raise damaged(directory, f"metadata.json: the run's batch settings are unusable "
                                 f"({error!r})") from None
    if consumed != expected:
        raise damaged(directory, f"metadata.json: consumed_samples is {consumed:,}, but "
                                 f"{iteration - start[0]} iterations from {start[1]:,} samples at "
                                 f"iteration {start[0]} consume {expected:,}")
    optimizer = metadata.get("optimizer")
    began = optimizer.get(OPTIMIZER_START) if optimizer else None
    if optimizer is None or began is None:
        return
    skipped = optimizer.get("skipped_iterations", 0)
    if not (isinstance(began, list) and len(began) == 2 and all(isinstance(x, int) for x in began)
            and isinstance(skipped, int) and began[0] <= iteration and began[1] <= skipped):
        raise damaged(directory, f"metadata.json: optimizer {OPTIMIZER_START!r} is {began!r}")
    steps = (iteration - began[0]) - (skipped - began[1])
    if optimizer["steps"] != steps:
        raise damaged(directory, f"metadata.json: the optimizer took {optimizer['steps']} steps, but "
                                 f"{iteration - began[0]} iterations since its start at iteration "
                                 f"{began[0]} with {skipped - began[1]} skipped give {steps}")


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
