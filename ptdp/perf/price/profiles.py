"""Hardware profiles: what the simulator (simulate/predict.py) needs to know
about a machine.

A `HardwareProfile` describes one kind of server and its devices: peak
matrix-multiply rate, how close real GEMMs come to it, memory bandwidth for
the memory-bound operators, the two kinds of links (inside a server:
NVLink/NVSwitch or local loopback; between servers: InfiniBand), device
memory, the fixed cost of launching one operator, and for CPU profiles the
cores the local processes share. Profiles are plain JSON (`save_profile`,
`load_profile`); nothing is pickled.

GEMM time (`gemm_seconds`) on GPU profiles follows the shape (ptdp.perf.price.gemm,
docs/cost-model.md): the output in tiles of `gemm_tile` spread over the
`sm_count` SMs in waves, a part-empty last wave costing a whole one; each
tile a fixed `tile_overhead_seconds` (prologue and epilogue) plus k steps
at e_max of the per-SM peak; never faster than its bytes over
`memory_bandwidth`. So a large GEMM runs at e_max of peak, a small k
(the attention products) pays the fixed cost on little work, and small
dimensions waste padded tiles and idle SMs. With `fused_attention` the
attention core (QKᵀ, softmax, dropout, PV) is one flash-attention kernel
(`attention_seconds`), priced by the same per-SM model over blocks of
query and key rows (causal: about half the block pairs).

Built-in GPU profiles (`a100`, `h100`, `h200`) take peaks, SM counts and
bandwidths from the vendors' data sheets; the tile (128 × 128 on A100,
128 × 256 on H100/H200, the usual CUTLASS/cuBLAS tiles of those chips) and
the tile's fixed cost (1 µs: about one memory round trip to fill the
operand pipeline plus writing the tile out) are stated assumptions, not
fits. e_max is the one number fitted, to exactly one point of the paper:
the 1.7B-parameter GPT (h = 2304, a = 24, l = 24, s = 2048, V = 51200)
with t = p = 1 on 32 A100s, B = 512, b = 16 at 137 TFLOP/s per GPU (44% of
peak), end to end. The fit assumes 16-bit training with full
recomputation, whose FLOPs the paper's 96·B·s·l·h²·(...) counts.
`ptdp.perf.calibrate.calibration_point.fit_to_calibration_point()` redoes it
(bisection on e_max until `predict.simulate` predicts 137 TFLOP/s for that
run, priced with the software the paper ran,
`calibration_point.paper_kernels`: attention as explicit GEMMs
and a fused softmax over the s × s scores, not flash attention, at the
bandwidth one layer's measured kernels give them, and whole layers
recomputed):
`CALIBRATED_GEMM_EFFICIENCY`, the fraction of the per-SM peak a tile's
main loop reaches; the rest of the gap to 44% is tile overheads, wave
quantisation, the attention kernel, memory-bound operators, the gradient
all-reduce and the optimizer as simulate/predict.py prices them. Nothing else from
the paper is fitted. That fit may still carry what the 2021 software spent
beyond what the model prices (published matmul measurements put the A100's
best product at 87 % of peak, the fit at 69 %), so h100 and h200 do not borrow it:
their e_max is fitted to a measured 8192³ bf16 matmul on an H200
(`HOPPER_GEMM_EFFICIENCY`, `calibration_point.fit_to_matmul`), data of
matrix products alone, not of a training run.

CPU profiles price GEMMs as before, a roofline with a saturating
efficiency:

    work  W = 2·m·n·k·batch                         (FLOPs)
    efficiency(m, n, k) = e_max · W / (W + W0),     W0 = peak · gemm_ramp_seconds
    time  = max(W / (peak · efficiency), bytes(m, n, k) / memory_bandwidth)

(equivalently W / (e_max · peak) + gemm_ramp_seconds / e_max: a fixed fill
time per GEMM on top of the ideal time), with e_max = 1 and the ramp
measured by `ptdp calibrate`.

CPU profiles come from `ptdp calibrate` (ptdp.perf.calibrate), which measures this
machine: besides the fields above, memory-bound throughput per operator
class (`op_bandwidth`), the speed-up of each class on all cores
(`thread_speedup`, `op_thread_speedup`) and tables of measured gloo times
(`collective_seconds`). Their contention model: a local job runs `world`
processes with `threads_per_process(world)` threads each (as `ptdp train`
sets them); while k processes compute at once, each gets
min(1, available_cores / (k · threads)) of its uncontended speed (processor
sharing; `available_cores`, measured, is what of the `cores` other load
leaves).
GPU profiles have `cores = 0`: no contention.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ptdp.perf.price import gemm

GB = 1e9
GIB = 2 ** 30

# e_max of the built-in GPU profiles: calibration_point.fit_to_calibration_point() returns
# 0.6939 (bisection on e_max until predict.simulate predicts 137 TFLOP/s per GPU for the
# paper's 1.7B run on a100, with the tile model of ptdp.perf.price.gemm and the paper's kernels:
# attention as two GEMMs and a softmax pass at PAPER_ATTENTION_CORE_FRACTION, a fused Adam,
# whole layers recomputed, calibration_point.paper_kernels; the other memory-bound passes
# at ACHIEVED_HBM_FRACTION of the data sheet); rounded here. It and
# PAPER_ATTENTION_CORE_FRACTION are solved together (calibration_point.fit_paper_kernels).
# tests/test_cost_model.py recomputes both fits and checks them. They change
# whenever the operator model in pricing.py does: refit and update them then.
CALIBRATED_GEMM_EFFICIENCY = 0.6939

# e_max of the h100 and h200 profiles: not the a100 fit but a measurement of
# matrix products alone, which is not a training run's throughput. ptdp's
# bench/gpu.py timed 8192³ bf16 torch.matmul on an H200 at 685.9 and 686.4
# TFLOP/s (two sessions, 2026-12-04, bench/RESULTS.md "GPU benchmark": the
# median of 15 trials of 5 back-to-back products after warm-up, CUDA
# events); `calibration_point.fit_to_matmul` finds the e_max for which the
# tile model prices that product at their mean. The H100 SXM has the same
# GH100 compute (132 SMs, the same clocks and 989 TFLOP/s peak; published
# matmul measurements find the two the same), so both profiles use it.
# tests/test_cost_model.py recomputes it.
HOPPER_MATMUL = (8192, 686.15)            # (size of the square product, TFLOP/s measured)
HOPPER_GEMM_EFFICIENCY = 0.7227

# The flash blocks' fraction of the per-SM peak (`attention_efficiency`) on
# Hopper, by kernel: fitted to the published H100 SXM5 benchmarks of the
# FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608, figures 5 and
# 6: bf16, head dim 128, 16 heads, batch × sequence = 16k, sequences of 512
# to 16k; `calibration_point.HOPPER_ATTENTION_BENCHMARKS`), which measure
# kernels, not a training run. "flash2" is FlashAttention-2, the kernel
# PyTorch's scaled_dot_product_attention picks by default (flash before
# memory-efficient, math and cuDNN): ptdp's own runs. "cudnn" is cuDNN's
# fused attention, which Transformer Engine prefers on Hopper: the
# Megatron-Core and NeMo runs bench/published_runs.py prices.
# `calibration_point.fit_attention` recomputes both; tests check them.
HOPPER_ATTENTION_EFFICIENCY = {"flash2": 0.3445, "cudnn": 0.5686}


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str = "gpu"                    # "gpu" or "cpu"
    devices_per_server: int = 8          # devices (or local processes) sharing the intra links
    peak_tflops: float = 312.0           # 16-bit (bf16/fp16) dense matrix peak per device
    peak_tflops_fp32: float = 19.5       # fp32 peak per device (CPU: per process at 1 thread)
    gemm_efficiency: float = 0.7         # e_max: fraction of peak a large GEMM reaches
    gemm_ramp_seconds: float = 4e-6      # CPU: W0 = peak · this: GEMM work at half of e_max
    # GPU: the tile model of ptdp.perf.price.gemm (defaults: A100's SMs and tile).
    sm_count: int = 108                  # streaming multiprocessors
    gemm_tile: tuple[int, int] = (128, 128)  # output tile [m, n] of one thread block
    tile_overhead_seconds: float = 1e-6  # fixed cost per tile: prologue and epilogue
    fused_attention: bool = False        # attention core as one flash-attention kernel
    # The fraction of the per-SM peak a flash-attention block pair reaches
    # (0: e_max, the GEMMs'); measured by bench/gpu.py's kernel sweep.
    attention_efficiency: float = 0.0
    # The priced run's software where it is not ptdp's (published runs of
    # Megatron-LM and NeMo, bench/published_runs.py; ptdp's own plans keep
    # these defaults): gradient buckets reduced during each chunk's last
    # backward (ptdp, Megatron-LM's --overlap-grad-reduce) or all after the
    # flush (Megatron-LM 2021's local DDP); the distributed optimizer's
    # all-gather of the updated weights under the next iteration's forward
    # (--overlap-param-gather, which ptdp runs too when given; `ptdp plan
    # --overlap-param-gather` sets it); the
    # sequence-parallel tensor collectives pipelined with the GEMM each
    # feeds or follows (--tp-comm-overlap; ptdp runs them between GEMMs);
    # rotary embeddings in one fused kernel (Megatron-Core's default rope
    # fusion; ptdp rotates eagerly, five passes); the optimizer step in
    # fused multi-tensor kernels (Megatron-LM's apex or Transformer Engine
    # Adam; ptdp's AdamW runs element-wise operators, operator_bytes.py);
    # full recomputation rerunning each layer's whole forward (Megatron-LM's
    # re-entrant checkpoint function; ptdp's non-re-entrant one stops once
    # every saved tensor is rebuilt, before the layer's last GEMM unless
    # hidden dropout saves a mask after it).
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    tensor_comm_overlap: bool = False
    fused_rope: bool = False
    fused_optimizer: bool = False
    recompute_whole_layer: bool = False
    memory_bandwidth: float = 2039 * GB  # bytes/s for memory-bound operators
    op_bandwidth: dict[str, float] = field(default_factory=dict)  # bytes/s by operator class
    intra_bandwidth: float = 300 * GB    # bytes/s per device per direction inside a server
    intra_latency: float = 5e-6          # seconds per message step inside a server
    inter_bandwidth: float = 25 * GB     # bytes/s per device per direction between servers
    inter_latency: float = 10e-6         # seconds per message step between servers
    memory_bytes: float = 80 * GIB       # device memory
    launch_overhead: float = 4e-6        # seconds per operator launched (kernel / eager op)
    # Measured seconds by message bytes between 2 processes of one server (calibrate: the
    # "allreduce" and the pipeline's batched send + receive, "exchange"); when present they
    # price intra-server communication instead of intra_latency / intra_bandwidth.
    collective_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    cores: int = 0                       # CPU: cores the local processes share (0: no contention)
    available_cores: float = 0.0         # CPU: of them, what computing processes get (0: all)
    thread_speedup: float = 1.0          # CPU: GEMM speed with `cores` threads over 1 thread
    op_thread_speedup: dict[str, float] = field(default_factory=dict)  # CPU: the same by op class
    notes: str = ""                      # where the numbers come from
    measurements: dict[str, Any] = field(default_factory=dict)  # calibrate's raw data

    def __post_init__(self):
        # JSON gives the tile back as a list; keep one spelling so profiles compare equal.
        object.__setattr__(self, "gemm_tile", tuple(int(x) for x in self.gemm_tile))

    # ---- rates -------------------------------------------------------------------------

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s of one device (one process on CPU, 1 thread) in `precision`."""
        return (self.peak_tflops_fp32 if precision == "fp32" else self.peak_tflops) * 1e12

    def threads_per_process(self, local_processes: int) -> int:
        """Threads `ptdp train` gives each of `local_processes` processes
        (ptdp.device.configure_threads): cores // processes, at least 1."""
        if self.kind != "cpu" or self.cores <= 0:
            return 1
        return max(1, self.cores // max(1, local_processes))

    def thread_factor(self, threads: int, op: str = "gemm") -> float:
        """Speed of one process's operators of class `op` ("gemm" or a memory
        class) with `threads` threads over 1 thread, no other process
        running: linear between 1 (1 thread) and the measured speed-up on all
        cores (`thread_speedup` for GEMMs, `op_thread_speedup[op]` for the
        others; 1 when not measured)."""
        if self.kind != "cpu" or self.cores <= 1 or threads <= 1:
            return 1.0
        speedup = self.thread_speedup if op == "gemm" else self.op_thread_speedup.get(op, 1.0)
        threads = min(threads, self.cores)
        return 1.0 + (speedup - 1.0) * (threads - 1) / (self.cores - 1)

    def share(self, busy_processes: float, threads: int) -> float:
        """Fraction of its uncontended speed a computing process gets while
        `busy_processes` processes (itself included) compute at once."""
        if self.kind != "cpu" or self.cores <= 0 or busy_processes <= 0:
            return 1.0
        cores = self.available_cores if self.available_cores > 0 else self.cores
        return min(1.0, cores / (busy_processes * threads))

    def gemm_efficiency_at(self, work: float, precision: str) -> float:
        """CPU profiles: e_max · W / (W + W0) for a GEMM of `work` FLOPs."""
        w0 = self.peak_flops(precision) * self.gemm_ramp_seconds
        return self.gemm_efficiency * work / (work + w0)

    def gemm_seconds(self, m: int, n: int, k: int, *, batch: int = 1, precision: str = "bf16",
                     bytes_per_element: int = 2) -> float:
        """Time of `batch` GEMMs [m, k] × [k, n] (one kernel), without launch
        overhead: the tile model on GPUs, the saturating roofline on CPUs."""
        if self.kind == "gpu":
            return gemm.gemm_seconds(self.tiled_device(precision), m, n, k, batch,
                                     bytes_per_element)
        work = 2.0 * m * n * k * batch
        if work <= 0:
            return 0.0
        compute = work / (self.peak_flops(precision) * self.gemm_efficiency_at(work, precision))
        traffic = batch * (m * k + k * n + m * n) * bytes_per_element / self.memory_bandwidth
        return max(compute, traffic)

    def tiled_device(self, precision: str = "bf16") -> gemm.TiledDevice:
        """This GPU as ptdp.perf.price.gemm's tile model sees it."""
        return gemm.TiledDevice(
            peak_flops=self.peak_flops(precision), sm_count=self.sm_count,
            tile_m=self.gemm_tile[0], tile_n=self.gemm_tile[1],
            achievable_fraction=self.gemm_efficiency,
            tile_overhead_seconds=self.tile_overhead_seconds,
            memory_bandwidth=self.memory_bandwidth)

    def attention_seconds(self, batch_heads: int, s: int, head_dim: int, *, causal: bool = True,
                          precision: str = "bf16", bytes_per_element: int = 2
                          ) -> tuple[float, float]:
        """(forward, backward) seconds of the fused attention kernel over
        `batch_heads` sequences of s positions, head size `head_dim`."""
        device = self.tiled_device(precision)
        if self.attention_efficiency > 0:
            device = replace(device, achievable_fraction=self.attention_efficiency)
        return gemm.attention_seconds(device, batch_heads, s, head_dim,
                                      causal=causal, bytes_per_element=bytes_per_element)

    def memory_seconds(self, nbytes: float, op: str = "elementwise",
                       direction: str | None = None) -> float:
        """Time of a memory-bound operator of class `op` moving `nbytes` (read
        + written) in `direction` ("forward", "backward" or None): at
        `op_bandwidth["op:direction"]` when that direction was measured (CPU
        profiles, `ptdp calibrate`), else at `op_bandwidth[op]` (CPU
        profiles: elementwise, layer_norm, attention_core, gelu, residual,
        cross_entropy, optimizer; the paper's attention core), else at
        `memory_bandwidth`."""
        rates = self.op_bandwidth
        rate = rates.get(f"{op}:{direction}") if direction else None
        return nbytes / (rate or rates.get(op, self.memory_bandwidth))

    def measured_seconds(self, kind: str, nbytes: float) -> float | None:
        """`collective_seconds[kind]` at `nbytes`: piecewise linear between the
        measured sizes, the smallest size's time below them, the last two
        sizes' slope above them; None when not measured."""
        table = self.collective_seconds.get(kind)
        if not table:
            return None
        points = sorted((float(size), seconds) for size, seconds in table.items())
        if nbytes <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if nbytes <= x1:
                return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (nbytes - x1)

    # ---- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware-profile fields {unknown}; known: {sorted(known)}")
        if "name" not in data:
            raise ValueError("a hardware profile needs a 'name'")
        return cls(**data)


# ---- built-in profiles ---------------------------------------------------------------------

# What a memory-bound kernel gets of the data sheet's HBM bandwidth: the
# best streaming kernels measured on an A100 80 GB SXM reach 1.80 of its
# 2.04 TB/s, 88 % (Nsight Compute agreeing; NVIDIA developer forum, "Trouble
# to Reach Peak Bandwidth of A100", which cites a GTC talk where no kernel
# passed about 90 %). A measurement of kernels, not of a training run; the
# same fraction is assumed for the H100's and H200's HBM3/HBM3e until
# bench/gpu.py's kernel sweep measures theirs.
ACHIEVED_HBM_FRACTION = 0.88

# The paper's attention core on A100 (Megatron-LM's fused scale-mask-softmax
# kernel and PyTorch's dropout over the b·(a/t)·s² scores, as
# calibration_point.paper_kernels prices the published 2021-22 runs): the
# fraction of the data sheet's HBM bandwidth its passes reach. Fitted to one
# layer's kernels as Korthikanti et al. 2022 timed them (arXiv 2205.05198,
# Table 4: a 22B layer on 8 A100s; selective recomputation, which runs the
# attention core's forward once more, adds 1.3 ms to the layer's forward and
# backward, with and without sequence parallelism;
# calibration_point.KORTHIKANTI_LAYER_MS), solved together with the a100's
# e_max (`calibration_point.fit_attention_core_fraction`). A measurement of
# kernels, not of a training run; tests/test_cost_model.py recomputes it.
PAPER_ATTENTION_CORE_FRACTION = 0.658


def _a100(e_max: float) -> HardwareProfile:
    return HardwareProfile(
        name="a100", kind="gpu", devices_per_server=8,
        peak_tflops=312.0, peak_tflops_fp32=19.5,
        gemm_efficiency=e_max,
        sm_count=108,                        # A100 SXM: 108 SMs
        gemm_tile=(128, 128),                # assumption: cuBLAS/CUTLASS's usual Ampere tile
        tile_overhead_seconds=1e-6,          # assumption: operand pipeline fill + tile write-out
        fused_attention=True,                # SDPA, causal, 16-bit on CUDA: flash attention
        memory_bandwidth=ACHIEVED_HBM_FRACTION * 2039 * GB,   # A100 80 GB SXM HBM2e
        intra_bandwidth=300 * GB,            # NVSwitch: 600 GB/s per GPU, both directions together
        intra_latency=5e-6,
        inter_bandwidth=200e9 / 8,           # 8 × 200 Gb/s HDR per server: one 25 GB/s NIC per GPU
        inter_latency=10e-6,
        memory_bytes=80 * GIB, launch_overhead=4e-6,
        notes="DGX A100 80 GB (data sheet); gemm_efficiency fitted to the paper's 1.7B run "
              "(ptdp.perf.calibrate.calibration_point.fit_to_calibration_point)")


def _h100(e_max: float) -> HardwareProfile:
    return replace(
        _a100(e_max), name="h100", peak_tflops=989.0, peak_tflops_fp32=67.0,
        attention_efficiency=HOPPER_ATTENTION_EFFICIENCY["flash2"],   # PyTorch's SDPA default
        sm_count=132,                        # H100 SXM: 132 SMs
        gemm_tile=(128, 256),                # assumption: CUTLASS's usual Hopper tile
        memory_bandwidth=ACHIEVED_HBM_FRACTION * 3350 * GB,   # H100 SXM HBM3
        intra_bandwidth=450 * GB,            # NVLink 4: 900 GB/s per GPU, both directions
        inter_bandwidth=400e9 / 8,           # 8 × 400 Gb/s NDR per server: one 50 GB/s NIC per GPU
        notes="DGX H100 (data sheet); gemm_efficiency from an H200's measured 8192³ bf16 "
              "matmul (the same GH100 compute)")


def _h200(e_max: float) -> HardwareProfile:
    return replace(_h100(e_max), name="h200", memory_bandwidth=ACHIEVED_HBM_FRACTION * 4800 * GB,
                   memory_bytes=141 * GB,
                   notes="DGX H200 (data sheet): H100 with 141 GB at 4.8 TB/s; "
                         "gemm_efficiency from its measured 8192³ bf16 matmul")


BUILTIN = {"a100": _a100, "h100": _h100, "h200": _h200}


def builtin_profile(name: str, gemm_efficiency: float | None = None) -> HardwareProfile:
    """A built-in profile, with its own e_max unless `gemm_efficiency` is
    given: a100's fitted to the paper, h100's and h200's from the H200's
    measured matmul."""
    default = CALIBRATED_GEMM_EFFICIENCY if name == "a100" else HOPPER_GEMM_EFFICIENCY
    return BUILTIN[name](default if gemm_efficiency is None else gemm_efficiency)


def default_profile_path() -> Path:
    """Where `ptdp calibrate` writes without --out and `load_profile("local")` reads."""
    from ptdp.data.cache import default_cache_dir

    return default_cache_dir() / "local-profile.json"


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name (a100, h100, h200), "local" (the profile
    `ptdp calibrate` wrote to its default path), or a JSON file's."""
    text = str(name_or_path)
    if text in BUILTIN:
        return builtin_profile(text)
    path = Path(text)
    if text == "local" and not path.exists():
        path = default_profile_path()
        if not path.is_file():
            raise FileNotFoundError(f"no local hardware profile at {path}: run `ptdp calibrate` "
                                    f"first (it writes one there)")
    if not path.is_file():
        raise FileNotFoundError(f"no hardware profile {text!r}: give one of "
                                f"{', '.join(BUILTIN)}, local, or a JSON file "
                                f"(ptdp calibrate --out FILE)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path}: not a JSON hardware profile: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return HardwareProfile.from_dict(data)


def save_profile(profile: HardwareProfile, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
