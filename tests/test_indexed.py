"""Megatron-LM indexed dataset: byte-compatible with Megatron-Core's own files,
zero-copy reads, and a clear error for every way a file can be damaged."""

import json
import mmap
import pickle
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from ptdp.data.indexed import (IndexedDataset, IndexedDatasetError, IndexedDatasetWriter,
                               best_fitting_dtype, data_file_path, index_file_path, write_documents)

# Megatron-Core's own files (written by its IndexedDatasetBuilder; see the
# README next to them), kept in the repository so these tests always run.
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron-indexed"
MEGATRON = FIXTURES / "megatron_gpt2_uint16"


@pytest.fixture(scope="module")
def expected():
    return json.loads(Path(f"{MEGATRON}.expected.json").read_text())


@pytest.fixture
def megatron_copy(tmp_path):
    """A writable copy of Megatron-Core's files: tmp_path/megatron.{bin,idx}."""
    prefix = tmp_path / "megatron"
    for suffix in (".bin", ".idx"):
        shutil.copyfile(f"{MEGATRON}{suffix}", f"{prefix}{suffix}")
        Path(f"{prefix}{suffix}").chmod(0o644)
    return prefix


# ---------------------------------------------------------------- compatibility

def test_reads_megatron_core_files_exactly(expected):
    dataset = IndexedDataset(MEGATRON)
    assert dataset.dtype == np.uint16
    assert len(dataset) == len(expected) == 37 and dataset.num_documents == 37
    assert dataset.document_indices.tolist() == list(range(38))
    assert dataset.num_tokens == sum(map(len, expected))
    for index, document in enumerate(expected):
        assert dataset[index].tolist() == document
        assert dataset.sequence_lengths[index] == len(document)


def test_writer_reproduces_megatron_core_bytes(tmp_path, expected):
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as writer:
        for document in expected:
            writer.add_document(document)
    for path in (data_file_path, index_file_path):
        assert Path(path(tmp_path / "ours")).read_bytes() == Path(path(MEGATRON)).read_bytes()


def test_merge_equals_writing_everything_at_once(tmp_path, expected):
    write_documents(tmp_path / "first", expected[:20])
    with IndexedDatasetWriter(tmp_path / "second") as writer:
        writer.add_sequences_as_document([])  # an empty document survives the merge
        for document in expected[20:]:
            writer.add_document(np.array(document, dtype=np.int64))
    with IndexedDatasetWriter(tmp_path / "merged") as writer:
        writer.merge(tmp_path / "first")
        writer.merge(tmp_path / "second")
    merged = IndexedDataset(tmp_path / "merged")
    assert [merged[i].tolist() for i in range(len(merged))] == expected
    assert merged.num_documents == 38
    assert merged.document_indices.tolist() == list(range(21)) + list(range(20, 38))


def test_merge_refuses_another_dtype(tmp_path):
    write_documents(tmp_path / "wide", [[1, 2]], dtype=np.int32)
    with IndexedDatasetWriter(tmp_path / "narrow", np.uint16) as writer:
        with pytest.raises(IndexedDatasetError, match=r"wide\.idx.*int32.*uint16"):
            writer.merge(tmp_path / "wide")


# ---------------------------------------------------------------- reading

def test_get_is_a_zero_copy_view_of_the_memory_map():
    dataset = IndexedDataset(MEGATRON)
    tokens = dataset.get(5, offset=3, length=7)
    base = tokens
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
    assert not tokens.flags.writeable and not tokens.flags.owndata
    assert tokens.tolist() == dataset[5].tolist()[3:10]
    assert np.shares_memory(tokens, dataset[5])


def test_get_offsets_slices_and_bounds(expected):
    dataset = IndexedDataset(MEGATRON)
    assert dataset.get(0, offset=len(expected[0]) - 2).tolist() == expected[0][-2:]
    assert dataset.get(0, length=0).tolist() == []
    assert dataset[-1].tolist() == expected[-1]
    assert [a.tolist() for a in dataset[2:5]] == expected[2:5]
    for bad in (lambda: dataset[37], lambda: dataset.get(1, offset=len(expected[1]) + 1),
                lambda: dataset.get(1, offset=1, length=len(expected[1]))):
        with pytest.raises(IndexError):
            bad()
    again = pickle.loads(pickle.dumps(dataset))  # reopens from the prefix
    assert again[3].tolist() == expected[3]


