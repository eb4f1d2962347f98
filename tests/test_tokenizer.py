"""Tokenizers: GPT-2's exact BPE (shipped ranks, and the vocab.json +
merges.txt form giving the same ids), `ptdp tokenizer train`, bytes."""

import shutil

import pytest

from ptdp.cli import main
from ptdp.data.corpus import read_works
from ptdp.data.tokenizer import (GPT2_RANKS_FILE, TokenizerError, build_tokenizer,
                                 dump_vocab_and_merges, load_gpt2_ranks)

SAMPLES = ["Hello world", "", " leading space and  double  spaces\n\n\ttabs",
           "naïve café — “quotes” and emoji 🎭 and 日本語", "I'll've you're'd 1234567 3.14159",
           "<|endoftext|> is ordinary text here"]


@pytest.fixture(scope="module")
def works():
    return read_works()


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """GPT-2's ranks written as vocab.json + merges.txt (the Megatron form)."""
    return dump_vocab_and_merges(load_gpt2_ranks(), 50256, tmp_path_factory.mktemp("gpt2"))


def test_gpt2_known_ids():
    tokenizer = build_tokenizer("GPT2BPETokenizer")
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert tokenizer.vocab_size == 50257 and tokenizer.eod == 50256
    # Known GPT-2 ids: " the" and "<|endoftext|>" spelled out stays text.
    assert tokenizer.encode(" the") == [262]
    assert 50256 not in tokenizer.encode("<|endoftext|>")


def test_gpt2_round_trip(works):
    tokenizer = build_tokenizer()
    for text in SAMPLES + [works[0][1][:20000]]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_gpt2_ranks_file_is_checked(tmp_path):
    damaged = tmp_path / "gpt2.tiktoken"
    data = bytearray(GPT2_RANKS_FILE.read_bytes())
    data[100] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match="sha256"):
        load_gpt2_ranks(damaged)
    with pytest.raises(TokenizerError, match="cannot read"):
        load_gpt2_ranks(tmp_path / "missing.tiktoken")


def test_vocab_and_merge_files_give_the_same_ids(gpt2_files, works):
    vocab_file, merge_file = gpt2_files
    files = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    shipped = build_tokenizer("GPT2BPETokenizer")
    assert (files.vocab_size, files.eod) == (50257, 50256)
    for text in SAMPLES + [text for _, text in works[:3]]:
        ids = shipped.encode(text)
        assert files.encode(text) == ids
        assert files.decode(ids) == text


def test_tokenizer_train(tmp_path, works):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(text for _, text in works[:4]), encoding="utf-8")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "1000",
                 "--output", str(out)]) == 0
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=out / "tokenizer.json")
    bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=out / "vocab.json",
                          merge_file=out / "merges.txt")
    assert hf.vocab_size == bpe.vocab_size == 1000
    assert hf.eod == bpe.eod
    text = works[5][1][:5000]
    ids = hf.encode(text)
    assert bpe.encode(text) == ids
    assert hf.decode(ids) == text
    # A learned BPE compresses: far fewer tokens than bytes.
    assert len(ids) < 0.5 * len(text.encode())
    for sample in SAMPLES[:5]:  # unseen characters fall back to bytes
        assert hf.decode(hf.encode(sample)) == sample


def test_byte_level():
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    assert tokenizer.vocab_size == 257 and tokenizer.eod == 256
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert ids == list(text.encode()) and tokenizer.decode(ids + [256]) == text


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokenizer_type="SentencePiece"), "is not one of"),
    (dict(vocab_file="v.json"), "needs --merge-file"),
    (dict(merge_file="m.txt"), "needs --vocab-file"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "needs --tokenizer-model"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="nope.json"), "no such file"),
    (dict(tokenizer_type="ByteLevelTokenizer", vocab_file="v.json"), "takes no tokenizer files"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(TokenizerError, match=message):
        build_tokenizer(**kwargs)


def test_a_models_directory_is_its_tokenizer_json_as_in_megatron_lm(tmp_path):
    """HuggingFaceTokenizer's --tokenizer-model may be a model's directory
    (Megatron-LM passes it to AutoTokenizer): the tokenizer.json inside it.
    DeepSeek-V3's end of sentence is an end of document. A directory without
    the file, or a hub name (nothing is downloaded), is refused saying so."""
    from tokenizers import Tokenizer, models

    from ptdp.config import DataConfig

    eos = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    Tokenizer(models.WordLevel({"a": 0, eos: 1}, unk_token="a")).save(
        str(tmp_path / "tokenizer.json"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path)
    assert (tokenizer.vocab_size, tokenizer.eod) == (2, 1)
    data = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert data.tokenizer_model == str(tmp_path / "tokenizer.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="the directory has no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tmp_path / "empty")
    with pytest.raises(TokenizerError, match="ptdp downloads nothing"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="deepseek-ai/DeepSeek-V3")


def test_bad_files(tmp_path):
    bogus = tmp_path / "tokenizer.json"
    bogus.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=bogus)
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text('{"a": 0, "b": 1, "ab": 2}')
    merges.write_text("#version: 0.2\na b\n")
    with pytest.raises(TokenizerError, match="no end-of-document token"):
        build_tokenizer(vocab_file=vocab, merge_file=merges)
    merges.write_text("#version: 0.2\na b\nab c\n")
    with pytest.raises(TokenizerError, match="line 3"):
        build_tokenizer(vocab_file=vocab, merge_file=merges)
    vocab.write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="must map each token"):
        build_tokenizer(vocab_file=vocab, merge_file=merges)


def test_train_errors(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text")
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "100",
                 "--output", str(tmp_path / "o")]) == 2
    assert "--vocab-size=100 is below 257" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "1000000000",
                 "--output", str(tmp_path / "o")]) == 2  # once asked for 71 GB, then aborted
    assert "--vocab-size=1,000,000,000 is more than ptdp trains (2,097,152;" in \
        capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(tmp_path / "missing.txt"), "--vocab-size",
                 "300", "--output", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written on a refused run
    shutil.rmtree(tmp_path / "o", ignore_errors=True)
