"""Conversations from JSON lines or Parquet files, one conversation a row.

A row's layout is found from its keys (a Parquet file's: its columns), as
Megatron-LM's varlen dataset finds it, the most explicit layout first:

* ``messages`` (OpenAI): a list of {"role", "content"};
* ``conversations`` (ShareGPT): a list of {"from", "value"}, the speakers
  human/gpt/system (and their usual synonyms) read as user/assistant/system;
* Alpaca/Dolly: an instruction (``instruction|prompt|query|question``),
  an optional context (``input|context``) and an answer
  (``output|response|completion|answer``): a user turn (instruction, a blank
  line, context) and an assistant turn;
* ``text``: plain pretraining text, no turns.

Every row becomes a `Record`: its messages as [{"role", "content"}] with
string contents, or its text. Unlike Megatron-LM, no empty system turn is
added: the chat template decides what a conversation without one looks like
(Qwen's adds its default system prompt), and transformers' ids for the
same messages are the reference. A row that is not a conversation is
refused with its file and 1-based row number and what to change.

Reading streams: JSON lines one line at a time, Parquet one record batch
at a time, so a file larger than memory reads in bounded memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from ptdp.errors import UserError

INSTRUCTION_FIELDS = ("instruction", "prompt", "query", "question")
CONTEXT_FIELDS = ("input", "context")
ANSWER_FIELDS = ("output", "response", "completion", "answer")
LAYOUTS = ("messages", "conversations", "alpaca", "text")
ACCEPTED_LAYOUTS = ("'messages' (a list of {role, content}), 'conversations' (ShareGPT: a list "
                    "of {from, value}), Alpaca/Dolly (one of " + "|".join(INSTRUCTION_FIELDS)
                    + ", optionally " + "|".join(CONTEXT_FIELDS) + ", and one of "
                    + "|".join(ANSWER_FIELDS) + ") or 'text' (plain text)")
# ShareGPT speakers as chat roles (Megatron-LM's table). Unlike Megatron-LM,
# an unknown speaker is refused rather than read as the user: a misread
# speaker would silently train on the wrong turns.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "system": "system", "tool": "tool", "function": "tool",
                  "observation": "tool"}
PARQUET_MAGIC = b"PAR1"
PARQUET_BATCH_ROWS = 1024  # rows a Parquet read holds at once


class ConversationError(UserError, ValueError):
    """A row that is not a conversation, or a file that holds none; the
    message names the file and the row and says what to change."""


@dataclass(frozen=True)
class Record:
    """One row, normalised: `messages` for a conversation, else `text`."""
    layout: str                                  # one of LAYOUTS
    messages: tuple[dict[str, str], ...] = ()
    text: str | None = None

    @property
    def is_conversation(self) -> bool:
        return self.text is None


def _row_error(path: Path, row: int, problem: str) -> ConversationError:
    return ConversationError(f"{path}, row {row}: {problem}")


def detect_layout(keys) -> str | None:
    """The layout rows with these keys (or columns) are in, or None."""
    keys = set(keys)
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "conversations"
    if keys & set(INSTRUCTION_FIELDS) and keys & set(ANSWER_FIELDS):
        return "alpaca"
    if "text" in keys:
        return "text"
    return None


def _unknown_layout(path: Path, row: int, keys) -> ConversationError:
    found = ", ".join(sorted(map(str, keys))) or "none"
    return _row_error(path, row, f"no conversation layout fits its keys ({found}); a row needs "
                                 f"{ACCEPTED_LAYOUTS}; rename the fields to one of these")


def _string_field(path: Path, row: int, where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _row_error(path, row, f"{where} is {type(value).__name__}, not a string (content as a "
                                    "list of parts, e.g. images, is not supported); give it as text")
    return value


def _turns(path: Path, row: int, layout: str, turns: Any) -> list[dict[str, str]]:
    """A messages or ShareGPT list as [{"role", "content"}], checked."""
    role_key, content_key = ("role", "content") if layout == "messages" else ("from", "value")
    if not isinstance(turns, list) or not turns:
        raise _row_error(path, row, f"'{layout}' must be a non-empty list of "
                                    f"{{{role_key}, {content_key}}} objects")
    messages = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, Mapping) or turn.get(role_key) is None \
                or turn.get(content_key) is None:
            raise _row_error(path, row, f"turn {number} of '{layout}' has no '{role_key}' or no "
                                        f"'{content_key}'; give each turn both")
        role = _string_field(path, row, f"turn {number}'s '{role_key}'", turn[role_key])
        if layout == "conversations":
            if role.lower() not in SHAREGPT_ROLES:
                raise _row_error(path, row, f"turn {number} is from {role!r}, not one of "
                                            f"{', '.join(SHAREGPT_ROLES)}; rename the speaker")
            role = SHAREGPT_ROLES[role.lower()]
        content = _string_field(path, row, f"turn {number}'s '{content_key}'", turn[content_key])
        messages.append({"role": role, "content": content})
    return messages


def _first_text(path: Path, row: int, sample: Mapping, fields) -> str:
    """The first of `fields` with a non-empty value (Megatron-LM's probe order)."""
    for field in fields:
        value = sample.get(field)
        if value not in (None, ""):
            return _string_field(path, row, f"'{field}'", value)
    return ""


def _alpaca_messages(path: Path, row: int, sample: Mapping) -> list[dict[str, str]]:
    instruction = _first_text(path, row, sample, INSTRUCTION_FIELDS)
    context = _first_text(path, row, sample, CONTEXT_FIELDS)
    answer = _first_text(path, row, sample, ANSWER_FIELDS)
    if not instruction:
        raise _row_error(path, row, f"the instruction ({'|'.join(INSTRUCTION_FIELDS)}) is empty; "
                                    "give the prompt the answer replies to")
    user = f"{instruction}\n\n{context}" if context else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _check_assistant_turns(path: Path, row: int, messages: list[dict[str, str]]) -> None:
    """A conversation trains on its assistant turns: it needs one, and none empty."""
    assistant = [i for i, m in enumerate(messages, 1) if m["role"] == "assistant"]
    if not assistant:
        raise _row_error(path, row, "the conversation has no assistant turn, so nothing to train "
                                    "on; add the reply or leave the row out")
    for number in assistant:
        if not messages[number - 1]["content"].strip():
            raise _row_error(path, row, f"turn {number} is an empty assistant turn; give its reply "
                                        "or leave the row out")


def normalise_row(path: Path, row: int, sample: Any, layout: str | None = None) -> Record:
    """Row number `row` (1-based) of `path` as a Record. `layout`: the file's
    (a Parquet file's columns decide it for every row); None: this row's keys."""
    if not isinstance(sample, Mapping):
        raise _row_error(path, row, f"is a JSON {type(sample).__name__}, not an object; each row "
                                    "is one conversation as a JSON object")
    layout = layout or detect_layout(sample)
    if layout is None:
        raise _unknown_layout(path, row, sample.keys())
    if layout == "text":
        text = _string_field(path, row, "'text'", sample.get("text"))
        return Record(layout, text=text)
    if layout == "alpaca":
        messages = _alpaca_messages(path, row, sample)
    else:
        messages = _turns(path, row, layout, sample.get(layout))
    _check_assistant_turns(path, row, messages)
    return Record(layout, messages=tuple(messages))


def _jsonl_rows(path: Path, bad_rows: list | None = None) -> Iterator[tuple[int, Any]]:
    """(1-based row, parsed JSON) per non-blank line, one line in memory at a
    time; a line that is not JSON is appended to `bad_rows` when given."""
    with path.open("rb") as file:
        for row, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                yield row, json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
                bad = _row_error(path, row, f"is not valid JSON ({error}); write one JSON object "
                                            "per line")
                if bad_rows is None:
                    raise bad from None
                bad_rows.append(bad)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(1-based row, row as a dict, the columns' layout) per row, one record batch at a time."""
    import pyarrow
    import pyarrow.parquet as parquet

    with path.open("rb") as probe:
        magic = probe.read(len(PARQUET_MAGIC))
    problem = None if magic == PARQUET_MAGIC else f"it starts with {magic!r}, not {PARQUET_MAGIC!r}"
    if problem is None:
        try:
            reader = parquet.ParquetFile(str(path))
        except (pyarrow.ArrowException, OSError) as error:
            problem = str(error)
    if problem is not None:
        raise ConversationError(f"{path} is not a Parquet file ({problem}); give a Parquet file, or "
                                "name JSON lines with the .jsonl suffix")
    columns = reader.schema_arrow.names
    layout = detect_layout(columns)
    if layout is None:
        raise _unknown_layout(path, 1, columns)
    row = 0
    batches = reader.iter_batches(batch_size=PARQUET_BATCH_ROWS)
    while True:
        try:
            batch = next(batches, None)
        except (pyarrow.ArrowException, OSError) as error:  # a damaged row group
            raise _row_error(path, row + 1, f"cannot be read ({error}); rewrite the file") from None
        if batch is None:
            return
        for sample in batch.to_pylist():
            row += 1
            yield row, sample, layout


def read_records(path: str | Path, bad_rows: list | None = None
                 ) -> Iterator[tuple[int, Record]]:
    """(1-based row, Record) for each row of a JSON lines file (.jsonl,
    .json) or a Parquet file (.parquet), streamed. Raises ConversationError
    at the first row that is not a conversation; with `bad_rows` (a list)
    appends the row's ConversationError to it and goes on instead. A file
    that cannot be read at all raises either way."""
    path = Path(path)
    if not path.is_file():
        raise ConversationError(f"{path}: no such file; give a JSON lines (.jsonl) or Parquet "
                                "(.parquet) file of conversations")
    if path.suffix.lower() == ".parquet":
        samples = _parquet_rows(path)
    else:
        samples = ((row, sample, None) for row, sample in _jsonl_rows(path, bad_rows))
    for row, sample, layout in samples:
        try:
            record = normalise_row(path, row, sample, layout)
        except ConversationError as error:
            if bad_rows is None:
                raise
            bad_rows.append(error)
            continue
        yield row, record
