"""GPT training samples over Megatron indexed datasets: split, shuffle, epochs, blend.

A split is a contiguous range of the dataset's documents (each sequence is a
document, as in Megatron-Core's GPTDataset). Its *document stream* is epoch
0's permutation of the split's documents, then epoch 1's, and so on, each
permutation drawn from (seed, epoch) alone. Sample j of the stream is the
window of tokens [j·s, j·s + s + 1), s = --seq-length: samples run across
document boundaries and consecutive samples share one token, so inputs are
sample[:-1] and labels sample[1:], as in Megatron.

**Epochs and the prefix property.** Sample j belongs to the epoch in which
it starts (j·s in [e·T, (e+1)·T), T = tokens of the split), and samples are
shuffled only within their epoch's block, with a permutation drawn from
(seed, epoch). A run asking for N samples gets the fewest whole epochs that
hold N; the stream carries as much of the next epoch's permutation as the
last sample needs. Nothing about epoch e depends on how many epochs there
are, so **the first N samples are the same whatever number of samples was
asked for**: a longer run, or a resumed run with more iterations, sees the
same data in the same order. (Megatron shuffles across all epochs but the
last, so it lacks this property.)

**The index** (document order, sample boundaries, sample order) is built
with vectorised numpy (cumsum/searchsorted; Python loops only over epochs),
by one rank, and cached as `.npy` files plus a JSON description of what
produced it. File names carry a hash of that description, so other
settings never pick up a stale index; each file is written under a
temporary name and renamed, the description last, so a reader never sees a
partial index. Other ranks wait at a barrier, then memory-map the files.

**Blending** (`--data-path 0.7 A 0.3 B`): each split of each dataset is
sized ceil(weight · N · 1.005) (Megatron's margin) and sample i of the blend
goes to the dataset whose count lags weight · (i + 1) the most, ties to the
first (Megatron's greedy rule). The rule only looks back, so blends too
keep the prefix property.

Permutations come from numpy's PCG64 seeded by SeedSequence([seed, stream,
epoch]). numpy does not promise that Generator streams stay the same across
its versions (NEP 19); the cache is keyed by the settings, not the numpy
version, so a run that keeps its cache keeps its order across an upgrade.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import operator
import os
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ptdp.data.cache import default_cache_dir
from ptdp.data.indexed import IndexedDataset, IndexedDatasetError
from ptdp.errors import UserError
from ptdp.status import phase

# Bump when the index algorithm changes: old caches then hash differently.
INDEX_FORMAT = 1
BLEND_MARGIN = 1.005  # Megatron asks each blended dataset for 0.5 % more samples than its share
SPLIT_NAMES = ("train", "valid", "test")
_BOUNDARY_BLOCK = 1 << 22  # sample boundaries per searchsorted call: bounded temporaries
_RNG_DOCUMENTS, _RNG_SAMPLES = 0, 1  # SeedSequence streams: document vs sample permutations


class DataError(UserError, ValueError):
    """Data settings or files that cannot work; the message says what is
    wrong and which flag or file to change."""


# ---------------------------------------------------------------- flags

def parse_data_path(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """Megatron's --data-path: one prefix, or weight-prefix pairs. Weights are
    normalised to sum to 1; every prefix must have its .bin and .idx."""
    values = list(data_path or [])
    if not values:
        raise DataError("--data-path is empty; give a dataset prefix (PREFIX for PREFIX.bin/.idx) "
                        "or weight-prefix pairs such as 0.7 A 0.3 B")
    pairs = parse_weighted_paths(values, "prefix")
    for _, prefix in pairs:
        _check_prefix_files(prefix)
    return pairs


def parse_weighted_paths(values: Sequence[str], what: str) -> list[tuple[float, str]]:
    """--data-path's one `what` (a prefix, a file) or weight-`what` pairs
    (0.7 A 0.3 B), the weights normalised to sum to 1."""
    values = list(values)
    if len(values) == 1:
        return [(1.0, values[0])]
    if not values or len(values) % 2:
        raise DataError(f"--data-path takes one {what} or weight-{what} pairs (0.7 A 0.3 B); got "
                        f"{len(values)} values {values}: one weight or {what} is missing")
    pairs = []
    for weight_text, path in zip(values[::2], values[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            raise DataError(f"--data-path: {weight_text!r} should be the weight of {path!r}; "
                            f"give weight-{what} pairs such as 0.7 A 0.3 B") from None
        if not math.isfinite(weight) or weight <= 0:
            raise DataError(f"--data-path: the weight of {path!r} is {weight_text}; weights "
                            f"must be positive numbers (leave a dataset out to give it none)")
        pairs.append((weight, path))
    total = sum(weight for weight, _ in pairs)
    return [(weight / total, path) for weight, path in pairs]


def _check_prefix_files(prefix: str) -> None:
    missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if not missing:
        return
    hint = "give the prefix without .bin/.idx, or write the dataset with `ptdp preprocess`"
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext) and os.path.isfile(prefix[:-len(ext)] + ".idx"):
            hint = f"drop the extension: --data-path {prefix[:-len(ext)]}"
    if len(missing) == 2:
        raise DataError(f"--data-path {prefix}: neither {prefix}.bin nor {prefix}.idx exists; {hint}")
    present = ".idx" if missing == [".bin"] else ".bin"
    raise DataError(f"--data-path {prefix}: {prefix}{missing[0]} is missing ({prefix}{present} "
                    f"exists); an indexed dataset needs both files: copy the missing one or {hint}")


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's --split: 'train,valid,test' proportions ('949,50,1',
    '98,2,0', '1' for train only; '/' separates too), normalised."""
    text = str(split).strip()
    parts = text.split(",") if "," in text else text.split("/")
    example = "e.g. --split 949,50,1, or 98,2,0 for no test data, or 1 for train only"
    if not 1 <= len(parts) <= 3:
        raise DataError(f"--split {split!r}: {len(parts)} proportions; give at most three "
                        f"(train,valid,test), {example}")
    try:
        shares = [float(part) for part in parts]
    except ValueError:
        raise DataError(f"--split {split!r}: proportions must be numbers, {example}") from None
    if any(not math.isfinite(share) or share < 0 for share in shares):
        raise DataError(f"--split {split!r}: proportions must be non-negative numbers, {example}")
    shares += [0.0] * (3 - len(shares))
    total = sum(shares)
    if total <= 0:
        raise DataError(f"--split {split!r}: all proportions are zero, {example}")
    return tuple(share / total for share in shares)


