"""Regenerate ptdp/config/megatron_flag_list.py: every flag of Megatron-LM's
`pretrain_gpt.py` parser, read from a Megatron-LM checkout without importing
it (Megatron-LM imports torch, Transformer Engine, triton...).

    python scripts/megatron_flag_list.py /path/to/Megatron-LM [--check]

The parser is `add_megatron_arguments` in megatron/training/arguments.py plus,
where NVIDIA Model Optimizer is installed, `add_modelopt_args`
(megatron/post_training/arguments.py). Its flags come from two kinds of code,
both read with `ast`:

- `add_argument('--flag', ...)` calls in the functions `add_megatron_arguments`
  reaches (functions that are never called add nothing; `--no-flag` too for
  argparse.BooleanOptionalAction; the flags of optional packages' groups,
  such as NVIDIA's kitchen quantization, are counted whether or not the
  package is installed);
- `ArgumentGroupFactory(SomeConfig, exclude=[...]).build_group(...)`, which
  turns each field of a dataclass (its bases' fields first) into a flag the
  way megatron/training/argument_utils.py does: `--field-name`; for a bool
  whose default is not False, `--no-field-name` and `--disable-field-name`;
  a field's metadata `argparse_meta` `arg_names` replaces them; fields with
  `init=False` or in `exclude` give none.

`--check` compares with the list in the repository instead of writing it
(exit status 1 when they differ).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent.parent / "ptdp" / "config" / "megatron_flag_list.py"
ENTRY_POINTS = (("megatron/training/arguments.py", "add_megatron_arguments"),
                ("megatron/post_training/arguments.py", "add_modelopt_args"))


class Module:
    """One parsed source file of the checkout: its functions, classes and the
    names it imports (name -> module path)."""

    def __init__(self, root: Path, path: Path):
        self.root, self.path = root, path
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.functions = {node.name: node for node in self.tree.body
                          if isinstance(node, ast.FunctionDef)}
        self.classes = {node.name: node for node in self.tree.body
                        if isinstance(node, ast.ClassDef)}
        self.imports: dict[str, str] = {}
        package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from ..x import y
                    parts = package.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{base}.{alias.name}"


class Checkout:
    def __init__(self, root: Path):
        self.root = root
        self._modules: dict[Path, Module] = {}

    def module(self, path: Path) -> Module:
        if path not in self._modules:
            self._modules[path] = Module(self.root, path)
        return self._modules[path]

    def find_class(self, dotted: str, depth: int = 0) -> tuple[Module, ast.ClassDef]:
        """The class `package.module.Name`, following re-exports in __init__.py."""
        if depth > 10:
            raise LookupError(dotted)
        module_name, name = dotted.rsplit(".", 1)
        relative = Path(*module_name.split("."))
        for candidate in (self.root / relative.with_suffix(".py"), self.root / relative / "__init__.py"):
            if candidate.is_file():
                module = self.module(candidate)
                if name in module.classes:
                    return module, module.classes[name]
                if name in module.imports:
                    return self.find_class(module.imports[name], depth + 1)
        # `from a.b import c` where c is a submodule: Name is then c.Name
        raise LookupError(dotted)


def _constant(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


def _is_bool(annotation: ast.AST | None) -> bool:
    """bool, Optional[bool] or `bool | None` (argument_utils strips Optional)."""
    if annotation is None:
        return False
    text = ast.unparse(annotation).replace(" ", "")
    return text in ("bool", "Optional[bool]", "bool|None", "None|bool", "typing.Optional[bool]")


def _dataclass_flags(checkout: Checkout, module: Module, cls: ast.ClassDef,
                     exclude: set[str]) -> list[str]:
    flags: list[str] = []
    for base in cls.bases:  # the bases' fields come first, as dataclasses.fields orders them
        name = ast.unparse(base)
        target = module.imports.get(name) or (
            f"{'.'.join(module.path.relative_to(checkout.root).with_suffix('').parts)}.{name}"
            if name in module.classes else None)
        if target is None:
            continue  # object, Generic[...], a class outside the checkout
        try:
            base_module, base_cls = checkout.find_class(target)
        except LookupError:
            continue
        flags += _dataclass_flags(checkout, base_module, base_cls, exclude)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name, annotation = node.target.id, ast.unparse(node.annotation)
        if name in exclude or "ClassVar" in annotation or "KW_ONLY" in annotation:
            continue
        default, names = node.value, None
        if isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith("field"):
            keywords = {k.arg: k.value for k in node.value.keywords}
            if _constant(keywords.get("init", ast.Constant(True))) is False:
                continue
            default = keywords.get("default")
            meta = keywords.get("metadata")
            if isinstance(meta, ast.Dict):
                for key, value in zip(meta.keys, meta.values):
                    if key is not None and _constant(key) == "argparse_meta" and \
                            isinstance(value, ast.Dict):
                        for inner_key, inner in zip(value.keys, value.values):
                            if inner_key is not None and _constant(inner_key) == "arg_names":
                                names = list(_constant(inner) or [])
        if names is None:
            dashed = "--" + name.replace("_", "-")
            if _is_bool(node.annotation) and not (isinstance(default, ast.Constant)
                                                  and default.value is False):
                names = ["--no-" + dashed[2:], "--disable-" + dashed[2:]]
            else:
                names = [dashed]
        flags += names
    return flags


def _reached_functions(module: Module, entry: str) -> list[ast.FunctionDef]:
    """`entry` and every function of the module it calls, directly or not."""
    seen, order, queue = set(), [], [entry]
    while queue:
        name = queue.pop(0)
        if name in seen or name not in module.functions:
            continue
        seen.add(name)
        order.append(module.functions[name])
        for node in ast.walk(module.functions[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                queue.append(node.func.id)
    return order


def flags_of(checkout: Checkout, path: str, entry: str) -> list[str]:
    module = checkout.module(checkout.root / path)
    flags: list[str] = []
    for function in _reached_functions(module, entry):
        for node in ast.walk(function):
            if not isinstance(node, ast.Call):
                continue
            called = ast.unparse(node.func)
            if called.endswith(".add_argument"):
                names = [value for arg in node.args
                         if isinstance(value := _constant(arg), str) and value.startswith("-")]
                action = next((ast.unparse(k.value) for k in node.keywords if k.arg == "action"), "")
                if action.endswith("BooleanOptionalAction"):  # --x also gives --no-x
                    names += ["--no-" + n[2:] for n in names if n.startswith("--")]
                flags += names
            elif called == "ArgumentGroupFactory" and node.args:
                keywords = {k.arg: k.value for k in node.keywords}
                exclude_node = keywords.get("exclude")
                if isinstance(exclude_node, ast.Name):  # exclude = [...] earlier in the function
                    exclude_node = next((n.value for n in ast.walk(function)
                                         if isinstance(n, ast.Assign)
                                         and any(isinstance(t, ast.Name) and t.id == exclude_node.id
                                                 for t in n.targets)), None)
                exclude = set(_constant(exclude_node) or []) if exclude_node is not None else set()
                class_name = ast.unparse(node.args[0])
                target = module.imports.get(class_name)
                if target is None:
                    raise LookupError(f"{path}: cannot find where {class_name} comes from")
                config_module, cls = checkout.find_class(target)
                flags += _dataclass_flags(checkout, config_module, cls, exclude)
    return flags


def collect(root: Path) -> list[str]:
    checkout = Checkout(root)
    flags: set[str] = set()
    for path, entry in ENTRY_POINTS:
        flags.update(flags_of(checkout, path, entry))
    flags.discard("-h")  # argparse's --help, which every parser has
    flags.discard("--help")
    return sorted(flags)


def render(flags: list[str], commit: str) -> str:
    body = textwrap.fill(", ".join(f'"{flag}"' for flag in flags) + ",", width=96,
                         initial_indent="    ", subsequent_indent="    ",
                         break_on_hyphens=False, break_long_words=False)
    return (f'"""Every flag of Megatron-LM\'s pretrain_gpt.py parser at its commit below\n'
            f"(add_megatron_arguments, and add_modelopt_args that joins it where NVIDIA Model\n"
            f"Optimizer is installed): {len(flags)} names, written by scripts/megatron_flag_list.py\n"
            f"from a Megatron-LM checkout; do not edit by hand.\n"
            f"ptdp/config/megatron_flag_classes.py and ptdp/config/megatron.py say what ptdp\n"
            f"does with each one that is not a setting of its own (tests/test_megatron_flags.py\n"
            f'checks that each is one of them)."""\n\n'
            f'MEGATRON_LM_COMMIT = "{commit}"\n\n'
            f"MEGATRON_LM_FLAGS: tuple[str, ...] = (\n{body}\n)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a Megatron-LM checkout (git work tree)")
    parser.add_argument("--commit", help="the checkout's commit (default: git rev-parse HEAD there)")
    parser.add_argument("--check", action="store_true",
                        help="compare with ptdp/config/megatron_flag_list.py instead of writing it")
    args = parser.parse_args(argv)
    commit = args.commit or subprocess.run(["git", "-C", str(args.checkout), "rev-parse", "HEAD"],
                                           capture_output=True, text=True, check=True).stdout.strip()
    text = render(collect(args.checkout), commit)
    if args.check:
        same = OUTPUT.read_text(encoding="utf-8") == text
        print(f"{OUTPUT.name} is {'up to date' if same else 'out of date'} for {commit}")
        return 0 if same else 1
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
