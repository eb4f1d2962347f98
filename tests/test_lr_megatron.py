"""The learning rate as Megatron-LM applies it (issue 27, item 6), and
--eval-iters 0 (item 7).

- Megatron-LM's train_step steps the optimizer with the rate its scheduler
  holds before the iteration (the constructor's step(0): at 0 samples), then,
  only when the step was not skipped, advances the scheduler by the
  iteration's samples; training_log logs the rate it holds then. A Trainer's
  applied and logged rates equal that order's, driven by Megatron-LM's own
  OptimizerParamScheduler where a checkout is named by $PTDP_MEGATRON_REPO
  (else by a stand-in with Megatron-LM's step/num_steps protocol around
  ptdp's formulas, which tests/test_megatron_schedules.py proves equal to
  Megatron-LM's), for iteration- and sample-based warm-ups, every decay
  style, WSD, --decoupled-lr, a batch ramp-up and fp16's skipped steps.
- Under a warm-up the first iteration steps at rate 0: the weights do not move.
- A resume continues the checkpoint's schedule where it stood; a command line
  whose schedule differs is refused before launch (exit 2) naming Megatron-LM's
  --use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler,
  each of which then does what Megatron-LM's does.
"""

from __future__ import annotations

import functools
import json
import types

import pytest
import torch

from ptdp.cli import main
from ptdp.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, validate
from ptdp.parallel.topology import ParallelContext
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.train.loop import Trainer
from ptdp.train.lr_schedule import LRSchedule
from tests.test_megatron_schedules import MEGATRON_REPO, megatron  # noqa: F401 - the fixture

CPU = torch.device("cpu")
MODEL = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                    vocab_size=32, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)
BASE = dict(micro_batch_size=1, global_batch_size=2, lr=1e-2, min_lr=1e-3, seed=3)
CASES = {
    "linear-warmup-iters": dict(train_iters=8, lr_warmup_iters=3),
    "cosine-decoupled": dict(train_iters=8, lr_warmup_iters=2, lr_decay_style="cosine",
                             decoupled_lr=5e-2, decoupled_min_lr=2e-3),
    "inverse-square-root": dict(train_iters=8, lr_warmup_iters=2,
                                lr_decay_style="inverse-square-root"),
    "constant": dict(train_iters=6, lr_warmup_iters=2, lr_decay_style="constant"),
    "WSD-samples-ramp": dict(train_iters=None, train_samples=24, global_batch_size=4,
                             rampup_batch_size=[2, 2, 8], lr_warmup_samples=4,
                             lr_decay_style="WSD", lr_wsd_decay_samples=10,
                             lr_wsd_decay_style="cosine"),
    "fp16-skipped-steps": dict(train_iters=6, lr_warmup_iters=2, fp16=True,
                               initial_loss_scale=2.0 ** 20, hysteresis=1),
}


def _config(**train) -> Config:
    return Config(model=MODEL, train=TrainConfig(**{**BASE, **train}),
                  data=DataConfig(mock_data=True))


def _steps(trainer: Trainer, iterations) -> tuple[list, list]:
    """(rates the optimizer stepped with, records) of `iterations`."""
    applied, real = [], trainer.optimizer.step

    def spy(lr, decoupled_lr=None):
        applied.append((lr, decoupled_lr))
        return real(lr, decoupled_lr)

    trainer.optimizer.step = spy
    records = [trainer.step(i)[0] for i in iterations]
    trainer.optimizer.step = real
    return applied, records


class _StandIn:
    """Megatron-LM's scheduler protocol (num_steps; step(increment) writes
    each param group's lr at the new position; the constructor steps 0)
    around ptdp's formulas, for runs without a Megatron-LM checkout."""

    def __init__(self, optimizer, tr: TrainConfig, B: int):
        main = LRSchedule.from_config(tr, B)
        self.optimizer, self.num_steps = optimizer, 0
        self.schedules = [main, main if len(optimizer.param_groups) == 1 else
                          LRSchedule.decoupled_from_config(tr, B)]
        self.step(0)

    def step(self, increment):
        self.num_steps += increment
        for group, schedule in zip(self.optimizer.param_groups, self.schedules):
            group["lr"] = schedule.lr(self.num_steps)


