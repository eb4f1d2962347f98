"""--overlap-param-gather (ptdp.parallel.data_parallel): under the
distributed optimizer (ZeRO-1) and ZeRO-2 the updated weights' all-gathers
are started after the step and waited for by the next forward's units.

The runs with the flag must equal the runs without it bitwise (the same
arithmetic, only the waits move): losses, gradient norms, the weights'
norm, an evaluation between steps, the tensors a checkpoint saved right
after a step writes, and the final weights. So that a missed wait cannot
pass by luck (gloo's gathers may finish before anyone looks), the test's
asynchronous gathers write their result only when waited for: a reader that
does not wait sees the previous step's weights.

One pool of four processes (d = 2, p = 2) runs both strategies in one call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ptdp.checkpoint.snapshot import _logical_tensors
from ptdp.config import ConfigError, validate
from ptdp.parallel import data_parallel
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.evaluate import evaluate
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step
from tests.test_megatron_flags import _args

STEPS = 3
CPU = torch.device("cpu")
ZERO_1 = dict(use_distributed_optimizer=True, bf16=True, ddp_bucket_size=30_000)  # buckets span layers
ZERO_2 = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads")
CASES = {"zero-1-interleaved-bf16": (1, ZERO_1), "zero-2-1f1b": (None, ZERO_2)}


class _WrittenWhenWaited:
    """An all-gather's handle whose result reaches the parameters only at
    wait(): what an unfinished gather looks like to a reader that skips it."""

    def __init__(self, output: torch.Tensor, gathered: torch.Tensor):
        self.output, self.gathered = output, gathered

    def wait(self) -> None:
        with torch.no_grad():
            self.output.copy_(self.gathered)


def _deferred_all_gather(real):
    def all_gather_flat(output, tensor, group, async_op=False):
        if not async_op:
            return real(output, tensor, group)
        gathered = torch.empty_like(output)
        real(gathered, tensor, group)  # (the collective itself, in the same order on every rank)
        return _WrittenWhenWaited(output, gathered)
    return all_gather_flat


def _trainer(ctx, k, strategy: dict, overlap: bool) -> Trainer:
    config = step._config(1, 2, 2, k, overlap_param_gather=overlap, eval_interval=100,
                          eval_iters=1, **strategy)
    return Trainer(config, ctx, CPU)


def _model_tensors(trainer: Trainer, iteration: int) -> dict[str, torch.Tensor]:
    """The weights a checkpoint after `iteration` iterations writes (the rank's share)."""
    return {name: tensor for name, tensor in _logical_tensors(trainer.training_state(iteration))
            .items() if name.startswith("model/")}


def _run_both(ctx, k, strategy: dict) -> tuple[list[int], list]:
    """Steps both runs side by side; returns the gathers found in flight
    right after each step of the overlapped run, and every difference found
    (collected, not raised: every rank goes on through the same collectives)."""
    plain, overlapped = _trainer(ctx, k, strategy, False), _trainer(ctx, k, strategy, True)
    assert overlapped.buffer.overlaps_param_gather and not plain.buffer.overlaps_param_gather
    left_for_finish, in_flight, differences = [], [], []
    finish = overlapped.buffer.finish

    def finish_noting_gathers_left():  # after the forward and backward, before the step
        left_for_finish.append(len(overlapped.buffer._gathering))
        finish()

    overlapped.buffer.finish = finish_noting_gathers_left
    for i in range(STEPS):
        want, got = plain.step(i)[0], overlapped.step(i)[0]
        in_flight.append(len(overlapped.buffer._gathering))
        differences += [(i, key, got[key], want[key]) for key in
                        ("loss", "grad_norm", "params_norm", "num_zeros", "skipped")
                        if got[key] != want[key]]
        if i == 0:  # an evaluation reads the weights through the forward's waits
            evaluated = (evaluate(overlapped, overlapped.data.valid, 1)["loss"],
                         evaluate(plain, plain.data.valid, 1)["loss"])
            if evaluated[0] != evaluated[1] or overlapped.buffer._gathering:
                differences.append((i, "evaluation", evaluated, len(overlapped.buffer._gathering)))
        if i == 1:  # a checkpoint right after the step holds the updated weights
            saved, wanted = _model_tensors(overlapped, i + 1), _model_tensors(plain, i + 1)
            differences += [(i, "saved", name) for name in wanted
                            if name not in saved or not torch.equal(saved[name], wanted[name])]
    # Every bucket was waited for by a unit of the next forward (none left for the step).
    if left_for_finish != [0] * STEPS:
        differences.append(("left for the step", left_for_finish))
    overlapped.buffer.finish_param_gather()
    final = step._logical_weights(overlapped, ctx)
    differences += [("final", name) for name, weight in step._logical_weights(plain, ctx).items()
                    if not torch.equal(final[name], weight)]
    return in_flight, differences


def _overlap_vs_synchronous(rank: int) -> dict[str, tuple[list[int], list]]:
    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=2))
    real = data_parallel.all_gather_flat
    data_parallel.all_gather_flat = _deferred_all_gather(real)
    try:
        return {name: _run_both(ctx, k, strategy) for name, (k, strategy) in CASES.items()}
    finally:
        data_parallel.all_gather_flat = real
        dist.barrier()
        ctx.destroy()


def test_overlapped_param_gather_trains_bitwise_like_the_synchronous_one(pools):
    for rank, per_case in enumerate(pools(4).run(_overlap_vs_synchronous)):
        for name, (in_flight, differences) in per_case.items():
            assert differences == [], (rank, name)
            # The gathers were left in flight by each step (waited for later).
            assert all(count > 0 for count in in_flight), (rank, name, in_flight)


def test_the_flag_is_a_setting_refused_without_a_sharded_optimizer():
    from ptdp.commands.train import config_from_args

    for flags in (["--use-distributed-optimizer"],
                  ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]):
        config = config_from_args(_args("--overlap-param-gather", *flags))
        assert config.train.overlap_param_gather
        validate(config)
    assert not config_from_args(_args("--use-distributed-optimizer")).train.overlap_param_gather
    with pytest.raises(ConfigError, match="--overlap-param-gather .* add --use-distributed-optimizer"):
        validate(config_from_args(_args("--overlap-param-gather")))


def test_plan_prices_the_overlap_and_keeps_the_flag(capsys):
    """`ptdp plan --overlap-param-gather`: the gather of the updated weights
    hides under the next forward (a shorter iteration than without), and the
    command it prints for a ZeRO-1 layout carries the flag."""
    import json

    from ptdp.cli import main

    plan = ["plan", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--seq-length", "1024", "--gpus", "8", "--global-batch-size", "64", "-t", "1", "-p",
            "1", "--micro-batch-size", "1", "--recompute-granularity", "full",
            "--use-distributed-optimizer"]
    seconds = []
    for flags in ([], ["--overlap-param-gather"]):
        assert main([*plan, *flags, "--json"]) == 0
        seconds.append(json.loads(capsys.readouterr().out)["results"][0]["iteration_seconds"])
    assert seconds[1] < seconds[0]
    assert main([*plan, "--overlap-param-gather", "--print-flags"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        "--use-distributed-optimizer --overlap-param-gather")
