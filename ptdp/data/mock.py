"""Generated training data: learnable sequences for runs without a corpus.

Each sequence walks a fixed random successor table (one table per seed):
the next token is successor[token] nine times in ten, a random token
otherwise. A model learns the table quickly, so the loss falls from log V
towards the entropy of the jumps (about 1 nat), which makes a short run
show that training works. Each sample depends only on (seed, index), never
on the layout, so every layout trains on the same batches.
"""

from __future__ import annotations

import torch

from ptdp.parallel.sharding import name_seed


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int, jump_probability: float = 0.1):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.jump_probability = jump_probability
        generator = torch.Generator().manual_seed(name_seed(seed, "mock/successor"))
        self.successor = torch.randperm(vocab_size, generator=generator).tolist()

    def __getitem__(self, index: int) -> torch.Tensor:
        """Tokens [seq_length + 1]: inputs are [:-1], labels [1:]."""
        generator = torch.Generator().manual_seed(name_seed(self.seed, f"mock/{index}"))
        length = self.seq_length + 1
        jumps = (torch.rand(length, generator=generator) < self.jump_probability).tolist()
        random_tokens = torch.randint(0, self.vocab_size, (length,), generator=generator).tolist()
        tokens = random_tokens[:1]
        for k in range(1, length):  # plain ints: a Python loop over tensors would cost ms
            tokens.append(random_tokens[k] if jumps[k] else self.successor[tokens[-1]])
        return torch.tensor(tokens, dtype=torch.long)
