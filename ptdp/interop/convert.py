"""`ptdp convert`: checkpoints to and from Hugging Face directories.

    ptdp convert --load CKPT --to-hf DIR      # config.json + model.safetensors
    ptdp convert --from-hf DIR --save CKPT    # a model-only ptdp checkpoint

Both directions work on logical tensors, so the checkpoint's training layout
does not matter; an imported model trains or generates under any layout.
The families are the table hf_directory.HF_FAMILIES: import reads
config.json's `architectures` and `model_type` and picks the family that
lists them; export writes the first family whose obstacles (what its class
cannot express) are none for the checkpoint's settings: GPT-2 for the defaults;
for RMSNorm + SwiGLU + rotary embeddings, Qwen3 with --qk-layernorm, Qwen2
with --add-qkv-bias and no other biases, else Llama (a Mistral directory
imports as such a model, and exports as a Llama: the same architecture).
A tokenizer.json travels both ways; export writes the checkpoint's
tokenizer in the form AutoTokenizer reads (hf_tokenizer.py). An imported
model keeps the rest of what its directory says of its use (chat template,
special tokens, generation_config.json, config.json's bos/eos/pad ids:
hf_carried.py), through training too, and its export writes them back.
Every output is checked before anything is read or converted (a path that
cannot be written, a --to-hf directory that is not empty, a --save another
job holds), and a failed write (a full disk) leaves nothing half-written.
Nothing of the Hugging Face directory is trusted: config.json is checked
against the weight files' headers before anything is built from it, every
weight must be floating point and finite (hf_weights.py), and the
tokenizer.json must load and fit the model before it is carried.
Hugging Face stores each norm's plain scale: export of an --apply-layernorm-1p
checkpoint writes 1 + w, and `--from-hf DIR --save CKPT --apply-layernorm-1p`
imports scale - 1 for training with that flag.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from safetensors import SafetensorError

from ptdp.checkpoint import lock as save_lock
from ptdp.checkpoint.carry import checkpoint_hf_files
from ptdp.checkpoint.lock import SaveDirectoryInUse
from ptdp.checkpoint.store import (CheckpointError, load_logical_model, resolve,
                                   save_inside_a_checkpoint, save_logical_model)
from ptdp.config import Config, ConfigError, DataConfig, TrainConfig
from ptdp.data.tokenizer import TokenizerError
from ptdp.interop.hf_carried import exported_files, read_carried_files, source_token_ids
from ptdp.interop.hf_directory import (family_for_export, family_for_import, load_hf_directory,
                                       save_hf_directory)
from ptdp.interop.hf_files import (ConversionError, export_directory_problem, hf_tokenizer_file,
                                   read_hf_config)
from ptdp.interop.hf_gpt2 import GPT2, GPT2_VOCAB
from ptdp.interop.hf_tokenizer import exported_tokenizer, imported_tokenizer
from ptdp.output_paths import output_path_problems


def output_problems(output: str, exporting: bool) -> list[str]:
    """Why the command's output cannot be written: the shared check of every
    output path (ptdp.output_paths: a link to nothing, /proc, a file where
    the directory goes, a directory nobody may write), then an export's
    directory that is not empty, or an import's --save that is a checkpoint
    or that a training job holds."""
    flag = "--to-hf" if exporting else "--save"
    problems = output_path_problems(flag, output, directory=True)
    if problems:
        return problems
    if exporting:
        problem = export_directory_problem(output)
        return [f"{flag} {problem}"] if problem else []
    return [problem for problem in (save_inside_a_checkpoint(output), save_lock.problem(output))
            if problem]


def _missing_directories(path: str) -> list[Path]:
    """`path` and the directories above it that do not exist yet, deepest
    first: what a write makes, and what a failed one removes again."""
    missing, current = [], Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return missing


def _remove_empty(directories: list[Path]) -> None:
    for directory in directories:  # deepest first; a directory someone filled meanwhile stays
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue  # never made (the write failed before), or removed with the partial output
        except OSError:
            return


def _write_failure(error: Exception) -> str | None:
    """What the system said when a write failed (an OSError, or safetensors'
    error carrying one's code: "(os error 28)"); None for any other error,
    which is a bug."""
    if isinstance(error, OSError):
        file = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror or error}{file}"
    code = re.search(r"\(os error (\d+)\)", str(error))
    return os.strerror(int(code.group(1))) if code else None


def _write_failed(flag: str, output: str, what: str, failure: str) -> ConfigError:
    return ConfigError([f"{flag} {output}: writing the {what} failed: {failure}. Nothing of it "
                        f"was kept; free space there (or choose another {flag}) and convert "
                        f"again"])


# ------------------------------------------------------------------ directions

def export_to_hf(load: str, directory: str) -> int:
    try:
        config, weights, metadata = load_logical_model(load)
        if config.lora.enabled:
            raise CheckpointError(f"--load {resolve(load)} holds LoRA adapters, not a model: "
                                  f"write them for peft with --to-hf-peft DIR, or merge them into "
                                  f"their base first (--merge-lora --save CKPT) and export that")
        model = config.model
        family = family_for_export(model)
        tokenizer = exported_tokenizer(config, load)
    except (CheckpointError, TokenizerError) as error:
        raise ConfigError([str(error)]) from None
    try:
        carried = checkpoint_hf_files(resolve(load), metadata)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    specials = tokenizer.specials
    made = _missing_directories(directory)
    try:
        save_hf_directory(directory, weights, model, bos_token_id=specials.bos_id,
                          eos_token_id=specials.eos_id,
                          tokenizer_files=exported_files(tokenizer.files, carried,
                                                         model.vocab_size),
                          token_ids=source_token_ids(carried, model.vocab_size,
                                                     tokenizer.files.get("tokenizer.json")))
    except (OSError, SafetensorError) as error:  # its temporary directory is gone already
        failure = _write_failure(error)
        if failure is None:
            raise
        _remove_empty(made)
        raise _write_failed("--to-hf", directory, "Hugging Face directory", failure) from None
    hf_class = family.classes[0]
    kept = [f"{name}'s token ids" if name == "config.json" else name for name in sorted(carried)]
    kept = f"; kept from the original: {', '.join(kept)}" if kept else ""
    print(f"wrote {directory}: {hf_class} ({model.num_layers} layers, hidden "
          f"{model.hidden_size}) from iteration {metadata['iteration']}, {tokenizer.note}{kept}")
    return 0


def import_from_hf(directory: str, save: str, apply_layernorm_1p: bool = False) -> int:
    hf_config = read_hf_config(directory)
    family = family_for_import(hf_config, directory)
    tokenizer_file = hf_tokenizer_file(directory)
    # Parsed before the weights are read (which takes long for a large model).
    tokenizer_ids, vocab = (imported_tokenizer(tokenizer_file) if tokenizer_file is not None
                            else (0, None))
    carried = read_carried_files(directory, vocab, hf_config.get("vocab_size"))
    model, weights = load_hf_directory(directory, apply_layernorm_1p=apply_layernorm_1p)
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
    elif family is GPT2 and model.vocab_size == GPT2_VOCAB:
        data = DataConfig()  # GPT-2's vocabulary implies GPT-2's tokenizer, which ptdp ships
    else:
        data = DataConfig(mock_data=True)
    # Training settings are the run's business.
    config = Config(model=model, train=TrainConfig(), data=data)
    path = save_checkpoint(save, config, weights, tokenizer_file=tokenizer_file, hf_files=carried)
    kept = [name for name in ("tokenizer.json" if tokenizer_file else None, *sorted(carried))
            if name not in (None, "config.json")]  # (its token ids are kept too)
    with_files = f" (with its {', '.join(kept)})" if kept else ""
    print(f"wrote {path}: {family.name}, {model.num_layers} layers, hidden {model.hidden_size}, "
          f"vocabulary {model.vocab_size}{with_files}; "
          f"{_next_steps(save, data, tokenizer_file is not None)}")
    return 0


def save_checkpoint(save: str, config: Config, weights: dict, **options) -> Path:
    """save_logical_model(save, config, weights, **options), its failures
    one paragraph each: a --save another job took since the check, or a
    write that failed (a full disk), which leaves nothing behind."""
    made = _missing_directories(save)
    try:
        return save_logical_model(save, config, weights, **options)
    except (CheckpointError, SaveDirectoryInUse) as error:  # (held since the check: a race)
        raise ConfigError([str(error)]) from None
    except (OSError, SafetensorError) as error:  # the partial checkpoint is gone already
        failure = _write_failure(error)
        if failure is None:
            raise
        _remove_empty(made)
        raise _write_failed("--save", save, "checkpoint", failure) from None


def _next_steps(save: str, data: DataConfig, has_tokenizer: bool) -> str:
    """What to run after an import. The checkpoint holds the model alone:
    --use-checkpoint-args takes its model settings (and its tokenizer), the
    run gives the data and the length of training."""
    load = shlex.quote(save)
    train = f"train with: ptdp train --load {load} --use-checkpoint-args --train-iters N"
    if data.mock_data:
        return (f"{train} --mock-data (no tokenizer.json in the directory: for real data give "
                f"--data-path and the tokenizer flags instead of --mock-data; generate with "
                f"ptdp generate --load {load} --prompt-ids 1,2,3)")
    tokenizer = "its tokenizer.json" if has_tokenizer else "GPT-2's tokenizer"
    return (f"{train} --data-path PREFIX (data preprocessed with {tokenizer}; or --mock-data); "
            f"generate with ptdp generate --load {load} --prompt TEXT")
