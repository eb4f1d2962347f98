"""Sliding windows and attention sinks in the model (issue 43): a GPT whose
layers alternate windowed and full attention (--window-size,
--window-attn-skip-freq) with learnable sinks (--softmax-type learnable;
off-by-one in one layout) trains as one process does under t = 2 with
sequence parallelism, p = 2 interleaved with full recomputation, d = 2
with the distributed optimizer, t = 2, p = 2 under zbv (the deferred weight
gradients), and (an MoE, gpt-oss's shape, with expert
biases) EP = 2 × ETP = 2 over t = 2, d = 2 with sequence parallelism: losses, gradient norms and final weights
(sinks included) over three AdamW steps. One pool of four processes runs
the layouts in one call.

Also in one process: a window of the whole sequence is the full model
exactly; the window and the sinks each change the logits (so the layouts
compare something); and the settings' bad values are refused before
launch, one paragraph each."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import ConfigError, validate
from ptdp.parallel.topology import ParallelContext
from ptdp.train.loop import Trainer
from tests import layouts_runner as runner
from tests import test_moe_parallel as moe
from tests import test_ptdp_step as step

CPU = torch.device("cpu")
# s = 16; layers 1, 2 and 4 see the 3 keys before each query, layer 3 all of them.
MODEL = dataclasses.replace(step.MODEL, window_size="3,0", window_attn_skip_freq=3,
                            softmax_type="learnable")
OFF_BY_ONE = dataclasses.replace(MODEL, softmax_type="off-by-one")
# gpt-oss's shape: an MoE whose attention has windows and sinks, biases on
# every linear layer (the experts' too) and the clamped quick GeGLU with the
# linear offset; its experts split over two ranks (ETP = 2) whose partial
# outputs are summed, so each adds its share of the second bias.
MOE = dataclasses.replace(moe.MOE, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0,
                          window_size="3,0", window_attn_skip_freq=2, softmax_type="learnable",
                          disable_bias_linear=False, moe_shared_expert_intermediate_size=None,
                          moe_shared_expert_gate=False, swiglu=False, quick_geglu=True,
                          glu_linear_offset=1.0, activation_func_clamp_value=1.5)
MODELS = {"learnable": MODEL, "off-by-one": OFF_BY_ONE, "moe": MOE}


# The settings of each layout: tests.layouts_runner.Layout, this file's model by default.
Layout = functools.partial(runner.Layout, model="learnable")

LAYOUTS = [
    Layout(t=2, d=2, sequence_parallel=True),
    Layout(p=2, d=2, k=1, recompute="full", distributed=True),
    Layout(t=2, p=2, sequence_parallel=True, recompute="selective", model="off-by-one"),
    Layout(t=2, p=2, sequence_parallel=True, schedule="zbv"),
    Layout(t=2, d=2, ep=2, sequence_parallel=True, model="moe"),
]


def test_windows_and_sinks_train_like_one_process_under_every_layout(pools):
    references = runner.one_process_runs(MODELS, LAYOUTS)
    sinks = {name for name in references["learnable", False][1] if name.endswith("attention.sinks")}
    assert len(sinks) == MODEL.num_layers  # a trained logit per head in every layer
    assert not any(name.endswith("sinks") for name in references["off-by-one", False][1])
    runner.train_under_layouts(pools, MODELS, LAYOUTS, references)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from tests.test_gpt import _build

    logits = _build(model, ParallelContext.single())(tokens).detach()
    return logits[..., :model.vocab_size]  # (the padding's logits are -inf)


def test_a_window_of_the_whole_sequence_is_full_attention_and_each_setting_counts():
    torch.manual_seed(0)
    tokens = torch.randint(0, step.MODEL.vocab_size, (2, step.MODEL.seq_length))
    full = _logits(step.MODEL, tokens)
    whole = dataclasses.replace(step.MODEL, window_size=f"{step.MODEL.seq_length - 1},0")
    assert_close(_logits(whole, tokens), full, rtol=0, atol=1e-6)
    windowed = dataclasses.replace(step.MODEL, window_size="3,0")
    assert (_logits(windowed, tokens) - full).abs().max() > 1e-3
    off_by_one = dataclasses.replace(step.MODEL, softmax_type="off-by-one")
    assert (_logits(off_by_one, tokens) - full).abs().max() > 1e-3


@pytest.mark.parametrize("settings, says", [
    ({"window_size": "128"}, "--window-size 128: give two integers L,R"),
    ({"window_size": "128,4"}, "ptdp's models are causal"),
    ({"window_size": "-2,0"}, "0 or more (-1: no bound)"),
    ({"window_attn_skip_freq": 2}, "--window-attn-skip-freq 2 chooses which layers are windowed"),
    ({"window_size": "3,0", "window_attn_skip_freq": "[1,0,1]"},
     "gives 3 layers, but --num-layers is 4"),
    ({"window_size": "3,0", "window_attn_skip_freq": "[1,2,1,0]"}, "2 is not 0 (full) or 1 "
                                                                  "(windowed)"),
    ({"window_size": "3,0", "attention_dropout": 0.1}, "--attention-dropout 0.1 with sliding "
                                                       "windows"),
])
def test_bad_local_attention_settings_are_refused_in_one_paragraph(settings, says):
    config = step._config(model=dataclasses.replace(step.MODEL, **settings))
    with pytest.raises(ConfigError) as refused:
        validate(config)
    assert len(refused.value.problems) == 1 and says in refused.value.problems[0], \
        refused.value.problems


def test_a_packed_sequence_computes_each_documents_windows_and_sinks_alone():
    """Three documents packed in one sequence (positions restarting, attention
    kept inside each) give, position by position, the logits of each document
    run alone, windows and sinks included; both with the window shorter and
    longer than a document."""
    from ptdp.parallel.document_attention import Documents
    from tests.test_gpt import _build

    lengths = (5, 7, 4)
    torch.manual_seed(1)
    tokens = torch.randint(0, MODEL.vocab_size, (1, sum(lengths)))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model = _build(MODEL, ParallelContext.single())
    with torch.no_grad():  # sinks away from their zero-mean start, so they count
        for layer in model.layers.values():
            layer.attention.sinks.add_(torch.randn_like(layer.attention.sinks))
        packed = model(tokens, documents=Documents(positions, ids))[..., :MODEL.vocab_size]
        start = 0
        for n in lengths:
            alone = model(tokens[:, start:start + n])[..., :MODEL.vocab_size]
            assert_close(packed[start:start + n], alone, rtol=0, atol=1e-5)
            start += n


@pytest.mark.parametrize("s, left, block", [(16, 3, 4), (1000, 127, 128), (1024, 128, 128),
                                            (300, 0, 64), (64, 200, 16)])
def test_the_performance_model_counts_what_the_window_keeps(s, left, block):
    """pair_fraction is the dense window mask's share of the causal pairs;
    block_fraction is local_attention's visited blocks' share of the causal
    blocks (the model's BLOCK is the kernel's)."""
    from ptdp.parallel import local_attention as kernel
    from ptdp.perf.analytic import local_attention as priced

    assert priced.BLOCK == kernel.DEFAULT_BLOCK
    causal = s * (s + 1) / 2
    kept = kernel.window_mask(s, (left, 0)).sum().item()
    assert priced.pair_fraction(s, left) == pytest.approx(kept / causal)
    blocks = -(-s // block)
    visited = len(kernel.visited_blocks(s, block, (left, 0)))
    assert priced.block_fraction(s, left, block) == pytest.approx(visited / (blocks * (blocks + 1) / 2))


def test_flops_and_plans_of_a_windowed_model():
    """Model FLOPs count a windowed layer's attention products at the
    window's share (the rest of the layer as before); the planner prices a
    windowed model at long sequences faster than the full one."""
    from ptdp.config import ModelConfig
    from ptdp.perf.analytic.flops import model_flops_per_iteration
    from ptdp.perf.analytic.local_attention import pair_fraction
    from ptdp.perf.layout import Layout, Workload
    from ptdp.perf.plan.planner import evaluate_layout
    from ptdp.perf.price.profiles import load_profile

    full = ModelConfig(num_layers=6, hidden_size=512, num_attention_heads=8, seq_length=4096,
                       vocab_size=32000, attention_dropout=0.0)
    windowed = dataclasses.replace(full, window_size="255,0", window_attn_skip_freq=3)
    B, s, a, d = 8, full.seq_length, full.num_attention_heads, full.head_dim
    saved = 3 * 4 * B * s * s * a * d * (1 - pair_fraction(s, 255)) * 4   # 4 windowed layers
    assert model_flops_per_iteration(full, B, recompute=None) - \
        model_flops_per_iteration(windowed, B, recompute=None) == pytest.approx(saved)
    layout, profile = Layout(d=8, b=1), load_profile("h100")
    assert evaluate_layout(Workload(windowed, B, "bf16"), layout, profile).seconds < \
        evaluate_layout(Workload(full, B, "bf16"), layout, profile).seconds


def test_a_checkpoint_keeps_the_sinks_and_the_window(tmp_path):
    """Saved and loaded, a model with learnable sinks and windows resumes
    with the same sinks; the checkpoint records the window settings."""
    from ptdp.checkpoint.store import read_metadata, resolve

    config = runner.layout_config(MODELS, Layout())
    trainer = Trainer(config, ParallelContext.single(), CPU)
    trainer.step(0)
    trainer.save(str(tmp_path), 1)
    resumed = Trainer(runner.layout_config(MODELS, Layout()), ParallelContext.single(), CPU,
                      start=(1, 4))
    resumed.load(str(tmp_path))
    for before, after in zip(trainer.model.modules(), resumed.model.modules()):
        if hasattr(before, "sinks"):
            assert torch.equal(before.sinks, after.sinks)
    model = read_metadata(resolve(tmp_path))["config"]["model"]
    assert (model["window_size"], model["window_attn_skip_freq"], model["softmax_type"]) == \
        ("3,0", 3, "learnable")
