"""The modes of the files and directories ptdp writes for a user to keep.

A file or directory made the ordinary way (open, mkdir) gets 0666 or 0777
less the user's umask, so whoever may read the user's other files may read
ptdp's checkpoints and exports too (0644 and 0755 under umask 022). Some
writers make private ones instead: safetensors writes through a 0600
temporary file and `tempfile.mkdtemp` makes a 0700 directory.
`give_ordinary_mode` puts such a path right once it is written.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask. Read from /proc where Linux has it, which changes
    nothing; elsewhere set and restored at once (a thread creating a file
    in between would see the temporary mask, so it is the fallback only)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ordinary_mode(is_directory: bool) -> int:
    """The mode open() or mkdir() would give a new file or directory."""
    return (0o777 if is_directory else 0o666) & ~umask()


def give_ordinary_mode(*paths: str | Path) -> None:
    """Set each path's mode to what an ordinarily created file or directory
    would have (symbolic links are left alone)."""
    mask = umask()
    for path in paths:
        if os.path.islink(path):
            continue
        os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)
