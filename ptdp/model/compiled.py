"""--compile: each transformer layer's element-wise work compiled with
torch.compile, between the layer's collectives.

torchtitan compiles whole TransformerBlocks. Here the tensor- and
sequence-parallel communication is ptdp's own autograd functions
(ptdp.parallel.tensor) inside the column- and row-parallel layers, so only
the pure computation between them is compiled, as small functions that take
every tensor they use as an argument (no module is traced, so one graph
serves every layer of a shape and dtype):

* a norm (input_layernorm; LayerNorm or RMSNorm);
* the attention's residual add fused with the norm after it (one pass over
  the hidden states instead of two), and the MLP's residual add, each with
  the row-parallel layer's bias;
* the rotation of q and k (rotary embeddings, partial rotation too), with
  --softmax-scale's query factor;
* the MLP's activation: SwiGLU and the other gated units, or bias + GeLU.

The matrix products, attention core, routers and experts stay eager, and so
do the pieces torch.compile could change: a residual add under active
dropout (inductor draws its own random numbers, not the eager streams that
recomputation and every layout replay), and --apply-layernorm-1p's norms
(their low-precision path is an autograd function of its own). Each piece is
the same formula as the eager path, so a compiled run equals an eager one
within rounding under every layout, recomputation (a checkpointed region
reruns the compiled piece), precision, LoRA, MoE, MLA and packed sequences.

Where the platform cannot compile (no C++ compiler for inductor on a CPU, no
Triton on a GPU), or a piece fails to compile, the layers run eager and one
note says why (`Compilation.problem`); training goes on unchanged.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.model.fused import _gated_unit
from ptdp.model.rotary import Rotary, rotate

# The model classes that call the pieces: each has a class attribute
# `layer_kernels` (None: eager), which compile_layers sets on their instances.
KERNELS_ATTR = "layer_kernels"
# Graphs each piece may hold (see compile_layers).
RECOMPILE_LIMIT = 64


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          eps: float | None) -> torch.Tensor:
    """LayerNorm over the last dimension, or RMSNorm where there is no bias."""
    return _rms_norm(x, weight, eps) if bias is None else _layer_norm(x, weight, bias, eps)


def _residual(out: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor) -> torch.Tensor:
    """residual + (out + bias): ptdp.model.fused's bias_dropout_add without dropout."""
    if bias is not None:
        out = out + bias
    return residual + out


def _residual_norm(out: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                   weight: torch.Tensor, norm_bias: torch.Tensor | None,
                   eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, norm(x)) with x = residual + (out + bias), in one pass."""
    x = _residual(out, bias, residual)
    return x, _norm(x, weight, norm_bias, eps)


def _rotate_queries_and_keys(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, width: int,
                             query_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = rotate(q, cos, sin, width), rotate(k, cos, sin, width)
    if query_scale is not None and query_scale != 1.0:
        q = q * query_scale
    return q, k


def _bias_gelu(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.gelu(y if bias is None else y + bias, approximate="tanh")


def toolchain_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels for `device` here (None: it can):
    inductor compiles C++ on a CPU and Triton kernels on a GPU."""
    try:
        from torch._inductor import cpp_builder
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError as error:  # a torch built without inductor
        return f"this torch has no inductor compiler ({error})"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (inductor compiles GPU kernels with it): install triton"
        return None
    try:
        cpp_builder.get_cpp_compiler()
    except (InvalidCxxCompiler, OSError, subprocess.SubprocessError):
        return ("no C++ compiler was found (inductor builds CPU kernels with one): install g++ "
                "or clang++, or name one in the CXX environment variable")
    return None


class Compilation:
    """Whether this process's pieces still compile; the first problem turns
    every piece eager and is said once, by rank 0: every rank runs the same
    pieces on the same kind of machine, so they fall back alike."""

    def __init__(self, problem: str | None = None, rank: int = 0):
        self.problem, self.rank = None, rank
        if problem is not None:
            self.fall_back(problem)

    def fall_back(self, why: str) -> None:
        if self.problem is not None:
            return
        self.problem = why
        if self.rank == 0:
            print(f"ptdp: note: --compile: the layers run eager, as without --compile (same "
                  f"results, eager speed): {why}", file=sys.stderr, flush=True)


