"""What every Hugging Face conversion shares: reading config.json, writing
model directories, and checking a state dict's names and shapes.

A directory is `config.json` plus the weights as `model.safetensors` or as
shards listed in `model.safetensors.index.json` (read by hf_weights.py); a
`tokenizer.json` (and the other files `AutoTokenizer` reads) may sit next
to them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

import torch

from ptdp.file_modes import give_ordinary_mode
from ptdp.plural import plural

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"

T = TypeVar("T")


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; says why and what to do."""


# ------------------------------------------------------------------ state dicts

def check_state(state: Mapping[str, torch.Tensor | tuple[int, ...]],
                expected: dict[str, tuple[int, ...]], what: str,
                padded_hint: int | None = None) -> None:
    """Refuse a state whose names or shapes differ from `expected`, listing
    what is missing, unexpected and misshapen. The state's values are
    tensors or only their shapes (an import checks the shapes the files'
    headers give before it reads any data). `padded_hint` (the vocabulary
    size) adds a note when the word embedding looks padded."""
    state = {name: shape_of(value) for name, value in state.items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{name}: {state[name]}, expected {shape}"
             for name, shape in expected.items()
             if name in state and state[name] != tuple(shape)]
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


# ------------------------------------------------------------------ config.json against the tensors
# The sizes config.json gives are checked against the tensors' shapes before
# anything is built from them: a model's name table has an entry per layer,
# so a config that claims a billion layers must be refused before it is made.

def shape_of(value: Any) -> tuple[int, ...]:
    """A tensor's shape, or a shape as it is."""
    return tuple(getattr(value, "shape", value))


def layer_disagreement(names: Iterable[str], prefix: str, field: str, layers: int) -> str | None:
    """None when the tensors `names` hold exactly `layers` layers (numbers
    after `prefix`, e.g. "h." in h.3.ln_1.weight), else what disagrees."""
    found = sorted({int(match.group(1)) for match in
                    (re.match(rf"{re.escape(prefix)}(\d+)\.", name) for name in names) if match})
    if len(found) == layers:
        return None  # which numbers they are, check_state says
    held = (f"{plural(len(found), 'layer')} ({prefix}{found[0]} to {prefix}{found[-1]})" if found
            else "no layers")
    return f"{field}={layers}, but the tensors hold {held}"


def carriers_matching(state: Mapping[str, Any], pattern: str,
                      axis: int) -> list[tuple[str, Mapping[str, Any], int]]:
    """size_disagreement's carriers: every tensor of `state` whose name
    matches `pattern` (one per layer, say), its size along `axis`."""
    return [(name, state, axis) for name in state if re.fullmatch(pattern, name)]


def size_disagreement(setting: str, size: int, what: str,
                      carriers: Iterable[tuple[str, Mapping[str, Any], int]]) -> str | None:
    """What disagrees when the tensors that carry a size all give another
    than config.json's `setting` ("n_embd=768") makes it (`size`, the
    tensors' `what`, e.g. "hidden size"); None when they agree with it,
    when none is there, or when they differ among themselves (then
    check_state names the odd tensors). `carriers`: (name, state, axis)."""
    found = []
    for name, state, axis in carriers:
        if name in state:
            shape = shape_of(state[name])
            found.append((name, shape, shape[axis] if len(shape) > axis else None))
    sizes = {actual for _, _, actual in found}
    if len(sizes) != 1 or size in sizes or None in sizes:
        return None
    name, shape, actual = found[0]
    return f"{setting}, but the tensors' {what} is {actual} ({name}: {shape})"


def check_sizes(disagreements: Iterable[str | None]) -> None:
    """Refuse the config when any of its sizes disagrees with the tensors."""
    problems = [problem for problem in disagreements if problem is not None]
    if problems:
        raise ConversionError(f"config.json does not match the tensors of the weight files: "
                              f"{'; '.join(problems)}. Fix config.json to describe these tensors "
                              f"(is it another model's?)")


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
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ConversionError(f"{config_path} nests its values too deeply to be a model's "
                              f"configuration (config.json is a flat JSON object)") from None
    if not isinstance(hf_config, dict):
        raise ConversionError(f"{config_path} does not hold a JSON object")
    return hf_config


def hf_tokenizer_file(directory: str | Path) -> Path | None:
    """The directory's tokenizer.json, if it has one."""
    path = Path(directory) / TOKENIZER_NAME
    return path if path.is_file() else None


# ------------------------------------------------------------------ writing

def export_directory_problem(directory: str | Path) -> str | None:
    """Why an export cannot be written to `directory`: it exists and is not
    an empty directory (an export never replaces or mixes with what is
    there, another model's files most of all). None when it can."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        held = [name for name in (CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
                if (directory / name).exists()] if directory.is_dir() else []
        what = ("is a file" if not directory.is_dir() else
                f"is not an empty directory: it holds a model ({', '.join(held)})" if held else
                "is not an empty directory")
        return (f"{directory} {what}; an export writes a new directory and never replaces or "
                f"mixes with what is there: give a new (or empty) directory, or remove this one "
                f"first")
    return None


def write_hf_directory(directory: str | Path, hf_config: dict[str, Any],
                       state: dict[str, torch.Tensor], *,
                       tokenizer_files: Mapping[str, bytes] | None = None,
                       token_ids: Mapping[str, Any] | None = None) -> None:
    """Write `config.json` and `model.safetensors` (plus the tokenizer's
    files, name -> contents, when given) into a new directory; `token_ids`
    (config.json's bos/eos/pad ids as an imported model's source had them)
    replace those of `hf_config`. Written into a temporary sibling and
    renamed into place, so a failed export leaves nothing half-written; an
    existing non-empty directory is refused. The files and the directory
    get the modes the user's umask gives."""
    from safetensors.torch import save_file

    directory = Path(directory)
    problem = export_directory_problem(directory)
    if problem:
        raise ConversionError(problem)
    hf_config = {**hf_config, **(token_ids or {})}
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        hf_config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")

    def write(partial: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
                  str(partial / WEIGHTS_NAME), metadata={"format": "pt"})
        _write_json(partial / CONFIG_NAME, hf_config)
        for name, contents in (tokenizer_files or {}).items():
            if Path(name).name != name or name in (WEIGHTS_NAME, CONFIG_NAME):
                raise ValueError(f"{name!r} is not a tokenizer file name")
            (partial / name).write_bytes(contents)

    write_new_directory(directory, write)


def write_new_directory(directory: Path, write: Callable[[Path], None]) -> None:
    """`write(partial)` fills a temporary sibling of `directory` (new, or
    empty: checked by the caller), renamed into place when done; a failure
    leaves nothing. The files get the modes the user's umask gives."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    try:
        write(partial)
        # mkdtemp's directory is private (0700) and safetensors' files too (0600).
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


def split_state(state: Mapping[str, T], prefix: str,
                ignored: re.Pattern) -> tuple[dict[str, T], T | None]:
    """A causal LM's state dict as (the base model's tensors under their bare
    names, `lm_head.weight` or None): keys lose `prefix` (the LM class's) or
    come bare (the base class's); buffers matching `ignored` are dropped.
    The values are tensors, or what a file's header says of them."""
    bare: dict[str, T] = {}
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
