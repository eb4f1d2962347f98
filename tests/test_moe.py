"""The MoE layer on one process against outside references: transformers'
Mixtral and Qwen3-MoE sparse blocks (same weights: output and gradients
within 1e-5 in fp32), its load-balancing function, hand computations of
Megatron-Core's rules (aux loss, z-loss, capacity, group-limited routing,
sigmoid scores), and a small GPT with MoE layers that trains."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.model.moe import MoELayer, balancing_scores, switch_loss, top_k_counts
from ptdp.model.shapes import logical_shapes
from ptdp.parallel.sharding import (SHARD_ATTR, gather_logical, initialize_parameters,
                                   logical_shape, shard_group)
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests.test_moe_parallel import ADAM_EPS, MOE

transformers = pytest.importorskip("transformers")

H, F_EXPERT, E, K = 16, 24, 4, 2
CPU = torch.device("cpu")


def _config(**moe) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=8, vocab_size=64,
                swiglu=True, ffn_hidden_size=32, disable_bias_linear=True, hidden_dropout=0.0,
                attention_dropout=0.0, num_experts=E, moe_ffn_hidden_size=F_EXPERT,
                moe_router_topk=K)
    base.update(moe)
    return ModelConfig(**base)


def _layer(config: ModelConfig, seed: int = 3) -> MoELayer:
    layer = MoELayer(config, ParallelContext.single(), RNGStreams(CPU))
    initialize_parameters(layer, seed)
    with torch.no_grad():  # a router that prefers some experts, so ties never decide
        layer.router.weight.mul_(20.0)
    return layer


def _hf_block(kind: str, layer: MoELayer, **config):
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = MixtralConfig(hidden_size=H, intermediate_size=F_EXPERT, num_local_experts=E,
                            num_experts_per_tok=K, hidden_act="silu", **config)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_EXPERT, intermediate_size=32,
                             num_experts=E, num_experts_per_tok=K, hidden_act="silu", **config)
    cfg._experts_implementation = "eager"
    block = Block(cfg).float()
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        # ours: [gate rows | up rows] per expert, as transformers' gate_up_proj
        block.experts.gate_up_proj.copy_(torch.stack(
            [layer.experts[str(e)].dense_h_to_4h.weight for e in range(E)]))
        block.experts.down_proj.copy_(torch.stack(
            [layer.experts[str(e)].dense_4h_to_h.weight for e in range(E)]))
    return block


@pytest.mark.parametrize("kind,moe,hf", [
    ("mixtral", {}, {}),                                       # top-2 of the logits, softmax over those
    ("qwen3", {}, {"norm_topk_prob": True}),                   # the same, renormalised
    ("qwen3", {"moe_router_pre_softmax": True}, {"norm_topk_prob": False}),  # softmax, then top-k
])
def test_the_moe_layer_equals_transformers_sparse_blocks(kind, moe, hf):
    layer = _layer(_config(**moe))
    block = _hf_block(kind, layer, **hf)
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(0))  # [s, b, h]
    ours_x, theirs_x = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    ours, bias = layer(ours_x)
    assert bias is None
    theirs = block(theirs_x).transpose(0, 1)
    assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    assert_close(ours_x.grad, theirs_x.grad.transpose(0, 1), rtol=1e-5, atol=1e-6)
    assert_close(layer.router.weight.grad, block.gate.weight.grad, rtol=1e-5, atol=1e-6)
    for e in range(E):
        assert_close(layer.experts[str(e)].dense_h_to_4h.weight.grad,
                     block.experts.gate_up_proj.grad[e], rtol=1e-5, atol=1e-6)
        assert_close(layer.experts[str(e)].dense_4h_to_h.weight.grad,
                     block.experts.down_proj.grad[e], rtol=1e-5, atol=1e-6)


def test_the_aux_loss_is_transformers_and_megatron_core_s_formula():
    """transformers' load_balancing_loss_func counts top-k assignments over
    T (Σ f = k); Megatron-Core's over k·T: theirs = k · ours. By hand:
    E/(k·T²) · Σ_e (Σ_t S_te) · c_e."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(12, E, generator=torch.Generator().manual_seed(2))
    scores = balancing_scores(logits, _config())
    ours = switch_loss(scores, K)
    theirs = load_balancing_loss_func((logits,), E, K)
    assert_close(K * ours, theirs, rtol=1e-6, atol=0)
    counts = torch.zeros(E)
    for row in scores:
        counts[row.topk(K).indices] += 1
    by_hand = E / (K * 12 ** 2) * sum(scores[:, e].sum() * counts[e] for e in range(E))
    assert_close(ours, by_hand, rtol=1e-6, atol=0)
    assert_close(switch_loss(torch.full((12, E), 1 / E), K), torch.tensor(1.0))  # uniform: 1


