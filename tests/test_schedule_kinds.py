"""Adding a schedule is a generator plus a record (ptdp.schedules.kinds):
a toy kind, GPipe under another name, defined and registered here alone, is
accepted by the configuration's checks, the planner's candidates, the
timeline and the executor, and the records say what the old name tests
said."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from torch.testing import assert_close

from ptdp.cli import build_parser
from ptdp.commands.train import config_from_args
from ptdp.config import ConfigError, validate
from ptdp.model.gpt import build_chunks
from ptdp.parallel.pipeline.executor import PipelineExecutor
from ptdp.parallel.topology import ParallelContext
from ptdp.perf.plan.candidates import candidate_layouts
from ptdp.perf.layout import Layout, Workload
from ptdp.commands.schedule import add_schedule_parser, run_schedule_command
from ptdp.schedules.actions import Compute, Schedule, ScheduleError
from ptdp.schedules.build import build_schedule
from ptdp.schedules.kinds import KINDS, ScheduleKind, kind_named, register, unregister
from ptdp.schedules.one_f_one_b import with_exchanges
from ptdp.schedules.simulate import simulate
from tests.test_pipeline import B_MICRO, CONFIG, LOSS_TOL, SEED, _microbatch_fn, _serial_reference
from tests.test_pipeline import _tokens

TOY = "gpipe-copy"


def _toy_order(p: int, m: int, v: int, rank: int) -> list[Compute]:
    """All forwards, then all backwards: GPipe's order."""
    return [Compute(op, i, 0) for op in "FB" for i in range(m)]


def _toy_schedule(p: int, m: int, v: int, costs) -> Schedule:
    steps = [[compute] for compute in _toy_order(p, m, v, 0)]
    ranks = tuple(with_exchanges(steps, rank, p, v) for rank in range(p))
    return Schedule(TOY, p, m, v, ranks, warmups=(m,) * p)


@pytest.fixture
def toy_kind():
    kind = register(ScheduleKind(TOY, title="GPipe, copied", generate=_toy_schedule,
                                 order=_toy_order))
    yield kind
    unregister(TOY)


def test_the_toy_is_gone_after_its_fixture():
    assert TOY not in KINDS
    with pytest.raises(ScheduleError, match=f"unknown schedule kind '{TOY}': use one of gpipe, "
                                            f"1f1b, interleaved, zb-h1, zbv"):
        build_schedule(TOY, 2, 4)


def test_a_registered_kind_builds_and_simulates_like_the_one_it_copies(toy_kind):
    for p, m in ((2, 4), (4, 6)):
        toy, gpipe = simulate(build_schedule(TOY, p, m)), simulate(build_schedule("gpipe", p, m))
        assert (toy.makespan, toy.peak_in_flight) == (gpipe.makespan, gpipe.peak_in_flight)
    with pytest.raises(ScheduleError, match=f"the {TOY} schedule has one chunk per rank"):
        build_schedule(TOY, 2, 4, 2)
    with pytest.raises(ScheduleError, match="already registered"):
        register(toy_kind)


def test_the_config_checks_accept_a_registered_kind(toy_kind):
    argv = ["train", "--pipeline-schedule", TOY, "-p", "2", "--num-layers", "4",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--mock-data"]
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.parallel.pipeline_schedule, config.parallel.schedule_kind) == (TOY, TOY)
    validate(config)
    chunked = dataclasses.replace(config.parallel, num_layers_per_virtual_pipeline_stage=1)
    with pytest.raises(ConfigError, match=f"--pipeline-schedule {TOY} cannot be combined with "
                                          f"--num-layers-per-virtual-pipeline-stage"):
        validate(dataclasses.replace(config, parallel=chunked))


def test_the_planner_offers_a_registered_kind_where_gpipe_is_valid(toy_kind):
    workload = Workload(CONFIG, global_batch=8)
    layouts = list(candidate_layouts(workload, 2, pipeline_sizes=(2,), schedules=(TOY,),
                                     recompute=(None,), distributed_optimizer=(False,),
                                     sequence_parallel=(False,), layer_splits=False))
    assert layouts and {(layout.schedule, layout.v) for layout in layouts} == {(TOY, 1)}
    assert Layout(p=2, schedule=TOY).valid_for(CONFIG, 8) == []
    assert Layout(p=2, schedule=TOY).train_flags(CONFIG, 8)[-2:] == ["--pipeline-schedule", TOY]


def test_the_timeline_shows_a_registered_kind_with_its_title(toy_kind, capsys):
    parser = argparse.ArgumentParser(prog="ptdp")
    add_schedule_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["schedule", "--kind", TOY, "-p", "2", "-m", "4"])
    assert run_schedule_command(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("GPipe, copied schedule: p = 2 ranks, m = 4 microbatches")
    assert "bubble fraction 1/4" in text and "paper (p-1)/m = 1/4" in text
    assert kind_named(TOY).bubble(2, 4, 1) == kind_named("gpipe").bubble(2, 4, 1)


def test_the_executor_runs_a_registered_kind(toy_kind):
    """On one pipeline rank, in this process: the loss and gradients of the
    one-process model."""
    m, ctx, config = 2, ParallelContext.single(), dataclasses.replace(CONFIG, num_layers=2)
    chunks = build_chunks(config, ctx, torch.device("cpu"), SEED, 1, kind=TOY)
    executor = PipelineExecutor(chunks, ctx, activation_shape=(config.seq_length, B_MICRO,
                                                               config.hidden_size),
                                dtype=torch.float32, device=torch.device("cpu"))
    stats = executor.run(build_schedule(TOY, 1, m), _microbatch_fn(_tokens(m, config)))
    serial, serial_loss = _serial_reference(m, config)
    assert_close(torch.stack(stats.losses).mean(), serial_loss.detach(), **LOSS_TOL)
    reference = dict(serial.named_parameters())
    for name, param in chunks[0].named_parameters():
        assert_close(param.grad, reference[name].grad, rtol=1e-5, atol=1e-6)
