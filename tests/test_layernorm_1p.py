"""--apply-layernorm-1p: every norm stores its scale zero-centred, w = scale - 1.

Megatron-LM's meaning (layernorm_zero_centered_gamma: FusedLayerNorm and
Transformer Engine's LayerNorm and RMSNorm): the weight starts at 0 and the
norm scales by 1 + w. Weight decay skips norms in both frameworks (1-D
parameters), so in fp32 a flagged model trains as the plain one does: the
gradient with respect to w is the gradient with respect to the scale, and
the stored weights differ by exactly 1 (to rounding: w and 1 + w round
differently after each step). In bf16 the 1 is added in fp32, which is the
point of the flag: a small bf16 w keeps bits that 1 + w in bf16 rounds away.

Checked here: the initial values; fp32 training equal to the plain scale for
LayerNorm and RMSNorm; the bf16 node against an fp64 reference; t = 2 with
sequence parallelism equal to one process; Hugging Face export (GPT-2
and Llama) giving transformers' logits and greedy tokens, and import back
under the flag; a checkpoint of the other setting refused on load.
"""

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ptdp.cli import main
from ptdp.config import Config, DataConfig
from ptdp.sampling import SamplingSettings
from ptdp.generate import GenerateRequest, generate_text
from ptdp.interop import hf_gpt2, hf_llama
from ptdp.interop.logical import norm_weight_names
from ptdp.model.fused import zero_centred_norm
from ptdp.model.gpt import GPT, LayerNorm1p, RMSNorm1p
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.checkpoint.store import (CheckpointError, check_model_fits, load_logical_model,
                                   read_metadata, resolve, save_logical_model)
from ptdp.train.loop import Trainer
from tests import test_ptdp_step

CPU = torch.device("cpu")
GPT2 = dataclasses.replace(test_ptdp_step.MODEL, num_layers=2)
LLAMA = dataclasses.replace(GPT2, normalization="RMSNorm", swiglu=True,
                            position_embedding_type="rope", disable_bias_linear=True)
NORMS = {"LayerNorm": GPT2, "RMSNorm": LLAMA}


def _flagged(model):
    return dataclasses.replace(model, apply_layernorm_1p=True)


def _logical(trainer):
    return test_ptdp_step._logical_weights(trainer, ParallelContext.single())


# ------------------------------------------------------------------ the model

@pytest.mark.parametrize("name", list(NORMS))
def test_norm_weights_start_at_zero_and_nothing_else_changes(name):
    plain, flagged = NORMS[name], _flagged(NORMS[name])
    model = GPT(flagged, ParallelContext.single(), RNGStreams(CPU)).initialize(3)
    reference = dict(GPT(plain, ParallelContext.single(), RNGStreams(CPU)).initialize(3)
                     .named_parameters())
    norm_kind = RMSNorm1p if name == "RMSNorm" else LayerNorm1p
    norms = [m for m in model.modules() if isinstance(m, (LayerNorm1p, RMSNorm1p))]
    assert len(norms) == 2 * flagged.num_layers + 1
    assert all(type(m) is norm_kind for m in norms)
    names = set(norm_weight_names(flagged))
    assert len(names) == len(norms)
    for param_name, param in model.named_parameters():
        if param_name in names:
            assert torch.equal(param, torch.zeros_like(param)), param_name
            assert torch.equal(reference[param_name], torch.ones_like(param))
        else:
            assert torch.equal(param, reference[param_name]), param_name