def test_balancing_losses_shape_the_gradient_not_the_output():
    """With aux loss and z-loss on, the output is unchanged and the router's
    gradient is the main loss's plus coeff · scale · ∇(each loss)."""
    coeff, z_coeff, scale = 0.1, 0.01, 0.25
    plain = _layer(_config())
    balanced = _layer(_config(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff))
    balanced.aux_loss_scale = scale
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(4))
    out_plain, _ = plain(x)
    out_balanced, _ = balanced(x)
    assert torch.equal(out_plain, out_balanced)
    out_plain.sum().backward()
    out_balanced.sum().backward()
    weight = balanced.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, H) @ weight.t()
    extra = coeff * switch_loss(balancing_scores(logits, balanced.config), K) \
        + z_coeff * torch.logsumexp(logits, dim=-1).square().mean()
    (expected,) = torch.autograd.grad(extra * scale, weight)
    assert_close(balanced.router.weight.grad - plain.router.weight.grad, expected, rtol=1e-4,
                 atol=1e-7)
    metrics = balanced.take_metrics()
    assert set(metrics) == {"load_balancing_loss", "z_loss", "tokens_per_expert", "assigned"}
    assert len(metrics["z_loss"]) == 1


def test_capacity_drops_by_probability_or_by_position():
    """T = 8 tokens, k = 1, E = 4, factor 0.5: capacity ceil(8/4 · 0.5) = 1
    token per expert; 'probs' keeps each expert's most probable token,
    'position' its first."""
    for policy in ("probs", "position"):
        layer = _layer(_config(moe_router_topk=1, moe_router_pre_softmax=True,
                               moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy))
        logits = torch.randn(8, E, generator=torch.Generator().manual_seed(5))
        routing = layer.router.route(logits)
        full = torch.softmax(logits, dim=-1)
        choice = full.argmax(dim=-1)
        for e in range(E):
            mine = (choice == e).nonzero().squeeze(1)
            kept = routing.routed[:, e].nonzero().squeeze(1)
            if mine.numel() == 0:
                assert kept.numel() == 0
                continue
            expected = mine[full[mine, e].argmax()] if policy == "probs" else mine[0]
            assert kept.tolist() == [expected.item()], (policy, e)
            assert routing.probs[kept, e].item() == pytest.approx(full[expected, e].item())
        assert (routing.probs[~routing.routed] == 0).all()


def test_sigmoid_scores_group_limited_routing_and_scaling():
    layer = _layer(_config(num_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                           moe_router_num_groups=4, moe_router_group_topk=1,
                           moe_router_topk_scaling_factor=2.5))
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(6))
    routing = layer.router.route(logits)
    scores = torch.sigmoid(logits)
    for t in range(6):
        groups = scores[t].view(4, 2)
        best_group = groups.topk(2, dim=-1).values.sum(-1).argmax()  # top k/group_k = 2 per group
        experts = [2 * best_group.item(), 2 * best_group.item() + 1]
        assert routing.routed[t].nonzero().squeeze(1).tolist() == experts
        chosen = scores[t, experts]
        assert_close(routing.probs[t, experts], 2.5 * chosen / chosen.sum())


