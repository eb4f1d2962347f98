"""Megatron-LM's numerics flags (issue 17): --calculate-per-token-loss,
--decoupled-lr / --decoupled-min-lr and --grad-reduce-in-bf16.

- Per-token loss, on --eod-mask-loss data whose microbatches count
  different numbers of tokens: one process's gradient equals a hand-computed
  Σ(per-token loss · mask) / Σ mask over the global batch (and differs from
  the default mean of microbatch means); the reported loss is that value;
  parallel layouts (1F1B and zbv at t = 1, p = 2, d = 2; interleaved at
  t = 2, p = 2 with sequence parallelism and full recomputation) train and
  validate like one process; fp16 loss scaling still skips an overflowing step and unscales.
- Decoupled rates: every iteration's rates equal Megatron-LM's
  OptimizerParamScheduler stepping a default group and a group with
  max_lr = --decoupled-lr, min_lr = --decoupled-min-lr (or --min-lr), bitwise
  (skipped without a Megatron-LM checkout; hand-computed rates always run);
  one AdamW step moves the word embedding and the output layer (tied or
  not) by the decoupled rate and the rest by --lr, as torch.optim.AdamW with
  those groups does; with the distributed optimizer and a pipeline split
  (above) the same as one process.
- bf16 reduction: at t = 2, d = 2 (all-reduce and reduce-scatter) the gradients
  equal the fp32-reduced ones within bf16's rounding and are not identical;
  at d = 1 the run is bitwise the fp32-reduced one.
- validate refuses the settings Megatron-LM would silently ignore.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ptdp.config import Config, ConfigError, DataConfig, ParallelConfig, TrainConfig, validate
from ptdp.data.loader import TrainingData
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.evaluate import evaluate
from ptdp.train.loop import Trainer
from ptdp.train.lr_schedule import LRSchedule
from ptdp.train.optimizer import embedding_and_output_weights
from tests.test_megatron_schedules import megatron  # noqa: F401 - the fixture
from tests.test_ptdp_step import MODEL, _logical_weights, computed_once

CPU = torch.device("cpu")
EOD = 7
SAMPLES = 64


def _documents(offset: int = 0) -> np.ndarray:
    """[SAMPLES, s + 1] tokens; sample k has an end-of-document token at a
    rate that cycles through 0, 0.2, 0.5 and 0.8, so --eod-mask-loss counts
    a different number of tokens in each microbatch."""
    generator = np.random.default_rng(5 + offset)
    tokens = generator.integers(8, MODEL.vocab_size, size=(SAMPLES, MODEL.seq_length + 1))
    rates = np.array([0.0, 0.2, 0.5, 0.8])[np.arange(SAMPLES) % 4]
    tokens[generator.random(tokens.shape) < rates[:, None]] = EOD
    return tokens


def _data() -> TrainingData:
    return TrainingData(train=_documents(), valid=_documents(1), eod=EOD, description="documents")


def _config(t=1, p=1, d=1, kind="1f1b", model=MODEL, **train) -> Config:
    base = dict(micro_batch_size=1, global_batch_size=8, train_iters=3, lr=1e-2, min_lr=1e-3,
                lr_warmup_iters=1, lr_decay_style="cosine", clip_grad=0.5, weight_decay=0.1,
                seed=17, ddp_bucket_size=2000, eval_iters=1)
    base.update(train)
    return Config(model=model,
                  parallel=ParallelConfig(tensor_model_parallel_size=t,
                                          pipeline_model_parallel_size=p, data_parallel_size=d,
                                          pipeline_schedule=kind),
                  train=TrainConfig(**base), data=DataConfig(mock_data=True, eod_mask_loss=True))


def _trainer(config: Config, ctx: ParallelContext | None = None) -> Trainer:
    return Trainer(config, ctx or ParallelContext.single(), CPU, data=_data())


def _gradients(trainer: Trainer, iteration: int = 0) -> torch.Tensor:
    """The reduced gradients of one iteration's forward and backward."""
    trainer.model.train()
    trainer.buffer.start_iteration(trainer.num_micro)
    trainer.executor.run(trainer.schedule, trainer.microbatch_fn(iteration),
                         per_token_loss=trainer.config.train.calculate_per_token_loss)
    trainer.buffer.finish()
    return trainer.buffer.reduced_grads.clone()


# ------------------------------------------------------------ --calculate-per-token-loss

