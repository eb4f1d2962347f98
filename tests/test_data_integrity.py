"""Data that is wrong is never trusted (issue 30, items 5 and 6):

- a `.bin` or `.idx` cut short while training reads it is an error naming
  the file, not a SIGBUS that kills the process without a word (both with
  memory-mapped files and with --no-mmap-bin-files);
- `ptdp preprocess` records the tokenizer beside each dataset
  (PREFIX.tokenizer-record.json) and `ptdp train` refuses data whose recorded
  tokenizer is not the run's; data without a record (Megatron-LM's) trains
  as before;
- a JSON line with a lone surrogate is reported by file and line;
- --split with --mock-data: a malformed one is refused, a valid one is said
  to do nothing (Megatron-LM replaces it with 1,1,1 under mock data).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ptdp.cli import main
from ptdp.commands.train import _mock_data_notes
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed import IndexedDataset, IndexedDatasetError, write_documents
from ptdp.data.loader import check_data_settings, tokenizer_record_problems
from ptdp.data.preprocess import TokenizerSpec, preprocess
from ptdp.data.tokenizer import build_tokenizer, dump_vocab_and_merges, load_gpt2_ranks
from ptdp.data.tokenizer_record import describe, mismatch, read_record, record_path
from ptdp.errors import RankFailure

TRAIN = ["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "1", "--split", "98,2,0"]


# --------------------------------------------------------------------------- a file cut short

@pytest.fixture
def dataset_files(tmp_path) -> str:
    prefix = str(tmp_path / "data")
    write_documents(prefix, [np.arange(i, i + 300) % 250 for i in range(400)])
    return prefix


@pytest.mark.parametrize("mapped", [True, False], ids=["mmap", "no-mmap-bin-files"])
def test_a_bin_truncated_between_two_reads_names_the_file(dataset_files, mapped):
    dataset = IndexedDataset(dataset_files, mmap_bin_files=mapped)
    first = dataset.get(len(dataset) - 1).copy()
    os.truncate(dataset_files + ".bin", os.path.getsize(dataset_files + ".bin") // 2)
    with pytest.raises(IndexedDatasetError) as caught:
        dataset.get(len(dataset) - 1)  # past the new end: SIGBUS through the map, unchecked
    message = str(caught.value)
    assert message.startswith(f"{dataset_files}.bin: 120,000 bytes now, 240,000 when training "
                              "opened it: the file was truncated")
    assert "resume from the last checkpoint with --load" in message
    assert first[0] == (len(dataset) - 1) % 250
    # A user error: one paragraph, no traceback, from whichever rank reads it.
    assert RankFailure.from_exception(1, caught.value).user_error


def test_an_idx_truncated_while_training_names_it(dataset_files):
    dataset = IndexedDataset(dataset_files)
    os.truncate(dataset_files + ".idx", 100)
    with pytest.raises(IndexedDatasetError, match=r"data\.idx: 100 bytes now, .* truncated"):
        dataset.get(0)


_READ_AFTER_THE_CUT = """
import sys
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed import IndexedDataset, IndexedDatasetError
prefix, cache = sys.argv[1:]
indexed = IndexedDataset(prefix)
samples = GPTDataset(indexed, prefix, range(len(indexed)), split_name="train", num_samples=50,
                     seq_length=32, seed=1, cache_dir=cache)
assert samples[0].shape == (33,)
with open(prefix + ".bin", "r+b") as file:
    file.truncate(1000)
try:
    for i in range(len(samples)):
        samples[i]
except IndexedDatasetError as error:
    print(error)