def test_forced_balancing_routes_by_draws_of_layer_and_position_with_the_real_gradient():
    """--moe-router-force-load-balancing: the routes are the top-k of
    standard normal draws, one per (layer, position, expert), whatever the
    router's weights or the tokens; the same draws for every sequence of the
    batch; the gradient still reaches the router's weights (through the
    logits, unchanged); over many positions the experts' loads are even."""
    from ptdp.model.router_noise import balanced_logits

    s, b = 512, 2
    config = _config(num_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                     moe_router_force_load_balancing=True)
    layer = _layer(config)
    layer.layer_id = 3
    x = torch.randn(s, b, H, generator=torch.Generator().manual_seed(1))
    flat, routing = layer._route(x)
    draws = balanced_logits(torch.arange(s), 3, 8)
    want = torch.zeros(s, 8, dtype=torch.bool).scatter(1, draws.topk(2, dim=1).indices, True)
    assert torch.equal(routing.routed, want.repeat_interleave(b, dim=0))
    assert not torch.equal(balanced_logits(torch.arange(s), 4, 8), draws)  # per layer
    assert abs(draws.mean().item()) < 0.05 and abs(draws.std().item() - 1) < 0.05
    loads = routing.routed.sum(dim=0).float()
    assert loads.max() / loads.min() < 1.3, loads  # a skewed router would load a few experts
    (routing.probs * torch.randn(s * b, 8, generator=torch.Generator().manual_seed(2))).sum() \
        .backward()
    assert layer.router.weight.grad.abs().sum() > 0
    unforced = _layer(dataclasses.replace(config, moe_router_force_load_balancing=False))
    assert not torch.equal(unforced._route(x)[1].routed, routing.routed)


def test_moe_layers_follow_the_layer_pattern_and_the_logical_shapes():
    config = _config(num_layers=4, moe_layer_freq="([0]+[1]*3)",
                     moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True)
    from ptdp.model.gpt import GPT

    model = GPT(config, ParallelContext.single(), RNGStreams(CPU))
    kinds = [type(model.layers[str(i)].mlp).__name__ for i in range(4)]
    assert kinds == ["MLP", "MoELayer", "MoELayer", "MoELayer"]
    params = {name: logical_shape(p) for name, p in model.named_parameters()}
    assert params == logical_shapes(config)  # (logical: the vocabulary unpadded)
    assert params["layers.1.mlp.experts.3.dense_h_to_4h.weight"] == (2 * F_EXPERT, H)
    assert params["layers.1.mlp.shared_expert_gate"] == (1, H)


def _small_moe_run(steps: int, **train) -> list[float]:
    model = _config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=128, ffn_hidden_size=64, moe_ffn_hidden_size=32,
                    moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                    moe_shared_expert_intermediate_size=32)
    config = Config(model=model, data=DataConfig(mock_data=True),
                    train=TrainConfig(micro_batch_size=4, global_batch_size=8, train_iters=30,
                                      lr=1e-2, seed=3, **train))
    trainer = Trainer(config, ParallelContext.single(), CPU)
    return [trainer.step(i)[0]["loss"] for i in range(steps)]


def test_a_small_moe_gpt_trains():
    losses = _small_moe_run(30)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3


@pytest.mark.parametrize("precision", [{"bf16": True}, {"fp16": True, "initial_loss_scale": 1024.0}],
                         ids=["bf16", "fp16"])
def test_mixed_precision_moe_tracks_fp32(precision):
    """bf16/fp16 weights with the router in fp32 (--moe-router-dtype's
    default), fp16 with a loss scale that needs no back-off (no step
    skipped): the losses of 8 steps stay within 2 % of fp32's. (The
    t = p = d = 2 tests check the balancing losses' backward scale in fp32,
    its 1/microbatches part; its fp16 loss-scale factor is not checked on
    its own.)"""
    reference = _small_moe_run(8)
    losses = _small_moe_run(8, **precision)
    assert losses == pytest.approx(reference, rel=2e-2)


# ------------------------------------------------------------------ under parallel layouts

# MOE (test_moe_parallel's model): E = 8, top-2, SwiGLU, a gated shared
# expert, balancing coefficients large enough that a wrong scale shows, a
# dense first layer (a stage may hold no MoE layer).


STEPS = 3  # (5 in the dense tests; the suite's time is shared)


