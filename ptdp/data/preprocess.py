"""`ptdp preprocess`: tokenize text into Megatron-LM indexed datasets.

Inputs are plain-text files (each file is one document) or JSON lines
(`.jsonl`/`.json`: one JSON object per line, the text under each of
`--json-keys`; blank lines are skipped). Each key gets its own dataset,
`PREFIX_{key}_document.bin/.idx` (Megatron-LM's names), one sequence per
document, in input order. As in Megatron-LM's preprocess_data.py, a
document whose text encodes to no tokens is written as a document without
sequences and gets no end-of-document token; but inputs that hold no text
at all (for some key) are refused, and nothing is written.

The work is done in two passes over chunks of the inputs (byte ranges that
end at line breaks): a check pass that parses every line, so a bad input
is reported (file and line) before anything is written, and an encode
pass. With several workers each chunk is encoded in a spawned process into
a temporary dataset next to the output, and the main process merges the
chunks in order, so the output is byte-identical for any worker count.
Workers rebuild the tokenizer from its settings (`TokenizerSpec`); no
tokenizer object crosses a process boundary.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ptdp.data.indexed import (IndexedDatasetWriter, best_fitting_dtype, data_file_path,
                               index_file_path)
from ptdp.data import tokenizer_record
from ptdp.data.tiktoken_tokenizer import TiktokenSettings
from ptdp.data.tokenizer import TEXT_TOKENIZER_TYPES, build_tokenizer, hf_tokenizer_file
from ptdp.output_paths import output_path_problems
from ptdp.status import Periodic

JSON_SUFFIXES = (".jsonl", ".json")
MAX_CHUNK_BYTES = 4 << 20   # a few seconds of GPT-2 encoding per chunk
MIN_CHUNK_BYTES = 64 << 10
CHUNKS_PER_WORKER = 8       # enough chunks that uneven ones still balance
MAX_REPORTED_PROBLEMS = 10


class PreprocessError(ValueError):
    """Inputs or settings that preprocessing cannot use; says what to change."""


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build a tokenizer (`build_tokenizer`'s arguments): what the
    workers receive instead of a tokenizer object."""

    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    tiktoken: TiktokenSettings | None = None  # TikTokenizer's settings

    def __post_init__(self) -> None:
        if self.tokenizer_type == "HuggingFaceTokenizer":  # a model's directory: its tokenizer.json
            object.__setattr__(self, "tokenizer_model", hf_tokenizer_file(self.tokenizer_model))

    def build(self):
        return build_tokenizer(self.tokenizer_type, vocab_file=self.vocab_file,
                               merge_file=self.merge_file, tokenizer_model=self.tokenizer_model,
                               tiktoken=self.tiktoken)


@dataclass(frozen=True)
class Piece:
    """Bytes `start`..`end` of one input file; JSON-lines pieces end at a line break."""

    path: str
    start: int
    end: int
    json_lines: bool

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PieceReport:
    lines: int
    documents: int
    problems: tuple[tuple[int, str], ...]  # (line within the piece, 1-based; what is wrong)


