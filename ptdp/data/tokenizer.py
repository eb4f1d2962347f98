"""Tokenizers: GPT-2's byte-level BPE, a user's own BPE, and raw bytes.

`build_tokenizer(type, ...)` is the one entry point; the names are
Megatron-LM's (`--tokenizer-type`):

* ``GPT2BPETokenizer`` (default): GPT-2's 50,257-token BPE. Without files it
  uses the original ranks shipped in `ptdp/data/assets/gpt2.tiktoken`
  (checked against its published sha256 on every load) and encodes with
  tiktoken. With `--vocab-file vocab.json --merge-file merges.txt` (the form
  Megatron-LM and Hugging Face use) it encodes with HF `tokenizers`.
* ``HuggingFaceTokenizer``: a `tokenizer.json` (`--tokenizer-model`), e.g. one
  made by `ptdp tokenizer train`.
* ``ByteLevelTokenizer``: the 256 byte values plus an end-of-document token;
  no files, for tests and for text in any script.
* ``Llama2Tokenizer`` and ``SentencePieceTokenizer``: a SentencePiece model
  (`--tokenizer-model tokenizer.model`), with Megatron-LM's ids
  (ptdp.data.sentencepiece_tokenizers).
* ``TikTokenizer``: Megatron-LM's tiktoken JSON vocabulary
  (`--tokenizer-model`, `--tiktoken-pattern` ...; ptdp.data.tiktoken_tokenizer).
* ``NullTokenizer``: no text at all, for data that is already token ids
  (Megatron-LM's meaning): `--vocab-size N` says the data's ids are 0..N-1,
  N is the end-of-document id, and the vocabulary is N + 1 tokens.

Every tokenizer has `vocab_size`, `eod` (the end-of-document id that
preprocessing appends), `encode(text) -> list[int]` and `decode(ids)`.
Encoding treats the text as ordinary text: a literal "<|endoftext|>" in a
document is not turned into the end-of-document token (except with
SentencePieceTokenizer, as in Megatron-LM).
"""

from __future__ import annotations

import base64
import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Protocol, Sequence

from ptdp.data.tiktoken_tokenizer import TiktokenEncoded, TikTokenizer, TiktokenSettings
from ptdp.data.tokenizer_error import TokenizerError
from ptdp.output_paths import output_path_problems

# Tokenizers that turn text into ids (what `ptdp preprocess` can use) ...
TEXT_TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelTokenizer",
                        "Llama2Tokenizer", "SentencePieceTokenizer", "TikTokenizer")
# The ones that read one --tokenizer-model file of their own kind.
MODEL_FILE_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer",
                              "TikTokenizer")
# ... and every --tokenizer-type training accepts.
TOKENIZER_TYPES = (*TEXT_TOKENIZER_TYPES, "NullTokenizer")

GPT2_RANKS_FILE = Path(__file__).parent / "assets" / "gpt2.tiktoken"
# sha256 of whisper/assets/gpt2.tiktoken in the openai-whisper==20250625 sdist.
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOD_TEXT = "<|endoftext|>"
# The demo's tokenizer: a 2048-token byte-level BPE trained (`ptdp tokenizer
# train`) on the demo corpus's training works; ptdp.data.corpus rebuilds it.
DEMO_TOKENIZER_FILE = Path(__file__).parent / "assets" / "shakespeare-bpe-2048.json"
DEMO_TOKENIZER_SHA256 = "29627d246587c67438c1ab1dfad51821a42bc1b2b7e80819aa2670f155fa9913"
DEMO_TOKENIZER_VOCAB = 2048
# GPT-2's pre-tokenisation: contractions, letters, digits, other symbols,
# each with an optional leading space; runs of whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# End-of-document tokens to look for in a user's vocabulary, in this order.
# The last: DeepSeek-V3's (and Moonlight's) end of sentence.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<eod>",
                  "<｜end▁of▁sentence｜>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class GPT2Tokenizer(TiktokenEncoded):
    """GPT-2's BPE from the shipped ranks, encoded by tiktoken."""

    name = "GPT2BPETokenizer"

    def __init__(self, ranks_file: Path = GPT2_RANKS_FILE):
        import tiktoken

        ranks = load_gpt2_ranks(ranks_file)
        self.eod = len(ranks)
        self.vocab_size = len(ranks) + 1
        self._encoding = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                           special_tokens={GPT2_EOD_TEXT: self.eod},
                                           explicit_n_vocab=self.vocab_size)


