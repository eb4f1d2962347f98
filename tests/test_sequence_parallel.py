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

import pytest
import torch
from torch.testing import assert_close

from ptdp.model.gpt import GPT
from ptdp.parallel.sharding import PARTIAL_GRAD_ATTR, SHARD_ATTR, gather_logical
from ptdp.parallel.tensor import RNGStreams, sum_partial_grads
from ptdp.parallel.topology import ParallelContext, RankGrid
from tests import test_checkpoint, test_gpt, test_pipeline, test_ptdp_step
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


PIPELINES = [(2, "gpipe", 1), (2, "1f1b", 1), (2, "interleaved", 2), (4, "1f1b", 1)]
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


@pytest.mark.parametrize("k", [None, 1], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed-optimizer"])
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
    """Dropout on, t = p = d = 2 interleaved: 10 iterations straight equal 5,
    save, load, 5 more, bitwise (losses and weights)."""
    for got, expected, same_weights, _ in pools(8).run(test_checkpoint._resume_same_layout,
                                                       str(tmp_path), {}, True):
        assert got == expected and same_weights
