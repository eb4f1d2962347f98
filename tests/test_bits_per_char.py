"""Bits per character on the validation set (issue 18): Σ loss / ln 2 over
the labels counted in the loss, divided by the characters they decode to.

The character table (per token id its UTF-8 characters, end of document 0)
is checked against each text tokenizer's own decoding; the evaluated figure
against one computed here from the one-process model's per-token losses; a
parallel layout against one process (rtol 1e-5, as tests/test_evaluate.py:
the layouts reorder floating-point sums). Generated data has no text and so
no figure; the log line and the metrics file show it.
"""

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.data.loader import TrainingData, character_table, collate
from ptdp.data.microbatch import split_microbatch
from ptdp.data.tokenizer import (ByteTokenizer, NullTokenizer, build_tokenizer, character_counts,
                                 train_tokenizer)
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.evaluate import evaluate
from ptdp.train.loop import Trainer
from ptdp.train.report import TENSORBOARD_TAGS, format_log_line

# ASCII and text of 2, 3 and 4 UTF-8 bytes per character, so that tokens per
# character differ from sample to sample.
# Short documents, so that the evaluated windows cross several boundaries.
DOCUMENTS = [
    "To be, or not to be: that is the question.\n",
    "Ελληνικά: ἐν ἀρχῇ ἦν ὁ λόγος. Naïve café, “quoted” — déjà vu.\n",
    "東京タワーの夜景、桜の花びら。😀🎭 emoji and 漢字 mixed.\n",
]
EOD = ByteTokenizer.eod
MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=ByteTokenizer.vocab_size, make_vocab_size_divisible_by=2,
                    hidden_dropout=0.0, attention_dropout=0.0)
B, EVAL_ITERS = 8, 2


# ---------------------------------------------------------------- the character table

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Every text tokenizer kind: raw bytes, GPT-2 (tiktoken), and a trained
    byte-level BPE read as tokenizer.json and as vocab.json + merges.txt."""
    folder = tmp_path_factory.mktemp("bpe")
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(DOCUMENTS) * 5, encoding="utf-8")
    paths = train_tokenizer([corpus], 400, folder / "tokenizer")
    return [ByteTokenizer(), build_tokenizer("GPT2BPETokenizer"),
            build_tokenizer("HuggingFaceTokenizer", tokenizer_model=paths["tokenizer_model"]),
            build_tokenizer("GPT2BPETokenizer", vocab_file=paths["vocab_file"],
                            merge_file=paths["merge_file"])]


def test_character_counts_sum_to_the_decoded_length(tokenizers):
    text = "".join(DOCUMENTS)
    for tokenizer in tokenizers:
        counts = character_counts(tokenizer)
        assert len(counts) == tokenizer.vocab_size and counts[tokenizer.eod] == 0
        ids = tokenizer.encode(text)
        assert len(ids) != len(text)  # tokens are not characters: the count is not trivial
        assert sum(counts[i] for i in ids) == len(tokenizer.decode(ids)) == len(text), tokenizer.name
        # Documents joined by the end-of-document token: it adds no characters.
        joined = ids + [tokenizer.eod] + ids
        assert sum(counts[i] for i in joined) == 2 * len(text)
        # A piece cut inside a multi-byte character still adds up: the token
        # holding a character's first byte counts it.
        assert sum(counts[i] for i in ids[:len(ids) // 2]) + sum(
            counts[i] for i in ids[len(ids) // 2:]) == len(text)


def test_no_count_without_an_exact_one(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    assert character_counts(NullTokenizer(100)) is None
    # A WordPiece tokenizer's decoder joins pieces with spaces it invents: not byte-level.
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "to": 1, "##be": 2, "<|endoftext|>": 3},
                                           unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    assert character_counts(tokenizer) is None
    # The table pads the model's larger vocabulary with zeros.
    table = character_table(ByteTokenizer(), 300)
    assert table.shape == (300,) and table[256:].sum() == 0
    assert table[ord("a")] == 1 and table[0xE6] == 1 and table[0x80] == table[0xBF] == 0


# ---------------------------------------------------------------- the evaluated figure

def _windows(seed: int) -> np.ndarray:
    """[B·EVAL_ITERS, s + 1] byte tokens: the documents (each ending in the
    end-of-document token) in a shuffled order, cut into windows that share
    their boundary token, as GPTDataset cuts them."""
    order = np.random.default_rng(seed).permutation(len(DOCUMENTS) * 6) % len(DOCUMENTS)
    stream = [t for k in order for t in list(DOCUMENTS[k].encode("utf-8")) + [EOD]]
    s = MODEL.seq_length
    assert len(stream) > B * EVAL_ITERS * s
    return np.array([stream[i * s:i * s + s + 1] for i in range(B * EVAL_ITERS)], dtype=np.int64)


def _data() -> TrainingData:
    return TrainingData(train=_windows(1), valid=_windows(2), eod=EOD, description="bytes",
                        characters=character_table(ByteTokenizer(), MODEL.vocab_size))


def _config(t=1, p=1, d=1, k=None, schedule="1f1b", sp=False, eod_mask_loss=True, per_token=False):
    return Config(model=MODEL,
                  parallel=ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                          data_parallel_size=d, num_layers_per_virtual_pipeline_stage=k,
                                          pipeline_schedule=schedule, sequence_parallel=sp),
                  train=TrainConfig(micro_batch_size=1, global_batch_size=B, train_iters=2, lr=1e-2,
                                    seed=17, eval_iters=EVAL_ITERS,
                                    calculate_per_token_loss=per_token),
                  data=DataConfig(mock_data=True, eod_mask_loss=eod_mask_loss))


def _trained(config: Config, ctx: ParallelContext) -> Trainer:
    """One training step, so the losses are no longer near-uniform ln V."""
    trainer = Trainer(config, ctx, torch.device("cpu"), data=_data())
    trainer.step(0)
    return trainer


def _by_hand(trainer: Trainer, eod_mask_loss: bool) -> float:
    """Σ per-token loss / ln 2 / Σ characters, from the one-process model's
    logits: cross entropy over the real vocabulary of each label kept by
    the loss mask, and each kept label's characters (bytes that start one)."""
    model, dataset = trainer.chunks[0], trainer.data.valid
    model.eval()
    nats, chars = 0.0, 0
    with torch.no_grad():
        for sample in range(B * EVAL_ITERS):
            batch = split_microbatch(collate(dataset, range(sample, sample + 1), MODEL.vocab_size),
                                     EOD, eod_mask_loss)
            logits = model(batch[0])[:, 0, :MODEL.vocab_size]       # [s, V], padding left out
            losses = F.cross_entropy(logits.double(), batch[1][0], reduction="none")
            kept = batch[2][0].bool() if eod_mask_loss else torch.ones_like(losses, dtype=torch.bool)
            nats += losses[kept].sum().item()
            chars += sum(1 for b in batch[1][0][kept].tolist() if b != EOD and not 0x80 <= b <= 0xBF)
    model.train()
    return nats / math.log(2) / chars


