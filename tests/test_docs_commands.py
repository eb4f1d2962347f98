"""Every command README.md and docs/ show is run by a test, as written.

Commands live in named blocks (tests/doc_commands.py). This file checks that
no command is shown outside one and that every named block is run by some
test, and runs the blocks no other test runs: the first run, the drawing,
planning, tokenizer and preprocessing commands, the Llama example
(shortened: see LENGTH_ONLY), and the launching commands that need a
cluster, which are checked up to the launch (their flags parsed and their
configuration validated for the world size they start)."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.doc_commands import COMMAND, ROOT, Block, blocks, commands, session
from ptdp import cli
from ptdp.commands.train import config_from_args
from ptdp.config import validate

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------ the rules

def unnamed_command_blocks(found: list[Block]) -> list[str]:
    """Blocks that show a command but have no name (text blocks hold
    synopses and pictures, not commands)."""
    return [block.where() for block in found if block.kind is None and block.language != "text"
            and any(COMMAND.match(line) for line in block.lines)]


def blocks_no_test_runs(found: list[Block], test_sources: dict[str, str]) -> list[str]:
    """Named blocks that no test file asks for by name."""
    asked = "\n".join(text for name, text in test_sources.items() if name != "doc_commands.py")
    return [f"{block.where()} ({block.name})" for block in found if block.name is not None
            and f'commands("{block.name}")' not in asked and f'session("{block.name}")' not in asked]


def _test_sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in TESTS.glob("*.py")}


def test_every_command_shown_is_in_a_named_block():
    found = blocks()
    assert unnamed_command_blocks(found) == []
    names = [block.name for block in found if block.name]
    assert len(names) == len(set(names)), "two blocks share a name"
    assert len(names) >= 10  # README and docs are both read


def test_every_named_block_is_run_by_a_test():
    assert blocks_no_test_runs(blocks(), _test_sources()) == []


def test_the_rules_catch_an_unnamed_command_and_a_block_no_test_runs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nptdp train --mock-data\n```\n\n<!-- commands: orphan -->\n```bash\n"
                    "ptdp plan --gpus 8\n```\n\n```text\nptdp schedule --kind K\n```\n")
    found = blocks([page])
    assert len(unnamed_command_blocks(found)) == 1
    assert [line.split(" ")[0] for line in blocks_no_test_runs(found, {})] != []
    assert blocks_no_test_runs(found, {"t.py": 'commands("orphan")'}) == []


# ------------------------------------------------------------------ running them

def _run_in_process(command: str, cwd: Path, monkeypatch, capsys) -> str:
    """A `ptdp ...` command through ptdp's own entry point in this process
    (the shell's part, globs, done here): the program is the one a user runs,
    without another interpreter's start-up."""
    words = shlex.split(command, comments=True)
    assert Path(words[0]).name == "ptdp", command
    monkeypatch.chdir(cwd)
    args = [match for word in words[1:] for match in (sorted(glob.glob(word)) or [word])]
    status = cli.main(args)
    output = capsys.readouterr()
    assert status == 0, f"{command}\n{output.err[-3000:]}"
    return output.out


def _run(command: str, cwd: Path, extra: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    if not (cwd / ".venv").exists():
        (cwd / ".venv").symlink_to(ROOT / ".venv")
    line = command
    if extra:  # after the command's own words, not after its trailing comment
        line = shlex.join(shlex.split(command, comments=True) + extra)
    result = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"
    return result


def test_the_two_commands_are_the_scripts_ci_and_the_demo_test_run():
    """./scripts/test.sh is what CI runs (.ci/run execs it) and scripts/demo.sh
    is run, shortened, by tests/test_demo.py."""
    shown = [shlex.split(command, comments=True) for command in commands("the-two-commands")]
    assert shown == [["./scripts/demo.sh"], ["./scripts/test.sh"]]
    assert "exec ./scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for script in ("demo.sh", "test.sh"):
        assert os.access(ROOT / "scripts" / script, os.X_OK)


def test_the_first_run_learns(tmp_path):
    (command,) = commands("first-run")
    result = _run(command, tmp_path)
    losses = [float(v) for v in re.findall(r"\| loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 4, result.stdout
    # README: from ln 256 ≈ 5.5 to about 1.1
    assert losses[0] > 3.0 and losses[-1] < 1.5 and losses == sorted(losses, reverse=True)


# Long runs are shortened by flags that change only their length (as
# tests/test_demo.py shortens the demo); everything else is as written.
LENGTH_ONLY = {"llama-tiny": ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                              "--log-interval", "1"],
               "moe-tiny": ["--train-iters", "2", "--log-interval", "1"]}


def _run_example(name: str, command: str, cwd: Path) -> subprocess.CompletedProcess:
    """An examples/NAME.yaml command in `cwd`, with the file there, shortened."""
    (cwd / "examples").mkdir()
    (cwd / "examples" / f"{name}.yaml").write_text((ROOT / "examples" / f"{name}.yaml").read_text())
    return _run(command, cwd, LENGTH_ONLY[name])


def test_the_llama_example_trains_evaluates_and_saves(tmp_path):
    (command,) = commands("llama-tiny")
    result = _run_example("llama-tiny", command, tmp_path)
    assert "(t=2, p=2, d=1)" in result.stdout and "val loss" in result.stdout
    assert (tmp_path / "llama-output" / "checkpoint" / "latest").read_text().strip() == "iter_0000002"


def test_drawing_and_planning_commands(tmp_path, monkeypatch, capsys):
    (tmp_path / "docs" / "images").mkdir(parents=True)
    for command in [*commands("draw-a-schedule"), *commands("picture-gpipe"),
                    *commands("picture-1f1b"), *commands("picture-interleaved"),
                    *commands("picture-zb-h1"), *commands("picture-zbv")]:
        out = _run_in_process(command, tmp_path, monkeypatch, capsys)
        assert "bubble" in out
        picture = tmp_path / shlex.split(command)[shlex.split(command).index("--out") + 1]
        assert picture.stat().st_size > 10_000
    (command,) = commands("plan-example")
    out = _run_in_process(command, tmp_path, monkeypatch, capsys)
    assert "ptdp train" in out and "--tensor-model-parallel-size" in out


def _write_corpus(directory: Path) -> None:
    """Small inputs for the data page's commands: two plain-text files and a
    JSON-lines file of Shakespeare's lines (the shipped corpus)."""
    from ptdp.data.corpus import read_works

    (directory / "corpus").mkdir()
    lines = []
    for index, (name, text) in enumerate(read_works()[:2]):
        (directory / "corpus" / f"work{index}.txt").write_text(text[:60_000])
        lines += [json.dumps({"text": text[i:i + 2000]}) for i in range(0, 20_000, 2000)]
    (directory / "books.jsonl").write_text("\n".join(lines) + "\n")


def test_tokenizer_and_preprocessing_commands(tmp_path, monkeypatch, capsys):
    _write_corpus(tmp_path)
    for command in [*commands("own-tokenizer"), *commands("preprocessing")]:
        _run_in_process(command, tmp_path, monkeypatch, capsys)
    for prefix in ("books-own", "books-own-bpe", "books"):
        for suffix in (".bin", ".idx"):
            assert (tmp_path / "data" / f"{prefix}_text_document{suffix}").stat().st_size > 0
    assert (tmp_path / "my-tokenizer" / "tokenizer.json").is_file()


def _launched(command: str) -> tuple[list[str], int]:
    """The `ptdp train` flags of a launching command and the world size it starts."""
    words = shlex.split(command.replace("$(hostname)", "localhost"), comments=True)
    if words[0] == "torchrun":
        flags = words[words.index("-m") + 3:]  # after "-m ptdp train"
        nodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words else 1
        return flags, nodes * int(words[words.index("--nproc-per-node") + 1])
    assert words[0] == "srun", command
    at = next(i for i, word in enumerate(words) if Path(word).name == "ptdp")
    return words[at + 2:], int(words[words.index("--ntasks-per-node") + 1])


def test_the_launching_commands_are_valid_for_the_world_they_start():
    shown = commands("launching")
    assert len(shown) == 4
    for command in shown:
        flags, world = _launched(command)
        config = config_from_args(cli.build_parser().parse_args(["train", *flags]))
        par = config.parallel
        model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
        assert world % model_parallel == 0, command
        par.data_parallel_size = world // model_parallel  # as a rank under torchrun/SLURM derives it
        validate(config)


def test_the_validation_example_prints_what_the_page_shows(capsys):
    ((command, shown),) = session("validation-example")
    words = shlex.split(command)
    assert words[0] == "ptdp"
    assert cli.main(words[1:]) == 2
    assert capsys.readouterr().err.strip() == shown.strip()


def test_the_moe_example_trains_and_logs_its_balancing_losses(tmp_path):
    (command,) = commands("moe-tiny")
    result = _run_example("moe-tiny", command, tmp_path)
    assert "(t=2, p=1, d=1)" in result.stdout
    assert re.search(r"iteration +2/2 .*\| load_balancing_loss \d\.\d{4} \| z_loss \d.* \| "
                     r"expert load \d+\.\d% to \d+\.\d% \|", result.stdout)
