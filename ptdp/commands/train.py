"""`ptdp train`: its flags, its run and what it checks before launching
(the checks that read the disk or the machine are train_checks.py's).

Flags are generated from the config dataclasses (ptdp/config/). A config
file (YAML or TOML, `--config FILE`) may set any of them, either in sections
named like the dataclasses (model, parallel, train, data) or flat; keys are
flag names with or without the leading dashes, or field names. Flags given on
the command line override the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from ptdp.config import SECTION_TYPES, Config, ConfigError, flag_fields, signal_from_name, validate
from ptdp.config.files import field_type, file_settings, load_config_file
from ptdp.config.megatron import add_accepted_flags, config_notes, given, notes, refusals
from ptdp.config.moe import megatron_reading_notes
from ptdp.graceful_signals import GRACEFUL_SIGNALS
from ptdp.plural import plural


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    groups = {name: parser.add_argument_group(f"{name} settings") for name in SECTION_TYPES}
    for section, f in flag_fields():
        meta = f.metadata
        names = [meta["flag"]] + ([meta["short"]] if "short" in meta else [])
        kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
        kind = field_type(f.type)
        if kind is bool:
            kwargs["action"] = "store_false" if meta.get("negate") else "store_true"
            kwargs["help"] = meta["help"]
        elif kind is list:
            kwargs.update(nargs=meta.get("nargs", "+"), metavar=meta.get("metavar", "VALUE"),
                          help=meta["help"])
            if f.type.startswith("list[int]"):
                kwargs["type"] = int
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = meta.get("metavar", {int: "N", float: "X", str: "VALUE"}[kind])
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
                kwargs["metavar"] = "{" + ",".join(map(str, meta["choices"])) + "}"
            kwargs["help"] = meta["help"] + ("" if f.default is None else f" (default: {f.default})")
        groups[section].add_argument(*names, **kwargs)
        if "off_flag" in meta:  # a setting on by default: its flag is accepted, the off flag turns it off
            groups[section].add_argument(meta["off_flag"], dest=kwargs["dest"], action="store_false",
                                         default=argparse.SUPPRESS, help=f"turn {meta['flag']} off")


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """{"section.field": value} of every setting the user gave, in the
    config file or as a flag (flags win); defaults are not included."""
    settings = file_settings(load_config_file(args.config), args.config) if args.config else {}
    settings.update({k: v for k, v in vars(args).items() if "." in k})
    return settings


def config_from_settings(settings: dict[str, Any]) -> Config:
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTION_TYPES}
    for key, value in settings.items():
        section, name = key.split(".", 1)
        sections[section][name] = value
    return Config.from_dict(sections)


def config_from_args(args: argparse.Namespace) -> Config:
    return config_from_settings(settings_from_args(args))


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train", help="train a GPT",
        description="Train a GPT with tensor, pipeline and data parallelism. Run directly, it "
                    "starts t·p·d local processes; under torchrun or SLURM it joins their job.")
    train.add_argument("--config", metavar="FILE", help="YAML or TOML file of settings; flags override it")
    _add_config_flags(train)
    add_accepted_flags(train)
    train.collects = True  # every problem of a training command line in one report


def run(args: argparse.Namespace, parent: int) -> int:
    """`ptdp train` from its parsed command line; `parent`: this process's
    parent when it started (under torchrun, its agent). Until the launch, a
    graceful-exit signal ends it with a paragraph (exit 128 + signal)."""
    try:
        previous = _say_signals_before_launch()
        try:
            return _train(args, parent, before_launch=lambda: _restore_signals(previous))
        finally:
            _restore_signals(previous)
    except _SignalBeforeLaunch as stop:
        stopping = sys.modules.get("ptdp.stop_requests")
        print(f"ptdp: {signal.Signals(stop.signum).name} came while ptdp train was checking its "
              f"settings, before any rank started: nothing was started or saved"
              + (stopping.STOP_REQUESTS.newest_checkpoint() if stopping else ""),
              file=sys.stderr, flush=True)
        return 128 + stop.signum


def _train(args: argparse.Namespace, parent: int, before_launch) -> int:
    """`ptdp train` from its parsed command line."""
    from ptdp.launch import follow_torchrun_agent
    from ptdp.stop_requests import STOP_REQUESTS

    if not follow_torchrun_agent(parent):
        print(f"ptdp: error: torchrun's agent (process {parent}) ended before this "
              f"worker could start, so it stops", file=sys.stderr)
        return 1
    settings = settings_from_args(args)
    config = config_from_settings(settings)
    STOP_REQUESTS.new_run(config.train.save)  # what a Ctrl-C names
    return run_train(config, explicit=list(settings), accepted=given(args),
                     before_launch=before_launch)


def run_train(config: Config, explicit: Sequence[str] = (), accepted: Sequence = (),
              before_launch=lambda: None) -> int:
    """`explicit`: the settings the user gave ("section.field"); a vocabulary
    size not among them is taken from the tokenizer, and without tokenizer
    settings among them, --load's checkpoint's tokenizer (if it carries one)
    is the run's. `accepted`: the Megatron-LM flags given that ptdp accepts
    without a setting (ptdp.config.megatron), with their values.
    `before_launch()` is called once the checks pass, before any rank or
    the training loop starts."""
    from ptdp.data.loader import check_datasets
    from ptdp.checkpoint.data_settings import resolve_data
    from ptdp.device import resolve_kind
    from ptdp.distributed import LOOPBACK, DistEnv, detect_env
    from ptdp.commands.train_checks import (launch_problems, resolve_reshard_after_forward,
                                            warn_about_free_space)
    from ptdp.launch import CPU_RANK_MODULES, LocalJobFailed, launch_local
    from ptdp.perf.local_processes import local_process_problems
    from ptdp.checkpoint.store import nothing_to_train
    from ptdp.checkpoint.adapters import with_checkpoint_lora
    from ptdp.checkpoint.args import changed_settings_note, with_checkpoint_shape
    from ptdp.train.loop import worker

    env = detect_env()
    config, adjusted = _as_megatron_does(config)
    config = with_checkpoint_shape(config, explicit)  # --use-checkpoint-args: the checkpoint's model
    config = with_checkpoint_lora(config, explicit)  # adapters loaded: their LoRA settings
    # The tokenizer (the flags', else the one --load's checkpoint carries) and
    # the vocabulary it gives, resolved once here: every rank gets the result.
    config = resolve_data(config, explicit)
    refused = refusals(list(accepted))
    try:
        validate(config, world_size=env.world_size if env is not None else None)
    except ConfigError as error:  # reported together with the refused flags
        raise ConfigError(refused + error.problems) from None
    adjusted += resolve_reshard_after_forward(config, env) if not refused else []
    # --sft tokenizes its files while checking them: only once all else holds.
    problems = (refused + ([] if config.data.sft else check_datasets(config))
                + launch_problems(config, env)  # after validate: the layout's arithmetic holds
                + local_process_problems(config.parallel, env))
    if not problems and config.data.sft:
        problems = check_datasets(config)
    if problems:
        raise ConfigError(problems)
    if env is None or env.rank == 0:
        for line in (notes(list(accepted)) + config_notes(config) + adjusted
                     + _mock_data_notes(config, explicit) + changed_settings_note(config)
                     + megatron_reading_notes(config.model, explicit)):
            print(line, flush=True)
    if env is None or env.rank == 0:
        warn_about_free_space(config)
    finished = nothing_to_train(config)
    if finished:  # a finished run resumed (a requeued job, say): said, and a success
        if env is None or env.rank == 0:
            print(finished, flush=True)
        return 0
    before_launch()  # the launcher's forwarding or the loop's handler takes the signals
    if env is not None:
        worker(env, config)
        return 0
    world = config.parallel.world_size
    try:
        kind = resolve_kind(config.parallel.device, world)
    except RuntimeError as error:
        raise ConfigError([str(error)]) from None
    # Said before the ranks come up: starting them (importing torch, joining
    # the process group) takes seconds in which nothing else is printed.
    parallel = config.parallel
    context = (f", c={parallel.context_parallel_size}" if parallel.context_parallel_size > 1
               else "")
    print(f"ptdp: starting {plural(world, 'process')} on this machine (t="
          f"{parallel.tensor_model_parallel_size}, p={parallel.pipeline_model_parallel_size}, "
          f"d={parallel.dp}{context}) on {kind}" + (", gloo" if kind == "cpu" else ", nccl"), flush=True)
    cores = os.cpu_count() or 1
    if kind == "cpu" and world > 2 * cores:
        print(f"ptdp: note: {plural(world, 'process')} share {plural(cores, 'CPU core')}: each "
              f"waits for the others most of the time, so every "
              f"iteration is slower than with fewer processes; such a layout checks equivalence, "
              f"it is not for speed", flush=True)
    if world == 1:
        worker(DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                       master_addr=LOOPBACK, master_port=0, source="local"), config)
        return 0
    try:
        launch_local(world, worker, config, forward_signals=_forwarded_signals(config),
                     preload=CPU_RANK_MODULES if kind == "cpu" else ())
    except LocalJobFailed as failure:
        if not failure.stopped:  # (a stop request ended every rank: no others to stop)
            others = world - 1
            print(f"ptdp: stopped the {others} other rank{'s' if others > 1 else ''}",
                  file=sys.stderr)
        failure.report()  # the cause on the last line
        return 1
    return 0


def _forwarded_signals(config: Config) -> tuple[int, ...]:
    """The signals `ptdp train` passes on to its ranks: those that ask them to
    save and stop (with the handler off, the supervisor's default applies)."""
    if not config.train.exit_signal_handler:
        return ()
    names = (*GRACEFUL_SIGNALS, config.train.exit_signal)
    return tuple(sorted({int(signal_from_name(name)) for name in names}))


def _nothing_to_resume(load: str) -> bool:
    """Whether --load's directory holds no checkpoint at all: missing, or
    without `latest`, metadata or any iter_* directory (a directory with some
    of them is a damaged one, which loading reports)."""
    from ptdp.checkpoint.retention import LATEST, METADATA

    directory = Path(load)
    if not directory.exists():
        return True
    return directory.is_dir() and not (directory / LATEST).exists() and not (
        directory / METADATA).exists() and not any(directory.glob("iter_*"))


def _as_megatron_does(config: Config) -> tuple[Config, list[str]]:
    """Two settings Megatron-LM's scripts rely on it to adjust, adjusted the
    same way and said in a note (every other setting is taken as given):
    --sequence-parallel at t = 1, and `--save DIR --load DIR`, its resume
    idiom, before DIR holds a checkpoint."""
    said: list[str] = []
    parallel, train = config.parallel, config.train
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size == 1:
        parallel = dataclasses.replace(parallel, sequence_parallel=False)
        said.append("ptdp: --sequence-parallel has no effect with --tensor-model-parallel-size 1 "
                    "(there is no tensor group to split the sequence over): it is off, as "
                    "Megatron-LM turns it off")
    if isinstance(train.load, str) and isinstance(train.save, str) and \
            Path(train.load).resolve() == Path(train.save).resolve() and _nothing_to_resume(train.load):
        # What only a loaded checkpoint means goes with it, as in Megatron-LM.
        unused = [flag for flag, on in (("--finetune", train.finetune),
                                        ("--no-load-optim", not train.load_optim),
                                        ("--no-load-rng", not train.load_rng),
                                        ("--use-checkpoint-args", train.use_checkpoint_args),
                                        ("--override-opt_param-scheduler",
                                         train.override_opt_param_scheduler),
                                        ("--use-checkpoint-opt_param-scheduler",
                                         train.use_checkpoint_opt_param_scheduler)) if on]
        train = dataclasses.replace(train, load=None, finetune=False, load_optim=True,
                                    load_rng=True, use_checkpoint_args=False,
                                    override_opt_param_scheduler=False,
                                    use_checkpoint_opt_param_scheduler=False)
        said.append(f"ptdp: --load {config.train.load}: no checkpoint there yet, so training starts "
                    f"at iteration 0 (it is also --save: the next run resumes from what this one "
                    f"saves)" + (f"; {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} "
                                 f"nothing to apply to" if unused else ""))
    train, pretrained_note = _pretrained_checkpoint(train, config.lora.enabled)
    said += pretrained_note
    return dataclasses.replace(config, parallel=parallel, train=train), said


def _pretrained_checkpoint(train, lora: bool = False) -> tuple[Any, list[str]]:
    """--pretrained-checkpoint DIR, Megatron-LM's fine-tuning start: with no
    checkpoint to resume in --load, the run is --load DIR --finetune. With
    LoRA it is always the base, and --load's checkpoint the adapters."""
    pretrained = train.pretrained_checkpoint
    if not isinstance(pretrained, str):
        return train, []
    if lora and isinstance(train.load, str) and not _nothing_to_resume(train.load):
        return train, [f"ptdp: --pretrained-checkpoint {pretrained}: the base model the adapters "
                       f"of --load {train.load} resume on (its seal must be the one they record)"]
    if isinstance(train.load, str) and not _nothing_to_resume(train.load):
        return train, [f"ptdp: --pretrained-checkpoint {pretrained}: not used, --load "
                       f"{train.load} holds a checkpoint, which the run resumes (as Megatron-LM "
                       f"does)"]
    what = ("the frozen base model's weights come from it; the adapters start afresh (B = 0, "
            "so the first step computes the base model), at iteration 0 with a fresh optimizer "
            "and schedule" if lora else
            "the model's weights come from it, as with --load DIR --finetune (iteration 0, a "
            "fresh optimizer and schedule), as Megatron-LM does")
    return dataclasses.replace(train, load=pretrained, finetune=True), [
        f"ptdp: --pretrained-checkpoint {pretrained}: "
        + (f"--load {train.load} holds no checkpoint, so " if isinstance(train.load, str) else "")
        + what]


def _mock_data_notes(config: Config, explicit: Sequence[str]) -> list[str]:
    """--split given with --mock-data is said to do nothing, never refused:
    Megatron-LM replaces it with 1,1,1 under mock data, and its own scripts
    pass it there, even in a form ptdp's parser refuses (llama3_8b.sh's
    --split "'99,1,0'"). One that would be refused with real data says so."""
    from ptdp.data.gpt_dataset import DataError, parse_split

    if not (config.data.mock_data and "data.split" in explicit):
        return []
    split = config.data.split
    note = (f"ptdp: --split {split} has no effect with --mock-data: generated data has no splits "
            f"(validation reads other generated sequences); Megatron-LM ignores it there too")
    try:
        parse_split(split)
    except DataError as error:
        return [f"{note}. With --data-path it would be refused: {error}"]
    return [note]


class _SignalBeforeLaunch(BaseException):
    """A graceful-exit signal while `ptdp train` checks its settings, before
    any rank (or the training loop's own handler) exists: the job ends, with
    its paragraph. BaseException: the checks' `except Exception` let it by."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_signal(signum: int, frame) -> None:
    raise _SignalBeforeLaunch(signum)


def _say_signals_before_launch() -> dict[int, Any]:
    """Until the launch, a graceful-exit signal ends `ptdp train` with a
    paragraph instead of silently (exit 128 + signal); returns the handlers
    it replaced, for _restore_signals."""
    numbers = [getattr(signal, name) for name in GRACEFUL_SIGNALS]
    return {number: signal.signal(number, _raise_signal) for number in numbers}


def _restore_signals(previous: dict[int, Any]) -> None:
    """The handlers from before, where ours is still in place (the
    launcher's forwarding and the loop's handler take over from them)."""
    for number, handler in previous.items():
        if signal.getsignal(number) is _raise_signal:
            signal.signal(number, handler)


def settings_problems(args: argparse.Namespace) -> list[str]:
    """The refused Megatron-LM flags and invalid settings of a training
    command line that has problems of its own, reported with them (one
    round). Only the checks that read no file but --config and import no
    torch (the rest come once the command line is right)."""
    try:
        config = config_from_args(args)
    except ConfigError as error:
        return error.problems
    problems = refusals(given(args))
    config, _ = _as_megatron_does(config)
    if config.train.use_checkpoint_args:  # the model's shape is the checkpoint's, not read here
        return problems
    try:
        validate(config, world_size=_job_world_size())
    except ConfigError as error:
        problems += error.problems
    return problems


def _job_world_size() -> int | None:
    """The job's process count under torchrun or SLURM, from the variables
    ptdp.distributed.detect_env reads (None for a local launch, or where they
    do not say)."""
    environ = os.environ
    name = ("WORLD_SIZE" if "RANK" in environ and "WORLD_SIZE" in environ else
            "SLURM_NTASKS" if "SLURM_PROCID" in environ else None)
    try:
        world = int(environ[name]) if name else None
    except ValueError:  # said where the job is joined
        return None
    return world if world is None or name == "WORLD_SIZE" or world > 1 else None
