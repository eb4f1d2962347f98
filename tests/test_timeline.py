"""Timeline pictures and the `ptdp schedule` subcommand (ptdp/perf/simulate/timeline.py)."""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

import numpy as np
import pytest

from ptdp.schedules.actions import Compute, Exchange
from ptdp.schedules.build import build_schedule
from ptdp.schedules.simulate import simulate
from ptdp.commands.schedule import add_schedule_parser, run_schedule_command
from ptdp.perf.simulate.timeline import (Box, boxes_from_simulation, colour, draw_timeline,
                                         separate_waits, timeline_figure)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])


def _has_colour(image: np.ndarray, hex_colour: str, min_pixels: int = 50) -> bool:
    close = np.all(np.abs(image[..., :3] - _rgb(hex_colour)) < 0.02, axis=-1)
    return int(close.sum()) >= min_pixels


# ------------------------------------------------------------------ boxes_from_simulation

@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3)])
def test_boxes_one_per_compute_with_simulated_times(kind, p, m, v):
    result = simulate(build_schedule(kind, p, m, v))
    rows = boxes_from_simulation(result)
    assert len(rows) == p
    for rank, row in enumerate(rows):
        assert len(row) == 2 * m * v == len(result.timelines[rank])
        for box, interval in zip(row, result.timelines[rank]):
            assert isinstance(box, tuple) and len(box) == 5
            assert box == (interval.action.op, interval.action.microbatch, interval.action.chunk,
                           float(interval.start), float(interval.end))
    assert max(b.end for row in rows for b in row) == float(result.makespan)


def test_boxes_with_transfer_cost_add_comm_before_computes():
    cost = Fraction(1, 4)
    result = simulate(build_schedule("1f1b", 4, 8), transfer_cost=cost)
    rows = boxes_from_simulation(result, transfer_cost=cost)
    for rank, row in enumerate(rows):
        computes = [b for b in row if b.op in "FB"]
        assert [(b.start, b.end) for b in computes] == [
            (float(i.start), float(i.end)) for i in result.timelines[rank]]
        for before, box in zip(row, row[1:]):
            if box.op == "comm":
                assert box.end - box.start == pytest.approx(float(cost))
                assert box.start >= before.end
        # One comm box per exchange that precedes a compute.
        actions = result.schedule.ranks[rank]
        exchanges = sum(isinstance(a, Exchange) and isinstance(b, Compute)
                        for a, b in zip(actions, actions[1:]))
        assert exchanges > 0 and sum(b.op == "comm" for b in row) == exchanges


# ------------------------------------------------------------------ draw_timeline

def test_draw_1f1b_png_has_forward_and_backward_colours(tmp_path):
    result = simulate(build_schedule("1f1b", 4, 8))
    path = tmp_path / "1f1b.png"
    drawing = dict(v=1, title="1F1B", bubble_fraction=result.bubble_fraction)
    draw_timeline(boxes_from_simulation(result), path, **drawing, dpi=60)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000

    import matplotlib.image

    image = matplotlib.image.imread(path)
    width, height = timeline_figure(boxes_from_simulation(result), **drawing).get_size_inches()
    assert image.shape[:2] == (round(height * 60), round(width * 60))
    assert image.shape[1] > 2 * image.shape[0]  # time runs to the right: a wide picture
    assert _has_colour(image, colour("F", 0, 1))
    assert _has_colour(image, colour("B", 0, 1))


def test_draw_interleaved_shades_chunks(tmp_path):
    result = simulate(build_schedule("interleaved", 4, 8, 2))
    path = tmp_path / "interleaved.png"
    draw_timeline(boxes_from_simulation(result), path, v=2, title="interleaved", dpi=60)

    import matplotlib.image

    image = matplotlib.image.imread(path)
    shades = [colour(op, chunk, 2) for op in "FB" for chunk in (0, 1)]
    assert len(set(shades)) == 4
    for shade in shades:
        assert _has_colour(image, shade), shade
    # chunk 0 darker than chunk 1, as in the paper's Figure 4
    for op in "FB":
        assert _rgb(colour(op, 0, 2)).sum() < _rgb(colour(op, 1, 2)).sum()


