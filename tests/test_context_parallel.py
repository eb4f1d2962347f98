"""Context parallelism equals one process: sequences split over c ranks
(two chunks each, ptdp.parallel.context_layout) train as the serial model.

One pool of four processes runs every layout in turn; each process
computes the one-process reference of each model once. Per layout: every
iteration's loss and gradient norm, the first iteration's gradient of every
parameter, the weights after the last step and the validation loss equal
the one-process run's within the dense tests' tolerances (test_ptdp_step).

The loss mask (--eod-mask-loss, plus `_masked`) leaves out whole chunks:
the first and last quarter of every other sample, which at c = 2 is all of
context rank 0's positions and at c = 4 all of ranks 0's and 1's; one
sample is masked out entirely. A rank with no counted token must add 0,
not NaN.

Sliding windows and learnable sinks (issue 43) run among the layouts (every
comm type at c = 2 and at c = 4, where whole ring steps are skipped; with
t = 2; within packed documents under p2p and a2a); in one process, each comm
type's window plan computes every (query, key) pair of the window once and
nothing outside it, within each document where there are documents.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.config.checks import validate
from ptdp.parallel.sharding import SHARD_ATTR, gather_logical, shard_group
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.evaluate import evaluate
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step

CPU = torch.device("cpu")
STEPS = 3
GLOBAL_BATCH = 4   # microbatches of 1: 4 per iteration at d = 1, enough for p = 2's schedules
# Relative to the largest element of each gradient (many are near 0).
GRAD_TOL = 1e-5

# Llama-like: rotary positions, grouped-query attention (2 groups of 2
# heads), RMSNorm, SwiGLU, untied output layer, no biases.
ROTARY = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     group_query_attention=True, seq_length=32, vocab_size=96,
                     make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                     normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                     disable_bias_linear=True)
# GPT-2-like: learned positions, four key/value heads, LayerNorm, tied output.
LEARNED = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32,
                      vocab_size=96, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                      attention_dropout=0.0)
# gpt-oss-like (issue 43): layers 1, 2 and 4 windowed, 3 full, learnable
# sinks in every layer. At c = 2 (chunks of 8) a window of 3 keys stays within
# a chunk and its neighbour; one of 11 reaches two chunks back. At c = 4
# (chunks of 4) the window of 3 leaves ring steps with nothing to compute,
# and the steps before them keys that the mask must hide.
WINDOW_3 = dataclasses.replace(ROTARY, window_size="3,0", window_attn_skip_freq=3,
                               softmax_type="learnable")
WINDOW_11 = dataclasses.replace(WINDOW_3, window_size="11,0")
# Four key/value heads, for a2a at c = 4 (which splits them over the ranks).
# (A window of 5 in documents gave one embedding element a second-step
# gradient of 1.2e-8, 2e-7 of the largest: Adam's eps turns rounding there
# into a weight difference just past WEIGHT_TOL, so the window is 6.)
WINDOW_6_MHA = dataclasses.replace(WINDOW_3, window_size="6,0", num_query_groups=None,
                                   group_query_attention=False)
SINKS = dataclasses.replace(ROTARY, softmax_type="learnable")
MODELS = {"rotary": ROTARY, "learned": LEARNED, "window3": WINDOW_3, "window11": WINDOW_11,
          "window6-mha": WINDOW_6_MHA, "sinks": SINKS}


@dataclasses.dataclass(frozen=True)
class Layout:
    c: int
    comm: str = "p2p"
    t: int = 1
    p: int = 1
    d: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    k: int | None = None                 # layers per virtual stage (interleaved)
    recompute: str | None = None
    distributed: bool = False
    per_token_loss: bool = False
    model: str = "rotary"
    masked: bool = True
    steps: int = STEPS
    reset: bool = False                  # --reset-position-ids and --reset-attention-mask

    @property
    def name(self) -> str:
        parts = [f"c{self.c}-{self.comm}", f"t{self.t}p{self.p}d{self.d}", self.model]
        parts += ["sp"] * self.sequence_parallel + [self.schedule] * (self.p > 1)
        parts += [f"{self.recompute}-recompute"] * bool(self.recompute)
        parts += ["distopt"] * self.distributed + ["per-token"] * self.per_token_loss
        parts += ["unmasked"] * (not self.masked) + ["reset"] * self.reset
        return "-".join(parts)

    @property
    def reference(self) -> tuple[str, bool, bool, int, bool]:
        return self.model, self.masked, self.per_token_loss, self.steps, self.reset


def _config(layout: Layout) -> Config:
    model = dataclasses.replace(MODELS[layout.model], recompute_granularity=layout.recompute)
    config = step._config(layout.t, layout.p, layout.d, layout.k, model, layout.sequence_parallel,
                          use_distributed_optimizer=layout.distributed,
                          calculate_per_token_loss=layout.per_token_loss,
                          global_batch_size=GLOBAL_BATCH)
    config.parallel = dataclasses.replace(
        config.parallel, context_parallel_size=layout.c, cp_comm_type=layout.comm,
        pipeline_schedule="1f1b" if layout.schedule == "interleaved" else layout.schedule)
    config.data = DataConfig(mock_data=True, eod_mask_loss=layout.masked,
                             reset_position_ids=layout.reset, reset_attention_mask=layout.reset)
    validate(config, world_size=layout.t * layout.c * layout.p * layout.d)
    return config


EOD = 7  # a token id the mock data holds now and then: --eod-mask-loss leaves it out


def _masked(microbatch_fn):
    """`microbatch_fn` whose loss masks also leave out the first and last
    quarter of every sample whose token sum is 1 modulo 4, and all of a
    sample whose token sum is 3 modulo 4 (the data decides, so every layout
    masks the same samples; the first iteration has both kinds)."""
    def build(iteration: int):
        def microbatch(i: int):
            batch = microbatch_fn(iteration)(i)
            if len(batch) < 3 or batch[2] is None:
                return batch
            inputs, labels, mask = batch[:3]
            mask = mask.clone()
            quarter = inputs.shape[1] // 4
            sums = inputs.sum(dim=1) % 4
            mask[sums == 1, :quarter] = 0
            mask[sums == 1, -quarter:] = 0
            mask[sums == 3] = 0
            return (inputs, labels, mask) + tuple(batch[3:])
        return microbatch
    return build


def _trainer(config: Config, ctx: ParallelContext) -> Trainer:
    trainer = Trainer(config, ctx, CPU)
    trainer.data.eod = EOD
    trainer.microbatch_fn = _masked(trainer.microbatch_fn)
    return trainer


def _logical(trainer: Trainer, ctx: ParallelContext, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter of this rank (or its gradient as the optimizer steps
    it), gathered over the tensor shards into its logical shape."""
    found = {}
    segments = {id(s.param): s for s in trainer.buffer.segments}
    for chunk in trainer.chunks:
        for name, param in chunk.named_parameters():
            value = param.detach()
            if grads:
                segment = segments[id(param)]
                value = trainer.buffer.grad_data[segment.start:segment.end].view(param.shape)
            found[name] = gather_logical(value.float().clone(), getattr(param, SHARD_ATTR, None),
                                         shard_group(param, ctx))
    return found


