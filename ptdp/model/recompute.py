"""Activation recomputation (the paper's "activation recomputation", with
Megatron-LM's granularities).

`checkpoint(function, rng, *args)` runs `function(*args)` keeping only its
tensor inputs for backward; the backward pass runs the function again to
rebuild the activations it needs. The recomputed forward must draw the same
dropout masks as the original one, from both random streams of `RNGStreams`:

* the replicated stream (the device's default generator) is stashed and
  restored by torch.utils.checkpoint itself (`preserve_rng_state=True`);
* the per-tensor-rank streams (`rng.states`, e.g. "tensor") are copied here
  when the checkpointed forward starts, swapped in for the recomputation and
  swapped out again afterwards, so the recomputation neither advances nor
  disturbs the live streams.

Built on the non-reentrant checkpoint (`use_reentrant=False`), whose
`context_fn` gives the recomputation its own context (torch >= 2.1).

Which regions are checkpointed (ptdp.model.gpt):
  full + uniform: consecutive groups of `recompute_num_layers` layers, one
      checkpoint per group (the last group may be shorter);
  full + block:   the first `recompute_num_layers` layers of each model chunk,
      each checkpointed on its own; the other layers run normally;
  selective:      only the attention core (softmax(QKᵀ)·V with its dropout),
      whose activations grow with s² but cost few FLOPs to recompute.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from ptdp.parallel.tensor import RNGStreams


class _ReplayedStreams:
    """Context for the recomputation: `rng`'s named streams are set to a
    fresh copy of `saved` inside, and the live streams are put back on exit.
    The dict is updated in place, so every holder of `rng` sees the swap.
    Reusable: a graph kept with retain_graph may be recomputed again."""

    def __init__(self, rng: RNGStreams, saved: dict[str, torch.Tensor]):
        self.rng, self.saved = rng, saved
        self.live: list[dict[str, torch.Tensor]] = []

    def __enter__(self) -> None:
        states = self.rng.states
        self.live.append(dict(states))
        states.clear()
        states.update({name: state.clone() for name, state in self.saved.items()})
        # What a forward asks to know that it is a repeat (the MoE layer
        # records its balancing losses once).
        self.rng.replaying = True

    def __exit__(self, *exc_info: Any) -> None:
        states = self.rng.states
        states.clear()
        states.update(self.live.pop())
        self.rng.replaying = bool(self.live)


def checkpoint(function: Callable[..., Any], rng: RNGStreams, *args: Any) -> Any:
    """`function(*args)`, storing only the tensor arguments for backward and
    recomputing the rest there with the same dropout masks (both streams)."""
    saved = {name: state.clone() for name, state in rng.states.items()}

    def contexts():
        return contextlib.nullcontext(), _ReplayedStreams(rng, saved)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             preserve_rng_state=True, context_fn=contexts)


def recompute_active(module: torch.nn.Module) -> bool:
    """Recomputation only saves memory for a graph backward will use: in
    training mode with gradients enabled. Elsewhere the plain forward runs."""
    return module.training and torch.is_grad_enabled()
