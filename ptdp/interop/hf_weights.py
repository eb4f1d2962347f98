"""A Hugging Face directory's weights: first what the safetensors headers
say, then the data, each tensor checked before it is trusted.

An import must not believe config.json about sizes it can check against the
files: a config that says a billion layers would otherwise make ptdp build a
table of a billion layers' names before it found out. So the weights are
read in two steps. `HFWeights(directory)` reads only the files' headers
(every tensor's name, shape and dtype, without its data); the converters
check config.json against those (hf_gpt2 / hf_llama `check_hf_tensors`),
and only then does `load` read the tensors the model uses, refusing any
that is not floating point (before reading it) or holds NaN or infinity.

The weights are `model.safetensors`, or the shards that
`model.safetensors.index.json` lists: each shard a `.safetensors` file in the
directory itself, and each tensor in the shard the index names for it. No
pickle: a directory that holds only `pytorch_model*.bin` is refused with a
way out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ptdp.interop.hf_files import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, ConversionError, abbreviate

# safetensors' names of the dtypes ptdp trains and computes in (what its
# checkpoints may hold); float8 is a quantized format that needs the scales
# stored beside it (fp8_blocks.py reads those pairs), and integer or bool
# weights are quantized or not weights.
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_FP8_NOTE = ("; block-scaled FP8 weights with their `_scale_inv` tensors are read when "
             "config.json's quantization_config says quant_method 'fp8': fp8_blocks.py")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as its file's header describes it."""
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I8, ...


class HFWeights:
    """The tensors of a directory's safetensors files, known from the
    files' headers until `load` reads their data. `example_class` (e.g.
    LlamaForCausalLM) goes into the advice for a pickle-only directory."""

    def __init__(self, directory: str | Path, example_class: str):
        self.directory = Path(directory)
        files, weight_map = _weight_files(self.directory, example_class)
        self.tensors: dict[str, StoredTensor] = {}
        for path in files:
            for key, stored in _read_header(path).items():
                if key in self.tensors:
                    raise ConversionError(f"{key!r} is in more than one weight file "
                                          f"({self.tensors[key].file.name} and {path.name})")
                self.tensors[key] = stored
        if weight_map is not None:
            _check_weight_map(self.directory / WEIGHTS_INDEX_NAME, weight_map, self.tensors)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: stored.shape for key, stored in self.tensors.items()}

    def load(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `keys`, read from their files. Every one's dtype is
        checked (from the headers) before any data is read; each tensor's
        values after it is read."""
        keys = list(keys)
        for key in keys:
            stored = self.tensors[key]
            if stored.dtype not in FLOAT_DTYPES:
                raise ConversionError(
                    f"{stored.file}: tensor {key!r} is {stored.dtype}, not floating point: ptdp "
                    f"imports weights stored as {', '.join(FLOAT_DTYPES.values())} (a quantized "
                    f"model must be dequantized first, e.g. saved again from transformers in "
                    f"one of those dtypes{_FP8_NOTE if stored.dtype.startswith('F8') else ''})")
        return {key: _finite(value, key, self.tensors[key].file)
                for key, value in self.read(keys).items()}

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors `keys` as stored, unchecked: for a reader that checks
        them itself (quantized formats: fp8_blocks.py)."""
        from safetensors import SafetensorError, safe_open

        state: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.tensors[key].file, []).append(key)
        for path, names in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for key in names:
                        state[key] = handle.get_tensor(key)
            except SafetensorError as error:
                raise ConversionError(f"cannot read {path}: {error}") from None
        return state


def _finite(tensor: torch.Tensor, key: str, path: Path) -> torch.Tensor:
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        nans = int(torch.isnan(tensor).sum())
        infinities = tensor.numel() - int(finite.sum()) - nans
        raise ConversionError(
            f"{path}: tensor {key!r} holds {nans} NaN and {infinities} infinite values (of "
            f"{tensor.numel()}): ptdp imports only finite weights; the file is damaged, or the "
            f"model had diverged when it was saved")
    return tensor


def _read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file, from its header alone (the
    library checks that the header is well formed and that each tensor's
    bytes lie inside the file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            slices = {key: handle.get_slice(key) for key in handle.keys()}
            return {key: StoredTensor(path, tuple(part.get_shape()), part.get_dtype())
                    for key, part in slices.items()}
    except (SafetensorError, OSError) as error:
        raise ConversionError(f"cannot read {path}: {error}") from None


# ------------------------------------------------------------------ which files

def _weight_files(directory: Path, example_class: str) -> tuple[list[Path], dict[str, str] | None]:
    """The weight files, and the index's weight map (tensor -> file name)
    when the weights are sharded."""
    single, index = directory / WEIGHTS_NAME, directory / WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single], None
    if index.is_file():
        weight_map = _read_weight_map(index)
        paths = []
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise ConversionError(f"{index} names {name!r}, not a .safetensors file in "
                                      f"{directory}: every shard must be a file of the directory "
                                      f"itself")
            path = directory / name
            if not path.is_file():
                raise ConversionError(f"{index} names {name}, which is missing from {directory}")
            paths.append(path)
        return paths, weight_map
    pickled = [p.name for p in sorted(directory.glob("pytorch_model*.bin"))]
    if pickled:
        raise ConversionError(
            f"{directory} holds only {', '.join(pickled)} (pickle, which can run code when "
            f"loaded): ptdp reads safetensors only. Convert it where you trust the file, e.g. "
            f"{example_class}.from_pretrained(dir).save_pretrained(new_dir) "
            f"(safe_serialization is the default), then use new_dir")
    raise ConversionError(f"{directory} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            RecursionError) as e:
        raise ConversionError(f"{index} is not a valid safetensors index ({e!r}); it needs a "
                              f"\"weight_map\" from tensor names to shard files") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ConversionError(f"{index}: \"weight_map\" must be a non-empty object from tensor "
                              f"names to shard file names")
    return weight_map


def _check_weight_map(index: Path, weight_map: dict[str, str],
                      tensors: dict[str, StoredTensor]) -> None:
    """Each tensor in the shard the index names for it, and every tensor of
    the shards listed: an index that disagrees with its shards belongs to
    other files."""
    problems = []
    for key, name in weight_map.items():
        if key not in tensors:
            problems.append(f"{key}: listed in {name}, which does not hold it")
        elif tensors[key].file.name != name:
            problems.append(f"{key}: listed in {name}, but {tensors[key].file.name} holds it")
    problems += [f"{key}: in {stored.file.name}, not listed"
                 for key, stored in tensors.items() if key not in weight_map]
    if problems:
        raise ConversionError(f"{index} does not match its shards:\n"
                              + "\n".join(f"  - {p}" for p in abbreviate(problems)))
