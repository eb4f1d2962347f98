"""The special tokens of a tokenizer.json, for an exported model's config.

Hugging Face wants bos/eos ids in config.json, and a tokenizer_config.json
beside tokenizer.json so that `AutoTokenizer.from_pretrained` loads that
file as it is (PreTrainedTokenizerFast) instead of guessing a class from
the model type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ptdp.data.tokenizer import EOD_CANDIDATES
from ptdp.interop.hf_files import ConversionError

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


def special_tokens(tokenizer_file: str | Path) -> SpecialTokens:
    """The bos/eos tokens of a tokenizer.json, found by their usual names."""
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab(with_added_tokens=True)
    except Exception as error:  # tokenizers raises plain Exception subclasses
        raise ConversionError(f"{tokenizer_file} is not a Hugging Face tokenizer.json: "
                              f"{error}") from None
    eos = next((t for t in EOS_CANDIDATES if t in vocab), None)
    bos = next((t for t in BOS_CANDIDATES if t in vocab), eos)
    return SpecialTokens(bos_id=vocab.get(bos), eos_id=vocab.get(eos), bos_text=bos, eos_text=eos)
