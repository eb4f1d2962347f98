"""bench/RESULTS.md: each benchmark appends its table under its own heading."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def append_results(heading: str, block: str) -> None:
    """Append `block` at the end of the `heading` section (a "## " line),
    creating the section, or the file, when missing."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if heading not in text:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{block}"
    else:
        start = text.index(heading) + len(heading)
        following = text.find("\n## ", start)
        end = len(text) if following < 0 else following + 1
        section = text[:end].rstrip("\n") + f"\n\n{block}"
        text = section + ("\n" + text[end:] if following >= 0 else "")
    RESULTS.write_text(text)


def publish(heading: str, block: str, *, write: bool) -> None:
    """Print a benchmark's table; with --write also append it to RESULTS.md."""
    print(block)
    if write:
        append_results(heading, block)
        print(f"appended to bench/{RESULTS.name}", file=sys.stderr)


def cpu_name() -> str:
    """The processor's model name, for the record of where a figure was taken."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
