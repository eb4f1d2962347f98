"""Errors the user can fix, and telling a rank's own failure from the echo of
another rank's.

When one rank of a job fails, its peers fail too: their next collective finds
the connection closed, or waits until the collective timeout. Those second
failures say nothing about the cause, and they often come first (the failing
rank tears down its process group while unwinding). `RankFailure` is what a
failed rank reports; `lost_peer` marks the echoes, so that a launcher can show
the failure that started it all.

User errors (a full disk, a damaged checkpoint, a setting that cannot work)
are shown as one paragraph, `ptdp: error: rank R: <message>`, without a Python
traceback; the traceback is kept in a file for bug reports, and printed when
PTDP_TRACEBACK=1. Everything else is a bug and keeps its traceback.

The traceback file is new and private: made by `tempfile.mkstemp` (a random
name, O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) in the temporary directory, a
directory every user may write. A predictable name there, opened the
ordinary way, would follow a symbolic link another user planted at it and
overwrite whatever file the job may write.

Under torchrun, whose summary of a failed job (with its own traceback) is
the last thing printed, `report_to_torchrun` writes the worker's error file
(TORCHELASTIC_ERROR_FILE) so that the summary's root cause shows ptdp's
message rather than "To enable traceback see: ...". An error that every
rank finds alike before the process group exists (a setting that cannot
work) is printed by one rank per node (`prints_shared_errors`), not by each.

This module imports nothing of ptdp or torch: the command line, the launcher
and every rank use it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence, TextIO


class UserError(Exception):
    """A problem the user can fix; printed as one paragraph without a traceback."""


class DivergenceError(UserError):
    """Training can no longer make progress (non-finite loss or gradients)."""


# ptdp's error types that predate UserError, named rather than imported: their
# modules import torch and one another, and this module must stay importable
# from anywhere. tests/test_launch.py checks that each one still exists.
USER_ERROR_TYPES = frozenset({
    "ptdp.config.ConfigError",
    "ptdp.checkpoint.errors.CheckpointError",
    "ptdp.data.loader.DataSettingsError",
    "ptdp.data.gpt_dataset.DataError",
    "ptdp.data.tokenizer.TokenizerError",
    "ptdp.data.indexed.IndexedDatasetError",
})

# Disk and permission problems: the user frees space, fixes a path or its
# permissions. (ENOENT is left out: a path ptdp computed wrongly is a bug.)
USER_ERRNOS = frozenset(code for code in (
    errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG, errno.EIO, errno.EACCES,
    errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG) if code is not None)

# Libraries written in Rust (safetensors) report an OSError's code in the text.
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")

# torch.distributed's error types: the classes, or gloo's plain RuntimeError
# whose text starts with the source location inside gloo.
_DISTRIBUTED_TYPES = frozenset({"DistError", "DistBackendError", "DistNetworkError",
                                "DistStoreError"})
_COLLECTIVE_LIBRARY = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)
# What a rank sees when a peer died, hung or tore down its process group.
_LOST_PEER = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|timed out|timeout"
    r"|got 0 bytes|connection was likely closed|remote (process|worker)|communicator was aborted"
    r"|clients joined|ncclRemoteError", re.IGNORECASE)
# "[/path/to/third_party/gloo/gloo/transport/tcp/pair.cc:553] " before a gloo message.
_SOURCE_LOCATION = re.compile(r"^\[[^\]\s]+:\d+\]\s*")

TRACEBACK_VARIABLE = "PTDP_TRACEBACK"


# ------------------------------------------------------------------ classification

def is_lost_peer_text(type_names: Sequence[str], message: str) -> bool:
    """Whether an exception of these classes (its type's MRO names) with this
    text reports a peer that vanished, hung or closed its connection."""
    from_collectives = bool(_DISTRIBUTED_TYPES.intersection(type_names)) or (
        "RuntimeError" in type_names and bool(_COLLECTIVE_LIBRARY.search(message)))
    return from_collectives and bool(_LOST_PEER.search(message))


def is_lost_peer(error: BaseException) -> bool:
    return is_lost_peer_text([cls.__name__ for cls in type(error).__mro__], str(error))


def exception_chain(error: BaseException) -> list[BaseException]:
    """`error`, then what it was raised from or while handling, and so on:
    the last one is the first exception this process raised."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and not any(current is seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__
                                        else current.__context__)
    return chain


