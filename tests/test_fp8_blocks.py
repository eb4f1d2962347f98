"""Block-scaled FP8 weights (DeepSeek-V3's published format) on import
(fp8_blocks.py, wired into hf_directory.load_hf_directory):

* the dequantization is transformers' (its FP8 backward's dequantization,
  and its load-time Fp8Dequantize where the blocks are whole) and DeepSeek-V3's
  `weight_dequant` (re-stated below), the edge blocks included;
* a random Qwen3 saved by transformers, its linear weights converted to FP8
  blocks as the published files have them, imports through `ptdp convert
  --from-hf` to the logits transformers computes on the dequantized weights;
  with whole blocks, transformers' own FP8 loading is the reference;
* what ptdp cannot read is refused, naming the key or tensor.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from torch.testing import assert_close

from ptdp.checkpoint.store import load_logical_model
from ptdp.cli import main
from ptdp.interop.fp8_blocks import dequantize_fp8_blocks
from ptdp.interop.hf_directory import load_hf_directory
from ptdp.interop.hf_files import ConversionError
from tests.test_hf_llama import TOL, VOCAB, _hf_logits, _our_logits, _ours, _tokens

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BLOCK = 128
PUBLISHED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [BLOCK, BLOCK]}
FP8_MAX = 448.0  # float8_e4m3fn's largest value


def deepseek_weight_dequant(x, s, block=BLOCK):
    """DeepSeek-V3's inference/kernel.py `weight_dequant`, re-stated: one
    program per (block row, block column) loads its masked tile of x as
    float32 and multiplies it by s[block row, block column]."""
    rows, cols = x.shape
    y = torch.empty(rows, cols, dtype=torch.float32)
    for m in range(math.ceil(rows / block)):
        for n in range(math.ceil(cols / block)):
            tile = (slice(m * block, (m + 1) * block), slice(n * block, (n + 1) * block))
            y[tile] = x[tile].to(torch.float32) * s[m, n]
    return y


def quantize_fp8_blocks(weight, block=BLOCK):
    """A float matrix as the published checkpoints store it: each block
    divided by its amax / 448 and cast to float8_e4m3fn; the scales, one per
    block (the edge blocks partial), float32."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block), math.ceil(cols / block))
    padded = torch.zeros(grid[0] * block, grid[1] * block)
    padded[:rows, :cols] = weight
    tiles = padded.reshape(grid[0], block, grid[1], block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    quantized = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.reshape(padded.shape)[:rows, :cols].contiguous(), scale.to(torch.float32)


def _random_pair(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator).to(torch.float8_e4m3fn)
    scale_shape = (*shape[:-2], math.ceil(shape[-2] / BLOCK), math.ceil(shape[-1] / BLOCK))
    return weight, torch.rand(scale_shape, generator=generator) * 0.1 + 0.01


@pytest.mark.parametrize("shape", [(200, 300), (576, 7 * 128), (256, 384), (2, 130, 129)])
def test_dequantization_is_transformers_and_deepseeks(shape):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    weight, scale = _random_pair(shape, seed=sum(shape))
    ours = dequantize_fp8_blocks(weight, scale, (BLOCK, BLOCK), torch.float32)
    theirs = _dequantize_fp8_weight(weight, scale, [BLOCK, BLOCK], torch.float32)
    assert_close(ours, theirs, rtol=0, atol=0)
    for i, matrix in enumerate(weight.reshape(-1, *shape[-2:])):
        assert_close(ours.reshape(-1, *shape[-2:])[i],
                     deepseek_weight_dequant(matrix, scale.reshape(-1, *scale.shape[-2:])[i]),
                     rtol=0, atol=0)
    if all(n % BLOCK == 0 for n in shape[-2:]):  # its load-time op assumes whole blocks
        whole = Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32)
        assert_close(ours, whole, rtol=0, atol=0)
    # the edge blocks hold their own scale (a bottom-right value, by hand)
    assert ours[..., -1, -1].tolist() == (weight[..., -1, -1].float() * scale[..., -1, -1]).tolist()
    assert dequantize_fp8_blocks(weight, scale).dtype == torch.bfloat16  # the default
    assert_close(dequantize_fp8_blocks(weight, scale), theirs.to(torch.bfloat16), rtol=0, atol=0)


# ------------------------------------------------------------------ a Qwen3 in FP8 blocks

def _qwen3(hidden, intermediate, head_dim, seed=3):
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    with torch.no_grad():  # norms away from 1, so a swap would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _fp8_directory(directory, hf):
    """`hf` saved (float32), then its linear weights (not lm_head, as
    Qwen3-FP8 keeps it) stored as FP8 blocks with `weight_scale_inv`, and
    config.json's quantization_config the published one. `hf` itself gets
    the dequantized weights, by DeepSeek's algorithm."""
    hf.save_pretrained(str(directory))
    tensors = safetensors_torch.load_file(str(directory / "model.safetensors"))
    params = dict(hf.named_parameters())
    for key in [key for key in tensors if key.endswith("_proj.weight")]:
        tensors[key], tensors[key + "_scale_inv"] = quantize_fp8_blocks(tensors[key])
        with torch.no_grad():
            params[key].copy_(deepseek_weight_dequant(tensors[key], tensors[key + "_scale_inv"]))
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"),
                                metadata={"format": "pt"})
    _edit_config(directory, quantization_config=dict(PUBLISHED, modules_to_not_convert=["lm_head"]))
    return directory


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def edge_model(tmp_path_factory):
    """A Qwen3 whose every matrix has partial edge blocks (144, 160, 200, 80
    rows or columns), in FP8 blocks; the model holds the dequantized weights."""
    hf = _qwen3(hidden=144, intermediate=200, head_dim=40)
    return hf, _fp8_directory(tmp_path_factory.mktemp("fp8") / "qwen3", hf)