def compare_weights(trainer: Trainer, ctx: ParallelContext, want: dict[str, torch.Tensor],
                    name: str) -> tuple[set, float]:
    """This rank's weights against the one-process run's `want`: (the names
    compared, the largest difference)."""
    worst, compared = 0.0, set()
    for param, weight in _logical(trainer, ctx, grads=False).items():
        assert_close(weight, want[param], **step.WEIGHT_TOL,
                     msg=lambda m, param=param: f"{name}: {param}: {m}")
        worst = max(worst, (weight - want[param]).abs().max().item())
        compared.add(param)
    return compared, worst


_serial: dict[tuple, tuple] = {}


def _one_process(layout: Layout):
    """The reference of the layout's model and loss: records of every
    iteration, the first iteration's gradients, the final weights and the
    validation loss."""
    key = layout.reference
    if key not in _serial:
        reference = Layout(c=1, model=layout.model, masked=layout.masked,
                           per_token_loss=layout.per_token_loss, steps=layout.steps,
                           reset=layout.reset)
        ctx = ParallelContext.single()
        trainer = _trainer(_config(reference), ctx)
        first, stats = trainer.step(0)
        if layout.masked:  # the masks leave all of some samples out, and quarters of others
            counts = [t.item() for t in stats.loss_tokens]
            assert 0 in counts and any(0 < n <= MODELS[layout.model].seq_length // 2
                                       for n in counts), counts
        grads = _logical(trainer, ctx, grads=True)
        if layout.reset:  # the sequences hold several documents, which the flags separate
            across = _one_process(dataclasses.replace(layout, reset=False))[1]
            assert any((grads[name] - across[name]).abs().max() > 1e-3 * grad.abs().max()
                       for name, grad in across.items())
        records = [first] + [trainer.step(i)[0] for i in range(1, layout.steps)]
        _serial[key] = (records, grads, _logical(trainer, ctx, grads=False),
                        evaluate(trainer, trainer.data.valid, 1)["loss"])
    return _serial[key]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert_close(got, want, rtol=0.0, atol=tol * max(want.abs().max().item(), 1e-3), msg=what)


