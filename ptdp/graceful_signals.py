"""The signals that ask a run to save and stop (besides --exit-signal).

Their names only, in a module of their own below everything that needs
them: the training loop's handler (ptdp.train.stopping), the data loader's
worker processes, which must leave them to the rank (ptdp.data.loader), and
`ptdp train`'s supervisor, which passes them on to its ranks (ptdp.cli).
"""

# Always handled when the handler is on, besides --exit-signal.
GRACEFUL_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1")
