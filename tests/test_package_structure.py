"""The package's layering (issue 15): the paper's FLOP formula lives in
ptdp/perf (training's report imports it, not the reverse), the modules of
ptdp/perf import each other without a cycle (also through imports inside
functions), and nothing in ptdp/train imports the command-line side."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ptdp"


def _imports(path: Path) -> set[str]:
    """Every ptdp module `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ptdp"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ptdp"))
    return found


def _perf_graph() -> dict[str, set[str]]:
    modules = {f"ptdp.perf.{p.stem}": p for p in (ROOT / "perf").glob("*.py") if p.stem != "__init__"}
    return {name: {m for m in _imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_perf_modules_import_each_other_without_a_cycle():
    graph = _perf_graph()
    state: dict[str, str] = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in graph[node]:
            assert state.get(nxt) != "open", "import cycle: " + " -> ".join(trail + [node, nxt])
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_the_flop_formula_lives_in_perf():
    report = (ROOT / "train" / "report.py").read_text()
    assert "def model_flops_per_iteration" not in report
    assert "def model_flops_per_iteration" in (ROOT / "perf" / "flops.py").read_text()
    for path in (ROOT / "perf").glob("*.py"):
        assert not any(m.startswith("ptdp.train") for m in _imports(path)), path.name


def test_training_does_not_import_the_command_line():
    for path in (ROOT / "train").glob("*.py"):
        assert not any(m == "ptdp.cli" or m.startswith("ptdp.cli.") for m in _imports(path)), path.name
