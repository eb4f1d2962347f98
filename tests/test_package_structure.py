"""The package's layering: no import cycle among ptdp's modules (also
through imports inside functions), and imports run only downwards, from the
command line to the launcher, training, the planner and conversion, to the
model and the data, to the parallel machinery, to the configuration and
the small modules everything shares (issues 15 and 25). Each checker is
also shown to fail on a small synthetic graph, so that a reintroduced cycle
or upward import cannot pass unnoticed."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ptdp"

# Top to bottom: a module may import modules of its own layer or of layers
# below it, never above. A module belongs to the layer of the longest prefix
# listed here that names it (a package names every module inside it); a
# module named by no prefix (ptdp.errors, ptdp.plural, ptdp.distributed, ...)
# is in the bottom layer. Cycles within a layer are the cycle check's.
LAYERS = (
    ("command line", ("ptdp.__main__", "ptdp.cli", "ptdp.commands")),
    ("programs", ("ptdp.launch", "ptdp.train", "ptdp.perf", "ptdp.interop", "ptdp.generate")),
    ("model and data", ("ptdp.model", "ptdp.data", "ptdp.checkpoint")),
    ("parallel", ("ptdp.parallel",)),
    ("foundation", ("ptdp.config", "ptdp.schedules", "ptdp.device")),
)
# Within the programs' layer, what each may still not import, and why.
NOT_WITHIN_A_LAYER = {
    # The launcher starts the ranks that train, and training never imports it
    # back: a rank needs only its environment and process group, from
    # ptdp.distributed.
    "ptdp.train": ("ptdp.launch",),
    # Nor does the launcher import training (ptdp.perf.calibrate uses it): the
    # stop requests it passes on live below both, in ptdp.stop_requests.
    "ptdp.launch": ("ptdp.train",),
    # Training reports the paper's FLOPs from ptdp.perf (issue 15); perf never
    # imports training back.
    "ptdp.perf": ("ptdp.train",),
    # Conversion and generation read and write checkpoints through
    # ptdp.checkpoint, the format below the programs, never through training.
    "ptdp.interop": ("ptdp.train",),
    "ptdp.generate": ("ptdp.train",),
}
# Nothing imports the command line: ptdp.__main__ (`python -m ptdp`) is its
# only way in, and ptdp.cli the only way to the commands (ptdp.commands,
# one module per `ptdp X`). Each command-line package, and who may import it.
IMPORTS_OF_THE_COMMAND_LINE = {"ptdp.cli": {"ptdp.__main__"},
                               "ptdp.commands": {"ptdp.__main__", "ptdp.cli"}}
# (importer, imported) pairs that break the order, each with why. None today.
EXCEPTIONS: dict[tuple[str, str], str] = {}


# ------------------------------------------------------------------ the import graph

def module_name(path: Path, root: Path) -> str:
    """ptdp/train/loop.py -> ptdp.train.loop; a package's __init__ is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str = "ptdp") -> set[str]:
    """Every name `path` imports from `package`, at any depth of its code
    (inside functions too); `from a import b` names both a and a.b, which is
    a module when b is one."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == package:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names
                         if alias.name.split(".")[0] == package)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the package at `root` it imports."""
    files: dict[str, list[Path]] = {}
    for path in root.rglob("*.py"):
        files.setdefault(module_name(path, root), []).append(path)
    return {name: {m for path in paths for m in _imports(path, root.name)
                   if m in files and m != name}
            for name, paths in files.items()}


