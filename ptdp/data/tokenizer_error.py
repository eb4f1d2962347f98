"""The error every tokenizer raises for unusable files or settings (its own
module, so that the tokenizers in other modules need not import
ptdp.data.tokenizer, which builds them)."""


class TokenizerError(ValueError):
    """A tokenizer's files or settings are unusable; says what to change."""

    # Its public name, under which ptdp.errors registers it as a user's error
    # (by name, not imported) and a pickled one is found again.
    __module__ = "ptdp.data.tokenizer"
