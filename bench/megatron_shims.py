"""Megatron-Core on a CPU: where it is installed, and the smallest shims it needs.

Megatron-Core (the `megatron-core` package) is not a ptdp dependency. The
benchmark installs it on demand into bench/.megatron-core (ignored by git),
without its dependencies, so that it cannot replace this environment's torch:

    pip install --target bench/.megatron-core megatron-core==0.16.1 --no-deps

Its imports that are missing on a CPU (Transformer Engine, apex, flash-attn,
triton) are guarded in 0.16.1 except where `install_import_shims` finds one
that is not: each missing module it has to stand in for gets an empty module,
listed by `shims()`. At run time Megatron-Core asks CUDA for its device in a
few places (`torch.cuda.current_device()`, `device="cuda"`,
`torch.cuda.synchronize()`); `install_cpu_device` gives each Megatron-Core
module that imported torch its own copy of the torch namespace in which those
name the CPU (the real torch is untouched: ptdp's side never sees it). Every
shim is listed with what it stands in for, and counted in the output.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import torch

VERSION = "0.16.1"
INSTALL_DIR = Path(__file__).resolve().parent / ".megatron-core"
INSTALL_COMMAND = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(INSTALL_DIR),
                   f"megatron-core=={VERSION}", "--no-deps"]
# What megatron-core imports at run time beyond torch: numpy and packaging
# (its only unconditional dependencies; both are ptdp's too).
RUNTIME_DEPENDENCIES = ("numpy", "packaging")
# Modules Megatron-Core may import that a CPU machine lacks: an empty module
# stands in for one only where importing Megatron-Core's GPT stack fails
# without it.
OPTIONAL_MODULES = ("triton", "transformer_engine", "apex", "flash_attn", "einops")

_SHIMS: list[tuple[str, str]] = []  # (what, why), in the order installed


def shims() -> list[tuple[str, str]]:
    """Every shim installed in this process: (what it replaces, why)."""
    return list(_SHIMS)


def available() -> bool:
    """Whether megatron-core is importable (from bench/.megatron-core or the environment)."""
    _add_install_dir()
    return importlib.util.find_spec("megatron") is not None \
        and importlib.util.find_spec("megatron.core") is not None


def ensure_installed(install: bool) -> None:
    """Megatron-Core importable, installing it into bench/.megatron-core if
    `install`; otherwise a missing one is one paragraph saying how to get it."""
    if available():
        return
    if not install:
        raise SystemExit(
            f"megatron-core is not installed. Run `python bench/megatron_peers.py --install` to put "
            f"megatron-core {VERSION} into bench/.megatron-core (no dependencies, so this "
            f"environment's torch stays), or install it there yourself with "
            f"`pip install --target bench/.megatron-core megatron-core=={VERSION} --no-deps`.")
    subprocess.run(INSTALL_COMMAND, check=True)
    importlib.invalidate_caches()
    if not available():
        raise SystemExit(f"pip installed megatron-core into {INSTALL_DIR.name}, but it does not "
                         f"import from there; remove that folder and run again with --install.")


def _add_install_dir() -> None:
    if INSTALL_DIR.is_dir() and str(INSTALL_DIR) not in sys.path:
        sys.path.insert(0, str(INSTALL_DIR))


def install_import_shims() -> None:
    """Import Megatron-Core's GPT stack; for each module it fails on that a
    CPU machine lacks, put an empty module in its place and try again."""
    _add_install_dir()
    for _ in range(len(OPTIONAL_MODULES) + 1):
        try:
            _import_gpt_stack()
            return
        except ModuleNotFoundError as error:
            missing = (error.name or "").split(".")[0]
            if missing not in OPTIONAL_MODULES or missing in sys.modules:
                raise
            sys.modules[missing] = types.ModuleType(missing)
            _SHIMS.append((f"import {missing}", "an empty module: not installed on this machine"))
    _import_gpt_stack()


def _import_gpt_stack() -> None:
    import warnings
    with warnings.catch_warnings():
        # "Apex is not installed. Falling back to ...": expected on a CPU.
        warnings.simplefilter("ignore", UserWarning)
        for name in ("megatron.core.parallel_state", "megatron.core.models.gpt",
                     "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer",
                     "megatron.core.pipeline_parallel", "megatron.core.distributed",
                     "megatron.core.transformer.moe.moe_layer"):
            importlib.import_module(name)


class _LayerNormAffine:
    """apex's FusedLayerNormAffineFunction as torch's layer_norm: what
    Megatron-Core's FusedLayerNorm calls (its `forward` arguments are what
    FusedLayerNorm inspects to choose how to call `apply`)."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):  # noqa: A002 (apex's names)
        raise NotImplementedError("called through apply")

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps):  # noqa: A002
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        return torch.nn.functional.layer_norm(input, shape, weight, bias, eps)


