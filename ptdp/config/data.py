"""The data section: where tokens come from (indexed datasets and their blend,
mock data, or the shipped demo corpus), the tokenizer, the dataset cache, and
how batches are read (background workers, memory-mapped files)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ptdp.config.base import flag, is_count


@dataclass
class DataConfig:
    """Where tokens come from. With neither --data-path nor --mock-data the
    model trains on the shipped demo corpus (Shakespeare)."""
    mock_data: bool = flag(False, "--mock-data", "train on generated, learnable sequences")
    data_path: list[str] | None = flag(
        None, "--data-path",
        "indexed dataset prefix(es) (PREFIX.bin/.idx, as `ptdp preprocess` or Megatron-LM write "
        "them), optionally weighted for blending: A, or 0.7 A 0.3 B", metavar="PATH")
    split: str = flag("949,50,1", "--split",
                      "train,valid,test proportions, taken as contiguous ranges of documents")
    tokenizer_type: str = flag(
        "GPT2BPETokenizer", "--tokenizer-type",
        "tokenizer; NullTokenizer (Megatron-LM's) is for --data-path files that are token ids "
        "already and needs --vocab-size N: the data's ids are 0..N-1, N is the end-of-document "
        "id, so the model's vocabulary is N + 1 (then padded); with --load and no tokenizer "
        "flags, the tokenizer the checkpoint carries; Llama2Tokenizer and SentencePieceTokenizer "
        "read a SentencePiece --tokenizer-model, TikTokenizer Megatron-LM's tiktoken JSON file",
        choices=("GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelTokenizer", "NullTokenizer",
                 "Llama2Tokenizer", "SentencePieceTokenizer", "TikTokenizer"))
    vocab_file: str | None = flag(None, "--vocab-file", "GPT-2 style vocab.json (with --merge-file; "
                                  "default: GPT-2's own ranks, shipped)", metavar="PATH")
    merge_file: str | None = flag(None, "--merge-file", "GPT-2 style merges.txt", metavar="PATH")
    tokenizer_model: str | None = flag(
        None, "--tokenizer-model", "tokenizer.json (or a model's directory holding it) for "
        "HuggingFaceTokenizer; the SentencePiece "
        "tokenizer.model for Llama2Tokenizer and SentencePieceTokenizer; the tiktoken JSON "
        "vocabulary for TikTokenizer", metavar="PATH")
    tiktoken_pattern: str | None = flag(
        None, "--tiktoken-pattern", "TikTokenizer's splitting pattern (Megatron-LM's v1 or v2)",
        choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = flag(
        1000, "--tiktoken-num-special-tokens",
        "TikTokenizer: ids 0..N-1 are special tokens, the file's tokens follow")
    tokenizer_special_tokens: list[str] | None = flag(
        None, "--tokenizer-special-tokens",
        "TikTokenizer's named special tokens, first ids first (default: <unk> <s> </s>, which any "
        "list must hold)", metavar="TOKEN")
    data_cache_path: str | None = flag(
        None, "--data-cache-path",
        "directory for dataset indices and the tokenized demo corpus (default: index-cache/ "
        "next to the data; the demo corpus under $PTDP_CACHE or the user cache)", metavar="DIR")
    num_workers: int = flag(
        0, "--num-workers",
        "background processes that read and assemble the training batches ahead of the step "
        "(0: in the training process; Megatron-LM's default is 2)")
    mmap_bin_files: bool = flag(
        True, "--no-mmap-bin-files",
        "read each sample's tokens from the --data-path .bin files with file reads instead of "
        "memory-mapping them (for file systems where mapping large files performs badly)",
        negate=True)
    eod_mask_loss: bool = flag(False, "--eod-mask-loss",
                               "leave positions whose input is the end-of-document token out of the loss")
    reset_position_ids: bool = flag(
        False, "--reset-position-ids",
        "positions restart at 0 after each end-of-document token (Megatron-LM's)")
    reset_attention_mask: bool = flag(
        False, "--reset-attention-mask",
        "no token attends across an end-of-document token: each document of a sequence attends "
        "only to itself (Megatron-LM's)")
    sft: bool = flag(
        False, "--sft",
        "fine-tune on conversations: --data-path names JSONL or Parquet files of one conversation "
        "per row (messages, ShareGPT conversations, Alpaca/Dolly fields or text), rendered with "
        "the tokenizer's chat template, the loss on the assistant's tokens only, conversations "
        "packed whole into sequences that attend within each (docs/fine-tuning.md)")
    chat_template: str | None = flag(
        None, "--chat-template",
        "with --sft: a jinja2 chat template file to render conversations with, instead of the "
        "tokenizer's own (ptdp ships a ChatML one: ptdp/data/assets/chatml.jinja)", metavar="FILE")
    sft_train_on_prompt: bool = flag(
        False, "--sft-train-on-prompt",
        "with --sft: the loss covers every token of a conversation, not only the assistant's")
    sft_packing: bool = flag(
        True, "--no-sft-packing",
        "with --sft: one conversation per sequence, padded, instead of packing several whole "
        "conversations into each", negate=True)
    sft_skip_bad_rows: bool = flag(
        False, "--sft-skip-bad-rows",
        "with --sft: skip and count rows that are not a conversation the template renders, "
        "instead of stopping at the first with its file and row")

    def __post_init__(self) -> None:
        # Megatron-LM's HuggingFaceTokenizer takes a model's directory: the
        # tokenizer.json inside it is the file every reader here opens.
        model = self.tokenizer_model
        if self.tokenizer_type == "HuggingFaceTokenizer" and isinstance(model, str) and model \
                and (Path(model) / "tokenizer.json").is_file():
            self.tokenizer_model = str(Path(model) / "tokenizer.json")

    @property
    def uses_demo_corpus(self) -> bool:
        return not self.mock_data and not self.data_path


def data_loading_problems(data: DataConfig) -> list[str]:
    """--num-workers, --no-mmap-bin-files."""
    problems = []
    workers = data.num_workers
    if not is_count(workers, 0):
        problems.append(f"--num-workers={workers!r} must be 0 (read in the training process) or a "
                        "positive number of background processes")
    if not isinstance(data.mmap_bin_files, bool):
        problems.append(f"--no-mmap-bin-files: mmap_bin_files={data.mmap_bin_files!r} must be true "
                        "or false")
    if data.mock_data:
        problems.extend(_unused_tokenizer_file_problems(data))
    return problems + sft_flag_problems(data)


def sft_flag_problems(data: DataConfig) -> list[str]:
    """--sft's companions without it, and what --sft cannot take."""
    if not data.sft:
        given = [name for name, on in (("--chat-template", data.chat_template is not None),
                                       ("--sft-train-on-prompt", data.sft_train_on_prompt),
                                       ("--no-sft-packing", not data.sft_packing),
                                       ("--sft-skip-bad-rows", data.sft_skip_bad_rows)) if on]
        return [f"{name} is a setting of --sft (fine-tuning on conversations); give --sft or drop "
                f"{name}" for name in given]
    problems = []
    if data.mock_data:
        problems.append("--sft trains on conversation files and --mock-data on generated tokens; "
                        "drop one")
    elif not data.data_path:
        problems.append("--sft needs --data-path: a JSON lines (.jsonl) or Parquet (.parquet) file "
                        "of conversations, or weight-file pairs to blend (0.7 A.jsonl 0.3 B.jsonl)")
    if data.eod_mask_loss:
        problems.append("--eod-mask-loss does not apply to --sft, whose loss mask covers the "
                        "assistant's tokens (all tokens with --sft-train-on-prompt); drop it")
    if data.tokenizer_type != "HuggingFaceTokenizer":
        problems.append(f"--sft renders conversations with a Hugging Face tokenizer and its chat "
                        f"template, not {data.tokenizer_type}: give --tokenizer-type "
                        "HuggingFaceTokenizer --tokenizer-model DIR/tokenizer.json (or --load a "
                        "checkpoint that carries its tokenizer)")
    return problems


def _unused_tokenizer_file_problems(data: DataConfig) -> list[str]:
    """With --mock-data no tokenizer reads its files, so a path that names
    nothing would pass silently; Megatron-LM builds the tokenizer even then
    and fails. A path that is there is left alone (scripts pass it)."""
    from pathlib import Path

    problems = []
    for name, flag_name in (("tokenizer_model", "--tokenizer-model"), ("vocab_file", "--vocab-file"),
                            ("merge_file", "--merge-file")):
        path = getattr(data, name)
        if isinstance(path, str) and path and not Path(path).exists():
            problems.append(f"{flag_name} {path}: no such file or directory; with --mock-data no "
                            f"tokenizer is used (generated data are token ids), so fix the path "
                            f"or drop {flag_name}")
    return problems