def _moe_vs_serial(rank, k, distributed, sequence_parallel, recompute=None, schedule="1f1b",
                   expert_parallel=1, steps=STEPS):
    """t = p = d = 2 (expert tensor-parallel size t) against one process over
    `steps` AdamW steps (warm-up, cosine decay, clipping, weight decay; Adam's
    eps 1e-6, see test_moe_parallel.ADAM_EPS):
    losses, gradient norms and the balancing losses (rtol 1e-5), and every
    weight within test_ptdp_step's 1e-5 (observed 6.4e-7). The balancing
    coefficients are large so that a wrong backward scale of those losses
    fails here (a factor of 2 fails every case). Returns the largest weight
    difference."""
    from tests import test_ptdp_step as step

    model = dataclasses.replace(MOE, recompute_granularity=recompute)
    ctx = ParallelContext.build(RankGrid(tp=2, dp=2, pp=2, ep=expert_parallel))
    config = step._config(2, 2, 2, k, model, sequence_parallel,
                          use_distributed_optimizer=distributed, adam_eps=ADAM_EPS)
    config.parallel.pipeline_schedule = schedule
    config.parallel.expert_model_parallel_size = expert_parallel
    trainer = Trainer(config, ctx, CPU)
    records = [trainer.step(i)[0] for i in range(steps)]

    def serial_run():
        serial = Trainer(step._config(model=model, use_distributed_optimizer=distributed,
                                      adam_eps=ADAM_EPS), ParallelContext.single(), CPU)
        expected = [serial.step(i)[0] for i in range(steps)]
        return expected, step._logical_weights(serial, ParallelContext.single())
    expected, serial_weights = step.computed_once(serial_run)
    for got, want in zip(records, expected):
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        for name in ("load_balancing_loss", "z_loss"):
            assert got[name] == pytest.approx(want[name], rel=1e-5), name
        if trainer.holds_loss:  # the last stage, or rank 0 under zbv
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    worst = 0.0
    for chunk in trainer.chunks:
        for name, param in chunk.named_parameters():
            weight = gather_logical(param.detach().float(), getattr(param, SHARD_ATTR, None),
                                    shard_group(param, ctx))
            assert_close(weight, serial_weights[name], **step.WEIGHT_TOL,
                         msg=lambda m, name=name: f"{name}: {m}")
            worst = max(worst, (weight - serial_weights[name]).abs().max().item())
    assert len(serial_weights) == len(logical_shapes(model))
    return worst


@pytest.mark.parametrize("k,distributed,sequence_parallel,recompute,schedule,ep,steps", [
    # the first stage without an MoE layer; the balancing losses recorded once under recomputation
    (None, False, True, "full", "1f1b", 1, STEPS),
    # interleaved, distributed optimizer, EP 2 × ETP 2 over a stage's t·d = 4 ranks, 5 steps
    (1, True, True, None, "1f1b", 2, 5),
    (None, True, False, None, "zbv", 1, STEPS),  # tokens replicated over t (no sequence parallelism)
], ids=["1f1b-sp-full-recompute", "interleaved-distopt-sp-ep2", "zbv-distopt"])
def test_moe_trains_like_one_process_at_t_p_d_2(pools, k, distributed, sequence_parallel,
                                                recompute, schedule, ep, steps):
    worst = max(pools(8).run(_moe_vs_serial, k, distributed, sequence_parallel, recompute,
                             schedule, ep, steps))
    print(f"largest weight difference: {worst:.2e}")


def test_recomputation_records_the_balancing_losses_once():
    from ptdp.model.gpt import GPT

    config = _config(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, recompute_granularity="full")
    model = GPT(config, ParallelContext.single(), RNGStreams(CPU))
    initialize_parameters(model, 5)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    model(tokens, labels=tokens).backward()  # the backward recomputes every layer
    for i in range(2):
        metrics = model.layers[str(i)].mlp.take_metrics()
        assert {name: len(values) for name, values in metrics.items()} == \
            {"load_balancing_loss": 1, "z_loss": 1, "tokens_per_expert": 1, "assigned": 1}


def test_flops_count_the_active_experts():
    """Per MoE layer the MLP's 6·B·s·h·(up + 1)·f becomes 6·B·s·h·(E +
    k·(up + 1)·f_moe + (up + 1)·f_shared): the router, the k routed experts
    and the shared expert (SwiGLU: up = 2)."""
    from ptdp.perf.analytic.flops import model_flops_per_iteration

    moe = _config(num_layers=2, moe_layer_freq="[0,1]", moe_shared_expert_intermediate_size=8)
    dense = dataclasses.replace(moe, num_experts=None, moe_ffn_hidden_size=None,
                                moe_router_topk=2, moe_layer_freq=1,
                                moe_shared_expert_intermediate_size=None)
    B, s = 4, moe.seq_length
    difference = (model_flops_per_iteration(moe, B, recompute=None)
                  - model_flops_per_iteration(dense, B, recompute=None))
    assert difference == 6 * B * s * H * (E + K * 3 * F_EXPERT + 3 * 8 - 3 * 32)


