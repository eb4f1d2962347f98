"""Checking, before anything runs, a path a command will write.

Every flag that names an output (`ptdp train --save`, `--metrics-file`,
`--timeline`, `--loss-curve`, `--tensorboard-dir`, `--data-cache-path`;
`ptdp plan --plot`; `ptdp preprocess --output-prefix`) goes through
`output_path_problems`, so that a path that cannot be written is refused with
the flag's name before a process starts, not as a traceback at the first
write, which for a loss curve comes after the whole run.

A path is refused when
- it is a symbolic link to nothing (said with where it points), or a
  directory on the way to it is;
- a file output is a directory, or an existing file that is neither a
  regular file nor a stream the user may write (a terminal, /dev/null,
  /dev/stdout, a named pipe: `--metrics-file /dev/stdout` streams the
  records; sockets and block devices are refused);
- a directory output is a file, or a file is where a directory would be made;
- its directory does not exist (a file's; a directory output is created with
  its parents) or lies on one of the kernel's pseudo file systems (/proc,
  /sys, /dev, ...: they look writable to root, but hold no files);
- a write is refused: an existing file is opened for appending (which
  changes nothing), and a new one's directory gets a probe file created
  exclusively under a random name and removed at once. os.access alone would
  not do: root passes it everywhere, and it knows nothing of read-only mounts.

Nothing here imports torch: `ptdp plan` uses it.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile

# The kernel's file systems that are views of its state, not storage: a
# file cannot be created there (or writing one changes a kernel setting).
PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
    "securityfs", "configfs", "pstore", "bpf", "efivarfs", "fusectl", "mqueue", "binfmt_misc",
    "autofs", "nsfs", "rpc_pipefs", "hugetlbfs", "selinuxfs"})
PROBE_PREFIX = ".ptdp-write-test-"


def output_path_problems(flag: str, path: str, *, directory: bool = False,
                         suffix: str | tuple[str, ...] | None = None) -> list[str]:
    """Why `flag path` cannot be written (empty when it can). `directory`:
    the flag names a directory, created with its parents where missing;
    else a file, whose directory must exist. `suffix` (".png"): the file
    format the writer produces, or the formats it can (".png", ".svg"),
    chosen by the path's suffix."""
    if not path:
        return []
    named = f"{flag} {path}"
    suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix or ())
    if suffixes and not directory and not path.lower().endswith(suffixes):
        if len(suffixes) == 1:
            return [f"{named}: the file written is a {suffixes[0].lstrip('.').upper()}; use a "
                    f"{suffixes[0]} path"]
        return [f"{named}: the format follows the path's suffix; use one of "
                f"{', '.join(suffixes)}"]
    if not directory and path.endswith(("/", os.sep)):
        return [f"{named} ends with '/': give a file path, not a directory"]
    dangling = _dangling_link(path)
    if dangling:
        return [f"{named}: {dangling}; give another path, or make the link point to "
                f"{'a directory' if directory else 'a file'} that exists"]
    problem = (_directory_problem if directory else _file_problem)(path)
    return [f"{named}: {problem}"] if problem else []


def _dangling_link(path: str) -> str | None:
    """Where `path`, or a directory above it, is a symbolic link to nothing."""
    current = os.path.abspath(path)
    while True:
        if os.path.islink(current) and not os.path.exists(current):
            target = os.readlink(current)
            where = "it" if current == os.path.abspath(path) else current
            return f"{where} is a symbolic link to {target}, which does not exist"
        if os.path.exists(current):
            return None
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def _file_problem(path: str) -> str | None:
    if os.path.exists(path):
        real = os.path.realpath(path)
        mode = os.stat(real).st_mode
        if stat.S_ISDIR(mode):
            return "is a directory; give a file path"
        if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):  # a stream: written as it is
            return None if os.access(real, os.W_OK) else "cannot be written by this user"
        if not stat.S_ISREG(mode):
            return (f"is not a regular file (a {_kind(mode)}); give the path of a file to write, "
                    f"or leave the flag out")
        where = _pseudo_file_system(os.path.dirname(os.path.abspath(path)), real)
        if where:
            return where
        try:
            os.close(os.open(real, os.O_WRONLY | os.O_APPEND))  # writes nothing
        except OSError as error:
            return f"cannot be written ({error.strerror or error}); choose a file you can write"
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        return f"directory {parent} {what}; create it or choose another path"
    return _pseudo_file_system(parent) or _cannot_create_in(parent)


def _directory_problem(path: str) -> str | None:
    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        return "is a file; give a directory"
    existing = target
    while not os.path.exists(existing):  # the nearest directory that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return (f"{existing} is a file, so the directory cannot be created under it; "
                f"choose another path")
    return _pseudo_file_system(existing) or _cannot_create_in(existing)


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISFIFO(mode):
        return "named pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _cannot_create_in(directory: str) -> str | None:
    """Why no file can be created in `directory`, found by creating one."""
    try:
        descriptor, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=directory)
    except OSError as error:
        return (f"no file can be created in {directory} ({error.strerror or error}); choose a "
                f"directory you can write to")
    os.close(descriptor)
    os.unlink(probe)
    return None


def _pseudo_file_system(directory: str, real: str | None = None) -> str | None:
    """A refusal when `directory` (or `real`, the file it leads to) lies on
    one of the kernel's pseudo file systems."""
    kind = file_system_type(real or directory)
    if kind in PSEUDO_FILE_SYSTEMS:
        return (f"{directory} is on the kernel's {kind} file system, which holds no files; "
                f"choose a path on a disk")
    return None


_ESCAPE = re.compile(r"\\([0-7]{3})")


def file_system_type(path: str) -> str | None:
    """The type of the file system `path` is on (from /proc/self/mountinfo:
    the last-mounted of the longest mount points above it), or None where
    that cannot be read."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    best, best_type = -1, None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        mount = _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), parts[4])
        inside = mount == "/" or real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:
            best, best_type = len(mount), rest.split()[0]
    return best_type
