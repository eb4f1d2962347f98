"""What a Hugging Face directory says beyond its weights and tokenizer.json,
kept from import to export: a chat model's chat template, special tokens
and generation settings.

An import reads, where the directory has them, tokenizer_config.json
(chat_template, bos/eos/pad/unk tokens, added_tokens_decoder, ...),
chat_template.jinja or chat_template.json (where transformers 5 keeps the
template), special_tokens_map.json, generation_config.json (the eos ids
`generate` stops at: a chat model's end of turn among them, and the pad id)
and config.json; the checkpoint carries them as they are (checkpoint/carry.py,
`HF_FILES_KEY`), through training too, as long as the run keeps the
tokenizer they describe. An export writes them back byte for byte beside
the tokenizer.json, and config.json gets the source's bos/eos/pad ids
(source_token_ids); so
`AutoTokenizer.from_pretrained(DIR).apply_chat_template` and
`generate` behave as on the original. A source without
generation_config.json but with an end-of-turn or pad token gets one
derived from them.

The files are data only: each is read with a bounded size and parsed as
JSON (or the template as UTF-8 text), its types checked and the tokens and
ids it names checked against the tokenizer and the vocabulary; nothing in
them is executed (the chat template is Jinja text that transformers runs
in its sandbox, not ptdp). A malformed file is refused naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from ptdp.interop.hf_files import CONFIG_NAME, TOKENIZER_CONFIG_NAME, ConversionError

SPECIAL_TOKENS_MAP_NAME = "special_tokens_map.json"
GENERATION_CONFIG_NAME = "generation_config.json"
CHAT_TEMPLATE_JINJA_NAME = "chat_template.jinja"
CHAT_TEMPLATE_JSON_NAME = "chat_template.json"
# The tokenizer's files: they describe the carried tokenizer.json, and
# travel only with it.
TOKENIZER_SIDE = (TOKENIZER_CONFIG_NAME, SPECIAL_TOKENS_MAP_NAME, CHAT_TEMPLATE_JINJA_NAME,
                  CHAT_TEMPLATE_JSON_NAME)
CARRIED_NAMES = (*TOKENIZER_SIDE, GENERATION_CONFIG_NAME, CONFIG_NAME)
# config.json's keys an export takes from the source (the rest it writes
# from the model's settings, which import read from the same file).
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token",
                      "cls_token", "mask_token")
# Ends of a turn in the common chat formats (ChatML/Qwen, Llama 3, Gemma, Phi-3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
# Far above any real file (a tokenizer_config.json that lists every added
# token of a large vocabulary is a few MB), far below memory trouble.
MAX_FILE_BYTES = 32 << 20


def read_carried_files(directory: str | Path, vocab: Mapping[str, int] | None,
                       vocab_size: Any) -> dict[str, bytes]:
    """The files of CARRIED_NAMES that Hugging Face `directory` has, name ->
    contents, each checked; the tokenizer's own only where the directory
    has a tokenizer.json (`vocab`: its tokens with their ids, None without
    one). `vocab_size`: config.json's, the bound of every id (not checked
    where it is no integer: the import refuses such a config itself).
    Raises ConversionError naming a file that is malformed."""
    directory = Path(directory)
    names = CARRIED_NAMES if vocab is not None else (GENERATION_CONFIG_NAME, CONFIG_NAME)
    size = vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    carried = {}
    for name in names:
        path = directory / name
        if not path.is_file():
            continue
        contents = _read_bounded(path)
        _CHECKS[name](path, _parsed(path, contents), vocab or {}, size)
        carried[name] = contents
    return carried


# ------------------------------------------------------------------ export

def exported_files(tokenizer_files: Mapping[str, bytes], carried: Mapping[str, bytes],
                   vocab_size: int) -> dict[str, bytes]:
    """The files an export writes beside the weights: the checkpoint's
    tokenizer files (hf_tokenizer.exported_tokenizer), in which the carried
    ones replace the generated, plus the carried generation_config.json or
    one derived from the source's tokens. Without carried files (a model
    that never came from Hugging Face): the tokenizer files as they are."""
    files = dict(tokenizer_files)
    for name in TOKENIZER_SIDE:
        if name in carried:
            files[name] = carried[name]
    if GENERATION_CONFIG_NAME in carried:
        files[GENERATION_CONFIG_NAME] = carried[GENERATION_CONFIG_NAME]
    elif carried:
        derived = derived_generation_config(carried, tokenizer_files.get("tokenizer.json"),
                                            vocab_size)
        if derived is not None:
            files[GENERATION_CONFIG_NAME] = _json_bytes(derived)
    return files


def source_token_ids(carried: Mapping[str, bytes], vocab_size: int,
                     tokenizer_json: bytes | None = None) -> dict[str, Any]:
    """config.json's bos/eos/pad ids for the export of an imported model:
    the source's, where its config.json gives one; where it gives none
    (null, or no key), the id of the token its tokenizer_config.json names
    for it (null where that says null); else nothing, and the export finds
    them in the vocabulary as for any model. Empty without a carried
    config.json. A value that is no id of the vocabulary (old Llama
    conversions say pad_token_id -1) is left to the export too."""
    if CONFIG_NAME not in carried:
        return {}
    source = json.loads(carried[CONFIG_NAME])
    tokenizer_config = (json.loads(carried[TOKENIZER_CONFIG_NAME])
                        if TOKENIZER_CONFIG_NAME in carried else {})
    vocab = _vocab_of(tokenizer_json) if tokenizer_config else {}
    ids: dict[str, Any] = {}
    for key in TOKEN_ID_KEYS:
        value, token = source.get(key), key.removesuffix("_id")
        if value is not None:
            if _ids_problem(value, vocab_size) is None:
                ids[key] = value
        elif token in tokenizer_config:
            text = _token_text(tokenizer_config[token])
            ids[key] = vocab.get(text) if text is not None else None
    return ids


def derived_generation_config(carried: Mapping[str, bytes], tokenizer_json: bytes | None,
                              vocab_size: int) -> dict[str, Any] | None:
    """generation_config.json for a source that had none: config.json's
    bos/eos ids, the tokenizer's eos and end-of-turn tokens added to the
    eos ids (so that `generate` stops at the end of a turn) and its pad
    token; None where that adds nothing to config.json (no end-of-turn or
    pad token), where transformers derives the same from config.json."""
    vocab = _vocab_of(tokenizer_json)
    ids = source_token_ids(carried, vocab_size, tokenizer_json)
    tokenizer_config = (json.loads(carried[TOKENIZER_CONFIG_NAME])
                        if TOKENIZER_CONFIG_NAME in carried else {})
    eos = ids.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    named_eos = _token_text(tokenizer_config.get("eos_token"))
    turn_ends = [vocab[token] for token in (named_eos, *END_OF_TURN_TOKENS) if token in vocab]
    pad = _token_text(tokenizer_config.get("pad_token"))
    pad_id = vocab.get(pad) if pad is not None else ids.get("pad_token_id")
    added = [token for token in turn_ends if token not in eos_ids]
    if not added and pad_id is None:
        return None
    eos_ids += list(dict.fromkeys(added))
    derived: dict[str, Any] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if ids.get("bos_token_id") is not None:
        derived["bos_token_id"] = ids["bos_token_id"]
    if pad_id is not None:
        derived["pad_token_id"] = pad_id
    return derived


def _vocab_of(tokenizer_json: bytes | None) -> dict[str, int]:
    if tokenizer_json is None:
        return {}
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json.decode()).get_vocab(with_added_tokens=True)


def _token_text(token: Any) -> str | None:
    """A special token's text: a string, or an AddedToken's {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _json_bytes(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


# ------------------------------------------------------------------ reading and checking

def _refused(path: Path, problem: str) -> ConversionError:
    return ConversionError(f"{path}: {problem}. The import keeps this file so that the exported "
                           f"model behaves as the original (chat template, special tokens, "
                           f"generation settings); fix it, or move it out of the directory to "
                           f"import the model without it")


def _read_bounded(path: Path) -> bytes:
    try:
        with open(path, "rb") as file:
            # read(n) allocates n bytes at once: ask for the file's size only.
            size = min(os.fstat(file.fileno()).st_size, MAX_FILE_BYTES)
            contents = file.read(size + 1)
    except OSError as error:
        raise _refused(path, f"cannot be read ({error.strerror or error})") from None
    if len(contents) > MAX_FILE_BYTES:
        raise _refused(path, f"is larger than {MAX_FILE_BYTES >> 20} MiB, far more than such a "
                             f"file holds")
    return contents


def _parsed(path: Path, contents: bytes) -> Any:
    try:
        text = contents.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _refused(path, f"is not UTF-8 text (byte 0x{contents[error.start]:02x} at offset "
                             f"{error.start})") from None
    if path.suffix == ".jinja":
        return text
    try:
        return json.loads(text)
    except RecursionError:  # thousands of nested brackets: no such file is real
        raise _refused(path, "nests its brackets too deeply to be read") from None
    except ValueError as error:
        raise _refused(path, f"is not valid JSON ({error})") from None


def _object(path: Path, data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _refused(path, f"holds a JSON {type(data).__name__}, not an object")
    return data


def _check_token(path: Path, key: str, token: Any, vocab: Mapping[str, int]) -> None:
    """A special token: null, its text, or an AddedToken's {"content": ...};
    a token the tokenizer does not have would become a new id the model
    has no row for."""
    if token is None:
        return
    text = _token_text(token)
    if text is None:
        raise _refused(path, f"{key} is {_shown(token)}, not a token (a string, or an object "
                             f"with its \"content\")")
    if vocab and text not in vocab:
        raise _refused(path, f"{key} {text!r} is not a token of the directory's tokenizer.json")


def _check_template(path: Path, template: Any) -> None:
    """A chat template: Jinja text, or a list of named ones ({"name", "template"})."""
    named = isinstance(template, list) and all(
        isinstance(entry, dict) and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str) for entry in template)
    if not (isinstance(template, str) or named):
        raise _refused(path, f"chat_template is {_shown(template)}, not a template (a string, or "
                             f"a list of {{\"name\", \"template\"}} objects)")


def _ids_problem(value: Any, vocab_size: int | None) -> str | None:
    """Why `value` is not null, a token id or a list of ids (eos) inside the
    vocabulary; None when it is."""
    ids = value if isinstance(value, list) else [] if value is None else [value]
    for token_id in ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0 \
                or (vocab_size is not None and token_id >= vocab_size):
            bound = f" (0..{vocab_size - 1})" if vocab_size is not None else ""
            return (f"is {_shown(value)}, not a token id of the model's vocabulary{bound} (nor "
                    f"a list of them)")
    return None


def _check_ids(path: Path, data: dict[str, Any], keys: tuple[str, ...],
               vocab_size: int | None) -> None:
    for key in keys:
        problem = _ids_problem(data.get(key), vocab_size)
        if problem is not None:
            raise _refused(path, f"{key} {problem}")


def _check_tokenizer_config(path: Path, data: Any, vocab: Mapping[str, int],
                            vocab_size: int | None) -> None:
    data = _object(path, data)
    for key in SPECIAL_TOKEN_KEYS:
        _check_token(path, key, data.get(key), vocab)
    if "chat_template" in data and data["chat_template"] is not None:
        _check_template(path, data["chat_template"])
    decoder = data.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict) or not all(
            isinstance(token, dict) and isinstance(token.get("content"), str) and number.isdigit()
            for number, token in decoder.items()):
        raise _refused(path, "added_tokens_decoder is not a mapping of token ids to tokens")
    for number, token in decoder.items():
        if vocab and vocab.get(token["content"]) != int(number):
            raise _refused(path, f"added_tokens_decoder gives {token['content']!r} the id "
                                 f"{number}, which the directory's tokenizer.json does not")


def _check_special_tokens_map(path: Path, data: Any, vocab: Mapping[str, int],
                              vocab_size: int | None) -> None:
    for key, value in _object(path, data).items():
        for token in value if isinstance(value, list) else [value]:
            _check_token(path, key, token, vocab)


def _check_chat_template_json(path: Path, data: Any, vocab: Mapping[str, int],
                              vocab_size: int | None) -> None:
    data = _object(path, data)
    if "chat_template" not in data:
        raise _refused(path, "has no \"chat_template\"")
    _check_template(path, data["chat_template"])


def _check_chat_template_jinja(path: Path, text: str, vocab: Mapping[str, int],
                               vocab_size: int | None) -> None:
    pass  # UTF-8 text (checked): Jinja that transformers runs sandboxed


def _check_generation_config(path: Path, data: Any, vocab: Mapping[str, int],
                             vocab_size: int | None) -> None:
    _check_ids(path, _object(path, data), ("bos_token_id", "eos_token_id", "pad_token_id",
                                           "decoder_start_token_id"), vocab_size)


def _check_config(path: Path, data: Any, vocab: Mapping[str, int], vocab_size: int | None) -> None:
    _object(path, data)  # read by the import; its ids are taken where valid (source_token_ids)


_CHECKS: dict[str, Callable[[Path, Any, Mapping[str, int], int | None], None]] = {
    TOKENIZER_CONFIG_NAME: _check_tokenizer_config,
    SPECIAL_TOKENS_MAP_NAME: _check_special_tokens_map,
    CHAT_TEMPLATE_JINJA_NAME: _check_chat_template_jinja,
    CHAT_TEMPLATE_JSON_NAME: _check_chat_template_json,
    GENERATION_CONFIG_NAME: _check_generation_config,
    CONFIG_NAME: _check_config,
}


def _shown(value: Any, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
