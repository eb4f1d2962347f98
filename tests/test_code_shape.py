"""The shape DESIGN.md asks of the code (issue 39): no module over 700
lines, no function over 100, a schedule kind's name spelled in at most 3
modules (its record, its generator and one more), and perf/ sorted into
sub-packages with at most 10 modules at its top level. Each checker is also
shown failing on a small synthetic package, so a regression cannot pass
unnoticed."""

import ast
import re
from functools import lru_cache
from pathlib import Path

from ptdp.schedules.kinds import KINDS

ROOT = Path(__file__).resolve().parents[1] / "ptdp"
MOST_LINES_PER_MODULE = 700
MOST_LINES_PER_FUNCTION = 100
MOST_MODULES_SPELLING_A_KIND = 3
MOST_PERF_TOP_LEVEL_MODULES = 10


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


@lru_cache(maxsize=None)
def _strings(path: Path) -> frozenset:
    return frozenset(node.value for node in ast.walk(_tree(path))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str))


def long_modules(root: Path, most: int = MOST_LINES_PER_MODULE) -> list[str]:
    return [f"{path.relative_to(root.parent)}: {n} lines"
            for path in sorted(root.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > most]


def long_functions(root: Path, most: int = MOST_LINES_PER_FUNCTION) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > most:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} "
                                 f"{node.name}: {length} lines")
    return found


def modules_spelling(root: Path, name: str) -> list[str]:
    """The modules with a string literal that is exactly `name` (how code
    tests for a kind by its name, as `kind == "zbv"` did)."""
    return [str(path.relative_to(root.parent)) for path in sorted(root.rglob("*.py"))
            if name in _strings(path)]


def top_level_modules(package: Path) -> list[str]:
    return sorted(path.name for path in package.glob("*.py"))


# ------------------------------------------------------------------ ptdp

def test_no_module_is_over_700_lines():
    assert long_modules(ROOT) == []


def test_no_function_is_over_100_lines():
    assert long_functions(ROOT) == []


def test_each_schedule_kind_is_spelled_in_at_most_three_modules():
    assert len(KINDS) >= 5
    for name in KINDS:
        modules = modules_spelling(ROOT, name)
        assert 1 <= len(modules) <= MOST_MODULES_SPELLING_A_KIND, (name, modules)


def test_perf_keeps_at_most_ten_modules_at_its_top_level():
    modules = top_level_modules(ROOT / "perf")
    assert len(modules) <= MOST_PERF_TOP_LEVEL_MODULES, modules
    assert {p.name for p in (ROOT / "perf").iterdir() if (p / "__init__.py").is_file()} >= {
        "analytic", "price", "simulate", "plan", "calibrate"}


# ------------------------------------------------------------------ the checkers fail when they should

def test_the_checkers_find_what_breaks_the_shape_in_a_synthetic_package(tmp_path):
    package = tmp_path / "ptdp"
    (package / "perf").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(101))
    (package / "long.py").write_text(f"def f():\n{body}\n" + "#\n" * 600)
    (package / "short.py").write_text("def g():\n    return 'zbv'\n")
    for i in range(11):
        (package / "perf" / f"m{i}.py").write_text("")
    assert long_modules(package) == ["ptdp/long.py: 702 lines"]
    assert long_functions(package) == ["ptdp/long.py:1 f: 102 lines"]
    assert modules_spelling(package, "zbv") == ["ptdp/short.py"]
    assert modules_spelling(package, "zb") == []
    assert len(top_level_modules(package / "perf")) == 11
    assert re.fullmatch(r"m\d+\.py", top_level_modules(package / "perf")[0])


# ------------------------------------------------------------------ docs/architecture.md

def modules_named_in_the_map(text: str) -> set[str]:
    """The module paths of docs/architecture.md's tree ("## Every module"):
    an entry is a line indented two spaces per level whose first word ends
    in / (a package) or .py; deeper-indented lines continue a description."""
    block = text.split("## Every module", 1)[1].split("```", 2)[1]
    named, stack = set(), []
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if not match or len(match.group(1)) >= 20 or len(match.group(1)) % 2:
            continue
        depth, word = len(match.group(1)) // 2, match.group(2)
        if not (word.endswith("/") or word.endswith(".py")):
            continue
        stack[depth:] = [word]
        if word.endswith(".py") and stack[0] == "ptdp/":
            named.add("".join(stack))
    return named


def test_the_architecture_page_names_every_module():
    modules = {str(path.relative_to(ROOT.parent)) for path in ROOT.rglob("*.py")
               if path.name != "__init__.py"}
    named = modules_named_in_the_map((ROOT.parent / "docs" / "architecture.md").read_text())
    assert sorted(modules - named) == [], "modules docs/architecture.md does not name"
    assert sorted(named - modules) == [], "docs/architecture.md names modules that do not exist"


def test_the_map_reader_follows_the_tree():
    text = ("## Every module\n```\nptdp/\n  cli.py    routes\n  train/    the loop\n"
            "    loop.py   the loop; it calls\n                       model.py's forward\n"
            "  model/\n    gpt.py\nbench/\n  gpu.py\n```\n")
    assert modules_named_in_the_map(text) == {"ptdp/cli.py", "ptdp/train/loop.py",
                                              "ptdp/model/gpt.py"}