def external_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the top-level names of what it imports from outside the
    package at `root`, at any depth of its code (inside functions too)."""
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        names = found.setdefault(module_name(path, root), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
        names.discard(root.name)
    return found


# ------------------------------------------------------------------ the checkers

def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        trail.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        trail.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def reaches(graph: dict[str, set[str]], external: dict[str, set[str]], package: str,
            forbidden: str) -> list[str]:
    """Each module of `package` that imports `forbidden`, itself or through
    the modules it imports (at any depth), as the chain of imports."""
    found = []
    for start in sorted(m for m in graph if _within(m, package)):
        trail, seen = {start: [start]}, {start}
        queue = [start]
        while queue:
            module = queue.pop(0)
            if forbidden in external.get(module, ()):
                found.append(" -> ".join(trail[module] + [forbidden]))
                break
            for nxt in sorted(graph.get(module, ())):
                if nxt not in seen:
                    seen.add(nxt)
                    trail[nxt] = trail[module] + [nxt]
                    queue.append(nxt)
    return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str, layers=LAYERS) -> int:
    """The index of `module`'s layer in `layers` (the last: the bottom one)."""
    best, depth = len(layers) - 1, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if _within(module, prefix) and len(prefix) > depth:
                best, depth = index, len(prefix)
    return best


def upward_imports(graph: dict[str, set[str]], layers=LAYERS, exceptions=EXCEPTIONS,
                   not_within=NOT_WITHIN_A_LAYER,
                   command_line: dict[str, set[str]] = IMPORTS_OF_THE_COMMAND_LINE) -> list[str]:
    """Every import that breaks the layer order, as 'a (layer) imports b (layer)'."""
    found = []
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        if (importer, imported) in exceptions:
            continue
        upward = layer_of(imported, layers) < layer_of(importer, layers)
        forbidden = any(_within(importer, prefix) and _within(imported, other)
                        for prefix, others in not_within.items() for other in others)
        of_command_line = any(_within(imported, package) and not _within(importer, package)
                              and importer not in importers
                              for package, importers in command_line.items())
        if upward or forbidden or of_command_line:
            found.append(f"{importer} ({layers[layer_of(importer, layers)][0]}) imports {imported} "
                         f"({layers[layer_of(imported, layers)][0]})")
    return found


# ------------------------------------------------------------------ ptdp

def test_no_import_cycle_among_ptdp_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_run_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_schedules_import_no_torch():
    """ptdp.schedules is data: no module of it imports torch, itself or
    through what it imports."""
    assert reaches(import_graph(), external_imports(), "ptdp.schedules", "torch") == []


def test_the_layer_order_names_every_package_and_the_exceptions_exist():
    graph = import_graph()
    packages = {m for m in graph if (ROOT.parent / m.replace(".", "/") / "__init__.py").is_file()}
    named = {p for _, prefixes in LAYERS for p in prefixes}
    # every subpackage of ptdp is placed on purpose, not by default
    assert {p for p in packages if p.count(".") == 1} <= named
    for importer, imported in EXCEPTIONS:  # a stale exception would hide a new one
        assert imported in graph.get(importer, ()), (importer, imported)


def test_the_rules_say_what_the_issue_asks():
    """cli above launch, train, perf; train above model, data, checkpoint and
    parallel; model above parallel; the training loop below the launcher;
    checkpoints beside the model (never importing training), and conversion
    and generation beside training without importing it."""
    for upper, lower in (("ptdp.cli", "ptdp.launch"), ("ptdp.cli", "ptdp.train"),
                         ("ptdp.cli", "ptdp.perf"), ("ptdp.train", "ptdp.model"),
                         ("ptdp.train", "ptdp.data"), ("ptdp.train", "ptdp.parallel"),
                         ("ptdp.model", "ptdp.parallel"), ("ptdp.train", "ptdp.checkpoint"),
                         ("ptdp.interop", "ptdp.checkpoint"), ("ptdp.checkpoint", "ptdp.parallel")):
        assert layer_of(upper) < layer_of(lower), (upper, lower)
    assert layer_of("ptdp.checkpoint") == layer_of("ptdp.model") == layer_of("ptdp.data")
    assert "ptdp.launch" in NOT_WITHIN_A_LAYER["ptdp.train"]
    assert "ptdp.train" in NOT_WITHIN_A_LAYER["ptdp.launch"]
    assert "ptdp.train" in NOT_WITHIN_A_LAYER["ptdp.interop"]
    assert "ptdp.train" in NOT_WITHIN_A_LAYER["ptdp.generate"]


# ------------------------------------------------------------------ the checkers fail when they should