def split_document_ranges(num_documents: int, split) -> list[range]:
    """Contiguous document ranges of train, valid, test with Megatron's
    rounding: each boundary adds round(share · n), then all but the first are
    shifted so that the last is n."""
    shares = parse_split(split) if isinstance(split, str) else tuple(split)
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [0] + [min(max(bound - excess, 0), num_documents) for bound in bounds[1:]]
    if bounds[1] == 0:
        raise DataError(f"--split {_split_text(split)} leaves the train split no documents of the "
                        f"{num_documents}; give train a larger share (e.g. --split 98,2,0) or use a "
                        f"dataset with more documents")
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


def _split_text(split) -> str:
    return split if isinstance(split, str) else ",".join(f"{share:g}" for share in split)


# ---------------------------------------------------------------- index building

def samples_in_epochs(num_epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Samples that start within the first `num_epochs` epochs: ceil(E·T / s)."""
    return -(-num_epochs * tokens_per_epoch // seq_length)


def epochs_for(num_samples: int, tokens_per_epoch: int, seq_length: int) -> int:
    """The fewest whole epochs holding `num_samples` samples (at least one)."""
    # ceil(E·T / s) >= N  <=>  E·T > (N - 1)·s
    return max(1, (max(num_samples, 1) - 1) * seq_length // tokens_per_epoch + 1)


def _smallest_int(max_value: int):
    return np.int32 if max_value < np.iinfo(np.int32).max else np.int64


def _rng(seed: int, stream: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream, epoch]))


def build_gpt_index(document_lengths: np.ndarray, *, seq_length: int, seed: int,
                    num_epochs: int) -> dict[str, np.ndarray]:
    """The index of `num_epochs` epochs over documents of these lengths.

    document_index [~E·D]: split-relative document ids in stream order; E
        whole permutations, then the head of epoch E's that the last sample needs.
    sample_index [S + 1, 2]: (position in document_index, token offset) of
        boundary j, token j·s of the stream; sample j runs from boundary j
        to boundary j + 1 inclusive. S = samples_in_epochs(E, T, s).
    shuffle_index [S]: sample i of the dataset is stream sample shuffle_index[i];
        a permutation within each epoch's block of samples.
    """
    lengths = np.asarray(document_lengths, dtype=np.int64)
    num_documents, tokens = len(lengths), int(lengths.sum())
    if tokens < seq_length + 1:
        raise DataError(f"{tokens} tokens cannot make one sample of --seq-length + 1 = "
                        f"{seq_length + 1} tokens")
    num_samples = samples_in_epochs(num_epochs, tokens, seq_length)
    # The last sample ends at token S·s (inclusive), at most s past the last whole
    # epoch; tokens >= s + 1, so a head of one more epoch always covers it.
    needed = num_samples * seq_length + 1 - num_epochs * tokens
    epochs = [_rng(seed, _RNG_DOCUMENTS, epoch).permutation(num_documents)
              for epoch in range(num_epochs + 1)]
    tail_ends = np.cumsum(lengths[epochs[-1]])
    epochs[-1] = epochs[-1][:int(np.searchsorted(tail_ends, needed, side="left")) + 1]
    document_index = np.concatenate(epochs).astype(_smallest_int(num_documents), copy=False)
    del epochs, tail_ends

    stream_lengths = lengths[document_index]
    stream_ends = np.cumsum(stream_lengths)
    stream_starts = stream_ends - stream_lengths
    del stream_lengths
    sample_index = np.empty((num_samples + 1, 2), dtype=_smallest_int(len(document_index)))
    for start in range(0, num_samples + 1, _BOUNDARY_BLOCK):
        boundaries = np.arange(start, min(start + _BOUNDARY_BLOCK, num_samples + 1),
                               dtype=np.int64) * seq_length
        # side="right": the document that holds the boundary token (skips empty ones)
        positions = np.searchsorted(stream_ends, boundaries, side="right")
        sample_index[start:start + len(boundaries), 0] = positions
        sample_index[start:start + len(boundaries), 1] = boundaries - stream_starts[positions]
    del stream_ends, stream_starts

    shuffle_index = np.empty(num_samples, dtype=_smallest_int(num_samples))
    block_starts = [samples_in_epochs(epoch, tokens, seq_length) for epoch in range(num_epochs + 1)]
    for epoch, (start, stop) in enumerate(zip(block_starts, block_starts[1:])):
        shuffle_index[start:stop] = start + _rng(seed, _RNG_SAMPLES, epoch).permutation(stop - start)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


def build_blend_index(weights: Sequence[float], num_samples: int) -> dict[str, np.ndarray]:
    """dataset_index[i]: the dataset sample i of the blend comes from (the one
    whose count lags weight · (i + 1) the most, ties to the first);
    dataset_sample_index[i]: which of that dataset's samples it is.

    The rule is sequential; this loop is written tightly (plain floats and
    ints, about 0.3 µs per sample for a few datasets) and runs once per
    blend, on the builder rank, before the result is cached."""
    weights = [float(weight) for weight in weights]
    counts = [0] * len(weights)
    choices = bytearray(num_samples)
    first_weight, others = weights[0], range(1, len(weights))
    for i in range(num_samples):
        step = i + 1
        best, best_lag = 0, first_weight * step - counts[0]
        for j in others:
            lag = weights[j] * step - counts[j]
            if lag > best_lag:
                best, best_lag = j, lag
        choices[i] = best
        counts[best] += 1
    dataset_index = np.frombuffer(bytes(choices), dtype=np.uint8).astype(np.int16)
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    for j in range(len(weights)):
        chosen = dataset_index == j
        dataset_sample_index[chosen] = np.arange(int(chosen.sum()))
    return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}


# ---------------------------------------------------------------- the cache

def dataset_fingerprint(prefix: str) -> dict:
    """Identifies an indexed dataset by content, cheaply: file sizes and a hash
    of the head and tail of the .idx (which hold the header, the first
    lengths and the last pointers, i.e. the running total). Content, not
    paths or mtimes, so a copy on another node names the same cache."""
    idx_path, chunk = prefix + ".idx", 1 << 20
    digest = hashlib.sha256()
    with open(idx_path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        digest.update(file.read(chunk))
        if size > chunk:
            file.seek(max(chunk, size - chunk))
            digest.update(file.read(chunk))
    return {"idx_bytes": size, "bin_bytes": os.path.getsize(prefix + ".bin"),
            "idx_head_tail_sha256": digest.hexdigest()}


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def safe_label(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:64]


class _CacheInvalid(Exception):
    pass


class IndexCache:
    """The files of one index: STEM-NAME.npy per array and STEM-description.json."""

    def __init__(self, directory: Path, stem: str, settings: dict, info: dict):
        self.directory, self.stem = Path(directory), stem
        self.settings = json.loads(json.dumps(settings))  # as it reads back (tuples -> lists)
        self.info = info

    def array_path(self, name: str) -> Path:
        return self.directory / f"{self.stem}-{name}.npy"

    @property
    def description_path(self) -> Path:
        return self.directory / f"{self.stem}-description.json"

    def load(self, names: Sequence[str], check: Callable[[dict], None]) -> dict | None:
        """The cached arrays (memory-mapped); None if no description exists;
        _CacheInvalid if it exists but the files do not match it."""
        try:
            text = self.description_path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as error:
            raise _CacheInvalid(f"cannot read {self.description_path}: {error}") from None
        try:
            description = json.loads(text)
        except (ValueError, RecursionError):
            raise _CacheInvalid(f"{self.description_path} is not valid JSON") from None
        if not isinstance(description, dict) or description.get("settings") != self.settings:
            raise _CacheInvalid(f"{self.description_path} describes other settings")
        arrays = {}
        for name in names:
            try:
                arrays[name] = np.load(self.array_path(name), mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError, EOFError) as error:
                raise _CacheInvalid(f"cannot load {self.array_path(name)}: {error}") from None
        try:
            check(arrays)
        except ValueError as error:
            raise _CacheInvalid(f"{self.directory}/{self.stem}-*.npy: {error}") from None
        return arrays

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        """Arrays first, the description last: it marks the index complete."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for name, array in arrays.items():
                _write_atomically(self.array_path(name),
                                  lambda file, a=array: np.save(file, a, allow_pickle=False))
            text = json.dumps({"settings": self.settings, "info": self.info,
                               "files": [self.array_path(n).name for n in arrays]}, indent=1)
            _write_atomically(self.description_path, lambda file: file.write(text.encode()))
        except OSError as error:
            raise DataError(f"cannot write the dataset index cache in {self.directory} ({error}); "
                            f"give a writable directory with --data-cache-path") from None


def _write_atomically(path: Path, write: Callable) -> None:
    temporary = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(temporary, "xb") as file:  # exclusive: never through a planted link
            write(file)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def cached_or_built(cache: IndexCache, names: Sequence[str], check: Callable[[dict], None],
                     build: Callable[[], dict] | None,
                     announce: Callable[[Path], None] | None = None) -> tuple[dict, bool]:
    """Load the index; when `build` is given (the builder rank) build and
    save it if it is missing or unusable. Returns (arrays, whether built).
    A build is announced on stderr (ptdp.status.phase), or, where the caller
    reports several indices at once, by calling `announce(cache directory)`
    first and printing nothing."""
    try:
        arrays = cache.load(names, check)
    except _CacheInvalid as problem:
        if build is None:
            raise DataError(f"the dataset index cache is unusable: {problem}; delete "
                            f"{cache.directory}/{cache.stem}-* and run again (the first rank "
                            f"rebuilds it)") from None
        warnings.warn(f"rebuilding the dataset index: {problem}", stacklevel=3)
        arrays = None
    if arrays is not None:
        return arrays, False
    if build is None:
        raise DataError(
            f"the dataset index {cache.description_path} does not exist, although the building rank "
            f"has written it before the barrier: the cache directory is not shared by all ranks "
            f"(e.g. a node-local disk); give --data-cache-path a directory on a file system every "
            f"node sees")
    with (phase(f"building the dataset index {cache.stem} in {cache.directory}") if announce is None
          else contextlib.nullcontext(announce(cache.directory))):
        arrays = build()
        check(arrays)  # a bug here must not be cached
        cache.save(arrays)
    return arrays, True


# ---------------------------------------------------------------- datasets

class GPTDataset:
    """One split of one indexed dataset: sample i is int64 tokens [s + 1].
    len() is the samples of the whole epochs needed for `num_samples`."""

    def __init__(self, indexed: IndexedDataset, prefix: str, documents: range, *, split_name: str,
                 num_samples: int, seq_length: int, seed: int, cache_dir: Path | None,
                 build: bool = True, announce: Callable[[Path], None] | None = None):
        if not isinstance(documents, range) or documents.step != 1 or documents.start < 0 \
                or documents.stop > len(indexed):
            raise DataError(f"{prefix}: documents {documents} are not a contiguous range within "
                            f"its {len(indexed)} documents")
        if seq_length < 1:
            raise DataError(f"--seq-length {seq_length}: must be at least 1")
        if seed < 0:
            raise DataError(f"--seed {seed}: the data order needs a non-negative seed")
        if num_samples < 0:
            raise DataError(f"{split_name}: {num_samples} samples asked; must be >= 0")
        self.indexed, self.prefix, self.documents = indexed, str(prefix), documents
        self.split_name, self.seq_length, self.seed = split_name, seq_length, seed
        self.num_samples = num_samples
        lengths = indexed.sequence_lengths[documents.start:documents.stop]
        self.tokens_per_epoch = int(np.sum(lengths, dtype=np.int64))
        check_split_holds_a_sample(self.prefix, split_name, len(documents), self.tokens_per_epoch,
                                   seq_length)
        self.num_epochs = epochs_for(num_samples, self.tokens_per_epoch, seq_length)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(self.prefix)
        settings = {"kind": "GPTDataset", "index_format": INDEX_FORMAT,
                    "dataset": dataset_fingerprint(self.prefix),
                    "documents": [documents.start, documents.stop], "seq_length": seq_length,
                    "seed": seed, "epochs": self.num_epochs}
        self.cache_key = settings_hash(settings)
        info = {"prefix": self.prefix, "split": split_name, "tokens_per_epoch": self.tokens_per_epoch,
                "samples": len(self)}
        cache = IndexCache(self.cache_dir, f"{self.cache_key}-GPTDataset-{safe_label(split_name)}",
                            settings, info)
        arrays, self.built = cached_or_built(
            cache, ("document_index", "sample_index", "shuffle_index"), self._check_index,
            (lambda: build_gpt_index(lengths, seq_length=seq_length, seed=seed,
                                     num_epochs=self.num_epochs)) if build else None, announce)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return samples_in_epochs(self.num_epochs, self.tokens_per_epoch, self.seq_length)

    def _check_index(self, arrays: dict) -> None:
        """Shapes and kinds the settings imply (cheap: no pass over the data)."""
        documents, samples = len(self.documents), len(self)
        document_index, sample_index = arrays["document_index"], arrays["sample_index"]
        shuffle_index = arrays["shuffle_index"]
        for name, array in arrays.items():
            if array.dtype.kind != "i":
                raise ValueError(f"{name} has dtype {array.dtype}, not an integer type")
        epochs = self.num_epochs
        if not (document_index.ndim == 1
                and epochs * documents < len(document_index) <= (epochs + 1) * documents):
            raise ValueError(f"document_index has shape {document_index.shape}, not about "
                             f"{self.num_epochs} epochs of {documents} documents")
        if sample_index.shape != (samples + 1, 2):
            raise ValueError(f"sample_index has shape {sample_index.shape}, not {(samples + 1, 2)}")
        if shuffle_index.shape != (samples,):
            raise ValueError(f"shuffle_index has shape {shuffle_index.shape}, not {(samples,)}")
        if sample_index[-1, 0] >= len(document_index):
            raise ValueError("sample_index points past document_index")

    def __getitem__(self, i: int) -> np.ndarray:
        i = operator.index(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of the {self.split_name} split is out of range "
                             f"(it has {len(self)})")
        j = int(self.shuffle_index[i])
        (first, offset), (last, end) = self.sample_index[j], self.sample_index[j + 1]
        first, offset, last, end = int(first), int(offset), int(last), int(end)
        base = self.documents.start
        if first == last:
            return self.indexed.get(base + int(self.document_index[first]), offset,
                                    end - offset + 1).astype(np.int64)
        parts = [self.indexed.get(base + int(self.document_index[first]), offset)]
        parts += [self.indexed.get(base + int(document))
                  for document in self.document_index[first + 1:last]]
        parts.append(self.indexed.get(base + int(self.document_index[last]), 0, end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __repr__(self) -> str:
        return (f"GPTDataset({self.prefix!r}, {self.split_name}: documents {self.documents.start}.."
                f"{self.documents.stop - 1}, {self.num_epochs} epoch(s), {len(self)} samples)")


def check_split_holds_a_sample(prefix: str, split_name: str, num_documents: int, tokens: int,
                               seq_length: int) -> None:
    if num_documents == 0:
        raise DataError(f"{prefix}: the {split_name} split has no documents; give it a larger share "
                        f"with --split (e.g. 98,2,0 leaves test out) or use more data")
    if tokens < seq_length + 1:
        raise DataError(f"{prefix}: the {split_name} split holds {tokens} tokens in {num_documents} "
                        f"documents, fewer than one sample of --seq-length + 1 = {seq_length + 1}; "
                        f"lower --seq-length, give the split a larger share with --split, or use "
                        f"more data")


class BlendedDataset:
    """Samples drawn from several datasets by weight (see build_blend_index)."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int, *, seed: int,
                 cache_dir: Path | None, build: bool = True, description: str,
                 announce: Callable[[Path], None] | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"blend {description}: {len(datasets)} datasets but "
                            f"{len(weights)} weights")
        if len(datasets) > 255:
            raise DataError(f"blend {description}: {len(datasets)} datasets; at most 255 can be "
                            f"blended")
        if any(not weight > 0 for weight in weights):
            raise DataError(f"blend {description}: weights must be positive, got {weights}")
        total = float(sum(weights))
        self.datasets, self.weights = list(datasets), [float(w) / total for w in weights]
        self.num_samples, self.description = num_samples, description
        if cache_dir is None:
            cache_dir = getattr(datasets[0], "cache_dir", None)
        if cache_dir is None:
            raise DataError(f"blend {description}: no cache directory; give --data-cache-path")
        self.cache_dir = Path(cache_dir)
        # The greedy rule draws no random numbers; the seed is recorded so that
        # the description says everything the samples depend on.
        settings = {"kind": "BlendedDataset", "index_format": INDEX_FORMAT,
                    "datasets": [dataset.cache_key for dataset in datasets],
                    "weights": self.weights, "num_samples": num_samples, "seed": seed}
        self.cache_key = settings_hash(settings)
        stem = f"{self.cache_key}-BlendedDataset-{safe_label(description)}"
        info = {"description": description,
                "prefixes": [getattr(dataset, "prefix", None) for dataset in datasets]}
        cache = IndexCache(self.cache_dir, stem, settings, info)
        arrays, self.built = cached_or_built(cache, ("dataset_index", "dataset_sample_index"),
                                              self._check_index, self._build if build else None,
                                              announce)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def _build(self) -> dict:
        arrays = build_blend_index(self.weights, self.num_samples)
        for j, dataset in enumerate(self.datasets):
            drawn = arrays["dataset_sample_index"][arrays["dataset_index"] == j]
            if len(drawn) and drawn.max() >= len(dataset):
                raise DataError(f"blend {self.description}: needs sample {drawn.max()} of "
                                f"{dataset!r}, which has {len(dataset)}; build it with more samples")
        return arrays

    def _check_index(self, arrays: dict) -> None:
        for name, array in arrays.items():
            if array.shape != (self.num_samples,) or array.dtype.kind != "i":
                raise ValueError(f"{name} has shape {array.shape} and dtype {array.dtype}, not "
                                 f"({self.num_samples},) integers")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        i = operator.index(i)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of blend {self.description} is out of range "
                             f"(it has {self.num_samples})")
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def __repr__(self) -> str:
        parts = ", ".join(f"{w:.3g}·{d!r}" for w, d in zip(self.weights, self.datasets))
        return f"BlendedDataset({self.description}: {self.num_samples} samples of {parts})"


# ---------------------------------------------------------------- all splits

def check_gpt_datasets(data_path: list[str], split: str, num_samples: tuple[int, int, int], *,
                       seq_length: int, warn: bool = True, mmap_bin_files: bool = True):
    """Every check that can fail on the data, without building anything:
    the files open, the split parses and each wanted split holds a sample.
    Returns (weighted prefixes, opened datasets, document ranges, wanted
    splits). Run before launching, and again on every rank before the
    barrier, so that no rank waits for a builder that has failed.
    `mmap_bin_files`: see IndexedDataset (--no-mmap-bin-files)."""
    weighted = parse_data_path(data_path)
    shares = parse_split(split)
    if len(num_samples) != 3:
        raise DataError(f"num_samples must be (train, valid, test), got {num_samples}")
    indexed = {}
    for _, prefix in weighted:
        if prefix not in indexed:
            try:
                indexed[prefix] = IndexedDataset(prefix, mmap_bin_files=mmap_bin_files)
            except IndexedDatasetError as error:
                raise DataError(f"--data-path {prefix}: {error}") from None
    ranges = {prefix: split_document_ranges(len(data), shares) for prefix, data in indexed.items()}
    wanted = [k for k in range(3) if shares[k] > 0 and num_samples[k] > 0]
    for k in list(wanted):
        empty = [prefix for prefix in indexed if not ranges[prefix][k]]
        if k > 0 and len(empty) == len(indexed):
            # Megatron too leaves a split that rounds to no documents out (the
            # default 949,50,1 gives a small corpus no test documents).
            if warn:
                warnings.warn(f"--split {split}: the {SPLIT_NAMES[k]} split rounds to no documents "
                              f"of {', '.join(empty)}; there is no {SPLIT_NAMES[k]} data",
                              stacklevel=3)
            wanted.remove(k)
    for k in wanted:
        for prefix, data in indexed.items():
            documents = ranges[prefix][k]
            tokens = int(np.sum(data.sequence_lengths[documents.start:documents.stop], dtype=np.int64))
            check_split_holds_a_sample(prefix, SPLIT_NAMES[k], len(documents), tokens, seq_length)
    return weighted, indexed, ranges, wanted


class _BuildReport:
    """All the indices of a run's splits and blend in two lines on stderr,
    printed only when something is built (a cached index is just read):
    "ptdp: building the dataset index in DIR ..." before the first build,
    and at the end what was built and how long it took."""

    def __init__(self):
        self.started: float | None = None
        self.directories: list[Path] = []

    def announce(self, directory: Path) -> None:
        if self.started is None:
            print(f"ptdp: building the dataset index in {directory} ...", file=sys.stderr,
                  flush=True)
            self.started = time.perf_counter()
        if directory not in self.directories:
            self.directories.append(directory)

    def done(self, datasets: Sequence, weighted: list[tuple[float, str]]) -> None:
        if self.started is None:
            return
        source = (weighted[0][1] if len(weighted) == 1 else
                  "a blend of " + ", ".join(f"{weight:g} {prefix}" for weight, prefix in weighted))
        splits = ", ".join(f"{name} {len(dataset):,}" for name, dataset in zip(SPLIT_NAMES, datasets)
                           if dataset is not None)
        others = [str(d) for d in self.directories[1:]]
        print(f"ptdp: built the dataset index of {source} (samples: {splits}) in "
              f"{time.perf_counter() - self.started:.1f} s"
              + (f"; also cached in {', '.join(others)}" if others else ""),
              file=sys.stderr, flush=True)


def build_gpt_datasets(data_path: list[str], split: str, num_samples: tuple[int, int, int], *,
                       seq_length: int, seed: int, cache_dir: str | None = None,
                       is_builder: bool = True, barrier: Callable[[], None] | None = None,
                       mmap_bin_files: bool = True):
    """(train, valid, test) datasets; None where the split's share or its
    sample count is zero, or (valid, test) where it rounds to no documents
    (a warning says so). Builder ranks build (or find) the cached indices,
    then every rank calls `barrier`, then the others load them. Every check
    that can fail on the data runs first, on every rank (check_gpt_datasets)."""
    weighted, indexed, ranges, wanted = check_gpt_datasets(data_path, split, num_samples,
                                                           seq_length=seq_length, warn=is_builder,
                                                           mmap_bin_files=mmap_bin_files)
    directory = Path(cache_dir) if cache_dir is not None else None
    building = _BuildReport()

    def build_all(build: bool) -> list:
        result = [None, None, None]
        for k in wanted:
            name = SPLIT_NAMES[k]
            parts = [GPTDataset(indexed[prefix], prefix, ranges[prefix][k], split_name=name,
                                num_samples=(num_samples[k] if len(weighted) == 1 else
                                             math.ceil(weight * num_samples[k] * BLEND_MARGIN)),
                                seq_length=seq_length, seed=seed, cache_dir=directory, build=build,
                                announce=building.announce)
                     for weight, prefix in weighted]
            result[k] = parts[0] if len(parts) == 1 else BlendedDataset(
                parts, [weight for weight, _ in weighted], num_samples[k], seed=seed,
                cache_dir=directory, build=build, description=name, announce=building.announce)
        return result

    datasets = build_all(True) if is_builder else None
    if datasets is not None:
        building.done(datasets, weighted)
    if barrier is not None:
        barrier()
    if datasets is None:
        datasets = build_all(False)
    return tuple(datasets)
