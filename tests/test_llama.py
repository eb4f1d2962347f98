"""The Llama family's options compute under every layout what one process
computes, as GPT does (the same tests and tolerances, reused with a
Llama-style model: RMSNorm, SwiGLU, rotary embeddings, grouped-query
attention with fewer groups than heads, untied output layer, no biases).

Covered here: tensor parallelism t in {2, 4}; pipelines p in {2, 4} with
every schedule (GPipe, 1F1B, interleaved), alone and with t = 2; full and
selective recomputation; the full PTD-P step t = p = d = 2 with the
distributed optimizer; mixtures of the options with GPT's parts; bf16 and
fp16; resharding checkpoints; the SwiGLU node's gradient. Logits against
Hugging Face's LlamaForCausalLM: tests/test_hf_llama.py.
"""

import dataclasses
import hashlib
import math

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig, validate
from ptdp.model.fused import swiglu
from ptdp.model.gpt import GPT
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.checkpoint.store import CheckpointError, check_model_fits, read_metadata, resolve
from ptdp.train.loop import Trainer
from tests import test_gpt, test_pipeline, test_ptdp_step

# 8 query heads in 4 key/value groups (t = 4 holds one group and two heads
# per rank); an FFN width that is not a multiple of 64; a rotary base other
# than Llama's.
LLAMA = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=8, seq_length=8,
                    vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0, ffn_hidden_size=88, normalization="RMSNorm",
                    norm_epsilon=1e-6, swiglu=True, position_embedding_type="rope",
                    rotary_base=500.0, group_query_attention=True, num_query_groups=4,
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True)
# The options mix freely with GPT's parts.
MIXTURES = {
    "rmsnorm-learned-positions-gelu-gqa-tied-biases": dataclasses.replace(
        LLAMA, swiglu=False, position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False, disable_bias_linear=False),
    "layernorm-swiglu-rope-mha-untied-biases": dataclasses.replace(
        LLAMA, normalization="LayerNorm", group_query_attention=False, num_query_groups=None,
        disable_bias_linear=False),
}
# Qwen's and Llama 3.1's options: heads twice h/a wide (--kv-channels), a norm
# over each head's queries and keys (its weight shared by the heads of both
# tensor ranks), biases on q, k, v only, Llama 3.1's rescaled frequencies (a
# base large enough that some are rescaled).
QWEN = dataclasses.replace(LLAMA, kv_channels=16, qk_layernorm=True, add_qkv_bias=True,
                           use_rope_scaling=True, rotary_base=500000.0)
MIXTURES["qwen-kv-channels-qk-layernorm-qkv-bias-rope-scaling"] = QWEN
MIXTURES["qk-layernorm-1p-layernorm-learned-positions"] = dataclasses.replace(
    QWEN, normalization="LayerNorm", apply_layernorm_1p=True, use_rope_scaling=False,
    position_embedding_type="learned_absolute")


def _layers(config, n):
    return dataclasses.replace(config, num_layers=n)


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_llama_equals_one_process(pools, t):
    results = pools(t).run(test_gpt._serial_vs_tensor_parallel, t, _layers(LLAMA, 2), True)
    assert len({r[0] for r in results}) == 1


@pytest.mark.parametrize("name", list(MIXTURES))
def test_tensor_parallel_mixtures_equal_one_process(pools, name):
    pools(2).run(test_gpt._serial_vs_tensor_parallel, 2, _layers(MIXTURES[name], 2), False)


PIPELINES = [(1, 2, "gpipe", 1), (1, 2, "1f1b", 1), (1, 2, "interleaved", 2),
             (1, 4, "gpipe", 1), (1, 4, "1f1b", 1), (1, 4, "interleaved", 2),
             (2, 2, "gpipe", 1), (2, 2, "1f1b", 1), (2, 2, "interleaved", 2)]
# The last layout runs Qwen's options instead (the others cover Llama's there).
PIPELINE_MODELS = {layout: LLAMA for layout in PIPELINES} | {(2, 2, "interleaved", 2): QWEN}


@pytest.mark.parametrize("t,p,kind,v", PIPELINES,
                         ids=[f"t{t}-p{p}-{kind}-v{v}" + ("-qwen" if PIPELINE_MODELS[t, p, kind, v]
                                                          is QWEN else "")
                              for t, p, kind, v in PIPELINES])
def test_pipeline_llama_equals_one_process(pools, t, p, kind, v):
    """Losses and every gradient, m = 2p; the untied output layer lives on
    the last stage only (no tied copy, nothing summed between stages)."""
    model = PIPELINE_MODELS[t, p, kind, v]
    checked = pools(t * p).run(test_pipeline._pipeline_vs_serial, t, p, kind, v, 2 * p, True, model)
    serial = GPT(model, ParallelContext.single(), RNGStreams(torch.device("cpu")))
    assert sum(checked) == t * len(dict(serial.named_parameters()))