def test_best_fitting_dtype_is_megatrons_rule():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(128256) == np.int32


def test_int32_round_trip_for_large_vocabularies(tmp_path):
    vocab_size = 128256
    dtype = best_fitting_dtype(vocab_size)
    documents = [[0, 65535, 65536, vocab_size - 1], [7], list(range(100_000, 100_050))]
    write_documents(tmp_path / "big", documents, dtype=dtype)
    dataset = IndexedDataset(tmp_path / "big")
    assert dataset.dtype == np.int32
    assert Path(index_file_path(tmp_path / "big")).read_bytes()[17] == 4  # Megatron's code for int32
    assert [dataset[i].tolist() for i in range(3)] == documents


def test_tokens_that_do_not_fit_are_refused(tmp_path):
    with IndexedDatasetWriter(tmp_path / "small", np.uint16) as writer:
        writer.add_document([1, 2])
        with pytest.raises(IndexedDatasetError, match=r"small\.bin: document 1: token 70000 at "
                                                      r"position 1 does not fit uint16"):
            writer.add_document([5, 70000])
        with pytest.raises(IndexedDatasetError, match="token -1"):
            writer.add_document([-1])
        with pytest.raises(IndexedDatasetError, match="must be integers"):
            writer.add_document([1.5])
    assert [d.tolist() for d in IndexedDataset(tmp_path / "small")[:]] == [[1, 2]]


def test_several_sequences_per_document_and_empty_documents(tmp_path):
    with IndexedDatasetWriter(tmp_path / "docs") as writer:
        writer.add_sequences_as_document([[1, 2], [3], []])
        writer.add_sequences_as_document([])
        writer.add_document([4, 5, 6])
    dataset = IndexedDataset(tmp_path / "docs")
    assert dataset.document_indices.tolist() == [0, 3, 3, 4]
    assert dataset.sequence_lengths.tolist() == [2, 1, 0, 3]
    assert dataset.sequence_pointers.tolist() == [0, 4, 6, 6]
    assert [s.tolist() for s in dataset[:]] == [[1, 2], [3], [], [4, 5, 6]]
    assert dataset.num_tokens == 6


def test_empty_dataset(tmp_path):
    IndexedDatasetWriter(tmp_path / "empty").finalize()
    dataset = IndexedDataset(tmp_path / "empty")
    assert len(dataset) == 0 and dataset.num_documents == 0 and dataset.num_tokens == 0


# ---------------------------------------------------------------- atomic commits

def test_nothing_appears_before_finalize_and_nothing_stays_after_an_error(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "late")
    writer.add_document([1, 2, 3])
    assert not Path(data_file_path(tmp_path / "late")).exists()
    assert not Path(index_file_path(tmp_path / "late")).exists()
    writer.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.bin", "late.idx"]
    with pytest.raises(IndexedDatasetError, match="already finalized"):
        writer.add_document([4])

    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "failed") as failed:
            failed.add_document([1])
            raise RuntimeError("crash while writing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.bin", "late.idx"]


def test_overwriting_replaces_both_files(tmp_path):
    write_documents(tmp_path / "data", [[1, 2, 3]] * 10)
    write_documents(tmp_path / "data", [[9]])
    dataset = IndexedDataset(tmp_path / "data")
    assert [s.tolist() for s in dataset[:]] == [[9]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "data.idx"]


def test_writer_needs_an_existing_directory(tmp_path):
    with pytest.raises(IndexedDatasetError, match=r"directory .*nowhere does not exist"):
        IndexedDatasetWriter(tmp_path / "nowhere" / "data")
    with pytest.raises(IndexedDatasetError, match=r"dtype uint32 cannot be stored; use one of uint8"):
        IndexedDatasetWriter(tmp_path / "data", np.uint32)
    assert _names(tmp_path) == []


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------- damaged files

