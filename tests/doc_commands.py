"""The commands README.md and docs/*.md show, for the tests that run them.

A fenced block that shows commands is named by the line before it:
`<!-- commands: NAME -->` for commands to run, `<!-- output: NAME -->` for a
terminal session (`$ command` lines followed by what they print). Tests get
a block's commands with `commands("NAME")` or `session("NAME")`, so what they
run is what the page says; tests/test_docs_commands.py checks that every
command shown is in a named block and every named block is run by a test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAME = re.compile(r"<!-- (commands|output): ([\w-]+) -->")
# A line that starts a command: a program a user runs from the checkout.
COMMAND = re.compile(r"^(\$ )?(\.venv/bin/|\./scripts/|ptdp |python |torchrun |srun )")


@dataclass
class Block:
    page: Path
    line: int              # 1-based line of the opening fence
    language: str          # after the fence: bash, console, text, or ""
    kind: str | None       # "commands", "output" or None (unnamed)
    name: str | None
    lines: list[str]

    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    found = []
    for page in pages:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].startswith("```"):
                start, language = i, lines[i][3:].strip()
                j = i + 1
                while j < len(lines) and not lines[j].startswith("```"):
                    j += 1
                label = NAME.fullmatch(lines[i - 1].strip()) if i > 0 else None
                found.append(Block(page, start + 1, language, label and label.group(1),
                                   label and label.group(2), lines[start + 1:j]))
                i = j + 1
            else:
                i += 1
    return found


def named(name: str) -> Block:
    matches = [block for block in blocks() if block.name == name]
    assert len(matches) == 1, f"{len(matches)} blocks named {name!r} in README.md and docs/"
    return matches[0]


def commands(name: str) -> list[str]:
    """The commands of block `name`: continuation lines joined, comment lines
    and blank lines left out (a trailing `# comment` is bash's to drop)."""
    block = named(name)
    assert block.kind == "commands", f"{block.where()}: {name!r} is not a commands block"
    joined, current = [], ""
    for line in block.lines:
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            joined.append(current.strip())
            current = ""
    return joined


def session(name: str) -> list[tuple[str, str]]:
    """Block `name` of a terminal session: (command, what it prints) pairs."""
    block = named(name)
    assert block.kind == "output", f"{block.where()}: {name!r} is not an output block"
    pairs: list[tuple[str, list[str]]] = []
    for line in block.lines:
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        else:
            assert pairs, f"{block.where()}: output before the first '$ ' command"
            pairs[-1][1].append(line)
    return [(command, "\n".join(output)) for command, output in pairs]
