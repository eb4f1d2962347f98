"""GPT dataset: samples are windows of the shuffled document stream, splits
are disjoint, epochs are whole permutations, the first N samples do not
depend on how many were asked for, indices are cached (and rebuilt when the
settings change or the files are damaged), blends follow their weights, and
non-builder ranks load what the builder wrote."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ptdp.data import gpt_dataset
from ptdp.data.gpt_dataset import (BlendedDataset, DataError, GPTDataset, build_blend_index,
                                   build_gpt_datasets, parse_data_path, parse_split,
                                   split_document_ranges)
from ptdp.data.indexed import IndexedDataset, IndexedDatasetWriter

ROOT = Path(__file__).resolve().parents[1]


def write_dataset(directory: Path, name: str, num_documents: int, seed: int,
                  max_length: int = 60, vocab: int = 5000) -> tuple[str, list[np.ndarray]]:
    """Random documents of 0..max_length tokens (empty ones included)."""
    rng = np.random.default_rng(seed)
    documents = [rng.integers(0, vocab, rng.integers(0, max_length + 1)) for _ in range(num_documents)]
    prefix = str(directory / name)
    writer = IndexedDatasetWriter(prefix, np.uint16, durable=False)
    for tokens in documents:
        writer.add_document(tokens)
    writer.finalize()
    return prefix, documents


def make(prefix: str, documents: range, *, num_samples: int, seq_length: int = 16, seed: int = 7,
         cache_dir=None, build: bool = True, split_name: str = "train") -> GPTDataset:
    return GPTDataset(IndexedDataset(prefix), prefix, documents, split_name=split_name,
                      num_samples=num_samples, seq_length=seq_length, seed=seed,
                      cache_dir=cache_dir, build=build)


@pytest.fixture
def corpus(tmp_path):
    return write_dataset(tmp_path, "corpus", 120, seed=0)


def samples(dataset, count=None) -> np.ndarray:
    return np.stack([dataset[i] for i in range(len(dataset) if count is None else count)])


# ---------------------------------------------------------------- samples and epochs

def test_samples_are_windows_of_the_shuffled_stream_and_epochs_are_permutations(corpus, tmp_path):
    prefix, documents = corpus
    split = range(10, 110)
    tokens_per_epoch = sum(len(documents[d]) for d in split)
    seq_length = 16
    num_samples = 2 * tokens_per_epoch // seq_length + 5  # needs a third epoch
    dataset = make(prefix, split, num_samples=num_samples, seq_length=seq_length)
    assert dataset.num_epochs == 3 and len(dataset) >= num_samples

    # Each epoch is one permutation of the split's documents (ids relative to the split).
    order = np.asarray(dataset.document_index)
    for epoch in range(3):
        assert sorted(order[epoch * 100:(epoch + 1) * 100]) == list(range(100))
    assert 0 < len(order) - 300 <= 100  # the head of a fourth, for the last sample's tail ...
    assert dataset.sample_index[-1, 0] == len(order) - 1  # ... and no more of it

    # The stream, built here by plain concatenation; sample j is its window [j·s, j·s + s + 1).
    stream = np.concatenate([documents[split.start + d] for d in order]).astype(np.int64)
    windows = np.stack([stream[j * seq_length:j * seq_length + seq_length + 1]
                        for j in range(len(dataset))])
    got = samples(dataset)
    assert got.dtype == np.int64 and got.shape == (len(dataset), seq_length + 1)
    shuffle = np.asarray(dataset.shuffle_index)
    np.testing.assert_array_equal(got, windows[shuffle])

    # Samples are shuffled within their epoch's block: those starting in epoch e.
    starts = np.arange(len(dataset)) * seq_length
    block_of_stream_sample = starts // tokens_per_epoch
    assert (np.diff(block_of_stream_sample[shuffle]) >= 0).all()
    assert sorted(shuffle) == list(range(len(dataset)))
    assert not (shuffle == np.arange(len(dataset))).all()


def test_prefix_property_first_samples_do_not_depend_on_how_many_were_asked(corpus, tmp_path):
    prefix, _ = corpus
    short = make(prefix, range(0, 120), num_samples=50, cache_dir=tmp_path / "a")
    long = make(prefix, range(0, 120), num_samples=7 * len(short), cache_dir=tmp_path / "b")
    assert long.num_epochs > short.num_epochs
    np.testing.assert_array_equal(samples(long, len(short)), samples(short))


def test_same_settings_same_samples_in_another_process_and_seed_changes_the_order(corpus, tmp_path):
    prefix, _ = corpus
    first = samples(make(prefix, range(120), num_samples=200, cache_dir=tmp_path / "one"))
    again = samples(make(prefix, range(120), num_samples=200, cache_dir=tmp_path / "two"))
    np.testing.assert_array_equal(first, again)
    script = ("import sys, numpy as np; from ptdp.data.indexed import IndexedDataset; "
              "from ptdp.data.gpt_dataset import GPTDataset; p = sys.argv[1]; "
              "d = GPTDataset(IndexedDataset(p), p, range(120), split_name='train', num_samples=200, "
              "seq_length=16, seed=7, cache_dir=sys.argv[2]); "
              "sys.stdout.write(np.stack([d[i] for i in range(len(d))]).tobytes().hex())")
    out = subprocess.run([sys.executable, "-c", script, prefix, str(tmp_path / "three")], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    np.testing.assert_array_equal(np.frombuffer(bytes.fromhex(out), np.int64).reshape(first.shape),
                                  first)
    other = samples(make(prefix, range(120), num_samples=200, seed=8, cache_dir=tmp_path / "four"))
    assert other.shape == first.shape and not (other == first).all()


# ---------------------------------------------------------------- splits

def test_parse_split_and_megatron_rounding():
    assert parse_split("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert parse_split("98/2/0") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    assert parse_split("3,1") == (0.75, 0.25, 0.0)
    assert split_document_ranges(1000, "949,50,1") == [range(0, 949), range(949, 999),
                                                        range(999, 1000)]
    assert split_document_ranges(10, "1") == [range(0, 10), range(10, 10), range(10, 10)]
    # Megatron: round each share, then shift every boundary so the last is n.
    assert split_document_ranges(3, "1,1") == [range(0, 1), range(1, 3), range(3, 3)]
    for n in (1, 7, 100, 1001):
        ranges = split_document_ranges(n, "80,15,5")
        assert ranges[0].start == 0 and ranges[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0", "nan"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)
    with pytest.raises(DataError, match="train split no documents"):
        split_document_ranges(10, "1,100,0")


def test_valid_documents_never_appear_in_train(corpus, tmp_path):
    prefix, _ = corpus
    train, valid, test = build_gpt_datasets([prefix], "80,15,5", (300, 40, 0), seq_length=16, seed=3,
                                            cache_dir=str(tmp_path / "cache"))
    assert test is None
    assert train.documents.stop == valid.documents.start
    used = {name: set((ds.documents.start + np.asarray(ds.document_index)).tolist())
            for name, ds in (("train", train), ("valid", valid))}
    assert used["train"] == set(range(train.documents.start, train.documents.stop))
    assert used["valid"] == set(range(valid.documents.start, valid.documents.stop))
    assert not used["train"] & used["valid"]
    assert len(train) >= 300 and len(valid) >= 40
    none_asked = build_gpt_datasets([prefix], "80,15,5", (300, 0, 10), seq_length=16, seed=3,
                                    cache_dir=str(tmp_path / "cache"))
    assert none_asked[1] is None and none_asked[2] is not None


# ---------------------------------------------------------------- the cache

def counting_builds(monkeypatch, name="build_gpt_index") -> list:
    calls = []
    original = getattr(gpt_dataset, name)

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(gpt_dataset, name, counted)
    return calls


def test_cache_is_reused_for_the_same_settings_and_rebuilt_for_others(corpus, tmp_path, monkeypatch):
    prefix, _ = corpus
    builds = counting_builds(monkeypatch)
    cache = tmp_path / "cache"
    first = make(prefix, range(120), num_samples=100, cache_dir=cache)
    files = sorted(cache.iterdir())
    assert len(builds) == 1 and [f.suffix for f in files].count(".npy") == 3
    assert not [f for f in files if ".tmp-" in f.name]
    stamps = {f: f.stat().st_mtime_ns for f in files}
    again = make(prefix, range(120), num_samples=len(first), cache_dir=cache)  # same epochs
    assert len(builds) == 1 and {f: f.stat().st_mtime_ns for f in files} == stamps
    assert isinstance(again.shuffle_index, np.memmap)
    np.testing.assert_array_equal(samples(again), samples(first))
    make(prefix, range(120), num_samples=100, seed=8, cache_dir=cache)
    make(prefix, range(120), num_samples=100, seq_length=17, cache_dir=cache)
    make(prefix, range(0, 110), num_samples=100, cache_dir=cache)
    make(prefix, range(120), num_samples=5 * len(first), cache_dir=cache)  # more epochs
    assert len(builds) == 5
    description = json.loads(next(cache.glob(f"{first.cache_key}-*-description.json")).read_text())
    assert description["settings"]["seed"] == 7 and description["settings"]["epochs"] == 1
    # New data under the same prefix hashes differently.
    write_dataset(tmp_path, "corpus", 120, seed=1)
    make(prefix, range(120), num_samples=100, cache_dir=cache)
    assert len(builds) == 6


def test_default_cache_dir_is_next_to_the_data(corpus, tmp_path):
    prefix, _ = corpus
    dataset = make(prefix, range(120), num_samples=10)
    assert dataset.cache_dir == tmp_path.resolve() / "index-cache"
    assert len(list(dataset.cache_dir.glob("*.npy"))) == 3


@pytest.mark.parametrize("damage", ["truncate", "garbage", "remove", "bad-json", "other-settings"])
def test_damaged_cache_is_rebuilt_by_the_builder_and_refused_by_others(corpus, tmp_path, monkeypatch,
                                                                       damage):
    prefix, _ = corpus
    cache = tmp_path / "cache"
    good = samples(make(prefix, range(120), num_samples=100, cache_dir=cache))
    target = next(cache.glob("*-shuffle_index.npy"))
    description = next(cache.glob("*-description.json"))
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "garbage":
        target.write_bytes(b"\x93NUMPY not really")
    elif damage == "remove":
        target.unlink()
    elif damage == "bad-json":
        description.write_text('{"settings": ')
    else:
        text = json.loads(description.read_text())
        text["settings"]["seed"] = 99
        description.write_text(json.dumps(text))
    (cache / "leftover.npy.tmp-0123").write_bytes(b"partial")  # an interrupted writer's file
    with pytest.raises(DataError, match="unusable.*delete"):
        make(prefix, range(120), num_samples=100, cache_dir=cache, build=False)
    builds = counting_builds(monkeypatch)
    with pytest.warns(UserWarning, match="rebuilding"):
        rebuilt = make(prefix, range(120), num_samples=100, cache_dir=cache)
    assert len(builds) == 1
    np.testing.assert_array_equal(samples(rebuilt), good)
    np.testing.assert_array_equal(samples(make(prefix, range(120), num_samples=100, cache_dir=cache,
                                               build=False)), good)


def test_arrays_without_a_description_count_as_absent(corpus, tmp_path, monkeypatch):
    """A builder killed before its last rename leaves arrays but no description."""
    prefix, _ = corpus
    cache = tmp_path / "cache"
    make(prefix, range(120), num_samples=100, cache_dir=cache)
    next(cache.glob("*-description.json")).unlink()
    with pytest.raises(DataError, match="not shared"):
        make(prefix, range(120), num_samples=100, cache_dir=cache, build=False)
    builds = counting_builds(monkeypatch)
    make(prefix, range(120), num_samples=100, cache_dir=cache)
    assert len(builds) == 1


def test_unwritable_cache_dir_names_the_flag(corpus, tmp_path):
    prefix, _ = corpus
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(DataError, match="cannot write the dataset index cache.*--data-cache-path"):
        make(prefix, range(120), num_samples=10, cache_dir=blocker / "cache")


# ---------------------------------------------------------------- builder and barrier

def test_non_builder_waits_at_the_barrier_then_loads(corpus, tmp_path, monkeypatch):
    prefix, _ = corpus
    cache = str(tmp_path / "shared")
    builds = counting_builds(monkeypatch)
    barrier = threading.Barrier(2, timeout=600)  # a hang guard: the build takes a second
    results, errors = {}, []

    def rank(is_builder: bool):
        try:
            results[is_builder] = build_gpt_datasets(
                [prefix], "90,10,0", (200, 30, 0), seq_length=16, seed=5, cache_dir=cache,
                is_builder=is_builder, barrier=barrier.wait)
        except Exception as error:  # surfaced below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(flag,)) for flag in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(builds) == 2  # train and valid, by the builder only
    for builder_split, other_split in zip(results[True][:2], results[False][:2]):
        np.testing.assert_array_equal(samples(other_split), samples(builder_split))


def test_non_builder_without_a_shared_cache_says_so(corpus, tmp_path):
    prefix, _ = corpus
    with pytest.raises(DataError, match="not shared by all ranks.*--data-cache-path"):
        build_gpt_datasets([prefix], "1", (10, 0, 0), seq_length=16, seed=5,
                           cache_dir=str(tmp_path / "node-local"), is_builder=False,
                           barrier=lambda: None)


# ---------------------------------------------------------------- blending

def greedy_reference(weights, n):
    counts, chosen = [0] * len(weights), []
    for i in range(n):
        lags = [w * (i + 1) - c for w, c in zip(weights, counts)]
        best = lags.index(max(lags))
        chosen.append(best)
        counts[best] += 1
    return chosen


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.5], [0.2, 0.5, 0.3], [0.01, 0.09, 0.4, 0.5]])
def test_blend_index_is_the_greedy_rule(weights):
    index = build_blend_index(weights, 5000)
    assert index["dataset_index"].tolist() == greedy_reference(weights, 5000)
    for j in range(len(weights)):
        assert index["dataset_sample_index"][index["dataset_index"] == j].tolist() == \
            list(range(int((index["dataset_index"] == j).sum())))
    # Realised counts never stray from the targets by a sample or more.
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[index["dataset_index"]], axis=0)
    targets = np.outer(np.arange(1, 5001), weights)
    assert np.abs(counts - targets).max() < 1.5


def test_blended_datasets_follow_their_weights(tmp_path, monkeypatch):
    a, _ = write_dataset(tmp_path, "a", 80, seed=1)
    b, _ = write_dataset(tmp_path, "b", 60, seed=2)
    assert parse_data_path(["7", a, "3", b]) == [(0.7, a), (0.3, b)]
    cache = str(tmp_path / "cache")
    num_samples = (3000, 200, 0)
    train, valid, test = build_gpt_datasets(["0.7", a, "0.3", b], "90,10,0", num_samples,
                                            seq_length=16, seed=3, cache_dir=cache)
    assert test is None and isinstance(train, BlendedDataset) and len(train) == 3000
    for blend, n in ((train, 3000), (valid, 200)):
        share = np.bincount(np.asarray(blend.dataset_index), minlength=2) / n
        assert abs(share[0] - 0.7) < 0.01 and abs(share[1] - 0.3) < 0.01
        parts = blend.datasets
        assert len(parts[0]) >= math.ceil(0.7 * n * 1.005)
        assert len(parts[1]) >= math.ceil(0.3 * n * 1.005)
    # Sample i is the promised sample of the promised dataset.
    for i in (0, 1, 2, 1234, 2999):
        source = train.datasets[int(train.dataset_index[i])]
        np.testing.assert_array_equal(train[i], source[int(train.dataset_sample_index[i])])
        assert train[i].shape == (17,)
    # Cached: the same blend again builds nothing; the first samples survive a longer run.
    builds = counting_builds(monkeypatch, "build_blend_index")
    again = build_gpt_datasets(["0.7", a, "0.3", b], "90,10,0", num_samples, seq_length=16, seed=3,
                               cache_dir=cache)[0]
    assert builds == []
    longer = build_gpt_datasets(["0.7", a, "0.3", b], "90,10,0", (9000, 200, 0), seq_length=16,
                                seed=3, cache_dir=cache)[0]
    assert len(builds) == 1
    np.testing.assert_array_equal(samples(longer, 3000), samples(again))


# ---------------------------------------------------------------- errors

def test_data_path_errors_say_what_to_change(tmp_path):
    a, _ = write_dataset(tmp_path, "a", 5, seed=1)
    with pytest.raises(DataError, match="3 values"):
        parse_data_path(["0.5", a, "0.5"])
    with pytest.raises(DataError, match="'x' should be the weight"):
        parse_data_path(["x", a, "0.5", a])
    with pytest.raises(DataError, match="must be positive"):
        parse_data_path(["0", a, "1", a])
    with pytest.raises(DataError, match="must be positive"):
        parse_data_path(["-1", a, "1", a])
    with pytest.raises(DataError, match="empty"):
        parse_data_path([])
    Path(a + ".idx").rename(tmp_path / "moved.idx")
    with pytest.raises(DataError, match=rf"{a}\.idx is missing \({a}\.bin exists\)"):
        parse_data_path([a])
    with pytest.raises(DataError, match="neither"):
        parse_data_path([str(tmp_path / "nothing")])
    b, _ = write_dataset(tmp_path, "b", 5, seed=1)
    with pytest.raises(DataError, match=f"drop the extension: --data-path {b}$"):
        parse_data_path([b + ".bin"])


def test_splits_too_small_for_a_sample_fail_before_the_barrier(corpus, tmp_path):
    prefix, documents = corpus
    waited = []
    with pytest.raises(DataError, match=r"valid split holds \d+ tokens.*--seq-length"):
        build_gpt_datasets([prefix], "99,1,0", (10, 10, 0), seq_length=200, seed=1,
                           cache_dir=str(tmp_path / "c"), barrier=lambda: waited.append(1))
    assert waited == []  # every rank sees the error; none waits for a failed builder
    total = sum(len(d) for d in documents)
    with pytest.raises(DataError, match="train split holds"):
        build_gpt_datasets([prefix], "1", (10, 0, 0), seq_length=total, seed=1,
                           cache_dir=str(tmp_path / "c"))
    # A valid/test share that rounds to no documents leaves that split out, as Megatron does ...
    with pytest.warns(UserWarning, match="the test split rounds to no documents"):
        train, valid, test = build_gpt_datasets([prefix], "949,50,1", (10, 10, 10), seq_length=16,
                                                seed=1, cache_dir=str(tmp_path / "c"))
    assert train is not None and valid is not None and test is None
    # ... but not in only some datasets of a blend: the weights could not hold.
    large, _ = write_dataset(tmp_path, "large", 700, seed=3, max_length=40)
    with pytest.raises(DataError, match="corpus: the test split has no documents"):
        build_gpt_datasets(["1", large, "1", prefix], "949,50,1", (10, 10, 10), seq_length=16,
                           seed=1, cache_dir=str(tmp_path / "c"))
    dataset = make(prefix, range(120), num_samples=10, cache_dir=tmp_path / "c")
    with pytest.raises(IndexError, match="out of range"):
        dataset[len(dataset)]
