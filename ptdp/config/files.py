"""--config FILE: a YAML or TOML file of settings, read and checked once.

The file sets any flag of `ptdp train`, in sections named like the
configuration's (model, parallel, train, data) or flat; keys are flag names
with or without the leading dashes, or field names. Each value is coerced
to its field's type here (YAML reads 1e-3 as text, weights as numbers), and
every problem of the file (unknown keys with their near misses, a key set
twice, a wrong type, text that is not UTF-8, nesting too deep) is reported
together, naming the file.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from ptdp.config.base import ConfigError
from ptdp.config.sections import SECTION_TYPES, flag_fields

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def field_type(annotation: str) -> type:
    kind = annotation.split("|")[0].strip()
    return list if kind.startswith("list[") else _TYPES[kind]


def load_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError([f"--config {path}: no such file"])
    suffix = file.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError([f"--config {path}: use a .yaml, .yml or .toml file"])
    text = _read_config_text(file, path)
    try:
        data = _parse_toml(text) if suffix == ".toml" else _parse_yaml(text)
    except _DuplicateKey as duplicate:
        raise ConfigError([f"--config {path}: {duplicate}"]) from None
    except RecursionError:  # the parsers recurse once per nesting level
        raise ConfigError([f"--config {path}: values nested too deeply for a settings file "
                           f"(it holds sections of flat settings, e.g. model: and train:)"]) from None
    except Exception as error:  # parser errors carry line and column
        message = str(error)
        if suffix == ".toml" and ("overwrite a value" in message or "twice" in message):
            message += ": a key or table is given twice; keep one"  # tomllib's words for it
        raise ConfigError([f"--config {path}: cannot parse: {message}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: expected a mapping of settings at the top level"])
    return data


def _read_config_text(file: Path, path: str) -> str:
    """The file's text; a ConfigError that points at the first byte that is
    not UTF-8 (a file saved in Latin-1 or UTF-16, say)."""
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ConfigError([f"--config {path}: cannot read it ({error.strerror or error})"]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ConfigError([f"--config {path}: not UTF-8 text (byte 0x{data[error.start]:02x} at "
                           f"offset {error.start}, line {line}); save the file as UTF-8"]) from None
    return text.removeprefix("\ufeff")  # a byte-order mark some editors write


def _parse_toml(text: str) -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)  # refuses a repeated key itself


class _DuplicateKey(ValueError):
    """A YAML mapping that sets one key twice."""


def _parse_yaml(text: str) -> Any:
    """safe_load, except that a key repeated in one mapping is an error:
    PyYAML silently keeps the last value, so the first would be ignored."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                first_line: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges are overridable
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        earlier = first_line.setdefault(key, line)
                    except TypeError:  # an unhashable key: the base class reports it
                        continue
                    if earlier != line:
                        raise _DuplicateKey(f"{key!r} is set twice (lines {earlier} and {line}); "
                                            f"keep one")
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader) or {}


def file_settings(data: dict[str, Any], path: str) -> dict[str, Any]:
    """Map a parsed config file to {"section.field": value}, checking names and types."""
    by_key: dict[str, tuple[str, Any]] = {}
    for section, f in flag_fields():
        for key in (f.name, f.metadata["flag"].lstrip("-").replace("-", "_"),
                    f.metadata.get("off_flag", "").lstrip("-").replace("-", "_")):
            if key:
                by_key[key] = (section, f)
    flat: list[tuple[str, Any, str]] = []  # (key, value, the key as the file spells it)
    for key, value in data.items():
        if key in SECTION_TYPES and isinstance(value, dict):
            flat.extend((inner, item, f"{key}.{inner}") for inner, item in value.items())
        else:
            flat.append((key, value, str(key)))
    settings: dict[str, Any] = {}
    set_by: dict[str, str] = {}  # "section.field" -> the key that set it
    problems = []
    for key, value, spelled in flat:
        normal = str(key).lstrip("-").replace("-", "_")
        if normal not in by_key:
            close = difflib.get_close_matches(normal, list(by_key), n=3)
            if "-" in str(key):
                close = [c.replace("_", "-") for c in close]
            problems.append(f"--config {path}: unknown setting {key!r}"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))
            continue
        section, f = by_key[normal]
        target = f"{section}.{f.name}"
        if target in set_by:  # e.g. hidden-size and hidden_size, or flat and under model:
            problems.append(f"--config {path}: {set_by[target]} and {spelled} both set "
                            f"{f.metadata['flag']}; keep one")
            continue
        set_by[target] = spelled
        kind = field_type(f.type)
        inverted = (normal != f.name and f.metadata.get("negate")) or (
            normal == f.metadata.get("off_flag", "").lstrip("-").replace("-", "_"))
        if inverted:  # a "no-..." flag name: invert
            value = not value if isinstance(value, bool) else value
        if kind is float and isinstance(value, str):
            # YAML 1.1 reads exponent notation without a dot (1e-3) as text.
            try:
                value = float(value)
            except ValueError:
                pass
        if kind is list and isinstance(value, str):  # "0.7 A 0.3 B" as one string
            value = value.split()
        if kind is list and isinstance(value, list) and f.type.startswith("list[int]"):
            value = [int(item) if isinstance(item, str) and item.strip().isdigit() else item
                     for item in value]  # "16 8 300000" as one string; validate checks the rest
        elif kind is list and isinstance(value, list):
            value = [str(item) for item in value]  # YAML reads weights as numbers
        optional = "None" in f.type
        ok = (value is None and optional) or (
            isinstance(value, list) if kind is list else
            isinstance(value, bool) if kind is bool else
            (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else
            (isinstance(value, int) and not isinstance(value, bool)) if kind is int else
            isinstance(value, str))
        # A union of types ("str | int | list[int]", --moe-layer-freq): a value of any of them.
        ok = ok or type(value).__name__ in [part.strip().split("[")[0] for part in f.type.split("|")]
        if not ok:
            problems.append(f"--config {path}: {key} = {value!r} should be of type {kind.__name__}")
            continue
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            problems.append(f"--config {path}: {key} = {value!r} is not one of {f.metadata['choices']}")
            continue
        settings[f"{section}.{f.name}"] = float(value) if kind is float and value is not None else value
    if problems:
        raise ConfigError(problems)
    return settings
