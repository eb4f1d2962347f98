"""Megatron-LM's memory-mapped indexed dataset (`PREFIX.bin` + `PREFIX.idx`), byte-compatible.

`PREFIX.bin` is every sequence's tokens, concatenated, in one dtype.
`PREFIX.idx` (Megatron-Core `indexed_dataset.py`, index version 1):

    b"MMIDIDX\\x00\\x00"            9 bytes
    version                        <Q, 1
    dtype code                     <B (see DTYPE_CODES)
    sequence count S               <Q
    document count D               <Q, number of documents + 1
    sequence_lengths               int32[S], tokens per sequence
    sequence_pointers              int64[S], byte offset of each sequence in .bin
    document_indices               int64[D], 0, then the sequence count after each document

Nothing follows (Megatron's multimodal variant appends int8 modes[S]; it is
not supported). Megatron writes the sequences contiguously, so the pointers
are the running sum of lengths × itemsize; the reader checks that, and every
other invariant, on open, with vectorised numpy over bounded blocks (indexes
of 10^9 tokens open in seconds and without large temporaries).

Writers put everything under temporary names and commit with renames, the
index last: a reader never sees a valid-looking `.idx` over a partial `.bin`.
"""

from __future__ import annotations

import mmap
import operator
import os
import shutil
import struct
import uuid
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ptdp.errors import UserError


MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"  # fairseq's older "cached"/"lazy" index format
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}

_BLOCK = 1 << 22  # sequences per validation block: 48 MiB of temporaries at most
_COPY_BUFFER = 1 << 22


class IndexedDatasetError(UserError, ValueError):
    """An indexed dataset is unreadable or a write is invalid; the message
    names the file, what is wrong and what to do."""


def best_fitting_dtype(vocab_size: int) -> np.dtype:
    """Megatron-LM's rule: uint16 below 65,500 tokens, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def data_file_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


def _dtype_code(dtype, where: str) -> tuple[np.dtype, int]:
    """The little-endian dtype and its Megatron code."""
    dtype = np.dtype(dtype)
    code = _CODE_OF.get(dtype.newbyteorder("="))
    if code is None:
        names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise IndexedDatasetError(f"{where}: dtype {dtype} cannot be stored; use one of {names}")
    return dtype.newbyteorder("<"), code


def _blocks(n: int):
    for start in range(0, n, _BLOCK):
        yield slice(start, min(start + _BLOCK, n))


# ---------------------------------------------------------------- reading

def _map(path: str) -> mmap.mmap | None:
    """Read-only map of a file; None for an empty file (which mmap refuses)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return None
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


