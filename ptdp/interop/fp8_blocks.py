"""Block-scaled FP8 weights, as DeepSeek-V3, Kimi K2 and other published
checkpoints store them, dequantized on import for every family.

Such a directory's config.json says

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and a quantized matrix `X.weight` [..., rows, cols] is stored as
float8_e4m3fn beside `X.weight_scale_inv` [..., ceil(rows/128),
ceil(cols/128)]: one float32 scale per 128 x 128 block, the blocks at the
bottom and right edges partial. The value is `weight.float() * scale` over
each block (DeepSeek-V3's `weight_dequant`; transformers' finegrained_fp8).
Other tensors (embeddings, norms, `modules_to_not_convert`) are stored
plain and read as they are. The scales may be stored as float32, bf16,
fp16 or E8M0 (`scale_fmt: "ue8m0"`: powers of two); the math is the same.

`load_fp8_state` reads an HFWeights (hf_weights.py) so: every pair checked
from the files' headers first (each FP8 weight has its scale and the
reverse, the scale grid is the one the block size gives), then each pair
read, its scales checked finite, and dequantized into the dtype asked
(bf16 by default; hf_directory.py asks for config.json's dtype). Anything
else is refused naming the key or tensor: dynamic activation quantization
is what such a model computes with bf16 activations too, but static
activation scales, FP4 experts or another FP8 format are not.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

from ptdp.interop.hf_files import ConversionError, abbreviate

METHOD = "fp8"
SCALE_SUFFIX = "_scale_inv"  # X.weight's scales are X.weight_scale_inv
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default
# safetensors' name of the FP8 format each `fmt` stores its weights in.
WEIGHT_FORMATS = {"e4m3": "F8_E4M3"}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' FP8 formats
# The dtypes a scale may be stored in, each read as float32 for the math.
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
_ADVICE = ("dequantize the model first (e.g. load it in transformers with "
           "FineGrainedFP8Config(dequantize=True) and save_pretrained it in bf16)")


# ------------------------------------------------------------------ the math

def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales' shape for a weight of `shape` [..., rows, cols]: one per
    block, the edge blocks partial."""
    *leading, rows, cols = shape
    return (*leading, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] = DEFAULT_BLOCK,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`weight` [..., rows, cols] (an FP8 dtype) times its block's scale,
    `scale_inv` [..., ceil(rows/block[0]), ceil(cols/block[1])], computed in
    float32 and returned in `dtype`. Refuses scales of another shape."""
    if weight.dim() < 2 or tuple(scale_inv.shape) != scale_grid(tuple(weight.shape), block):
        raise ConversionError(
            f"FP8 weight {tuple(weight.shape)} with scales {tuple(scale_inv.shape)}: blocks of "
            f"{block[0]} x {block[1]} need scales {scale_grid(tuple(weight.shape), block)}")
    rows, cols = weight.shape[-2:]
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


# ------------------------------------------------------------------ config.json

def fp8_block(quantization: Any) -> tuple[int, int]:
    """The block size of config.json's `quantization_config` when it is
    block-scaled FP8 that ptdp reads; refuses anything else, naming the key."""
    if not isinstance(quantization, dict):
        raise ConversionError(f"quantization_config={quantization!r} must be an object naming "
                              f"its quant_method")
    method = quantization.get("quant_method")
    if method != METHOD:
        raise ConversionError(
            f"quantization_config.quant_method {method!r} is not a format ptdp reads: ptdp "
            f"dequantizes block-scaled FP8 (quant_method 'fp8', DeepSeek-V3's) for every family "
            f"and gpt-oss's MXFP4 experts. Otherwise {_ADVICE}")
    problems = []
    fmt = quantization.get("fmt", "e4m3")
    if fmt not in WEIGHT_FORMATS:
        problems.append(f"quantization_config.fmt {fmt!r}: ptdp reads FP8 weights stored as "
                        f"{', '.join(map(repr, WEIGHT_FORMATS))} (float8_e4m3fn)")
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        problems.append(f"quantization_config.activation_scheme {scheme!r}: the model quantizes "
                        f"its activations with stored scales, which a dequantized model does "
                        f"not compute; ptdp reads 'dynamic' (the weights alone are quantized)")
    scale_fmt = quantization.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        problems.append(f"quantization_config.scale_fmt {scale_fmt!r}: ptdp reads 'float' and "
                        f"'ue8m0' scales")
    experts = quantization.get("expert_dtype", "fp8")
    if experts != "fp8":
        problems.append(f"quantization_config.expert_dtype {experts!r}: ptdp reads FP8 experts "
                        f"only, not packed FP4 ones")
    block = quantization.get("weight_block_size", list(DEFAULT_BLOCK))
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        problems.append(f"quantization_config.weight_block_size {block!r} must be two positive "
                        f"integers (rows, columns of a block; null, one scale per tensor, is not "
                        f"a format ptdp reads)")
    if problems:
        raise ConversionError(
            "this block-scaled FP8 checkpoint is not one ptdp can dequantize:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + f"\nCorrect config.json if it misdescribes the files; otherwise {_ADVICE}")
    return int(block[0]), int(block[1])


# ------------------------------------------------------------------ the files

def fp8_pairs(tensors: Mapping[str, Any], block: tuple[int, int]) -> dict[str, str]:
    """weight key -> scale key of every FP8 pair among `tensors` (a
    HFWeights' StoredTensor headers, checked before any data is read):
    refuses a scale without its weight, an FP8 weight without its scales,
    an FP8 format other than e4m3, and a scale grid other than `block`'s."""
    pairs, problems = {}, []
    for key, stored in tensors.items():
        if key.endswith(SCALE_SUFFIX):
            weight = key.removesuffix(SCALE_SUFFIX)
            if weight not in tensors:
                problems.append(f"{key}: scales without their weight {weight}")
            elif tensors[weight].dtype not in FP8_DTYPES:
                problems.append(f"{key}: scales of {weight}, which is {tensors[weight].dtype}, "
                                f"not FP8")
            elif stored.dtype not in SCALE_DTYPES:
                problems.append(f"{key} is {stored.dtype}: scales are one of "
                                f"{', '.join(SCALE_DTYPES)}")
            else:
                pairs[weight] = key
        elif stored.dtype in FP8_DTYPES and key + SCALE_SUFFIX not in tensors:
            problems.append(f"{key} is {stored.dtype} without {key}{SCALE_SUFFIX} beside it: an "
                            f"FP8 weight needs its block scales")
    mismatched = False
    for weight, scale in pairs.items():
        shape, grid = tensors[weight].shape, tensors[scale].shape
        if tensors[weight].dtype != WEIGHT_FORMATS["e4m3"]:
            problems.append(f"{weight} is {tensors[weight].dtype}, not F8_E4M3 (float8_e4m3fn), "
                            f"the format quantization_config.fmt 'e4m3' says")
        elif len(shape) < 2 or tuple(grid[:-2]) != tuple(shape[:-2]) or len(grid) != len(shape):
            problems.append(f"{weight} {list(shape)} with {scale} {list(grid)}: a block-scaled "
                            f"weight is a matrix (or a stack of them) with a scale grid of as "
                            f"many dimensions")
        elif tuple(grid) != scale_grid(shape, block):
            mismatched = True
            expected = list(scale_grid(shape, block))
            problems.append(f"{scale} is {list(grid)}: for {weight} {list(shape)} "
                            f"weight_block_size {list(block)} gives {expected}")
    if problems:
        advice = _fitting_block([(tensors[w].shape, tensors[s].shape) for w, s in pairs.items()])
        raise ConversionError(
            "the block-scaled FP8 tensors do not pair up as quantization_config says:\n"
            + "\n".join(f"  - {p}" for p in abbreviate(problems))
            + (f"\n{advice}" if mismatched and advice else ""))
    return pairs


def _fitting_block(grids: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """Advice for scale grids that another block size gives: the block
    sizes every weight's grid fits (a grid of g blocks over n fits any block
    b with ceil(n / b) = g), and one of them: 128 where it fits, as
    published, else the smallest."""
    fitting = []
    for axis in (-2, -1):
        low, high = 1, math.inf
        for shape, grid in grids:
            if len(shape) < 2 or len(grid) != len(shape) or not 0 < grid[axis] <= shape[axis]:
                return ""
            n, g = shape[axis], grid[axis]
            low = max(low, math.ceil(n / g))
            high = min(high, math.inf if g == 1 else math.ceil(n / (g - 1)) - 1)
        if low > high:
            return ""
        fitting.append((low, high, DEFAULT_BLOCK[0] if low <= DEFAULT_BLOCK[0] <= high else low))
    (rows_low, rows_high, rows), (cols_low, cols_high, cols) = fitting
    return (f"The scale grids fit weight_block_size [{rows}, {cols}] (rows "
            f"{_range(rows_low, rows_high)}, columns {_range(cols_low, cols_high)}): set "
            f"quantization_config.weight_block_size to the block the checkpoint was quantized "
            f"with.")


def _range(low: int, high: float) -> str:
    return f"{low} or more" if high == math.inf else f"{low} to {high}"


def load_fp8_state(weights: Any, quantization: Any, keys: Iterable[str] | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors `keys` (default all) of an HFWeights whose config.json's
    `quantization_config` is `quantization`: each FP8 `X.weight` with its
    `X.weight_scale_inv` dequantized into `dtype` under the weight's name
    (the scales leave the state), the others as stored (floating point and
    finite, as HFWeights.load checks)."""
    block = fp8_block(quantization)
    pairs = fp8_pairs(weights.tensors, block)
    keys = list(weights.tensors if keys is None else keys)
    scales = set(pairs.values())
    state = weights.load(key for key in keys if key not in pairs and key not in scales)
    for key in keys:
        if key in pairs:
            state[key] = _dequantized_pair(weights, key, pairs[key], block, dtype)
    return state


def _dequantized_pair(weights: Any, key: str, scale_key: str, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    raw = weights.read([key, scale_key])
    weight, scale = raw[key], raw[scale_key]
    file = weights.tensors[scale_key].file
    if not bool(torch.isfinite(scale.to(torch.float32)).all()):
        raise ConversionError(f"{file}: {scale_key} holds NaN or infinite scales: the file is "
                              f"damaged; ptdp imports only finite weights")
    if bool(torch.isnan(weight.to(torch.float32)).any()):
        raise ConversionError(f"{weights.tensors[key].file}: {key} holds NaN codes: the file is "
                              f"damaged; ptdp imports only finite weights")
    value = dequantize_fp8_blocks(weight, scale, block, dtype)
    if not bool(torch.isfinite(value).all()):
        raise ConversionError(
            f"{weights.tensors[key].file}: {key} dequantizes beyond {dtype}'s range (its scales "
            f"are too large for it): set config.json's \"dtype\" to \"float32\" to import it "
            f"in float32")
    return value


def fp8_shapes(weights: Any, quantization: Any) -> dict[str, tuple[int, ...]]:
    """The shapes of an HFWeights' tensors as `load_fp8_state` returns them
    (the scales gone), its pairs checked from the headers: what a family's
    check_hf_tensors sees."""
    pairs = fp8_pairs(weights.tensors, fp8_block(quantization))
    scales = set(pairs.values())
    return {key: shape for key, shape in weights.shapes.items() if key not in scales}
