"""Conversations rendered with a chat template, as token ids and a loss mask.

The template is Jinja, run as transformers runs it (its `apply_chat_template`
is the reference the tests hold this to): an immutable sandbox (templates
come from model hubs: untrusted code), trim_blocks and lstrip_blocks, the
loop controls, `raise_exception`, `strftime_now`, a `tojson` filter that
does not escape HTML, guarded `dict` and `namespace`, and the tokenizer's
special tokens (bos_token, eos_token, ...) as variables. The rendered text
is encoded as one string with the tokenizer.json (`tokenizers`), special
tokens recognised and none added, as transformers does.

The loss mask says which tokens the model learns to write:
* a template with `{% generation %} ... {% endgeneration %}` marks them: the
  text each block renders is a character span, and a token is in the mask
  when its character offsets overlap a span (transformers'
  `return_assistant_tokens_mask=True`, token for token);
* a template without markers: see `_assistant_spans_by_rendering`;
* `train_on_prompt=True`: every token.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ptdp.data.sft.rows import Record, read_records
from ptdp.data.sft.template_files import (TOKENIZER_JSON, ChatTemplateError, chat_template_text,
                                          special_tokens, tokenizer_directory)

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Ends of a turn in the common chat formats (ChatML/Qwen, Llama 3, Gemma,
# Phi-3); the tokenizer's eos_token is tried too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

_generation_spans: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "generation_spans", default=None)


@dataclass(frozen=True)
class TokenizedConversation:
    """A row's token ids and, per token, whether the loss covers it (1) or not (0)."""
    ids: np.ndarray        # int64 [n]
    loss_mask: np.ndarray  # int8 [n], aligned with ids (not shifted)


