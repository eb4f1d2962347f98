"""The demo's loss.png shows the whole run (issue 25): iterations 1-10 from
the first phase's metrics file (t = p = d = 2) and 11-300 from the resumed
one's (d = 2), the change of layout marked; no training here, two small
synthetic metrics files."""

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from ptdp.train.report import join_phases, loss_curve_figure, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("plot_loss_curve",
                                                  ROOT / "scripts" / "plot_loss_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, iterations, *, marker=None, val_at=(), cut_short=False) -> Path:
    lines = [json.dumps(marker)] if marker else []
    for i in iterations:
        record = {"iteration": i, "loss": 10.0 / i, "lr": 1e-3}
        if i in val_at:
            record["val_loss"] = 11.0 / i
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n"
    path.write_text(text + ('{"iteration": 9' if cut_short else ""))
    return path


def _demo_files(tmp_path: Path, n: int = 30, split: int = 10) -> tuple[Path, Path]:
    # As the demo's runs write them: the first phase's file, then the resumed
    # run's, behind the marker a run writes when it appends to a file.
    three_d = _write(tmp_path / "metrics-3d.jsonl", range(1, split + 1))
    resumed = _write(tmp_path / "metrics.jsonl", range(split + 1, n + 1), val_at=(20, 30),
                     marker={"event": "resume", "iteration": split, "checkpoint": "ckpt"})
    return three_d, resumed


def _lines_by_label(figure) -> dict:
    (ax,) = figure.axes
    return {line.get_label(): line for line in ax.lines}


def test_the_demo_curve_covers_both_phases_from_iteration_1_with_the_change_marked(tmp_path):
    three_d, resumed = _demo_files(tmp_path)
    records, boundaries = join_phases([("t=p=d=2", read_metrics(three_d)),
                                       ("d=2", read_metrics(resumed))])
    figure = loss_curve_figure(records, boundaries)
    lines = _lines_by_label(figure)
    assert list(lines["training loss"].get_xdata()) == list(range(1, 31))
    assert list(lines["training loss"].get_ydata()) == pytest.approx([10 / i for i in range(1, 31)])
    assert list(lines["validation loss"].get_xdata()) == [20, 30]
    (ax,) = figure.axes
    marks = [line for line in ax.lines if line.get_label().startswith("_")]  # axvline: no legend
    assert [list(line.get_xdata()) for line in marks] == [[10.5, 10.5]]
    assert [text.get_text() for text in ax.texts] == ["t=p=d=2 | d=2"]


def test_marker_lines_a_cut_short_last_line_and_redone_iterations_are_handled(tmp_path):
    first = _write(tmp_path / "a.jsonl", range(1, 13), cut_short=True,
                   marker={"event": "start", "iteration": 0, "checkpoint": None})
    assert [r["iteration"] for r in read_metrics(first)] == list(range(1, 13))
    # The second phase resumed from iteration 10's checkpoint: its 11 and 12 count.
    second = _write(tmp_path / "b.jsonl", range(11, 16))
    records, boundaries = join_phases([("A", read_metrics(first)), ("B", read_metrics(second))])
    assert [r["iteration"] for r in records] == list(range(1, 16))
    assert boundaries == [(10.5, "A | B")]
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text('{"iteration": 1, "loss": 2.0}\nnot json\n{"iteration": 2, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"garbled.jsonl, line 2: not a JSON record"):
        read_metrics(garbled)


def test_the_script_the_demo_runs_draws_both_files(tmp_path, capsys):
    demo = (ROOT / "scripts" / "demo.sh").read_text().replace("\\\n", " ")
    (command,) = [shlex.split(line) for line in demo.splitlines()
                  if "scripts/plot_loss_curve.py" in line]
    assert command[2:] == ["demo-output/loss.png", "--phase", "t=p=d=2",
                           "demo-output/metrics-3d.jsonl", "--phase", "d=2",
                           "demo-output/metrics.jsonl"]
    three_d, resumed = _demo_files(tmp_path)
    out = tmp_path / "loss.png"
    assert _script().main([str(out), "--phase", "t=p=d=2", str(three_d),
                           "--phase", "d=2", str(resumed)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert printed == f"ptdp demo: drew the loss curve of iterations 1-30 to {out}\n"
