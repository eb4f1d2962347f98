"""Activation memory as autograd holds it: the bytes of the distinct storages
that a forward pass saves for its backward.

    with SavedTensorBytes(model.parameters()) as saved:
        loss = model(tokens, labels)
    saved.bytes            # what the backward will need, parameters excluded

Storages are counted once however many saved tensors view them (q, k and v
are views of one projection output), and the parameters' own storages are
left out: they live whether or not a backward follows. Tensors that
non-reentrant checkpointing keeps behind its own inner hooks are counted as
what really stays stored: the checkpointed region's inputs. This is the
measurement the analytic activation model (ptdp.perf.analytic.counts) is checked
against, in tests and in bench/memory.py.
"""

from __future__ import annotations

from typing import Iterable

import torch


class SavedTensorBytes:
    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._hooks.__exit__(*exc_info)

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class HeldTensorBytes(SavedTensorBytes):
    """SavedTensorBytes counted when the forward has returned (on leaving
    the context) instead of when each tensor is saved: the storages still
    alive then, at their size then — what the backward will find. The
    output-discarding recomputation (ptdp.model.recompute.recompute_discarding:
    --recompute-modules layernorm, moe_act, mla_up_proj) frees storages
    after they were saved, and a node dropped during the forward (a
    branch whose result no gradient needs) frees what it saved; storages are
    followed by weak references, so none is kept alive by the counting."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        super().__init__(parameters)
        self._weak: list[int] = []
        self.held_bytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._weak.append(tensor.untyped_storage()._weak_ref())
        return super()._pack(tensor)

    def __exit__(self, *exc_info) -> None:
        super().__exit__(*exc_info)
        at_end: dict[int, int] = {}
        for ref in self._weak:
            if not torch.UntypedStorage._expired(ref):
                storage = torch.UntypedStorage._new_with_weak_ptr(ref)
                at_end[storage.data_ptr()] = storage.nbytes()
            torch.UntypedStorage._free_weak_ref(ref)
        self._weak = []
        self.held_bytes = sum(nbytes for ptr, nbytes in at_end.items()
                              if ptr and ptr not in self._excluded)