def test_draw_large_schedule_with_comm_and_wait_boxes(tmp_path):
    result = simulate(build_schedule("interleaved", 8, 32, 4))
    rows = boxes_from_simulation(result)
    rows[0].append(Box("wait", -1, -1, 10.0, 12.0))
    rows[1].append(Box("comm", -1, -1, 10.0, 11.0))
    path = tmp_path / "big.png"
    draw_timeline(rows, path, v=4, title="big", xmax=120, dpi=40)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_draw_rejects_bad_boxes(tmp_path):
    with pytest.raises(ValueError, match="chunk 1"):
        draw_timeline([[Box("F", 0, 1, 0.0, 1.0)]], tmp_path / "x.png", v=1, title="t")
    with pytest.raises(ValueError, match="unknown box op"):
        draw_timeline([[("X", 0, 0, 0.0, 1.0)]], tmp_path / "x.png", v=1, title="t")
    assert not (tmp_path / "x.png").exists()


def test_measured_exchanges_wait_for_the_peer_apart_from_communication():
    """1F1B, p = 2, m = 1 as the trainer measures it (ms): rank 0 sends its
    activation and waits for the gradient while rank 1 computes F and B; the
    gradient's exchange on rank 1 starts at 12. Rank 0's exchange is waiting
    until then, communication after; a send alone is communication."""
    schedule = build_schedule("1f1b", 2, 1, 1)
    assert [str(a) for a in schedule.ranks[0]] == ["F0.0", "[send a0|0 -> 1, recv g0|0 <- 1]",
                                                   "B0.0"]
    assert [str(a) for a in schedule.ranks[1]] == ["[recv a0|0 <- 0]", "F0.0", "B0.0",
                                                   "[send g0|0 -> 0]"]
    rows = [[("F", 0, 0, 0.0, 4.0), ("comm", -1, -1, 4.0, 13.0), ("B", 0, 0, 13.0, 21.0)],
            [("comm", -1, -1, 0.0, 4.5), ("F", 0, 0, 4.5, 8.0), ("B", 0, 0, 8.0, 12.0),
             ("comm", -1, -1, 12.0, 12.25)]]
    assert separate_waits(rows, schedule) == [
        [Box("F", 0, 0, 0.0, 4.0), Box("wait", -1, -1, 4.0, 12.0), Box("comm", -1, -1, 12.0, 13.0),
         Box("B", 0, 0, 13.0, 21.0)],
        [Box("wait", -1, -1, 0.0, 4.0), Box("comm", -1, -1, 4.0, 4.5), Box("F", 0, 0, 4.5, 8.0),
         Box("B", 0, 0, 8.0, 12.0), Box("comm", -1, -1, 12.0, 12.25)]]
    # A peer that posted before the exchange began (clocks a little apart):
    # no wait; the data arrived after the box ended: all of it waiting.
    early = [list(rows[0]), [("comm", -1, -1, 5.0, 6.0), *rows[1][1:]]]
    assert separate_waits(early, schedule)[1][0] == Box("comm", -1, -1, 5.0, 6.0)
    late = [[*rows[0][:1], ("comm", -1, -1, 4.0, 11.0), *rows[0][2:]], rows[1]]
    assert separate_waits(late, schedule)[0][1:3] == [Box("wait", -1, -1, 4.0, 11.0),
                                                     Box("B", 0, 0, 13.0, 21.0)]
    figure = timeline_figure(separate_waits(rows, schedule), v=1, title="measured")
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert "waiting for a peer" in legend and "communication" in legend
    with pytest.raises(ValueError, match="pipeline rank 1: 1 comm boxes for the 2 exchanges"):
        separate_waits([rows[0], rows[1][:-1]], schedule)