def _check_demo_tokenizer(path: Path) -> None:
    """The shipped demo tokenizer is the one its hash names (a damaged copy
    would tokenize the corpus differently without failing)."""
    if hashlib.sha256(path.read_bytes()).hexdigest() != DEMO_TOKENIZER_SHA256:
        raise TokenizerError(f"{path} does not match its sha256 (damaged file); rebuild it with "
                             f"`python -m ptdp.data.corpus --demo-tokenizer DIR` (then copy DIR/tokenizer.json there) or "
                             f"reinstall ptdp")


def load_gpt2_ranks(path: Path = GPT2_RANKS_FILE,
                    expected_sha256: str | None = GPT2_RANKS_SHA256) -> dict[bytes, int]:
    """The mergeable ranks (token bytes -> id), after checking the file's hash."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TokenizerError(f"cannot read the GPT-2 ranks file {path}: {error}; reinstall ptdp "
                             "(the file ships with it) or pass --vocab-file and --merge-file") from None
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise TokenizerError(f"{path} has sha256 {digest}, not GPT-2's {expected_sha256}: the file "
                             "is damaged; reinstall ptdp or run scripts/fetch_assets.py")
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer: a tokenizer.json, or GPT-2
    style vocab.json + merges.txt (byte-level BPE with GPT-2's splitting)."""

    def __init__(self, tokenizer, name: str, source: str):
        self._tokenizer = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eod = next((vocab[t] for t in EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise TokenizerError(f"{source} has no end-of-document token (looked for "
                                 f"{', '.join(EOD_CANDIDATES)}); add {GPT2_EOD_TEXT} as a special "
                                 "token (ptdp tokenizer train does)")
        self.eod = eod

    @classmethod
    def from_vocab_and_merges(cls, vocab_file: str | Path, merge_file: str | Path) -> "HFTokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        _check_vocab_and_merges(Path(vocab_file), Path(merge_file))
        try:
            model = models.BPE.from_file(str(vocab_file), str(merge_file))
        except Exception as error:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"cannot read --vocab-file {vocab_file} / --merge-file {merge_file} "
                                 f"as GPT-2 style BPE files (vocab.json, merges.txt): {error}") from None
        tokenizer = Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return cls(tokenizer, "GPT2BPETokenizer", f"--vocab-file {vocab_file}")

    @classmethod
    def from_file(cls, path: str | Path) -> "HFTokenizer":
        from tokenizers import Tokenizer

        if not Path(path).is_file():
            raise TokenizerError(f"--tokenizer-model {path}: no such file (give a tokenizer.json, "
                                 "e.g. one written by `ptdp tokenizer train`)")
        if Path(path).resolve() == DEMO_TOKENIZER_FILE.resolve():
            _check_demo_tokenizer(Path(path))
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:
            raise TokenizerError(f"--tokenizer-model {path} is not a Hugging Face tokenizer.json: "
                                 f"{error}") from None
        return cls(tokenizer, "HuggingFaceTokenizer", f"--tokenizer-model {path}")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids and each token's character span in `text` (a chat
        template's loss mask maps rendered spans to tokens with them)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _check_vocab_and_merges(vocab_file: Path, merge_file: Path) -> None:
    """Catch what would make `tokenizers` panic (it aborts on a merge of
    tokens missing from the vocabulary) and say which line is wrong."""
    try:
        vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise TokenizerError(f"--vocab-file {vocab_file} is not a JSON vocabulary "
                             f"(token -> id): {error}") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerError(f"--vocab-file {vocab_file} must map each token to an integer id")
    try:
        lines = merge_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise TokenizerError(f"--merge-file {merge_file}: {error}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip() or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or any(p not in vocab for p in parts) or "".join(parts) not in vocab:
            raise TokenizerError(f"--merge-file {merge_file} line {number} ({line!r}): a merge is two "
                                 "tokens of --vocab-file whose concatenation is also in it")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end of document 256."""

    name = "ByteLevelTokenizer"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in (int(x) for x in ids) if i < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron-LM's NullTokenizer: the data is token ids already, and there
    is no text to encode or decode. `data_vocab_size` (its --vocab-size N)
    counts the data's ids 0..N-1; N is the end-of-document id, so the
    vocabulary holds N + 1 tokens."""

    name = "NullTokenizer"

    def __init__(self, data_vocab_size: int):
        if isinstance(data_vocab_size, bool) or not isinstance(data_vocab_size, int) \
                or data_vocab_size < 1:
            raise TokenizerError(f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1 (the "
                                 f"data's token ids are 0..N-1), got {data_vocab_size!r}")
        self.eod = data_vocab_size
        self.vocab_size = data_vocab_size + 1

    def encode(self, text: str) -> list[int]:
        raise TokenizerError("NullTokenizer has no text: this model was trained on token ids; give "
                             "token ids (ptdp generate --prompt-ids 1,2,3) or use a text tokenizer")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)  # the ids themselves, as Megatron-LM's


def build_tokenizer(tokenizer_type: str = "GPT2BPETokenizer", *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    vocab_size: int | None = None, tiktoken=None) -> Tokenizer:
    """The tokenizer that `--tokenizer-type` and its file flags describe.
    `vocab_size` is NullTokenizer's --vocab-size N (ids 0..N-1; N is the end
    of document); the other tokenizers ignore it. `tiktoken`: TikTokenizer's
    settings (ptdp.data.tiktoken_tokenizer.TiktokenSettings)."""
    if tokenizer_type == "NullTokenizer":
        problems = check_tokenizer_settings(tokenizer_type, vocab_file, merge_file, tokenizer_model)
        if problems:
            raise TokenizerError("; ".join(problems))
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N: the data's "
                                 "token ids are 0..N-1 and N is the end-of-document id")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        tokenizer_model = hf_tokenizer_file(tokenizer_model)
    if tokenizer_type != "TikTokenizer":
        tiktoken = None
    elif tiktoken is None:
        tiktoken = TiktokenSettings()
    return _build(tokenizer_type, vocab_file and str(vocab_file), merge_file and str(merge_file),
                  tokenizer_model and str(tokenizer_model), tiktoken)


@lru_cache(maxsize=8)  # loading GPT-2's ranks takes ~0.2 s; tokenizers are stateless
def _build(tokenizer_type, vocab_file, merge_file, tokenizer_model, tiktoken=None) -> Tokenizer:
    problems = check_tokenizer_settings(tokenizer_type, vocab_file, merge_file, tokenizer_model)
    if problems:
        raise TokenizerError("; ".join(problems))
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file:
            return HFTokenizer.from_vocab_and_merges(vocab_file, merge_file)
        return GPT2Tokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        return HFTokenizer.from_file(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, tiktoken)
    if tokenizer_type in ("Llama2Tokenizer", "SentencePieceTokenizer"):
        from ptdp.data import sentencepiece_tokenizers

        return getattr(sentencepiece_tokenizers, tokenizer_type)(tokenizer_model)
    return ByteTokenizer()


def hf_tokenizer_file(path):
    """HuggingFaceTokenizer's --tokenizer-model: a tokenizer.json, or (as
    Megatron-LM takes it) a model's directory, which means the tokenizer.json
    inside it."""
    if path and Path(path).is_dir() and (Path(path) / "tokenizer.json").is_file():
        return str(Path(path) / "tokenizer.json")
    return path


def check_tokenizer_settings(tokenizer_type: str, vocab_file, merge_file, tokenizer_model) -> list[str]:
    """Problems with a tokenizer's flags, each saying what to change."""
    problems = []
    if tokenizer_type not in TOKENIZER_TYPES:
        problems.append(f"--tokenizer-type={tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
    elif tokenizer_type == "GPT2BPETokenizer":
        if bool(vocab_file) != bool(merge_file):
            given, missing = (("--vocab-file", "--merge-file") if vocab_file
                              else ("--merge-file", "--vocab-file"))
            problems.append(f"{given} needs {missing} too (or neither, for the shipped GPT-2 ranks)")
        if tokenizer_model:
            problems.append("--tokenizer-model is for --tokenizer-type "
                            + ", ".join(MODEL_FILE_TOKENIZER_TYPES))
    elif tokenizer_type in MODEL_FILE_TOKENIZER_TYPES:
        if not tokenizer_model:
            what = {"HuggingFaceTokenizer": "PATH/tokenizer.json",
                    "TikTokenizer": "PATH (its tiktoken JSON vocabulary)"}
            problems.append(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model "
                            + what.get(tokenizer_type, "PATH (its SentencePiece tokenizer.model)"))
        if vocab_file or merge_file:
            problems.append("--vocab-file/--merge-file are for --tokenizer-type GPT2BPETokenizer")
    elif vocab_file or merge_file or tokenizer_model:
        problems.append(f"--tokenizer-type {tokenizer_type} takes no tokenizer files")
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file),
                       ("--tokenizer-model", tokenizer_model)):
        if path and Path(path).is_dir() and tokenizer_type == "HuggingFaceTokenizer":
            problems.append(f"{flag} {path}: the directory has no tokenizer.json; give the "
                            f"directory of a Hugging Face model that has one, or the file")
        elif path and not Path(path).is_file():
            hub = tokenizer_type == "HuggingFaceTokenizer" and flag == "--tokenizer-model" \
                and str(path).count("/") == 1 and not Path(path).parent.exists()
            problems.append(f"{flag} {path}: no such file" + (
                " (ptdp downloads nothing: give the local directory of the model, holding its "
                "tokenizer.json, or that file)" if hub else ""))
    return problems


