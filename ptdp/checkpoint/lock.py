"""One job at a time per --save directory.

Two jobs saving into one directory undo each other: a save clears the
`iter_*.partial` leftovers of killed saves, which is the other job's save in
progress, and their checkpoints mix in one lineage's place. So the job's
first rank holds an exclusive lock on `SAVE/.ptdp-save.lock` for the whole
run and writes into the file who holds it; a second job is refused before
launch (or, if it started in the same second, by its first rank) naming the
holder. The lock is flock(2)'s: the kernel releases it when the process ends,
however it ends, so a file left behind by a killed job locks nothing. A job
that ends removes the file; one that takes the lock checks that the file it
locked is still the one at that path (another job may have removed it
between the open and the lock), and otherwise tries again.
Where the file system has no locks (some network file systems), a warning
says so and the run goes on unguarded. The lock file is never followed if it
is a symbolic link (one planted there would have the job write where it
points), nor used if it is not a regular file: either is refused in one
paragraph, before launch.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import sys
from datetime import datetime, timezone
from pathlib import Path

from ptdp.errors import UserError

LOCK_FILE = ".ptdp-save.lock"


class SaveDirectoryInUse(UserError):
    """Another job holds the --save directory."""


class LockFileNotUsable(UserError):
    """SAVE/.ptdp-save.lock is a symbolic link or not a regular file."""


def _not_a_lock_file(path: Path) -> str | None:
    """Why `path` cannot be the lock file (None: it can, or it is not there)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        what = f"is a symbolic link{target}, which ptdp never follows there"
    else:
        what = "is not a regular file" + (" but a directory" if stat.S_ISDIR(mode) else "")
    return (f"--save {path.parent}: its lock file {path} {what}; ptdp creates that file itself, as "
            f"a regular file, to keep a second job from saving into the same directory. Remove "
            f"it (no job's lock is a link or a directory) and run again")


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 65536) or b"{}")
        return (f"process {record['pid']} on {record['host']} (started {record['started']}: "
                f"{record['command']})")
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return "another process (it has not said which yet)"


def _in_use(save: Path, holder: str) -> str:
    return (f"--save {save} is in use by another job, {holder}: two jobs saving into one directory "
            f"delete each other's saves in progress. Wait for it to end, or give this run another "
            f"--save")


def problem(save: str | Path) -> str | None:
    """Before launch: why --save cannot be taken now (None: it can)."""
    path = Path(save) / LOCK_FILE
    unusable = _not_a_lock_file(path)
    if unusable:
        return unusable
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # no lock file (or unreadable: taking it will say)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _in_use(Path(save), _holder(fd))
    except OSError:
        return None  # no locks on this file system: acquire warns
    finally:
        os.close(fd)  # (closing releases a lock the probe took)
    return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


class SaveLock:
    """Held by the job's first rank from start-up to exit."""

    def __init__(self, save: str | Path):
        self.fd: int | None = None
        directory = Path(save)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_FILE
        while True:
            unusable = _not_a_lock_file(self.path)  # planted after the check before launch
            if unusable:
                raise LockFileNotUsable(unusable)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                             0o644)
            except OSError as error:  # planted between the check and the open
                raise LockFileNotUsable(_not_a_lock_file(self.path) or (
                    f"--save {directory}: its lock file {self.path} cannot be opened "
                    f"({error.strerror or error})")) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise SaveDirectoryInUse(_in_use(directory, holder)) from None
            except OSError as error:
                os.close(fd)
                print(f"ptdp: warning: --save {save}: this file system cannot lock files "
                      f"({error.strerror or error}), so nothing stops another job from saving "
                      f"there at the same time", file=sys.stderr, flush=True)
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)  # removed by a job that just ended: lock the file now there
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                self.path.unlink()  # while still locked: a waiting job then retries
            except OSError:
                pass
            os.close(self.fd)  # releases the lock
            self.fd = None

    def __enter__(self) -> "SaveLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