def followed_a_lost_peer(error: BaseException) -> bool:
    """Whether this process's failure began with losing a peer (so it is a
    consequence of another rank's failure), judged by the first exception."""
    return is_lost_peer(exception_chain(error)[-1])


def cause_to_report(error: BaseException) -> BaseException:
    """The exception that says what went wrong: the outermost one that is not
    an echo of a lost peer (a rank that hit a full disk and then lost its
    connection while cleaning up reports the full disk)."""
    return next((e for e in exception_chain(error) if not is_lost_peer(e)), error)


def _os_error_code(error: BaseException) -> int | None:
    if isinstance(error, OSError):
        return error.errno
    match = _OS_ERROR_CODE.search(str(error))
    return int(match.group(1)) if match else None


def is_user_error(error: BaseException) -> bool:
    """A problem the user can fix: ptdp's own error types and disk or
    permission problems. Anything else is a bug and keeps its traceback."""
    if isinstance(error, UserError):
        return True
    if any(f"{cls.__module__}.{cls.__qualname__}" in USER_ERROR_TYPES for cls in type(error).__mro__):
        return True
    return _os_error_code(error) in USER_ERRNOS


def describe(error: BaseException) -> str:
    """The message shown for `error`: a user error's text, an OSError's file
    and reason, a lost peer's text without gloo's source location, or a
    bug's `Type: text`."""
    if isinstance(error, OSError) and error.strerror:
        where = "" if error.filename is None else str(error.filename)
        if error.filename2 is not None:
            where += f" -> {error.filename2}"
        return f"{where}: {error.strerror}" if where else error.strerror
    if is_user_error(error):
        return str(error) or type(error).__name__
    if is_lost_peer(error):  # gloo's RuntimeError says nothing the text does not
        return _SOURCE_LOCATION.sub("", str(error))
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# ------------------------------------------------------------------ a rank's report

@dataclass(frozen=True)
class RankFailure:
    """What a failed rank tells whoever launched it."""
    rank: int
    time: float        # time.time() when the rank caught the exception
    lost_peer: bool    # a consequence of another rank's failure
    user_error: bool   # shown without a traceback
    message: str       # the cause, for the user
    traceback: str     # the full traceback, for bug reports

    @classmethod
    def from_exception(cls, rank: int, error: BaseException) -> RankFailure:
        cause = cause_to_report(error)
        return cls(rank=rank, time=time.time(), lost_peer=followed_a_lost_peer(error),
                   user_error=is_user_error(cause), message=describe(cause),
                   traceback="".join(traceback.format_exception(type(error), error,
                                                                error.__traceback__)))


# Set when this process joins a job as a rank: an error after that happened
# on that rank (ptdp.distributed.init_process_group sets it).
_process_rank: int | None = None


def set_process_rank(rank: int | None) -> None:
    global _process_rank
    _process_rank = rank


def process_rank() -> int | None:
    """The rank this process joined a job as, or None before it did."""
    return _process_rank


# ------------------------------------------------------------------ showing a user error

# This user's newest traceback files kept in the temporary directory: each
# failed run writes one per rank, and without a bound they pile up there.
KEEP_TRACEBACKS = 20
TRACEBACK_PREFIX = "ptdp-error-"


def keep_traceback(rank: int, traceback_text: str) -> Path:
    """Write `traceback_text` to a new private file in the temporary
    directory (see the module's notes); returns its path, after removing
    this user's older traceback files beyond the newest KEEP_TRACEBACKS.
    Raises OSError."""
    descriptor, path = tempfile.mkstemp(prefix=f"{TRACEBACK_PREFIX}rank{rank}-", suffix=".txt")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(traceback_text)
    except BaseException:
        os.unlink(path)
        raise
    _remove_old_tracebacks(Path(path).parent, KEEP_TRACEBACKS)
    return Path(path)


