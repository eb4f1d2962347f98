"""The tokenizer travels with a checkpoint: `save_logical_model(...,
tokenizer_file=)` and training runs with a Hugging Face tokenizer store it
as tokenizer.json (sha256 in the metadata); `checkpoint_tokenizer` returns
it, checked; `ptdp train --load` without tokenizer flags and `ptdp generate`
use it, and a chain of resumes keeps it."""

import json
from pathlib import Path

import pytest
import torch

from ptdp.cli import main
from ptdp.config import Config, ConfigError, DataConfig, ModelConfig
from ptdp.checkpoint.data_settings import model_tokenizer, resolve_data
from ptdp.data.preprocess import TokenizerSpec, preprocess
from ptdp.data.tokenizer import build_tokenizer, train_tokenizer
from ptdp.interop.logical import logical_shapes
from ptdp.checkpoint.store import (CheckpointError, checkpoint_tokenizer, load_logical_model,
                                   read_metadata, resolve, save_logical_model)

TEXT = "".join(f"the {animal} sat on the mat number {i}. "
               for i, animal in enumerate(["cat", "dog", "bird"] * 30))
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--make-vocab-size-divisible-by", "8", "--split", "1,0,0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(tokenizer.json, data prefix): a small BPE and a corpus it tokenized."""
    folder = tmp_path_factory.mktemp("hf-corpus")
    (folder / "corpus.txt").write_text(TEXT)
    tokenizer = train_tokenizer([folder / "corpus.txt"], 300, folder / "tokenizer")["tokenizer_model"]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": TEXT[i:i + 200]}) + "\n"
                                                 for i in range(0, len(TEXT), 200)))
    preprocess([folder / "corpus.jsonl"], folder / "corpus",
               TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=tokenizer), append_eod=True,
               progress=False)
    return Path(tokenizer), str(folder / "corpus_text_document")


def _model_only(save: Path, vocab: int, tokenizer_file=None) -> Path:
    model = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8,
                        vocab_size=vocab)
    weights = {name: torch.zeros(shape) for name, shape in logical_shapes(model).items()}
    return save_logical_model(save, Config(model=model, data=DataConfig(
        tokenizer_type="HuggingFaceTokenizer")), weights, tokenizer_file=tokenizer_file)


# --------------------------------------------------------------------------- the contract

def test_save_logical_model_carries_the_tokenizer(tmp_path, corpus):
    tokenizer, _ = corpus
    directory = _model_only(tmp_path / "ckpt", 300, tokenizer)
    metadata = read_metadata(directory)
    assert metadata["tokenizer"] == "tokenizer.json"
    assert set(metadata["files"]) == {"part-pp0-tp0.safetensors", "tokenizer.json"}
    for load in (tmp_path / "ckpt", directory):  # SAVE (through latest) or the iter_* directory
        carried = checkpoint_tokenizer(load)
        assert carried == directory / "tokenizer.json"
        assert carried.read_bytes() == tokenizer.read_bytes()


def test_a_checkpoint_without_a_tokenizer_is_as_before(tmp_path):
    directory = _model_only(tmp_path / "ckpt", 300)
    metadata = read_metadata(directory)
    assert "tokenizer" not in metadata and list(metadata["files"]) == ["part-pp0-tp0.safetensors"]
    assert checkpoint_tokenizer(tmp_path / "ckpt") is None
    with pytest.raises(CheckpointError, match="no-such.json: no such file"):
        _model_only(tmp_path / "other", 300, tmp_path / "no-such.json")


def test_a_damaged_or_missing_tokenizer_is_refused(tmp_path, corpus, capsys):
    tokenizer, _ = corpus
    directory = _model_only(tmp_path / "ckpt", 300, tokenizer)
    carried = directory / "tokenizer.json"
    carried.write_text(carried.read_text().replace("<|endoftext|>", "<|endoftexx|>"))
    with pytest.raises(CheckpointError, match="tokenizer.json: sha256 differs from metadata.json; "
                                              "the file is damaged"):
        checkpoint_tokenizer(directory)
    assert main(["generate", "--load", str(directory), "--prompt", "the cat"]) == 2
    assert "tokenizer.json: sha256 differs" in capsys.readouterr().err
    config = Config.from_dict({"train": {"load": str(directory)}})
    with pytest.raises(ConfigError, match="sha256 differs .* or name a tokenizer "
                                          r"\(--tokenizer-type and its files\)"):
        resolve_data(config, ["train.load"])
    carried.unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        checkpoint_tokenizer(directory)


# --------------------------------------------------------------------------- resolution

def test_the_carried_tokenizer_must_fit_the_model(tmp_path, corpus):
    tokenizer, _ = corpus
    size = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer).vocab_size
    # An imported model's embedding may have more rows than its tokenizer has tokens.
    larger = _model_only(tmp_path / "larger", size + 20, tokenizer)
    config = resolve_data(Config.from_dict({"train": {"load": str(larger)}}), ["train.load"])
    assert config.model.vocab_size == size + 20
    assert config.data.tokenizer_type == "HuggingFaceTokenizer"
    assert Path(config.data.tokenizer_model) == (larger / "tokenizer.json").absolute()
    with pytest.raises(ConfigError, match=f"--vocab-size=7 disagrees with the vocabulary of "
                                          f"--load {larger}'s model, {size + 20}"):
        resolve_data(Config.from_dict({"train": {"load": str(larger)}, "model": {"vocab_size": 7}}),
                     ["train.load", "model.vocab_size"])
    smaller = _model_only(tmp_path / "smaller", size - 1, tokenizer)
    with pytest.raises(ConfigError, match=f"the tokenizer the checkpoint carries has {size} tokens, "
                                          f"more than its model's vocabulary of {size - 1}"):
        resolve_data(Config.from_dict({"train": {"load": str(smaller)}}), ["train.load"])
    # Explicit tokenizer flags take the place of the carried tokenizer, and must fit.
    with pytest.raises(ConfigError, match=f"its model has a vocabulary of {size - 1} tokens, but the "
                                          "ByteLevelTokenizer .* has 257; the checkpoint carries its "
                                          "tokenizer: drop the tokenizer flags"):
        resolve_data(Config.from_dict({"train": {"load": str(smaller)},
                                       "data": {"tokenizer_type": "ByteLevelTokenizer"}}),
                     ["train.load", "data.tokenizer_type"])
    # --mock-data has no tokenizer: the carried one is not looked at.
    mock = resolve_data(Config.from_dict({"train": {"load": str(smaller)},
                                          "data": {"mock_data": True}}), ["train.load"])
    assert mock.data.tokenizer_model is None


def test_generate_uses_the_carried_tokenizer(tmp_path, corpus):
    tokenizer, _ = corpus
    directory = _model_only(tmp_path / "ckpt", 300, tokenizer)
    config, _, _ = load_logical_model(directory)
    carried = model_tokenizer(config, directory)
    assert carried.encode("the cat sat") == \
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer).encode("the cat sat")


# --------------------------------------------------------------------------- training

def test_a_chain_of_resumes_keeps_the_tokenizer(tmp_path, corpus, capsys):
    tokenizer, prefix = corpus
    save = tmp_path / "ckpt"
    flags = [*MODEL, "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"),
             "--save", str(save)]
    assert main(["train", *flags, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(tokenizer), "--train-iters", "2"]) == 0
    first = resolve(save)
    assert checkpoint_tokenizer(save).read_bytes() == tokenizer.read_bytes()
    # No tokenizer flags: the checkpoint's tokenizer, carried on; --keep-last 1
    # prunes the checkpoint the run resumed from.
    for iterations in ("3", "4"):
        assert main(["train", *flags, "--load", str(save), "--keep-last", "1",
                     "--train-iters", iterations, "--use-checkpoint-opt_param-scheduler"]) == 0
    assert not first.exists() and resolve(save).name == "iter_0000004"
    assert checkpoint_tokenizer(save).read_bytes() == tokenizer.read_bytes()
    metadata = read_metadata(resolve(save))
    assert metadata["config"]["data"]["tokenizer_type"] == "HuggingFaceTokenizer"
    assert metadata["config"]["data"]["tokenizer_model"] is None  # the carried file is it
    capsys.readouterr()
    # Generation decodes with it: text is the decoded ids.
    sampling = ["--prompt", "the cat", "--max-new-tokens", "5", "--temperature", "0"]
    assert main(["generate", "--load", str(save), *sampling, "--output-ids"]) == 0
    ids = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    assert main(["generate", "--load", str(save), *sampling]) == 0
    text = capsys.readouterr().out
    carried = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer)
    assert text == carried.decode(carried.encode("the cat") + ids) + "\n"  # prompt echoed first
    # Explicit tokenizer flags win, and one that does not fit the model is refused.
    assert main(["train", *flags, "--load", str(save), "--tokenizer-type", "ByteLevelTokenizer",
                 "--train-iters", "5"]) == 2
    assert "but the ByteLevelTokenizer (--tokenizer-type and its files) has 257" in \
        capsys.readouterr().err


def test_runs_without_a_hugging_face_tokenizer_carry_none(tmp_path, capsys):
    save = tmp_path / "ckpt"
    assert main(["train", "--mock-data", "--vocab-size", "32", *MODEL, "--train-iters", "1",
                 "--save", str(save)]) == 0
    assert checkpoint_tokenizer(save) is None and "tokenizer" not in read_metadata(resolve(save))
