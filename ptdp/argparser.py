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


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """' (did you mean --swiglu?)' for the closest of `known`, or ''. One
    guess: a second one is rarely what was meant and makes the line long."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


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
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # The tokens that reached no parser: blame the (sub)command they were given to.
            command = self._innermost(parsed)
            command.error(command._unrecognized(extras))
        return parsed

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
        flags, strays, after_flag = [], [], False
        for token in extras:
            if _is_flag(token):
                name = token.split("=", 1)[0]
                reason = next((why for flag, why in self.not_taken.items()
                               if name == flag or flag.endswith("-") and name.startswith(flag)), None)
                if reason is not None:
                    return f"{name}: {reason}"
                flags.append(name + did_you_mean(name, known))
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
        """An invalid choice names the flag, the value and the choices, without quotes."""
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


def _long_name(option_strings: Sequence[str]) -> str | None:
    return next((name for name in option_strings if name.startswith("--")), None)


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((action for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), None)

