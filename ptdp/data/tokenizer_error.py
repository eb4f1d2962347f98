"""The error every tokenizer raises for unusable files or settings (its own
module, so that the tokenizers in other modules need not import
ptdp.data.tokenizer, which builds them)."""

from ptdp.errors import UserError


class TokenizerError(UserError, ValueError):
    """A tokenizer's files or settings are unusable; says what to change."""
