"""The performance model with low-rank adapters on a frozen base
(ptdp.perf.analytic.lora, price/lora.py, `ptdp plan --lora-*`, the
banner's LoRA line) against measurements and independent counts:

- activations: the bytes autograd saves for one whole model (embedding,
  layers, output) with adapters, counted with saved-tensor hooks, equal
  the model's figure exactly, for several target sets, adapter dropout on
  and off, fp32 and bf16, LayerNorm/GeLU and RMSNorm/SwiGLU, and each
  recomputation;
- state: a one-process Trainer's frozen weights, adapter buffer, fp32
  gradients and optimizer state equal the model's bytes (bf16, buckets
  small enough to split the adapters);
- FLOPs: the frozen-base count equals one computed from the built model's
  matrices (2× their forward, 3× the adapters' and the attention's);
- plan: on one H100 profile a 7B-class model that full fine-tuning cannot
  fit fits with adapters, and its predicted step is shorter;
- the banner's trainable/frozen counts equal those of a built model.
"""

from __future__ import annotations

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.config.lora import LoRAConfig
from ptdp.model.adapters import attach_adapters
from ptdp.model.gpt import GPT
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext
from ptdp.perf.analytic.flops import model_flops_per_iteration
from ptdp.perf.analytic.memory import memory_per_rank
from ptdp.perf.analytic.saved import SavedTensorBytes
from ptdp.perf.layout import Layout, LoRAWork, Workload
from ptdp.perf.plan.planner import evaluate_layout
from ptdp.perf.price.profiles import load_profile
from ptdp.train.banner import lora_line

ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
GPT2 = dict()
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             num_query_groups=2)


def _built(model: ModelConfig, lora: LoRAConfig | None, dtype=torch.float32):
    ctx = ParallelContext.single()
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(5, ctx)
    gpt = GPT(model, ctx, rng)
    if lora is not None:
        attach_adapters(gpt, model, lora, 1)
    return gpt.initialize(5).to(dtype).train()


def _saved_bytes(model: ModelConfig, b: int, dtype, lora: LoRAConfig) -> int:
    gpt = _built(model, lora, dtype)
    tokens = torch.randint(0, model.vocab_size, (b, model.seq_length + 1),
                           generator=torch.Generator().manual_seed(1))
    with SavedTensorBytes(gpt.parameters()) as saved:
        loss = gpt(tokens[:, :-1], labels=tokens[:, 1:])
    loss.float().sum().backward()
    return saved.bytes


