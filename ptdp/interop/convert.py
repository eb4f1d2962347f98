"""`ptdp convert`: checkpoints to and from Hugging Face GPT-2 and Llama directories.

    ptdp convert --load CKPT --to-hf DIR      # config.json + model.safetensors
    ptdp convert --from-hf DIR --save CKPT    # a model-only ptdp checkpoint

Both directions work on logical tensors, so the checkpoint's training layout
does not matter; an imported model trains or generates under any layout.
Import reads the architecture from config.json; export picks it from the
checkpoint's settings (GPT-2 for the defaults, Llama for RMSNorm + SwiGLU
+ rotary embeddings). A tokenizer.json travels both ways; export writes the
checkpoint's tokenizer in the form AutoTokenizer reads (hf_tokenizer.py).
Nothing of the Hugging Face directory is trusted: config.json is checked
against the weight files' headers before anything is built from it, every
weight must be floating point and finite (hf_weights.py), and the
tokenizer.json must load and fit the model before it is carried.
Hugging Face stores each norm's plain scale: export of an --apply-layernorm-1p
checkpoint writes 1 + w, and `--from-hf DIR --save CKPT --apply-layernorm-1p`
imports scale - 1 for training with that flag.
"""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

from ptdp.config import Config, ConfigError, DataConfig, TrainConfig
from ptdp.interop import hf_gpt2, hf_llama
from ptdp.interop.hf_files import ConversionError, hf_tokenizer_file, read_hf_config
from ptdp.interop.hf_tokenizer import exported_tokenizer, imported_tokenizer_ids
# The flags live in a module without torch (the command line builds them at every start).
from ptdp.interop.convert_flags import add_convert_parser  # noqa: F401

# Hugging Face class and model_type of each architecture ptdp converts. The
# bare models (GPT2Model, LlamaModel) are read too: their keys lack the prefix.
ARCHITECTURES: dict[str, tuple[ModuleType, tuple[str, ...], str]] = {
    "GPT-2": (hf_gpt2, ("GPT2LMHeadModel", "GPT2Model"), "gpt2"),
    "Llama": (hf_llama, ("LlamaForCausalLM", "LlamaModel"), "llama"),
}
_OBSTACLES = {"GPT-2": hf_gpt2.gpt2_obstacles, "Llama": hf_llama.llama_obstacles}


def run_convert_command(args: argparse.Namespace) -> int:
    exporting, importing = bool(args.load or args.to_hf), bool(args.from_hf or args.save)
    if exporting == importing or (exporting and not (args.load and args.to_hf)) \
            or (importing and not (args.from_hf and args.save)):
        raise ConfigError(["give either --load CKPT --to-hf DIR (export) or --from-hf DIR "
                           "--save CKPT (import)"])
    one_plus = getattr(args, "apply_layernorm_1p", False)
    if exporting and one_plus:
        raise ConfigError(["--apply-layernorm-1p is for --from-hf: an exported checkpoint's norms "
                           "follow its own setting, and the Hugging Face files get plain scales"])
    try:
        if exporting:
            return _export(args.load, args.to_hf)
        return _import(args.from_hf, args.save, one_plus)
    except ConversionError as error:
        raise ConfigError([str(error)]) from None


# ------------------------------------------------------------------ which architecture

def architecture_of_hf_config(hf_config: dict[str, Any], source: str) -> str:
    """"GPT-2" or "Llama", from config.json's `architectures` and
    `model_type`; a config with neither is GPT-2's oldest form."""
    classes = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if not isinstance(classes, list):
        classes = [classes]
    if not classes and model_type is None:
        return "GPT-2"  # the oldest GPT-2 config.json names neither
    for name, (_, known_classes, known_type) in ARCHITECTURES.items():
        if all(c in known_classes for c in classes) and model_type in (known_type, None):
            return name
    supported = "; ".join(f"{' or '.join(classes_)} (model_type {type_!r})"
                          for _, classes_, type_ in ARCHITECTURES.values())
    raise ConversionError(f"{source}: architectures {classes} with model_type {model_type!r} is "
                          f"not an architecture ptdp converts; supported: {supported}")


