"""Signal names as --exit-signal gives them (SIGUSR2, USR2 or usr2), and the
signals a run cannot take as its graceful-exit signal. The training loop, the
data workers and the launcher read the name with `signal_from_name`."""

from __future__ import annotations

from typing import Any


def signal_from_name(name: str):
    """SIGUSR2, USR2 or usr2 -> signal.SIGUSR2 (KeyError if this platform has none)."""
    import signal

    upper = name.strip().upper()
    return signal.Signals[upper if upper.startswith("SIG") else "SIG" + upper]


# Signals a run cannot use as its graceful-exit signal, and why.
_UNUSABLE_EXIT_SIGNALS = {
    "SIGKILL": "no process can catch SIGKILL",
    "SIGSTOP": "no process can catch SIGSTOP",
    "SIGINT": "Ctrl-C (SIGINT) stops a run at once by design, without saving",
    "SIGCHLD": "SIGCHLD arrives whenever a child process ends, so every rank's exit would stop the run",
    "SIGSEGV": "SIGSEGV reports a crash of the process itself, not a request to stop",
    "SIGBUS": "SIGBUS reports a crash of the process itself, not a request to stop",
    "SIGFPE": "SIGFPE reports a crash of the process itself, not a request to stop",
    "SIGILL": "SIGILL reports a crash of the process itself, not a request to stop",
    "SIGABRT": "SIGABRT reports a crash of the process itself, not a request to stop",
}


def exit_signal_problem(name: Any) -> str | None:
    """None if --exit-signal names a signal that this platform has and a run
    can handle (SIGUSR2, USR2 or usr2 alike), else what is wrong."""
    import difflib
    import signal

    advice = "use e.g. SIGUSR2 (SLURM: --signal=USR2@120) or SIGTERM"
    if not isinstance(name, str) or not name.strip():
        return f"--exit-signal={name!r} must name a signal: {advice}"
    try:
        canonical = signal_from_name(name).name  # aliases: SIGCLD is SIGCHLD, SIGIOT is SIGABRT
    except KeyError:
        upper = name.strip().upper()
        close = difflib.get_close_matches(upper if upper.startswith("SIG") else "SIG" + upper,
                                          list(signal.Signals.__members__), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        return f"--exit-signal={name!r} is not a signal of this platform{hint}: {advice}"
    if canonical in _UNUSABLE_EXIT_SIGNALS:
        return (f"--exit-signal={name!r} cannot be the exit signal: "
                f"{_UNUSABLE_EXIT_SIGNALS[canonical]}; {advice}")
    return None
