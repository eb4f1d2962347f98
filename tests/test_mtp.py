"""Multi-token prediction (--mtp-num-layers, issue 44).

- The model's MTP losses, and the gradients of the main loss plus their
  weighted mean, equal a reference written here from the definition with
  plain tensors (D = 1 and 2): depth k embeds the tokens k places ahead,
  norms them and the previous hidden state, concatenates [embedding,
  hidden], projects 2h -> h, runs one transformer layer and a final norm,
  and takes the cross entropy of the shared output layer against the
  tokens k + 1 places ahead, over the positions that have one. The
  reference cuts the sequence instead of shifting and masking it (a causal
  layer's first positions do not see the rest), so it shares no shift
  code with the model. --mtp-num-layers 0 is the model without MTP exactly.
- Layouts in one pooled call of four processes train as one process does
  (main and MTP losses, gradient norms over three steps, final weights):
  t = 2 with sequence parallelism, p = 2 interleaved with full
  recomputation, d = 2 with the distributed optimizer, p = 2 under zbv
  (the MTP modules on rank 0 with the embedding), context parallelism,
  an MoE model, an untied output layer (the last stage's own copy of the
  word embedding), ZeRO-3.
- A packed batch's MTP losses equal its documents' run one by one.
- Bad settings are refused before launch, one paragraph each; the log
  line names each depth's loss as Megatron-LM does.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ptdp.config import ConfigError, ModelConfig, validate
from ptdp.parallel.document_attention import Documents
from ptdp.parallel.topology import ParallelContext
from ptdp.train.loop import Trainer
from ptdp.train.report import format_log_line
from tests import layouts_runner as runner
from tests import test_moe_parallel as moe
from tests import test_ptdp_step as step
from tests.test_gpt import _build

CPU = torch.device("cpu")
ROPE = dataclasses.replace(step.MODEL, position_embedding_type="rope", mtp_num_layers=2,
                           mtp_loss_scaling_factor=0.3)
LLAMA = dataclasses.replace(ROPE, normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
                            disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                            mtp_num_layers=1)
MOE = dataclasses.replace(moe.MOE, position_embedding_type="rope", mtp_num_layers=1,
                          moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
MODELS = {"rope": ROPE, "llama": LLAMA, "moe": MOE}


# --------------------------------------------------------------------------- the definition

def _norm(module, x):
    """The model's norm, from its weights (LayerNorm or RMSNorm)."""
    if getattr(module, "bias", None) is not None:
        return F.layer_norm(x, x.shape[-1:], module.weight, module.bias, module.eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight


def _reference_losses(model, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Depth k's loss for a [b, s + 1] sample, from the definition: the
    positions i = 0 .. s - k - 1 have a target (token i + k + 1); the layer
    is causal, so it runs on those positions alone."""
    s = tokens.shape[1] - 1
    word = model.embedding.word_embeddings.weight[:model.config.vocab_size]
    output = model.output_matrix.weight[:model.config.vocab_size]
    hidden = model.final_layernorm(model._run_layers(model.embedding(tokens[:, :s])))
    losses = []
    for k in range(1, depth + 1):
        layer = model.mtp.layers[k - 1]
        n = s - k
        embedded = word[tokens[:, k:k + n]].transpose(0, 1)           # tokens k places ahead
        joined = torch.cat([_norm(layer.enorm, embedded), _norm(layer.hnorm, hidden[:n])], -1)
        hidden = _norm(layer.final_layernorm,
                       layer.transformer_layer(joined @ layer.eh_proj.weight.T))
        logits = hidden @ output.T
        targets = tokens[:, k + 1:k + 1 + n].transpose(0, 1)          # tokens k + 1 places ahead
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
    return losses


@pytest.mark.parametrize("depth, config", [(1, ROPE), (2, ROPE), (1, LLAMA)])
def test_the_mtp_losses_and_their_gradients_follow_the_definition(depth, config):
    config = dataclasses.replace(config, mtp_num_layers=depth)
    torch.manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1))
    model = _build(config, ParallelContext.single()).train()
    returned = model(tokens[:, :-1], tokens[:, 1:])
    [got] = model.mtp.take_losses()
    main = F.cross_entropy(model.logits(model.final_layernorm(model._run_layers(
        model.embedding(tokens[:, :-1])))).flatten(0, 1)[:, :config.vocab_size],
        tokens[:, 1:].transpose(0, 1).flatten())
    want = _reference_losses(model, tokens, depth)
    assert_close(returned, main, rtol=1e-6, atol=0)                # the reported loss: the main one
    assert_close(got, torch.stack(want).detach(), rtol=1e-5, atol=0)
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(returned, params, allow_unused=True)
    total = main + config.mtp_loss_scaling_factor / depth * torch.stack(want).sum()
    want_grads = torch.autograd.grad(total, params, allow_unused=True)
    for (name, _), g, w in zip(model.named_parameters(), grads, want_grads):
        assert (g is None) == (w is None), name
        if g is not None:
            assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert any(g is not None and g.abs().sum() > 0 for (name, _), g in
               zip(model.named_parameters(), grads) if name.startswith("mtp.layers.0.eh_proj"))


def test_zero_mtp_layers_is_the_model_without_mtp_exactly():
    plain = dataclasses.replace(ROPE, mtp_num_layers=None)
    records = {}
    for depth in (None, 0):
        trainer = Trainer(step._config(model=dataclasses.replace(plain, mtp_num_layers=depth)),
                          ParallelContext.single(), CPU)
        assert not any(name.startswith("mtp") for name, _ in trainer.model.named_parameters())
        records[depth] = [trainer.step(i)[0] for i in range(2)]
    for a, b in zip(records[None], records[0]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
        assert not any(key.startswith("mtp_") for key in b)


# --------------------------------------------------------------------------- layouts

# The settings of each layout: tests.layouts_runner.Layout, this file's model by default.
Layout = functools.partial(runner.Layout, model="rope")

LAYOUTS = [
    Layout(t=2, d=2, sequence_parallel=True),
    Layout(p=2, d=2, k=1, recompute="full", distributed=True),
    Layout(t=2, p=2, sequence_parallel=True, schedule="zbv", model="llama"),
    Layout(p=2, c=2, schedule="zbv", recompute="full"),
    Layout(c=2, t=2, sequence_parallel=True),
    Layout(c=2, p=2, model="llama"),
    Layout(t=2, d=2, ep=2, sequence_parallel=True, model="moe"),
    Layout(p=2, d=2, recompute="selective", model="llama", sharding="optim_grads_params"),
]


def test_mtp_trains_like_one_process_under_every_layout(pools):
    references = runner.one_process_runs(MODELS, LAYOUTS)
    for (model, _), (records, weights) in references.items():
        depth = MODELS[model].mtp_num_layers
        assert all(f"mtp_{k} loss" in r for r in records for k in range(1, depth + 1)), model
        assert sum(name.endswith("eh_proj.weight") for name in weights) == depth
    per_rank = runner.train_under_layouts(pools, MODELS, LAYOUTS, references)
    for i, layout in enumerate(LAYOUTS):
        mtp_ranks = [r for r, results in enumerate(per_rank)
                     if any(n.startswith("mtp.") for n in results[i].names)]
        assert mtp_ranks and all(per_rank[r][i].holds_loss for r in mtp_ranks), layout.name


# --------------------------------------------------------------------------- packed documents

@pytest.mark.parametrize("config", [dataclasses.replace(ROPE, position_embedding_type="learned_absolute"),
                                    ROPE])
def test_a_packed_batch_s_mtp_losses_are_its_documents_run_one_by_one(config):
    """Three documents in one sequence (positions restarting, attention kept
    inside each): each depth's loss is the token-weighted mean of the
    documents' own, each run alone with its own labels (a target past a
    document's end, which the packed run would draw from the next one, is
    left out)."""
    lengths = (6, 5, 5)
    torch.manual_seed(5)
    tokens = torch.randint(0, config.vocab_size, (1, sum(lengths) + 1))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model = _build(config, ParallelContext.single()).train()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model(inputs, labels, documents=Documents(positions, ids))
    [packed] = model.mtp.take_losses()
    sums, counts, start = torch.zeros(2), torch.zeros(2), 0
    for n in lengths:
        model(inputs[:, start:start + n], labels[:, start:start + n])
        [alone] = model.mtp.take_losses()
        for k in (1, 2):
            sums[k - 1] += alone[k - 1] * (n - k)
            counts[k - 1] += n - k
        start += n
    assert_close(packed, sums / counts, rtol=1e-5, atol=0)
    model(inputs, labels)  # unpacked: other numbers, so the documents count
    assert (model.mtp.take_losses()[0] - packed).abs().max() > 1e-3


# --------------------------------------------------------------------------- refusals, logging

@pytest.mark.parametrize("settings, parallel, lora, says", [
    ({"mtp_num_layers": -1}, {}, None, "--mtp-num-layers -1: give the number of multi-token"),
    ({"mtp_loss_scaling_factor": float("nan")}, {}, None,
     "--mtp-loss-scaling-factor=nan is not a finite number"),
    ({"mtp_loss_scaling_factor": -0.1}, {}, None, "the MTP loss's weight must be 0 or more"),
    ({"position_embedding_type": "learned_absolute"}, {"pipeline_model_parallel_size": 2}, None,
     "own copy of the learned position table"),
    ({}, {}, 4, "with --lora-rank: ptdp's adapters do not reach the MTP modules"),
])
def test_bad_mtp_settings_are_refused_in_one_paragraph(settings, parallel, lora, says):
    config = step._config(model=dataclasses.replace(ROPE, **settings))
    config.parallel = dataclasses.replace(config.parallel, **parallel)
    if lora is not None:
        config.lora = dataclasses.replace(config.lora, lora_rank=lora)
    with pytest.raises(ConfigError) as refused:
        validate(config, world_size=config.parallel.pipeline_model_parallel_size)
    assert len(refused.value.problems) == 1 and says in refused.value.problems[0], \
        refused.value.problems


def test_the_log_line_and_tensorboard_name_each_depth_s_loss_as_megatron_lm_does(tmp_path):
    record = {"iteration": 3, "consumed_samples": 12, "loss": 4.5, "mtp_1 loss": 4.61,
              "mtp_2 loss": 4.75, "lr": 1e-3, "grad_norm": 1.0, "iteration_ms": 5.0,
              "tokens_per_s": 100.0}
    line = format_log_line(record, 10)
    assert "loss 4.5000 | mtp_1 loss 4.6100 | mtp_2 loss 4.7500 | lr" in line
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ptdp.train.report import TensorBoardLogger

    with TensorBoardLogger(tmp_path / "tb") as logger:
        logger.log(record)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("mtp_2 loss")] == [(3, 4.75)]
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("mtp_1 loss")] == [(3, 4.61)]


# --------------------------------------------------------------------------- shapes, FLOPs

@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_logical_shapes_name_every_mtp_parameter(model):
    from ptdp.model.shapes import logical_shapes, state_shapes

    config = MODELS[model]
    if model == "moe":
        config = dataclasses.replace(config, moe_router_enable_expert_bias=True,
                                     moe_router_score_function="sigmoid")
    built = _build(config, ParallelContext.single())
    vocab = config.padded_vocab_size(1)
    got = {name: tuple(p.shape) if p.shape[0] != vocab else (config.vocab_size, *p.shape[1:])
           for name, p in built.named_parameters()}
    assert got == logical_shapes(config)
    assert sum(name.startswith("mtp.layers.") for name in got) > 0
    biases = {name: tuple(b.shape) for name, b in built.named_buffers() if "expert_bias" in name}
    assert biases == state_shapes(config)


def test_the_flop_count_adds_each_mtp_module_s_projection_layer_and_output_layer():
    from ptdp.perf.analytic.flops import model_flops_per_iteration

    B, s, h, V = 8, ROPE.seq_length, ROPE.hidden_size, ROPE.vocab_size
    layer = 24 * B * s * h * h + 4 * B * s * s * h          # GPT-2's options: the paper's layer
    module = 2 * B * s * 2 * h * h + layer                     # the projection and the layer
    plain = dataclasses.replace(ROPE, mtp_num_layers=None)
    for recompute, extra in ((None, 0), ("selective", 4 * B * s * s * h), ("full", module)):
        added = (model_flops_per_iteration(ROPE, B, recompute=recompute)
                 - model_flops_per_iteration(plain, B, recompute=recompute))
        assert added == pytest.approx(2 * (3 * (module + 2 * B * s * h * V) + extra)), recompute


@pytest.mark.parametrize("t, p, v", [(2, 1, 1), (2, 2, 1), (1, 2, 2)])
@pytest.mark.parametrize("untied", [False, True])
def test_parameter_counts_include_the_mtp_modules(t, p, v, untied):
    """The planner's counts (ptdp.perf.analytic.mtp): the logical total and
    each pipeline rank's elements equal the built models', the last stage
    holding the modules (and, untied at p > 1, its copy of the embedding)."""
    from ptdp.model.gpt import GPT
    from ptdp.parallel.tensor import RNGStreams
    from ptdp.perf.analytic import counts as analytic
    from ptdp.perf.layout import Layout
    from ptdp.train.banner import count_parameters
    from tests.test_llama_perf import _held_by_each_rank

    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=100, make_vocab_size_divisible_by=4, mtp_num_layers=2,
                        normalization="RMSNorm", position_embedding_type="rope",
                        untie_embeddings_and_output_weights=untied)
    gpt = GPT(model, ParallelContext.single(), RNGStreams(torch.device("cpu")))
    assert count_parameters(gpt) == analytic.parameter_count(model)
    per_rank = analytic.parameters_per_rank(model, Layout(t=t, p=p, v=v))
    for (pp, _), held in _held_by_each_rank(model, t, p, v).items():
        assert held == per_rank[pp], (pp, held, per_rank)


@pytest.mark.parametrize("extra, flag", [
    ({"mtp_num_layers": 1}, "--mtp-num-layers: checkpoint 1, requested 0"),
    ({"multi_latent_attention": True, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_head_dim": 8,
      "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "qk_layernorm": True, "mtp_num_layers": 1},
     "--multi-latent-attention: checkpoint True, requested False"),
])
def test_checkpoints_keep_mtp_and_mla(tmp_path, extra, flag):
    """A checkpoint with MTP modules (or MLA) loads only into a model that
    has them, never silently dropping them; --use-checkpoint-args takes
    MTP's depth and loss factor and MLA's widths and rotation from it."""
    from ptdp.checkpoint.args import with_checkpoint_shape
    from ptdp.checkpoint.store import (CheckpointError, check_model_fits, read_metadata,
                                       resolve, save_logical_model)
    from ptdp.config import Config, DataConfig, TrainConfig
    from ptdp.model.gpt import GPT
    from ptdp.parallel.tensor import RNGStreams

    base = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       vocab_size=64, make_vocab_size_divisible_by=8,
                       position_embedding_type="rope")
    model = dataclasses.replace(base, mtp_loss_scaling_factor=0.3, **extra)
    gpt = GPT(model, ParallelContext.single(), RNGStreams(torch.device("cpu"))).initialize(5)
    logical = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    logical["embedding.word_embeddings.weight"] = logical["embedding.word_embeddings.weight"][:64]
    save_logical_model(tmp_path / "ckpt", Config(model=model, data=DataConfig(mock_data=True)),
                       logical)
    directory = resolve(tmp_path / "ckpt")
    check_model_fits(read_metadata(directory), model, directory)
    with pytest.raises(CheckpointError, match=flag):
        check_model_fits(read_metadata(directory), base, directory)
    config = Config(model=base, data=DataConfig(mock_data=True),
                    train=TrainConfig(load=str(tmp_path / "ckpt"), use_checkpoint_args=True))
    taken = with_checkpoint_shape(config, explicit=["train.load", "train.use_checkpoint_args"])
    assert taken.model.mtp_depth == 1 and taken.model.mtp_loss_scaling_factor == 0.3
    for name, value in extra.items():
        assert getattr(taken.model, name) == value, name
    check_model_fits(read_metadata(directory), taken.model, directory)
