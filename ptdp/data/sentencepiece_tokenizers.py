"""Megatron-LM's two SentencePiece tokenizers, on a `--tokenizer-model`
SentencePiece model file (`tokenizer.model`), with the ids Megatron-LM gives.

* ``Llama2Tokenizer`` (Llama 2, Mistral, Mixtral): the model's own pieces
  and nothing more. Encoding starts every text with the model's
  beginning-of-sentence id, as Megatron-LM's tokenizer (and so its
  preprocess_data.py) does; the end of document is the model's
  end-of-sentence id.
* ``SentencePieceTokenizer``: the model's pieces, then Megatron-LM's special
  tokens where the model lacks them, in this order: <CLS>, <SEP>, <EOD>,
  <MASK>, the model's padding piece (else <PAD>), its beginning-of-sentence
  piece (else <BOS>) and end-of-sentence piece (else <EOS>). The end of
  document is <EOD>. Unlike ptdp's other tokenizers, a special token's text
  inside a document becomes that token (Megatron-LM's behaviour, kept so the
  ids are the same), and decoding writes each special token between spaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from ptdp.data.tokenizer_error import TokenizerError

SENTENCEPIECE_TOKENIZER_TYPES = ("Llama2Tokenizer", "SentencePieceTokenizer")
# Megatron-LM's special tokens, added after the model's pieces where missing.
_ADDED_SPECIALS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")


def load_sentencepiece(path: str | Path, tokenizer_type: str):
    """The SentencePieceProcessor of a model file; TokenizerError if unusable."""
    try:
        import sentencepiece
    except ImportError:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs the sentencepiece package: "
                             "pip install sentencepiece (into the environment ptdp runs in)") from None
    if not Path(path).is_file():
        raise TokenizerError(f"--tokenizer-model {path}: no such file (give the SentencePiece "
                             "model, e.g. tokenizer.model)")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as error:
        raise TokenizerError(f"--tokenizer-model {path} is not a SentencePiece model file "
                             f"(tokenizer.model) for --tokenizer-type {tokenizer_type}: "
                             f"{error}") from None


def _piece(model, piece_id: int) -> str | None:
    """The model's piece for `piece_id`; None for a disabled id (-1)."""
    return model.id_to_piece(piece_id) if 0 <= piece_id < model.get_piece_size() else None


class Llama2Tokenizer:
    """Megatron-LM's Llama2Tokenizer: see the module docstring."""

    name = "Llama2Tokenizer"

    def __init__(self, path: str | Path):
        self._model = model = load_sentencepiece(path, self.name)
        self.vocab_size = model.get_piece_size()
        self.bos, self.eod = model.bos_id(), model.eos_id()
        missing = [what for what, i in (("beginning-of-sentence", self.bos),
                                        ("end-of-sentence", self.eod)) if i < 0]
        if missing:
            raise TokenizerError(f"--tokenizer-model {path} has no {' or '.join(missing)} piece, "
                                 f"which --tokenizer-type Llama2Tokenizer needs (it starts each "
                                 f"text with the first and ends documents with the second); use "
                                 f"--tokenizer-type SentencePieceTokenizer, which adds its own")

    def encode(self, text: str) -> list[int]:
        return [self.bos, *self._model.encode(text)]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in self._model.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._model.decode_ids([int(i) for i in ids])

    def token_pieces(self, decoded_only: bool) -> dict[int, bytes] | None:
        # Decoding turns "▁" into spaces and drops a text's first one: a
        # piece is not its decoded text.
        if decoded_only:
            return None
        return {i: self._model.id_to_piece(i).encode("utf-8") for i in range(self.vocab_size)}


class SentencePieceTokenizer:
    """Megatron-LM's SentencePieceTokenizer: see the module docstring."""

    name = "SentencePieceTokenizer"

    def __init__(self, path: str | Path):
        self._model = model = load_sentencepiece(path, self.name)
        self._vocab = {model.id_to_piece(i): i for i in range(model.get_piece_size())}
        self._special: dict[str, int] = {}  # in Megatron-LM's order: it breaks ties by it
        for token in _ADDED_SPECIALS:
            self._add_special(token)
        for piece_id, fallback in ((model.pad_id(), "<PAD>"), (model.bos_id(), "<BOS>"),
                                   (model.eos_id(), "<EOS>")):
            self._add_special(_piece(model, piece_id) or fallback)
        self.bos = self._vocab[_piece(model, model.bos_id()) or "<BOS>"]
        self._special_text = {i: token for token, i in self._special.items()}
        self.vocab_size = len(self._vocab)
        self.eod = self._vocab["<EOD>"]

    def _add_special(self, token: str) -> None:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
        self._special[token] = self._vocab[token]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:  # the earliest special token next; the text before it is ordinary
            found = {token: text.find(token, start) for token in self._special}
            found = {token: at for token, at in found.items() if at >= 0}
            if not found:
                break
            token = min(found, key=found.__getitem__)
            ids += self._model.encode(text[start:found[token]])
            ids.append(self._special[token])
            start = found[token] + len(token)
        return ids + self._model.encode(text[start:])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for at, i in enumerate(ids):
            if i in self._special_text:
                text += self._model.decode_ids(ids[last:at]) + " " + self._special_text[i] + " "
                last = at + 1
        return text + self._model.decode_ids(ids[last:])

    def token_pieces(self, decoded_only: bool) -> dict[int, bytes] | None:
        if decoded_only:
            return None
        return {i: token.encode("utf-8") for token, i in self._vocab.items()}
