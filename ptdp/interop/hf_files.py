"""What every Hugging Face conversion shares: reading and writing model
directories, and checking a state dict's names and shapes.

A directory is `config.json` plus the weights as `model.safetensors` or as
shards listed in `model.safetensors.index.json`; a `tokenizer.json` (and
the other files `AutoTokenizer` reads) may sit next to them. No pickle: a
directory that holds only `pytorch_model*.bin` is refused with a way out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from ptdp.file_modes import give_ordinary_mode

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; says why and what to do."""


# ------------------------------------------------------------------ state dicts

def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], what: str,
                padded_hint: int | None = None) -> None:
    """Refuse a state whose names or shapes differ from `expected`, listing
    what is missing, unexpected and misshapen. `padded_hint` (the vocabulary
    size) adds a note when the word embedding looks padded."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{name}: {tuple(state[name].shape)}, expected {shape}"
             for name, shape in expected.items()
             if name in state and tuple(state[name].shape) != tuple(shape)]
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(abbreviate(missing))}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(abbreviate(unexpected))}")
    if wrong:
        problems.append("wrong shape: " + "; ".join(abbreviate(wrong)))
    if problems:
        message = f"{what} does not match the model config:\n" + "\n".join(
            f"  - {p}" for p in problems)
        if padded_hint is not None and any(w.startswith("embedding.word_embeddings") for w in wrong):
            message += (f"\n  (the word embedding must be the logical, unpadded tensor with "
                        f"{padded_hint} rows)")
        raise ConversionError(message)


def abbreviate(items: list[str], limit: int = 8) -> list[str]:
    return items if len(items) <= limit else items[:limit] + [f"... ({len(items) - limit} more)"]


# ------------------------------------------------------------------ reading

def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The `config.json` of a Hugging Face model directory, as a dict."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConversionError(f"{directory} is not a directory")
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise ConversionError(f"{directory} has no {CONFIG_NAME}")
    try:
        hf_config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(hf_config, dict):
        raise ConversionError(f"{config_path} does not hold a JSON object")
    return hf_config


def read_hf_weights(directory: str | Path, example_class: str) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, by key.
    `example_class` (e.g. LlamaForCausalLM) goes into the advice for a
    pickle-only directory."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(directory), example_class):
        try:
            part = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise ConversionError(f"cannot read {path}: {e}") from None
        for key in part.keys() & state.keys():
            raise ConversionError(f"{key!r} is in more than one weight file ({path.name})")
        state.update(part)
    return state


def hf_tokenizer_file(directory: str | Path) -> Path | None:
    """The directory's tokenizer.json, if it has one."""
    path = Path(directory) / TOKENIZER_NAME
    return path if path.is_file() else None


def _weight_files(directory: Path, example_class: str) -> list[Path]:
    single, index = directory / WEIGHTS_NAME, directory / WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(f"{index} is not a valid safetensors index: {e!r}") from None
        paths = []
        for name in names:
            path = directory / name
            if Path(name).name != name or not name.endswith(".safetensors"):
                raise ConversionError(f"{index} names {name!r}, not a .safetensors file in "
                                      f"{directory}")
            if not path.is_file():
                raise ConversionError(f"{index} names {name}, which is missing from {directory}")
            paths.append(path)
        return paths
    pickled = [p.name for p in sorted(directory.glob("pytorch_model*.bin"))]
    if pickled:
        raise ConversionError(
            f"{directory} holds only {', '.join(pickled)} (pickle, which can run code when "
            f"loaded): ptdp reads safetensors only. Convert it where you trust the file, e.g. "
            f"{example_class}.from_pretrained(dir).save_pretrained(new_dir) "
            f"(safe_serialization is the default), then use new_dir")
    raise ConversionError(f"{directory} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")


# ------------------------------------------------------------------ writing

def write_hf_directory(directory: str | Path, hf_config: dict[str, Any],
                       state: dict[str, torch.Tensor], *,
                       tokenizer_files: Mapping[str, bytes] | None = None) -> None:
    """Write `config.json` and `model.safetensors` (plus the tokenizer's
    files, name -> contents, when given) into a new directory. Written into
    a temporary sibling and renamed into place, so a failed export leaves
    nothing half-written; an existing non-empty directory is refused. The
    files and the directory get the modes the user's umask gives."""
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConversionError(f"{directory} exists and is not an empty directory: choose a new one")
    hf_config = dict(hf_config)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
                  str(partial / WEIGHTS_NAME), metadata={"format": "pt"})
        _write_json(partial / CONFIG_NAME, hf_config)
        for name, contents in (tokenizer_files or {}).items():
            if Path(name).name != name or name in (WEIGHTS_NAME, CONFIG_NAME):
                raise ValueError(f"{name!r} is not a tokenizer file name")
            (partial / name).write_bytes(contents)
        # mkdtemp's directory is private (0700) and safetensors' file too (0600).
        give_ordinary_mode(partial, *partial.iterdir())
        if directory.exists():
            directory.rmdir()  # empty, checked above
        os.rename(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def split_state(state: dict[str, torch.Tensor], prefix: str,
                ignored: re.Pattern) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A causal LM's state dict as (the base model's tensors under their bare
    names, `lm_head.weight` or None): keys lose `prefix` (the LM class's) or
    come bare (the base class's); buffers matching `ignored` are dropped."""
    bare: dict[str, torch.Tensor] = {}
    lm_head = None
    for key, tensor in state.items():
        if key == "lm_head.weight":
            lm_head = tensor
            continue
        name = key[len(prefix):] if key.startswith(prefix) else key
        if ignored.match(name):
            continue
        if name in bare:
            raise ConversionError(f"{name!r} appears twice (with and without {prefix!r})")
        bare[name] = tensor
    return bare, lm_head
