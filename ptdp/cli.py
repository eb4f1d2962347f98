"""`ptdp` command line.

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
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ptdp.argparser import CommandParser, problems_text
from ptdp.config.megatron import add_accepted_flags, config_notes, given, notes, refusals
from ptdp.plural import plural
from ptdp.config import SECTION_TYPES, Config, ConfigError, flag_fields, validate
from ptdp.config.files import field_type, file_settings, load_config_file
from ptdp.data.preprocess import add_preprocess_parser, run_preprocess
from ptdp.data.tokenizer import TokenizerError, add_tokenizer_parser, run_tokenizer_command
# Every command's flags are built at each start, so the modules named here
# must not import torch (a --help, `ptdp plan` and an argument error start in
# a fraction of the time); the commands that need it import it when they run.
from ptdp.generate import add_generate_parser
from ptdp.interop.convert_flags import add_convert_parser
from ptdp.commands.calibrate import add_calibrate_parser, run_calibrate_command
from ptdp.commands.plan import add_plan_parser, run_plan_command
from ptdp.commands.schedule import add_schedule_parser, run_schedule_command

# How long a rank that leaves a shared configuration error to another rank
# waits before exiting (see main).
QUIET_RANK_WAIT_SECONDS = 10.0


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


def version_text() -> str:
    """`ptdp --version`: this package's version and torch's, the two a bug report needs."""
    from importlib import metadata

    from ptdp import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:  # torch from a source build, say
        import torch

        torch_version = torch.__version__
    return f"ptdp {__version__}\ntorch {torch_version}"


def build_parser() -> argparse.ArgumentParser:
    # CommandParser: one-line errors, for every subcommand too (they inherit its class).
    parser = CommandParser(prog="ptdp", description="PTD-P training of GPT models.",
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # --version's 2 lines
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the versions of ptdp and torch and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train a GPT",
        description="Train a GPT with tensor, pipeline and data parallelism. Run directly, it "
                    "starts t·p·d local processes; under torchrun or SLURM it joins their job.")
    train.add_argument("--config", metavar="FILE", help="YAML or TOML file of settings; flags override it")
    _add_config_flags(train)
    add_accepted_flags(train)
    train.collects = True  # every problem of a training command line in one report
    add_schedule_parser(commands)
    add_tokenizer_parser(commands)
    add_generate_parser(commands)
    add_convert_parser(commands)
    add_plan_parser(commands)
    add_calibrate_parser(commands)
    add_preprocess_parser(commands)
    return parser


def _output_path_problems(config: Config) -> list[str]:
    """Every path the run writes, checked before launching (ptdp.output_paths),
    not at its first write (the loss curve's comes after the whole run).
    --save's own rules are `_save_directory_problems`'s; this adds what they
    leave to the shared check (a dangling link, a pseudo file system, a
    directory where no file can be created), once they pass."""
    from ptdp.output_paths import output_path_problems

    tr, data = config.train, config.data
    problems = []
    if isinstance(tr.save, str) and not _save_directory_problems(tr.save):
        problems += output_path_problems("--save", tr.save, directory=True)
    for flag_name, path, directory, suffix in (
            ("--metrics-file", tr.metrics_file, False, None),
            ("--timeline", tr.timeline, False, ".png"),
            ("--loss-curve", tr.loss_curve, False, ".png"),
            ("--tensorboard-dir", tr.tensorboard_dir, True, None),
            ("--data-cache-path", data.data_cache_path, True, None)):
        if isinstance(path, str):
            problems += output_path_problems(flag_name, path, directory=directory, suffix=suffix)
    return problems


def _memory_problems(config: Config, env) -> list[str]:
    """A model that cannot fit this machine's memory by the analytic model's
    estimate (ptdp.perf.fits), refused before its ranks allocate it."""
    from ptdp import device as devices
    from ptdp.perf.fits import memory_problems

    local = config.parallel.world_size if env is None else env.local_world_size
    try:
        kind = devices.resolve_kind(config.parallel.device, local)
    except RuntimeError:  # reported where the launch resolves it
        return []
    memory = None
    if kind == "cuda":
        import torch

        memory = devices.accelerator_shape(torch.device("cuda", 0 if env is None
                                                        else env.local_rank))[1]
    return memory_problems(config, kind=kind, local_processes=local, device_memory=memory)


def _reporting_problems(config: Config) -> list[str]:
    """--eval-*, --peak-tflops and --tensorboard-dir's package, before launching
    (the paths are `_output_path_problems`')."""
    tr, problems = config.train, []
    if not isinstance(tr.eval_interval, int) or tr.eval_interval < 0:
        problems.append(f"--eval-interval={tr.eval_interval!r} must be 0 (never) or a positive integer")
    if not isinstance(tr.eval_iters, int) or isinstance(tr.eval_iters, bool) or tr.eval_iters < 0:
        problems.append(f"--eval-iters={tr.eval_iters!r} must be 0 (no evaluation) or a positive "
                        f"integer")
    if tr.peak_tflops is not None and not tr.peak_tflops > 0:
        problems.append(f"--peak-tflops={tr.peak_tflops!r} must be positive")
    if tr.tensorboard_dir:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            problems.append("--tensorboard-dir needs the tensorboard package: pip install tensorboard")
    return problems


def _checkpoint_problems(config: Config) -> list[str]:
    """--save/--load/--save-interval/--keep-last, checked before launching."""
    from ptdp.checkpoint.store import CheckpointError, check_model_fits, read_metadata, resolve

    tr, problems = config.train, []
    for flag_name, value in (("--save-interval", tr.save_interval), ("--keep-last", tr.keep_last)):
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"{flag_name}={value!r} must be a positive integer")
        elif value is not None and not tr.save:
            problems.append(f"{flag_name} needs --save DIR")
    if tr.save:
        from ptdp.checkpoint.store import save_inside_a_checkpoint
        from ptdp.checkpoint.lock import problem as save_in_use

        problems.extend(_save_directory_problems(tr.save))
        problems.extend(p for p in (save_inside_a_checkpoint(tr.save), save_in_use(tr.save)) if p)
    if tr.load:
        from ptdp.checkpoint.store import nothing_to_train
        from ptdp.train.lr_resume import schedule_problems

        try:
            directory = resolve(tr.load)
            metadata = read_metadata(directory)
            check_model_fits(metadata, config.model, directory)
            if nothing_to_train(config) is None:  # (a finished run resumed: said, a success)
                problems.extend(schedule_problems(tr, tr.batch_size(config.parallel.dp),
                                                  metadata, directory))
        except CheckpointError as error:
            problems.append(str(error))
    return problems


def _save_directory_problems(save: str) -> list[str]:
    """--save must be a directory this user can create or write into."""
    path = Path(save).absolute()
    if path.exists() and not path.is_dir():
        return [f"--save {save} is a file; give a directory"]
    existing = path
    while not existing.exists():  # the nearest ancestor that exists
        existing = existing.parent
    if not existing.is_dir():
        return [f"--save {save}: {existing} is a file, so the directory cannot be created under it; "
                f"choose another path"]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        return [f"--save {save} {what} by this user; choose a directory you can write to"]
    return []


def checkpoint_bytes(config: Config) -> int:
    """What one checkpoint takes on disk: every logical weight in its
    training precision, the two Adam moments in fp32 and, with --bf16 or
    --fp16, the fp32 main weights."""
    from ptdp.perf.analytic.counts import parameter_count

    tr = config.train
    mixed = tr.bf16 or tr.fp16
    return parameter_count(config.model) * ((2 if mixed else 4) + 8 + (4 if mixed else 0))


def _warn_about_free_space(config: Config) -> None:
    """A checkpoint that cannot fit fails hours later; say so now (a warning:
    other files may be removed by then, and the estimate is approximate)."""
    if not config.train.save:
        return
    existing = Path(config.train.save).absolute()
    while not existing.exists():
        existing = existing.parent
    needed, free = checkpoint_bytes(config), shutil.disk_usage(existing).free
    if free < needed:
        print(f"ptdp: warning: --save {config.train.save} has {_size(free)} free, but one "
              f"checkpoint of this model takes about {_size(needed)}; free space or choose "
              f"another --save before the first save", file=sys.stderr, flush=True)


def _size(count: float) -> str:
    """Bytes for people: 4.9 KiB, 3.0 GiB."""
    units, index = ("bytes", "KiB", "MiB", "GiB"), 0
    while count >= 1024 and index < len(units) - 1:
        count, index = count / 1024, index + 1
    return f"{count:.0f} bytes" if index == 0 else f"{count:.1f} {units[index]}"


def _forwarded_signals(config: Config) -> tuple[int, ...]:
    """The signals `ptdp train` passes on to its ranks: those that ask them to
    save and stop (with the handler off, the supervisor's default applies)."""
    from ptdp.config import signal_from_name
    from ptdp.graceful_signals import GRACEFUL_SIGNALS

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
    train, pretrained_note = _pretrained_checkpoint(train)
    said += pretrained_note
    return dataclasses.replace(config, parallel=parallel, train=train), said


def _pretrained_checkpoint(train) -> tuple[Any, list[str]]:
    """--pretrained-checkpoint DIR, Megatron-LM's fine-tuning start: with no
    checkpoint to resume in --load, the run is --load DIR --finetune."""
    pretrained = train.pretrained_checkpoint
    if not isinstance(pretrained, str):
        return train, []
    if isinstance(train.load, str) and not _nothing_to_resume(train.load):
        return train, [f"ptdp: --pretrained-checkpoint {pretrained}: not used, --load "
                       f"{train.load} holds a checkpoint, which the run resumes (as Megatron-LM "
                       f"does)"]
    return dataclasses.replace(train, load=pretrained, finetune=True), [
        f"ptdp: --pretrained-checkpoint {pretrained}: "
        + (f"--load {train.load} holds no checkpoint, so " if isinstance(train.load, str) else "")
        + "the model's weights come from it, as with --load DIR --finetune (iteration 0, a fresh "
          "optimizer and schedule), as Megatron-LM does"]


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
    from ptdp.launch import CPU_RANK_MODULES, LocalJobFailed, launch_local
    from ptdp.perf.local_processes import local_process_problems
    from ptdp.checkpoint.store import nothing_to_train
    from ptdp.checkpoint.args import changed_settings_note, with_checkpoint_shape
    from ptdp.config.moe import megatron_reading_notes
    from ptdp.train.loop import worker

    env = detect_env()
    config, adjusted = _as_megatron_does(config)
    config = with_checkpoint_shape(config, explicit)  # --use-checkpoint-args: the checkpoint's model
    # The tokenizer (the flags', else the one --load's checkpoint carries) and
    # the vocabulary it gives, resolved once here: every rank gets the result.
    config = resolve_data(config, explicit)
    refused = refusals(list(accepted))
    try:
        validate(config, world_size=env.world_size if env is not None else None)
    except ConfigError as error:  # reported together with the refused flags
        raise ConfigError(refused + error.problems) from None
    problems = (refused + check_datasets(config) + _checkpoint_problems(config)
                + _reporting_problems(config) + _output_path_problems(config)
                + _memory_problems(config, env)  # after validate: the layout's arithmetic holds
                + local_process_problems(config.parallel, env))
    if problems:
        raise ConfigError(problems)
    if env is None or env.rank == 0:
        for line in (notes(list(accepted)) + config_notes(config) + adjusted
                     + _mock_data_notes(config, explicit) + changed_settings_note(config)
                     + megatron_reading_notes(config.model, explicit)):
            print(line, flush=True)
    if env is None or env.rank == 0:
        _warn_about_free_space(config)
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


def main(argv: Sequence[str] | None = None) -> int:
    from ptdp.errors import (RankFailure, print_user_error, process_rank, report_to_torchrun,
                             set_process_rank)

    parent = os.getppid()  # first: under torchrun, its agent (launch.follow_torchrun_agent)
    parser = build_parser()
    args, problems, command = parser.parse_collecting(argv)
    if problems:
        if args.command != "train":
            command.error(problems_text(problems))
        # With the settings' own problems, in one report, said once per job.
        _say_shared_error(f"{command.prog}: error: "
                          f"{problems_text(problems + _settings_problems(args))}")
        raise SystemExit(2)
    set_process_rank(None)  # set when this process joins a job as one of its ranks
    try:
        if args.command == "train":
            previous = _say_signals_before_launch()
            try:
                return _train(args, parent, before_launch=lambda: _restore_signals(previous))
            finally:
                _restore_signals(previous)
        if args.command == "schedule":
            return run_schedule_command(args)
        if args.command == "tokenizer":
            return run_tokenizer_command(args)
        if args.command == "preprocess":
            return run_preprocess(args)
        if args.command == "generate":
            from ptdp.generate import run_generate_command

            return run_generate_command(args)
        if args.command == "convert":
            from ptdp.interop.convert import run_convert_command

            return run_convert_command(args)
        if args.command == "plan":
            return run_plan_command(args)
        if args.command == "calibrate":
            return run_calibrate_command(args)
    except _SignalBeforeLaunch as stop:
        stopping = sys.modules.get("ptdp.stop_requests")
        print(f"ptdp: {signal.Signals(stop.signum).name} came while ptdp train was checking its "
              f"settings, before any rank started: nothing was started or saved"
              + (stopping.STOP_REQUESTS.newest_checkpoint() if stopping else ""),
              file=sys.stderr, flush=True)
        return 128 + stop.signum
    except KeyboardInterrupt:
        stopping = sys.modules.get("ptdp.stop_requests")  # imported by `train` only
        # After a graceful stop's request: what it saved, if anything.
        print(stopping.STOP_REQUESTS.interrupted() if stopping else "ptdp: interrupted",
              file=sys.stderr, flush=True)
        return 130
    except Exception as error:
        # Under torchrun, whose summary comes last, report_to_torchrun puts
        # the message there too (instead of "To enable traceback see: ...").
        rank = process_rank()
        if rank is not None:  # raised on a rank of a running job (torchrun, SLURM, one process)
            failure = RankFailure.from_exception(rank, error)
            if not failure.user_error:
                if not failure.lost_peer:  # torchrun's root cause: the earliest error file
                    report_to_torchrun(failure.message, failure.traceback)
                raise  # a bug: its traceback
            print_user_error(rank, failure.message, failure.traceback)
            report_to_torchrun(f"ptdp: error: rank {rank}: {failure.message}")
            return 1
        if isinstance(error, (ConfigError, TokenizerError)):  # found before launching
            _say_shared_error(f"ptdp: error: {error}")
            return 2
        raise
    parser.error(f"unknown command {args.command}")
    return 2


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
    from ptdp.graceful_signals import GRACEFUL_SIGNALS

    numbers = [getattr(signal, name) for name in GRACEFUL_SIGNALS]
    return {number: signal.signal(number, _raise_signal) for number in numbers}


def _restore_signals(previous: dict[int, Any]) -> None:
    """The handlers from before, where ours is still in place (the
    launcher's forwarding and the loop's handler take over from them)."""
    for number, handler in previous.items():
        if signal.getsignal(number) is _raise_signal:
            signal.signal(number, handler)


def _say_shared_error(message: str) -> None:
    """An error every rank of a torchrun or SLURM job finds alike, before
    launching: one rank per node prints it (ptdp.errors.prints_shared_errors),
    every rank's torchrun error file carries it."""
    from ptdp.errors import prints_shared_errors, report_to_torchrun

    speaks = prints_shared_errors()
    if speaks:
        print(message, file=sys.stderr, flush=True)
    report_to_torchrun(message, echo=not speaks)
    if not speaks:
        # torchrun stops every worker when the first one exits: a quiet rank
        # that ended first would stop the one that says why before it
        # printed. It waits; the speaker's exit ends it.
        time.sleep(QUIET_RANK_WAIT_SECONDS)


def _settings_problems(args: argparse.Namespace) -> list[str]:
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


if __name__ == "__main__":
    sys.exit(main())