CASES = [(GPT2, 0.1, None, "fp32"), (GPT2, 0.0, "selective", "bf16"), (LLAMA, 0.1, None, "bf16"),
         (LLAMA, 0.0, None, "fp32"), (GPT2, 0.0, "full", "fp32")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("options,attention_dropout,recompute,precision", CASES,
                         ids=["gpt2-math", "gpt2-selective", "llama-math", "llama-flash",
                              "gpt2-full"])
def test_activations_with_adapters_match_saved_tensors(options, attention_dropout, recompute,
                                                       precision):
    torch.manual_seed(0)
    model = ModelConfig(num_layers=2, vocab_size=200, hidden_size=32, num_attention_heads=4,
                        seq_length=16, hidden_dropout=0.1, attention_dropout=attention_dropout,
                        recompute_granularity=recompute, **options)
    for dtype in (DTYPES[precision],):
        for targets in (ALL, ["linear_qkv", "linear_fc2"]):
            for dropout in (0.0, 0.1):
                lora = LoRAConfig(lora_rank=4, lora_target_modules=targets, lora_dropout=dropout)
                measured = _saved_bytes(model, 2, dtype, lora)
                predicted = memory_per_rank(Workload(model, 2, precision, LoRAWork.of(lora)),
                                            Layout(b=2, recompute=recompute),
                                            kernels="cpu")[0]["activations"]
                assert predicted == measured, (precision, targets, dropout)
                if targets == ALL and not dropout:
                    without_dropout = measured
        if recompute != "full":   # a frozen base saves less than full fine-tuning
            full = memory_per_rank(Workload(model, 2, precision), Layout(b=2, recompute=recompute),
                                   kernels="cpu")[0]["activations"]
            assert without_dropout < full


def test_state_bytes_of_a_trainer_with_adapters():
    from ptdp.train.loop import Trainer

    torch.manual_seed(0)
    model = ModelConfig(num_layers=2, vocab_size=100, hidden_size=32, num_attention_heads=2,
                        seq_length=16, make_vocab_size_divisible_by=8)
    lora = LoRAConfig(lora_rank=4, lora_target_modules=["linear_qkv", "linear_fc2"])
    bucket = 300   # the adapters in several buckets
    config = Config(model=model, lora=lora,
                    train=TrainConfig(micro_batch_size=2, global_batch_size=2, train_iters=1,
                                      bf16=True, ddp_bucket_size=bucket, seed=3),
                    data=DataConfig(mock_data=True))
    trainer = Trainer(config, ParallelContext.single(), torch.device("cpu"))
    frozen = sum(p.numel() * p.element_size() for p in trainer.model.parameters()
                 if not p.requires_grad)
    buffer = trainer.buffer
    measured = {"weights": frozen + buffer.param_data.nbytes, "gradients": buffer.grad_data.nbytes,
                "optimizer": trainer.optimizer.state_bytes}
    predicted = memory_per_rank(Workload(model, 2, "bf16", LoRAWork.of(lora)), Layout(b=2),
                                kernels="cpu", bucket_size=bucket)[0]
    assert {key: predicted[key] for key in measured} == measured
    adapters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert buffer.numel == adapters == 2 * 4 * (32 + 3 * 32) + 2 * 4 * (32 + 128)


def test_flops_with_adapters_count_what_is_computed():
    model = ModelConfig(num_layers=2, vocab_size=512, hidden_size=64, num_attention_heads=4,
                        seq_length=32)
    lora = LoRAConfig(lora_rank=4, lora_target_modules=["linear_qkv", "linear_fc1"])
    gpt = _built(model, lora)
    B, s = 8, model.seq_length
    tokens = B * s
    linear = adapters = 0
    for name, param in gpt.named_parameters():
        if param.dim() != 2 or "embedding" in name:
            continue
        if name.endswith((".A", ".B")):
            adapters += 2 * tokens * param.numel()
        else:
            linear += 2 * tokens * param.numel()
    output = 2 * tokens * model.vocab_size * model.hidden_size   # the tied output layer
    attention = model.num_layers * 4 * B * s * s * model.hidden_size
    expected = 2 * (linear + output) + 3 * attention + 3 * adapters
    got = model_flops_per_iteration(model, B, recompute=None, lora=LoRAWork.of(lora))
    assert got == pytest.approx(expected, rel=1e-12)
    assert got < model_flops_per_iteration(model, B, recompute=None)


def test_plan_fits_with_adapters_and_is_faster():
    model = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                        vocab_size=51200)
    profile = load_profile("h100")
    layout = Layout()
    full = evaluate_layout(Workload(model, 8, "bf16"), layout, profile)
    lora = evaluate_layout(Workload(model, 8, "bf16", LoRAWork(16)), layout, profile)
    assert not full.fits and lora.fits
    # The saving is the optimizer state and gradients: 16 bytes per frozen parameter.
    base = full.memory["weights"] // 2
    assert full.memory["total"] - lora.memory["total"] > 14 * base
    assert lora.seconds < full.seconds
    # Backward: no weight-gradient GEMMs for the base, roughly half the base's backward.
    backward = lora.prediction.seconds_by_category["backward compute"]
    assert backward < 0.8 * full.prediction.seconds_by_category["backward compute"]


def test_banner_counts_trainable_and_frozen_parameters_of_the_whole_model():
    model = ModelConfig(num_layers=3, vocab_size=100, hidden_size=48, num_attention_heads=4,
                        seq_length=16)
    lora = LoRAConfig(lora_rank=8, lora_alpha=16, lora_target_modules=["linear_qkv", "linear_proj"])
    gpt = _built(model, lora)
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in gpt.parameters() if not p.requires_grad)
    frozen -= (model.padded_vocab_size(1) - model.vocab_size) * model.hidden_size
    line = lora_line(Config(model=model, lora=lora))
    assert trainable == 3 * (8 * 48 + 144 * 8 + 8 * 48 + 48 * 8)
    assert "rank 8, alpha 16, 6 adapted layers on linear_qkv linear_proj" in line
    assert f"trainable {trainable:,} ({100 * trainable / (trainable + frozen):.2g} %)" in line
    assert f"frozen {frozen:,}" in line or f"frozen {frozen / 1e6:.3g} M" in line
