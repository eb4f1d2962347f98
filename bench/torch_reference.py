"""The same GPT written the way a PyTorch user would write it, for the peer
benchmarks: nn.Linear / nn.Embedding / nn.LayerNorm, batch-first [b, s, h]
activations, separate query/key/value projections (so DTensor's
ColwiseParallel can split them by heads), F.cross_entropy.

It is loaded with ptdp's logical weights (`load_logical`), so both sides
start from the same numbers and must produce the same losses before their
times are compared. Like ptdp's GPT it can be one pipeline stage: it holds
only the layers it is given, the embeddings on the first stage, the final
LayerNorm and the output layer (tied to the word embedding) on the last.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a share of them.
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.ln_1, self.ln_2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.attn = Attention(h, config.num_attention_heads)
        self.fc, self.out = nn.Linear(h, config.ffn_size), nn.Linear(config.ffn_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class TiedOutput(nn.Module):
    """logits = x · Eᵀ with the word embedding E of this stage, or a copy of
    it on a last stage that has no embedding (kept equal by summing the two
    copies' gradients, as the user of a pipelined tied model must)."""

    def __init__(self, weight: nn.Parameter | None, vocab: int, h: int):
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.empty(vocab, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TorchGPT(nn.Module):
    def __init__(self, config: ModelConfig, layer_ids: Sequence[int] | None = None, *,
                 pre_process: bool = True, post_process: bool = True):
        super().__init__()
        self.layer_ids = list(range(config.num_layers) if layer_ids is None else layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        h, vocab = config.hidden_size, config.vocab_size
        if pre_process:
            self.tok_embeddings = nn.Embedding(vocab, h)
            self.pos_embeddings = nn.Embedding(config.max_positions, h)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in self.layer_ids})
        if post_process:
            self.norm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
            self.output = TiedOutput(self.tok_embeddings.weight if pre_process else None, vocab, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: tokens [b, s]; otherwise hidden [b, s, h]. Returns
        hidden [b, s, h], or logits [b, s, V] on the last stage."""
        if self.pre_process:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_embeddings(x) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            x = layer(x)
        if self.post_process:
            x = self.output(self.norm(x))
        return x

    def tied_weights(self) -> list[torch.Tensor]:
        """This stage's copies of the word embedding (one or two)."""
        found = []
        if self.pre_process:
            found.append(self.tok_embeddings.weight)
        if self.post_process and not self.pre_process:
            found.append(self.output.weight)
        return found


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss over the tokens of logits [b, s, V] and labels [b, s]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _ptdp_names(layer: int) -> dict[str, str]:
    prefix = f"layers.{layer}."
    pairs = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
             "attn.proj": "attention.dense", "fc": "mlp.dense_h_to_4h", "out": "mlp.dense_4h_to_h"}
    names = {}
    for mine, theirs in pairs.items():
        for kind in ("weight", "bias"):
            names[f"{prefix}{mine}.{kind}"] = f"{prefix}{theirs}.{kind}"
    return names


@torch.no_grad()
def load_logical(model: TorchGPT, logical: dict[str, torch.Tensor]) -> TorchGPT:
    """Copy ptdp's logical (unsharded) parameters, as named by a one-process
    ptdp GPT's state_dict, into `model` (plain tensors, before any
    parallelisation)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    wanted: dict[str, torch.Tensor] = {}
    if model.pre_process:
        wanted["tok_embeddings.weight"] = logical["embedding.word_embeddings.weight"]
        wanted["pos_embeddings.weight"] = logical["embedding.position_embeddings.weight"]
    if model.post_process:
        wanted["norm.weight"] = logical["final_layernorm.weight"]
        wanted["norm.bias"] = logical["final_layernorm.bias"]
        wanted["output.weight"] = logical["embedding.word_embeddings.weight"]
    for i in model.layer_ids:
        for mine, theirs in _ptdp_names(i).items():
            wanted[mine] = logical[theirs]
        for kind in ("weight", "bias"):
            # ptdp's fused projection holds [query; key; value] along its output dimension.
            q, k, v = logical[f"layers.{i}.attention.query_key_value.{kind}"].chunk(3, dim=0)
            for name, part in (("query", q), ("key", k), ("value", v)):
                wanted[f"layers.{i}.attn.{name}.{kind}"] = part
    missing = sorted(set(own) - set(wanted))
    if missing:
        raise KeyError(f"no ptdp weight for {missing}")
    for name, value in wanted.items():
        own[name].copy_(value)
    return model
