"""`ptdp convert`: checkpoints to and from Hugging Face GPT-2 directories.

    ptdp convert --load CKPT --to-hf DIR      # config.json + model.safetensors
    ptdp convert --from-hf DIR --save CKPT    # a model-only ptdp checkpoint

Both directions work on logical tensors, so the checkpoint's training layout
does not matter; an imported model trains or generates under any layout.
"""

from __future__ import annotations

import argparse

from ptdp.config import Config, ConfigError, DataConfig, TrainConfig
from ptdp.interop.hf_gpt2 import ConversionError, load_hf_directory, save_hf_directory


def add_convert_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert", help="convert checkpoints to or from Hugging Face GPT-2",
        description="Export a checkpoint as a Hugging Face GPT2LMHeadModel directory "
                    "(--load CKPT --to-hf DIR), or import one (--from-hf DIR --save CKPT).")
    parser.add_argument("--load", metavar="CKPT", help="ptdp checkpoint to export")
    parser.add_argument("--to-hf", metavar="DIR", help="new Hugging Face directory to write")
    parser.add_argument("--from-hf", metavar="DIR", help="Hugging Face GPT-2 directory to import "
                        "(config.json + model.safetensors)")
    parser.add_argument("--save", metavar="CKPT", help="where to write the imported checkpoint")


def run_convert_command(args: argparse.Namespace) -> int:
    exporting, importing = bool(args.load or args.to_hf), bool(args.from_hf or args.save)
    if exporting == importing or (exporting and not (args.load and args.to_hf)) \
            or (importing and not (args.from_hf and args.save)):
        raise ConfigError(["give either --load CKPT --to-hf DIR (export) or --from-hf DIR "
                           "--save CKPT (import)"])
    try:
        if exporting:
            return _export(args.load, args.to_hf)
        return _import(args.from_hf, args.save)
    except ConversionError as error:
        raise ConfigError([str(error)]) from None


def _export(load: str, directory: str) -> int:
    from ptdp.data.loader import tokenizer_for
    from ptdp.train.checkpoint import CheckpointError, load_logical_model

    try:
        config, weights, metadata = load_logical_model(load)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    eod = None if config.data.mock_data else tokenizer_for(config.data).eod
    save_hf_directory(directory, weights, config.model, eod_token_id=eod)
    print(f"wrote {directory}: GPT2LMHeadModel ({config.model.num_layers} layers, hidden "
          f"{config.model.hidden_size}) from iteration {metadata['iteration']}")
    return 0


def _import(directory: str, save: str) -> int:
    from ptdp.train.checkpoint import save_logical_model

    model, weights = load_hf_directory(directory)
    # Training settings are the run's business; the data settings default to
    # GPT-2's tokenizer, which a GPT-2 vocabulary implies.
    data = DataConfig() if model.vocab_size == 50257 else DataConfig(mock_data=True)
    config = Config(model=model, train=TrainConfig(), data=data)
    path = save_logical_model(save, config, weights)
    print(f"wrote {path}: {model.num_layers} layers, hidden {model.hidden_size}, vocabulary "
          f"{model.vocab_size}; train or generate with --load {save}"
          + ("" if model.vocab_size == 50257 else " (not GPT-2's vocabulary: give the data and "
             "tokenizer flags when training)"))
    return 0