def test_an_fp8_qwen3_converts_to_the_logits_of_its_dequantized_weights(edge_model, tmp_path):
    hf, directory = edge_model
    save = tmp_path / "ckpt"
    assert main(["convert", "--from-hf", str(directory), "--save", str(save)]) == 0
    config, weights, _ = load_logical_model(save)
    tokens = _tokens(seed=7, length=12)
    theirs = _hf_logits(hf, tokens)
    assert_close(_our_logits(_ours(config.model, weights), tokens), theirs, **TOL)
    # (the weights really are FP8's: the float32 original computes otherwise)
    original = _qwen3(hidden=144, intermediate=200, head_dim=40)
    assert (_hf_logits(original, tokens) - theirs).abs().max() > 1e-3


def test_config_dtype_is_what_the_weights_dequantize_into(edge_model, tmp_path):
    hf, source = edge_model
    directory = tmp_path / "bf16"
    shutil.copytree(source, directory)
    _edit_config(directory, dtype="bfloat16")
    _, state = load_hf_directory(directory)
    down = state["layers.1.mlp.dense_4h_to_h.weight"]
    assert down.dtype == torch.bfloat16
    assert_close(down, hf.model.layers[1].mlp.down_proj.weight.detach().to(torch.bfloat16),
                 rtol=0, atol=0)
    assert state["embedding.word_embeddings.weight"].dtype == torch.float32  # as stored


def test_whole_blocks_import_as_transformers_loads_them(tmp_path):
    """(transformers' load-time dequantization takes the block to be the
    weight's rows over the grid's, which partial edge blocks break: so
    every matrix here is 128 or 256 by 128, or 64 rows of one block.)"""
    hf = _qwen3(hidden=128, intermediate=256, head_dim=32, seed=5)
    directory = _fp8_directory(tmp_path / "qwen3", hf)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager", local_files_only=True).eval()
    config, state = load_hf_directory(directory)
    tokens = _tokens(seed=8, length=12)
    assert_close(_our_logits(_ours(config, state), tokens), _hf_logits(theirs, tokens), **TOL)


# ------------------------------------------------------------------ refusals

def _drop(key):
    return lambda tensors: tensors.pop(key)


def _set(key, value):
    def change(tensors):
        tensors[key] = value(tensors[key])
    return change


def _infinite_scale(scale):
    scale = scale.clone()
    scale[0, 1] = float("inf")
    return scale


def _nan_code(weight):
    weight = weight.clone()
    weight.view(torch.uint8)[3, 4] = 0x7F  # float8_e4m3fn's NaN
    return weight


UP = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("config_change, tensor_change, named", [
    ({"quant_method": "gptq"}, None, "quantization_config.quant_method 'gptq'"),
    ({"fmt": "e5m2"}, None, "quantization_config.fmt 'e5m2'"),
    ({"activation_scheme": "static"}, None, "quantization_config.activation_scheme 'static'"),
    ({"weight_block_size": [64, 64]}, None,
     r"up_proj.weight_scale_inv is \[2, 2\]: for model.layers.0.mlp.up_proj.weight \[200, 144\] "
     r"weight_block_size \[64, 64\] gives \[4, 3\](.|\n)*grids fit weight_block_size \[128, 128\]"),
    ({"weight_block_size": None}, None, "quantization_config.weight_block_size None"),
    (None, _drop(UP), f"{UP}_scale_inv: scales without their weight {UP}"),
    (None, _drop(UP + "_scale_inv"), f"{UP} is F8_E4M3 without {UP}_scale_inv"),
    (None, _set(UP, lambda w: w.to(torch.float8_e5m2)), f"{UP} is F8_E5M2, not F8_E4M3"),
    (None, _set(UP + "_scale_inv", _infinite_scale), f"{UP}_scale_inv holds NaN or infinite"),
    (None, _set(UP, _nan_code), f"{UP} holds NaN codes"),
])
def test_what_ptdp_cannot_read_is_refused_naming_it(edge_model, tmp_path, config_change,
                                                    tensor_change, named):
    directory = tmp_path / "changed"
    shutil.copytree(edge_model[1], directory)
    if config_change is not None:
        _edit_config(directory, quantization_config={**PUBLISHED, **config_change})
    if tensor_change is not None:
        path = str(directory / "model.safetensors")
        tensors = safetensors_torch.load_file(path)
        tensor_change(tensors)
        safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=named) as refused:
        load_hf_directory(directory)
    assert str(directory) in str(refused.value)


def test_scales_beyond_the_dtype_asked_are_refused_naming_the_weight(edge_model, tmp_path):
    directory = tmp_path / "fp16"
    shutil.copytree(edge_model[1], directory)
    _edit_config(directory, dtype="float16")
    path = str(directory / "model.safetensors")
    tensors = safetensors_torch.load_file(path)
    tensors[UP + "_scale_inv"] *= 1e8  # (the largest weights become ~1e7: float16 ends at 65504)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=f"{UP} dequantizes beyond torch.float16's range"):
        load_hf_directory(directory)
    _edit_config(directory, dtype="float32")  # as the refusal advises
    _, state = load_hf_directory(directory)
    assert state["layers.0.mlp.dense_h_to_4h.weight"].abs().max() > 1e6
