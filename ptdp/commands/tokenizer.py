"""`ptdp tokenizer train`: its flags, and its run, which trains a
byte-level BPE with ptdp.data.tokenizer (imported when the command runs)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("tokenizer", help="tokenizer tools (train a byte-level BPE)")
    actions = parser.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    train = actions.add_parser("train", help="train a GPT-2 style byte-level BPE on text files",
                               description="Train a byte-level BPE (GPT-2's pre-tokenisation) on "
                               "text files and write tokenizer.json, vocab.json and merges.txt.")
    train.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text files")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="tokens in the vocabulary, including 256 bytes and <|endoftext|>")
    train.add_argument("--output", required=True, metavar="DIR", help="directory for the files")
    train.add_argument("--min-frequency", type=int, default=2, metavar="N",
                       help="merges seen fewer times are not learned (default: 2)")


def run(args: argparse.Namespace) -> int:
    from ptdp.data.tokenizer import build_tokenizer, train_tokenizer

    paths = train_tokenizer(args.input, args.vocab_size, args.output, min_frequency=args.min_frequency)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=paths["tokenizer_model"])
    print(f"trained a byte-level BPE of {tokenizer.vocab_size} tokens (end of document: "
          f"{tokenizer.eod}); use it with\n"
          f"  --tokenizer-type HuggingFaceTokenizer --tokenizer-model {paths['tokenizer_model']}\n"
          f"or\n  --tokenizer-type GPT2BPETokenizer --vocab-file {paths['vocab_file']} "
          f"--merge-file {paths['merge_file']}")
    return 0
