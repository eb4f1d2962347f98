"""The one place that knows about CUDA versus CPU.

Everything else asks this module for the device, the collective backend, the
random-number state of the device and whether fused kernels can be compiled.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from ptdp.plural import plural


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_kind(requested: str, local_world_size: int) -> str:
    """'cpu' or 'cuda' for a job with `local_world_size` processes on this host."""
    if requested == "cpu":
        return "cpu"
    count = cuda_device_count()
    if requested == "cuda":
        if count < local_world_size:
            raise RuntimeError(
                f"--device cuda needs one GPU per local process: "
                f"{plural(local_world_size, 'process')}, {plural(count, 'GPU')} visible; use "
                f"--device cpu or fewer processes")
        return "cuda"
    return "cuda" if count >= local_world_size > 0 else "cpu"


def backend_for(kind: str) -> str:
    return "nccl" if kind == "cuda" else "gloo"


def device_for(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def configure_threads(kind: str, local_world_size: int) -> None:
    """Share the host's cores among the local processes (CPU mode); more
    threads than cores makes every rank slower on a small machine."""
    if kind == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def configure_matmul(kind: str, exact_bf16_reductions: bool) -> None:
    """--disable-bf16-reduced-precision-matmul: cuBLAS's bf16 products
    reduce in full precision (PyTorch allows reduced precision by default)."""
    if kind == "cuda" and exact_bf16_reductions:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int, device: torch.device) -> None:
    """Seed the generator that dropout on `device` draws from."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def can_compile_kernels(device: torch.device) -> bool:
    """torch.compile fuses element-wise kernels well on GPUs (Triton). On CPU
    its C++ compile time dominates the short runs this project makes there,
    so nothing is compiled: the layers add their biases in the matrix
    products instead (see ptdp.parallel.tensor.defers_bias). Asked per layer
    call, so the answer about Triton is cached."""
    return device.type == "cuda" and hasattr(torch, "compile") and _triton_available()


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """The accelerator's model name (to look up its peak), or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def accelerator_shape(device: torch.device) -> tuple[int, int]:
    """(streaming multiprocessors, memory bytes) of a CUDA device."""
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.total_memory


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """This process's peak memory so far, in bytes, as (peak, reserved).
    On CUDA: the most the caching allocator held in tensors at once
    (torch.cuda.max_memory_allocated, Megatron-LM's mem-max-allocated-bytes)
    and the most it reserved from the driver. On CPU: the peak resident set
    size of the process (tensors, the interpreter and its libraries, pages
    shared with the process it was forked from), and None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return peak_resident_bytes(), None


def peak_resident_bytes() -> int:
    """getrusage's ru_maxrss of this process in bytes: Linux and the BSDs
    count it in KiB, macOS in bytes."""
    import resource  # POSIX only; imported here so that importing ptdp does not need it

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def release_cached_memory(device: torch.device) -> None:
    """Return the caching allocator's unused blocks to the driver
    (--empty-unused-memory-level); nothing to do on CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cuda_profiler_start() -> None:
    """Open the capture range of `nsys profile --capture-range=cudaProfilerApi`."""
    torch.cuda.profiler.start()


def cuda_profiler_stop() -> None:
    torch.cuda.profiler.stop()
