"""Megatron-LM's logging and housekeeping flags (ptdp.train.report's
TensorBoard options, ptdp.train.housekeeping): --tensorboard-log-interval,
--log-validation-ppl-to-tensorboard, --log-timers-to-tensorboard,
--log-throughput, --manual-gc*, --empty-unused-memory-level, --profile*.

Runs are one in-process rank (a one-process gloo group) on a tiny model,
except the profiler's, which needs a second rank that must not write a trace.
"""

import dataclasses
import gc
import json
import math

import pytest
import torch
import torch.distributed as dist

from ptdp.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, validate
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train import housekeeping as hk
from ptdp.train import loop
from ptdp.train.report import TensorBoardLogger

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=2, train_iters=4, lr=1e-3, seed=5,
                    eval_iters=1, log_interval=100)


def _config(**train) -> Config:
    return Config(model=MODEL, train=dataclasses.replace(TRAIN, **train),
                  data=DataConfig(mock_data=True))


@pytest.fixture
def one_rank():
    """A one-process job in this process: train() as a launched rank runs it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ParallelContext.build(RankGrid(1, 1, 1))
    finally:
        dist.destroy_process_group()


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


# ------------------------------------------------------------------------------------------
# TensorBoard


def _record(iteration: int) -> dict:
    return {"iteration": iteration, "consumed_samples": 8 * iteration, "loss": 3.0 / iteration,
            "lr": 1e-3, "iteration_ms": 100.0 + iteration, "forward_backward_ms": 60.0 + iteration,
            "grad_reduce_ms": 5.0, "optimizer_ms": 20.0, "forward_ms": 20.0, "backward_ms": 40.0,
            "pipeline_transfer_ms": 1.5, "tokens_per_s": 1000.0, "tflops_per_device": 0.25 * iteration}


def test_interval_and_megatron_tags(tmp_path):
    pytest.importorskip("tensorboard")
    records = [_record(i) for i in range(1, 7)]
    for i, loss in ((3, 2.5), (6, 1.25)):  # evaluations off the interval and on it
        records[i - 1].update(val_loss=loss, val_perplexity=math.exp(loss))
    with TensorBoardLogger(tmp_path / "flags", interval=2, timers=True, validation_ppl=True,
                           throughput=True) as logger:
        for record in records:
            logger.log(record)
    with TensorBoardLogger(tmp_path / "plain", interval=2) as logger:
        for record in records:
            logger.log(record)
    flags, plain = _scalars(tmp_path / "flags"), _scalars(tmp_path / "plain")

    # Training scalars every 2 iterations; validation ones at every evaluation.
    assert [step for step, _ in flags["train/loss"]] == [2, 4, 6]
    assert [step for step, _ in flags["valid/loss"]] == [3, 6]
    assert flags["lm loss validation ppl"] == [(3, pytest.approx(math.exp(2.5))),
                                               (6, pytest.approx(math.exp(1.25)))]
    assert flags["lm loss validation ppl vs samples"] == [
        (24, pytest.approx(math.exp(2.5))), (48, pytest.approx(math.exp(1.25)))]
    # Timers in seconds under Megatron-LM's names.
    assert flags["forward-backward-time"] == [(i, pytest.approx((60.0 + i) / 1e3)) for i in (2, 4, 6)]
    assert flags["iteration-time"] == [(i, pytest.approx((100.0 + i) / 1e3)) for i in (2, 4, 6)]
    for tag in ("optimizer-time", "all-grads-sync-time", "forward-compute-time",
                "backward-compute-time", "pipeline-transfer-time"):
        assert [step for step, _ in flags[tag]] == [2, 4, 6], tag
    assert flags["throughput"] == [(i, pytest.approx(0.25 * i)) for i in (2, 4, 6)]
    # Without the flags: none of the optional Megatron-LM tags; the same values.
    megatron = {"lm loss validation ppl", "forward-backward-time", "iteration-time", "throughput"}
    assert not megatron & plain.keys()
    assert plain["train/loss"] == flags["train/loss"]
    assert plain["valid/perplexity"] == flags["valid/perplexity"]


def test_a_run_writes_at_the_interval_and_the_perplexity_of_its_loss(one_rank, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    board = tmp_path / "tb"
    config = _config(tensorboard_dir=str(board), tensorboard_log_interval=2, eval_interval=3,
                     log_validation_ppl_to_tensorboard=True, log_timers_to_tensorboard=True,
                     log_throughput=True)
    history = loop.train(config, one_rank, torch.device("cpu"))
    scalars = _scalars(board)

    assert [step for step, _ in scalars["train/loss"]] == [2, 4]
    losses = {r["iteration"]: r["loss"] for r in history}
    assert scalars["train/loss"] == [(i, pytest.approx(losses[i])) for i in (2, 4)]
    # Evaluations after iterations 3 and 4 (the last); ppl = exp(validation loss).
    valid = scalars["valid/loss"]
    assert [step for step, _ in valid] == [3, 4]
    assert scalars["lm loss validation ppl"] == [(step, pytest.approx(math.exp(loss), rel=1e-6))
                                                 for step, loss in valid]
    timings = {r["iteration"]: r for r in history}
    assert scalars["optimizer-time"] == [(i, pytest.approx(timings[i]["optimizer_ms"] / 1e3))
                                         for i in (2, 4)]
    assert {"forward-backward-time", "iteration-time", "all-grads-sync-time",
            "throughput"} <= scalars.keys()
    # The job's peak memory (here one rank's resident set: it imported torch),
    # never shrinking, in the records, the log line and TensorBoard.
    peaks = [r["peak_memory_gib"] for r in history]
    assert peaks == sorted(peaks) and peaks[0] > 50 / 1024
    assert {r["peak_memory_rank"] for r in history} == {0}
    assert {r["peak_memory_measure"] for r in history} == {"resident set size"}
    assert scalars["memory/peak_gib"] == [(i, pytest.approx(timings[i]["peak_memory_gib"]))
                                          for i in (2, 4)]
    assert "mem-max-allocated-bytes" not in scalars  # Megatron-LM's is CUDA's allocated bytes
    assert f"peak memory {peaks[-1]:.3g} GiB (rank 0, resident set)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------
# Garbage collection


def test_manual_gc_collects_at_megatron_points(one_rank, monkeypatch):
    """gc off for the run; a full collection at the start, every
    --manual-gc-interval iterations, before each evaluation, and of the
    youngest generation after it; automatic collection back on after."""
    events: list = []
    step, evaluate = loop.Trainer.step, loop.evaluate

    def recording_step(self, iteration, *args, **kwargs):
        events.append(("step", iteration + 1, gc.isenabled()))
        return step(self, iteration, *args, **kwargs)

    def recording_evaluate(*args, **kwargs):
        events.append(("evaluate",))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(loop.Trainer, "step", recording_step)
    monkeypatch.setattr(loop, "evaluate", recording_evaluate)
    monkeypatch.setattr(gc, "collect", lambda generation=2: events.append(("collect", generation)))
    assert gc.isenabled()
    loop.train(_config(manual_gc=True, manual_gc_interval=2, eval_interval=3), one_rank,
               torch.device("cpu"))
    assert gc.isenabled()
    assert events == [("collect", 2),
                      ("step", 1, False), ("step", 2, False), ("collect", 2),
                      ("step", 3, False), ("collect", 2), ("evaluate",), ("collect", 0),
                      ("step", 4, False), ("collect", 2),
                      ("collect", 2), ("evaluate",), ("collect", 0)]


def _housekeeping(device="cpu", rank=0, world_size=1, **train):
    return hk.Housekeeping(dataclasses.replace(TRAIN, **train), torch.device(device), rank=rank,
                           world_size=world_size)


def test_gc_options(monkeypatch):
    collected: list = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    # --no-manual-gc-eval: nothing around evaluations; interval 0: nothing between steps.
    keeper = _housekeeping(manual_gc=True, manual_gc_eval=False)
    keeper.start_training()
    try:
        assert not gc.isenabled() and collected == [2]
        for done in range(1, 5):
            keeper.after_iteration(done)
        with keeper.evaluation():
            pass
        assert collected == [2]
    finally:
        keeper.finish(4)
    assert gc.isenabled()
    # Without --manual-gc nothing is touched.
    collected.clear()
    plain = _housekeeping(manual_gc_interval=0)
    plain.start_training()
    plain.after_iteration(1)
    with plain.evaluation():
        assert gc.isenabled()
    plain.finish(1)
    assert collected == []


def test_empty_unused_memory_levels(monkeypatch):
    released: list = []
    monkeypatch.setattr(hk.devices, "release_cached_memory", lambda device: released.append("x"))
    for level, want in ((0, 0), (1, 2), (2, 3)):  # two iterations and one evaluation
        released.clear()
        keeper = _housekeeping(empty_unused_memory_level=level)
        keeper.after_iteration(1)
        keeper.after_iteration(2)
        with keeper.evaluation():
            pass
        assert len(released) == want, level


# ------------------------------------------------------------------------------------------
# Profiling


def _profiled_run(rank, board):
    config = _config(profile=True, use_pytorch_profiler=True, profile_step_start=1,
                     profile_step_end=3, profile_ranks=[1], tensorboard_dir=board, train_iters=4)
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, pipeline_model_parallel_size=2))
    ctx = ParallelContext.build(RankGrid(tp=1, dp=1, pp=2))
    loop.train(config, ctx, torch.device("cpu"))


def test_pytorch_profiler_traces_the_profiled_rank_only(pools, tmp_path):
    pools(2).run(_profiled_run, str(tmp_path))
    traces = sorted(p.name for p in tmp_path.glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].startswith("rank1."), traces
    events = json.loads((tmp_path / traces[0]).read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    # Iterations 2 and 3: --profile-step-end 3 minus --profile-step-start 1.
    assert len(steps) == 2, steps


def test_nsys_capture_range_brackets_the_profiled_iterations(monkeypatch):
    """Without --use-pytorch-profiler (CUDA): cudaProfilerStart before
    0-based iteration S, cudaProfilerStop after iteration E is done, on the
    profiled ranks only; a run that ends first closes the range."""
    calls: list = []
    monkeypatch.setattr(hk.devices, "cuda_profiler_start", lambda: calls.append("start"))
    monkeypatch.setattr(hk.devices, "cuda_profiler_stop", lambda: calls.append("stop"))

    def run(rank, iterations):
        calls.clear()
        keeper = _housekeeping("cuda", rank=rank, world_size=2, profile=True, profile_step_start=2,
                               profile_step_end=4, profile_ranks=[1])
        for iteration in range(iterations):
            keeper.before_iteration(iteration)
            calls.append(iteration + 1)
            keeper.after_iteration(iteration + 1)
        keeper.finish(iterations)
        return calls[:]

    assert run(1, 6) == [1, 2, "start", 3, 4, "stop", 5, 6]
    assert run(0, 6) == [1, 2, 3, 4, 5, 6]
    assert run(1, 3) == [1, 2, "start", 3, "stop"]


def test_profiling_refusals(capsys):
    def problems(**train):
        try:
            validate(_config(**train))
        except ConfigError as error:
            return error.problems
        return []

    assert problems(profile=True, use_pytorch_profiler=True) == [
        "--use-pytorch-profiler writes its trace under --tensorboard-dir: add --tensorboard-dir DIR"]
    assert any("--profile-step-end=4 must be an integer greater than --profile-step-start 4" in p
               for p in problems(profile=True, profile_step_start=4, profile_step_end=4))
    assert any("--profile-ranks=[-1]" in p for p in problems(profile=True, profile_ranks=[-1]))
    found = problems(use_pytorch_profiler=True, profile_ranks=[1], manual_gc_interval=5,
                     log_timers_to_tensorboard=True, log_validation_ppl_to_tensorboard=True,
                     tensorboard_log_interval=0)
    for text in ("--use-pytorch-profiler only applies when profiling: add --profile",
                 "--profile-ranks only applies when profiling: add --profile",
                 "--manual-gc-interval 5 paces manual garbage collection: add --manual-gc",
                 "--log-timers-to-tensorboard writes to TensorBoard: add --tensorboard-dir DIR",
                 "--log-validation-ppl-to-tensorboard writes to TensorBoard: add --tensorboard-dir",
                 "--tensorboard-log-interval=0 must be a positive integer"):
        assert any(text in p for p in found), text
    assert problems(empty_unused_memory_level=3) == ["--empty-unused-memory-level=3 is not one of "
                                                     "0, 1, 2"]
    assert problems(log_throughput=True, profile=True, use_pytorch_profiler=True,
                    tensorboard_dir="tb", manual_gc=True, manual_gc_interval=3) == []
    # What only the job knows: its size and its device. --profile alone is
    # Megatron-LM's nsys range: on CPU a note (its example scripts give it), no CUDA call.
    keeper = _housekeeping(profile=True, profile_step_start=0, profile_step_end=1)
    keeper.before_iteration(0)
    keeper.after_iteration(1)
    assert not keeper.profiles and "add --use-pytorch-profiler" in capsys.readouterr().out
    with pytest.raises(hk.HousekeepingError, match="--profile-ranks 2 3: the job has 2 processes, ranks 0 to 1"):
        _housekeeping(profile=True, use_pytorch_profiler=True, tensorboard_dir="tb",
                      profile_ranks=[0, 2, 3], world_size=2)
