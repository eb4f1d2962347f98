"""Sequence parallelism computes what one process computes.

With dropout off, --sequence-parallel at t in {2, 4}, alone, with p = 2 (every
schedule), with d = 2 and the distributed optimizer, with and without
recomputation: the loss and every gradient equal the one-process model's,
for the GPT and a Llama-style model. Measured while running: pipeline sends
carry each rank's own b·(s/t)·h slice, and the norms' gradients, which each
tensor rank computes from its own positions, are summed over the tensor
group once per iteration. With dropout on, recomputation replays the
per-rank masks (bitwise) and resume is bitwise.

Tolerances are those of the tensor-parallel and pipeline tests (the sums
are reordered: the sequence is split and gathered, norms' gradients summed).
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from ptdp.model.gpt import GPT
from ptdp.parallel.sharding import PARTIAL_GRAD_ATTR, SHARD_ATTR, gather_logical
from ptdp.parallel.tensor import RNGStreams, sum_partial_grads
from ptdp.parallel.topology import ParallelContext, RankGrid
from tests import test_checkpoint, test_gpt, test_pipeline, test_ptdp_step
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.train.loop import Trainer
from tests.test_llama import LLAMA

SEED = 7
LOSS_TOL = dict(rtol=1e-6, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=2e-7)
MODELS = {"gpt": test_gpt.SMALL, "llama": dataclasses.replace(LLAMA, num_layers=2, seq_length=16)}


def _build(config, ctx, sequence_parallel):
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(SEED, ctx)
    return GPT(config, ctx, rng, sequence_parallel=sequence_parallel).initialize(SEED)


def _tensor_parallel_vs_serial(rank, t, config):
    ctx = ParallelContext.build(RankGrid(tp=t, dp=1, pp=1))
    serial = _build(config, ParallelContext.single(), False)
    parallel = _build(config, ctx, True)
    tokens, labels = test_gpt._batch(config)
    mask = (torch.arange(config.seq_length) % 3 != 0).float().expand_as(labels)
    serial_loss, parallel_loss = serial(tokens, labels, mask), parallel(tokens, labels, mask)
    serial_loss.backward()
    parallel_loss.backward()
    partial = [p.grad for p in parallel.parameters() if getattr(p, PARTIAL_GRAD_ATTR, False)]
    assert partial  # the norms' weights (and biases) are marked
    sum_partial_grads(partial, ctx.tp_group)
    assert_close(parallel_loss, serial_loss, **LOSS_TOL)
    serial_params = dict(serial.named_parameters())
    for name, param in parallel.named_parameters():
        reference = serial_params[name]
        assert_close(gather_logical(param.grad, getattr(param, SHARD_ATTR, None), ctx.tp_group),
                     gather_logical(reference.grad, getattr(reference, SHARD_ATTR, None), None),
                     **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")
    return parallel_loss.item()


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("model", list(MODELS))
def test_sequence_parallel_equals_one_process(pools, t, model):
    losses = pools(t).run(_tensor_parallel_vs_serial, t, MODELS[model])
    assert len(set(losses)) == 1


PIPELINES = [(t, kind, v) for t in (2, 4)
             for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))]
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


@pytest.mark.parametrize("t,kind,v", PIPELINES, ids=[f"t{t}-p2-{k}-v{v}" for t, k, v in PIPELINES])
def test_sequence_parallel_pipelines_equal_one_process(pools, t, kind, v):
    """p = 2 with every schedule (GPipe, 1F1B, interleaved), t = 2 and 4: the
    loss and every gradient; each send carries b·(s/t)·h elements."""
    pools(t * 2).run(test_pipeline._pipeline_vs_serial, t, 2, kind, v, 4, True, test_pipeline.CONFIG,
                     True)


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_sequence_parallel_with_recomputation_equals_one_process(pools, model, recompute):
    config = dataclasses.replace(MODELS[model], num_layers=4, **RECOMPUTE[recompute])
    pools(4).run(test_pipeline._pipeline_vs_serial, 2, 2, "interleaved", 2, 4, True, config, True)


@pytest.mark.parametrize("k,distributed", [(None, False), (1, True)],
                         ids=["1f1b-adamw", "interleaved-distributed-optimizer"])
def test_sequence_parallel_full_step_trains_like_one_process(pools, k, distributed):
    """t = p = d = 2 with GradBuffer summing the norms' gradients over the
    tensor group before the data-parallel reduction: five AdamW steps,
    losses, gradient norms and weights as test_ptdp_step checks them."""
    results = pools(8).run(test_ptdp_step._ptdp_vs_serial, k, distributed, test_ptdp_step.MODEL,
                           test_ptdp_step.WEIGHT_TOL, True)
    assert max(r[2] for r in results) < 1e-5


def _dropout_masks_differ_per_rank(rank):
    """Dropout on: each tensor rank drops its own positions from its own
    stream, so the embedding outputs of the two ranks differ (they are other
    positions), and the run is reproducible."""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=1))
    config = dataclasses.replace(test_gpt.SMALL, hidden_dropout=0.5)
    tokens, _ = test_gpt._batch(config)
    outputs = [_build(config, ctx, True).train().embedding(tokens) for _ in range(2)]
    return outputs[0].detach(), torch.equal(outputs[0], outputs[1])


def test_dropout_draws_each_ranks_own_positions(pools):
    (first, same0), (second, same1) = pools(2).run(_dropout_masks_differ_per_rank)
    assert same0 and same1 and first.shape[0] == test_gpt.SMALL.seq_length // 2
    assert ((first == 0) != (second == 0)).any()


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_with_dropout_is_bitwise_exact(pools, recompute):
    """t = p = d = 2 interleaved, dropout on: recomputation replays the
    per-rank masks of the sequence-parallel regions too."""
    for same_losses, same_weights, _ in pools(8).run(test_ptdp_step._recompute_vs_off,
                                                     RECOMPUTE[recompute], True):
        assert same_losses and same_weights


def test_resume_is_bitwise_exact(pools, tmp_path):
    """Dropout on, t = p = d = 2 interleaved: 6 iterations straight equal 3,
    save, load, 3 more, bitwise (losses and weights)."""
    for got, expected, same_weights, _ in pools(8).run(test_checkpoint._resume_same_layout,
                                                       str(tmp_path), {}, True):
        assert got == expected and same_weights


def _leg(rank, save, t, p, d, sequence_parallel, start):
    ctx = ParallelContext.build(RankGrid(tp=t, dp=d, pp=p))
    config = test_ptdp_step._config(t, p, d, None, MODELS["llama"], sequence_parallel,
                                    train_iters=6, use_distributed_optimizer=d > 1)
    trainer = Trainer(config, ctx, torch.device("cpu"), start=start)
    if start[0]:
        trainer.load(save)
    losses = [trainer.step(i)[0]["loss"] for i in range(start[0], start[0] + 2)]
    trainer.save(save, start[0] + 2)
    return losses


def test_checkpoints_reshard_with_and_without_sequence_parallelism(pools, tmp_path):
    """A Llama-style model, two steps in each of three layouts: d = 2 without
    sequence parallelism, t = 4 and d = 2 with it and the distributed
    optimizer, t = p = 2 with it: the losses continue one process's."""
    serial = Trainer(test_ptdp_step._config(model=MODELS["llama"], train_iters=6),
                     ParallelContext.single(), torch.device("cpu"))
    expected = [serial.step(i)[0]["loss"] for i in range(6)]
    got, start = [], (0, 0)
    for t, p, d, sequence_parallel in ((1, 1, 2, False), (4, 1, 2, True), (2, 2, 1, True)):
        results = pools(t * p * d).run(_leg, str(tmp_path), t, p, d, sequence_parallel, start)
        got += [r for r in results if r[0] is not None][-1]
        metadata = read_metadata(resolve(tmp_path))
        start = (metadata["iteration"], metadata["consumed_samples"])
    assert got == pytest.approx(expected, rel=1e-5)