class IndexedDataset:
    """A Megatron `.bin`/`.idx` pair; `get` returns views into the memory-
    mapped `.bin` (no copies). Indexing is by sequence; with one sequence per
    document (what `ptdp preprocess` writes) sequences are documents.

    `mmap_bin_files=False` (--no-mmap-bin-files, Megatron-LM's meaning):
    the `.bin` is not mapped; each `get` reads its tokens from the file
    (pread, so processes that inherit the descriptor do not share a file
    position), for file systems where mapping large files performs badly.
    The index is mapped either way, as Megatron-LM does."""

    def __init__(self, prefix: str | Path, *, mmap_bin_files: bool = True):
        self.prefix = str(prefix)
        self.mmap_bin_files = mmap_bin_files
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path, other in ((idx_path, bin_path), (bin_path, idx_path)):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path}: no such file; an indexed dataset is the pair PREFIX.bin + PREFIX.idx "
                    f"({other} {'exists' if os.path.isfile(other) else 'is missing too'}); give the "
                    f"prefix without the extension, or run `ptdp preprocess` again")
        self._index_map = _map(idx_path)
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = \
            _read_index(idx_path, self._index_map)
        self.num_tokens = _check_index_arrays(idx_path, self.dtype, self.sequence_lengths,
                                              self.sequence_pointers, self.document_indices)
        expected = self.num_tokens * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise IndexedDatasetError(
                f"{bin_path}: {actual:,} bytes, but its index {idx_path} describes "
                f"{self.num_tokens:,} {self.dtype.name} tokens = {expected:,} bytes; the data file is "
                f"{'truncated' if actual < expected else 'longer than its index'} (an interrupted "
                f"copy or write?); copy it again or rerun `ptdp preprocess`")
        self._data_map = self._tokens = self._bin_fd = None
        if mmap_bin_files:
            self._data_map = _map(bin_path)
            self._tokens = (np.empty(0, self.dtype) if self._data_map is None
                            else np.frombuffer(self._data_map, dtype=self.dtype))
        else:
            self._bin_fd = os.open(bin_path, os.O_RDONLY)
        self._opened_sizes = (expected, 0 if self._index_map is None else len(self._index_map))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset` .. `offset + length` of sequence `index` (to its end
        without `length`): a read-only view into the memory map."""
        index = operator.index(index)
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"sequence {index} is out of range: {self.prefix} has {count} sequences")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}..{offset + length} of sequence {index} are out of "
                             f"range: it has {size} tokens ({self.prefix})")
        # Pointers were checked to be contiguous, so they are token offsets × itemsize.
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        if not self.mmap_bin_files:
            return self._read(start, length)
        self.check_unchanged()
        return self._tokens[start:start + length]

    def check_unchanged(self) -> None:
        """Raise IndexedDatasetError, naming the file, when the `.bin` or the
        `.idx` is no longer the size it had on open. Reading a page of a
        memory map beyond a file's end does not fail like a read: the kernel
        kills the process with SIGBUS, which says nothing of the file. One
        fstat per file (about a microsecond) before each read; a file cut in
        the moment between this check and the read still ends in SIGBUS."""
        for path, size, opened in zip((data_file_path(self.prefix), index_file_path(self.prefix)),
                                      self._current_sizes(), self._opened_sizes):
            if size is not None and size != opened:
                raise IndexedDatasetError(
                    f"{path}: {size:,} bytes now, {opened:,} when training opened it: "
                    f"the file was {'truncated' if size < opened else 'extended'} or "
                    f"rewritten in place while training read it (a copy or sync in progress? a "
                    f"tool that rewrites the prefix in place, as Megatron-LM's preprocess_data.py "
                    f"does?); restore it (copy it again, or rerun `ptdp preprocess`), then resume "
                    f"from the last checkpoint with --load")

    def _current_sizes(self) -> tuple[int | None, int | None]:
        """The sizes of the opened `.bin` and `.idx` now: a memory map's
        size() asks its own descriptor (no descriptor more per dataset;
        blends open hundreds); None for an empty file, which has no map."""
        data = (os.fstat(self._bin_fd).st_size if self._bin_fd is not None else
                None if self._data_map is None else self._data_map.size())
        return data, None if self._index_map is None else self._index_map.size()

    def _read(self, start: int, length: int) -> np.ndarray:
        """Tokens start .. start + length, read from the `.bin` file."""
        self.check_unchanged()  # a clearer message than the short read's, and the index too
        itemsize = self.dtype.itemsize
        data = _pread_exactly(self._bin_fd, length * itemsize, start * itemsize,
                              data_file_path(self.prefix))
        return np.frombuffer(data, dtype=self.dtype)

    def __del__(self):
        descriptor = getattr(self, "_bin_fd", None)
        if descriptor is not None:
            os.close(descriptor)
            self._bin_fd = None

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.get(i) for i in range(*index.indices(len(self)))]
        return self.get(index)

    def __reduce__(self):
        # Memory maps and descriptors cannot be pickled; reopen from the
        # prefix instead (e.g. in DataLoader workers).
        return (_reopen, (type(self), self.prefix, self.mmap_bin_files))

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {self.num_documents} documents, {len(self)} "
                f"sequences, {self.num_tokens} {self.dtype.name} tokens)")


def _reopen(kind: type, prefix: str, mmap_bin_files: bool) -> IndexedDataset:
    return kind(prefix, mmap_bin_files=mmap_bin_files)


def _pread_exactly(descriptor: int, size: int, offset: int, path: str) -> bytes:
    """`size` bytes at `offset`; pread may return fewer at once (network file systems)."""
    parts, done = [], 0
    while done < size:
        part = os.pread(descriptor, size - done, offset + done)
        if not part:
            raise IndexedDatasetError(f"{path}: ends at byte {offset + done:,}, before the "
                                      f"{size:,} bytes its index places at {offset:,}; the file "
                                      f"changed after it was opened")
        parts.append(part)
        done += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_index(path: str, buffer) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    rerun = "rerun `ptdp preprocess` (or Megatron-LM's preprocess_data.py) to rebuild it"
    size = 0 if buffer is None else len(buffer)
    if size < _HEADER.size:
        raise IndexedDatasetError(f"{path}: {size} bytes, shorter than the {_HEADER.size}-byte header "
                                  f"of an index file: truncated; {rerun}")
    magic, version, code, sequences, documents = _HEADER.unpack_from(buffer, 0)
    if magic != MAGIC:
        if magic.startswith(LEGACY_MAGIC):
            raise IndexedDatasetError(f"{path}: a legacy fairseq 'cached'/'lazy' index, not the "
                                      f"memory-mapped format; {rerun}")
        raise IndexedDatasetError(f"{path}: starts with {magic!r}, not {MAGIC!r}: not a Megatron-LM "
                                  f"indexed dataset index; check the path, or {rerun}")
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: index version {version}; only version {VERSION} "
                                  f"(Megatron-LM's) is supported; {rerun}")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: "
                                  f"{', '.join(f'{c} {np.dtype(t).name}' for c, t in DTYPE_CODES.items())}); "
                                  f"the file is damaged or not an index; {rerun}")
    if documents < 1:
        raise IndexedDatasetError(f"{path}: document count {documents}; it must be at least 1 "
                                  f"(document_indices starts with 0); {rerun}")
    expected = _HEADER.size + sequences * (4 + 8) + documents * 8
    if size != expected:
        if size == expected + sequences and sequences > 0:
            problem = (f"has {sequences} bytes after document_indices: the sequence modes of "
                       f"Megatron's multimodal format, which ptdp does not read")
        elif size < expected:
            problem = "is truncated"
        else:
            problem = f"has {size - expected:,} unexpected trailing bytes"
        raise IndexedDatasetError(
            f"{path}: {size:,} bytes, but its header ({sequences:,} sequences, {documents:,} "
            f"document indices) implies {expected:,}; the file {problem}; {rerun}")
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    offset = _HEADER.size
    lengths = np.frombuffer(buffer, dtype="<i4", count=sequences, offset=offset)
    offset += lengths.nbytes
    pointers = np.frombuffer(buffer, dtype="<i8", count=sequences, offset=offset)
    offset += pointers.nbytes
    document_indices = np.frombuffer(buffer, dtype="<i8", count=documents, offset=offset)
    return dtype, lengths, pointers, document_indices


def _check_index_arrays(path: str, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray,
                        document_indices: np.ndarray) -> int:
    """Check the index's invariants block by block; return the total token count."""
    rerun = "the index is damaged; rerun `ptdp preprocess` to rebuild it"
    sequences = len(lengths)
    if document_indices[0] != 0:
        raise IndexedDatasetError(f"{path}: document_indices starts at {document_indices[0]}, not 0; "
                                  f"{rerun}")
    for block in _blocks(len(document_indices) - 1):
        step = np.diff(document_indices[block.start:block.stop + 1])
        if (step < 0).any():
            document = block.start + int(np.argmax(step < 0))
            raise IndexedDatasetError(
                f"{path}: document_indices decrease at document {document} "
                f"({document_indices[document]} then {document_indices[document + 1]}); {rerun}")
    if document_indices[-1] != sequences:
        raise IndexedDatasetError(f"{path}: document_indices ends at {document_indices[-1]}, but there "
                                  f"are {sequences} sequences; {rerun}")
    total = 0  # tokens before the current block
    for block in _blocks(sequences):
        part = lengths[block].astype(np.int64)
        if (part < 0).any():
            sequence = block.start + int(np.argmax(part < 0))
            raise IndexedDatasetError(f"{path}: sequence {sequence} has negative length "
                                      f"{lengths[sequence]}; {rerun}")
        ends = np.cumsum(part) + total
        expected = (ends - part) * dtype.itemsize  # where each sequence starts, contiguous
        wrong = expected != pointers[block]
        if wrong.any():
            sequence = block.start + int(np.argmax(wrong))
            raise IndexedDatasetError(
                f"{path}: sequence {sequence} points to byte {pointers[sequence]:,} of the data "
                f"file, but the sequences before it end at byte {expected[sequence - block.start]:,} "
                f"(Megatron writes them contiguously); {rerun}")
        total = int(ends[-1])
    return total


# ---------------------------------------------------------------- writing

def _temporary_path(final: str) -> str:
    """A new file next to `final` (same file system, so a rename commits it),
    created with the process umask like an ordinary output file."""
    path = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    return path


def _fsync_directory(directory: str) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # not possible everywhere (e.g. Windows); the renames still happened
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


class IndexedDatasetWriter:
    """Writes a Megatron `.bin`/`.idx` pair. Use as a context manager, or call
    `finalize()` (commit) or `discard()` (remove the temporary files).

    `durable=False` skips the fsyncs before the commit; for temporary
    outputs only (a power loss could then leave a valid index over data the
    disk never received)."""

    def __init__(self, prefix: str | Path, dtype=np.uint16, *, durable: bool = True):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = data_file_path(prefix), index_file_path(prefix)
        self.dtype, self._code = _dtype_code(dtype, self.bin_path)
        self._durable = durable
        directory = os.path.dirname(os.path.abspath(self.bin_path))
        if not os.path.isdir(directory):
            raise IndexedDatasetError(f"{self.bin_path}: directory {directory} does not exist; "
                                      f"create it or choose another prefix")
        self._bin_tmp = _temporary_path(self.bin_path)
        self._bin = open(self._bin_tmp, "wb", buffering=1 << 20)
        self._lengths = array("i")        # int32, one per sequence
        self._documents = array("q", [0])  # int64, sequence count after each document
        self._done = False

    # -- adding

    def add_document(self, tokens) -> None:
        """One document made of one sequence (a list or 1-D array of ids)."""
        self.add_sequences_as_document([tokens])

    def add_sequences_as_document(self, sequences: Iterable) -> None:
        """One document made of several sequences (e.g. sentences); an empty
        list is a document without sequences (Megatron's empty document)."""
        self._check_open()
        arrays = [self._as_tokens(tokens) for tokens in sequences]
        for tokens in arrays:
            self._bin.write(memoryview(tokens))
            self._lengths.append(len(tokens))
        self._documents.append(len(self._lengths))

    def merge(self, other_prefix: str | Path) -> None:
        """Append every document of another finished dataset of the same dtype."""
        self._check_open()
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{index_file_path(other_prefix)}: dtype {other.dtype.name}, but "
                                      f"{self.bin_path} is being written as {self.dtype.name}; "
                                      f"merge datasets of one dtype")
        offset = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.astype(np.int32, copy=False).tobytes())
        self._documents.frombytes((other.document_indices[1:] + offset).astype(np.int64).tobytes())
        del other  # drop its maps before copying the bytes (and before a caller deletes the files)
        with open(data_file_path(other_prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, _COPY_BUFFER)

    def _as_tokens(self, tokens) -> np.ndarray:
        values = np.asarray(tokens)
        where = f"{self.bin_path}: document {len(self._documents) - 1}"
        if values.ndim != 1:
            raise IndexedDatasetError(f"{where}: tokens must be a 1-D sequence, got shape {values.shape}")
        if values.size == 0:
            return np.empty(0, self.dtype)
        if values.size > np.iinfo(np.int32).max:
            raise IndexedDatasetError(f"{where}: {values.size:,} tokens in one sequence; the index "
                                      f"stores lengths as int32; split it into several sequences")
        if values.dtype == self.dtype:
            return np.ascontiguousarray(values)
        if self.dtype.kind in "iu":
            if values.dtype.kind not in "iu":
                raise IndexedDatasetError(f"{where}: tokens must be integers, got {values.dtype}")
            info = np.iinfo(self.dtype)
            outside = (values < info.min) | (values > info.max)
            if outside.any():
                position = int(np.argmax(outside))
                raise IndexedDatasetError(
                    f"{where}: token {values[position]} at position {position} does not fit "
                    f"{self.dtype.name} ({info.min}..{info.max}); write with a wider dtype "
                    f"(best_fitting_dtype(vocab_size) gives int32 from 65,500 tokens on)")
        return values.astype(self.dtype)

    # -- committing

    def finalize(self) -> None:
        """Write the index and commit both files under their final names."""
        self._check_open()
        self._done = True
        try:
            self._bin.flush()
            if self._durable:
                os.fsync(self._bin.fileno())
            self._bin.close()
            idx_tmp = _temporary_path(self.idx_path)
        except BaseException:
            self._remove_temporaries()
            raise
        try:
            self._write_index(idx_tmp)
            # The index is the commit marker: remove an old one first, so no
            # moment shows an old index next to the new data file.
            if os.path.exists(self.idx_path):
                os.unlink(self.idx_path)
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(idx_tmp, self.idx_path)
        except BaseException:
            self._remove_temporaries(idx_tmp)
            raise
        if self._durable:
            _fsync_directory(os.path.dirname(os.path.abspath(self.idx_path)))

    def _write_index(self, path: str) -> None:
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.empty(0, np.int32)
        documents = np.frombuffer(self._documents, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(path, "wb") as file:
            file.write(_HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(documents)))
            for values, dtype in ((lengths, "<i4"), (pointers, "<i8"), (documents, "<i8")):
                file.write(memoryview(np.ascontiguousarray(values, dtype=dtype)))
            file.flush()
            if self._durable:
                os.fsync(file.fileno())

    def discard(self) -> None:
        """Stop without writing anything; remove the temporary files."""
        if self._done:
            return
        self._done = True
        self._bin.close()
        self._remove_temporaries()

    def _remove_temporaries(self, *more: str) -> None:
        for path in (self._bin_tmp, *more):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _check_open(self) -> None:
        if self._done:
            raise IndexedDatasetError(f"{self.bin_path}: the writer is already finalized or discarded")

    @property
    def num_documents(self) -> int:
        return len(self._documents) - 1

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.finalize()
        else:
            self.discard()


def write_documents(prefix: str | Path, documents: Sequence, dtype=np.uint16) -> None:
    """Write a list of documents (each a list/array of ids) in one call."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for tokens in documents:
            writer.add_document(tokens)