def test_parameter_count_counts_every_expert():
    from ptdp.model.gpt import GPT
    from ptdp.perf.analytic.counts import parameter_count

    config = _config(num_layers=3, moe_layer_freq=2, moe_shared_expert_intermediate_size=8,
                     moe_shared_expert_gate=True, untie_embeddings_and_output_weights=True)
    model = GPT(config, ParallelContext.single(), RNGStreams(CPU))
    built = sum(math.prod(logical_shape(p)) for p in model.parameters())
    assert parameter_count(config) == built


def test_expert_biases_are_saved_loaded_and_used_by_generation(tmp_path):
    """Aux-loss-free balancing's biases are model state: a checkpoint holds
    them (as model/<name>), a resumed run and `ptdp generate`'s model get them."""
    from ptdp.generate import PipelinedModel
    from ptdp.checkpoint.store import load_logical_model

    model = _config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=128, ffn_hidden_size=64, moe_ffn_hidden_size=32,
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.1, moe_aux_loss_coeff=0.0)
    config = Config(model=model, data=DataConfig(mock_data=True),
                    train=TrainConfig(micro_batch_size=4, global_batch_size=8, train_iters=4,
                                      lr=1e-2, seed=3))
    trainer = Trainer(config, ParallelContext.single(), CPU)
    for i in range(2):
        trainer.step(i)
    biases = {name: buffer.clone() for name, buffer in trainer.model.named_buffers()
              if name.endswith("expert_bias")}
    assert len(biases) == 2 and any(b.abs().max() > 0 for b in biases.values())
    checkpoint = trainer.save(tmp_path / "ckpt", 2)
    resumed = Trainer(config, ParallelContext.single(), CPU, start=(2, 16))
    resumed.load(str(checkpoint))
    assert {name: buffer for name, buffer in resumed.model.named_buffers()
            if name.endswith("expert_bias")}.keys() == biases.keys()
    for name, buffer in resumed.model.named_buffers():
        if name in biases:
            assert torch.equal(buffer, biases[name])
    saved_config, weights, _ = load_logical_model(checkpoint)
    generation = PipelinedModel(saved_config, ParallelContext.single(), CPU, weights)
    generated = {f"0.{name}": buffer for name, buffer in generation.chunks[0].named_buffers()
                 if name.endswith("expert_bias")}
    assert generated.keys() == biases.keys()
    for name, buffer in generated.items():
        assert torch.equal(buffer, biases[name])


def test_the_log_reports_how_evenly_the_experts_were_loaded():
    """The busiest and idlest expert's shares of the tokens the experts took
    (all MoE layers of the global batch), and under a capacity factor the
    fraction of the top-k's assignments dropped: counted here by hand from
    the layers' own routing."""
    from ptdp.model.moe import MoELayer
    from ptdp.train.report import format_log_line

    model = _config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=128, ffn_hidden_size=64, moe_ffn_hidden_size=32,
                    moe_expert_capacity_factor=1.0)
    config = Config(model=model, data=DataConfig(mock_data=True),
                    train=TrainConfig(micro_batch_size=4, global_batch_size=8, train_iters=2,
                                      lr=1e-2, seed=3))
    trainer = Trainer(config, ParallelContext.single(), CPU)
    seen = []
    for layer in trainer.model.modules():
        if isinstance(layer, MoELayer):
            original = layer.router.route
            layer.router.route = lambda logits, original=original: seen.append(original(logits)) \
                or seen[-1]
    record, _ = trainer.step(0)
    counts = torch.stack([routing.routed.sum(dim=0) for routing in seen]).double()
    per_layer = counts.view(2, 2, E).sum(dim=0)  # [microbatch, layer, expert], in forward order
    shares = per_layer / per_layer.sum(dim=1, keepdim=True)
    assert record["moe_busiest_expert_share"] == pytest.approx(shares.max().item())
    assert record["moe_idlest_expert_share"] == pytest.approx(shares.min().item())
    assigned = len(seen) * 4 * 16 * K
    assert record["moe_dropped_fraction"] == pytest.approx(1 - counts.sum().item() / assigned)
    assert 0 < record["moe_dropped_fraction"] < 0.5
    line = format_log_line(record, 2)
    assert (f"expert load {shares.min().item():.1%} to {shares.max().item():.1%}" in line
            and f"dropped {record['moe_dropped_fraction']:.2%}" in line)


@pytest.mark.parametrize("moe", [{}, {"swiglu": False, "disable_bias_linear": False}],
                         ids=["swiglu", "gelu-biases"])
