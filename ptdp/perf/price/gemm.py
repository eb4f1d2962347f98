"""GEMM and fused-attention time on a GPU, from the shape (tiles, waves, bytes).

A GPU GEMM kernel (cuBLAS, CUTLASS) cuts the [m, n] output into tiles of
tile_m × tile_n; each thread block computes one tile by walking the k
dimension, and the device's SMs take the tiles in waves. So:

    tiles     = ceil(m / tile_m) · ceil(n / tile_n) · batch
    waves     = ceil(tiles / SMs)       a part-empty last wave costs a whole one
    tile time = tile_overhead + 2 · tile_m · tile_n · k / sm_rate
    sm_rate   = peak / SMs · achievable_fraction
    compute   = waves · tile time
    time      = max(compute, bytes / memory_bandwidth)

The fixed cost per tile (prologue: the first operand loads from memory
before the pipelined main loop runs; epilogue: writing the tile out) is paid
once per tile, so a large k amortises it and a small k (the attention
products, k = head dimension) does not. An edge tile is padded to the whole
tile_m × tile_n (the hardware computes it anyway), so small dimensions waste
most of a tile. The memory term is the roofline's: a GEMM whose arithmetic
intensity is below the machine balance (k = 8, say) runs at memory speed,
its operands read and its output written once. `achievable_fraction` is
what the main loop of a large tile reaches of peak (issue rate, register
and shared-memory traffic): fitted, see profiles.py.

Fused (flash) attention, causal or not: each thread block holds one block
of `block` query rows of one (batch, head) and walks the key blocks it may
see (all of them, or under a causal mask those up to its own: on average
about half), two products per key block (QKᵀ and PV, 4 · block² · d FLOPs)
at the same per-SM rate. The backward recomputes QKᵀ and forms dV, dP, dS→dQ
and dK: five products, 2.5× the forward's. Memory: forward reads q, k, v and
writes o and the fp32 logsumexp; backward reads q, k, v, o, dO and the
logsumexp (and the fp32 rowsum of dO ∘ o it computes first) and writes dq,
dk, dv. The s × s scores never reach memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Flash attention's block of query (and key) rows on A100/H100 for head
# dimensions up to 128 (flash-attention 2's forward kernel: 128 × 128 for
# d = 64 and 128 × 64 or 128 × 128 for d = 128): an assumption, not measured.
FLASH_BLOCK = 128
FLASH_BACKWARD_PRODUCTS = 5       # QKᵀ recomputed, dV = PᵀdO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀQ
LOGSUMEXP_BYTES = 4               # one fp32 per query row


@dataclass(frozen=True)
class TiledDevice:
    """What the tile model needs to know about one GPU."""
    peak_flops: float                 # FLOP/s of the whole device at this precision
    sm_count: int                     # streaming multiprocessors (tiles running at once)
    tile_m: int
    tile_n: int
    achievable_fraction: float        # of the per-SM peak that a tile's main loop reaches
    tile_overhead_seconds: float      # fixed cost per tile: prologue and epilogue
    memory_bandwidth: float           # bytes/s

    @property
    def sm_flops(self) -> float:
        """FLOP/s one SM sustains in a tile's main loop."""
        return self.peak_flops / self.sm_count * self.achievable_fraction


def waves(tiles: int, sm_count: int) -> int:
    return math.ceil(tiles / sm_count)


def gemm_compute_seconds(device: TiledDevice, m: int, n: int, k: int, batch: int = 1) -> float:
    """Tiles in waves, each tile its fixed cost plus k steps of a padded tile."""
    tiles = math.ceil(m / device.tile_m) * math.ceil(n / device.tile_n) * batch
    tile_seconds = (device.tile_overhead_seconds
                    + 2.0 * device.tile_m * device.tile_n * k / device.sm_flops)
    return waves(tiles, device.sm_count) * tile_seconds


def gemm_bytes(m: int, n: int, k: int, batch: int, bytes_per_element: int) -> float:
    """Each operand read and the output written once."""
    return batch * (m * k + k * n + m * n) * bytes_per_element


def gemm_seconds(device: TiledDevice, m: int, n: int, k: int, batch: int = 1,
                 bytes_per_element: int = 2) -> float:
    """Time of `batch` GEMMs [m, k] × [k, n] in one kernel (no launch overhead)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    return max(gemm_compute_seconds(device, m, n, k, batch),
               gemm_bytes(m, n, k, batch, bytes_per_element) / device.memory_bandwidth)


def gemm_efficiency(device: TiledDevice, m: int, n: int, k: int, batch: int = 1,
                    bytes_per_element: int = 2) -> float:
    """Achieved FLOP/s over peak."""
    seconds = gemm_seconds(device, m, n, k, batch, bytes_per_element)
    return 2.0 * m * n * k * batch / seconds / device.peak_flops if seconds > 0 else 0.0


def key_blocks_per_query_block(s: int, causal: bool, block: int = FLASH_BLOCK) -> float:
    """Mean key blocks a query block visits: all of them, or under a causal
    mask block i sees blocks 0..i (the mean of 1..q, (q + 1) / 2)."""
    blocks = math.ceil(s / block)
    return (blocks + 1) / 2 if causal else blocks


def attention_seconds(device: TiledDevice, batch_heads: int, s: int, head_dim: int, *,
                      causal: bool = True, bytes_per_element: int = 2,
                      block: int = FLASH_BLOCK) -> tuple[float, float]:
    """(forward, backward) seconds of fused attention over `batch_heads`
    (batch · heads) sequences of length s with head dimension `head_dim`."""
    if batch_heads <= 0 or s <= 0 or head_dim <= 0:
        return 0.0, 0.0
    thread_blocks = math.ceil(s / block) * batch_heads
    visits = key_blocks_per_query_block(s, causal, block)
    pair_flops = 4.0 * block * block * head_dim           # QKᵀ and PV of one block pair
    forward_block = device.tile_overhead_seconds + visits * pair_flops / device.sm_flops
    backward_block = (device.tile_overhead_seconds
                      + visits * pair_flops * FLASH_BACKWARD_PRODUCTS / 2 / device.sm_flops)
    rounds = waves(thread_blocks, device.sm_count)
    vector = batch_heads * s * head_dim * bytes_per_element           # one of q, k, v, o, ...
    rows = batch_heads * s * LOGSUMEXP_BYTES
    forward_bytes = 4 * vector + rows                                 # q, k, v in; o, lse out
    backward_bytes = 8 * vector + 2 * rows      # q, k, v, o, dO, lse, rowsum in; dq, dk, dv out
    return (max(rounds * forward_block, forward_bytes / device.memory_bandwidth),
            max(rounds * backward_block, backward_bytes / device.memory_bandwidth))
