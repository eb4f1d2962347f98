"""The tokenizer of an exported model, as the files Hugging Face reads, and
the check of the tokenizer.json an import carries (imported_tokenizer).

`AutoTokenizer.from_pretrained(DIR)` should give the ids the model was
trained with, so an export writes the checkpoint's own tokenizer:

* a tokenizer.json it carries (HuggingFaceTokenizer, an imported model) as
  it is;
* GPT2BPETokenizer as GPT-2's own files: tokenizer.json, plus vocab.json and
  merges.txt, built from the shipped ranks (or from the run's --vocab-file
  and --merge-file);
* ByteLevelTokenizer as a byte-level BPE without merges (byte b is id b);
* nothing for generated data (--mock-data) or NullTokenizer, which have no
  text: the export says so.

Beside tokenizer.json goes a tokenizer_config.json, so that AutoTokenizer
loads that file as it is (PreTrainedTokenizerFast) instead of guessing a
class from the model type; Hugging Face wants the bos/eos ids in
config.json too. (An imported model's own tokenizer_config.json, chat
template and ids take their place: hf_carried.py.) One difference from ptdp's own tokenizers remains, as in
Hugging Face's GPT-2: a literal "<|endoftext|>" in a text becomes the
end-of-document token there, while ptdp encodes it as ordinary text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptdp.config import Config
from ptdp.data.tokenizer import (EOD_CANDIDATES, GPT2_EOD_TEXT, build_tokenizer, bytes_to_unicode,
                                 gpt2_vocab_and_merges, load_gpt2_ranks, vocab_and_merges_text)
from ptdp.interop.hf_files import TOKENIZER_CONFIG_NAME, TOKENIZER_NAME, ConversionError

# End of text as ptdp's tokenizers find it, so export and generation agree.
EOS_CANDIDATES = EOD_CANDIDATES
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[BOS]")


@dataclass(frozen=True)
class SpecialTokens:
    """bos/eos ids, and their texts where a tokenizer.json names them. A
    vocabulary without a beginning-of-text token uses its end-of-text token
    for both, as GPT-2 does."""
    bos_id: int | None = None
    eos_id: int | None = None
    bos_text: str | None = None
    eos_text: str | None = None

    def tokenizer_config(self, model_max_length: int) -> dict[str, Any]:
        """tokenizer_config.json for the tokenizer.json beside it."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "model_max_length": model_max_length,
                                  "clean_up_tokenization_spaces": False}
        if self.bos_text is not None:
            config["bos_token"] = self.bos_text
        if self.eos_text is not None:
            config["eos_token"] = self.eos_text
        return config


@dataclass(frozen=True)
class ExportedTokenizer:
    """What an export writes for its tokenizer: files by name (none for a
    model without text), the bos/eos for config.json, and what to tell the
    user about it."""
    specials: SpecialTokens
    note: str
    files: dict[str, bytes] = field(default_factory=dict)