def architecture_of_model(model) -> str:
    """"GPT-2" or "Llama" for a ModelConfig; refuses a mixture of both,
    listing what keeps it from each."""
    obstacles = {name: find(model) for name, find in _OBSTACLES.items()}
    fitting = [name for name, found in obstacles.items() if not found]
    if fitting:
        return fitting[0]
    raise ConversionError(
        "this checkpoint's model is neither a GPT-2 nor a Llama, so Hugging Face has no class for "
        "it:\n" + "\n".join(f"  - not {name}: {'; '.join(found)}"
                             for name, found in obstacles.items()))


# ------------------------------------------------------------------ directions

def _export(load: str, directory: str) -> int:
    from ptdp.data.tokenizer import TokenizerError
    from ptdp.train.checkpoint import CheckpointError, load_logical_model

    try:
        config, weights, metadata = load_logical_model(load)
        model = config.model
        architecture = architecture_of_model(model)
        tokenizer = exported_tokenizer(config, load)
    except (CheckpointError, TokenizerError) as error:
        raise ConfigError([str(error)]) from None
    specials = tokenizer.specials
    if architecture == "Llama":
        hf_llama.save_hf_directory(directory, weights, model, bos_token_id=specials.bos_id,
                                   eos_token_id=specials.eos_id, tokenizer_files=tokenizer.files)
    else:
        hf_gpt2.save_hf_directory(directory, weights, model, eod_token_id=specials.eos_id,
                                  tokenizer_files=tokenizer.files)
    hf_class = ARCHITECTURES[architecture][1][0]
    print(f"wrote {directory}: {hf_class} ({model.num_layers} layers, hidden "
          f"{model.hidden_size}) from iteration {metadata['iteration']}, {tokenizer.note}")
    return 0


def _import(directory: str, save: str, apply_layernorm_1p: bool = False) -> int:
    from ptdp.train.checkpoint import CheckpointError, save_logical_model

    architecture = architecture_of_hf_config(read_hf_config(directory), directory)
    module = ARCHITECTURES[architecture][0]
    tokenizer_file = hf_tokenizer_file(directory)
    # Parsed before the weights are read (which takes long for a large model).
    tokenizer_ids = imported_tokenizer_ids(tokenizer_file) if tokenizer_file is not None else 0
    model, weights = module.load_hf_directory(directory, apply_layernorm_1p=apply_layernorm_1p)
    if tokenizer_ids > model.vocab_size:
        raise ConversionError(f"{tokenizer_file} has {tokenizer_ids} token ids, more than the "
                              f"model's vocabulary of {model.vocab_size} (vocab_size in "
                              f"config.json, the word embedding's rows): it is another model's "
                              f"tokenizer; use the model's own, or move the file out of the "
                              f"directory to import the model without a tokenizer")
    if tokenizer_file is not None:
        # The checkpoint carries the file; its metadata names it, and
        # training and generation take it from there.
        data = DataConfig(tokenizer_type="HuggingFaceTokenizer")
    elif architecture == "GPT-2" and model.vocab_size == hf_gpt2.GPT2_VOCAB:
        data = DataConfig()  # GPT-2's vocabulary implies GPT-2's tokenizer, which ptdp ships
    else:
        data = DataConfig(mock_data=True)
    # Training settings are the run's business.
    config = Config(model=model, train=TrainConfig(), data=data)
    try:
        path = save_logical_model(save, config, weights, tokenizer_file=tokenizer_file)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    note = ""
    if tokenizer_file is not None:
        note = " (with its tokenizer.json)"
    elif data.mock_data:
        note = (" (no tokenizer.json in the directory: give the data and tokenizer flags when "
                "training, and token ids to generate, e.g. --prompt-ids 1,2,3)")
    print(f"wrote {path}: {architecture}, {model.num_layers} layers, hidden {model.hidden_size}, "
          f"vocabulary {model.vocab_size}; train or generate with --load {save}{note}")
    return 0
