"""Pipeline parallelism computes what one process computes.

For p in {2, 4}, every schedule (GPipe, 1F1B, interleaved with v in {1, 2}),
m in {p, 2p}, alone and with t = 2: the loss and every parameter's gradient
equal the one-process model's (fp32 on CPU). Measured while running: the
stored activations per rank peak at the schedule's bound, every
point-to-point send carries b·s·h/t elements with scatter/gather on (b·s·h
off), and sent activations are released.

Tolerance: the pipeline does the serial model's arithmetic in the same order
on each microbatch; tensor parallelism (t = 2) reorders sums, so values agree
to rounding: loss rtol 1e-6, gradients rtol 1e-5 + atol 2e-7.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from ptdp.config import ModelConfig
from ptdp.model.gpt import GPT, build_chunks
from ptdp.parallel.pipeline.executor import PipelineExecutor
from ptdp.schedules.actions import Exchange
from ptdp.schedules.build import build_forward_only, build_schedule
from ptdp.parallel.sharding import PARTIAL_GRAD_ATTR, SHARD_ATTR, gather_logical
from ptdp.parallel.tensor import RNGStreams, sum_partial_grads
from ptdp.parallel.topology import ParallelContext, RankGrid

SEED = 3
B_MICRO = 2
CONFIG = ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=8,
                     vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                     attention_dropout=0.0)
LOSS_TOL = dict(rtol=1e-6, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=2e-7)


def all_reduce_tied_embedding_grads(chunks, ctx):
    """Sum the tied word embedding's gradients of the first and last stage
    (in training, GradBuffer does this for its tied bucket)."""
    if ctx.embedding_group is None or not chunks[0].config.tied_output:
        return
    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None and embedding.word_embeddings.weight.grad is not None:
            dist.all_reduce(embedding.word_embeddings.weight.grad, group=ctx.embedding_group)


def _tokens(m, config=CONFIG):
    generator = torch.Generator().manual_seed(21)
    return torch.randint(0, config.vocab_size, (m * B_MICRO, config.seq_length + 1),
                         generator=generator)


def _microbatch_fn(tokens):
    def microbatch(i):
        chunk = tokens[i * B_MICRO:(i + 1) * B_MICRO]
        return chunk[:, :-1], chunk[:, 1:]
    return microbatch


def _serial_reference(m, config=CONFIG):
    """The one-process model's mean loss over m microbatches, after backward
    (without recomputation: the reference for every layout)."""
    ctx = ParallelContext.single()
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(SEED, ctx)
    config = dataclasses.replace(config, recompute_granularity=None)
    model = GPT(config, ctx, rng).initialize(SEED)
    microbatch = _microbatch_fn(_tokens(m, config))
    losses = [model(*microbatch(i)) for i in range(m)]
    loss = torch.stack(losses).mean()
    loss.backward()
    return model, loss


def _pipeline_vs_serial(rank, t, p, kind, v, m, scatter_gather, config=CONFIG,
                        sequence_parallel=False):
    """With `sequence_parallel` each tensor rank holds and sends s/t positions
    (the executor then sends whole local tensors) and the norms' partial
    gradients are summed over the tensor group, as GradBuffer does."""
    ctx = ParallelContext.build(RankGrid(tp=t, dp=1, pp=p))
    chunks = build_chunks(config, ctx, torch.device("cpu"), SEED, v,
                          sequence_parallel=sequence_parallel)
    schedule = build_schedule(kind, p, m, v)
    positions = config.seq_length // t if sequence_parallel else config.seq_length
    executor = PipelineExecutor(chunks, ctx, activation_shape=(positions, B_MICRO,
                                                               config.hidden_size),
                                dtype=torch.float32, device=torch.device("cpu"),
                                scatter_gather=scatter_gather and not sequence_parallel)
    stats = executor.run(schedule, _microbatch_fn(_tokens(m, config)))
    all_reduce_tied_embedding_grads(chunks, ctx)
    sum_partial_grads([param.grad for chunk in chunks for param in chunk.parameters()
                       if getattr(param, PARTIAL_GRAD_ATTR, False)], ctx.tp_group)

    serial, serial_loss = _serial_reference(m, config)
    if ctx.is_last_stage:
        assert len(stats.losses) == m
        assert_close(torch.stack(stats.losses).mean(), serial_loss.detach(), **LOSS_TOL)
    else:
        assert stats.losses == []

    serial_params = dict(serial.named_parameters())
    checked = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            reference = serial_params[name]
            grad = gather_logical(param.grad, getattr(param, SHARD_ATTR, None), ctx.tp_group)
            want = gather_logical(reference.grad, getattr(reference, SHARD_ATTR, None), None)
            assert_close(grad, want, **GRAD_TOL, msg=lambda msg, name=name: f"{name}: {msg}")
            checked += 1

    # Measured, not assumed.
    assert stats.peak_stored == schedule.in_flight_bound(ctx.pp_rank)
    activation = B_MICRO * config.seq_length * config.hidden_size
    split = (scatter_gather or sequence_parallel) and t > 1
    expected = activation // t if split else activation
    sends = [tr for a in schedule.ranks[ctx.pp_rank] if isinstance(a, Exchange)
             for tr in a.transfers if tr.op == "send"]
    assert stats.sent_elements == [expected] * len(sends)
    activation_sends = sum(tr.kind == "activation" for tr in sends)
    held = activation // t if sequence_parallel else activation  # what each rank's output holds
    assert stats.released_bytes == activation_sends * held * 4
    return checked


CASES = [(p, kind, v, m) for p in (2, 4)
         for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 2))
         for m in (p, 2 * p)]


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("p,kind,v,m", CASES, ids=[f"p{p}-{k}-v{v}-m{m}" for p, k, v, m in CASES])
def test_pipeline_equals_one_process(pools, t, p, kind, v, m):
    checked = pools(t * p).run(_pipeline_vs_serial, t, p, kind, v, m, True)
    # Every logical parameter was checked somewhere (the tied embedding twice).
    serial_count = len(dict(GPT(CONFIG, ParallelContext.single(),
                                RNGStreams(torch.device("cpu"))).named_parameters()))
    assert sum(checked) == t * (serial_count + 1)


def test_scatter_gather_off_sends_whole_tensors(pools):
    pools(4).run(_pipeline_vs_serial, 2, 2, "1f1b", 1, 4, False)


def _forward_only(rank, p, v, m):
    ctx = ParallelContext.build(RankGrid(tp=1, dp=1, pp=p))
    chunks = build_chunks(CONFIG, ctx, torch.device("cpu"), SEED, v)
    executor = PipelineExecutor(chunks, ctx, activation_shape=(CONFIG.seq_length, B_MICRO,
                                                               CONFIG.hidden_size),
                                dtype=torch.float32, device=torch.device("cpu"))
    stats = executor.run(build_forward_only(p, m, v), _microbatch_fn(_tokens(m)), forward_only=True)
    assert stats.peak_stored == 0
    assert all(param.grad is None for chunk in chunks for param in chunk.parameters())
    if ctx.is_last_stage:
        return torch.stack(stats.losses).mean().item()
    assert stats.losses == []
    return None


@pytest.mark.parametrize("p,v", [(2, 1), (2, 2), (4, 2)])
def test_forward_only_evaluation(pools, p, v):
    m = 2 * p
    results = pools(p).run(_forward_only, p, v, m)
    _, serial_loss = _serial_reference(m)
    assert results[-1] == pytest.approx(serial_loss.item(), rel=1e-6)
    assert all(r is None for r in results[:-1])


def test_chunks_hold_the_papers_layers():
    """4 ranks, 16 layers, v = 2: rank 0 holds layers 0, 1, 8, 9 (the paper's
    1, 2, 9, 10) and rank 1 holds 2, 3, 10, 11; embeddings only on the first
    virtual stage, output layer only on the last."""
    config = dataclasses.replace(CONFIG, num_layers=16)
    held = {}
    for pp_rank in range(4):
        ctx = ParallelContext(grid=RankGrid(1, 1, 4), rank=pp_rank,
                              groups={"tensor": None, "data": None, "pipeline": None,
                                      "model_parallel": None})
        chunks = build_chunks(config, ctx, torch.device("cpu"), SEED, 2)
        held[pp_rank] = [layer for chunk in chunks for layer in chunk.layer_ids]
        for c, chunk in enumerate(chunks):
            stage = c * 4 + pp_rank
            assert chunk.pre_process == (stage == 0) and chunk.post_process == (stage == 7)
    assert held[0] == [0, 1, 8, 9] and held[1] == [2, 3, 10, 11] and held[3] == [6, 7, 14, 15]


def _tied_copies_stay_equal(rank):
    ctx = ParallelContext.build(RankGrid(tp=1, dp=1, pp=2))
    chunks = build_chunks(CONFIG, ctx, torch.device("cpu"), SEED, 1)
    executor = PipelineExecutor(chunks, ctx, activation_shape=(CONFIG.seq_length, B_MICRO,
                                                               CONFIG.hidden_size),
                                dtype=torch.float32, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(chunks[0].parameters(), lr=1e-2)
    for step in range(3):
        executor.run(build_schedule("1f1b", 2, 2), _microbatch_fn(_tokens(2)))
        all_reduce_tied_embedding_grads(chunks, ctx)
        optimizer.step()
        optimizer.zero_grad()
    weight = chunks[0].embedding.word_embeddings.weight.detach().clone()
    copies = [torch.empty_like(weight) for _ in range(2)]
    dist.all_gather(copies, weight)
    initial = GPT(CONFIG, ParallelContext.single(), RNGStreams(torch.device("cpu"))).initialize(SEED)
    moved = not torch.equal(weight, initial.embedding.word_embeddings.weight[:weight.shape[0]])
    return torch.equal(copies[0], copies[1]), moved


def test_tied_embedding_copies_stay_identical(pools):
    """After 3 AdamW steps the first and last stage's copies are still bitwise
    equal (their gradients are summed over the embedding group)."""
    for identical, moved in pools(2).run(_tied_copies_stay_equal):
        assert identical and moved


class _ToyStage(torch.nn.Module):
    """A two-stage toy whose boundary tensor [3, 1, 3] (9 elements) does not
    split over t = 2: the executor must send whole tensors."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        generator = torch.Generator().manual_seed(1 if first else 2)
        self.weight = torch.nn.Parameter(torch.randn(3, 3, generator=generator))

    def forward(self, x, labels=None):
        if self.first:
            x = x.float().unsqueeze(-1).expand(3, 1, 3)  # tokens [3, 1] -> [3, 1, 3]
        y = torch.tanh(x @ self.weight) + 0.0
        return y if labels is None else (y.sum(-1) * labels).mean()


def _indivisible_boundary(rank, scatter_gather):
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=2))
    chunk = _ToyStage(first=ctx.is_first_stage)
    executor = PipelineExecutor([chunk], ctx, activation_shape=(3, 1, 3), dtype=torch.float32,
                                device=torch.device("cpu"), scatter_gather=scatter_gather)
    tokens = torch.arange(6.0).reshape(2, 3, 1)
    stats = executor.run(build_schedule("1f1b", 2, 2), lambda i: (tokens[i], tokens[i] + 1))
    return stats.sent_elements, chunk.weight.grad.clone(), [l.item() for l in stats.losses]


def test_scatter_gather_falls_back_when_the_size_does_not_divide(pools):
    split = pools(4).run(_indivisible_boundary, True)
    whole = pools(4).run(_indivisible_boundary, False)
    for (sent, grad, losses), (sent_ref, grad_ref, losses_ref) in zip(split, whole):
        assert sent == sent_ref == [9, 9]
        assert torch.equal(grad, grad_ref) and losses == losses_ref
