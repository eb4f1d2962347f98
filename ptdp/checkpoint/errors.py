"""The error a checkpoint that cannot be used raises."""

from ptdp.errors import UserError


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used; says what is wrong and what to do."""