def output_prefix_for_key(output_prefix: str | Path, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def is_json_lines(path: str | Path) -> bool:
    return Path(path).suffix.lower() in JSON_SUFFIXES


# ---------------------------------------------------------------- reading inputs

def _read(piece: Piece) -> bytes:
    with open(piece.path, "rb") as file:
        file.seek(piece.start)
        data = file.read(piece.size)
    if len(data) != piece.size:
        raise PreprocessError(f"{piece.path} changed while being preprocessed (it is shorter than "
                              f"before); run again on files that nobody is writing")
    return data


# json.loads turns an escaped UTF-16 pair into one character, but keeps half
# of one ("\ud800" alone) as a surrogate code point, which no tokenizer can encode.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _texts_from_line(line: bytes, keys: Sequence[str]) -> list[str]:
    """The texts under `keys` in one JSON line; ValueError says what is wrong."""
    try:
        record = json.loads(line)
    except ValueError as error:  # includes invalid UTF-8
        raise ValueError(f"not valid JSON ({error}); each line must be one JSON object") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ValueError("values nested too deeply for a document; each line must be one JSON "
                         "object whose text is a string") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {_json_type(record)}, not an object with key {keys[0]!r}")
    texts = []
    for key in keys:
        if key not in record:
            present = ", ".join(repr(k) for k in list(record)[:8]) or "none"
            raise ValueError(f"no key {key!r} (keys: {present}); choose the keys with --json-keys")
        text = record[key]
        if not isinstance(text, str):
            raise ValueError(f"{key!r} is a JSON {_json_type(text)}, not a string")
        lone = _LONE_SURROGATE.search(text)
        if lone:
            raise ValueError(
                f"{key!r} holds a lone surrogate, the escape \\u{ord(lone.group()):04x} at "
                f"character {lone.start():,}: half of a UTF-16 pair, which is no character and has "
                f"no UTF-8 encoding (the text was cut or converted badly); write the whole pair "
                f"(e.g. \\ud83d\\ude00) or remove the escape")
        texts.append(text)
    return texts


def _documents(piece: Piece, keys: Sequence[str], data: bytes | None = None,
               report: list | None = None) -> Iterator[list[str]]:
    """Each document's texts, one per key. With `report`, bad lines are
    recorded there as (line within the piece, problem) and skipped;
    without, they raise (the check pass has passed, so the file changed)."""
    data = _read(piece) if data is None else data
    changed = "did the file change during preprocessing? run again on files nobody is writing"
    if not piece.json_lines:
        try:
            yield [data.decode("utf-8")]
        except UnicodeDecodeError as error:
            problem = f"not UTF-8 text (byte {error.start:,}: {error.reason}); convert it to UTF-8"
            if report is None:
                raise PreprocessError(f"{piece.path}: {problem}; {changed}") from None
            report.append((1, problem))
        return
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            texts = _texts_from_line(line, keys)
        except ValueError as error:
            if report is None:
                raise PreprocessError(f"{piece.path}, line {number} after byte {piece.start:,}: "
                                      f"{error}; {changed}") from None
            report.append((number, str(error)))
            if len(report) >= MAX_REPORTED_PROBLEMS:
                return
            continue
        yield texts


def check_chunk(chunk: Sequence[Piece], keys: Sequence[str]) -> list[PieceReport]:
    """Parse every document of a chunk; report its lines, documents and problems."""
    reports = []
    for piece in chunk:
        data = _read(piece)
        problems: list[tuple[int, str]] = []
        documents = sum(1 for _ in _documents(piece, keys, data, problems))
        lines = 1
        if piece.json_lines:  # a last line without a line break still counts
            lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        reports.append(PieceReport(lines, documents, tuple(problems)))
    return reports


# ---------------------------------------------------------------- planning

def _plan_pieces(path: str, chunk_bytes: int) -> list[Piece]:
    size = os.path.getsize(path)
    if not is_json_lines(path):
        return [Piece(path, 0, size, False)]
    pieces, start = [], 0
    with open(path, "rb") as file:
        while start < size:
            file.seek(min(start + chunk_bytes, size))
            file.readline()  # move the cut to the next line break
            end = min(file.tell(), size)
            pieces.append(Piece(path, start, end, True))
            start = end
    return pieces or [Piece(path, 0, 0, True)]


def plan_chunks(inputs: Sequence[str], chunk_bytes: int) -> list[tuple[Piece, ...]]:
    """Cut the inputs into chunks of about `chunk_bytes`, in input order;
    small files share a chunk."""
    chunks, current, current_bytes = [], [], 0
    for path in inputs:
        for piece in _plan_pieces(path, chunk_bytes):
            current.append(piece)
            current_bytes += piece.size
            if current_bytes >= chunk_bytes:
                chunks.append(tuple(current))
                current, current_bytes = [], 0
    if current:
        chunks.append(tuple(current))
    return chunks


def default_chunk_bytes(total_bytes: int, workers: int) -> int:
    share = total_bytes // (workers * CHUNKS_PER_WORKER)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, share))


def _check_settings(inputs: Sequence[str], output_prefix: str, keys: Sequence[str],
                    workers: int) -> list[str]:
    problems = []
    if not inputs:
        problems.append("--input needs at least one file")
    for path in inputs:
        if not os.path.exists(path):
            problems.append(f"--input {path}: no such file")
        elif not os.path.isfile(path):
            problems.append(f"--input {path}: not a file (give the text or JSON-lines files themselves)")
        elif not os.access(path, os.R_OK):
            problems.append(f"--input {path}: not readable")
    if not keys:
        problems.append("--json-keys needs at least one key")
    if len(set(keys)) != len(keys):
        problems.append(f"--json-keys {' '.join(keys)}: a key is repeated")
    for key in keys:
        if not key or "/" in key or os.sep in key:
            problems.append(f"--json-keys {key!r}: a key becomes part of the output file name; "
                            f"use one without '/'")
    text_inputs = [p for p in inputs if not is_json_lines(p)]
    if text_inputs and len(keys) > 1:
        problems.append(f"--input {text_inputs[0]} is plain text (one document, no keys) but "
                        f"--json-keys names {len(keys)} keys; give JSON-lines inputs or one key")
    if workers < 1:
        problems.append(f"--workers {workers}: use 1 or more")
    if not os.path.basename(output_prefix):
        problems.append(f"--output-prefix {output_prefix!r} names a directory; add a file name "
                        f"prefix, e.g. {os.path.join(output_prefix, 'corpus')}")
    else:
        directory = os.path.dirname(os.path.abspath(output_prefix))
        if os.path.isdir(directory) and not os.access(directory, os.W_OK):
            problems.append(f"--output-prefix {output_prefix}: directory {directory} is not writable")
        else:  # (created when missing) a file in the way, a pseudo file system, a read-only
            # mount, root's os.access: the shared check, with its probe file, tells
            problems += [problem.replace(f"--output-prefix {directory}:",
                                         f"--output-prefix {output_prefix}:", 1)
                         for problem in output_path_problems("--output-prefix", directory,
                                                             directory=True)]
    outputs = {os.path.abspath(f(output_prefix_for_key(output_prefix, key)))
               for key in keys for f in (data_file_path, index_file_path)}
    for path in sorted(outputs):
        if os.path.isdir(path):
            problems.append(f"--output-prefix {output_prefix}: {path} is a directory, where the "
                            f"output file goes; choose another prefix")
    for path in inputs:
        if os.path.abspath(path) in outputs:
            problems.append(f"--input {path} would be overwritten by the output; choose another "
                            f"--output-prefix")
    return problems


# ---------------------------------------------------------------- encoding

def _encoded(chunk: Sequence[Piece], keys: Sequence[str], tokenizer,
             append_eod: bool) -> Iterator[list[list[int]]]:
    """Each document's token ids, one list per key."""
    for piece in chunk:
        for texts in _documents(piece, keys):
            encoded = []
            for text in texts:
                tokens = tokenizer.encode(text)
                if tokens and append_eod:  # Megatron-LM: no end-of-document after an empty one
                    tokens.append(tokenizer.eod)
                encoded.append(tokens)
            yield encoded


def _write(writers: Sequence[IndexedDatasetWriter], documents: Iterator[list[list[int]]],
           token_counts: list[int]) -> int:
    count = 0
    for encoded in documents:
        for k, (writer, tokens) in enumerate(zip(writers, encoded)):
            if tokens:
                writer.add_document(tokens)
            else:
                writer.add_sequences_as_document([])
            token_counts[k] += len(tokens)
        count += 1
    return count


@dataclass(frozen=True)
class EncodeJob:
    """What a worker needs for one chunk: plain, picklable settings."""

    chunk: tuple[Piece, ...]
    keys: tuple[str, ...]
    tokenizer: TokenizerSpec
    append_eod: bool
    dtype: str
    prefixes: tuple[str, ...]  # temporary output prefix per key


def encode_chunk_to_files(job: EncodeJob) -> tuple[int, list[int]]:
    """Worker side: encode one chunk into temporary datasets, one per key."""
    tokenizer = job.tokenizer.build()  # cached per process by build_tokenizer
    token_counts = [0] * len(job.keys)
    writers = [IndexedDatasetWriter(prefix, job.dtype, durable=False) for prefix in job.prefixes]
    try:
        documents = _write(writers, _encoded(job.chunk, job.keys, tokenizer, job.append_eod),
                           token_counts)
        for writer in writers:
            writer.finalize()
    finally:
        for writer in writers:
            writer.discard()
    return documents, token_counts


# ---------------------------------------------------------------- progress

@contextlib.contextmanager
def _progress(enabled: bool, total_bytes: int) -> Iterator[Callable[[str, int, int], None]]:
    """Yields advance(stage, documents, bytes): a rich bar per stage on stderr
    when enabled and stderr is a terminal; when enabled without one (a log),
    a plain line every few seconds per stage; else nothing."""
    if not enabled:
        yield lambda stage, documents, nbytes: None
        return
    if not sys.stderr.isatty():
        stages = {"check": Periodic("checking the input", total_bytes, "bytes"),
                  "encode": Periodic("tokenizing", total_bytes, "bytes")}
        yield lambda stage, documents, nbytes: stages[stage].advance(nbytes)
        return
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    columns = (TextColumn("{task.description:>6}"), BarColumn(),
               TextColumn("{task.fields[documents]:>12,} documents"), TransferSpeedColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        tasks = {stage: bar.add_task(stage, total=total_bytes, documents=0)
                 for stage in ("check", "encode")}

        def advance(stage: str, documents: int, nbytes: int) -> None:
            task = tasks[stage]
            done = bar.tasks[task].fields["documents"]
            bar.update(task, advance=nbytes, documents=done + documents)

        yield advance


# ---------------------------------------------------------------- the whole job

def preprocess(inputs: Sequence[str | Path], output_prefix: str | Path,
               tokenizer: TokenizerSpec | str = "GPT2BPETokenizer", *,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               progress: bool = True, chunk_bytes: int | None = None) -> dict:
    """Tokenize `inputs` into `{output_prefix}_{key}_document.bin/.idx` per key.

    `tokenizer` is a TokenizerSpec or a tokenizer type name. Raises
    PreprocessError (or TokenizerError) and writes nothing on bad inputs or
    settings, or on inputs with no text under some key. Returns documents, tokens (all keys),
    tokens_per_key, input_bytes, seconds, workers (used), dtype and files
    (the paths written). Beside each dataset, PREFIX.tokenizer-record.json
    records the tokenizer (ptdp.data.tokenizer_record), which training
    checks."""
    started = time.perf_counter()
    inputs = [str(p) for p in inputs]
    output_prefix = str(output_prefix)
    keys = tuple(json_keys)
    spec = TokenizerSpec(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if not isinstance(spec, TokenizerSpec):
        raise TypeError(f"preprocess() takes the tokenizer's settings, TokenizerSpec(...) or a type "
                        f"name, not {type(tokenizer).__name__}: workers build their own tokenizer")
    problems = _check_settings(inputs, output_prefix, keys, workers)
    if spec.tokenizer_type == "NullTokenizer":
        problems.append("--tokenizer-type NullTokenizer has no text to tokenize (it is for data that "
                        f"is token ids already); use one of {', '.join(TEXT_TOKENIZER_TYPES)}")
    if problems:
        raise PreprocessError("; ".join(problems))
    built = spec.build()  # a bad tokenizer setting fails here, before any work
    dtype = best_fitting_dtype(built.vocab_size)

    total_bytes = sum(os.path.getsize(p) for p in inputs)
    chunks = plan_chunks(inputs, chunk_bytes or default_chunk_bytes(total_bytes, workers))
    workers = max(1, min(workers, len(chunks)))
    with contextlib.ExitStack() as stack:
        imap = map
        if workers > 1:
            imap = stack.enter_context(_worker_pool(workers))
        advance = stack.enter_context(_progress(progress, total_bytes))
        try:
            documents = _check_all(chunks, keys, imap, advance)
            if documents == 0:  # nothing to encode: say so before creating any file
                raise PreprocessError(_empty_input_problem(inputs, keys, documents))
            token_counts = _encode_all(chunks, keys, spec, built, append_eod, dtype, output_prefix,
                                       documents, imap if workers > 1 else None, advance, inputs)
        except BrokenProcessPool:
            raise PreprocessError(f"a worker process died (out of memory, or killed?); nothing was "
                                  f"written; run again, with fewer --workers than {workers}") from None
    files = [f(output_prefix_for_key(output_prefix, key)) for key in keys
             for f in (data_file_path, index_file_path, tokenizer_record.record_path)]
    return dict(documents=documents, tokens=sum(token_counts),
                tokens_per_key=dict(zip(keys, token_counts)), input_bytes=total_bytes,
                seconds=time.perf_counter() - started, workers=workers, dtype=dtype.name, files=files)


@contextlib.contextmanager
def _worker_pool(workers: int) -> Iterator[Callable]:
    """Yields an ordered map over `workers` processes. Spawned, not forked:
    safe whatever threads this process runs. An executor, not a Pool: a
    worker that dies raises BrokenProcessPool instead of hanging. On an
    error the chunks not yet started are cancelled rather than awaited."""
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_leave_interrupts_to_the_parent)
    interrupted = False

    def ordered_map(fn, items):
        # The executor starts its workers while the first jobs are handed
        # over; a worker inherits this thread's blocked Ctrl-C, so one that
        # is still starting (importing, before its initializer) cannot die
        # of the terminal's Ctrl-C with a traceback. Meanwhile a Ctrl-C for
        # this process waits, and arrives as soon as the jobs are handed over.
        with _interrupts_held_for_new_workers():
            return executor.map(fn, items)

    try:
        yield ordered_map
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if interrupted:
            _stop_at_once(executor)
        else:
            executor.shutdown(wait=True, cancel_futures=True)


def _stop_at_once(executor: ProcessPoolExecutor) -> None:
    """After Ctrl-C: the workers ignore it (below), so stop them now, not
    after their chunk. Killing them under the executor's own threads (its
    manager, its queue's feeder) may make those trip over the dead pipes and
    print a traceback onto the terminal, racing "interrupted"; such errors
    are the expected result of the kill and are dropped until the threads
    have been joined."""
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: None
    try:
        for process in list((getattr(executor, "_processes", None) or {}).values()):
            process.terminate()
        executor.shutdown(wait=True, cancel_futures=True)  # joins the manager, which joins the feeder
    finally:
        threading.excepthook = previous_hook


@contextlib.contextmanager
def _interrupts_held_for_new_workers() -> Iterator[None]:
    """SIGINT blocked in this thread (where it can be: not on Windows), so
    that processes started meanwhile begin with it blocked; afterwards the
    thread's previous mask returns, and with it any Ctrl-C that came."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _leave_interrupts_to_the_parent() -> None:
    """Workers ignore Ctrl-C (which the terminal sends to the whole process
    group): the parent closes the progress bar, stops them and says
    "interrupted" on a line of its own. Otherwise every worker writes a
    KeyboardInterrupt traceback onto the bar's line, and the parent, racing
    them, may report a dead worker instead. A worker starts with SIGINT
    blocked (_interrupts_held_for_new_workers); once it is ignored, the block
    is lifted, which discards a Ctrl-C that came during the start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@dataclass(frozen=True)
class _CheckJob:
    keys: tuple[str, ...]

    def __call__(self, chunk: tuple[Piece, ...]) -> list[PieceReport]:
        return check_chunk(chunk, self.keys)


def _check_all(chunks, keys, imap, advance) -> int:
    """The check pass: count the documents, or raise PreprocessError listing
    the bad lines as file:line."""
    problems, documents = [], 0
    lines_before: dict[str, int] = {}  # per file: lines in its earlier pieces
    for chunk, reports in zip(chunks, imap(_CheckJob(keys), chunks)):
        for piece, report in zip(chunk, reports):
            base = lines_before.get(piece.path, 0)
            lines_before[piece.path] = base + report.lines
            documents += report.documents
            for line, problem in report.problems:
                where = f"{piece.path}:{base + line}" if piece.json_lines else piece.path
                problems.append(f"{where}: {problem}")
        advance("check", sum(report.documents for report in reports), sum(p.size for p in chunk))
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        raise PreprocessError("bad input, nothing written:\n  " + "\n  ".join(shown)
                              + (f"\n  ... and {more} more" if more else ""))
    return documents


def _empty_input_problem(inputs: Sequence[str], empty_keys: Sequence[str], documents: int) -> str:
    """Why there is nothing to write. A dataset without tokens would only
    fail later, when training cannot draw a single sample from it."""
    names = " ".join(inputs)
    advice = "give input with text"
    if documents == 0:
        what = "no documents (the input is empty, or has only blank lines)"
    elif not any(is_json_lines(path) for path in inputs):
        what = "no text (every input file is empty)"
    else:
        many = documents > 1
        what = (f"no text under --json-keys {' '.join(empty_keys)}: the {documents:,} "
                f"document{'s' if many else ''} {'have' if many else 'has'} only empty text there")
        advice += ", or name the key that holds it with --json-keys"
    return f"--input {names}: {what}; nothing was written; {advice}"


def _encode_all(chunks, keys, spec, tokenizer, append_eod, dtype, output_prefix, expected_documents,
                pool_imap, advance, inputs) -> list[int]:
    """The encode pass: in this process (pool_imap None) or in the pool's
    workers, chunk datasets merged in order. Commits the outputs last, and
    only if every key's dataset holds tokens."""
    token_counts = [0] * len(keys)
    writers: list[IndexedDatasetWriter] = []
    scratch = None
    fields = tokenizer_record.describe(tokenizer, spec.tokenizer_type, vars(spec))
    # The input passed its checks: the output's directory is made if missing.
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    try:
        for key in keys:
            writers.append(IndexedDatasetWriter(output_prefix_for_key(output_prefix, key), dtype))
        documents = 0
        if pool_imap is None:
            for chunk in chunks:
                count = _write(writers, _encoded(chunk, keys, tokenizer, append_eod), token_counts)
                documents += count
                advance("encode", count, sum(p.size for p in chunk))
        else:
            # Scratch space next to the output: same file system; removed below.
            scratch = tempfile.mkdtemp(prefix=".ptdp-preprocess-",
                                       dir=os.path.dirname(os.path.abspath(output_prefix)))
            jobs = [EncodeJob(chunk, keys, spec, append_eod, dtype.str,
                              tuple(os.path.join(scratch, f"chunk{i:06d}_key{k}")
                                    for k in range(len(keys))))
                    for i, chunk in enumerate(chunks)]
            for job, (count, counts) in zip(jobs, pool_imap(encode_chunk_to_files, jobs)):
                for writer, prefix in zip(writers, job.prefixes):  # imap keeps the order
                    writer.merge(prefix)
                    os.unlink(data_file_path(prefix))
                    os.unlink(index_file_path(prefix))
                token_counts = [a + b for a, b in zip(token_counts, counts)]
                documents += count
                advance("encode", count, sum(p.size for p in job.chunk))
        if documents != expected_documents:
            raise PreprocessError(f"the inputs held {expected_documents:,} documents when checked but "
                                  f"{documents:,} when encoded: did a file change during "
                                  f"preprocessing? nothing was written; run again")
        empty_keys = [key for key, count in zip(keys, token_counts) if count == 0]
        if empty_keys:
            raise PreprocessError(_empty_input_problem(inputs, empty_keys, documents))
        # The tokenizer is recorded beside each dataset (ptdp.data.tokenizer_record):
        # an old record goes before the new data is committed, the new one after.
        for writer in writers:
            tokenizer_record.remove_record(writer.prefix)
            writer.finalize()
            tokenizer_record.write_record(writer.prefix, fields, append_eod=append_eod)
        return token_counts
    finally:
        for writer in writers:
            writer.discard()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
