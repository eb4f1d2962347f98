"""Megatron-LM's run length, learning-rate schedules and batch-size ramp-up
(issue 17): --train-samples, --lr-warmup-samples, --lr-warmup-fraction,
--lr-decay-samples, --lr-decay-style inverse-square-root and WSD (with
--lr-wsd-decay-style/-iters/-samples), --rampup-batch-size and
--recompute-activations.

- Against Megatron-LM's own classes: the learning rate of every iteration
  equals its OptimizerParamScheduler's, driven as its training loop drives it
  (stepped by each iteration's global batch in samples), bitwise, for every
  style and way of giving the lengths; every iteration's global batch and the
  run's length equal its ramp-up calculator's (RampupBatchsizeNumMicroBatches-
  Calculator, from the last Megatron-LM commit that has it). Both are read from
  a Megatron-LM git checkout named by $PTDP_MEGATRON_REPO
  with `git show` and imported with a one-function stand-in for
  megatron.core.utils; without a checkout those tests are skipped and
  hand-computed values check each style.
- validate refuses each mix Megatron-LM refuses, and each ramp it cannot run,
  naming the flag and the fix, before launch.
- Training on a ramp (microbatches per iteration 2, 2, 4, 6, 6): a parallel
  run (t = 1, p = 2, d = 2; 1F1B and zb-h1) equals one process on the same
  ramp; a run stopped mid-ramp and resumed equals an uninterrupted one,
  bitwise on the same layout (dropout on) and to rounding under another.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from ptdp.config import (Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig,
                         validate)
from ptdp.data.batches import ConsumedSamples, GlobalBatches
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.checkpoint.store import read_metadata, resolve
from tests.test_checkpoint import stop_save_resume
from ptdp.train.loop import Trainer
from ptdp.train.lr_schedule import LRSchedule

MEGATRON_REPO = os.environ.get("PTDP_MEGATRON_REPO", "")
# The last commit with RampupBatchsizeNumMicroBatchesCalculator (532ad926b4's
# parent; Megatron-LM then replaced --rampup-batch-size by step schedules).
RAMPUP_COMMIT = "0b9bc2088b6d6c858275d02638064cc7e0bf8b70"
CPU = torch.device("cpu")


# ------------------------------------------------------------ Megatron-LM's classes

def _git_show(spec: str) -> str | None:
    if not MEGATRON_REPO:  # (`git -C ''` would read this checkout)
        return None
    try:
        return subprocess.run(["git", "-C", MEGATRON_REPO, "show", spec], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _import_source(name: str, source: str, directory) -> types.ModuleType:
    path = directory / f"{name.rsplit('.', 1)[-1]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """Megatron-LM's OptimizerParamScheduler (HEAD) and its batch-size
    calculators (RAMPUP_COMMIT), imported from a checkout."""
    scheduler = _git_show("HEAD:megatron/core/optimizer_param_scheduler.py")
    calculators = _git_show(f"{RAMPUP_COMMIT}:megatron/core/num_microbatches_calculator.py")
    if scheduler is None or calculators is None:
        pytest.skip(f"no Megatron-LM git checkout at {MEGATRON_REPO!r} (set PTDP_MEGATRON_REPO)")
    # Its only import beyond torch: a logging helper (stood in for, so that
    # megatron.core's heavy dependencies are not needed).
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *args, **kwargs: None
    stand_ins = {"megatron": types.ModuleType("megatron"),
                 "megatron.core": types.ModuleType("megatron.core"), "megatron.core.utils": utils}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    directory = tmp_path_factory.mktemp("megatron")
    try:
        return types.SimpleNamespace(
            scheduler=_import_source("megatron.core.optimizer_param_scheduler", scheduler, directory),
            calculators=_import_source("megatron.core.num_microbatches_calculator", calculators,
                                       directory))
    except Exception as error:  # noqa: BLE001 - a newer Megatron-LM that needs more
        pytest.skip(f"Megatron-LM's classes do not import on their own any more: {error!r}")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def megatron_run(megatron, tr: TrainConfig, d: int) -> list[tuple[int, float]]:
    """(global batch, learning rate) of every iteration as Megatron-LM's
    training has them: the run's length from training.py's update_train_iters,
    the scheduler's lengths from its get_optimizer_param_scheduler, and each
    iteration's batch from the calculator updated with the consumed samples,
    the scheduler stepped by that batch after the step (the rate it logs)."""
    b = tr.micro_batch_size
    B = tr.global_batch_size or b * d
    calculators = megatron.calculators

    def calculator():
        if tr.rampup_batch_size is None:
            return calculators.ConstantNumMicroBatchesCalculator(B, b, d, False, 1)
        start, increment, samples = tr.rampup_batch_size
        return calculators.RampupBatchsizeNumMicroBatchesCalculator(B, b, d, False, 1, start,
                                                                    increment, samples)

    if tr.train_samples is None:
        iterations = tr.train_iters
        decay = (tr.lr_decay_iters or tr.train_iters) * B
        wsd = None if tr.lr_wsd_decay_iters is None else tr.lr_wsd_decay_iters * B
        warmup = tr.lr_warmup_iters * B
    else:
        if tr.rampup_batch_size is None:
            iterations = tr.train_samples // B
        else:
            counter, iterations, consumed = calculator(), 0, 0
            while consumed <= tr.rampup_batch_size[2] and consumed <= tr.train_samples:
                counter.update(consumed, consistency_check=False)
                consumed += counter.get_current_global_batch_size()
                iterations += 1
            if tr.train_samples > consumed:
                iterations += (tr.train_samples - consumed) // B
        decay = tr.lr_decay_samples or tr.train_samples
        wsd = tr.lr_wsd_decay_samples
        warmup = tr.lr_warmup_samples
    if tr.lr_warmup_fraction is not None:
        warmup = tr.lr_warmup_fraction * decay
    optimizer = types.SimpleNamespace(param_groups=[{}])
    scheduler = megatron.scheduler.OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=tr.lr, min_lr=tr.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=tr.lr_decay_style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=decay, wd_incr_style="constant", wsd_decay_steps=wsd,
        lr_wsd_decay_style=tr.lr_wsd_decay_style)
    counter, consumed, run = calculator(), 0, []
    for _ in range(iterations):
        counter.update(consumed, consistency_check=True)
        batch = counter.get() * b * d
        scheduler.step(increment=batch)
        run.append((batch, optimizer.param_groups[0]["lr"]))
        consumed += batch
    return run


def ptdp_run(tr: TrainConfig, d: int) -> list[tuple[int, float]]:
    """(global batch, learning rate) of every iteration as a Trainer has them
    (Trainer.batch_of and Trainer.learning_rate, without the model)."""
    batches = GlobalBatches(tr, d)
    consumed = ConsumedSamples(batches, 0, 0)
    schedule = LRSchedule.from_config(tr, batches.final)
    return [(batches.size_at(consumed.before(i)),
             schedule.lr_after(i + 1, consumed.before(i + 1)))
            for i in range(batches.train_iters)]


BASE = dict(micro_batch_size=2, lr=3e-3, min_lr=3e-5)
ITERATIONS = dict(BASE, global_batch_size=16, train_iters=40)
SAMPLES = dict(BASE, global_batch_size=32, train_iters=None, train_samples=1000)
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
SCHEDULES = [  # (TrainConfig settings, data-parallel size)
    *[(dict(ITERATIONS, lr_decay_style=style, lr_warmup_iters=warmup), 1)
      for style in ("constant", "linear", "cosine", "inverse-square-root") for warmup in (0, 3)],
    (dict(ITERATIONS, lr_decay_style="cosine", lr_decay_iters=30, lr_warmup_fraction=0.15), 2),
    (dict(ITERATIONS, lr_decay_style="inverse-square-root", lr_warmup_fraction=0.1), 2),
    (dict(ITERATIONS, global_batch_size=None, lr_decay_style="linear", lr_warmup_iters=5), 4),
    *[(dict(ITERATIONS, lr_decay_style="WSD", lr_wsd_decay_style=style, lr_wsd_decay_iters=12,
            lr_warmup_iters=4, lr_decay_iters=36), 1) for style in WSD_STYLES],
    *[(dict(SAMPLES, lr_decay_style=style, lr_warmup_samples=warmup), 1)
      for style in ("constant", "linear", "cosine", "inverse-square-root") for warmup in (0, 100)],
    (dict(SAMPLES, lr_decay_style="cosine", lr_decay_samples=800, lr_warmup_fraction=0.25), 2),
    (dict(SAMPLES, lr_decay_style="inverse-square-root", min_lr=2e-3), 1),  # the floor binds
    *[(dict(SAMPLES, lr_decay_style="WSD", lr_wsd_decay_style=style, lr_wsd_decay_samples=300,
            lr_warmup_samples=64), 1) for style in WSD_STYLES],
    # Ramp-ups: whole increments (100 samples each) and fractional ones (62.5).
    (dict(SAMPLES, rampup_batch_size=[8, 8, 300], lr_decay_style="cosine",
          lr_warmup_samples=50), 1),
    (dict(SAMPLES, rampup_batch_size=[16, 4, 250], lr_decay_style="linear",
          lr_warmup_fraction=0.05), 2),
    (dict(SAMPLES, rampup_batch_size=[8, 8, 300], lr_decay_style="WSD", lr_wsd_decay_samples=400,
          lr_wsd_decay_style="minus_sqrt"), 2),
    (dict(SAMPLES, rampup_batch_size=[4, 4, 999], lr_decay_style="inverse-square-root",
          lr_warmup_samples=40), 2),
    (dict(SAMPLES, train_samples=200, rampup_batch_size=[8, 8, 600]), 1),  # ends mid-ramp
]


def _ids(cases):
    return [f"{'samples' if s.get('train_samples') else 'iters'}-{s.get('lr_decay_style', 'linear')}"
            f"-{s.get('lr_wsd_decay_style', '')}-{'ramp' if s.get('rampup_batch_size') else ''}-{i}"
            for i, (s, _) in enumerate(cases)]


@pytest.mark.parametrize("settings,d", SCHEDULES, ids=_ids(SCHEDULES))
def test_every_iteration_equals_megatron(megatron, settings, d):
    tr = TrainConfig(**settings)
    validate(Config(parallel=ParallelConfig(data_parallel_size=d), train=tr))
    want = megatron_run(megatron, tr, d)
    got = ptdp_run(tr, d)
    assert len(got) == len(want) > 5
    assert got == want  # bitwise: the same floating-point operations in the same order


def test_hand_computed_rates():
    """Each style at points worked out by hand (these run without Megatron-LM)."""
    def rates(iterations, d=1, **settings):
        run = ptdp_run(TrainConfig(micro_batch_size=1, **settings), d)
        return [run[i - 1][1] for i in iterations]

    # inverse-square-root: warm-up over 4 iterations of B = 2, then lr·sqrt(8 / steps).
    assert rates([1, 4, 16], lr=1.0, min_lr=0.0, global_batch_size=2, train_iters=20,
                 lr_warmup_iters=4, lr_decay_style="inverse-square-root") == pytest.approx(
        [0.25, 1.0, 0.5])
    # WSD over 10 iterations, the last 4 annealing: stable to 6, then each shape.
    shapes = {"linear": 0.5, "cosine": 0.5, "exponential": 2 * 0.5 ** 0.5 - 1,
              "minus_sqrt": 1 - 0.5 ** 0.5}
    for shape, middle in shapes.items():
        got = rates([6, 7, 8, 10], lr=1.0, min_lr=0.0, global_batch_size=1, train_iters=10,
                    lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_style=shape)
        assert got[0] == 1.0 and got[2] == pytest.approx(middle) and got[3] == pytest.approx(0.0)
    # --lr-warmup-fraction 0.1 of 100 samples: 10 samples, so 5 per iteration reach lr at 2.
    assert rates([1, 2], lr=1.0, global_batch_size=5, train_iters=None, train_samples=100,
                 lr_warmup_fraction=0.1) == [0.5, 1.0]


def test_ramp_sizes_and_length():
    """--rampup-batch-size 8 8 300 to B = 32 over --train-samples 1000: 100
    samples per increment; the ramp's 24 iterations end at 320 samples, then
    21 whole batches of 32."""
    tr = TrainConfig(micro_batch_size=2, global_batch_size=32, train_iters=None, train_samples=1000,
                     rampup_batch_size=[8, 8, 300])
    batches = GlobalBatches(tr, 2)
    assert [batches.size_at(c) for c in (0, 99, 100, 199, 200, 300, 301)] == [8, 8, 16, 16, 24, 32, 32]
    assert batches.microbatches_at(100) == 4
    sizes = [size for size, _ in ptdp_run(tr, 2)]
    assert sizes == [8] * 13 + [16] * 6 + [24] * 5 + [32] * 21
    assert batches.train_iters == 45 and batches.consumed_after(0, 45) == 992
    # A run resumed after 20 iterations (224 samples) continues on the ramp.
    resumed = ConsumedSamples(batches, 20, sum(sizes[:20]))
    assert [resumed.before(i + 1) - resumed.before(i) for i in range(20, 45)] == sizes[20:]


def test_a_ramp_in_an_iteration_based_run():
    """Megatron-LM refuses --rampup-batch-size with --train-iters (its old
    175B example has both); ptdp runs the same ramp for --train-iters
    iterations, and the configuration validates."""
    tr = TrainConfig(micro_batch_size=2, global_batch_size=32, train_iters=30,
                     rampup_batch_size=[8, 8, 300])
    validate(Config(train=tr, parallel=ParallelConfig(data_parallel_size=2)))
    assert GlobalBatches(tr, 2).train_iters == 30
    sizes = [size for size, _ in ptdp_run(tr, 2)]
    assert sizes == [8] * 13 + [16] * 6 + [24] * 5 + [32] * 6


def test_iteration_based_rates_keep_their_values():
    """Without the new flags, the rates are the formulas ptdp had (to rounding)."""
    tr = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=6, train_iters=8,
                     lr_decay_style="cosine", micro_batch_size=1, global_batch_size=8)
    got = [lr for _, lr in ptdp_run(tr, 1)]
    want = [0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55,
            0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.1, 0.1, 0.1]
    assert got == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------ refused before launch

def _train(**settings) -> Config:
    return Config(train=TrainConfig(**settings))


def _samples(**settings) -> Config:
    return _train(**{"train_samples": 1000, "global_batch_size": 32, **settings})


def _layout(t=1, p=1, d=1, schedule="1f1b", k=None, **settings) -> Config:
    return Config(model=ModelConfig(num_layers=4),
                  parallel=ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                          data_parallel_size=d, pipeline_schedule=schedule,
                                          num_layers_per_virtual_pipeline_stage=k),
                  train=TrainConfig(**{"train_samples": 1000, "global_batch_size": 32,
                                       "micro_batch_size": 2, **settings}))


REFUSED = [
    (_train(train_iters=10, train_samples=100),
     "--train-iters and --train-samples both set the run's length: give one"),
    (_train(lr_decay_samples=100), "--lr-decay-samples counts samples, but the run's length is "
                                   "given in iterations (--train-iters): use --lr-decay-iters"),
    (_train(lr_warmup_samples=10), "use --lr-warmup-iters, or give the length as --train-samples"),
    (_train(lr_decay_style="WSD", lr_wsd_decay_iters=5, lr_wsd_decay_samples=5),
     "--lr-wsd-decay-samples counts samples"),
    (_samples(lr_decay_iters=10), "--lr-decay-iters counts iterations, but the run's length is "
                                  "given in samples (--train-samples): use --lr-decay-samples"),
    (_samples(lr_warmup_iters=3), "use --lr-warmup-samples, or give the length as --train-iters"),
    (_train(lr_warmup_fraction=0.1, lr_warmup_iters=2),
     "--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: give one"),
    (_samples(lr_warmup_fraction=0.1, lr_warmup_samples=20),
     "--lr-warmup-fraction and --lr-warmup-samples both set the warm-up: give one"),
    (_train(lr_warmup_fraction=1.0), "--lr-warmup-fraction=1.0 must be in [0, 1)"),
    (_samples(lr_warmup_samples=1000), "--lr-warmup-samples 1000 must be less than the decay "
                                       "length, 1000"),
    (_samples(lr_decay_samples=0), "--lr-decay-samples=0 must be an integer >= 1"),
    (_train(lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-iters N"),
    (_samples(lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-samples N"),
    (_train(lr_wsd_decay_iters=5), "--lr-wsd-decay-iters only applies to --lr-decay-style WSD"),
    (_train(lr_decay_style="WSD", lr_wsd_decay_iters=30, train_iters=20),
     "--lr-wsd-decay-iters 30 exceeds the decay length 20"),
    (_samples(lr_decay_style="WSD", lr_wsd_decay_samples=-1),
     "--lr-wsd-decay-samples=-1 must be an integer >= 0"),
    (_samples(train_samples=20), "--train-samples 20 is less than one global batch "
                                 "(--global-batch-size 32)"),
    (_samples(rampup_batch_size=[8, 0, 300]), "--rampup-batch-size 8 0 300 must be three positive "
                                              "integers"),
    (_samples(rampup_batch_size=[8, 8]), "must be three positive integers"),
    (_samples(rampup_batch_size=[32, 8, 300]), "there is nothing to ramp"),
    (_samples(micro_batch_size=1, rampup_batch_size=[8, 7, 300]), "(32 - 8 = 24 is not a multiple of 7): use "
                                              "INCREMENT in [1, 2, 3, 4, 6, 8]"),
    (_layout(d=2, rampup_batch_size=[8, 6, 300]), "--rampup-batch-size INCREMENT 6 is not divisible "
                                                  "by --micro-batch-size 2 × data-parallel size 2 = "
                                                  "4 (every global batch of the ramp must be whole "
                                                  "microbatches on every data-parallel rank): use 8"),
    (_layout(p=2, d=2, schedule="zb-h1", rampup_batch_size=[4, 4, 300]),
     "--pipeline-schedule zb-h1 needs at least 2 microbatches per iteration (p with "
     "--pipeline-model-parallel-size 2), but --rampup-batch-size starts at 4 / "
     "(--micro-batch-size 2 × d 2) = 1: use START 8 or more"),
    (_layout(p=2, schedule="zbv", rampup_batch_size=[4, 4, 300]), "use START 8 or more"),
    (_layout(p=2, k=1, rampup_batch_size=[8, 2, 300]),
     "the interleaved schedule needs every iteration's microbatches to be a multiple of "
     "--pipeline-model-parallel-size 2"),
    (Config(model=ModelConfig(recompute_activations=True, recompute_granularity="full")),
     "--recompute-activations is Megatron-LM's alias of --recompute-granularity selective, so it "
     "contradicts --recompute-granularity full"),
]


@pytest.mark.parametrize("config,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_bad_mixes_are_refused_with_the_fix(config, message):
    with pytest.raises(ConfigError) as caught:
        validate(config)
    assert len(caught.value.problems) == 1, caught.value.problems
    assert message in caught.value.problems[0]


def test_valid_settings_pass():
    validate(_samples(lr_decay_style="WSD", lr_wsd_decay_samples=300, lr_warmup_fraction=0.1))
    validate(_layout(p=2, d=2, schedule="zb-h1", rampup_batch_size=[8, 8, 300]))
    validate(_layout(p=2, k=1, rampup_batch_size=[8, 8, 300]))
    validate(_train(lr_decay_style="inverse-square-root", lr_warmup_iters=3))
    config = Config(model=ModelConfig(recompute_activations=True))
    validate(config)
    assert config.model.recompute_granularity == "selective"
    assert TrainConfig().train_iters == 20 and TrainConfig(train_samples=64).train_iters is None


def test_flags_reach_the_config_and_bad_ones_stop_before_launch(no_launch, capsys):
    from ptdp.cli import build_parser, main
    from ptdp.commands.train import config_from_args

    config = config_from_args(build_parser().parse_args([
        "train", "--train-samples", "1000", "--global-batch-size", "32", "--rampup-batch-size", "8",
        "8", "300", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "100",
        "--lr-wsd-decay-style", "cosine", "--lr-warmup-fraction", "0.01", "--recompute-activations"]))
    tr = config.train
    assert (tr.train_samples, tr.train_iters, tr.rampup_batch_size) == (1000, None, [8, 8, 300])
    assert (tr.lr_decay_style, tr.lr_wsd_decay_samples, tr.lr_wsd_decay_style) == ("WSD", 100, "cosine")
    assert config.model.recompute_granularity == "selective"
    validate(config)
    assert main(["train", "--mock-data", "--train-samples", "100", "--train-iters", "5"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_config_file_ramp(tmp_path):
    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_args

    path = tmp_path / "run.yaml"
    for text in ("rampup-batch-size: [8, 8, 300]\n", "rampup-batch-size: 8 8 300\n"):
        path.write_text("train-samples: 1000\nglobal-batch-size: 32\n" + text)
        config = config_from_args(build_parser().parse_args(["train", "--config", str(path)]))
        assert config.train.rampup_batch_size == [8, 8, 300]


# ------------------------------------------------------------ training on a ramp

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
# B = 12 over b = 1: from 4 sequences, +4 every 8 samples up to 16 samples:
# batches 4, 4, 8, 12, 12 (m = 2, 2, 4, 6, 6 at d = 2); 5 iterations for 48 samples.
RAMP = TrainConfig(micro_batch_size=1, global_batch_size=12, train_iters=None, train_samples=48,
                   rampup_batch_size=[4, 4, 16], lr=1e-2, min_lr=1e-3, lr_warmup_samples=8,
                   lr_decay_style="WSD", lr_wsd_decay_samples=20, lr_wsd_decay_style="cosine",
                   clip_grad=0.5, weight_decay=0.1, seed=23, ddp_bucket_size=1500)
BATCHES = [4, 4, 8, 12, 12]


def ramp_config(t=1, p=1, d=1, schedule="1f1b", model=MODEL, **train) -> Config:
    return Config(model=model,
                  parallel=ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                                          data_parallel_size=d, pipeline_schedule=schedule),
                  train=dataclasses.replace(RAMP, **train), data=DataConfig(mock_data=True))


def _ramp_vs_one_process(rank, schedule):
    from tests.test_zero_bubble import trains_like_one_process

    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=2))
    config = ramp_config(1, 2, 2, schedule)
    validate(config, world_size=4)
    trainer = Trainer(config, ctx, CPU)
    assert trainer.train_iters == len(BATCHES)
    records = trains_like_one_process(trainer, ctx, ramp_config(), iterations=len(BATCHES))
    schedules = sorted({m: trainer.schedule_for(m).m for m in (2, 4, 6)}.items())
    return ([r["global_batch_size"] for r in records], [r["consumed_samples"] for r in records],
            [r["lr"] for r in records], schedules)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_ramped_parallel_run_equals_one_process(pools, schedule):
    want_lrs = [lr for _, lr in ptdp_run(RAMP, 1)]
    for batches, consumed, lrs, schedules in pools(4).run(_ramp_vs_one_process, schedule):
        assert batches == BATCHES
        assert consumed == [4, 8, 16, 28, 40]
        assert lrs == want_lrs
        assert schedules == [(2, 2), (4, 4), (6, 6)]


def _resume_mid_ramp(rank, save):
    """5 iterations straight vs 2 (mid-ramp, 8 samples), save, a new trainer
    loads and runs the other 3: bitwise the same (dropout on)."""
    ctx = ParallelContext.build(RankGrid(tp=1, dp=2, pp=2))
    model = dataclasses.replace(MODEL, hidden_dropout=0.1, attention_dropout=0.1)
    config = ramp_config(1, 2, 2, model=model)
    got, expected, same_weights, metadata = stop_save_resume(config, ctx, save, 2, 5)
    keys = ("loss", "lr", "consumed_samples", "global_batch_size", "grad_norm")
    return ([[r[k] for k in keys] for r in got], [[r[k] for k in keys] for r in expected],
            same_weights, metadata["consumed_samples"])


def test_resume_mid_ramp_is_bitwise_exact(pools, tmp_path):
    for got, expected, same_weights, consumed in pools(4).run(_resume_mid_ramp, str(tmp_path)):
        assert consumed == 8
        assert got == expected  # bitwise (the loss is None off the last stage)
        assert same_weights


def test_resume_mid_ramp_under_another_layout(pools, tmp_path):
    """t = 1, p = 2, d = 2 for 2 iterations (4 + 4 samples), then t = 2, p = 1,
    d = 2 resumes for 2 more (8 + 12): the losses of one process straight."""
    from tests.test_zero_bubble import train_leg

    legs = [(1, 2, 2, ramp_config(1, 2, 2)), (2, 1, 2, ramp_config(2, 1, 2))]
    serial = Trainer(ramp_config(), ParallelContext.single(), CPU)
    expected = [serial.step(i)[0]["loss"] for i in range(4)]
    got = []
    for leg, (t, p, d, _) in enumerate(legs):
        got += next(r for r in pools(t * p * d).run(train_leg, str(tmp_path), leg, legs) if r)
    assert got == pytest.approx(expected, rel=1e-5)
    assert read_metadata(resolve(tmp_path))["consumed_samples"] == 28
