"""Validation through the pipeline, forward only (ptdp.train.evaluate).

The parallel evaluation (t = 2, p = 2, d = 2; 1F1B layout and interleaved)
must give the one-process value on the same validation samples: the layouts
reorder floating-point sums (tensor all-reduces, data-parallel averaging),
so rtol 1e-5. The one-process value is checked against the model called
directly, microbatch by microbatch (rtol 1e-6: the same operations).
"""

import dataclasses
import math

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.data.loader import collate
from ptdp.data.microbatch import split_microbatch
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.evaluate import evaluate
from ptdp.train.loop import Trainer

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=8, train_iters=2, lr=1e-2, seed=17)
EVAL_ITERS = 2


def _config(t=1, p=1, d=1, k=None, model=MODEL, **train):
    return Config(model=model,
                  parallel=ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                          data_parallel_size=d, num_layers_per_virtual_pipeline_stage=k),
                  train=dataclasses.replace(TRAIN, **train), data=DataConfig(mock_data=True))


def _state(trainer):
    """Everything evaluation must leave alone."""
    opt = trainer.optimizer
    return {"params": trainer.buffer.param_data.clone(), "grads": trainer.buffer.grad_data.clone(),
            "main": opt.main.clone(), "exp_avg": opt.exp_avg.clone(),
            "exp_avg_sq": opt.exp_avg_sq.clone(), "steps": opt.steps,
            "rng": torch.get_rng_state(),
            "streams": {k: v.clone() for k, v in trainer.chunks[0].rng.states.items()}}


def _assert_unchanged(before, after):
    for key, value in before.items():
        if isinstance(value, dict):
            assert value.keys() == after[key].keys()
            for name in value:
                assert torch.equal(value[name], after[key][name]), f"{key}/{name} changed"
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), f"{key} changed"
        else:
            assert value == after[key], f"{key} changed"


def _evaluations(trainer):
    """Evaluate at the initial weights, then again after one training step
    (so weights, gradients and Adam moments are all non-zero), checking that
    evaluation touches none of them."""
    results = [evaluate(trainer, trainer.data.valid, EVAL_ITERS)]
    trainer.step(0)
    before = _state(trainer)
    results.append(evaluate(trainer, trainer.data.valid, EVAL_ITERS))
    _assert_unchanged(before, _state(trainer))
    assert all(m.training for m in trainer.model.modules())
    return results


def _parallel(rank, k):
    ctx = ParallelContext.build(RankGrid(tp=2, dp=2, pp=2))
    trainer = Trainer(_config(2, 2, 2, k), ctx, torch.device("cpu"))
    return ctx.is_last_stage, _evaluations(trainer)


@pytest.mark.parametrize("k", [None, 1], ids=["1f1b", "interleaved"])
def test_parallel_evaluation_equals_one_process(pools, k):
    serial = _evaluations(Trainer(_config(), ParallelContext.single(), torch.device("cpu")))
    assert serial[0]["loss"] != serial[1]["loss"]  # the step changed the model
    results = pools(8).run(_parallel, k)
    assert sum(last for last, _ in results) == 4  # t·d ranks on the last stage
    for last, evaluations in results:
        for got, want in zip(evaluations, serial):
            if last:
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
                assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)
            else:
                assert got == {"loss": None, "perplexity": None}


def _manual_loss(trainer, dataset, num_iters, start):
    """Mean over microbatches of the model's loss, calling the one-process
    model directly on samples start + k·B + i·b onwards."""
    model, b, B = trainer.chunks[0], trainer.config.train.micro_batch_size, trainer.global_batch
    model.eval()
    losses = []
    with torch.no_grad():
        for k in range(num_iters):
            for i in range(B // b):
                first = start + k * B + i * b
                tokens = collate(dataset, range(first, first + b), trainer.config.model.vocab_size)
                losses.append(model(*split_microbatch(tokens, None, False)).item())
    model.train()
    return sum(losses) / len(losses), losses


@pytest.mark.parametrize("start", [0, 5])
def test_loss_is_the_mean_of_microbatch_losses(start):
    trainer = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    result = evaluate(trainer, trainer.data.valid, EVAL_ITERS, start_sample=start)
    want, losses = _manual_loss(trainer, trainer.data.valid, EVAL_ITERS, start)
    assert len(losses) == EVAL_ITERS * 8 and len(set(losses)) > 1
    assert result["loss"] == pytest.approx(want, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
    # The samples matter: another start gives another value.
    other = evaluate(trainer, trainer.data.valid, EVAL_ITERS, start_sample=start + 1)
    assert other["loss"] != result["loss"]


def test_dropout_is_off_and_training_is_unaffected():
    dropout = dataclasses.replace(MODEL, hidden_dropout=0.5, attention_dropout=0.5)
    trainer = Trainer(_config(model=dropout), ParallelContext.single(), torch.device("cpu"))
    first = evaluate(trainer, trainer.data.valid, EVAL_ITERS)
    second = evaluate(trainer, trainer.data.valid, EVAL_ITERS)
    assert first == second
    # The same weights without dropout (initialisation does not depend on it).
    plain = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    assert evaluate(plain, plain.data.valid, EVAL_ITERS) == first
    # Dropout is really configured: in training mode the forward differs.
    model, data = trainer.chunks[0], trainer.data.valid
    tokens = collate(data, range(0, 1), MODEL.vocab_size)
    with torch.no_grad():
        assert model(*split_microbatch(tokens, None, False)).item() != pytest.approx(
            _manual_loss(trainer, data, 1, 0)[1][0], rel=1e-3)
    # Training after an evaluation is the training without it (dropout
    # streams untouched). One after the other: the replicated dropout stream
    # is the process's default generator, which each Trainer seeds.
    runs = []
    for evaluate_first in (True, False):
        trainer = Trainer(_config(model=dropout), ParallelContext.single(), torch.device("cpu"))
        if evaluate_first:
            evaluate(trainer, trainer.data.valid, EVAL_ITERS)
            assert trainer.model.training
        runs.append([trainer.step(i)[0]["loss"] for i in range(2)])
    assert runs[0] == runs[1]


def test_missing_validation_set_is_a_clear_error():
    trainer = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    with pytest.raises(ValueError, match="--split"):
        evaluate(trainer, None, 1)
    with pytest.raises(ValueError, match="at least one"):
        evaluate(trainer, trainer.data.valid, 0)
