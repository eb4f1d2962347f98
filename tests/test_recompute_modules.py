"""--recompute-modules (Megatron-LM's selective recomputation by module)
changes memory, never numbers.

Each module, and all of them together, gives BITWISE the same losses,
gradients, random streams and MoE statistics (tokens per expert, balancing
losses: counted once, not again by the recomputation) as no recomputation,
over two steps with dropout on, on one process, for a dense GPT, an MoE GPT
(shared experts, aux and z losses, expert biases) and an MoE GPT with MLA
(with a query latent and without);
and holds fewer activation bytes after the forward. One pooled layout
(t = 2 with sequence parallelism, EP = 2, MLA, every module) trains like one
process. Bad values are refused, each in one paragraph.

Bytes held: the distinct storages that the forward saved for the backward,
parameters excluded, counted once the forward has returned (as
ptdp.perf.analytic.saved.SavedTensorBytes does, but at the end rather than
when each is saved: the output-discarding recomputation of layernorm,
moe_act and mla_up_proj frees storages after they were saved).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptdp.config import ConfigError, DataConfig, ModelConfig, validate
from ptdp.model.moe import MoELayer
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step
from tests.test_recompute import _assert_bitwise, _batch, _build

CPU = torch.device("cpu")
DENSE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.1,
                    attention_dropout=0.1)
MOE = dataclasses.replace(DENSE, swiglu=True, ffn_hidden_size=64, disable_bias_linear=True,
                          normalization="RMSNorm", num_experts=4, moe_ffn_hidden_size=32,
                          moe_router_topk=2, moe_shared_expert_intermediate_size=32,
                          moe_shared_expert_gate=True, moe_aux_loss_coeff=0.1,
                          moe_z_loss_coeff=0.01, moe_router_enable_expert_bias=True,
                          moe_router_score_function="sigmoid", moe_layer_freq="([0]+[1])")
MLA = dataclasses.replace(MOE, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8,
                          qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True,
                          position_embedding_type="rope", attention_dropout=0.0)
ALL = ["core_attn", "layernorm", "mlp", "moe_act", "shared_experts"]
CASES = {  # model, the module lists tried
    "dense": (DENSE, [["core_attn"], ["layernorm"], ["mlp"], ["core_attn", "layernorm", "mlp"]]),
    "moe": (MOE, [["moe"], ["moe_act"], ["shared_experts"], ["layernorm", "moe"], ALL]),
    "mla": (MLA, [["mla_up_proj"], ["mla_up_proj", "layernorm", "moe"], ALL + ["mla_up_proj"]]),
    # No query latent: the queries' up projection reads the discarded norm
    # output itself, refilled first (the nested discards' order).
    "mla-direct-query": (dataclasses.replace(MLA, q_lora_rank=None),
                         [["layernorm", "mla_up_proj"]]),
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _selective(config: ModelConfig, modules: list[str]) -> ModelConfig:
    return dataclasses.replace(config, recompute_granularity="selective",
                               recompute_modules=list(modules))


def _moe_statistics(model) -> dict:
    stats = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            for key, values in module.take_metrics().items():
                stats[f"{name}.{key}"] = torch.stack(values)
            stats[f"{name}.tokens_per_expert"] = module.router.tokens_per_expert.clone()
    return stats


def _held_bytes_and_train(config: ModelConfig, steps: int = 2) -> tuple[int, list[dict]]:
    """The bytes the first forward holds for backward (module docstring),
    then per step: loss, gradients, streams and MoE statistics."""
    model = _build(config, ParallelContext.single())
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    results, held = [], []
    for index in range(steps):
        model.zero_grad(set_to_none=True)
        tokens, labels = _batch(config, seed=11 + index)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
            loss = model(tokens, labels)
        if index == 0:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
            held_bytes = sum(n for ptr, n in storages.items() if ptr not in excluded)
        held.clear()
        loss.backward()
        results.append(dict(loss=loss.detach(), rng=model.rng.get_states(),
                            grads={n: p.grad.clone() for n, p in model.named_parameters()},
                            moe=_moe_statistics(model)))
    return held_bytes, results


@pytest.mark.parametrize("case", CASES)
def test_each_module_is_bitwise_equal_and_holds_less(case):
    model, module_lists = CASES[case]
    off, reference = _held_bytes_and_train(model)
    if case != "dense":  # the statistics are really there to compare
        assert any(key.endswith("tokens_per_expert") for key in reference[0]["moe"])
        assert reference[1]["moe"] and all(v.numel() for v in reference[1]["moe"].values())
    for modules in module_lists:
        held, results = _held_bytes_and_train(_selective(model, modules))
        _assert_bitwise(results, reference, f"{case} {modules}")
        for step_index, (got, want) in enumerate(zip(results, reference)):
            assert got["moe"].keys() == want["moe"].keys()
            for key, value in want["moe"].items():
                assert torch.equal(got["moe"][key], value), f"{modules} step {step_index} {key}"
        assert held < off, f"{case} {modules}: {held} bytes held, {off} without recomputation"


def test_every_module_holds_less_than_any_one():
    off, _ = _held_bytes_and_train(MLA, steps=1)
    one = {m: _held_bytes_and_train(_selective(MLA, [m]), steps=1)[0]
           for m in ("core_attn", "layernorm", "mla_up_proj", "moe_act", "shared_experts")}
    every, _ = _held_bytes_and_train(_selective(MLA, ALL + ["mla_up_proj"]), steps=1)
    assert every < min(one.values()) and max(one.values()) < off, (off, one, every)


# ------------------------------------------------------------------ one pooled layout

STEPS = 2
POOLED = dataclasses.replace(MLA, hidden_dropout=0.0, num_experts=4,
                             moe_router_enable_expert_bias=False,
                             moe_router_score_function="softmax")


def _config(modules: list[str] | None, t: int = 1, ep: int = 1):
    model = POOLED if modules is None else _selective(POOLED, modules)
    config = step._config(t, 1, 1, None, model, t > 1, train_iters=STEPS, global_batch_size=4)
    config.parallel = dataclasses.replace(config.parallel, expert_model_parallel_size=ep,
                                          expert_tensor_parallel_size=1)
    config.data = DataConfig(mock_data=True)
    validate(config, world_size=t)
    return config


def _pooled(rank: int, records: list) -> None:
    """Every module but moe (the experts' activation and the shared experts
    recomputed behind the dispatch), then with moe (the whole layer, its
    dispatch run again in backward)."""
    for modules in (ALL + ["mla_up_proj"], ALL + ["mla_up_proj", "moe"]):
        ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=1, ep=2, etp=1))
        trainer = Trainer(_config(modules, t=2, ep=2), ctx, CPU)
        for i, want in enumerate(records):
            got = trainer.step(i)[0]
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (modules, i)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (modules, i)
        ctx.destroy()


def test_every_module_at_t2_sequence_parallel_ep2_trains_like_one_process(pools):
    trainer = Trainer(_config(None), ParallelContext.single(), CPU)
    records = [trainer.step(i)[0] for i in range(STEPS)]
    assert records[0]["loss"] != records[1]["loss"]
    pools(2).run(_pooled, records)


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("settings, message", [
    (dict(recompute_modules=["mlp", "attention"]), "--recompute-modules attention: not a module "
     "name"),
    (dict(recompute_modules=["mhc", "gdp_qkv"]), "--recompute-modules mhc gdp_qkv: Megatron-LM's "
     "recomputation of modules of models ptdp does not build"),
    (dict(recompute_granularity="full", recompute_modules=["mlp"]), "--recompute-modules mlp "
     "chooses what selective recomputation recomputes, but --recompute-granularity is full"),
    (dict(recompute_granularity=None, recompute_modules=["mlp"]), "--recompute-granularity is "
     "None: add --recompute-granularity selective"),
    (dict(recompute_modules=["mla_up_proj"]), "--recompute-modules mla_up_proj recomputes "
     "multi-latent attention's up projections, but the model has none"),
    (dict(recompute_modules="mlp"), "--recompute-modules='mlp' must be a list of module names"),
])
def test_bad_values_are_refused(settings, message):
    model = dataclasses.replace(DENSE, recompute_granularity="selective")
    model = dataclasses.replace(model, **settings)
    with pytest.raises(ConfigError) as error:
        validate(step._config(model=model))
    assert message in str(error.value)
    assert str(error.value).count("\n  - ") == 1


def test_moe_act_with_grouped_gemm_is_refused():
    model = dataclasses.replace(_selective(MOE, ["moe_act"]), moe_grouped_gemm=True)
    with pytest.raises(ConfigError, match="moe_act recomputes the experts' activation"):
        validate(step._config(model=model))
    validate(step._config(model=_selective(MOE, ["moe", "shared_experts", "core_attn"])))
