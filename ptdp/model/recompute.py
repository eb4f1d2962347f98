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
  selective:      the --recompute-modules parts of each layer (Megatron-LM's
      names; ptdp.config.recompute): by default only the attention core
      (softmax(QKᵀ)·V with its dropout), whose activations grow with s² but
      cost few FLOPs to recompute. core_attn, mlp, moe and shared_experts
      are `checkpoint`ed; layernorm, moe_act and mla_up_proj use
      `recompute_discarding` (Megatron-Core's output-discarding checkpoint):
      their outputs, which the next operation keeps for its backward, are
      freed after it and refilled just before its backward.
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


def recompute_discarding(function: Callable[..., Any], rng: RNGStreams,
                         consumer: Callable[[Any], Any], *args: Any) -> Any:
    """consumer(function(*args)) without keeping function's outputs: the
    consumer saves them for its backward, so once it has run their storage
    is freed, and right before the consumer's backward (a hook on its first
    output that requires a gradient) `function` runs again, without
    gradients, into that storage. `function`'s own backward recomputes it
    through `checkpoint`. For functions that draw no random numbers (norms,
    activations, projections): the refill replays the named streams only.

    Inside a recomputation (rng.replaying) nothing is discarded: the
    recomputed graph is never run backward, so no hook would refill it."""
    outputs = checkpoint(function, rng, *args)
    result = consumer(outputs)
    if rng.replaying:
        return result
    produced = [t for t in (outputs if isinstance(outputs, tuple) else (outputs,))
                if isinstance(t, torch.Tensor)]
    inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    # Distinct storages, none an input's (a view of an input must stay):
    # {data_ptr: (index of the first output on it, its storage, its bytes)}.
    storages: dict[int, tuple[int, Any, int]] = {}
    for index, tensor in enumerate(produced):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in inputs:
            storages.setdefault(storage.data_ptr(), (index, storage, storage.nbytes()))
    hook_on = next((t for t in (result if isinstance(result, tuple) else (result,))
                    if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if hook_on is None or not storages:
        return result
    saved = {name: state.clone() for name, state in rng.states.items()}

    def refill(grad: torch.Tensor) -> None:
        with torch.no_grad(), _ReplayedStreams(rng, saved):
            again = function(*args)
        again = [t for t in (again if isinstance(again, tuple) else (again,))
                 if isinstance(t, torch.Tensor)]
        for index, storage, nbytes in storages.values():
            # The storage's own copy: the saved tensors' version counters
            # stay as they were.
            storage.resize_(nbytes)
            storage.copy_(again[index].untyped_storage())

    for _, storage, _ in storages.values():
        storage.resize_(0)
    # Nested discards may hang on one tensor (--recompute-modules layernorm
    # around mla_up_proj, whose input is the discarded norm output): the
    # outer one, registered last, must refill first, so one hook runs the
    # refills newest first.
    refills = getattr(hook_on, "_ptdp_refills", None)
    if refills is None:
        refills = hook_on._ptdp_refills = []

        def refill_all(grad: torch.Tensor) -> None:
            for each in refills:
                each(grad)
        hook_on.register_hook(refill_all)
    refills.insert(0, refill)
    return result


def recompute_active(module: torch.nn.Module) -> bool:
    """Recomputation only saves memory for a graph backward will use: in
    training mode with gradients enabled. Elsewhere the plain forward runs."""
    return module.training and torch.is_grad_enabled()
