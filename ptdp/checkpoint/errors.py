"""The error a checkpoint that cannot be used raises."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; says what is wrong and what to do."""