# ---------------------------------------------------------------- ptdp tokenizer train

LARGEST_TRAINED_VOCABULARY = 1 << 21

def train_tokenizer(inputs: Sequence[str | Path], vocab_size: int, output_dir: str | Path, *,
                    min_frequency: int = 2) -> dict[str, str]:
    """Train a GPT-2 style byte-level BPE on text files. Writes
    `tokenizer.json` (for HuggingFaceTokenizer) and `vocab.json` +
    `merges.txt` (for GPT2BPETokenizer); <|endoftext|> is the
    end-of-document token. Returns the written paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    problems = [f"--input {p}: no such file" for p in inputs if not Path(p).is_file()]
    if not inputs:
        problems.append("--input needs at least one text file")
    minimum = 256 + 1  # every byte plus the end-of-document token
    if vocab_size < minimum:
        problems.append(f"--vocab-size={vocab_size} is below {minimum} (256 bytes + "
                        f"{GPT2_EOD_TEXT}); use at least {minimum}, e.g. 8192")
    elif vocab_size > LARGEST_TRAINED_VOCABULARY:
        # The trainer allocates for the requested size up front (about 70
        # bytes a token: 10**9 aborted asking for 71 GB).
        problems.append(f"--vocab-size={vocab_size:,} is more than ptdp trains "
                        f"({LARGEST_TRAINED_VOCABULARY:,}; the largest open models' vocabularies "
                        f"hold about 262,144): use e.g. 32768 or 131072")
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        problems.append(f"--output {out} exists and is not a directory")
    else:  # checked before the training, not at the first write after it
        problems += output_path_problems("--output", str(out), directory=True)
    if problems:
        raise TokenizerError("; ".join(problems))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[GPT2_EOD_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in inputs], trainer)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"tokenizer_model": str(out / "tokenizer.json")}
    tokenizer.save(paths["tokenizer_model"])
    vocab_file, merge_file = tokenizer.model.save(str(out))
    paths.update(vocab_file=vocab_file, merge_file=merge_file)
    return paths


def gpt2_vocab_and_merges(ranks: dict[bytes, int], eod_id: int
                          ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken-style ranks as GPT-2's vocab.json (token text -> id, with
    <|endoftext|> at `eod_id`) and merges.txt (pairs, in rank order). Each
    multi-byte token's merge is recovered by running BPE on its bytes with
    only lower-ranked tokens allowed, which ends in exactly two parts."""
    byte_to_char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            best_rank, i = min((r, i) for r, i in pairs if r is not None and r < rank)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        merges.append((text(parts[0]), text(parts[1])))
    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[GPT2_EOD_TEXT] = eod_id
    return vocab, merges


