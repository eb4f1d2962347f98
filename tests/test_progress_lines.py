"""What preprocess and the dataset index print around their progress: every
error on a line of its own, and a blend's indices in two lines, not twelve."""

import io
import json
import os
import re
import signal
import subprocess
import sys

import pytest


def screen(output: str) -> list[str]:
    """The lines a terminal shows for `output` (carriage returns, rich's
    erase-line and cursor-up redraws applied)."""
    lines, row, col, i = [""], 0, 0, 0
    escape = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")
    while i < len(output):
        match = escape.match(output, i)
        if match:
            argument, op = match.groups()
            if op == "K":
                lines[row] = lines[row][:col] if argument in ("", "0") else ""
            elif op == "A":
                row = max(0, row - int(argument or 1))
            i = match.end()
            continue
        c = output[i]
        if c == "\r":
            col = 0
        elif c == "\n":
            row, col = row + 1, 0
            lines.extend([""] * (row + 1 - len(lines)))
        else:
            line = lines[row].ljust(col)
            lines[row], col = line[:col] + c + line[col + 1:], col + 1
        i += 1
    return [line.rstrip() for line in lines if line.strip()]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bad_input_error_starts_a_line_after_the_progress_bars(tmp_path, monkeypatch):
    from ptdp.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["preprocess", "--input", str(bad), "--output-prefix", str(tmp_path / "out" / "a"),
                 "--workers", "1"]) == 2
    shown = screen(terminal.getvalue())
    errors = [n for n, line in enumerate(shown) if "bad input" in line]
    assert errors and shown[errors[0]].startswith("ptdp: error: bad input"), shown
    assert any(line.lstrip().startswith("check") for line in shown[:errors[0]]), shown


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_ctrl_c_while_tokenizing_says_interrupted_on_its_own_line(tmp_path):
    """The terminal's Ctrl-C reaches the workers too: none may write a
    traceback onto the progress bar's line."""
    corpus = tmp_path / "corpus.jsonl"
    line = json.dumps({"text": "the quick brown fox jumps over the lazy dog " * 3})
    corpus.write_text((line + "\n") * 60_000)
    master, slave = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "ptdp", "preprocess", "--input", str(corpus), "--output-prefix",
         str(tmp_path / "out"), "--workers", "2"],
        stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    output, sent = b"", False
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the process has ended
                break
            if not chunk:
                break
            output += chunk
            if not sent and b"MB/s" in output:  # the workers are at work
                os.killpg(process.pid, signal.SIGINT)
                sent = True
    finally:
        os.close(master)
        returncode = process.wait(timeout=60)
    shown = screen(output.decode(errors="replace"))
    assert sent and returncode == 130, shown
    assert shown[-1] == "ptdp: interrupted", shown
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in shown), shown


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs signal masks")
def test_a_worker_still_starting_up_outlives_ctrl_c():
    """The terminal's Ctrl-C can come while a worker is still importing,
    before its initializer has told it to ignore Ctrl-C: it must neither die
    (a broken pool) nor print a traceback."""
    import multiprocessing

    from ptdp.data.preprocess import _worker_pool

    with _worker_pool(2) as ordered_map:
        before = set(multiprocessing.active_children())
        results = ordered_map(abs, [-1, -2, -3, -4])
        starting = set(multiprocessing.active_children()) - before
        for worker in starting:  # a spawned interpreter takes far longer to start
            os.kill(worker.pid, signal.SIGINT)
        assert starting and list(results) == [1, 2, 3, 4]


def test_a_two_dataset_blend_reports_its_indices_in_two_lines(tmp_path, capsys):
    from ptdp.data.gpt_dataset import build_gpt_datasets
    from ptdp.data.preprocess import preprocess

    prefixes = []
    for name in "AB":
        text = tmp_path / f"{name}.jsonl"
        text.write_text("".join(json.dumps({"text": f"document {i} of {name} " * 10}) + "\n"
                                for i in range(200)))
        preprocess([text], tmp_path / name, progress=False)
        prefixes.append(str(tmp_path / f"{name}_text_document"))
    capsys.readouterr()
    data_path = ["0.7", prefixes[0], "0.3", prefixes[1]]
    build_gpt_datasets(data_path, "90,5,5", (100, 20, 10), seq_length=16, seed=1,
                       cache_dir=str(tmp_path / "cache"))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"ptdp: building the dataset index in {tmp_path / 'cache'} ...", lines
    assert re.fullmatch(
        rf"ptdp: built the dataset index of a blend of 0\.7 {re.escape(prefixes[0])}, 0\.3 "
        rf"{re.escape(prefixes[1])} \(samples: train 100, valid 20, test 10\) in \d+\.\d s",
        lines[1]), lines
    assert len(lines) == 2, lines
    # Cached: read, not built, and nothing to say.
    build_gpt_datasets(data_path, "90,5,5", (100, 20, 10), seq_length=16, seed=1,
                       cache_dir=str(tmp_path / "cache"))
    assert capsys.readouterr().err == ""
