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
says so and the run goes on unguarded.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

from ptdp.errors import UserError

LOCK_FILE = ".ptdp-save.lock"


class SaveDirectoryInUse(UserError):
    """Another job holds the --save directory."""


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 65536) or b"{}")
        return (f"process {record['pid']} on {record['host']} (started {record['started']}: "
                f"{record['command']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not said which yet)"


def _in_use(save: Path, holder: str) -> str:
    return (f"--save {save} is in use by another job, {holder}: two jobs saving into one directory "
            f"delete each other's saves in progress. Wait for it to end, or give this run another "
            f"--save")


def problem(save: str | Path) -> str | None:
    """Before launch: why --save cannot be taken now (None: it can)."""
    path = Path(save) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
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
