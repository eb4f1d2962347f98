"""Megatron-LM's Llama2Tokenizer, SentencePieceTokenizer and TikTokenizer
(issue 27, item 7): the ids Megatron-LM gives (its end of document, its
added special tokens, its vocabulary size), checked against sentencepiece's
own encoding of a tiny model trained here and tiktoken's encoding of a tiny
vocabulary file built here; and they work for `ptdp preprocess`, the
tokenizer record that training checks, and decoding."""

from __future__ import annotations

import base64
import io
import json

import pytest

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.data.loader import tokenizer_for, tokenizer_record_problems
from ptdp.data.preprocess import TokenizerSpec, preprocess
from ptdp.data.tiktoken_tokenizer import TiktokenSettings
from ptdp.data.tokenizer import TokenizerError, build_tokenizer
from ptdp.data.tokenizer_record import read_record

spm = pytest.importorskip("sentencepiece")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a tiny corpus.",
         "Shakespeare wrote plays; the plays were good, and the words were many."]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    """A 64-piece BPE SentencePiece model (unk 0, bos 1, eos 2, no pad), trained here."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 10), model_writer=model,
                                   vocab_size=64, model_type="bpe", minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return str(path)


def test_llama2_tokenizer_is_sentencepiece_with_a_leading_bos(sp_model):
    reference = spm.SentencePieceProcessor(model_file=sp_model)
    tokenizer = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert (tokenizer.vocab_size, tokenizer.eod) == (64, reference.eos_id()) == (64, 2)
    for text in TEXTS + ["", "unseen wörds"]:
        assert tokenizer.encode(text) == [1] + reference.encode(text)
    assert tokenizer.encode_batch(TEXTS[:2]) == [tokenizer.encode(t) for t in TEXTS[:2]]
    assert tokenizer.decode(tokenizer.encode(TEXTS[0])) == TEXTS[0]


def test_sentencepiece_tokenizer_adds_megatrons_special_tokens(sp_model):
    reference = spm.SentencePieceProcessor(model_file=sp_model)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    # <CLS> 64, <SEP> 65, <EOD> 66, <MASK> 67, <PAD> 68 (the model has no pad);
    # the model's own <s> (1) and </s> (2) are its bos and eos.
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.bos) == (69, 66, 1)
    assert tokenizer.encode(TEXTS[1]) == reference.encode(TEXTS[1])
    text = "Hello<EOD> world</s><MASK>"
    assert tokenizer.encode(text) == (reference.encode("Hello") + [66] + reference.encode(" world")
                                      + [2, 67])
    assert tokenizer.decode(tokenizer.encode("Hello<EOD>world")) == "Hello <EOD> world"


def test_a_model_without_eos_is_refused_for_llama2(tmp_path):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 10), model_writer=model,
                                   vocab_size=40, model_type="bpe", minloglevel=2, eos_id=-1)
    path = tmp_path / "no-eos.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(TokenizerError, match="no end-of-sentence piece, which --tokenizer-type "
                                             "Llama2Tokenizer needs"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=str(path))
    assert build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(path)).vocab_size == 40 + 6  # + <EOS>


def _tiktoken_file(path, merges=(b"th", b"the", b" the", b"he", b"ll", b"llo")) -> str:
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("latin-1")} for i, t in enumerate(tokens)]))
    return str(path)


def test_tiktokenizer_ids_are_megatrons(tmp_path):
    import tiktoken

    path = _tiktoken_file(tmp_path / "vocab.json")
    settings = TiktokenSettings("v2", num_special_tokens=8)
    tokenizer = build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken=settings)
    # Specials <unk> 0, <s> 1, </s> 2, <SPECIAL_3>..<SPECIAL_7>; rank r is id 8 + r.
    assert (tokenizer.vocab_size, tokenizer.eod) == (8 + 262, 2)
    text = "hello the other</s>"
    ids = tokenizer.encode(text)
    assert ids[:2] == [8 + 259, 8 + 261]  # "he", "llo"
    assert 8 + 258 in ids and 2 not in ids     # " the"; </s> stays text
    # The reference: tiktoken itself on the file's ranks and the v2 pattern.
    from ptdp.data.tiktoken_tokenizer import TIKTOKEN_PATTERNS

    entries = json.loads(open(path).read())
    reference = tiktoken.Encoding("ref", pat_str=TIKTOKEN_PATTERNS["v2"], mergeable_ranks={
        base64.b64decode(e["token_bytes"]): e["rank"] for e in entries}, special_tokens={})
    assert ids == [8 + i for i in reference.encode_ordinary(text)]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([2]) == "</s>"
    named = build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken=TiktokenSettings(
        "v1", 4, ("<s>", "<unk>", "<pad>", "</s>")))
    assert (named.eod, named.vocab_size) == (3, 4 + 262)


@pytest.mark.parametrize("settings, message", [
    (TiktokenSettings(None), "needs --tiktoken-pattern v1 or v2"),
    (TiktokenSettings("v1", 2), "--tiktoken-num-special-tokens=2 must be at least the 3"),
    (TiktokenSettings("v1", 10, ("<s>", "</s>")), "must include <unk>"),
])
def test_tiktokenizer_settings_are_checked(tmp_path, settings, message):
    path = _tiktoken_file(tmp_path / "vocab.json")
    with pytest.raises(TokenizerError, match=message):
        build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken=settings)


def test_a_bad_tiktoken_file_is_refused(tmp_path):
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps([{"rank": 1, "token_bytes": "AA==", "token_str": ""}]))
    with pytest.raises(TokenizerError, match="not Megatron-LM's tiktoken vocabulary .* entry 0 "
                                             "has rank 1"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(path), tiktoken=TiktokenSettings("v1"))


def test_preprocess_record_and_training_check(sp_model, tmp_path):
    """`ptdp preprocess` with Llama2Tokenizer writes Megatron-LM's ids (bos,
    text, eod) and a record that the same tokenizer passes and the
    SentencePieceTokenizer on the same model does not."""
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "d"),
                 "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp_model,
                 "--append-eod", "--workers", "1"]) == 0
    prefix = str(tmp_path / "d_text_document")
    from ptdp.data.indexed import IndexedDataset

    reference = spm.SentencePieceProcessor(model_file=sp_model)
    assert list(IndexedDataset(prefix).get(0)) == [1] + reference.encode(TEXTS[0]) + [2]
    assert read_record(prefix)["tokenizer_type"] == "Llama2Tokenizer"

    def problems(tokenizer_type, vocab):
        config = Config(data=DataConfig(data_path=[prefix], tokenizer_type=tokenizer_type,
                                        tokenizer_model=sp_model),
                        model=ModelConfig(vocab_size=vocab))
        return tokenizer_record_problems(config, [prefix])

    assert problems("Llama2Tokenizer", 64) == []
    refused = problems("SentencePieceTokenizer", 69)
    assert len(refused) == 1 and "tokenized with the Llama2Tokenizer (64 tokens" in refused[0]


def test_tiktoken_settings_reach_preprocess_and_training(tmp_path):
    path = _tiktoken_file(tmp_path / "vocab.json")
    source = tmp_path / "corpus.txt"
    source.write_text("hello the world")
    spec = TokenizerSpec("TikTokenizer", tokenizer_model=path,
                         tiktoken=TiktokenSettings("v2", 8))
    preprocess([source], tmp_path / "t", spec, progress=False)
    prefix = str(tmp_path / "t_text_document")
    data = DataConfig(data_path=[prefix], tokenizer_type="TikTokenizer", tokenizer_model=path,
                      tiktoken_pattern="v2", tiktoken_num_special_tokens=8)
    assert tokenizer_for(data).vocab_size == 270
    config = Config(data=data, model=ModelConfig(vocab_size=270))
    assert tokenizer_record_problems(config, [prefix]) == []


def test_train_flags_need_the_model_file():
    with pytest.raises(TokenizerError, match="--tokenizer-type Llama2Tokenizer needs "
                                             "--tokenizer-model PATH \\(its SentencePiece"):
        build_tokenizer("Llama2Tokenizer")