def test_grouped_gemm_equals_one_product_per_expert(moe):
    """--moe-grouped-gemm: the same outputs and gradients as one product per
    expert, with a capacity factor, and an expert that no token reaches (an
    expert bias keeps it out)."""
    from ptdp.model.grouped_experts import grouped_gemm_used

    assert grouped_gemm_used((H, F_EXPERT, 2 * F_EXPERT), torch.float32)
    settings = dict(moe_expert_capacity_factor=0.75, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, **moe)
    looped = _layer(_config(**settings))
    grouped = _layer(_config(moe_grouped_gemm=True, **settings))
    assert grouped.grouped_gemm and not looped.grouped_gemm
    for layer in (looped, grouped):
        layer.router.expert_bias[E - 1] = -100.0
    x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(5))
    outs = []
    for layer in (looped, grouped):
        inputs = x.clone().requires_grad_()
        out, _ = layer(inputs)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        outs.append((out.detach(), inputs.grad))
    assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
    idle = 0
    for (name, a), (_, b) in zip(looped.named_parameters(), grouped.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
            idle += int(name.endswith("dense_h_to_4h.weight") and not a.grad.any())
    assert idle >= 1  # an expert no token reached still got its (zero) gradient


def test_the_global_aux_loss_uses_the_running_mean_of_the_counts():
    """global_aux_loss (Megatron-Core's): microbatch i's loss takes the mean of
    the top-k counts of microbatches 1..i (over the replicas; one here), and a
    new iteration starts the mean again."""
    layer = _layer(_config(moe_router_load_balancing_type="global_aux_loss",
                           moe_aux_loss_coeff=0.1))
    generator = torch.Generator().manual_seed(6)
    inputs = [torch.randn(8, 2, H, generator=generator) for _ in range(3)]
    for x in inputs:
        layer(x)
    recorded = [v.item() for v in layer.take_metrics()["global_load_balancing_loss"]]
    scores = [balancing_scores(x.reshape(-1, H) @ layer.router.weight.detach().t(), layer.config)
              for x in inputs]
    counts = [top_k_counts(S, K) for S in scores]
    for i, S in enumerate(scores):
        mean = torch.stack(counts[:i + 1]).mean(dim=0)
        by_hand = E / (K * 16 * 16) * (S.sum(dim=0) * mean).sum()
        assert recorded[i] == pytest.approx(by_hand.item(), rel=1e-6)
    assert recorded[1] != pytest.approx(switch_loss(scores[1], K).item(), rel=1e-6)
    layer.start_iteration()
    layer(inputs[1])
    assert layer.take_metrics()["global_load_balancing_loss"][0].item() == \
        pytest.approx(switch_loss(scores[1], K).item(), rel=1e-6)


def test_a_checkpoint_of_other_experts_is_refused_with_what_differs(tmp_path):
    """E, the MoE layers and the experts' widths are part of the model's
    shape: a checkpoint of other ones is refused, the settings named, and the
    message names --use-checkpoint-args."""
    from ptdp.checkpoint.store import CheckpointError, check_model_fits, read_metadata, resolve

    model = _config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=128, ffn_hidden_size=64, moe_ffn_hidden_size=32,
                    position_embedding_type="rope")
    config = Config(model=model, data=DataConfig(mock_data=True),
                    train=TrainConfig(micro_batch_size=4, global_batch_size=8, train_iters=1, lr=1e-2))
    directory = resolve(Trainer(config, ParallelContext.single(), CPU).save(tmp_path / "ckpt", 0))
    metadata = read_metadata(directory)
    check_model_fits(metadata, model, directory)  # the same model fits
    other = dataclasses.replace(model, num_experts=8, moe_layer_freq="([0]+[1])",
                                position_embedding_type="learned_absolute")
    with pytest.raises(CheckpointError) as refused:
        check_model_fits(metadata, other, directory)
    message = str(refused.value)
    for line in ("--max-position-embeddings: checkpoint none (rotary positions: no table), "
                 "requested 16",
                 f"--num-experts: checkpoint {E}, requested 8",
                 "--moe-layer-freq: checkpoint MoE layers [0, 1], requested MoE layers [1]",
                 "use the checkpoint's settings (--use-checkpoint-args takes them from it)"):
        assert line in message, message
    with pytest.raises(CheckpointError, match=r"--num-experts: checkpoint 4, requested none \(dense\)"):
        check_model_fits(metadata, dataclasses.replace(model, num_experts=None), directory)
