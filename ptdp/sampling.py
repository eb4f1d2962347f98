"""Token sampling: the pure core of `ptdp generate`.

`sample_next` turns one position's logits into token ids: temperature 0 is
greedy (argmax); otherwise the logits are divided by the temperature, cut to
the `top_k` largest (0: all), then to the nucleus (the smallest set of the
most probable tokens whose probability reaches `top_p`, renormalised after
the top-k cut; always at least one token), and a token is drawn from what is
left. `generate` runs the autoregressive loop around any `next_logits`
function, without a KV cache: each step recomputes the (cropped) context.
Sampling happens in fp32 on the CPU with a generator seeded from
`SamplingSettings.seed`, so the same logits give the same tokens on any
device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: `ptdp generate --help` and the other
# commands' start-up read SamplingSettings without it.


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError listing every invalid setting, by flag name."""
        problems = []
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            problems.append(f"--temperature={self.temperature!r} must be >= 0 (0: greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            problems.append(f"--top-k={self.top_k!r} must be an integer >= 0 (0: no top-k cut)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            problems.append(f"--top-p={self.top_p!r} must be in (0, 1] (1: no nucleus cut)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            problems.append(f"--max-new-tokens={self.max_new_tokens!r} must be a positive integer")
        if not _is_int(self.seed):
            problems.append(f"--seed={self.seed!r} must be an integer")
        if problems:
            raise ValueError("invalid sampling settings:\n"
                             + "\n".join(f"  - {p}" for p in problems))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def filter_logits(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """fp32 logits [b, V] after temperature, top-k and top-p: removed tokens
    are -inf. Needs temperature > 0."""
    import torch

    logits = logits.float() / settings.temperature
    vocab = logits.shape[-1]
    if 0 < settings.top_k < vocab:
        # Exactly k tokens per row, even with ties at the k-th value.
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, logits.topk(settings.top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if settings.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Probability of the more likely tokens; 0 < top_p for the first, so
        # the most likely token always stays.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= settings.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, settings: SamplingSettings,
                generator: torch.Generator) -> torch.Tensor:
    """Token ids [b] (int64) from logits [b, V] (unpadded: padding columns
    removed or -inf)."""
    import torch

    settings.validate()
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, settings).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(next_logits: Callable[[torch.Tensor], torch.Tensor], prompt: list[int],
             settings: SamplingSettings, *, max_context: int, eod: int | None = None,
             stop: Collection[int] = ()) -> list[int]:
    """Sample up to `settings.max_new_tokens` tokens after `prompt`.

    `next_logits(tokens)` gets int64 tokens [1, s] on the CPU (the last
    `max_context` tokens so far) and returns the logits of the last position,
    [1, V] or [V], unpadded. Stops after `eod` when given, or after any token
    of `stop` (a chat model's ends of turn); returns the new tokens only,
    without the one it stopped at.
    """
    import torch

    settings.validate()
    if not _is_int(max_context) or max_context < 1:
        raise ValueError(f"max_context={max_context!r} must be a positive integer")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    generator = torch.Generator().manual_seed(settings.seed)
    stops = set(stop) | ({eod} if eod is not None else set())
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(settings.max_new_tokens):
        context = torch.tensor([tokens[-max_context:]], dtype=torch.long)
        logits = next_logits(context).detach()
        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
        if logits.dim() != 2 or logits.shape[0] != 1:
            raise ValueError(f"next_logits must return logits [1, vocab], got shape "
                             f"{tuple(logits.shape)}")
        token = int(sample_next(logits.float().cpu(), settings, generator)[0])
        if token in stops:
            break
        tokens.append(token)
        new.append(token)
    return new