def install_apex_layer_norm() -> None:
    """An `apex` holding only normalization.fused_layer_norm.FusedLayerNormAffineFunction
    (torch's layer_norm), before Megatron-Core is imported: its local layer
    spec then builds its FusedLayerNorm, the norm that supports sequence
    parallelism (its torch-norm fallback for machines without apex refuses it)."""
    if "apex" in sys.modules:
        return
    names = ("apex", "apex.normalization", "apex.normalization.fused_layer_norm")
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["apex"].normalization = sys.modules["apex.normalization"]
    sys.modules["apex.normalization"].fused_layer_norm = sys.modules[names[2]]
    sys.modules[names[2]].FusedLayerNormAffineFunction = _LayerNormAffine
    _SHIMS.append(("import apex (normalization.fused_layer_norm.FusedLayerNormAffineFunction only)",
                   "torch's layer_norm, so that the local spec builds Megatron-Core's FusedLayerNorm: "
                   "its fallback norm without apex refuses sequence parallelism"))


# ------------------------------------------------------------------------------------------
# The CPU as Megatron-Core's device


def _cpu_device(device):
    """`device` with CUDA's names (an index, "cuda", "cuda:N") read as the CPU."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) \
            or (isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def made(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)
    return made


FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
             "zeros_like", "ones_like", "empty_like", "full_like")


class _CpuStream:
    """The one "stream" of a CPU: work is done when the call returns, so
    waits and events have nothing to wait for."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _CpuStream()


def _cpu_cuda_namespace() -> types.ModuleType:
    cuda = types.ModuleType("torch.cuda")
    cuda.__dict__.update(torch.cuda.__dict__)
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *args, **kwargs: None
    cuda.device_count = lambda: 0
    cuda.Stream = lambda *args, **kwargs: _STREAM
    cuda.Event = lambda *args, **kwargs: _STREAM
    cuda.current_stream = lambda *args, **kwargs: _STREAM
    cuda.stream = lambda stream: contextlib.nullcontext()
    return cuda


@functools.cache
def cpu_torch() -> types.ModuleType:
    """A copy of the torch namespace in which CUDA's device is the CPU:
    torch.cuda.current_device() is the CPU, synchronize() does nothing, and
    the tensor factories read device="cuda" (or an index) as the CPU. Plain
    attribute lookups, so Megatron-Core's other calls cost what they did."""
    namespace = types.ModuleType("torch")
    namespace.__dict__.update(torch.__dict__)
    for name in FACTORIES:
        setattr(namespace, name, _on_cpu(getattr(torch, name)))
    namespace.cuda = _cpu_cuda_namespace()
    return namespace


def install_cpu_device() -> None:
    """Every imported Megatron-Core module's `torch` becomes cpu_torch()
    (modules imported later are patched by calling this again)."""
    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "torch", None) is torch:
            module.torch = cpu_torch()
            patched += 1
    if patched and not any(what.startswith("torch in Megatron-Core") for what, _ in _SHIMS):
        _SHIMS.append(("torch in Megatron-Core's modules",
                       "their own copy of the namespace: torch.cuda.current_device() is the CPU, "
                       "torch.cuda.synchronize() does nothing, tensor factories read "
                       "device=\"cuda\" as the CPU; its streams and events are one CPU "
                       "stream with nothing to wait for"))


@contextlib.contextmanager
def tensor_cuda_is_identity():
    """Within: Tensor.cuda() returns the tensor itself. Megatron-Core's
    GPTModel moves the tied embedding to CUDA before its first all-reduce
    between the pipeline's ends; only its construction runs under this."""
    if not any(what == "Tensor.cuda()" for what, _ in _SHIMS):
        _SHIMS.append(("Tensor.cuda()", "the tensor itself, while Megatron-Core builds its model "
                       "(it moves the tied embedding to CUDA before the pipeline's ends "
                       "all-reduce it)"))
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def install_missing_names() -> None:
    """Names Megatron-Core 0.16.1 uses but defines only when Transformer
    Engine imports: moe_utils.te_general_gemm (the router's product checks
    it against None, but without Transformer Engine it is never bound)."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _SHIMS.append(("megatron.core.transformer.moe.moe_utils.te_general_gemm",
                       "None: bound only when Transformer Engine imports, read by the router "
                       "either way"))


def _move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """maybe_move_tensor_to_cpu for tensors already on the CPU: the split
    sizes the all-to-all dispatcher asks as numpy arrays become numpy arrays
    (the original converts only tensors on CUDA, leaving CPU ones tensors,
    which torch.distributed.all_to_all_single refuses as split sizes)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def install_host_splits() -> None:
    """The all-to-all dispatcher's device-to-host step, on a CPU (_move_to_host)."""
    from megatron.core.transformer.moe import token_dispatcher
    if token_dispatcher.maybe_move_tensor_to_cpu is not _move_to_host:
        token_dispatcher.maybe_move_tensor_to_cpu = _move_to_host
        _SHIMS.append(("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
                       "returns the split sizes as numpy arrays for tensors already on the CPU "
                       "(it converts only CUDA tensors, and all_to_all_single refuses tensors "
                       "as split sizes)"))


def install_rng_tracker() -> None:
    """Megatron-Core's own tracker for inference, whose fork() does nothing,
    in place of its training tracker, which forks the CUDA generator: the
    benchmark's dropout is off, so no random number is drawn inside a fork."""
    from megatron.core.tensor_parallel import random
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _SHIMS.append(("Megatron-Core's RNG tracker",
                   "its inference tracker (fork() does nothing): there is no CUDA generator to "
                   "fork, and dropout is off"))
