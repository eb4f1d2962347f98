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