@pytest.mark.parametrize("bias", [True, False], ids=["LayerNorm", "RMSNorm"])
def test_the_norm_scales_by_one_plus_w(bias):
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=generator) for shape in ((4, 3, 16), (16,), (16,)))
    b = b if bias else None
    want = F.layer_norm(x, (16,), w + 1, b, 1e-5) if bias else F.rms_norm(x, (16,), w + 1, 1e-5)
    assert_close(zero_centred_norm(x, w, b, 1e-5), want, rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_adds_the_one_in_fp32(bias, dtype):
    """Output and gradients against fp64, with w small (5e-3: 1 + w in bf16
    loses most of it). The output is rounded once: within half the spacing
    of the largest outputs of the reference, and closer to it on average
    than the norm given 1 + w rounded to the low precision."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=generator).to(dtype).requires_grad_()
    w = (torch.randn(32, generator=generator) * 5e-3).to(dtype).requires_grad_()
    b = (torch.randn(32, generator=generator) * 0.1).to(dtype).requires_grad_() if bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    y = zero_centred_norm(x, w, b, 1e-5)
    assert y.dtype == dtype
    grad = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(grad)

    exact = [t.detach().double().requires_grad_() for t in leaves]
    norm = F.layer_norm if bias else (lambda v, s, g, _, e: F.rms_norm(v, s, g, e))
    reference = norm(exact[0], (32,), exact[1] + 1, exact[2] if bias else None, 1e-5)
    reference.backward(grad.double())
    ulp = torch.finfo(dtype).eps * 4  # the spacing of values in [4, 8), the largest outputs
    assert (y.double() - reference).abs().max() <= ulp / 2
    rounded_scale = norm(x.detach(), (32,), w.detach() + 1, None if b is None else b.detach(),
                         1e-5)
    ours, theirs = ((t.double() - reference).abs().mean() for t in (y, rounded_scale))
    assert ours < theirs
    for got, want in zip(leaves, exact):
        assert got.grad.dtype == dtype
        assert_close(got.grad.double(), want.grad, rtol=2e-2, atol=4 * ulp)


# ------------------------------------------------------------------ training

@pytest.mark.parametrize("name", list(NORMS))
def test_fp32_training_equals_the_plain_scale(name):
    """Three AdamW steps (weight decay on, clipping active): the same losses
    and gradient norms; the norms' weights are the plain model's minus 1,
    everything else the same, and the norms did move."""
    runs = {}
    for model in (NORMS[name], _flagged(NORMS[name])):
        trainer = Trainer(test_ptdp_step._config(model=model, train_iters=3),
                          ParallelContext.single(), CPU)
        runs[model.apply_layernorm_1p] = [trainer.step(i)[0] for i in range(3)], _logical(trainer)
    (plain_records, plain), (records, weights) = runs[False], runs[True]
    for got, want in zip(records, plain_records):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    names = set(norm_weight_names(NORMS[name]))
    for weight_name, weight in weights.items():
        shift = 1.0 if weight_name in names else 0.0
        assert_close(weight + shift, plain[weight_name], rtol=0, atol=1e-6,
                     msg=lambda m, n=weight_name: f"{n}: {m}")
    assert all((weights[n].abs() > 1e-3).any() for n in names)


def _sequence_parallel_vs_serial(rank, model):
    """t = 2 with sequence parallelism, where each rank's norm gradients
    cover its own positions and are summed over the tensor group: three
    steps as one process takes them. (The norms hold nothing else that a
    layout splits or shares.)"""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=1))
    trainer = Trainer(test_ptdp_step._config(2, 1, 1, None, model, True, train_iters=3), ctx, CPU)
    records = [trainer.step(i)[0] for i in range(3)]
    serial = Trainer(test_ptdp_step._config(model=model, train_iters=3), ParallelContext.single(),
                     CPU)
    serial_records = [serial.step(i)[0] for i in range(3)]
    for got, want in zip(records, serial_records):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    serial_weights = _logical(serial)
    for name, weight in test_ptdp_step._logical_weights(trainer, ctx).items():
        assert_close(weight, serial_weights[name], rtol=0, atol=1e-5,
                     msg=lambda m, name=name: f"{name}: {m}")
    return len(records)


def test_a_parallel_layout_equals_one_process(pools):
    assert pools(2).run(_sequence_parallel_vs_serial, _flagged(LLAMA)) == [3] * 2


# ------------------------------------------------------------------ checkpoints

def _checkpoint(path, model, seed=5, scale=0.1):
    """A model-only checkpoint of `model` whose norms are away from their
    initial values (a scale/shift swap would show)."""
    gpt = GPT(model, ParallelContext.single(), RNGStreams(CPU)).initialize(seed)
    logical = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    logical["embedding.word_embeddings.weight"] = \
        logical["embedding.word_embeddings.weight"][:model.vocab_size]
    if "output_layer.weight" in logical:
        logical["output_layer.weight"] = logical["output_layer.weight"][:model.vocab_size]
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in logical.items():
        if "layernorm" in name:
            tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)
    save_logical_model(path, Config(model=model, data=DataConfig(mock_data=True)), logical)
    return logical


def test_a_checkpoint_of_the_other_setting_is_refused(tmp_path):
    model = _flagged(LLAMA)
    _checkpoint(tmp_path / "ckpt", model)
    directory = resolve(tmp_path / "ckpt")
    metadata = read_metadata(directory)
    check_model_fits(metadata, model, directory)
    with pytest.raises(CheckpointError, match=r"--apply-layernorm-1p: checkpoint True, "
                                              r"requested False"):
        check_model_fits(metadata, LLAMA, directory)


# ------------------------------------------------------------------ Hugging Face

HF = {"GPT-2": (GPT2, "test_hf_gpt2", "GPT2LMHeadModel"),
      "Llama": (LLAMA, "test_hf_llama", "LlamaForCausalLM")}


def _our_logits(logical, model, tokens):
    from tests.test_hf_llama import _ours
    ours = _ours(model, logical)
    with torch.no_grad():
        return ours(tokens).transpose(0, 1)[..., :model.vocab_size]


@pytest.mark.parametrize("architecture", list(HF))
def test_hugging_face_export_and_import(tmp_path, architecture):
    """Export writes the plain scale 1 + w: transformers computes our logits
    and greedy continuation; import with the flag stores scale - 1 again."""
    base, helpers, hf_class = HF[architecture]
    helpers = importlib.import_module(f"tests.{helpers}")  # skips without transformers
    model = _flagged(dataclasses.replace(base, vocab_size=96))
    logical = _checkpoint(tmp_path / "ckpt", model)
    assert main(["convert", "--load", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    hf = getattr(helpers.transformers, hf_class).from_pretrained(str(tmp_path / "hf"),
                                                                 local_files_only=True).eval()
    tokens = torch.randint(0, model.vocab_size, (2, model.seq_length),
                           generator=torch.Generator().manual_seed(4))
    assert_close(helpers._hf_logits(hf, tokens), _our_logits(logical, model, tokens),
                 rtol=0, atol=1e-5)
    module = hf_gpt2 if architecture == "GPT-2" else hf_llama
    assert_close(module.to_hf_state(logical, model)[_hf_final_norm(architecture)],
                 logical["final_layernorm.weight"] + 1, rtol=0, atol=0)

    prompt = tokens[0, :4].tolist()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                          max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    request = GenerateRequest(load=str(tmp_path / "ckpt"), prompt_ids=prompt, output_ids=True,
                              settings=SamplingSettings(temperature=0.0, max_new_tokens=6))
    assert generate_text(request, ParallelContext.single(), CPU) == \
        ",".join(map(str, out[0, 4:].tolist()))

    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back"),
                 "--apply-layernorm-1p"]) == 0
    config, back, _ = load_logical_model(tmp_path / "back")
    assert config.model.apply_layernorm_1p
    for name in logical:
        assert_close(back[name], logical[name], rtol=0, atol=1e-7)


def _hf_final_norm(architecture):
    return "transformer.ln_f.weight" if architecture == "GPT-2" else "model.norm.weight"


def test_export_refuses_the_flag(tmp_path, capsys):
    assert main(["convert", "--load", str(tmp_path), "--to-hf", str(tmp_path / "hf"),
                 "--apply-layernorm-1p"]) == 2
    assert "--apply-layernorm-1p is for --from-hf" in capsys.readouterr().err
