"""`ptdp convert --to-hf` writes the tokenizer the checkpoint was trained
with, so that `AutoTokenizer.from_pretrained(DIR)` gives ptdp's ids and
decodes them back to the text; models without text say so. The export,
like a checkpoint, gets the modes the user's umask gives."""

import json
import os

import pytest
import torch

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.data.corpus import read_works
from ptdp.data.tokenizer import build_tokenizer, dump_vocab_and_merges, load_gpt2_ranks
from ptdp.interop.logical import logical_shapes
from ptdp.checkpoint.store import save_logical_model

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world", " leading space and  double  spaces\n\n\ttabs  \n",
         "naïve café — “quotes”, emoji 🎭 and 日本語", "I'll've you're'd 1234567 3.14159",
         "trailing whitespace run   \t\n"]


def _checkpoint(tmp_path, vocab_size: int, data: DataConfig):
    """A model-only checkpoint of a tiny GPT-2 whose run used `data`."""
    model = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=16,
                        vocab_size=vocab_size)
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator)
               for name, shape in logical_shapes(model).items()}
    save = tmp_path / "ckpt"
    save_logical_model(save, Config(model=model, data=data), weights)
    return save


def _export(save, directory, capsys):
    assert main(["convert", "--load", str(save), "--to-hf", str(directory)]) == 0
    return capsys.readouterr().out


def _assert_same_ids_and_text(auto, ours):
    for text in TEXTS:
        ids = ours.encode(text)
        assert auto.encode(text) == ids, text  # adds no bos/eos, as ptdp's
        assert auto.encode(text, add_special_tokens=False) == ids, text
        assert auto.decode(ids) == text
    # Documents joined by the end-of-document token, as preprocessing writes them.
    eod = ours.eod
    assert auto.eos_token_id == auto.bos_token_id == eod
    joined = auto.eos_token.join(TEXTS[:2])
    assert auto.encode(joined) == ours.encode(TEXTS[0]) + [eod] + ours.encode(TEXTS[1])
    assert auto.decode(auto.encode(joined)) == joined


@pytest.mark.parametrize("form", ["shipped ranks", "vocab and merges"])
def test_gpt2_tokenizer_round_trips_through_auto_tokenizer(tmp_path, capsys, form):
    data = DataConfig()
    if form == "vocab and merges":
        vocab_file, merge_file = dump_vocab_and_merges(load_gpt2_ranks(), 50256, tmp_path / "bpe")
        data = DataConfig(vocab_file=str(vocab_file), merge_file=str(merge_file))
    export = tmp_path / "hf"
    out = _export(_checkpoint(tmp_path, 50257, data), export, capsys)
    assert "(tokenizer.json, vocab.json, merges.txt)" in out
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"} <= {
        p.name for p in export.iterdir()}
    auto = transformers.AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    assert len(auto) == 50257 and auto.eos_token == "<|endoftext|>"
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=data.vocab_file, merge_file=data.merge_file)
    assert auto.encode("Hello world") == [15496, 995]
    _assert_same_ids_and_text(auto, ours)
    config = json.loads((export / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 50256
    if form == "shipped ranks":
        play = read_works()[0][1][:20000]  # a long text of the demo corpus too
        assert auto.encode(play) == ours.encode(play) and auto.decode(ours.encode(play)) == play
        # the written vocab.json + merges.txt are GPT-2's too
        from_files = build_tokenizer("GPT2BPETokenizer", vocab_file=str(export / "vocab.json"),
                                     merge_file=str(export / "merges.txt"))
        assert [from_files.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]


def test_byte_level_tokenizer_round_trips_through_auto_tokenizer(tmp_path, capsys):
    export = tmp_path / "hf"
    out = _export(_checkpoint(tmp_path, 257, DataConfig(tokenizer_type="ByteLevelTokenizer")),
                  export, capsys)
    assert "byte-level tokenizer" in out
    auto = transformers.AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    assert len(auto) == 257
    _assert_same_ids_and_text(auto, build_tokenizer("ByteLevelTokenizer"))


@pytest.mark.parametrize("data, vocab_size, eos", [
    (DataConfig(mock_data=True), 64, None),
    (DataConfig(tokenizer_type="NullTokenizer"), 65, 64),
], ids=["mock-data", "NullTokenizer"])
def test_models_without_text_export_without_a_tokenizer(tmp_path, capsys, data, vocab_size, eos):
    export = tmp_path / "hf"
    out = _export(_checkpoint(tmp_path, vocab_size, data), export, capsys)
    assert "no tokenizer: the model was trained on" in out and "give it token ids" in out
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == eos


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_export_follows_the_umask(tmp_path, capsys, mask):
    save = _checkpoint(tmp_path, 257, DataConfig(tokenizer_type="ByteLevelTokenizer"))
    previous = os.umask(mask)
    try:
        _export(save, tmp_path / "hf", capsys)
    finally:
        os.umask(previous)
    paths = [tmp_path / "hf", *(tmp_path / "hf").iterdir()]
    assert {p.name for p in paths} >= {"hf", "model.safetensors", "tokenizer.json"}
    for path in paths:
        expected = (0o777 if path.is_dir() else 0o666) & ~mask
        assert path.stat().st_mode & 0o777 == expected, (path.name, oct(path.stat().st_mode))
