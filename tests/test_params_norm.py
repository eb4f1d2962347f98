"""--log-params-norm and --log-num-zeros-in-grad (issue 27, item 7): the
weights' L2 norm after the step and the gradient's exact zeros, on the log
line and under Megatron-LM's TensorBoard tags. One process here, against
the model's own parameters; tests/test_ptdp_step.py and
tests/test_moe_parallel.py check that every layout gives the one-process
values (each element counted once over shards and replicas)."""

import math

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.parallel.topology import ParallelContext
from ptdp.train.loop import Trainer
from ptdp.train.report import format_log_line

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)


def _trainer(**train) -> Trainer:
    config = Config(model=MODEL, data=DataConfig(mock_data=True), train=TrainConfig(
        micro_batch_size=2, global_batch_size=4, train_iters=2, lr=1e-2, seed=3, **train))
    return Trainer(config, ParallelContext.single(), torch.device("cpu"))


def test_the_norm_and_the_zeros_are_the_models():
    trainer = _trainer(log_params_norm=True, log_num_zeros_in_grad=True, clip_grad=0.0)
    record = trainer.step(0)[0]
    params = list(trainer.model.parameters())
    assert record["params_norm"] == pytest.approx(
        math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in params)), rel=1e-6)
    zeros = sum(int((p.grad == 0).sum()) for p in params)
    assert record["num_zeros"] == zeros > 0
    line = format_log_line(record, 2)
    assert f"num zeros {zeros} | params norm {record['params_norm']:.4f}" in line


def test_without_the_flags_nothing_is_computed():
    record = _trainer().step(0)[0]
    assert record["params_norm"] is None and record["num_zeros"] is None
    assert "params norm" not in format_log_line(record, 2)