def _hand_computed(trainer: Trainer) -> tuple[torch.Tensor, float, list[float]]:
    """Gradient and loss of Σ(per-token loss · mask) / Σ mask over the first
    global batch, from the model's logits and F.cross_entropy; and the
    token count of each sample."""
    tokens = torch.as_tensor(_documents()[:trainer.global_batch])
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = (inputs != EOD).float()
    trainer.buffer.start_iteration(1)
    logits = trainer.chunks[0](inputs)                               # [s, b, V']
    losses = F.cross_entropy(logits.transpose(0, 1).reshape(-1, logits.shape[-1]),
                             labels.reshape(-1), reduction="none")
    loss = (losses * mask.reshape(-1)).sum() / mask.sum()
    loss.backward()
    trainer.buffer.finish()
    return trainer.buffer.reduced_grads.clone(), loss.item(), mask.sum(1).tolist()


def test_per_token_loss_is_the_global_batchs_token_mean():
    per_token = _trainer(_config(calculate_per_token_loss=True))
    want, want_loss, counts = _hand_computed(_trainer(_config()))
    assert len(set(counts)) > 2  # microbatches (b = 1) count different tokens
    got = _gradients(per_token)
    assert_close(got, want, rtol=1e-5, atol=1e-7)
    default = _gradients(_trainer(_config()))
    assert (default - want).abs().max() > 100 * (got - want).abs().max() + 1e-4
    # The reported loss is the same token mean (training's record, the same batch).
    record, _ = _trainer(_config(calculate_per_token_loss=True)).step(0)
    assert record["loss"] == pytest.approx(want_loss, rel=1e-6)


def test_per_token_validation_loss():
    trainer = _trainer(_config(calculate_per_token_loss=True))
    got = evaluate(trainer, trainer.data.valid, 1)["loss"]
    tokens = torch.as_tensor(_documents(1)[:8])
    mask = (tokens[:, :-1] != EOD).float()
    with torch.no_grad():
        logits = trainer.chunks[0](tokens[:, :-1])
        losses = F.cross_entropy(logits.transpose(0, 1).reshape(-1, logits.shape[-1]),
                                 tokens[:, 1:].reshape(-1), reduction="none")
    assert got == pytest.approx(((losses * mask.reshape(-1)).sum() / mask.sum()).item(), rel=1e-6)
    default = _trainer(_config())
    assert evaluate(default, default.data.valid, 1)["loss"] != pytest.approx(got, rel=1e-4)


