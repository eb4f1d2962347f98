"""The optimizer pieces on one process: AdamW over the flat buffer equals
torch.optim.AdamW, the LR schedule, the loss scaler, weight-decay and norm
ranges."""

import gc
import math
import weakref

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.parallel.topology import ParallelContext
from ptdp.train.loop import Trainer
from ptdp.train.optimizer import LossScaler, learning_rate
from ptdp.train import optimizer as optimizer_module

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)


def _config(**train):
    base = dict(micro_batch_size=2, global_batch_size=4, train_iters=4, lr=1e-2, seed=9,
                clip_grad=0.0, weight_decay=0.1, lr_decay_style="constant")
    base.update(train)
    return Config(model=MODEL, train=TrainConfig(**base), data=DataConfig(mock_data=True))


@pytest.mark.parametrize("fused", [True, False])
def test_flat_adamw_equals_torch_adamw(fused, monkeypatch):
    """Our AdamW on the flat fp32 buffer against torch.optim.AdamW on the same
    model (decay on matrices only), over 4 steps: with PyTorch's fused kernel,
    and op by op (where a PyTorch lacks the kernel) against torch's foreach
    implementation. (Gradients near zero, such as the key bias's, make the
    update sensitive to rounding, so each path is held to its own twin.)"""
    if not fused:
        monkeypatch.setattr(optimizer_module, "_fused_adamw", lambda *args: False)
    config = _config()
    trainer = Trainer(config, ParallelContext.single(), torch.device("cpu"))
    reference = Trainer(config, ParallelContext.single(), torch.device("cpu"))
    params = list(reference.model.parameters())
    torch_adamw = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=1e-2,
        fused=fused, foreach=not fused)
    for iteration in range(4):
        trainer.step(iteration)
        # The reference computes the same gradients through its own buffer,
        # then torch's AdamW steps its parameters (gradients are aliased).
        reference.model.train()
        reference.buffer.start_iteration(reference.num_micro)
        reference.executor.run(reference.schedule, reference.microbatch_fn(iteration))
        reference.buffer.finish()
        torch_adamw.step()
    for (name, ours), theirs in zip(trainer.model.named_parameters(), params):
        assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_weight_decay_and_norm_ranges_cover_the_right_parameters():
    trainer = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    decayed = sum(end - start for start, end in trainer.optimizer.decay_ranges)
    matrices = sum(p.numel() for p in trainer.model.parameters() if p.ndim >= 2)
    assert decayed == matrices
    counted = sum(end - start for start, end in trainer.optimizer.norm_ranges)
    assert counted == sum(p.numel() for p in trainer.model.parameters())


def test_gradient_norm_in_pieces_equals_the_whole(monkeypatch):
    """CUDA's dot refused 2^31 elements or more (a 2.7 B-parameter model's one
    gradient range did, on an H200): the norm is summed over pieces of at most
    PIECE elements. With pieces of 7 elements the gradient norm and the
    step equal those of whole ranges."""
    whole = Trainer(_config(clip_grad=1.0), ParallelContext.single(), torch.device("cpu"))
    monkeypatch.setattr(optimizer_module, "PIECE", 7)
    pieces = Trainer(_config(clip_grad=1.0), ParallelContext.single(), torch.device("cpu"))
    assert max(end - start for start, end in pieces.optimizer.norm_ranges) > 7
    for iteration in range(2):
        expected, got = whole.step(iteration)[0], pieces.step(iteration)[0]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    for (name, a), b in zip(whole.model.named_parameters(), pieces.model.parameters()):
        assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_the_gradient_norm_is_exact_over_a_long_range(monkeypatch):
    """The norm of one range of 600 thousand gradients equals its float64
    value to 1e-7 (the float32 rows' sums, added in float64, are about 1e-8
    off): a float32 BLAS dot over the range was 2e-5 off, more than a
    tensor-parallel layout (whose ranks hold shorter ranges) then disagreed
    with one process by."""
    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16,
                        vocab_size=4096, untie_embeddings_and_output_weights=True,
                        hidden_dropout=0.0, attention_dropout=0.0)
    trainer = Trainer(Config(model=model, train=TrainConfig(micro_batch_size=4, global_batch_size=4,
                                                            train_iters=1, clip_grad=1.0),
                             data=DataConfig(mock_data=True)),
                      ParallelContext.single(), torch.device("cpu"))
    exact = []
    step = optimizer_module.Optimizer.step

    def recording_step(self, lr, decoupled_lr=None):
        grads = self.buffer.reduced_grads
        exact.append(math.sqrt(sum(grads[a:b].double().square().sum().item()
                                   for a, b in self.norm_ranges)))
        return step(self, lr, decoupled_lr)

    monkeypatch.setattr(optimizer_module.Optimizer, "step", recording_step)
    assert max(b - a for a, b in trainer.optimizer.norm_ranges) > 500_000
    assert trainer.step(0)[0]["grad_norm"] == pytest.approx(exact[0], rel=1e-7)


