"""Each rank's peak memory, and the largest over the job, for the log line,
the metrics file and TensorBoard.

A rank measures its own peak (ptdp.device.peak_memory: the resident set on
CPU, the caching allocator's most allocated and most reserved on CUDA). The
job's largest, and which rank has it, travel in the small all-reduce (MAX)
every rank already makes after each iteration (StopConditions.agree), so
they cost no collective of their own: each figure is sent as one float,
`KiB × world size + rank`, whose maximum over the ranks is the largest
figure (ties: the highest rank) with its rank in the low digits. float64
holds that exactly while KiB × world size < 2**53 (8 TiB per rank on a
million ranks). A figure a device does not have (reserved memory on CPU)
is sent as -1 and comes back absent.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ptdp import device as devices

KIB = 1024
GIB = 1024 ** 3
# What the peak is on each device kind, as the metrics file names it.
MEASURES = {"cpu": "resident set size", "cuda": "allocated by tensors"}


def own_codes(device: torch.device, rank: int, world_size: int) -> tuple[float, float]:
    """This rank's (peak, reserved) as the floats the all-reduce carries."""
    peak, reserved = devices.peak_memory(device)
    return encode(peak, rank, world_size), -1.0 if reserved is None else encode(reserved, rank,
                                                                               world_size)


def encode(nbytes: int, rank: int, world_size: int) -> float:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    return float((int(nbytes) // KIB) * world_size + rank)


def decode(code: float, world_size: int) -> tuple[int, int] | None:
    """(bytes, rank) of a code the MAX all-reduce returned; None for -1."""
    if code < 0:
        return None
    kib, rank = divmod(int(code), world_size)
    return kib * KIB, rank


def job_fields(codes: Sequence[float], world_size: int, device: torch.device) -> dict[str, Any]:
    """The record's memory fields from the all-reduced (peak, reserved) codes:
    `peak_memory_gib` (the largest rank's peak), `peak_memory_rank`,
    `peak_memory_measure` (what is measured) and, on CUDA,
    `peak_reserved_memory_gib` and `peak_reserved_memory_rank`."""
    fields: dict[str, Any] = {}
    peak = decode(codes[0], world_size)
    if peak is not None:
        fields.update(peak_memory_gib=peak[0] / GIB, peak_memory_rank=peak[1],
                      peak_memory_measure=MEASURES.get(device.type, device.type))
    reserved = decode(codes[1], world_size) if len(codes) > 1 else None
    if reserved is not None:
        fields.update(peak_reserved_memory_gib=reserved[0] / GIB,
                      peak_reserved_memory_rank=reserved[1])
    return fields


def log_text(record: dict[str, Any]) -> str | None:
    """The log line's part: "peak memory 0.412 GiB (rank 3, resident set)",
    with the reserved memory on CUDA; None when the record has none."""
    if record.get("peak_memory_gib") is None:
        return None
    measure = record.get("peak_memory_measure", "")
    short = {"resident set size": "resident set", "allocated by tensors": "allocated"}.get(
        measure, measure)
    text = f"peak memory {_gib(record['peak_memory_gib'])} (rank {record['peak_memory_rank']}"
    text += f", {short})" if short else ")"
    if record.get("peak_reserved_memory_gib") is not None:
        text += (f", reserved {_gib(record['peak_reserved_memory_gib'])} "
                 f"(rank {record['peak_reserved_memory_rank']})")
    return text


def _gib(value: float) -> str:
    return f"{value:.3g} GiB"