def test_fp16_loss_scaling_with_per_token_loss():
    """An overflowing scale skips the step (weights unchanged) and halves; a
    static scale is taken off again: the gradient norm is fp32's."""
    overflowing = _trainer(_config(calculate_per_token_loss=True, fp16=True,
                                   initial_loss_scale=2.0 ** 40, hysteresis=1))
    before = overflowing.buffer.param_data.clone()
    record, _ = overflowing.step(0)
    assert record["skipped"] and overflowing.optimizer.scaler.scale == 2.0 ** 39
    assert torch.equal(overflowing.buffer.param_data, before)
    scaled, _ = _trainer(_config(calculate_per_token_loss=True, fp16=True,
                                 loss_scale=1024.0)).step(0)
    fp32, _ = _trainer(_config(calculate_per_token_loss=True)).step(0)
    assert not scaled["skipped"]
    assert scaled["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=2e-2)


PARALLEL_CASES = {  # name: the layout's settings
    "1f1b-t1p2d2-distributed-untied": dict(t=1, d=2, distributed=True, untied=True),
    "zbv-t1p2d2-tied": dict(t=1, d=2, kind="zbv"),
    "interleaved-t2p2d1-sequence-parallel-recompute": dict(t=2, d=1, k=1, sequence_parallel=True,
                                                           recompute=True),
}


def _parallel_vs_serial(rank, t, d, kind="1f1b", k=None, distributed=False, untied=False,
                        sequence_parallel=False, recompute=False):
    model = dataclasses.replace(MODEL, untie_embeddings_and_output_weights=untied,
                                recompute_granularity="full" if recompute else None)
    # adam_eps 1e-4: Adam divides a gradient by its own magnitude, so the
    # rounding noise of near-zero gradients (which the layouts sum in other
    # orders) would move weights by up to lr per step; with this eps such
    # noise moves them by ~nothing and the weights agree to 1e-6.
    flags = dict(calculate_per_token_loss=True, decoupled_lr=3e-2, decoupled_min_lr=2e-3,
                 use_distributed_optimizer=distributed, adam_eps=1e-4)
    config = _config(t, 2, d, kind, model, **flags)
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, num_layers_per_virtual_pipeline_stage=k,
        sequence_parallel=sequence_parallel))
    validate(config, world_size=4)
    ctx = ParallelContext.build(RankGrid(tp=t, dp=d, pp=2))
    trainer = _trainer(config, ctx)
    records = [trainer.step(i)[0] for i in range(3)]

    def serial_run():
        serial = _trainer(_config(model=model, **flags))
        serial_records = [serial.step(i)[0] for i in range(3)]
        return (serial_records, _logical_weights(serial, ParallelContext.single()),
                evaluate(serial, serial.data.valid, 1)["loss"])
    serial_records, reference, serial_validation = computed_once(serial_run)
    for got, want in zip(records, serial_records):
        assert not got["skipped"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        if trainer.holds_loss:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    for name, weight in _logical_weights(trainer, ctx).items():
        assert_close(weight, reference[name], rtol=0.0, atol=1e-6,
                     msg=lambda msg, name=name: f"{name}: {msg}")
    validation = evaluate(trainer, trainer.data.valid, 1)["loss"]
    if trainer.holds_loss:
        assert validation == pytest.approx(serial_validation, rel=1e-5)
    return trainer.holds_loss


@pytest.mark.parametrize("layout", PARALLEL_CASES.values(), ids=PARALLEL_CASES)
def test_parallel_layouts_train_like_one_process(pools, layout):
    """p = 2 under --calculate-per-token-loss and --decoupled-lr: the
    embedding and the output layer live on different stages (1F1B,
    interleaved) or on rank 0's two chunks (zbv); the token count is summed
    over the data-parallel replicas."""
    holders = pools(4).run(_parallel_vs_serial, **layout)
    assert sum(holders) == 4 // 2  # the last stage's t·d ranks


# ------------------------------------------------------------ --decoupled-lr

RATE_CASES = [
    dict(lr_decay_style="cosine", lr_warmup_iters=3, decoupled_lr=5e-2, decoupled_min_lr=1e-3),
    dict(lr_decay_style="linear", decoupled_lr=5e-2),                      # final rate: --min-lr
    dict(lr_decay_style="inverse-square-root", lr_warmup_iters=2, decoupled_lr=5e-2,
         decoupled_min_lr=4e-2),                                            # the floor binds
    dict(lr_decay_style="WSD", lr_wsd_decay_iters=8, lr_wsd_decay_style="minus_sqrt",
         lr_warmup_iters=2, decoupled_lr=1e-4, decoupled_min_lr=0.0),       # below --lr
    dict(lr_decay_style="constant", lr_warmup_iters=4, decoupled_lr=2e-2),
]


def _rates(tr: TrainConfig, B: int) -> list[tuple[float, float]]:
    """(main, decoupled) rate of every iteration, as a Trainer steps them."""
    main, decoupled = LRSchedule.from_config(tr, B), LRSchedule.decoupled_from_config(tr, B)
    return [(main.lr_after(i, i * B), decoupled.lr_after(i, i * B))
            for i in range(1, tr.train_iters + 1)]


@pytest.mark.parametrize("settings", RATE_CASES, ids=[s["lr_decay_style"] for s in RATE_CASES])
def test_decoupled_rates_equal_megatron(megatron, settings):  # noqa: F811 - the fixture
    tr = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=24, lr=1e-2,
                     min_lr=1e-3, **settings)
    validate(Config(train=tr))
    B = 8
    decay = (tr.lr_decay_iters or tr.train_iters) * B
    wsd = None if tr.lr_wsd_decay_iters is None else tr.lr_wsd_decay_iters * B
    # As _get_param_groups builds them: every group gets max_lr = --lr and
    # min_lr = --min-lr, which the decoupled override replaces (min_lr only
    # when --decoupled-min-lr is given).
    default = {"max_lr": tr.lr, "min_lr": tr.min_lr}
    override = {"max_lr": tr.decoupled_lr}
    if tr.decoupled_min_lr is not None:
        override["min_lr"] = tr.decoupled_min_lr
    optimizer = types.SimpleNamespace(param_groups=[dict(default), {**default, **override}])
    scheduler = megatron.scheduler.OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=tr.lr, min_lr=tr.min_lr,
        lr_warmup_steps=tr.lr_warmup_iters * B, lr_decay_steps=decay,
        lr_decay_style=tr.lr_decay_style, start_wd=0.0, end_wd=0.0, wd_incr_steps=decay,
        wd_incr_style="constant", wsd_decay_steps=wsd, lr_wsd_decay_style=tr.lr_wsd_decay_style)
    want = []
    for _ in range(tr.train_iters):
        scheduler.step(increment=B)
        want.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"]))
    assert _rates(tr, B) == want  # bitwise


