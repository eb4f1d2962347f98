"""`ptdp preprocess`: its flags, and its run, which reports what
ptdp.data.preprocess wrote (imported when the command runs)."""

from __future__ import annotations

import argparse
import os
import sys

from ptdp.data.tokenizer import TEXT_TOKENIZER_TYPES, TokenizerError


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `preprocess` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "preprocess", help="tokenize text into Megatron-LM indexed datasets (.bin/.idx)",
        description="Tokenize plain-text files (one document each) or JSON lines (one document "
                    "per line) into PREFIX_{key}_document.bin/.idx, Megatron-LM's indexed "
                    "dataset format, one dataset per JSON key, documents in input order.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="plain-text files, or JSON lines (.jsonl, .json)")
    parser.add_argument("--output-prefix", required=True, metavar="P",
                        help="writes P_{key}_document.bin and .idx")
    parser.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TEXT_TOKENIZER_TYPES,
                        help="(default: GPT2BPETokenizer)")
    parser.add_argument("--vocab-file", metavar="FILE", help="GPT-2 style vocab.json")
    parser.add_argument("--merge-file", metavar="FILE", help="GPT-2 style merges.txt")
    parser.add_argument("--tokenizer-model", metavar="FILE",
                        help="tokenizer.json for HuggingFaceTokenizer; tokenizer.model for "
                        "Llama2Tokenizer and SentencePieceTokenizer; the tiktoken JSON vocabulary "
                        "for TikTokenizer")
    parser.add_argument("--tiktoken-pattern", choices=("v1", "v2"),
                        help="TikTokenizer's splitting pattern")
    parser.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, metavar="N",
                        help="TikTokenizer's special ids 0..N-1 (default: 1000)")
    parser.add_argument("--tokenizer-special-tokens", nargs="+", metavar="TOKEN",
                        help="TikTokenizer's named special tokens (default: <unk> <s> </s>)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every non-empty document with the end-of-document token")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="processes that encode (default: all cores)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="keys of the texts in JSON lines, one dataset each (default: text)")
    return parser


def run(args: argparse.Namespace) -> int:
    from ptdp.data import tokenizer_record
    from ptdp.data.indexed import IndexedDatasetError, data_file_path, index_file_path
    from ptdp.data.preprocess import (PreprocessError, TokenizerSpec, output_prefix_for_key,
                                      preprocess)
    from ptdp.data.tiktoken_tokenizer import TiktokenSettings

    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                         TiktokenSettings.of(args))
    workers = args.workers if args.workers is not None else (os.cpu_count() or 1)
    print(f"ptdp: tokenizing {' '.join(args.input)} with the {args.tokenizer_type} into "
          f"{args.output_prefix}_* ({workers} worker{'s' if workers > 1 else ''}) ...", flush=True)
    try:
        result = preprocess(args.input, args.output_prefix, spec, json_keys=args.json_keys,
                            append_eod=args.append_eod, workers=workers)
    except (PreprocessError, TokenizerError, IndexedDatasetError) as error:
        print(f"ptdp: error: {error}", file=sys.stderr)
        return 2
    seconds = result["seconds"]
    print(f"{result['documents']:,} documents, {result['tokens']:,} {result['dtype']} tokens in "
          f"{seconds:.1f} s ({result['tokens'] / max(seconds, 1e-9) / 1e6:.2f} M tokens/s, "
          f"{result['input_bytes'] / max(seconds, 1e-9) / 1e6:.1f} MB/s, "
          f"{result['workers']} worker{'s' if result['workers'] > 1 else ''})")
    for key in args.json_keys:
        prefix = output_prefix_for_key(args.output_prefix, key)
        print(f"wrote {data_file_path(prefix)} and {index_file_path(prefix)} (and "
              f"{tokenizer_record.record_path(prefix)}, its tokenizer)")
    return 0