def _layouts_vs_one_process(rank: int, layouts: list[Layout], references: dict | None = None
                            ) -> list[tuple[str, set, float]]:
    """Each layout in turn against the one-process run: (name, names of the
    parameters this rank compared, the largest weight difference).
    `references`: one-process runs the caller computed (_serial's entries)."""
    _serial.update(references or {})
    results = []
    for layout in layouts:
        records, serial_grads, serial_weights, validation = _one_process(layout)
        grid = RankGrid(tp=layout.t, dp=layout.d, pp=layout.p, cp=layout.c)
        ctx = ParallelContext.build(grid)
        trainer = _trainer(_config(layout), ctx)
        got = [trainer.step(0)[0]]
        if not layout.distributed:  # (sharded: each rank holds part of the gradients)
            for name, grad in _logical(trainer, ctx, grads=True).items():
                assert grad.abs().max() > 0, (layout.name, name)
                _close(grad, serial_grads[name], GRAD_TOL, f"{layout.name}: {name} gradient")
        for i in range(1, layout.steps):
            record, stats = trainer.step(i)
            got.append(record)
        if layout.p > 1:  # each send carries this rank's b·s/c positions (t = 1 here)
            model = MODELS[layout.model]
            sent = step.TRAIN.micro_batch_size * model.seq_length // layout.c * model.hidden_size
            assert set(stats.sent_elements) == {sent}, (layout.name, stats.sent_elements)
        for record, want in zip(got, records):
            assert not record["skipped"], layout.name
            assert record["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), layout.name
            if trainer.holds_loss:
                assert record["loss"] == pytest.approx(want["loss"], rel=1e-5), layout.name
        evaluated = evaluate(trainer, trainer.data.valid, 1)["loss"]
        if trainer.holds_loss:
            assert evaluated == pytest.approx(validation, rel=1e-5), layout.name
        results.append((layout.name, *compare_weights(trainer, ctx, serial_weights,
                                                      layout.name)))
        del trainer
        ctx.destroy()
    return results


# Four processes, every layout in one call.
LAYOUTS = [
    Layout(c=4),
    Layout(c=4, comm="all_gather", model="learned"),
    Layout(c=4, comm="a2a", model="learned"),
    Layout(c=2, d=2, comm="a2a", per_token_loss=True),
    Layout(c=2, d=2, distributed=True),
    Layout(c=2, t=2, sequence_parallel=True, recompute="selective"),
    Layout(c=2, t=2, sequence_parallel=True, comm="a2a", model="learned", masked=False),
    Layout(c=2, p=2),
    Layout(c=2, p=2, schedule="interleaved", k=1, comm="all_gather", model="learned",
           recompute="full"),
    Layout(c=2, p=2, schedule="zb-h1", recompute="full", masked=False),
    Layout(c=2, p=2, schedule="zbv", comm="a2a"),
    # Pretraining sequences split at the end-of-document token: positions
    # and attention per document through the ring and the all-to-all.
    Layout(c=2, d=2, reset=True),
    Layout(c=4, comm="a2a", model="learned", reset=True),
    # Sliding windows and sinks: skipped ring steps and key blocks, masks by
    # absolute positions, the sinks applied once after the merge (under a2a
    # each rank its heads').
    Layout(c=2, d=2, model="window3", steps=2),
    Layout(c=2, d=2, model="window11", comm="all_gather", steps=2),
    Layout(c=2, d=2, model="window3", comm="a2a", steps=2),
    Layout(c=4, model="window3", steps=2),
    Layout(c=4, model="window3", comm="all_gather", steps=2),
    Layout(c=4, model="window6-mha", comm="a2a", steps=2),
    Layout(c=2, t=2, sequence_parallel=True, model="window3", steps=2),
    Layout(c=2, d=2, model="window3", reset=True, steps=2),           # windows in documents
    Layout(c=4, model="window6-mha", comm="a2a", reset=True, steps=2),
    Layout(c=2, d=2, model="sinks", comm="a2a", reset=True, steps=2),   # sinks in documents
]


def test_context_parallel_layouts_train_like_one_process(pools):
    for layout in LAYOUTS:  # the references once, here, rather than on each of the four ranks
        _one_process(layout)
    per_rank = pools(4).run(_layouts_vs_one_process, LAYOUTS, dict(_serial))
    for i, layout in enumerate(LAYOUTS):
        names = set().union(*(results[i][1] for results in per_rank))
        every = {name for name, _ in _reference_names(layout.model)}
        assert names == every, layout.name      # every parameter compared on some rank
        worst = max(results[i][2] for results in per_rank)
        assert worst < 1e-5, layout.name


def _seen(blocks, query_positions, key_positions, seq: int, row: int = 0) -> torch.Tensor:
    """[seq, seq] int: how many of `blocks` compute each (query, key) pair of
    absolute positions in batch row `row` (a block's own masks and causality
    applied)."""
    seen = torch.zeros(seq, seq, dtype=torch.int64)
    for rows, q0, q1, k0, k1, causal, mask in blocks:
        if row not in range(2)[rows]:
            continue
        computed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        computed = computed.tril() if causal else computed
        computed = computed if mask is None else computed & mask[row % mask.shape[0], 0]
        rows, cols = computed.nonzero(as_tuple=True)
        seen.index_put_((query_positions[q0:q1][rows], key_positions[k0:k1][cols]),
                        torch.ones_like(rows), accumulate=True)
    return seen


# Two batch rows of packed documents (32 positions): lengths 5, 9, 2, 16 and
# 13, 1, 18, so documents start inside chunks and windows, one is a single
# position and some cross a chunk or context rank's boundary.
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2 + [3] * 16,
                          [7] * 13 + [8] + [9] * 18])


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("block", [128, 3])
def test_window_plans_compute_each_pair_in_the_window_once(monkeypatch, block, documents):
    """Every comm type's blocks, over all ranks (and ring steps), compute each
    (query, key) pair inside the window exactly once and none outside it
    (local_attention.window_mask), with query blocks of 3 positions too, so
    that blocks straddle the window's edge; at c = 4 with a window of 3 some
    ring steps compute nothing. With packed documents, in each batch row,
    exactly the pairs in the window and in one document."""
    from ptdp.parallel import context_attention as attention
    from ptdp.parallel.context_layout import rank_positions
    from ptdp.parallel.local_attention import window_mask
    monkeypatch.setattr(attention, "WINDOW_BLOCK", block)
    attention._window_plan.cache_clear()
    seq, natural = 32, torch.arange(32)
    for c, left in [(2, 0), (2, 3), (2, 11), (4, 3), (4, 5), (4, 20)]:
        half = seq // c // 2
        window = attention._Window(left, seq, CPU)
        docs = attention._Documents(DOCUMENTS, 2, CPU) if documents else None
        for row in range(2 if documents else 1):
            ring, gathered, empty_steps = 0, 0, 0
            for rank in range(c):
                queries = rank_positions(seq, c, rank)
                for source in range(c):
                    blocks = attention._ring_blocks(rank, source, c, half, docs, window)
                    empty_steps += not blocks
                    ring = ring + _seen(blocks, queries, rank_positions(seq, c, source), seq, row)
                spans = attention._chunk_spans(rank, c, half)
                gathered = gathered + _seen(
                    attention._whole_sequence_blocks(spans, docs, [], window), queries, natural,
                    seq, row)
            chunks = [(start, start, half) for start in range(0, seq, half)]
            a2a = _seen(attention._whole_sequence_blocks(chunks, docs, [], window), natural,
                        natural, seq, row)
            want = window_mask(seq, (left, 0))
            if documents:
                want &= DOCUMENTS[row].unsqueeze(-1) == DOCUMENTS[row].unsqueeze(0)
            for name, got in [("p2p", ring), ("all_gather", gathered), ("a2a", a2a)]:
                assert torch.equal(got, want.long()), (name, c, left, block, row)
            if not documents:
                assert (empty_steps > 0) == ((c, left) in [(2, 0), (4, 3), (4, 5)]), (c, left)
    attention._window_plan.cache_clear()