def special_tokens(tokenizer_file: str | Path) -> SpecialTokens:
    """The bos/eos tokens of a tokenizer.json, found by their usual names."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises plain Exception subclasses
        raise ConversionError(f"{tokenizer_file} is not a Hugging Face tokenizer.json: "
                              f"{error}") from None
    return _special_tokens_of(tokenizer)


def imported_tokenizer(tokenizer_file: str | Path) -> tuple[int, dict[str, int]]:
    """How many token ids the tokenizer.json that an import would carry into
    its checkpoint has (its size, or its largest id + 1 where ids are
    missing: what the model's vocabulary must hold), and its tokens with
    their ids (added ones included); refusing one that ptdp
    could not use there: a file the `tokenizers` library cannot load, or a
    vocabulary without an end-of-document token (generation stops at it,
    and training separates documents with it)."""
    from tokenizers import Tokenizer

    way_out = "fix it, or move it out of the directory to import the model without a tokenizer"
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises plain Exception subclasses
        raise ConversionError(f"{tokenizer_file} is not a Hugging Face tokenizer.json ({error}); "
                              f"{way_out}") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not any(token in vocab for token in EOS_CANDIDATES):
        raise ConversionError(f"{tokenizer_file} has no end-of-document token (looked for "
                              f"{', '.join(EOS_CANDIDATES)}), which ptdp needs to train and "
                              f"generate with it; add one as a special token, or move the file "
                              f"out of the directory to import the model without a tokenizer")
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1), vocab


def _special_tokens_of(tokenizer) -> SpecialTokens:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos = next((t for t in EOS_CANDIDATES if t in vocab), None)
    bos = next((t for t in BOS_CANDIDATES if t in vocab), eos)
    return SpecialTokens(bos_id=vocab.get(bos), eos_id=vocab.get(eos), bos_text=bos, eos_text=eos)


# ------------------------------------------------------------------ the checkpoint's tokenizer

def exported_tokenizer(config: Config, load: str | Path) -> ExportedTokenizer:
    """The tokenizer files of checkpoint `load` (whose settings are
    `config`) for a Hugging Face directory. Raises TokenizerError when the
    files the run named are gone."""
    from ptdp.checkpoint.store import checkpoint_tokenizer

    data, max_length = config.data, config.model.max_positions
    carried = checkpoint_tokenizer(load)
    if carried is None and not data.mock_data and data.tokenizer_type == "HuggingFaceTokenizer":
        build_tokenizer(data.tokenizer_type, tokenizer_model=data.tokenizer_model)  # checks the file
        carried = Path(data.tokenizer_model)  # a checkpoint from before they carried it
    if carried is not None:
        specials = special_tokens(carried)
        return ExportedTokenizer(specials, "with its tokenizer.json", {
            TOKENIZER_NAME: carried.read_bytes(),
            TOKENIZER_CONFIG_NAME: _json(specials.tokenizer_config(max_length))})
    if data.mock_data:
        return ExportedTokenizer(SpecialTokens(), "no tokenizer: the model was trained on generated "
                                 "data (--mock-data), which has no text; give it token ids")
    if data.tokenizer_type == "NullTokenizer":
        eod = config.model.vocab_size - 1
        return ExportedTokenizer(SpecialTokens(bos_id=eod, eos_id=eod),
                                 f"no tokenizer: the model was trained on token ids "
                                 f"(NullTokenizer), which have no text; give it token ids "
                                 f"(end of document: {eod})")
    if data.tokenizer_type in ("Llama2Tokenizer", "SentencePieceTokenizer", "TikTokenizer"):
        from ptdp.data.loader import tokenizer_for

        tokenizer = tokenizer_for(data)  # checks the file is still there
        bos = getattr(tokenizer, "bos", tokenizer.eod)
        return ExportedTokenizer(SpecialTokens(bos_id=bos, eos_id=tokenizer.eod),
                                 f"no tokenizer files: ptdp does not convert the "
                                 f"{data.tokenizer_type}'s --tokenizer-model "
                                 f"{Path(data.tokenizer_model).name} to tokenizer.json; copy the "
                                 f"tokenizer you trained with beside the model (bos {bos}, eos "
                                 f"{tokenizer.eod})")
    if data.tokenizer_type == "ByteLevelTokenizer":
        byte_text = bytes_to_unicode()
        tokenizer = _byte_level_bpe({byte_text[b]: b for b in range(256)}, [])
        return _with_files(tokenizer, max_length, "with its byte-level tokenizer (tokenizer.json)")
    # GPT2BPETokenizer: the run's vocab.json + merges.txt, or GPT-2's shipped ranks.
    if data.vocab_file or data.merge_file:
        build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file,
                        merge_file=data.merge_file)  # checks the files
        vocab = json.loads(Path(data.vocab_file).read_text(encoding="utf-8"))
        merges = _read_merges(Path(data.merge_file))
        whose = "its --vocab-file/--merge-file BPE"
    else:
        ranks = load_gpt2_ranks()
        vocab, merges = gpt2_vocab_and_merges(ranks, eod_id=len(ranks))
        whose = "GPT-2's tokenizer"
    vocab_text, merges_text = vocab_and_merges_text(vocab, merges)
    return _with_files(_byte_level_bpe(vocab, merges), max_length,
                       f"with {whose} (tokenizer.json, vocab.json, merges.txt)",
                       {"vocab.json": vocab_text.encode(), "merges.txt": merges_text.encode()})


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """GPT-2's tokenizer.json form of a byte-level BPE: GPT-2's splitting, no
    prefix space, and the vocabulary's end-of-document token as a special
    token (<|endoftext|>, added after the last id where the vocabulary
    lacks one, as ByteLevelTokenizer's 256)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    eod = next((t for t in EOD_CANDIDATES if t in vocab), GPT2_EOD_TEXT)
    tokenizer.add_special_tokens([AddedToken(eod, special=True, normalized=False)])
    return tokenizer


def _with_files(tokenizer, max_length: int, note: str,
                others: dict[str, bytes] | None = None) -> ExportedTokenizer:
    specials = _special_tokens_of(tokenizer)
    return ExportedTokenizer(specials, note, {
        TOKENIZER_NAME: tokenizer.to_str().encode(),
        TOKENIZER_CONFIG_NAME: _json(specials.tokenizer_config(max_length)),
        **(others or {})})


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt's pairs (checked by build_tokenizer), without its #version line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [tuple(line.split(" ")) for number, line in enumerate(lines, 1)
            if line.strip() and not (number == 1 and line.startswith("#version"))]


def _json(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