class _Piece:
    """One function, compiled on its first call (fullgraph: a graph break
    would mean it is not the pure computation it should be); eager once the
    compilation has a problem. A piece that fails to compile is run eager
    first: if that fails too, the error is the computation's and is raised."""

    def __init__(self, fn: Callable, compilation: Compilation):
        self.fn, self.compilation = fn, compilation
        self.compiled: Callable | None = None

    def __call__(self, *args):
        if self.compilation.problem is not None:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, fullgraph=True)
        try:
            return self.compiled(*args)
        except _compiler_errors() as error:
            result = self.fn(*args)
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            self.compilation.fall_back(f"compiling {self.fn.__name__.strip('_')} failed "
                                       f"({type(error).__name__}: {first_line})")
            return result


def _compiler_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile a function: dynamo's
    errors (it wraps the backend's), and inductor's own about the C++
    compiler. Nothing else is caught: other exceptions in a call (checkpoint's
    early stop of a recomputation, say) are the computation's."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    return TorchDynamoException, FailOnRecompileLimitHit, CppCompileError, InvalidCxxCompiler


def compiles_norm(norm: nn.Module) -> bool:
    """A plain LayerNorm or RMSNorm with a weight (not --apply-layernorm-1p's)."""
    return type(norm) in (nn.LayerNorm, nn.RMSNorm) and norm.weight is not None


class LayerKernels:
    """The compiled pieces the layers call (ptdp.model.gpt); each also knows
    when its eager path must run instead."""

    def __init__(self, compilation: Compilation):
        self.compilation = compilation
        (self._rms_norm, self._layer_norm, self._residual, self._residual_norm, self._rotate,
         self._gated, self._gelu) = (
            _Piece(fn, compilation) for fn in (_rms_norm, _layer_norm, _residual, _residual_norm,
                                               _rotate_queries_and_keys, _gated_unit, _bias_gelu))

    def norm(self, norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """`norm` as a function of its input, compiled where it is plain."""
        if not compiles_norm(norm):
            return norm
        if isinstance(norm, nn.RMSNorm):
            return lambda x: self._rms_norm(x, norm.weight, norm.eps)
        return lambda x: self._layer_norm(x, norm.weight, norm.bias, norm.eps)

    def residual(self, out: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor) -> torch.Tensor:
        return self._residual(out, bias, residual)

    def residual_norm(self, out: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, norm(x)) with x = residual + out + bias; `norm` must compile (compiles_norm)."""
        return self._residual_norm(out, bias, residual, norm.weight, getattr(norm, "bias", None),
                                   norm.eps)

    def rotate(self, rotary: Rotary, q: torch.Tensor, k: torch.Tensor,
               context: tuple[int, int], positions: torch.Tensor | None,
               query_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated (the tables eager, cached by the rotation), q scaled."""
        cos, sin = rotary.tables_for(q, context, positions)
        return self._rotate(q, k, cos, sin, rotary.width, query_scale)

    def gated_unit(self, y: torch.Tensor, activation: str, offset: float,
                   clamp: float | None) -> torch.Tensor:
        return self._gated(y, activation, offset, clamp)

    def bias_gelu(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._gelu(y, bias)


def compile_layers(chunks: Iterable[nn.Module], device: torch.device,
                   rank: int = 0) -> LayerKernels:
    """Give every layer, attention and MLP of `chunks` the compiled pieces
    (one set for the process); where the platform cannot compile, say so once
    and leave them eager."""
    kernels = LayerKernels(Compilation(toolchain_problem(device), rank))
    # Each piece is one function for every layer, so its variants (dtype,
    # training or evaluation, recomputation, a second model in the same
    # process) all count against dynamo's per-function limit of 8 graphs;
    # past it a fullgraph function fails (and the layers would go eager).
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    if kernels.compilation.problem is None:
        for chunk in chunks:
            for module in chunk.modules():
                if hasattr(type(module), KERNELS_ATTR):
                    setattr(module, KERNELS_ATTR, kernels)
    return kernels