def vocab_and_merges_text(vocab: dict[str, int], merges: list[tuple[str, str]]) -> tuple[str, str]:
    """The contents of vocab.json and merges.txt, as GPT-2's files spell them."""
    return (json.dumps(vocab, ensure_ascii=False),
            "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def dump_vocab_and_merges(ranks: dict[bytes, int], eod_id: int, output_dir: Path) -> tuple[Path, Path]:
    """Write tiktoken-style ranks as vocab.json + merges.txt (GPT-2's file
    form). Used by the tests to check the two GPT-2 forms agree."""
    vocab_text, merges_text = vocab_and_merges_text(*gpt2_vocab_and_merges(ranks, eod_id))
    output_dir.mkdir(parents=True, exist_ok=True)
    vocab_file, merge_file = output_dir / "vocab.json", output_dir / "merges.txt"
    vocab_file.write_text(vocab_text, encoding="utf-8")
    merge_file.write_text(merges_text, encoding="utf-8")
    return vocab_file, merge_file


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the
    vocab.json/merges.txt spelling): printable Latin-1 bytes stand for
    themselves, the rest are shifted past 255."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


# ---------------------------------------------------------------- characters per token (bits per character)

def _utf8_characters(token: bytes) -> int:
    """The characters `token` starts: its bytes that are not UTF-8
    continuation bytes (0x80-0xBF). Summed over a byte-level token sequence
    this is exactly the length of its decoded text, even where a character's
    bytes are split over tokens (the token holding its first byte counts it)."""
    return sum(1 for b in token if not 0x80 <= b <= 0xBF)


