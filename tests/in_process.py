"""`ptdp train` through ptdp's entry point in the test process, for jobs
refused before launch (the `no_launch` fixture fails a test if a rank would
start): cheaper than a process of its own, the same code and messages."""

from __future__ import annotations


def train_refused(argv, capsys) -> tuple[int, str, str]:
    """`ptdp train ARGV`: (exit status, stdout, stderr)."""
    from ptdp.cli import main

    capsys.readouterr()
    try:
        status = main(["train", *argv])
    except SystemExit as leaving:  # a usage error, as `python -m ptdp` exits with it
        status = leaving.code
    out, err = capsys.readouterr()
    return status, out, err
