"""What each side of bench/peers.py holds in tensors, and the peak of its
tensors during a step, measured inside one process that runs both sides.

The process's peak RSS is shared by both sides (and by gloo's buffers, the
Python heap, the allocator's cache), and on CPU torch keeps no allocator
statistics (torch.cuda.max_memory_allocated has no CPU counterpart). So each
side's memory is measured from its own tensors:

- held: the bytes of the distinct storages of its parameters, gradients and
  optimizer state after a step (a DTensor counted by its local shard, a view
  by the storage it lives in, so FSDP2's padded shards and ptdp's flat
  buffers count as allocated);
- step peak: the most bytes of tensor storage alive at once during one
  training step (forward, backward, gradient reduction, optimizer step),
  counted by `StepPeak` from the held storages at the step's start plus
  every storage an operation creates during the step, each counted until it
  is freed; FSDP2's gathered parameters, whose storages it resizes in place
  (UntypedStorage.resize_, which no dispatch mode sees), are counted through
  resize_ as well. Not counted: memory outside torch tensors (gloo's own
  buffers, Python objects), and tensors from before the step that are not
  part of the held state (they only make both peaks slightly low).
"""

from __future__ import annotations

import weakref
from functools import wraps
from typing import Iterable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.UntypedStorage]:
    found = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        found[id(storage)] = storage
    return found


def held_bytes(categories: dict[str, list[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes per category (params, grads, optimizer) and in total, each
    storage counted once, in the first category that names it."""
    seen: dict[int, torch.UntypedStorage] = {}
    result = {}
    for name, tensors in categories.items():
        new = {key: st for key, st in _storages(tensors).items() if key not in seen}
        seen.update(new)
        result[name] = sum(st.nbytes() for st in new.values())
    result["total"] = sum(st.nbytes() for st in seen.values())
    return result


def ptdp_state(trainer) -> dict[str, list[torch.Tensor | None]]:
    """ptdp's parameters (the flat param_data buffer), gradients (the full
    buffer under no_shard/optim, the shard under optim_grads, and any bucket
    still holding full gradients: the tied embedding's) and optimizer state
    (fp32 main weights where they are a copy, Adam's moments)."""
    buffer, optimizer = trainer.buffer, trainer.optimizer
    params = [buffer.param_data] + list(trainer.model.parameters())
    grads = [buffer.grad_data, buffer.grad_shard] + [bucket.grads for bucket in buffer.buckets]
    return {"params": params, "grads": grads,
            "optimizer": [optimizer.main, optimizer.exp_avg, optimizer.exp_avg_sq]}


def torch_state(modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer
                ) -> dict[str, list[torch.Tensor | None]]:
    """PyTorch's parameters and gradients (FSDP2's: the local shards of its
    sharded DTensors) and torch.optim.AdamW's state."""
    params = [p for module in modules for p in module.parameters()]
    state = [value for per_param in optimizer.state.values() for value in per_param.values()
             if isinstance(value, torch.Tensor)]
    return {"params": params, "grads": [p.grad for p in params], "optimizer": state}


class StepPeak(TorchDispatchMode):
    """Counts live tensor storage during a step; `peak` the most bytes at
    once. Start it with the storages the side holds (`held`)."""

    def __init__(self, held: Iterable[torch.Tensor | None]):
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = self.peak = 0
        for storage in _storages(held).values():
            self._add(storage)
        self.start = self.peak = self.current
        self._resize = None

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        self.live[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)), nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.live:
            ref, nbytes = self.live[key]
            self.live[key] = (ref, storage.nbytes())
            self.current += storage.nbytes() - nbytes
            self.peak = max(self.peak, self.current)
        elif storage.nbytes():
            self._add(storage)  # FSDP2's gathered parameters: storage freed (size 0) until then

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_

        @wraps(original)
        def resize_(storage, size):
            result = original(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # let DTensor run its local operations, seen here next
        result = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for out in tree_flatten(result)[0]:
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                storage = out.untyped_storage()
                # A view or in-place result lives in an input's storage: nothing new.
                if id(storage) not in inputs and id(storage) not in self.live:
                    self._add(storage)
        return result


def measured_step(step, held_before) -> tuple[object, dict[str, int]]:
    """Run `step()` under StepPeak; its result and the bytes: the state held
    at the start, the peak during the step (both over this process's
    tensors of this side)."""
    with StepPeak(held_before()) as tracker:
        result = step()
    return result, {"start": tracker.start, "peak": tracker.peak}


def measure_sides(ours, theirs, iteration: int, losses: dict) -> dict:
    """bench/peers.py's memory step: one more step of ptdp's Trainer `ours`
    and of PyTorch's side `theirs` (None: none), untimed (the counting slows
    it), each loss appended to `losses` for the comparison; per side the
    bytes it holds after the step (held_bytes) and its StepPeak."""
    def flat(categories):
        return [t for tensors in categories.values() for t in tensors]

    def ours_state():
        return ptdp_state(ours)

    def theirs_state():
        return torch_state([m for _, m in theirs.modules], theirs.optimizer)

    memory = {}
    for side, step, state in (("ours", lambda: ours.step(iteration)[0]["loss"], ours_state),
                              ("theirs", lambda: theirs.step(iteration), theirs_state)):
        if side == "theirs" and theirs is None:
            break
        dist.barrier()
        loss, peak = measured_step(step, lambda: flat(state()))
        losses[side].append(loss)
        memory[side] = {**held_bytes(state()), **peak}
    if getattr(ours.buffer, "peak_full_grad_bytes", None) is not None:
        memory["ours"]["peak_full_grad_bytes"] = ours.buffer.peak_full_grad_bytes
    return memory
