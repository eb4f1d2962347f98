"""The command line says things one way everywhere (issue 17, items 2 and 6):
one-line errors for bad flags with a guess at what was meant, `ptdp
--version`, `ptdp schedule` numbering microbatches as its picture does and
taking `ptdp train`'s chunk flags, legible measured timelines with idle time
apart from communication, `ptdp generate` echoing its prompt, and "1 process"."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ptdp.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _fails(capsys, *argv) -> str:
    """stderr of `ptdp argv`, which must exit with argparse's status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


# --------------------------------------------------------------------------- bad flags

def test_unknown_flag_is_one_line_with_a_guess(capsys):
    err = _fails(capsys, "train", "--swiglu-x")
    assert err == "ptdp train: error: unrecognized flag --swiglu-x (did you mean --swiglu?)\n"


@pytest.mark.parametrize("argv, line", [
    (["schedule", "--kind-x", "1f1b"],
     "ptdp schedule: error: unrecognized flag --kind-x (did you mean --kind?)"),
    (["plan", "--gpus", "8", "--hiden-size", "64"],
     "ptdp plan: error: unrecognized flag --hiden-size (did you mean --hidden-size?)"),
    # A flag that names a file or directory is guessed only one edit away.
    (["convert", "--from-fh", "a"],
     "ptdp convert: error: unrecognized flag --from-fh (did you mean --from-hf?)"),
    (["preprocess", "--imput", "a"],
     "ptdp preprocess: error: unrecognized flag --imput (did you mean --input?)"),
    (["calibrate", "--otu", "a"], "ptdp calibrate: error: unrecognized flag --otu (did you mean --out?)"),
    (["calibrate", "--out-x", "a"],
     "ptdp calibrate: error: unrecognized flag --out-x (ptdp calibrate --help lists what it takes)"),
    (["tokenizer", "train", "--inptu", "a"],
     "ptdp tokenizer train: error: unrecognized flag --inptu (did you mean --input?)"),
    (["generate", "--lod", "x"], "ptdp generate: error: unrecognized flag --lod (did you mean --load?)"),
])
def test_every_command_names_its_unknown_flag_before_missing_ones(argv, line, capsys):
    """A misspelt required flag is reported as misspelt, not as missing."""
    assert _fails(capsys, *argv) == line + "\n"


def test_several_unknown_flags_are_each_named(capsys):
    err = _fails(capsys, "train", "--swiglu-x", "--hiden-size", "8", "--frobnicate=3")
    assert err.count("\n") == 1
    assert err.startswith("ptdp train: error: unrecognized flags ")
    assert "--swiglu-x (did you mean --swiglu?)" in err
    assert "--hiden-size (did you mean --hidden-size?)" in err
    assert "--frobnicate" in err and "=3" not in err and " 8" not in err  # values are not flags


def test_unknown_flag_without_a_guess_points_at_help(capsys):
    err = _fails(capsys, "train", "--zzzzzz")
    assert err == "ptdp train: error: unrecognized flag --zzzzzz (ptdp train --help lists what it takes)\n"


@pytest.mark.parametrize("argv, line", [
    (["train", "--pipeline-schedule", "zb"],
     "ptdp train: error: --pipeline-schedule zb: choose from gpipe, 1f1b, zb-h1, zbv"),
    (["train", "--device", "tpu"], "ptdp train: error: --device tpu: choose from auto, cpu, cuda"),
    (["train", "--num-layers", "x"], "ptdp train: error: --num-layers x: not an integer"),
    (["train", "-t", "1.5"], "ptdp train: error: --tensor-model-parallel-size 1.5: not an integer"),
    (["train", "--lr", "fast"], "ptdp train: error: --lr fast: not a number"),
    (["train", "--num-layers"], "ptdp train: error: --num-layers needs a value: --num-layers N"),
    (["train", "--pipeline-schedule"],
     "ptdp train: error: --pipeline-schedule needs a value: choose from gpipe, 1f1b, zb-h1, zbv"),
    (["train", "--swiglu=1"], "ptdp train: error: --swiglu takes no value (given '1')"),
    (["schedule", "--kind", "zb", "-p", "2", "-m", "2"],
     "ptdp schedule: error: --kind zb: choose from gpipe, 1f1b, interleaved, zb-h1, zbv"),
    (["trian"], "ptdp: error: unknown command trian (did you mean train?); choose from train, "
                "schedule, tokenizer, generate, convert, plan, calibrate, preprocess"),
])
def test_bad_values_are_one_clear_line(argv, line, capsys):
    assert _fails(capsys, *argv) == line + "\n"