"""


def test_a_sample_read_after_the_cut_names_the_file(dataset_files, tmp_path):
    """Through the GPT dataset and its memory map, as a training rank reads:
    in a process of its own, which a SIGBUS would kill (exit -7, no word)."""
    result = subprocess.run([sys.executable, "-c", _READ_AFTER_THE_CUT, dataset_files,
                             str(tmp_path / "cache")], capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.startswith(f"{dataset_files}.bin: 1,000 bytes now, 240,000 when "
                                    "training opened it")


def test_a_file_replaced_by_rename_is_not_a_change(dataset_files):
    """Rewriting by rename (as `ptdp preprocess` does) leaves the opened file
    as it was: reading it on is right."""
    dataset = IndexedDataset(dataset_files)
    write_documents(dataset_files, [[1, 2, 3]])
    assert list(dataset.get(1)[:3]) == [1, 2, 3]


# --------------------------------------------------------------------------- the tokenizer record

def _corpus(tmp_path) -> Path:
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i}: " + "some words here. " * 6})
                              + "\n" for i in range(120)))
    return source


@pytest.fixture(scope="module")
def byte_level_data(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("bytes")
    preprocess([_corpus(directory)], directory / "b", "ByteLevelTokenizer", progress=False)
    return str(directory / "b_text_document")


def _problems(prefix: str, tokenizer_type: str, vocab_size: int, **files) -> list[str]:
    config = Config(data=DataConfig(data_path=[prefix], tokenizer_type=tokenizer_type, **files),
                    model=ModelConfig(vocab_size=vocab_size))
    return tokenizer_record_problems(config, [prefix])


def test_preprocess_records_the_tokenizer(byte_level_data):
    record = read_record(byte_level_data)
    assert record["tokenizer_type"] == "ByteLevelTokenizer"
    assert (record["vocab_size"], record["eod"]) == (257, 256)
    assert record["data"]["bin_bytes"] == os.path.getsize(byte_level_data + ".bin")
    assert record_path(byte_level_data) == byte_level_data + ".tokenizer-record.json"


def test_byte_level_data_is_refused_as_gpt2_tokens(byte_level_data):
    (problem,) = _problems(byte_level_data, "GPT2BPETokenizer", 50257)
    assert problem.startswith(f"--data-path {byte_level_data}: it was tokenized with the "
                              "ByteLevelTokenizer (257 tokens), but this run's tokenizer is the "
                              "GPT2BPETokenizer (50,257 tokens)")
    assert "--tokenizer-type ByteLevelTokenizer" in problem
    assert _problems(byte_level_data, "ByteLevelTokenizer", 257) == []


def test_null_tokenizer_compares_the_ids_only(byte_level_data):
    assert _problems(byte_level_data, "NullTokenizer", 257) == []   # --vocab-size 256
    (problem,) = _problems(byte_level_data, "NullTokenizer", 301)
    assert "--tokenizer-type NullTokenizer --vocab-size 300" in problem
    assert "give --vocab-size 256" in problem


def test_the_refusal_comes_before_launch(no_launch, capsys, byte_level_data):
    assert main([*TRAIN, "--data-path", byte_level_data]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and "its token ids would stand for other text" in err


def test_one_tokenizer_given_two_ways_is_the_same(tmp_path):
    """GPT-2's shipped ranks and its vocab.json + merges.txt give every id
    the same meaning: the vocabulary, not the files, is compared."""
    ranks = load_gpt2_ranks()
    vocab, merges = dump_vocab_and_merges(ranks, len(ranks), tmp_path)
    shipped = describe(build_tokenizer("GPT2BPETokenizer"), "GPT2BPETokenizer", {})
    files = {"vocab_file": str(vocab), "merge_file": str(merges)}
    given = describe(build_tokenizer("GPT2BPETokenizer", **files), "GPT2BPETokenizer", files)
    assert set(given["files"]) == {"--vocab-file", "--merge-file"}
    assert mismatch(shipped, given) is None and mismatch(given, shipped) is None
    byte_level = describe(build_tokenizer("ByteLevelTokenizer"), "ByteLevelTokenizer", {})
    assert mismatch(byte_level, shipped) is not None


def test_data_without_a_record_trains_as_before(tmp_path):
    prefix = str(tmp_path / "megatron")
    write_documents(prefix, [list(range(200))] * 20)   # as Megatron-LM writes it: .bin, .idx
    assert not os.path.exists(record_path(prefix))
    assert _problems(prefix, "GPT2BPETokenizer", 50257) == []


def test_a_damaged_record_is_refused(tmp_path, byte_level_data):
    prefix = str(tmp_path / "copy")
    for suffix in (".bin", ".idx"):
        Path(prefix + suffix).write_bytes(Path(byte_level_data + suffix).read_bytes())
    Path(record_path(prefix)).write_text('{"format": 1, "tokenizer_type": ')
    (problem,) = _problems(prefix, "ByteLevelTokenizer", 257)
    assert problem.startswith(f"--data-path {prefix}: its tokenizer record "
                              f"{prefix}.tokenizer-record.json cannot be read")
    assert f"or delete {prefix}.tokenizer-record.json" in problem


def test_a_record_beside_rewritten_data_is_not_believed(tmp_path):
    preprocess([_corpus(tmp_path)], tmp_path / "d", "ByteLevelTokenizer", progress=False)
    prefix = str(tmp_path / "d_text_document")
    write_documents(prefix, [list(range(200))] * 20)   # another tool writes the same prefix
    (problem,) = _problems(prefix, "ByteLevelTokenizer", 257)
    assert "describes other data than" in problem and "rewritten since by another tool?" in problem


def test_preprocessing_again_replaces_the_record(tmp_path):
    source = _corpus(tmp_path)
    preprocess([source], tmp_path / "d", "ByteLevelTokenizer", progress=False)
    preprocess([source], tmp_path / "d", TokenizerSpec("GPT2BPETokenizer"), progress=False)
    prefix = str(tmp_path / "d_text_document")
    assert read_record(prefix)["tokenizer_type"] == "GPT2BPETokenizer"
    assert _problems(prefix, "GPT2BPETokenizer", 50257) == []
    assert len(_problems(prefix, "ByteLevelTokenizer", 257)) == 1


# --------------------------------------------------------------------------- preprocess input

@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_lone_surrogate_is_reported_by_file_and_line(tmp_path, capsys, workers):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "fine"}\n\n{"text": "cut \\ud83d here"}\n')
    assert main(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "out"),
                 "--tokenizer-type", "ByteLevelTokenizer", "--workers", workers]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error: bad input, nothing written:")
    assert f"{source}:3: 'text' holds a lone surrogate, the escape \\ud83d at character 4" in err
    assert "write the whole pair" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_whole_surrogate_pair_is_a_character(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "smile \\ud83d\\ude00"}\n')
    result = preprocess([source], tmp_path / "out", "ByteLevelTokenizer", progress=False)
    assert result["tokens"] == len("smile 😀".encode("utf-8"))


# --------------------------------------------------------------------------- --split, --mock-data

def test_a_split_with_mock_data_is_said_to_do_nothing():
    config = Config(data=DataConfig(mock_data=True, split="98,2,0"))
    assert check_data_settings(config) == []
    (note,) = _mock_data_notes(config, ["data.mock_data", "data.split"])
    assert note == ("ptdp: --split 98,2,0 has no effect with --mock-data: generated data has no "
                    "splits (validation reads other generated sequences); Megatron-LM ignores it "
                    "there too")
    assert _mock_data_notes(config, ["data.mock_data"]) == []   # the default, not given


def test_a_malformed_split_with_mock_data_is_not_silent(no_launch, capsys):
    """Accepted, as Megatron-LM accepts it there (its llama3_8b.sh passes
    --split "'99,1,0'" with --mock-data), but said, before launch: ignored
    now, refused with real data."""
    with pytest.raises(AssertionError, match="a training process was started"):
        main([*TRAIN[:-2], "--vocab-size", "512", "--mock-data", "--split", "abc"])
    out = capsys.readouterr().out
    assert "ptdp: --split abc has no effect with --mock-data" in out
    assert ("With --data-path it would be refused: --split 'abc': proportions must be numbers, "
            "e.g. --split 949,50,1, or 98,2,0 for no test data, or 1 for train only") in out


def test_a_rank_killed_by_sigbus_is_explained():
    """The read the size check cannot cover (a cut between the check and the
    read) still ends in SIGBUS: the launcher's report says what it means."""
    import signal

    from ptdp.launch import _describe_exit

    said = _describe_exit(-signal.SIGBUS)
    assert said.startswith("killed by SIGBUS: most likely a memory-mapped file was cut short")
    assert "--data-path" in said and _describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
