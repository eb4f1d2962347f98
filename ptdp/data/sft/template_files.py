"""A Hugging Face tokenizer directory's chat template and special tokens,
read where transformers reads them.

transformers 5 takes the template from chat_template.jinja when the
directory has one, else from tokenizer_config.json's "chat_template" (a
string, or a list of named templates of which "default" is used). The
special tokens the template sees (bos_token, eos_token, ...) are
tokenizer_config.json's, a token given as a string or as an AddedToken
object ({"content": ...}); an older directory whose tokenizer_config.json
has no "added_tokens_decoder" takes them from special_tokens_map.json, as
transformers does. The files are data: parsed as JSON or UTF-8 text and
never executed here (the template runs in jinja2's sandbox, template.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ptdp.errors import UserError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
# The tokens transformers passes to every template by name.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
CHATML_TEMPLATE_FILE = Path(__file__).parent.parent / "assets" / "chatml.jinja"


class ChatTemplateError(UserError, ValueError):
    """A chat template that is missing, unreadable or refuses a conversation."""


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"cannot read {what} {path}: {error}; give a UTF-8 text file") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(_read_text(path, "the tokenizer file"))
    except (json.JSONDecodeError, RecursionError) as error:
        raise ChatTemplateError(f"{path} is not valid JSON ({error}); repair or remove it") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_directory(path: str | Path) -> Path:
    """The directory of a tokenizer given as its directory or its
    tokenizer.json; for the tokenizer.json a checkpoint carries, the
    checkpoint's Hugging Face files beside it (ptdp.checkpoint.carry)."""
    from ptdp.checkpoint.carry import HF_FILES_DIR

    path = Path(path)
    directory = path if path.is_dir() else path.parent
    carried = directory / HF_FILES_DIR
    if not any((directory / name).is_file() for name in (TOKENIZER_CONFIG, CHAT_TEMPLATE_JINJA)) \
            and any((carried / name).is_file() for name in (TOKENIZER_CONFIG, CHAT_TEMPLATE_JINJA)):
        return carried
    return directory


def special_tokens(directory: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them (see the module's notes)."""
    config_path = directory / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    legacy = directory / SPECIAL_TOKENS_MAP
    if "added_tokens_decoder" not in config and legacy.is_file():
        for name, value in _read_json(legacy).items():
            if name in SPECIAL_TOKEN_NAMES and _token_text(value) is not None:
                tokens[name] = _token_text(value)
    return {name: text for name, text in tokens.items() if text is not None}


def directory_template(directory: Path) -> str | None:
    """The directory's own chat template, or None when it has none."""
    jinja = directory / CHAT_TEMPLATE_JINJA
    if jinja.is_file():
        return _read_text(jinja, "the chat template")
    config_path = directory / TOKENIZER_CONFIG
    if not config_path.is_file():
        return None
    template = _read_json(config_path).get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{config_path}: chat_template is {type(template).__name__}, not a "
                                "template; give a string or pass a template file")
    return template


def chat_template_text(tokenizer_path: str | Path, template_file: str | Path | None = None) -> str:
    """The template to render with: `template_file` when given, else the
    tokenizer directory's own. A tokenizer without one is refused, saying
    to pass a template file (ptdp ships ChatML's)."""
    if template_file is not None:
        return _read_text(Path(template_file), "the chat template file")
    directory = tokenizer_directory(tokenizer_path)
    template = directory_template(directory)
    if template is None:
        raise ChatTemplateError(
            f"the tokenizer in {directory} has no chat template ({CHAT_TEMPLATE_JINJA} or "
            f"\"chat_template\" in {TOKENIZER_CONFIG}), so conversations cannot be rendered; give "
            f"one with --chat-template FILE, e.g. ptdp's ChatML template --chat-template "
            f"{CHATML_TEMPLATE_FILE} (its tokenizer needs <|im_start|> and <|im_end|> as special "
            "tokens)")
    return template


def tokenizer_side_files(tokenizer_path: str | Path) -> dict[str, bytes]:
    """The files beside a run's tokenizer.json that say how it is used
    (tokenizer_config.json, special_tokens_map.json, chat_template.jinja or
    .json), name -> contents: what the run's checkpoints carry, so that
    `ptdp generate --chat` and an export render conversations as training did."""
    directory = tokenizer_directory(tokenizer_path)
    return {name: (directory / name).read_bytes()
            for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_JINJA,
                         "chat_template.json") if (directory / name).is_file()}