def test_no_command_names_the_commands(capsys):
    err = _fails(capsys)
    assert err.count("\n") == 1 and err.startswith("ptdp: error: give a command: train, schedule")


def test_version_prints_ptdp_and_torch(capsys):
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    import torch

    import ptdp

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ptdp.__version__ == version  # the package and its metadata agree
    assert lines[0] == f"ptdp {version}"
    assert lines[1].startswith("torch ") and torch.__version__.split("+")[0] in lines[1]


# --------------------------------------------------------------------------- ptdp schedule

def _schedule(capsys, monkeypatch, *argv):
    """`ptdp schedule argv`'s text, and the boxes and figure its picture drew."""
    import ptdp.perf.simulate.timeline as timeline

    drawn = {}
    build = timeline.timeline_figure

    def recording(rows, **kwargs):
        drawn["rows"], drawn["figure"] = rows, build(rows, **kwargs)
        return drawn["figure"]

    monkeypatch.setattr(timeline, "timeline_figure", recording)
    assert main(["schedule", *argv]) == 0
    return capsys.readouterr().out, drawn


def _text_computes(out: str) -> dict[int, list[tuple[str, int, int]]]:
    """{rank: [(op, microbatch, chunk), ...]} as the text prints them."""
    rows = {}
    for rank, computes in re.findall(r"^\s+rank (\d+): (.*)$", out, re.M):
        rows[int(rank)] = [(op, int(mb), int(chunk))
                           for op, mb, chunk in re.findall(r"([FBW])(\d+)\.(\d+)", computes)]
    return rows


@pytest.mark.parametrize("argv", [["--kind", "1f1b", "-p", "4", "-m", "8"],
                                  ["--kind", "interleaved", "-p", "2", "-m", "4", "-v", "2"],
                                  ["--kind", "zbv", "-p", "2", "-m", "4"]])
def test_schedule_text_numbers_microbatches_as_its_picture(argv, capsys, monkeypatch, tmp_path):
    out, drawn = _schedule(capsys, monkeypatch, *argv, "--out", str(tmp_path / "s.png"))
    text = _text_computes(out)
    assert "microbatches numbered from 1 as in the picture" in out
    ax = drawn["figure"].axes[0]
    labels: dict[int, list[tuple[float, str]]] = {}
    for label in ax.texts:
        x, y = label.get_position()
        labels.setdefault(round(y), []).append((x, label.get_text()))
    for rank, row in enumerate(drawn["rows"]):
        boxes = sorted((b for b in row if b.op in "FBW"), key=lambda b: b.start)
        # The picture's boxes, in the picture's numbering, are the text's computes ...
        assert [(b.op, b.microbatch + 1, b.chunk) for b in boxes] == text[rank]
        # ... and the numbers drawn in them are the text's microbatch numbers.
        assert [int(t) for _, t in sorted(labels[rank])] == [mb for _, mb, _ in text[rank]]
    assert min(mb for row in text.values() for _, mb, _ in row) == 1