HEADER = 34                     # magic 9 + version 8 + dtype 1 + counts 8 + 8
SEQUENCES = 37
LENGTHS = HEADER                # int32[37]
POINTERS = HEADER + 4 * 37      # int64[37]
DOCUMENTS = POINTERS + 8 * 37   # int64[38]


def _patch(path, offset, data):
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def _resize(path, delta):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)


CORRUPTIONS = {
    "missing index": (lambda p: Path(f"{p}.idx").unlink(), "idx", "no such file"),
    "missing data": (lambda p: Path(f"{p}.bin").unlink(), "bin", "no such file"),
    "wrong magic": (lambda p: _patch(f"{p}.idx", 0, b"NOTANIDX\0"), "idx", "not a Megatron-LM"),
    "legacy format": (lambda p: _patch(f"{p}.idx", 0, b"TNTIDX\0\0\0"), "idx", "legacy"),
    "version": (lambda p: _patch(f"{p}.idx", 9, struct.pack("<Q", 2)), "idx", "index version 2"),
    "dtype code": (lambda p: _patch(f"{p}.idx", 17, bytes([9])), "idx", "unknown dtype code 9"),
    "truncated index": (lambda p: _resize(f"{p}.idx", -8), "idx", "truncated"),
    "trailing bytes": (lambda p: _resize(f"{p}.idx", 3), "idx", "3 unexpected trailing bytes"),
    "multimodal": (lambda p: _resize(f"{p}.idx", SEQUENCES), "idx", "multimodal"),
    "short header": (lambda p: _resize(f"{p}.idx", -(DOCUMENTS + 8 * 38 - 20)), "idx",
                     "shorter than the 34-byte header"),
    "documents start": (lambda p: _patch(f"{p}.idx", DOCUMENTS, struct.pack("<q", 1)), "idx",
                        "document_indices starts at 1, not 0"),
    "documents decrease": (lambda p: _patch(f"{p}.idx", DOCUMENTS + 8 * 10, struct.pack("<q", 30)),
                           "idx", "document_indices decrease at document 10"),
    "documents end": (lambda p: _patch(f"{p}.idx", DOCUMENTS + 8 * 37, struct.pack("<q", 36)), "idx",
                      "ends at 36, but there are 37 sequences"),
    "negative length": (lambda p: _patch(f"{p}.idx", LENGTHS + 4 * 6, struct.pack("<i", -5)), "idx",
                        "sequence 6 has negative length -5"),
    "pointer": (lambda p: _patch(f"{p}.idx", POINTERS + 8 * 4, struct.pack("<q", 2)), "idx",
                "sequence 4 points to byte 2"),
    "truncated data": (lambda p: _resize(f"{p}.bin", -2), "bin", "truncated"),
    "longer data": (lambda p: _resize(f"{p}.bin", 2), "bin", "longer than its index"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_each_kind_of_damage_has_its_own_error_naming_the_file(megatron_copy, name):
    corrupt, suffix, message = CORRUPTIONS[name]
    IndexedDataset(megatron_copy)  # intact before
    corrupt(megatron_copy)
    with pytest.raises(IndexedDatasetError) as error:
        IndexedDataset(megatron_copy)
    assert str(error.value).startswith(f"{megatron_copy}.{suffix}: ")
    assert message in str(error.value)


def test_validation_scales_to_many_sequences(tmp_path, monkeypatch):
    """Blocked validation sees damage in a later block, not only the first."""
    import ptdp.data.indexed as indexed

    monkeypatch.setattr(indexed, "_BLOCK", 64)
    with IndexedDatasetWriter(tmp_path / "many") as writer:
        for i in range(1000):
            writer.add_document([i % 50] * (i % 5))
    dataset = IndexedDataset(tmp_path / "many")
    assert dataset.num_tokens == sum(i % 5 for i in range(1000))
    assert dataset[999].tolist() == [49] * 4
    pointers = HEADER + 4 * 1000
    _patch(f"{tmp_path / 'many'}.idx", pointers + 8 * 700, struct.pack("<q", 0))
    with pytest.raises(IndexedDatasetError, match="sequence 700 points to byte 0"):
        IndexedDataset(tmp_path / "many")