@pytest.mark.parametrize("size", [0, 5, optimizer_module.SQUARES_PER_ROW,
                                  3 * optimizer_module.SQUARES_PER_ROW + 7, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_squares_equals_the_float64_sum(size, dtype):
    """Rows of float32 sums added in float64: within 1e-7 of the exact sum
    (about 1e-8 off), whole rows, a remainder, or both."""
    values = (torch.randn(size, generator=torch.Generator().manual_seed(size)) * 3).to(dtype)
    exact = values.double().square().sum().item()
    got = optimizer_module.sum_of_squares(values)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(exact, rel=1e-7, abs=0.0)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_dropped_trainer_frees_its_weights_gradients_and_state(bf16):
    """A process that builds a second trainer (a benchmark, a notebook) gets
    the first one's memory back: on an H200 each 1.3 B run of bench/gpu.py
    kept about 10 GiB of the previous run's buffers, because the gradient
    hooks held the buffer strongly from where the garbage collector does
    not look."""
    trainer = Trainer(_config(bf16=bf16), ParallelContext.single(), torch.device("cpu"))
    for iteration in range(2):
        trainer.step(iteration)
    tensors = {"grad_data": trainer.buffer.grad_data, "param_data": trainer.buffer.param_data,
               "exp_avg": trainer.optimizer.exp_avg, "exp_avg_sq": trainer.optimizer.exp_avg_sq,
               "main": trainer.optimizer.main}
    tensors.update(trainer.model.named_parameters())
    alive = {name: weakref.ref(tensor) for name, tensor in tensors.items()}
    del trainer, tensors
    gc.collect()
    assert [name for name, ref in alive.items() if ref() is not None] == []


@pytest.mark.parametrize("style,expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 0.775, 0.55, 0.325, 0.1]),
    ("cosine", [0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55,
                0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.1]),
])
def test_learning_rate_schedule(style, expected):
    config = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=6, train_iters=8,
                         lr_decay_style=style)
    got = [learning_rate(k, config) for k in range(1, 7)]
    assert got == pytest.approx(expected)
    if style != "constant":
        assert learning_rate(8, config) == pytest.approx(0.1)  # after the decay: min-lr


def test_dynamic_loss_scaler():
    scaler = LossScaler(1024.0, dynamic=True, min_scale=256.0, window=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 1024.0          # hysteresis: the first overflow is tolerated
    scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(True)
    assert scaler.scale == 256.0
    scaler.update(True)
    assert scaler.scale == 256.0           # never below the minimum
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 512.0           # a window without overflow doubles it
    scaler.update(True)
    assert scaler.scale == 512.0           # hysteresis restored by the growth
    static = LossScaler(8.0, dynamic=False)
    static.update(True)
    assert static.scale == 8.0


def test_loss_scaler_from_config():
    assert LossScaler.from_config(TrainConfig()).scale == 1.0
    assert LossScaler.from_config(TrainConfig(bf16=True)).scale == 1.0
    fixed = LossScaler.from_config(TrainConfig(fp16=True, loss_scale=128.0))
    assert fixed.scale == 128.0 and not fixed.dynamic
    dynamic = LossScaler.from_config(TrainConfig(fp16=True, initial_loss_scale=4096.0, hysteresis=1))
    assert dynamic.scale == 4096.0 and dynamic.dynamic and dynamic.hysteresis == 1


def test_mixed_precision_keeps_fp32_main_weights_and_gradients():
    for flags, dtype in (({"bf16": True}, torch.bfloat16),
                         ({"fp16": True, "initial_loss_scale": 1024.0}, torch.float16)):
        trainer = Trainer(_config(**flags), ParallelContext.single(), torch.device("cpu"))
        assert all(p.dtype == dtype for p in trainer.model.parameters())
        assert trainer.buffer.grad_data.dtype == torch.float32
        assert trainer.optimizer.main.dtype == torch.float32
        record, _ = trainer.step(0)
        assert math.isfinite(record["loss"]) and not record["skipped"]
        # Main weights are the fp32 truth; the model holds their rounding.
        assert_close(trainer.buffer.param_data, trainer.optimizer.main.to(dtype))
        assert record["optimizer_state_bytes"] == 3 * 4 * trainer.buffer.numel
    fp32 = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    assert fp32.optimizer.main is fp32.buffer.param_data  # no copy for fp32
    assert fp32.optimizer.state_bytes == 2 * 4 * fp32.buffer.numel


def test_fp16_default_scale_backs_off_until_steps_succeed():
    """The default initial scale 2^32 overflows fp16 gradients: those steps are
    skipped (weights untouched) and the scale halves until steps succeed."""
    trainer = Trainer(_config(fp16=True, hysteresis=1, train_iters=40), ParallelContext.single(),
                      torch.device("cpu"))
    before = trainer.buffer.param_data.clone()
    records = [trainer.step(i)[0] for i in range(20)]
    skipped = [r["skipped"] for r in records]
    first_success = skipped.index(False)
    assert first_success > 0 and skipped[:first_success] == [True] * first_success
    scales = [r["loss_scale"] for r in records]
    assert scales[0] == 2.0 ** 32
    for k in range(19):  # hysteresis 1: every overflow halves, a success keeps the scale
        assert scales[k + 1] == (scales[k] / 2 if skipped[k] else scales[k])
    assert sum(not s for s in skipped) >= 4
    assert torch.isfinite(trainer.buffer.param_data.float()).all()
    assert not torch.equal(trainer.buffer.param_data, before)


@pytest.mark.parametrize("flags,tolerance", [({"bf16": True}, 0.02),
                                             ({"fp16": True, "initial_loss_scale": 4096.0}, 0.01)],
                         ids=["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_over_20_steps(flags, tolerance):
    """Same data, same seed: the 16-bit run's losses stay within `tolerance`
    (absolute, losses ~4) of fp32's for 20 steps (observed: 1.5e-3 for bf16,
    1.3e-4 for fp16), and both learn."""
    curves = []
    for extra in ({}, flags):
        trainer = Trainer(_config(train_iters=20, lr=3e-3, lr_warmup_iters=2, clip_grad=1.0,
                                  lr_decay_style="cosine", **extra),
                          ParallelContext.single(), torch.device("cpu"))
        records = [trainer.step(i)[0] for i in range(20)]
        assert not any(r["skipped"] for r in records)
        curves.append([r["loss"] for r in records])
    fp32, half = curves
    assert max(abs(a - b) for a, b in zip(fp32, half)) < tolerance
    assert half[-1] < half[0] - 0.3