def character_counts(tokenizer: Tokenizer) -> list[int] | None:
    """Per token id, the characters it contributes to decoded text; None when
    no exact count exists (NullTokenizer: no text; a Hugging Face tokenizer
    that is not byte-level, whose decoder may add or drop characters between
    tokens). The end-of-document token counts 0: it is not text, but its loss
    (the cost of encoding where documents end) stays in bits per character's
    numerator. Ids a vocabulary leaves unused count 0."""
    pieces = token_pieces(tokenizer, decoded_only=True)
    if pieces is None:
        return None
    counts = [0] * tokenizer.vocab_size
    for i, token in pieces.items():
        if i != tokenizer.eod and i < len(counts):
            counts[i] = _utf8_characters(token)
    return counts


def token_pieces(tokenizer: Tokenizer, *, decoded_only: bool) -> dict[int, bytes] | None:
    """What each id stands for, as bytes; None for NullTokenizer (no text).
    A Hugging Face tokenizer that is not byte-level gives its vocabulary's
    own strings, or None with `decoded_only` (its decoder may add or drop
    characters between tokens, so they are not its decoded text)."""
    if isinstance(tokenizer, ByteTokenizer):
        return {i: bytes([i]) for i in range(256)}
    if hasattr(tokenizer, "token_pieces"):  # SentencePiece and tiktoken files: their own
        return tokenizer.token_pieces(decoded_only)
    if isinstance(tokenizer, GPT2Tokenizer):
        decode = tokenizer._encoding.decode_single_token_bytes
        return {i: decode(i) for i in range(tokenizer.eod)}
    if isinstance(tokenizer, HFTokenizer):
        pieces = _byte_level_pieces(tokenizer._tokenizer)
        if pieces is None and not decoded_only:
            pieces = {i: text.encode("utf-8", "surrogatepass") for text, i in
                      tokenizer._tokenizer.get_vocab(with_added_tokens=True).items()}
        return pieces
    return None


def _byte_level_pieces(tokenizer) -> dict[int, bytes] | None:
    """Each id's bytes for a tokenizer whose decoder is byte-level, as its
    ByteLevel decoder turns a token's text into bytes: through GPT-2's
    byte-to-character map where every character is in it, else the token's
    own UTF-8 (added tokens such as <|endoftext|>). None for other decoders."""
    from tokenizers import decoders

    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    pieces = {}
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if all(c in char_to_byte for c in text):
            pieces[i] = bytes(char_to_byte[c] for c in text)
        else:
            pieces[i] = text.encode("utf-8")
    return pieces
