"""Megatron-LM's TikTokenizer: a byte-level BPE read from its tiktoken JSON
vocabulary file (`--tokenizer-model vocab.json`), with the ids Megatron-LM
gives.

The file is a JSON list of {"rank": i, "token_bytes": base64, "token_str":
text}, rank i at position i, the first 256 being the single bytes. The ids:
first `--tiktoken-num-special-tokens` special tokens (default 1000):
`--tokenizer-special-tokens` (default <unk> <s> </s>; the list must hold
those three), then <SPECIAL_k> fillers up to the count; after them the
file's tokens in rank order. The end of document is </s>. The splitting
pattern is `--tiktoken-pattern` v1 or v2 (required, as in Megatron-LM).
Encoding adds no special token; special tokens' text in a document stays
ordinary text.

The vocabulary is the special tokens plus the whole file, at most Megatron-
LM's 2^17 tokens (its size without --vocab-size: a longer file is cut
there, as Megatron-LM cuts it).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ptdp.data.tokenizer_error import TokenizerError

# Megatron-LM's two splitting patterns (PATTERN_TIKTOKEN, PATTERN_TIKTOKEN_V2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
DEFAULT_NUM_SPECIAL_TOKENS = 1000
MAX_VOCAB_SIZE = 2 ** 17  # Megatron-LM's vocabulary without --vocab-size


@dataclass(frozen=True)
class TiktokenSettings:
    """--tiktoken-pattern, --tiktoken-num-special-tokens, --tokenizer-special-tokens."""
    pattern: str | None = None
    num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS
    special_tokens: tuple[str, ...] | None = None

    @classmethod
    def of(cls, data) -> "TiktokenSettings":
        """The settings in a DataConfig."""
        specials = data.tokenizer_special_tokens
        return cls(data.tiktoken_pattern, data.tiktoken_num_special_tokens,
                   None if specials is None else tuple(specials))

    def problems(self) -> list[str]:
        problems = []
        if self.pattern not in TIKTOKEN_PATTERNS:
            problems.append("--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2 (the "
                            "splitting its vocabulary was made with)")
        specials = list(self.special_tokens or REQUIRED_SPECIAL_TOKENS)
        if len(set(specials)) != len(specials):
            problems.append(f"--tokenizer-special-tokens {' '.join(specials)}: each token once")
        missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in specials]
        if missing:
            problems.append(f"--tokenizer-special-tokens must include {' '.join(missing)} (the "
                            f"TikTokenizer's unknown, beginning and end tokens)")
        count = self.num_special_tokens
        if isinstance(count, bool) or not isinstance(count, int) or count < len(specials):
            problems.append(f"--tiktoken-num-special-tokens={count!r} must be at least the "
                            f"{len(specials)} special tokens")
        return problems


def read_tiktoken_vocabulary(path: str | Path) -> list[bytes]:
    """The file's tokens in rank order; TokenizerError saying what is wrong."""
    where = f"--tokenizer-model {path}"
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(entries, list):
            raise ValueError("not a JSON list")
        tokens = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
                raise ValueError(f"entry {i} is not {{rank, token_bytes, token_str}}")
            if entry["rank"] != i:
                raise ValueError(f"entry {i} has rank {entry['rank']!r}; ranks run 0, 1, 2, ...")
            token = base64.b64decode(entry["token_bytes"], validate=True)
            if i < 256 and token != bytes([i]):
                raise ValueError(f"entry {i} is not the single byte {i} (the first 256 are)")
            tokens.append(token)
        if len(set(tokens)) != len(tokens):
            raise ValueError("a token's bytes appear twice")
    except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as error:
        raise TokenizerError(f"{where} is not Megatron-LM's tiktoken vocabulary (a JSON list of "
                             f"rank, token_bytes, token_str): {error}") from None
    return tokens


class TiktokenEncoded:
    """encode/decode of a tokenizer whose `_encoding` is a tiktoken Encoding
    (GPT-2's and TikTokenizer): ordinary text, special tokens' text included."""
    _encoding: "tiktoken.Encoding"

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])


class TikTokenizer(TiktokenEncoded):
    """Megatron-LM's TikTokenizer: see the module docstring."""

    name = "TikTokenizer"

    def __init__(self, path: str | Path, settings: TiktokenSettings):
        import tiktoken

        problems = settings.problems()
        if problems:
            raise TokenizerError("; ".join(problems))
        specials = list(settings.special_tokens or REQUIRED_SPECIAL_TOKENS)
        count = settings.num_special_tokens
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), count)]
        tokens = read_tiktoken_vocabulary(path)[:max(0, MAX_VOCAB_SIZE - count)]
        ranks = {token: count + rank for rank, token in enumerate(tokens)}
        special_ids = {token: i for i, token in enumerate(specials)}
        self.vocab_size = count + len(tokens)
        self.eod = special_ids["</s>"]
        self.bos = special_ids["<s>"]
        self._encoding = tiktoken.Encoding(
            name=Path(path).stem, pat_str=TIKTOKEN_PATTERNS[settings.pattern],
            mergeable_ranks=ranks, special_tokens=special_ids, explicit_n_vocab=self.vocab_size)

    def token_pieces(self, decoded_only: bool) -> dict[int, bytes]:
        decode = self._encoding.decode_single_token_bytes
        return {i: decode(i) for i in range(self.vocab_size)}