def test_schedule_takes_trains_chunk_flags(capsys):
    def json_of(*argv):
        assert main(["schedule", *argv, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        return data["kind"], data["v"], data["actions"], data["makespan"]

    interleaved = json_of("--kind", "interleaved", "-p", "4", "-m", "8", "-v", "2")
    # As in ptdp train: 1f1b with --num-layers-per-virtual-pipeline-stage is interleaved 1F1B.
    assert json_of("--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "4", "-m", "8",
                   "--num-layers", "16", "--num-layers-per-virtual-pipeline-stage", "2") == interleaved
    assert json_of("--kind", "interleaved", "-p", "4", "-m", "8", "--num-layers", "16",
                   "--num-layers-per-virtual-pipeline-stage", "2", "-v", "2") == interleaved
    assert json_of("--kind", "zbv", "-p", "2", "-m", "4", "--num-layers", "8",
                   "--num-layers-per-virtual-pipeline-stage", "2")[:2] == ("zbv", 2)


@pytest.mark.parametrize("argv, message", [
    (["--kind", "1f1b", "--num-layers-per-virtual-pipeline-stage", "2"], "needs --num-layers L"),
    (["--kind", "1f1b", "--num-layers", "12", "--num-layers-per-virtual-pipeline-stage", "4"],
     "--num-layers 12 is not divisible by -p 4 × --num-layers-per-virtual-pipeline-stage 4 = 16"),
    (["--kind", "1f1b", "--num-layers", "16", "--num-layers-per-virtual-pipeline-stage", "2",
      "-v", "3"], "-v/--num-model-chunks 3 disagrees with"),
    (["--kind", "gpipe", "--num-layers", "16", "--num-layers-per-virtual-pipeline-stage", "2"],
     "--kind gpipe cannot be combined with --num-layers-per-virtual-pipeline-stage"),
    (["--kind", "zb-h1", "--num-layers", "16", "--num-layers-per-virtual-pipeline-stage", "2"],
     "zb-h1 has one model chunk per rank"),
])
def test_schedule_chunk_flags_that_cannot_work(argv, message, capsys):
    assert main(["schedule", "-p", "4", "-m", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error: ") and message in err


# --------------------------------------------------------------------------- timeline pictures

def _measured_like_rows(scale: float = 1.0):
    """A 1F1B timeline with communication, scaled like a measured one in ms."""
    from fractions import Fraction

    from ptdp.schedules.build import build_schedule
    from ptdp.schedules.simulate import simulate
    from ptdp.perf.simulate.timeline import Box, boxes_from_simulation

    cost = Fraction(1, 4)
    rows = boxes_from_simulation(simulate(build_schedule("1f1b", 4, 8), transfer_cost=cost),
                                 transfer_cost=cost)
    return [[Box(b.op, b.microbatch, b.chunk, b.start * scale, b.end * scale) for b in row]
            for row in rows]


def test_idle_gaps():
    from ptdp.perf.simulate.timeline import Box, idle_gaps

    row = [Box("F", 0, 0, 1.0, 2.0), Box("comm", -1, -1, 2.0, 2.5), Box("B", 0, 0, 3.0, 5.0)]
    assert idle_gaps(row, 6.0) == [(0.0, 1.0), (2.5, 3.0), (5.0, 6.0)]
    assert idle_gaps(row, 5.0, min_gap=0.75) == [(0.0, 1.0)]
    assert idle_gaps([], 2.0) == [(0.0, 2.0)]


def test_measured_timeline_is_labelled_and_legible(tmp_path):
    import matplotlib.image

    from ptdp.perf.simulate.timeline import _IDLE_COLOUR, draw_timeline, timeline_figure

    rows = _measured_like_rows(scale=0.37)
    drawing = dict(v=1, title="measured 1f1b timeline, p=4, m=8", time_unit="ms")
    fig = timeline_figure(rows, **drawing)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"pipeline rank {r}" for r in range(4)]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "communication" in legend and "idle (the bubble)" in legend

    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    assert fig.legends[0].get_window_extent(renderer).x0 >= figure_box.x0 - 1
    assert fig.legends[0].get_window_extent(renderer).x1 <= figure_box.x1 + 1
    ticks = [t.get_window_extent(renderer) for t in ax.get_yticklabels()]
    assert all(tick.x1 <= ax.get_window_extent(renderer).x0 + 1 for tick in ticks)
    assert all(not a.overlaps(b) for a, b in zip(ticks, ticks[1:]))
    # Box labels: legible, every compute box numbered, each inside its box, none overlapping.
    labels = ax.texts
    assert len(labels) == sum(b.op in "FB" for row in rows for b in row)
    assert all(label.get_fontsize() >= 6 for label in labels)
    extents = [label.get_window_extent(renderer) for label in labels]
    for label, extent in zip(labels, extents):
        x, y = label.get_position()
        box = next(b for b in rows[round(y)] if b.op in "FB" and abs((b.start + b.end) / 2 - x) < 1e-9)
        left, right = (ax.transData.transform((t, y))[0] for t in (box.start, box.end))
        assert left - 0.5 <= extent.x0 and extent.x1 <= right + 0.5
    for i, a in enumerate(extents):
        assert not any(a.overlaps(b) for b in extents[i + 1:])

    path = tmp_path / "measured.png"
    draw_timeline(rows, path, **drawing, dpi=60)
    image = matplotlib.image.imread(path)
    close = (abs(image[..., :3] - [int(_IDLE_COLOUR[i:i + 2], 16) / 255 for i in (1, 3, 5)])
             < 0.02).all(axis=-1)
    assert close.sum() >= 50  # idle time is shaded, not blank


def test_figure_size_follows_rows_and_boxes_not_the_time_unit():
    from ptdp.perf.simulate.timeline import timeline_figure

    def size(rows):
        return tuple(timeline_figure(rows, v=1, title="t").get_size_inches())

    rows = _measured_like_rows()
    assert size(_measured_like_rows(scale=1e3)) == pytest.approx(size(rows))  # ms or unit time
    assert size(rows[:2])[1] < size(rows)[1]  # fewer ranks: a lower picture


def test_pictures_drawn_to_one_scale_have_one_width():
    """--xmax: pictures of schedules with boxes of different lengths compare directly."""
    from ptdp.schedules.build import build_schedule
    from ptdp.schedules.simulate import simulate
    from ptdp.perf.simulate.timeline import boxes_from_simulation, timeline_figure

    widths = {timeline_figure(boxes_from_simulation(simulate(build_schedule(kind, 4, 8, v))), v=v,
                              title=kind, xmax=33).get_size_inches()[0]
              for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))}
    assert len(widths) == 1


# --------------------------------------------------------------------------- ptdp generate

def _save_untrained(directory: Path, vocab_size: int, data) -> Path:
    import torch

    from ptdp.config import Config, ModelConfig, TrainConfig
    from ptdp.parallel.topology import ParallelContext
    from ptdp.train.loop import Trainer

    model = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=16,
                        vocab_size=vocab_size, make_vocab_size_divisible_by=8)
    config = Config(model=model, train=TrainConfig(micro_batch_size=2, global_batch_size=2,
                                                   train_iters=1), data=data)
    Trainer(config, ParallelContext.single(), torch.device("cpu")).save(str(directory), 0)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(a model of generated data, without a tokenizer; a model with a byte tokenizer)"""
    from ptdp.config import DataConfig
    from ptdp.data.preprocess import preprocess

    folder = tmp_path_factory.mktemp("generate")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of some text"}) + "\n"
                              for i in range(40)))
    preprocess([corpus], folder / "corpus", "ByteLevelTokenizer", progress=False)
    text = DataConfig(data_path=[str(folder / "corpus_text_document")], split="1,0,0",
                      tokenizer_type="ByteLevelTokenizer", data_cache_path=str(folder / "cache"))
    return (_save_untrained(folder / "mock", 32, DataConfig(mock_data=True)),
            _save_untrained(folder / "text", 257, text))


def _generate(capsys, *argv) -> str:
    assert main(["generate", *argv]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def test_generate_echoes_a_text_prompt(checkpoints, capsys):
    from ptdp.data.tokenizer import build_tokenizer

    flags = ["--load", str(checkpoints[1]), "--prompt", "line 7", "--max-new-tokens", "6",
             "--temperature", "0", "--device", "cpu"]
    echoed = _generate(capsys, *flags)
    alone = _generate(capsys, *flags, "--no-echo-prompt")
    assert echoed == "line 7" + alone
    # --output-ids: the generated ids only, with or without the echo.
    ids = [int(t) for t in _generate(capsys, *flags, "--output-ids").split(",") if t]
    assert build_tokenizer("ByteLevelTokenizer").decode(ids) == alone
    assert _generate(capsys, *flags, "--output-ids", "--no-echo-prompt") == ",".join(map(str, ids))


def test_generate_echoes_prompt_ids(checkpoints, capsys):
    flags = ["--load", str(checkpoints[0]), "--max-new-tokens", "5", "--temperature", "0",
             "--device", "cpu"]
    echoed = _generate(capsys, *flags, "--prompt", "1 2 3").split()
    assert echoed[:3] == ["1", "2", "3"]
    assert _generate(capsys, *flags, "--prompt-ids", "1,2,3").split() == echoed
    assert _generate(capsys, *flags, "--prompt", "1 2 3", "--no-echo-prompt").split() == echoed[3:]
    assert _generate(capsys, *flags, "--prompt", "1 2 3", "--output-ids") == ",".join(echoed[3:])


# --------------------------------------------------------------------------- "1 process"

def test_plural():
    from ptdp.plural import plural

    assert plural(1, "process") == "1 process"
    assert plural(0, "process") == "0 processes"
    assert plural(8, "process") == "8 processes"
    assert plural(1, "GPU") == "1 GPU" and plural(2, "GPU") == "2 GPUs"
    assert plural(2, "microbatch") == "2 microbatches"


def test_device_message_for_one_process(monkeypatch):
    import ptdp.device as device

    monkeypatch.setattr(device, "cuda_device_count", lambda: 0)
    with pytest.raises(RuntimeError) as error:
        device.resolve_kind("cuda", 1)
    assert "1 process, 0 GPUs visible" in str(error.value)


_COUNTED_PROCESSES = re.compile(r"\{[^{}]*\} processes")


def _counted_processes() -> set[str]:
    """The ptdp files whose f-strings say '{n} processes', wrong for n = 1."""
    return {str(path.relative_to(ROOT)) for path in (ROOT / "ptdp").rglob("*.py")
            if _COUNTED_PROCESSES.search(path.read_text())}


def test_no_count_of_processes_says_1_processes():
    assert not _counted_processes()
