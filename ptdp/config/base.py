"""What every section of the configuration shares: the field that is also a
command-line flag, the error that lists every invalid setting, and the small
arithmetic and type tests of the sections' checks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

from ptdp.errors import UserError


def flag(default: Any, name: str, help: str, **extra: Any) -> Any:
    """A dataclass field that is also the command-line flag `name`."""
    return field(default=default, metadata={"flag": name, "help": help, **extra})


def flag_in(section: Any, name: str) -> str:
    """The flag of field `name` of a section (its dataclass or an instance)."""
    for f in dataclasses.fields(section):
        if f.name == name:
            return f.metadata["flag"]
    raise KeyError(f"{getattr(section, '__name__', type(section).__name__)}.{name}")


class ConfigError(UserError, ValueError):
    """One or more invalid settings; the message lists each with a fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def divisors(n: int) -> list[int]:
    """n's divisors, ascending; pairs up to sqrt(n), so a huge n (an expert
    count of 10**9 given by mistake) is checked in milliseconds."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0] if n >= 1 else []
    return small + [n // k for k in reversed(small) if k * k != n]


def nearest_multiple(value: int, multiple: int) -> int:
    """The multiple of `multiple` closest to `value` (at least `multiple`)."""
    return max(multiple, round(value / multiple) * multiple)


def is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def finite_or_none(*values: Any) -> bool:
    """Whether each value is a finite number or None. Every float setting that
    is not a finite number is reported once, as such (checks._float_problems);
    the range checks look only at the settings that pass this."""
    return all(value is None or is_finite_number(value) for value in values)


def positive_integer_problems(section: Any, names: tuple[str, ...],
                              optional: tuple[str, ...] = ()) -> list[str]:
    """`FLAG=value must be a positive integer` for each field of `names` that is
    not one; None is fine for the `optional` ones (not given)."""
    problems = []
    for name in names:
        value = getattr(section, name)
        if value is None and name in optional:
            continue
        if not is_count(value, 1):
            problems.append(f"{flag_in(section, name)}={value!r} must be a positive integer")
    return problems