RECOMPUTE = {
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=2),
    "full-block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_recomputation_in_a_llama_pipeline_equals_one_process(pools, name):
    config = dataclasses.replace(LLAMA, **RECOMPUTE[name])
    pools(4).run(test_pipeline._pipeline_vs_serial, 2, 2, "interleaved", 2, 4, True, config)


@pytest.mark.parametrize("k", [None, 1], ids=["1f1b", "interleaved-qwen"])
def test_llama_full_step_with_the_distributed_optimizer(pools, k):
    """t = p = d = 2, five AdamW steps: losses and gradient norms equal one
    process's to test_ptdp_step's tolerances, weights to 5e-5. This model
    is more sensitive to summation order than the GPT there: one process
    alone, splitting the same batch into 8 microbatches of 1 instead of 4 of
    2, moves the word embedding by 5.2e-6 after five steps (Adam divides
    each gradient by its own size); the parallel run differs by up to 1.4e-5
    (the gradients themselves agree to 1e-5 relative: the pipeline tests)."""
    model = _layers(LLAMA if k is None else QWEN, 4)  # interleaved: Qwen's options
    results = pools(8).run(test_ptdp_step._ptdp_vs_serial, k, True, model,
                           dict(rtol=0.0, atol=5e-5))
    assert all(math.isfinite(x) for x in results[-1][0])
    assert max(r[2] for r in results) < 5e-5


def _recompute_with_dropout(rank):
    """Dropout on (replicated and per-rank streams), grouped-query attention:
    recomputation replays every mask, so runs are bitwise equal."""
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=2))
    model = dataclasses.replace(LLAMA, hidden_dropout=0.1, attention_dropout=0.1)
    runs = []
    for recompute in ({}, RECOMPUTE["full-uniform"], RECOMPUTE["selective"]):
        config = test_ptdp_step._config(2, 2, 1, 1, dataclasses.replace(model, **recompute),
                                        train_iters=2)
        trainer = Trainer(config, ctx, torch.device("cpu"))
        runs.append(([trainer.step(i)[0]["loss"] for i in range(2)],
                     trainer.buffer.param_data.clone()))
    return [losses == runs[0][0] and torch.equal(weights, runs[0][1]) for losses, weights in runs]


def test_recomputation_with_dropout_is_bitwise_exact(pools):
    for same in pools(4).run(_recompute_with_dropout):
        assert all(same)


_fp32_losses: list = []  # this rank's fp32 run, once for both precisions (the pool's ranks live on)


def _low_precision(rank, flags):
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=2))
    losses = {}
    for name, extra in (("fp32", {}), ("low", flags)):
        if name == "fp32" and _fp32_losses:
            losses[name] = _fp32_losses[0]
            continue
        config = test_ptdp_step._config(2, 2, 1, None, LLAMA, train_iters=6, **extra)
        trainer = Trainer(config, ctx, torch.device("cpu"))
        losses[name] = [trainer.step(i)[0]["loss"] for i in range(6)]
    _fp32_losses[:] = [losses["fp32"]]
    return losses


@pytest.mark.parametrize("flags", [dict(bf16=True), dict(fp16=True, initial_loss_scale=2.0 ** 12)],
                         ids=["bf16", "fp16"])
def test_llama_trains_in_bf16_and_fp16(pools, flags):
    """Six steps at t = p = 2 track the fp32 run (bf16 keeps ~3 significant
    digits) and learn (the generated data is learnable)."""
    losses = pools(4).run(_low_precision, flags)[-1]
    assert losses["low"] == pytest.approx(losses["fp32"], rel=3e-2)
    assert losses["low"][-1] < losses["low"][0]


def _train_and_save(rank, save, t, p, d, iters, start):
    ctx = ParallelContext.build(RankGrid(tp=t, dp=d, pp=p))
    config = test_ptdp_step._config(t, p, d, None, LLAMA, train_iters=4,
                                    use_distributed_optimizer=d > 1)
    trainer = Trainer(config, ctx, torch.device("cpu"), start=start)
    if start[0]:
        trainer.load(save)
    losses = [trainer.step(i)[0]["loss"] for i in range(start[0], start[0] + iters)]
    trainer.save(save, start[0] + iters)
    return losses