def test_the_cycle_check_finds_a_cycle_in_a_synthetic_graph():
    graph = {"ptdp.a": {"ptdp.b"}, "ptdp.b": {"ptdp.c"}, "ptdp.c": {"ptdp.a"}, "ptdp.d": {"ptdp.a"}}
    assert find_cycle(graph) == ["ptdp.a", "ptdp.b", "ptdp.c", "ptdp.a"]
    assert find_cycle({"ptdp.a": {"ptdp.b"}, "ptdp.b": set(), "ptdp.c": {"ptdp.a", "ptdp.b"}}) is None


def test_the_layer_check_finds_upward_imports_in_a_synthetic_graph():
    graph = {"ptdp.data.loader": {"ptdp.train.checkpoint", "ptdp.config"},
             "ptdp.parallel.pipeline.split": {"ptdp.model.gpt"},
             "ptdp.train.loop": {"ptdp.launch", "ptdp.cli", "ptdp.data.loader"},
             "ptdp.perf.plan": {"ptdp.train.report"}, "ptdp.__main__": {"ptdp.cli"}}
    assert upward_imports(graph) == [
        "ptdp.data.loader (model and data) imports ptdp.train.checkpoint (programs)",
        "ptdp.parallel.pipeline.split (parallel) imports ptdp.model.gpt (model and data)",
        "ptdp.perf.plan (programs) imports ptdp.train.report (programs)",
        "ptdp.train.loop (programs) imports ptdp.cli (command line)",
        "ptdp.train.loop (programs) imports ptdp.launch (programs)",
    ]
    exception = {("ptdp.data.loader", "ptdp.train.checkpoint"): "why"}
    assert len(upward_imports(graph, exceptions=exception)) == 4


def test_the_layer_check_finds_imports_of_the_commands_in_a_synthetic_graph():
    """Only ptdp.cli (and ptdp.__main__) import a command's module; one
    command's module may share another's (both are the command line)."""
    graph = {"ptdp.cli": {"ptdp.commands.plan"}, "ptdp.__main__": {"ptdp.cli"},
             "ptdp.commands.plan": {"ptdp.perf.plan.planner", "ptdp.commands.schedule"},
             "ptdp.commands.schedule": set(), "ptdp.perf.plan.planner": set(),
             "ptdp.train.loop": {"ptdp.commands.schedule"},
             "ptdp.perf.simulate.timeline": {"ptdp.commands"}}
    assert upward_imports(graph) == [
        "ptdp.perf.simulate.timeline (programs) imports ptdp.commands (command line)",
        "ptdp.train.loop (programs) imports ptdp.commands.schedule (command line)",
    ]
    graph["ptdp.commands.schedule"] = {"ptdp.cli"}
    assert upward_imports(graph)[0] == \
        "ptdp.commands.schedule (command line) imports ptdp.cli (command line)"


def test_the_layer_check_finds_the_launcher_importing_training_in_a_synthetic_graph():
    graph = {"ptdp.launch": {"ptdp.train.stopping", "ptdp.stop_requests", "ptdp.distributed"},
             "ptdp.train.stopping": {"ptdp.stop_requests"}}
    assert upward_imports(graph) == [
        "ptdp.launch (programs) imports ptdp.train.stopping (programs)"]
    graph["ptdp.launch"].discard("ptdp.train.stopping")
    assert upward_imports(graph) == []


def test_the_torch_check_finds_torch_at_any_depth_in_a_synthetic_package(tmp_path):
    package = tmp_path / "ptdp"
    (package / "schedules").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "schedules" / "__init__.py").write_text("")
    (package / "schedules" / "kinds.py").write_text("from ptdp import helpers\n")
    (package / "schedules" / "plain.py").write_text("import math\n")
    (package / "helpers.py").write_text("def f():\n    import torch.nn\n    return torch\n")
    graph, external = import_graph(package), external_imports(package)
    assert reaches(graph, external, "ptdp.schedules", "torch") == [
        "ptdp.schedules.kinds -> ptdp.helpers -> torch"]
    (package / "helpers.py").write_text("import math\n")
    assert reaches(import_graph(package), external_imports(package), "ptdp.schedules",
                   "torch") == []