def _megatron_scheduler(megatron, optimizer, tr: TrainConfig, B: int):
    """Megatron-LM's scheduler as get_optimizer_param_scheduler builds it."""
    main = LRSchedule.from_config(tr, B)  # the lengths in samples (checked against Megatron-LM's)
    return megatron.scheduler.OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=tr.lr, min_lr=tr.min_lr, lr_warmup_steps=main.warmup_steps,
        lr_decay_steps=main.decay_steps, lr_decay_style=tr.lr_decay_style, start_wd=0.0,
        end_wd=0.0, wd_incr_steps=main.decay_steps, wd_incr_style="constant",
        wsd_decay_steps=main.wsd_decay_steps, lr_wsd_decay_style=tr.lr_wsd_decay_style)


def _megatron_order(scheduler_of, tr: TrainConfig, B: int, records: list) -> tuple[list, list]:
    """(applied, logged) rates of Megatron-LM's train_step and training_log
    for iterations of the records' batches and skips: the optimizer steps
    with the groups' lr, then scheduler.step(increment=batch) if the update
    succeeded, then the first group's lr is logged."""
    groups = [{"max_lr": tr.lr, "min_lr": tr.min_lr}]
    if tr.decoupled_lr is not None:
        groups.append({"max_lr": tr.decoupled_lr,
                       "min_lr": tr.min_lr if tr.decoupled_min_lr is None else tr.decoupled_min_lr})
    optimizer = types.SimpleNamespace(param_groups=groups)
    scheduler = scheduler_of(optimizer, tr, B)
    applied, logged = [], []
    for record in records:
        rates = [group["lr"] for group in groups]
        applied.append((rates[0], rates[1] if len(rates) > 1 else None))
        if not record["skipped"]:
            scheduler.step(increment=record.get("global_batch_size", B))
        logged.append(groups[0]["lr"])
    return applied, logged


@pytest.mark.parametrize("case", list(CASES))
def test_rates_follow_megatrons_train_step(case, request):
    config = _config(**CASES[case])
    validate(config)
    tr = config.train
    trainer = Trainer(config, ParallelContext.single(), CPU)
    applied, records = _steps(trainer, range(trainer.train_iters))
    B = trainer.global_batch
    scheduler_of = (functools.partial(_megatron_scheduler, request.getfixturevalue("megatron"))
                    if MEGATRON_REPO else _StandIn)
    want_applied, want_logged = _megatron_order(scheduler_of, tr, B, records)
    assert applied == want_applied  # bitwise
    assert [r["lr"] for r in records] == want_logged
    # Iteration 1 steps with the rate at 0 samples: 0 under a warm-up.
    assert applied[0][0] == 0.0
    if case == "fp16-skipped-steps":
        skipped = [r["skipped"] for r in records]
        assert skipped[0] and not all(skipped)
        # A skipped step leaves the schedule where it stood (the rate repeats).
        first = skipped.index(False)
        assert {rate for rate, _ in applied[:first + 1]} == {0.0}
    if case == "WSD-samples-ramp":
        assert {r["global_batch_size"] for r in records} == {2, 4}


def test_the_first_iteration_of_a_warm_up_leaves_the_weights():
    """Megatron-LM's first step is at the warm-up's rate 0: Adam's moments
    fill, the weights stay; the second step (at lr·1/3) moves them."""
    trainer = Trainer(_config(**CASES["linear-warmup-iters"]), ParallelContext.single(), CPU)
    before = trainer.buffer.param_data.clone()
    record = trainer.step(0)[0]
    assert torch.equal(trainer.buffer.param_data, before) and trainer.optimizer.exp_avg.any()
    assert record["lr"] == pytest.approx(1e-2 / 3)  # logged: the rate the next step takes
    trainer.step(1)
    assert not torch.equal(trainer.buffer.param_data, before)