def _half_precision_vs_one_process(rank: int, precision: str, model: str) -> list[float]:
    """c = 4 (p2p) against one process, both in `precision`: the relative
    differences of the two iterations' losses and gradient norms."""
    layout = Layout(c=4, steps=2, model=model)
    differences = []
    runs = []
    for c, ctx in ((1, ParallelContext.single()), (4, None)):
        config = _config(dataclasses.replace(layout, c=c))
        # fp16: a fixed scale that does not overflow, so that both runs step
        scale = {"loss_scale": 1024.0} if precision == "fp16" else {}
        config.train = dataclasses.replace(config.train, **{precision: True}, **scale)
        if ctx is None:
            ctx = ParallelContext.build(RankGrid(tp=1, dp=1, pp=1, cp=4))
        trainer = _trainer(config, ctx)
        runs.append([trainer.step(i)[0] for i in range(layout.steps)])
        if c == 4:
            ctx.destroy()
    for got, want in zip(*reversed(runs)):
        assert not got["skipped"]
        differences += [abs(got["loss"] / want["loss"] - 1),
                        abs(got["grad_norm"] / want["grad_norm"] - 1)]
    return differences


@pytest.mark.parametrize("precision, model", [("bf16", "window3"), ("fp16", "rotary")])
def test_half_precision_trains_like_one_process(pools, precision, model):
    """The blocks' softmax statistics and merges stay in fp32 (ptdp.parallel.
    block_attention): in bf16 and fp16 the losses and gradient norms stay
    within those precisions' rounding of one process's. In bf16 the model
    has sliding windows and learnable sinks (fp32 logits on bf16 blocks)."""
    for differences in pools(4).run(_half_precision_vs_one_process, precision, model):
        assert max(differences) < (1e-3 if precision == "bf16" else 2e-4), differences


