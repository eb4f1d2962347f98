"""`ptdp` command line: the top-level parser, built from each command's
parser (ptdp/commands/, one module per command), the routing of `main` to
the command's run, `--version`, and the error reporting every command
shares (a user's error as one paragraph, exit 2; under torchrun or SLURM
said once per job).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import metadata
from typing import Sequence

from ptdp import __version__
from ptdp.argparser import CommandParser, problems_text
# Every command's flags are built at each start, so the modules named here
# must not import torch (a --help, `ptdp plan` and an argument error start in
# a fraction of the time); the commands that need it import it when they run.
from ptdp.commands import convert, generate, preprocess, tokenizer, train
from ptdp.commands.calibrate import add_calibrate_parser, run_calibrate_command
from ptdp.commands.plan import add_plan_parser, run_plan_command
from ptdp.commands.schedule import add_schedule_parser, run_schedule_command
from ptdp.config import ConfigError
from ptdp.data.tokenizer_error import TokenizerError
from ptdp.errors import (RankFailure, print_user_error, prints_shared_errors, process_rank,
                         report_to_torchrun, set_process_rank)

# How long a rank that leaves a shared configuration error to another rank
# waits before exiting (see main).
QUIET_RANK_WAIT_SECONDS = 10.0


def version_text() -> str:
    """`ptdp --version`: this package's version and torch's, the two a bug report needs."""
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
    train.add_parser(commands)
    add_schedule_parser(commands)
    tokenizer.add_parser(commands)
    generate.add_parser(commands)
    convert.add_parser(commands)
    add_plan_parser(commands)
    add_calibrate_parser(commands)
    preprocess.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parent = os.getppid()  # first: under torchrun, its agent (launch.follow_torchrun_agent)
    parser = build_parser()
    args, problems, command = parser.parse_collecting(argv)
    if problems:
        if args.command != "train":
            command.error(problems_text(problems))
        # With the settings' own problems, in one report, said once per job.
        _say_shared_error(f"{command.prog}: error: "
                          f"{problems_text(problems + train.settings_problems(args))}")
        raise SystemExit(2)
    set_process_rank(None)  # set when this process joins a job as one of its ranks
    try:
        if args.command == "train":
            return train.run(args, parent)
        if args.command == "schedule":
            return run_schedule_command(args)
        if args.command == "tokenizer":
            return tokenizer.run(args)
        if args.command == "preprocess":
            return preprocess.run(args)
        if args.command == "generate":
            return generate.run(args)
        if args.command == "convert":
            return convert.run(args)
        if args.command == "plan":
            code = run_plan_command(args)
            # the program itself, not a caller's process, nor under a
            # profiler or a tracer (coverage), which write at exit
            if argv is None and sys.getprofile() is None and sys.gettrace() is None:
                _exit_without_freeing(code)
            return code
        if args.command == "calibrate":
            return run_calibrate_command(args)
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


def _exit_without_freeing(code: int) -> None:
    """End the process now, its output flushed: a search's caches hold
    millions of small objects, and freeing them one by one at exit takes
    seconds (as long as half the search at 3,072 GPUs) for nothing. Only
    where the command line ran `ptdp plan` itself: nothing else in the
    process waits on an exit handler."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _say_shared_error(message: str) -> None:
    """An error every rank of a torchrun or SLURM job finds alike, before
    launching: one rank per node prints it (ptdp.errors.prints_shared_errors),
    every rank's torchrun error file carries it."""
    speaks = prints_shared_errors()
    if speaks:
        print(message, file=sys.stderr, flush=True)
    report_to_torchrun(message, echo=not speaks)
    if not speaks:
        # torchrun stops every worker when the first one exits: a quiet rank
        # that ended first would stop the one that says why before it
        # printed. It waits; the speaker's exit ends it.
        time.sleep(QUIET_RANK_WAIT_SECONDS)


if __name__ == "__main__":
    sys.exit(main())