# --------------------------------------------------------------------------- resuming

TINY = ["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--vocab-size", "32", "--make-vocab-size-divisible-by", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "2",
        "--seed", "3", "--log-interval", "100"]


def _train(tmp_path, name, *flags):
    """`ptdp train TINY FLAGS` in this process: (exit code, logged rates by iteration)."""
    metrics = tmp_path / f"{name}.jsonl"
    code = main(["train", *TINY, *flags, "--metrics-file", str(metrics)])
    rates = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record:
                rates[record["iteration"]] = record["lr"]
    return code, rates


def _logged(train_iters: int, iterations) -> dict[int, float]:
    """The rates an uninterrupted TINY run of `train_iters` logs (none skipped)."""
    schedule = LRSchedule.from_config(TrainConfig(**{**BASE, "train_iters": train_iters,
                                                     "lr_warmup_iters": 2}), 2)
    return {i: schedule.lr(i * 2) for i in iterations}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """An 8-iteration run stopped (and saved) after 4, and the uninterrupted run's rates."""
    tmp = tmp_path_factory.mktemp("lr-resume")
    save = tmp / "ckpt"
    code, first = _train(tmp, "first", "--train-iters", "8", "--exit-interval", "4",
                         "--save", str(save))
    assert code == 0 and first == _logged(8, range(1, 5))
    return save, _logged(8, range(1, 9))


def test_a_checkpoint_records_the_schedule_where_it_stands(stopped):
    save, _ = stopped
    held = read_metadata(resolve(save))["lr_schedule"]
    assert held["num_steps"] == 4 * 2  # Megatron-LM's num_steps: samples stepped
    assert held["schedule"]["decay_steps"] == 8 * 2 and held["schedule"]["warmup_steps"] == 2 * 2
    assert held["decoupled"] is None


def test_a_resume_continues_the_schedule(stopped, tmp_path):
    save, straight = stopped
    code, rates = _train(tmp_path, "resumed", "--train-iters", "8", "--load", str(save))
    assert code == 0 and rates == {i: straight[i] for i in range(5, 9)}


def test_another_schedule_is_refused_with_megatrons_two_ways_out(stopped, tmp_path, capsys):
    save, _ = stopped
    code, _ = _train(tmp_path, "longer", "--train-iters", "12", "--load", str(save),
                     "--lr", "2e-2", "--lr-decay-style", "cosine", "--lr-warmup-init", "1e-3")
    assert code == 2
    err = capsys.readouterr().err
    assert f"--load {resolve(save)} holds a learning-rate schedule other than this command " \
           "line's:" in err
    assert "--lr: checkpoint 0.01, requested 0.02" in err
    assert "--lr-warmup-init: checkpoint 0.0, requested 0.001" in err
    assert ("decay length (--lr-decay-iters, default --train-iters): checkpoint 16 samples "
            "(8 iterations of 2), requested 24 samples (12 iterations of 2)") in err
    assert "--lr-decay-style: checkpoint linear, requested cosine" in err
    assert "--use-checkpoint-opt_param-scheduler (continue the checkpoint's schedule)" in err
    assert "--override-opt_param-scheduler (follow this command line's from the samples " \
           "consumed; the rate changes at once)" in err
    assert not (tmp_path / "longer.jsonl").exists()  # refused before anything ran