def _reference_names(model: str):
    from ptdp.model.shapes import logical_shapes
    return logical_shapes(MODELS[model]).items()


# ------------------------------------------------------------------ `ptdp train`, end to end

def test_the_cli_trains_saves_and_resumes_under_other_context_sizes(tmp_path, one_process_run,
                                                                    capsys):
    """`ptdp train --context-parallel-size 2` prints the one-process losses
    (test_train_cli's model and run), evaluates, and saves at iteration 2;
    the checkpoint resumes in one process (no context parallelism) to the
    same iterations 3 and 4, and `ptdp generate` loads it."""
    from ptdp.cli import main
    from tests.test_train_cli import COMMON, _ptdp
    save = tmp_path / "checkpoints"
    records, printed, stdout = _ptdp(
        ["--context-parallel-size", "2", "--exit-interval", "2", "--save", str(save),
         "--eval-interval", "2", "--eval-iters", "1"], tmp_path, "c2")
    ref_records, ref_printed, _ = one_process_run
    assert "(t=1, p=1, d=1, c=2)" in stdout and "(t=1, p=1, d=1, c=2 p2p)" in stdout
    assert ("ptdp: context parallelism: each sequence in 4 chunks, 16 positions per rank; "
            "attention by a ring of key/value blocks (p2p), each block on ") in stdout
    assert printed[:2] == ref_printed[:2]
    assert 0 < records[-1]["val_loss"] < 10  # evaluated (its equality: the layouts above)
    for got, want in zip(records, ref_records[:2]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    # (in this process: one rank needs no launch)
    metrics = tmp_path / "resumed.jsonl"
    assert main(["train", *COMMON, "--load", str(save), "--metrics-file", str(metrics)]) == 0
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, ref_records[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    capsys.readouterr()
    assert main(["generate", "--load", str(save), "--prompt-ids", "1,2,3", "--max-new-tokens",
                 "4", "--temperature", "0", "--output-ids"]) == 0
    assert len(capsys.readouterr().out.strip().split(",")) == 4