def _low_precision(rank, flags):
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=1))
    losses = []
    for sequence_parallel in (False, True):
        config = test_ptdp_step._config(2, 1, 1, None, test_ptdp_step.MODEL, sequence_parallel,
                                        train_iters=4, **flags)
        trainer = Trainer(config, ctx, torch.device("cpu"))
        losses.append([trainer.step(i)[0]["loss"] for i in range(4)])
    return losses


@pytest.mark.parametrize("flags", [dict(bf16=True), dict(fp16=True, initial_loss_scale=2.0 ** 12)],
                         ids=["bf16", "fp16"])
def test_sequence_parallel_in_bf16_and_fp16(pools, flags):
    """t = 2, four steps: with and without sequence parallelism the losses
    agree to the precision's rounding (the sums are split differently)."""
    without, with_sp = pools(2).run(_low_precision, flags)[0]
    assert with_sp == pytest.approx(without, rel=1e-2)
    assert with_sp[-1] < with_sp[0]


COMMON = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--vocab-size", "500", "--make-vocab-size-divisible-by", "16",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3", "--seed", "5",
          "--eval-interval", "2", "--eval-iters", "1"]


def _run(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "ptdp", *args], capture_output=True, text=True,
                            env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _in_this_process(capsys, *args) -> str:
    """A one-process `ptdp` command through ptdp's own entry point here (one
    rank needs no launch): its stdout, as _run returns it."""
    from ptdp.cli import main

    capsys.readouterr()
    status = main(list(args))
    output = capsys.readouterr()
    assert status == 0, output.out + output.err
    return output.out


