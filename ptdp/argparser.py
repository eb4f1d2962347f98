"""The argparse parser of every `ptdp` command: mistakes on the command line
are one line each, like mistakes in a config file.

argparse's own errors print the whole usage (for `ptdp train`, dozens of
flags) above a terse last line, and an unknown flag is reported by the
top-level parser as `ptdp: error: unrecognized arguments`, without the
command it was given to or a guess at what was meant. `CommandParser`
reports instead, with exit status 2 as argparse does:

    ptdp train: error: unrecognized flag --swiglu-x (did you mean --swiglu?)
    ptdp train: error: --pipeline-schedule zb: choose from gpipe, 1f1b, zb-h1, zbv
    ptdp train: error: --num-layers x: not an integer
    ptdp train: error: --num-layers needs a value: --num-layers N

Subcommand parsers made with `add_subparsers().add_parser` are of the
parent's class, so making the top-level parser a `CommandParser` covers
every command.

A command whose parser `collects` (`ptdp train`'s) reports every problem of
its command line in one round: each unknown flag, each value that does not
parse, each missing value (`parse_collecting` returns them, and `parse_args`
reports them together); the caller adds the settings' own problems to them.

"Did you mean" names a flag only for a near miss, a typo (one or two
letters changed, dropped, added or swapped; one for a flag that names a
file or directory), never for a flag of Megatron-LM's parser: `--mscale`
is not a misspelt `--save`, nor `--mtp-num-layers` a misspelt `--num-layers`.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn, Sequence

_ARGUMENT = re.compile(r"argument (?P<names>[^:]+): (?P<rest>.*)", re.S)
_INVALID_VALUE = re.compile(r"invalid (?P<type>\w+) value: (?P<value>.*)", re.S)
_TYPE_WORDS = {"int": "not an integer", "float": "not a number"}
# The namespace attribute that carries a collecting parser's problems, and
# the value an action is given for a value that did not parse (removed).
PROBLEMS = "_command_line_problems"
_INVALID = object()
# Metavars of flags that name a file or directory: a guess must be closer.
_PATH_METAVARS = ("DIR", "FILE", "PATH", "CKPT", "PREFIX")


def edit_distance(a: str, b: str) -> int:
    """Letters changed, dropped, added or swapped (adjacent) to turn a into b
    (the optimal string alignment distance)."""
    previous, row = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, previous, row = previous, row, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1,
                         previous[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], before[j - 2] + 1)
    return row[len(b)]


def did_you_mean(name: str, known: Sequence[str], paths: Sequence[str] = ()) -> str:
    """' (did you mean --swiglu?)' for the closest of `known` if it is a near
    miss, or ''. One guess: a second one is rarely what was meant and makes
    the line long. `paths`: those of `known` that name a file or directory,
    where a wrong guess would write or read elsewhere: one edit at most."""
    from ptdp.config.megatron_flag_list import MEGATRON_LM_FLAGS

    if name in MEGATRON_LM_FLAGS:  # a real flag of another program, never a typo of ours
        return ""
    scored = []
    for candidate in known:
        distance = edit_distance(name, candidate)
        if distance <= (1 if candidate in paths else 2) and distance < len(candidate.lstrip("-")):
            ratio = difflib.SequenceMatcher(None, name, candidate).ratio()
            scored.append((distance, -ratio, candidate))
    return f" (did you mean {min(scored)[2]}?)" if scored else ""


def _is_flag(token: str) -> bool:
    """'--foo' and '-x' are flags; '-3' and '-0.5' are (negative) values."""
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `<prog>: error: <what>`.
    `not_taken` (set by a command): flags another command takes, or flag
    prefixes, each with why this one does not, said instead of a guess."""

    not_taken: dict[str, str] = {}
    collects: bool = False  # report every problem of the command line in one round

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required: "):
            # A misspelt flag often is the missing one (--hiden-size): name it first.
            unknown = self._unknown_flags(getattr(self, "_given", []))
            if unknown:
                message = self._unrecognized(unknown)
        self.exit(2, f"{self.prog}: error: {self._reworded(message)}\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # Kept for error(): argparse checks required flags before it reports unknown ones.
        self._given = list(sys.argv[1:] if args is None else args)
        self._problems: list[str] = []
        self._missing: set[int] = set()  # actions given without their value
        parsed, extras = super().parse_known_args(args, namespace)
        for name, value in list(vars(parsed).items()):
            if value is _INVALID:  # reported instead: the setting keeps its default
                delattr(parsed, name)
        if self._problems:
            setattr(parsed, PROBLEMS, getattr(parsed, PROBLEMS, []) + self._problems)
        return parsed, extras

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, problems, command = self.parse_collecting(args, namespace)
        if problems:
            command.error(problems_text(problems))
        return parsed

    def parse_collecting(self, args=None, namespace=None
                         ) -> tuple[argparse.Namespace, list[str], CommandParser]:
        """The parsed command line, its problems (the unknown flags first)
        and the parser of the command chosen. Without `collects`, a problem
        other than unknown flags ends the parse at once, as argparse does."""
        parsed, extras = self.parse_known_args(args, namespace)
        problems = getattr(parsed, PROBLEMS, [])
        if hasattr(parsed, PROBLEMS):
            delattr(parsed, PROBLEMS)
        # The tokens that reached no parser: blame the (sub)command they were given to.
        command = self._innermost(parsed)
        if extras:
            problems.insert(0, command._unrecognized(extras))
        return parsed, problems, command

    # ---- collecting, instead of stopping at the first problem

    def _match_argument(self, action, arg_strings_pattern):
        try:
            return super()._match_argument(action, arg_strings_pattern)
        except argparse.ArgumentError as error:  # a flag without its value
            if not (self.collects and action.option_strings):
                raise
            self._problems.append(self._reworded(str(error)))
            self._missing.add(id(action))
            return 0

    def _get_values(self, action, arg_strings):
        if id(action) in self._missing and not arg_strings:
            self._missing.discard(id(action))
            return _INVALID
        try:
            return super()._get_values(action, arg_strings)
        except argparse.ArgumentError as error:  # a value that does not parse, or is refused
            if not (self.collects and action.option_strings):
                raise
            self._problems.append(self._reworded(str(error)))
            return _INVALID

    # ---- unknown flags

    def _innermost(self, parsed: argparse.Namespace) -> CommandParser:
        """The parser of the command the user chose (`ptdp tokenizer train`'s, say)."""
        parser = self
        while (commands := _subcommands(parser)) is not None:
            chosen = getattr(parsed, commands.dest, None)
            if not isinstance(commands.choices.get(chosen), CommandParser):
                break
            parser = commands.choices[chosen]
        return parser

    def _unknown_flags(self, tokens: Sequence[str]) -> list[str]:
        """The tokens that look like flags this parser does not take."""
        known = self._option_string_actions
        unknown = []
        for token in tokens:
            if token == "--":
                break
            name = token.split("=", 1)[0]
            if (not _is_flag(token) or name in known
                    or (not name.startswith("--") and name[:2] in known)  # -t2: -t with its value
                    or (self.allow_abbrev and name.startswith("--")
                        and any(option.startswith(name) for option in known))):
                continue
            unknown.append(token)
        return unknown

    def _unrecognized(self, extras: list[str]) -> str:
        known = [name for action in self._actions for name in action.option_strings]
        paths = [name for action in self._actions for name in action.option_strings
                 if isinstance(action.metavar, str) and action.metavar.startswith(_PATH_METAVARS)]
        flags, strays, after_flag = [], [], False
        for token in extras:
            if _is_flag(token):
                name = token.split("=", 1)[0]
                reason = next((why for flag, why in self.not_taken.items()
                               if name == flag or flag.endswith("-") and name.startswith(flag)), None)
                if reason is not None:
                    return f"{name}: {reason}"
                flags.append(name + did_you_mean(name, known, paths))
                after_flag = "=" not in token
            elif after_flag:  # most likely the unknown flag's value: not worth a word
                after_flag = False
            else:
                strays.append(token)
        parts = []
        if flags:
            parts.append(f"unrecognized flag{'s' * (len(flags) > 1)} {', '.join(flags)}")
        if strays:
            parts.append(f"unexpected argument{'s' * (len(strays) > 1)} {' '.join(strays)}")
        message = "; ".join(parts)
        if "did you mean" not in message:
            message += f" ({self.prog} --help lists what it takes)"
        return message

    # ---- invalid values

    def _check_value(self, action: argparse.Action, value) -> None:
        """An invalid choice names the flag, the value and the choices, without
        quotes; a value of Megatron-LM's that ptdp refuses (an action's
        `refused_values`, ptdp.config.megatron) says why."""
        refused = getattr(action, "refused_values", {})
        if value in refused:
            raise argparse.ArgumentError(None, f"{_long_name(action.option_strings)} {value}: "
                                               f"{refused[value]}")
        if action.choices is None or value in action.choices:
            return
        choices = ", ".join(map(str, action.choices))
        if isinstance(action, argparse._SubParsersAction):
            message = (f"unknown command {value}{did_you_mean(str(value), list(action.choices))}; "
                       f"choose from {choices}")
        else:
            message = f"{_long_name(action.option_strings) or action.dest} {value}: choose from {choices}"
        raise argparse.ArgumentError(None, message)

    def _reworded(self, message: str) -> str:
        """argparse's 'argument -p/--pipeline-model-parallel-size: expected one
        argument' and its kin, said with the flag first."""
        if message.startswith("the following arguments are required: "):
            commands = _subcommands(self)
            if commands is not None and commands.metavar in message.split(": ", 1)[1].split(", "):
                return (f"give a command: {', '.join(commands.choices)} "
                        f"({self.prog} --help says what each does)")
            return message
        match = _ARGUMENT.fullmatch(message)
        if match is None:
            return message
        names, rest = match["names"].split("/"), match["rest"]
        flag = _long_name(names) or names[0]
        action = self._option_string_actions.get(flag)
        metavar = (action.metavar or action.dest.upper()) if action is not None else "VALUE"
        if isinstance(metavar, tuple):
            metavar = " ".join(metavar)
        if rest == "expected one argument":
            if action is not None and action.choices is not None:
                return f"{flag} needs a value: choose from {', '.join(map(str, action.choices))}"
            return f"{flag} needs a value: {flag} {metavar}"
        if rest == "expected at least one argument":
            return f"{flag} needs at least one value: {flag} {metavar} [{metavar} ...]"
        invalid = _INVALID_VALUE.fullmatch(rest)
        if invalid is not None:
            value = invalid["value"]
            value = value[1:-1] if len(value) >= 2 and value[0] == value[-1] == "'" else value
            what = _TYPE_WORDS.get(invalid["type"], f"not a valid {invalid['type']}")
            return f"{flag} {value or repr('')}: {what}"
        if rest.startswith("ignored explicit argument "):
            return f"{flag} takes no value (given {rest.removeprefix('ignored explicit argument ')})"
        return f"{flag}: {rest}"


def problems_text(problems: Sequence[str]) -> str:
    """One problem as it is; several as a list, one a line."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {problem}" for problem in problems)


def _long_name(option_strings: Sequence[str]) -> str | None:
    return next((name for name in option_strings if name.startswith("--")), None)


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((action for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), None)