@pytest.mark.parametrize("eod_mask_loss,per_token", [(False, False), (True, False), (True, True)],
                         ids=["all-labels", "eod-mask-loss", "per-token-loss"])
def test_one_process_equals_the_hand_computation(eod_mask_loss, per_token):
    trainer = _trained(_config(eod_mask_loss=eod_mask_loss, per_token=per_token),
                       ParallelContext.single())
    result = evaluate(trainer, trainer.data.valid, EVAL_ITERS)
    assert result["bits_per_char"] == pytest.approx(_by_hand(trainer, eod_mask_loss), rel=1e-5)
    # Not the loss per token in bits: the byte tokens of non-ASCII text are
    # more than its characters.
    assert result["bits_per_char"] > 1.2 * result["loss"] / math.log(2)


# Four ranks (a pool of eight takes long to start on a small machine): tensor
# and sequence parallel with interleaving; data parallel (the character
# sums are reduced like the loss) with zbv, whose rank 0 reads each
# microbatch twice (first and last stage).
PARALLEL = {"t2p2-interleaved-sp": dict(t=2, p=2, k=1, sp=True),
            "p2d2-zbv": dict(p=2, d=2, schedule="zbv")}


def _parallel(rank, layout):
    sizes = PARALLEL[layout]
    ctx = ParallelContext.build(RankGrid(tp=sizes.get("t", 1), dp=sizes.get("d", 1), pp=2))
    trainer = _trained(_config(**PARALLEL[layout]), ctx)
    return trainer.holds_loss, evaluate(trainer, trainer.data.valid, EVAL_ITERS)


@pytest.mark.parametrize("layout", list(PARALLEL))
def test_parallel_layout_equals_one_process(pools, layout):
    trainer = _trained(_config(), ParallelContext.single())
    want = evaluate(trainer, trainer.data.valid, EVAL_ITERS)
    results = pools(4).run(_parallel, layout)
    assert sum(holds for holds, _ in results) == 2  # t·d ranks compute the loss
    for holds, got in results:
        if holds:
            assert got["bits_per_char"] == pytest.approx(want["bits_per_char"], rel=1e-5)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        else:
            assert got == {"loss": None, "perplexity": None}


def test_generated_data_has_no_figure():
    trainer = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))  # --mock-data
    assert trainer.data.characters is None
    assert "bits_per_char" not in evaluate(trainer, trainer.data.valid, 1)


# ---------------------------------------------------------------- what the user sees

def test_log_line_and_tensorboard_tag():
    record = {"iteration": 10, "consumed_samples": 160, "loss": 2.5, "lr": 3e-3, "grad_norm": 0.75,
              "iteration_ms": 123.45, "tokens_per_s": 8300.2, "val_loss": 2.6,
              "val_perplexity": math.exp(2.6), "val_bits_per_char": 2.5123}
    assert "| val loss 2.6000 (ppl 13.46, 2.512 bits/char) |" in format_log_line(record, 40)
    assert TENSORBOARD_TAGS["val_bits_per_char"] == "valid/bits_per_char"


def test_training_run_reports_bits_per_char(tmp_path, capsys):
    """`ptdp train` on the demo corpus with the byte tokenizer: the log line
    and the metrics file carry the figure where validation ran. (One
    process: through ptdp's entry point in this process, no launch.)"""
    from ptdp.cli import main

    metrics = tmp_path / "metrics.jsonl"
    command = ["train", "--tokenizer-type", "ByteLevelTokenizer",
               "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
               "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
               "--log-interval", "1", "--metrics-file", str(metrics)]
    capsys.readouterr()
    status = main(command)
    result = capsys.readouterr()
    assert status == 0, result.out + result.err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert "val_bits_per_char" not in records[0]
    value = records[1]["val_bits_per_char"]
    # Shakespeare is ASCII: one byte token per character, so bits/char is
    # about the loss per token in bits (the end-of-document tokens aside).
    assert value == pytest.approx(records[1]["val_loss"] / math.log(2), rel=0.02)
    printed = re.findall(r"val loss (\d+\.\d+) \(ppl [\d.]+, (\d+\.\d+) bits/char\)", result.out)
    assert printed == [(f"{records[1]['val_loss']:.4f}", f"{value:.4g}")]