def test_use_checkpoint_opt_param_scheduler_continues_the_checkpoints(stopped, tmp_path, capsys):
    """Megatron-LM's _check_and_set takes the checkpoint's values: the decay
    still ends at iteration 8, then --min-lr."""
    save, straight = stopped
    code, rates = _train(tmp_path, "kept", "--train-iters", "12", "--load", str(save),
                         "--use-checkpoint-opt_param-scheduler")
    assert code == 0
    assert rates == {**{i: straight[i] for i in range(5, 9)}, **{i: 1e-3 for i in range(9, 13)}}
    assert "the learning-rate schedule is the checkpoint's (--use-checkpoint-opt_param-scheduler)" \
        in capsys.readouterr().out


def test_override_opt_param_scheduler_follows_the_command_line(stopped, tmp_path):
    """Megatron-LM's override: the command line's schedule, at the samples consumed."""
    save, _ = stopped
    code, rates = _train(tmp_path, "override", "--train-iters", "12", "--load", str(save),
                         "--override-opt_param-scheduler")
    assert code == 0 and rates == _logged(12, range(5, 13))


def test_megatrons_resume_idiom_with_the_flag_starts_then_continues(tmp_path, capsys):
    """Megatron-LM's resume tests pass --use-checkpoint-opt_param-scheduler
    with `--save DIR --load DIR` from the first run on: nothing to apply to
    then, said; the next, longer run continues the checkpoint's schedule."""
    flags = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
             "--use-checkpoint-opt_param-scheduler"]
    code, rates = _train(tmp_path, "first", "--train-iters", "2", *flags)
    assert code == 0 and rates == _logged(2, [1, 2])
    assert "--use-checkpoint-opt_param-scheduler has nothing to apply to" in capsys.readouterr().out
    code, rates = _train(tmp_path, "second", "--train-iters", "3", *flags)
    assert code == 0 and rates == {3: 1e-3}  # past the checkpoint's decay: --min-lr


def test_the_schedule_flags_are_checked():
    def problems(**train):
        with pytest.raises(ConfigError) as caught:
            validate(_config(train_iters=4, **train))
        return caught.value.problems

    assert problems(override_opt_param_scheduler=True) == [
        "--override-opt_param-scheduler needs --load DIR (the checkpoint whose learning-rate "
        "schedule to replace): add --load or drop --override-opt_param-scheduler"]
    assert "exclude each other" in problems(load="ckpt", override_opt_param_scheduler=True,
                                            use_checkpoint_opt_param_scheduler=True)[0]
    assert "with --no-load-optim the schedule starts afresh" in problems(
        load="ckpt", load_optim=False, use_checkpoint_opt_param_scheduler=True)[0]
    validate(_config(train_iters=4, load="ckpt", override_opt_param_scheduler=True))


def test_the_schedule_flags_are_config_keys(tmp_path):
    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_settings, settings_from_args

    def train_of(text):
        path = tmp_path / "run.yaml"
        path.write_text(text)
        args = build_parser().parse_args(["train", "--config", str(path)])
        return config_from_settings(settings_from_args(args)).train

    train = train_of("train:\n  use-checkpoint-opt_param-scheduler: true\n")
    assert train.use_checkpoint_opt_param_scheduler and not train.override_opt_param_scheduler
    assert train_of("override-opt_param-scheduler: true\n").override_opt_param_scheduler


# --------------------------------------------------------------------------- --eval-iters 0

def test_eval_iters_0_turns_evaluation_off(tmp_path, capsys):
    """Megatron-LM's way: no evaluation at the interval nor after the last iteration."""
    code, rates = _train(tmp_path, "no-eval", "--train-iters", "4", "--eval-interval", "3",
                         "--eval-iters", "0", "--log-interval", "1")
    assert code == 0 and sorted(rates) == [1, 2, 3, 4]
    assert "val loss" not in capsys.readouterr().out
    assert "val_loss" not in (tmp_path / "no-eval.jsonl").read_text()
    assert main(["train", *TINY, "--train-iters", "4", "--eval-iters", "-1"]) == 2
    assert "--eval-iters=-1 must be 0 (no evaluation) or a positive integer" in \
        capsys.readouterr().err
