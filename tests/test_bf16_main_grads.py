"""--main-grads-dtype bf16 (and Megatron-FSDP's --megatron-fsdp-main-grads-dtype
bf16) in one process: the gradient buffers are bf16 and hold the same
gradients as fp32 ones to bf16's rounding, but not the same numbers; the
optimizer's state stays fp32; the memory model counts 2 bytes a gradient,
as the buffers hold; and a run that is not --bf16 is refused. The layouts
(d = 2 and 4, ZeRO-1/2/3, t = 2, p = 2, EP = 2) and the resume are in
tests/test_sharded_data_parallel.py's pooled runs."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import ConfigError, validate
from ptdp.parallel.topology import ParallelContext
from ptdp.perf.analytic.memory import memory_per_rank
from ptdp.perf.fits import layout_of, workload_of
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step

CPU = torch.device("cpu")


def _trainer(main_grads: str, **train) -> Trainer:
    return Trainer(step._config(bf16=True, main_grads_dtype=main_grads, **train),
                   ParallelContext.single(), CPU)


def _one_iteration_gradients(trainer: Trainer) -> torch.Tensor:
    """The gradients of the first iteration's 8 microbatches, as the
    optimizer would read them."""
    trainer.model.train()
    trainer.buffer.start_iteration(trainer.num_micro)
    trainer.executor.run(trainer.schedule, trainer.microbatch_fn(0), per_token_loss=False)
    trainer.buffer.finish()
    return trainer.buffer.reduced_grads.clone()


def test_bf16_main_gradients_are_bf16_and_round_the_fp32_ones():
    fp32, bf16 = (_one_iteration_gradients(_trainer(dtype)) for dtype in ("fp32", "bf16"))
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert bf16.nbytes * 2 == fp32.nbytes
    # The same bf16 microbatch gradients summed 8 times: each bf16 addition
    # rounds to 2^-8 of the running sum, so the sums agree to a few such
    # roundings (relative to the largest gradient) and are not the same.
    scale = fp32.abs().max()
    assert_close(bf16.float(), fp32, rtol=2 ** -6, atol=2 ** -7 * scale)
    assert not torch.equal(bf16.float(), fp32)
    assert (bf16.float() != fp32).float().mean() > 0.1   # most elements rounded


def test_the_optimizer_reads_bf16_main_gradients_as_fp32():
    """Two steps with clipping: the state stays fp32, the losses follow the
    fp32 main gradients' to bf16's rounding, and the weights differ."""
    runs = {}
    for dtype in ("fp32", "bf16"):
        trainer = _trainer(dtype)
        records = [trainer.step(i)[0] for i in range(2)]
        assert all(r["grad_norm"] > step.TRAIN.clip_grad for r in records)   # clipping acts
        optimizer = trainer.optimizer
        assert {t.dtype for t in (optimizer.main, optimizer.exp_avg, optimizer.exp_avg_sq)} == \
            {torch.float32}
        runs[dtype] = records, trainer.optimizer.main.clone()
    (fp32_records, fp32_main), (bf16_records, bf16_main) = runs["fp32"], runs["bf16"]
    for want, got in zip(fp32_records, bf16_records):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-3)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2)
    assert not torch.equal(bf16_main, fp32_main)
    assert (bf16_main - fp32_main).abs().max() < 2 * step.TRAIN.lr   # within 2 steps' reach


@pytest.mark.parametrize("distributed", [False, True], ids=["adamw", "distributed-optimizer"])
def test_the_memory_model_counts_two_bytes_a_bf16_main_gradient(distributed):
    for dtype, size in (("fp32", 4), ("bf16", 2)):
        trainer = _trainer(dtype, use_distributed_optimizer=distributed)
        buffer = trainer.buffer
        held = buffer.grad_data.nbytes + (buffer.grad_shard.nbytes if distributed else 0)
        assert held == size * (buffer.numel + (buffer.shard_numel if distributed else 0))
        config = trainer.config
        [estimate] = memory_per_rank(workload_of(config), layout_of(config), kernels="cpu",
                                     bucket_size=config.train.ddp_bucket_size)
        assert estimate["gradients"] == held


@pytest.mark.parametrize("train, says", [
    (dict(), "this run is fp32: add --bf16 or give --main-grads-dtype fp32"),
    (dict(fp16=True), "this run is --fp16: add --bf16"),
])
def test_bf16_main_gradients_need_a_bf16_model(train, says):
    with pytest.raises(ConfigError) as error:
        validate(step._config(main_grads_dtype="bf16", **train))
    assert "--main-grads-dtype bf16 keeps the main gradients of a --bf16 run in bf16" in \
        str(error.value) and says in str(error.value)
    validate(step._config(main_grads_dtype="bf16", bf16=True))