def _remove_old_tracebacks(directory: Path, keep: int) -> None:
    """Remove all but the newest `keep` of this user's traceback files in
    `directory`: regular files only (a link or another user's file is never
    touched), and quietly, since several ranks may prune at once."""
    mine = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if not (entry.name.startswith(TRACEBACK_PREFIX) and entry.name.endswith(".txt")):
            continue
        try:
            status = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(status.st_mode) and status.st_uid == os.getuid():
            mine.append((status.st_mtime_ns, entry.path))
    for _, old in sorted(mine)[:-keep]:
        try:
            os.unlink(old)
        except OSError:
            pass


TORCHRUN_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def report_to_torchrun(message: str, detail: str | None = None, echo: bool = False) -> bool:
    """Under torchrun: write this worker's error file, in the format of
    torch.distributed.elastic's ErrorHandler.record_exception, with
    `message` as the failure's text and `detail` (default: `message`) where
    torchrun's summary shows the traceback. Created exclusively, not
    following a symbolic link (torchrun names a file in its own private
    directory; nothing else writes it). Whether it was written.

    `echo`: another rank printed this same error (`prints_shared_errors`).
    The file still carries the whole message (torchrun may see this rank fail
    first, and stop the other before its file is written), but dated two
    seconds later: torchrun's root cause is the earliest failure (in whole
    seconds), so it names the rank that printed, even when that rank read
    the clock just after a second began and this one just before."""
    path = os.environ.get(TORCHRUN_ERROR_FILE)
    if not path:
        return False
    record = {"message": {"message": message, "extraInfo": {
        "py_callstack": detail if detail is not None else message,
        "timestamp": str(int(time.time()) + (2 if echo else 0))}}}  # torchrun reads an integer
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                             | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(record, file)  # ASCII: torchrun reads it in the locale's encoding
    except OSError:  # the summary then says what it would have said anyway
        return False
    return True


def _environment_integer(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


def prints_shared_errors(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints an error that every rank of its job finds
    alike: a setting that cannot work, found by each rank before the process
    group exists (so before the ranks could agree on who speaks).

    Under torchrun or SLURM (ptdp.distributed.detect_env's variables) that is
    local rank 0 of each node, not only the job's first rank, which is known
    as early: the checks read files (--config, the data, the tokenizer, --load's
    checkpoint) that each node sees for itself, so a node whose files differ
    must still say why its ranks stop, while the ranks of one node, with one
    command line and one file system, fail alike. Without a local rank (RANK
    and WORLD_SIZE set by hand) only the job's first rank prints. Any other
    process (ptdp's own launcher checks before starting the ranks) prints; so
    does one whose variables are not integers: an error said twice is better
    than one never said."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:  # torchrun, or set by hand
        names = ("LOCAL_RANK", "SLURM_LOCALID", "RANK")
    elif "SLURM_PROCID" in environ and (_environment_integer(environ, "SLURM_NTASKS") or 1) > 1:
        names = ("SLURM_LOCALID", "SLURM_PROCID")
    else:
        return True
    for name in names:
        if name in environ:
            return _environment_integer(environ, name) in (0, None)
    return True


def _wants_traceback() -> bool:
    return os.environ.get(TRACEBACK_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def print_user_error(rank: int, message: str, traceback_text: str,
                     stream: TextIO | None = None) -> None:
    """Where the traceback went (with PTDP_TRACEBACK=1: the traceback itself),
    then the message as one paragraph, last, where the eye lands."""
    stream = stream if stream is not None else sys.stderr
    if _wants_traceback():
        print(traceback_text.rstrip(), file=stream)
    else:
        try:
            path = keep_traceback(rank, traceback_text)
        except OSError:  # the full disk may hold the temporary directory too
            print(f"ptdp: set {TRACEBACK_VARIABLE}=1 to print the traceback", file=stream)
        else:
            print(f"ptdp: the traceback of rank {rank} is in {path} ({TRACEBACK_VARIABLE}=1 "
                  f"prints it instead)", file=stream)
    print(f"ptdp: error: rank {rank}: {message}", file=stream, flush=True)