def test_decoupled_rates_by_hand():
    """Warm-up over 2 iterations, linear decay to iteration 10: the decoupled
    group goes 0.5, 1.0, then down to --decoupled-min-lr 0.2 (--lr's 0.1 to 0)."""
    tr = TrainConfig(micro_batch_size=1, global_batch_size=1, train_iters=12, lr=0.1, min_lr=0.0,
                     lr_warmup_iters=2, lr_decay_iters=10, lr_decay_style="linear",
                     decoupled_lr=1.0, decoupled_min_lr=0.2)
    rates = _rates(tr, 1)
    assert [d for _, d in rates[:2]] == [0.5, 1.0]
    assert rates[5][1] == pytest.approx(0.2 + 0.8 * 0.5)  # iteration 6: halfway through the decay
    assert rates[5][0] == pytest.approx(0.05)
    assert [d for _, d in rates[10:]] == [0.2, 0.2]


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_one_adamw_step_uses_each_groups_rate(untied):
    """After one step each parameter moved as torch.optim.AdamW moves it with
    the embedding and output layer in a group at --decoupled-lr."""
    model = dataclasses.replace(MODEL, untie_embeddings_and_output_weights=untied)
    config = _config(model=model, decoupled_lr=0.5, lr_warmup_iters=0, lr_decay_style="constant",
                     clip_grad=0.0)
    trainer, reference = _trainer(config), _trainer(config)
    special = embedding_and_output_weights(reference.chunks)
    names = {param: name for name, param in reference.model.named_parameters()}
    assert sorted(names[p] for p in special) == (
        ["0.embedding.word_embeddings.weight", "0.output_layer.weight"] if untied
        else ["0.embedding.word_embeddings.weight"])
    params = list(reference.model.parameters())
    others = [p for p in params if p not in special]
    torch_adamw = torch.optim.AdamW(
        [{"params": list(special), "lr": 0.5, "weight_decay": 0.1},
         {"params": [p for p in others if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0}], lr=1e-2)
    record, _ = trainer.step(0)
    assert record["lr"] == 1e-2  # the log's rate stays --lr's
    _gradients(reference)
    torch_adamw.step()
    for (name, ours), theirs in zip(trainer.model.named_parameters(), params):
        assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    # And the rates differ enough to tell: the embedding moved ~lr per element.
    initial = _trainer(config).model.state_dict()
    moved = (trainer.chunks[0].embedding.word_embeddings.weight
             - initial["0.embedding.word_embeddings.weight"]).abs().max()
    assert moved > 0.1


# ------------------------------------------------------------ --grad-reduce-in-bf16

def _bf16_reduction(rank, distributed):
    """t = 2, d = 2 (the four processes the other tests use)."""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=2, pp=1))
    grads = {}
    for in_bf16 in (False, True):
        config = _config(t=2, d=2, bf16=True, grad_reduce_in_bf16=in_bf16,
                         use_distributed_optimizer=distributed)
        grads[in_bf16] = _gradients(_trainer(config, ctx))
    scale = grads[False].abs().max()
    assert_close(grads[True], grads[False], rtol=2 ** -7, atol=2 ** -8 * scale)
    assert not torch.equal(grads[True], grads[False])


@pytest.mark.parametrize("distributed", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_bf16_reduction_is_close_at_two_replicas(pools, distributed):
    pools(4).run(_bf16_reduction, distributed)


def test_bf16_reduction_is_exact_at_one_replica():
    records, weights = [], []
    for in_bf16 in (False, True):
        trainer = _trainer(_config(bf16=True, grad_reduce_in_bf16=in_bf16, train_iters=2))
        records.append([trainer.step(i)[0]["loss"] for i in range(2)])
        weights.append(trainer.buffer.param_data.clone())
    assert records[0] == records[1] and torch.equal(weights[0], weights[1])


# ------------------------------------------------------------ validation

@pytest.mark.parametrize("train,expected", [
    (dict(decoupled_lr=-1.0), "--decoupled-lr=-1.0 must be >= 0"),
    (dict(decoupled_lr=1e-3, decoupled_min_lr=-1e-4), "--decoupled-min-lr=-0.0001 must be >= 0"),
    (dict(decoupled_min_lr=1e-4), "--decoupled-min-lr 0.0001 needs --decoupled-lr"),
    (dict(decoupled_lr=1e-3, decoupled_min_lr=2e-3), "--decoupled-min-lr 0.002 is above "
                                                     "--decoupled-lr 0.001"),
    (dict(decoupled_lr=1e-4, min_lr=1e-3), "--min-lr 0.001 is above --decoupled-lr 0.0001"),
    (dict(grad_reduce_in_bf16=True), "--grad-reduce-in-bf16 reduces the gradients of a --bf16 run"),
    (dict(grad_reduce_in_bf16=True, fp16=True), "this run is --fp16: add --bf16"),
])
def test_validate_names_the_problem(train, expected):
    base = dict(lr=1e-2, min_lr=0.0)
    base.update(train)
    with pytest.raises(ConfigError) as error:
        validate(Config(train=TrainConfig(**base)))
    assert expected in str(error.value)


def test_validate_accepts_the_flags():
    validate(Config(train=TrainConfig(lr=1e-2, min_lr=1e-3, decoupled_lr=1e-3, bf16=True,
                                      grad_reduce_in_bf16=True, calculate_per_token_loss=True)))
    validate(Config(train=TrainConfig(lr=1e-2, decoupled_lr=0.0, decoupled_min_lr=0.0)))