def _environment():
    """A Jinja environment as transformers builds one for chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(jinja2.ext.Extension):
        """`{% generation %}`: renders its body and, while spans are being
        collected, records the body's character span in the output."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record", []), [], [], body
                                          ).set_lineno(lineno)

        def _record(self, caller):
            text = caller()
            collecting = _generation_spans.get()
            if collecting is not None:  # the blocks rendered so far give the start
                blocks, spans = collecting
                start = sum(len(block) for block in blocks)
                spans.append((start, start + len(text)))
            return text

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace()` refusing underscore names (a way into Python's internals)."""
        def __init__(*args, **kwargs):
            self, attributes = args[0], dict(*args[1:], **kwargs)
            for name in attributes:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself."""
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda format: datetime.now().strftime(format),
                               dict=TemplateDict(), namespace=TemplateNamespace)
    return environment


@contextmanager
def _collecting(blocks: list[str], spans: list[tuple[int, int]]):
    token = _generation_spans.set((blocks, spans))
    try:
        yield
    finally:
        _generation_spans.reset(token)


def _load_tokenizer(tokenizer_path: Path):
    """The tokenizer.json as ptdp's HuggingFaceTokenizer loads it (its checks
    and messages)."""
    from ptdp.data.tokenizer import HFTokenizer

    path = tokenizer_path / TOKENIZER_JSON if tokenizer_path.is_dir() else tokenizer_path
    return HFTokenizer.from_file(path)


class ChatTemplate:
    """A chat template bound to its tokenizer: render, tokenize, mask."""

    def __init__(self, source: str, tokenizer_path: str | Path):
        import jinja2

        self.source = source
        self.tokenizer_path = Path(tokenizer_path)
        self.has_generation_markers = bool(GENERATION_MARKER.search(source))
        directory = tokenizer_directory(tokenizer_path)
        self.special_tokens = special_tokens(directory)
        self.text_tokenizer = _load_tokenizer(Path(tokenizer_path))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"the chat template is not valid Jinja (line {error.lineno}: "
                                    f"{error.message}); fix it or pass another template file") from None
        eos = self.special_tokens.get("eos_token")
        self.end_of_turn = END_OF_TURN_TOKENS + ((eos,) if eos and eos not in END_OF_TURN_TOKENS
                                                 else ())

    @classmethod
    def for_tokenizer(cls, tokenizer_path: str | Path,
                      template_file: str | Path | None = None) -> "ChatTemplate":
        """The tokenizer's own template (directory or its tokenizer.json), or
        `template_file`'s; ChatTemplateError when there is neither."""
        return cls(chat_template_text(tokenizer_path, template_file), tokenizer_path)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(messages=[dict(m) for m in messages], tools=None,
                                     documents=None, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)

    def render_with_generation_spans(self, messages: Sequence[dict]
                                     ) -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans its `{% generation %}` blocks rendered."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with _collecting(blocks, spans):
            for block in self._template.generate(messages=[dict(m) for m in messages], tools=None,
                                                 documents=None, add_generation_prompt=False,
                                                 **self.special_tokens):
                blocks.append(block)
        return "".join(blocks), spans

    def _assistant_spans_by_rendering(self, messages: Sequence[dict], text: str
                                      ) -> list[tuple[int, int]]:
        """Without generation markers, each assistant turn's span is found by
        rendering: the conversation before the turn with the generation
        prompt is a prefix of the whole text, and the turn starts where it
        ends (what a model writes after the prompt); its content follows,
        and the span ends after the first end-of-turn token behind the
        content (the model must learn to stop), or with the content when
        the template writes none. A template whose earlier turns render
        differently once later ones follow cannot be read this way."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:index], add_generation_prompt=True)
            content = message["content"].strip()
            found = text.find(content, len(prompt)) if text.startswith(prompt) else -1
            if found < 0:
                raise ChatTemplateError(
                    f"cannot find assistant turn {index + 1} where the template renders it (the "
                    "text before it changes once it follows, or its content is rewritten); add "
                    "{% generation %} ... {% endgeneration %} around the assistant replies")
            content_end = found + len(content)
            ends = [(text.find(t, content_end), t) for t in self.end_of_turn]
            ends = [(at, t) for at, t in ends if at >= 0]
            end = min(at + len(t) for at, t in ends) if ends else content_end
            spans.append((len(prompt), end))
        return spans

    def tokenize_messages(self, messages: Sequence[dict], train_on_prompt: bool = False
                          ) -> TokenizedConversation:
        """Token ids (apply_chat_template's) and the loss mask of a conversation."""
        if self.has_generation_markers:
            text, spans = self.render_with_generation_spans(messages)
        else:
            text = self.render(messages)
            spans = [] if train_on_prompt else self._assistant_spans_by_rendering(messages, text)
        token_ids, offsets = self.text_tokenizer.encode_with_offsets(text)
        ids = np.asarray(token_ids, dtype=np.int64)
        if train_on_prompt:
            return TokenizedConversation(ids, np.ones(len(ids), dtype=np.int8))
        return TokenizedConversation(ids, spans_to_token_mask(offsets, spans))

    def tokenize_text(self, text: str) -> TokenizedConversation:
        """Plain text: its tokens and the end-of-document token, all in the loss."""
        ids = self.text_tokenizer.encode(text) + [self.text_tokenizer.eod]
        return TokenizedConversation(np.asarray(ids, dtype=np.int64), np.ones(len(ids), np.int8))


def spans_to_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
                        ) -> np.ndarray:
    """1 for each token whose character offsets overlap a span (spans and
    offsets both in order: one pass), transformers' rule."""
    mask = np.zeros(len(offsets), dtype=np.int8)
    span = 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[token] = 1
    return mask


def tokenize_record(template: ChatTemplate, record: Record, path: str | Path, row: int,
                    train_on_prompt: bool = False) -> TokenizedConversation:
    """A row's tokens and loss mask; a conversation the template refuses is
    a ChatTemplateError naming the file and the row."""
    import jinja2

    if not record.is_conversation:
        return template.tokenize_text(record.text)
    try:
        return template.tokenize_messages(record.messages, train_on_prompt)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"{path}, row {row}: the chat template refuses the conversation "
                                f"({error}); change the row's roles or order to what the template "
                                "accepts, or pass another template file") from None
    except ChatTemplateError as error:
        raise ChatTemplateError(f"{path}, row {row}: {error}") from None


def tokenize_rows(path: str | Path, template: ChatTemplate, train_on_prompt: bool = False
                  ) -> Iterator[TokenizedConversation]:
    """Each row of a JSON lines or Parquet file, tokenized, in file order
    (streamed); the first bad row raises its ConversationError or
    ChatTemplateError."""
    for row, record in read_records(path):
        yield tokenize_record(template, record, path, row, train_on_prompt)
