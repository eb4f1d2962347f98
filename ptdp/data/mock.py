"""Generated training data: learnable sequences for runs without a corpus.

Sample i is a short random pattern of tokens repeated to fill the sequence.
Tokens are drawn from a skewed distribution (so a model first learns their
frequencies) and the repetition rewards attending to earlier positions (so
the loss keeps falling after that). Each sample depends only on (seed, i),
never on the layout, so every layout trains on the same batches.
"""

from __future__ import annotations

import torch

from ptdp.parallel.sharding import name_seed


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int, max_period: int = 16):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.max_period = max_period

    def __getitem__(self, index: int) -> torch.Tensor:
        """Tokens [seq_length + 1]: inputs are [:-1], labels [1:]."""
        generator = torch.Generator().manual_seed(name_seed(self.seed, f"mock/{index}"))
        period = int(torch.randint(2, self.max_period + 1, (1,), generator=generator))
        skewed = torch.rand(period, generator=generator) ** 3
        pattern = (skewed * self.vocab_size).long().clamp(max=self.vocab_size - 1)
        return pattern.repeat(self.seq_length // period + 2)[: self.seq_length + 1]
