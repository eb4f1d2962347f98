"""Fast start-up (issue 17): the commands that need no model (`ptdp plan`,
every --help, --version, an argument error) run without importing torch,
which takes seconds. Checked on sys.modules, in a fresh interpreter."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INVOCATIONS = [
    ["--help"],
    ["--version"],
    ["train", "--help"],
    ["plan", "--help"],
    ["generate", "--help"],
    ["convert", "--help"],
    ["trian"],                              # a misspelt command
    ["train", "--hidden-sise", "64"],       # a misspelt flag
    ["plan", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
     "--gpus", "4", "--gpu", "a100", "--global-batch-size", "16", "--seq-length", "128"],
]

# Runs each invocation in turn in one interpreter and reports, after each,
# its exit status and whether torch has been imported by then.
PROBE = """
import contextlib, io, json, sys
from ptdp.cli import main
report = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as stop:
            status = stop.code
    report.append([argv, status, "torch" in sys.modules])
print(json.dumps(report))
"""


def test_commands_without_a_model_do_not_import_torch():
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(INVOCATIONS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [argv for argv, _, _ in report] == INVOCATIONS
    statuses = {" ".join(argv): status for argv, status, _ in report}
    assert statuses["--help"] == 0 and statuses["plan --help"] == 0
    assert statuses["trian"] == 2 and statuses["train --hidden-sise 64"] == 2
    assert statuses[" ".join(INVOCATIONS[-1])] == 0  # the plan itself ran
    importing = [" ".join(argv) for argv, _, torch_loaded in report if torch_loaded]
    assert not importing, f"torch was imported by: ptdp {importing[0]}"


# Imports every module of ptdp.commands in turn and reports, after each,
# whether torch has been imported by then.
COMMAND_MODULES_PROBE = """
import importlib, json, pkgutil, sys
import ptdp.commands
report = []
for module in pkgutil.iter_modules(ptdp.commands.__path__):
    importlib.import_module("ptdp.commands." + module.name)
    report.append([module.name, "torch" in sys.modules])
print(json.dumps(report))
"""


def test_every_command_module_imports_without_torch():
    """Each command's module (its parser and run: ptdp/commands/) imports
    no torch, directly or through what it imports; the commands that need
    it import it when they run."""
    done = subprocess.run([sys.executable, "-c", COMMAND_MODULES_PROBE], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"train", "train_checks", "generate", "convert", "preprocess", "tokenizer"} <= \
        {name for name, _ in report}
    importing = [name for name, torch_loaded in report if torch_loaded]
    assert not importing, f"torch was imported by: ptdp.commands.{importing[0]}"


def test_the_heavy_commands_keep_their_entry_points():
    """generate and convert import torch when they run; their modules in
    ptdp.commands hold their flags and their run."""
    from ptdp.commands import convert, generate, preprocess, tokenizer, train

    for command in (convert, generate, preprocess, tokenizer, train):
        assert callable(command.add_parser) and callable(command.run), command.__name__