def test_the_layer_check_finds_checkpoints_or_conversion_importing_training():
    """A checkpoint module importing training is an upward import; conversion
    or generation importing training breaks their rule within the layer,
    while their imports of ptdp.checkpoint pass."""
    graph = {"ptdp.checkpoint.snapshot": {"ptdp.train.loss_range", "ptdp.model.gpt"},
             "ptdp.interop.convert": {"ptdp.train.checkpoint", "ptdp.checkpoint.store"},
             "ptdp.generate": {"ptdp.train.loop", "ptdp.checkpoint.store"},
             "ptdp.train.resume": {"ptdp.checkpoint.state"}}
    assert upward_imports(graph) == [
        "ptdp.checkpoint.snapshot (model and data) imports ptdp.train.loss_range (programs)",
        "ptdp.generate (programs) imports ptdp.train.loop (programs)",
        "ptdp.interop.convert (programs) imports ptdp.train.checkpoint (programs)",
    ]


def test_the_graph_sees_imports_inside_functions_and_submodules(tmp_path):
    package = tmp_path / "ptdp"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from ptdp.top import VALUE\n")
    (package / "low" / "leaf.py").write_text("def f():\n    from ptdp import top\n    return top\n")
    (package / "top.py").write_text("from ptdp.low import leaf\nVALUE = 1\n")
    graph = import_graph(package)
    assert graph == {"ptdp": set(), "ptdp.low": {"ptdp.top"}, "ptdp.low.leaf": {"ptdp", "ptdp.top"},
                     "ptdp.top": {"ptdp.low", "ptdp.low.leaf"}}
    assert find_cycle(graph) in (["ptdp.low", "ptdp.top", "ptdp.low"],
                                 ["ptdp.low.leaf", "ptdp.top", "ptdp.low.leaf"])
    assert upward_imports(graph, layers=(("top", ("ptdp.top",)), ("low", ("ptdp.low",)))) == [
        "ptdp.low (low) imports ptdp.top (top)", "ptdp.low.leaf (low) imports ptdp.top (top)"]


# ------------------------------------------------------------------ earlier rules (issue 15)

def _perf_graph() -> dict[str, set[str]]:
    """ptdp.perf's modules, its sub-packages' included, and what each imports of them."""
    modules = {module_name(p, ROOT): p for p in (ROOT / "perf").rglob("*.py")}
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
    assert "def model_flops_per_iteration" in (ROOT / "perf" / "analytic" / "flops.py").read_text()
    for path in (ROOT / "perf").rglob("*.py"):
        assert not any(m.startswith("ptdp.train") for m in _imports(path)), path


def test_training_does_not_import_the_command_line():
    for path in (ROOT / "train").glob("*.py"):
        assert not any(m == "ptdp.cli" or m.startswith("ptdp.cli.") for m in _imports(path)), path.name


def _readme_layers() -> list[tuple[str, set[str]]]:
    """The README's map of the layers (the table after `<!-- layers -->`):
    each row's name and the packages it names in its second column."""
    readme = (ROOT.parent / "README.md").read_text()
    table = readme.split("<!-- layers -->\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = []
    for row in table:
        name, packages = [cell.strip() for cell in row.strip("|").split("|")][:2]
        rows.append((name, set(re.findall(r"`(ptdp\.[\w.]+)`", packages))))
    return rows


def test_the_readme_map_of_the_layers_is_the_one_enforced_here():
    """README.md's architecture table lists the layers of LAYERS, top to
    bottom, each with its packages, and names the within-layer rules."""
    rows = _readme_layers()
    assert [name for name, _ in rows] == [name for name, _ in LAYERS]
    for (name, shown), (_, enforced) in zip(rows, LAYERS):
        assert shown == set(enforced), name
    readme = (ROOT.parent / "README.md").read_text()
    for importer, forbidden in NOT_WITHIN_A_LAYER.items():
        for module in forbidden:
            assert f"not `{module}` from `{importer}`" in readme, (importer, module)