def test_train_evaluate_save_and_generate_from_the_command_line(tmp_path, capsys):
    """`ptdp train --sequence-parallel` at t = p = 2: the training and
    validation losses of one process; its checkpoint generates at t = 2 what
    the one-process checkpoint generates on one process. (The one-process
    runs go through `ptdp`'s entry point in this process: no interpreter to
    start.)"""
    outputs = {}
    for name, layout in (("serial", []), ("sp", ["-t", "2", "-p", "2", "--sequence-parallel"])):
        metrics = tmp_path / f"{name}.jsonl"
        run = _run if layout else functools.partial(_in_this_process, capsys)
        run("train", *COMMON, *layout, "--metrics-file", str(metrics),
            "--save", str(tmp_path / name))
        outputs[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    for got, want in zip(outputs["sp"], outputs["serial"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert ("val_loss" in got) == ("val_loss" in want)
        if "val_loss" in want:
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    assert sum("val_loss" in r for r in outputs["sp"]) == 2
    generate = ["generate", "--prompt", "1 2 3", "--max-new-tokens", "6", "--temperature", "0"]
    expected = _in_this_process(capsys, *generate, "--load", str(tmp_path / "serial"))
    assert _run(*generate, "--load", str(tmp_path / "sp"), "-t", "2") == expected


def test_invalid_layouts_are_refused_before_launch(no_launch, capsys):
    from tests.in_process import train_refused

    status, _, err = train_refused([*COMMON, "-t", "2", "--sequence-parallel", "--seq-length", "33"],
                                   capsys)
    assert status != 0, err
    assert "--seq-length 33 divisible by --tensor-model-parallel-size 2" in err


def test_at_one_tensor_rank_it_is_turned_off_with_a_note_as_megatron_does(no_launch, capsys):
    """Megatron-LM's Llama example sets --sequence-parallel at t = 1, where
    Megatron-LM turns it off; so does ptdp, saying so (no_launch: the note
    comes before any process starts)."""
    from ptdp.cli import main

    with pytest.raises(AssertionError, match="a training process was started"):
        main(["train", *COMMON, "--sequence-parallel"])
    assert "--sequence-parallel has no effect with --tensor-model-parallel-size 1" in \
        capsys.readouterr().out
    from ptdp.config import Config, ParallelConfig, validate
    with pytest.raises(ValueError, match="needs --tensor-model-parallel-size > 1"):
        validate(Config(parallel=ParallelConfig(sequence_parallel=True)))  # (the API refuses it)