# ------------------------------------------------------------------ ptdp schedule

def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="ptdp")
    add_schedule_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["schedule", *argv])
    assert args.command == "schedule"
    code = run_schedule_command(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_schedule_command_text_summary(capsys):
    code, out, err = _run(["--kind", "1f1b", "-p", "4", "-m", "8"], capsys)
    assert code == 0 and err == ""
    assert "p = 4 ranks, m = 8 microbatches, v = 1" in out
    assert "makespan 33" in out
    assert "bubble fraction 3/8 = 0.375 (37.5%)" in out
    assert "peak in flight per rank: 4 3 2 1" in out
    assert "rank 3: F1.0 B1.0 F2.0 B2.0" in out  # microbatches from 1, as the picture numbers them


def test_schedule_command_json_interleaved(capsys):
    code, out, _ = _run(["--kind", "interleaved", "-p", "4", "-m", "8", "-v", "2", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert (data["kind"], data["p"], data["m"], data["v"]) == ("interleaved", 4, 8, 2)
    assert data["bubble_fraction"] == pytest.approx(3 / 16)
    assert data["bubble_fraction_exact"] == "3/16"
    assert data["makespan"] == pytest.approx(28.5)
    assert data["peak_in_flight"] == [11, 9, 7, 5]
    assert len(data["actions"]) == 4 and all(len(a) == 32 for a in data["actions"])
    assert data["actions"][0][:5] == ["F0.0", "F1.0", "F2.0", "F3.0", "F0.1"]


def test_schedule_command_interleaved_defaults_to_two_chunks_and_costs(capsys):
    code, out, _ = _run(["--kind", "interleaved", "-p", "2", "-m", "4", "--json",
                         "--backward-cost", "1", "--transfer-cost", "0.5"], capsys)
    data = json.loads(out)
    assert code == 0 and data["v"] == 2
    assert (data["backward_cost"], data["transfer_cost"]) == (1, 0.5)


def test_schedule_command_writes_png(tmp_path, capsys):
    path = tmp_path / "gpipe.png"
    code, out, _ = _run(["--kind", "gpipe", "-p", "2", "-m", "3", "--out", str(path)], capsys)
    assert code == 0 and f"wrote {path}" in out
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_schedule_command_invalid_schedule(capsys):
    code, out, err = _run(["--kind", "interleaved", "-p", "4", "-m", "6"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("ptdp: error: ") and "multiple of 4" in err and "m = 4 or 8" in err
    code, _, err = _run(["--kind", "1f1b", "-p", "4", "-m", "8", "-v", "2"], capsys)
    assert code == 2 and "use kind 'interleaved'" in err
    code, _, err = _run(["--kind", "1f1b", "-p", "0", "-m", "8"], capsys)
    assert code == 2 and "p = 0 must be a positive integer" in err
    code, _, err = _run(["--kind", "1f1b", "-p", "2", "-m", "2", "--forward-cost", "0"], capsys)
    assert code == 2 and "--forward-cost 0 must be positive" in err


def test_schedule_command_out_in_missing_directory(tmp_path, capsys, monkeypatch):
    import ptdp.commands.schedule as timeline

    def fail(*args, **kwargs):
        raise AssertionError("computed the schedule before checking --out")

    monkeypatch.setattr(timeline, "build_schedule", fail)
    target = tmp_path / "missing" / "x.png"
    code, out, err = _run(["--kind", "1f1b", "-p", "4", "-m", "8", "--out", str(target)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("ptdp: error: --out") and "does not exist" in err
    code, _, err = _run(["--kind", "1f1b", "-p", "4", "-m", "8", "--out", str(tmp_path / "x.txt")],
                        capsys)
    assert code == 2 and ".png" in err


def test_schedule_parser_rejects_unknown_kind(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(["--kind", "pipedream", "-p", "2", "-m", "2"], capsys)
    assert exit_info.value.code == 2