def test_llama_checkpoints_reshard(pools, tmp_path):
    """Two steps at t = 2, p = 2, then two at t = 4, d = 2 (the grouped q/k/v
    rows and the gate/up halves re-cut for another t): the losses are one
    process's."""
    serial = Trainer(test_ptdp_step._config(model=LLAMA, train_iters=4), ParallelContext.single(),
                     torch.device("cpu"))
    expected = [serial.step(i)[0]["loss"] for i in range(4)]
    first = pools(4).run(_train_and_save, str(tmp_path), 2, 2, 1, 2, (0, 0))[-1]
    metadata = read_metadata(resolve(tmp_path))
    second = pools(8).run(_train_and_save, str(tmp_path), 4, 1, 2, 2,
                          (metadata["iteration"], metadata["consumed_samples"]))[0]
    assert first + second == pytest.approx(expected, rel=1e-5)


def test_a_gpt_checkpoint_is_refused_for_a_llama_model(tmp_path):
    gpt = dataclasses.replace(LLAMA, normalization="LayerNorm", swiglu=False,
                              position_embedding_type="learned_absolute",
                              group_query_attention=False, num_query_groups=None,
                              untie_embeddings_and_output_weights=False, disable_bias_linear=False)
    trainer = Trainer(test_ptdp_step._config(model=gpt), ParallelContext.single(), torch.device("cpu"))
    trainer.save(str(tmp_path), 0)
    directory = resolve(tmp_path)
    with pytest.raises(CheckpointError) as error:
        check_model_fits(read_metadata(directory), LLAMA, directory)
    for setting in ("--normalization: checkpoint LayerNorm, requested RMSNorm",
                    "--swiglu", "--position-embedding-type", "--num-query-groups: checkpoint 8, "
                    "requested 4", "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
        assert setting in str(error.value)


def test_gpt_weights_and_loss_are_unchanged_by_the_new_options():
    """The GPT-2 path builds the same tensors from the same seed and computes
    the same loss as before the options existed: the digest and the loss
    below were taken with the code of the commit before them."""
    model = GPT(test_gpt.SMALL, ParallelContext.single(), RNGStreams(torch.device("cpu")))
    model.initialize(7)
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().numpy().tobytes())
    assert digest.hexdigest() == "0d8fabf0c38649d7242060c917ab2aab8a62e87df7bd80c3ef2a9fb035ca2089"
    tokens = torch.randint(0, 100, (3, 17), generator=torch.Generator().manual_seed(11))
    assert model(tokens[:, :-1], tokens[:, 1:]).item() == 4.596041202545166


def test_swiglu_node_matches_autograd():
    torch.manual_seed(0)
    y = torch.randn(3, 2, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (y,))
    gate, up = y.detach().chunk(2, dim=-1)
    assert_close(swiglu(y), torch.nn.functional.silu(gate) * up)


def _validate(model, t=1):
    validate(Config(model=model, parallel=ParallelConfig(tensor_model_parallel_size=t),
                    train=TrainConfig(), data=DataConfig(mock_data=True)))


def test_invalid_groups_are_refused_with_alternatives():
    with pytest.raises(ConfigError) as error:
        _validate(dataclasses.replace(LLAMA, num_query_groups=2), t=4)
    assert ("--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4" in str(error.value)
            and "--tensor-model-parallel-size in [1, 2]" in str(error.value)
            and "--num-query-groups in [4, 8]" in str(error.value))
    with pytest.raises(ConfigError, match=r"--num-query-groups 3 does not divide "
                                          r"--num-attention-heads 8.*\[1, 2, 4, 8\]"):
        _validate(dataclasses.replace(LLAMA, num_query_groups=3))
    with pytest.raises(ConfigError, match="add --group-query-attention or drop --num-query-groups"):
        _validate(dataclasses.replace(LLAMA, group_query_attention=False))
    with pytest.raises(ConfigError, match="--group-query-attention needs --num-query-groups"):
        _validate(dataclasses.replace(LLAMA, num_query_groups=None))
    with pytest.raises(ConfigError, match="rope needs an even head dimension"):
        _validate(dataclasses.replace(LLAMA, hidden_size=24, num_query_groups=8))
    with pytest.raises(ConfigError, match="--norm-epsilon 1e-06 and --layernorm-epsilon 0.001 disagree"):
        _validate(dataclasses.replace(LLAMA, layernorm_epsilon=1e-3))
    with pytest.raises(ConfigError, match="give --ffn-hidden-size"):
        _validate(dataclasses.replace(LLAMA, hidden_size=16, ffn_hidden_size=None))


def test_swiglu_default_width_is_megatrons():
    """int(4·h·2/3 / 64)·64, as Megatron-LM computes it (e.g. h 4096 -> 10880)."""
    assert dataclasses.replace(LLAMA, hidden_size=4096, ffn_hidden_size=None).ffn_size == 10880
    assert dataclasses.replace(LLAMA, hidden_size=64, ffn_hidden_size=None).ffn_size == 128
    assert dataclasses.replace(LLAMA, ffn_hidden_size=None, swiglu=False).ffn_size == 256
