"""Packing is invisible, under every layout (issue 40's acceptance).

The same conversations train as packed sequences (three or six whole
conversations per sequence, each with positions restarting at 0 and
attention kept inside it, padding masked out of the loss) and one
conversation per padded sequence. With the per-token loss (--sft's
default: the global batch's loss tokens summed, over their count) the
first iteration's loss and every gradient are the same numbers either way,
in one process; and each layout below trains on the packs over three
AdamW steps as one process does (losses, gradient norms, weights), its
first gradients equal to the unpacked run's. Attention allowed across the
documents of a pack changes the result, so the document masks are really
what makes the two agree.

One pool of four processes runs every layout in one call, against the
one-process references the test computes once per model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ptdp.config import Config, DataConfig
from ptdp.config.checks import validate
from ptdp.data.loader import TrainingData
from ptdp.data.sft.packing import build_sequence
from ptdp.data.sft.template import TokenizedConversation
from ptdp.parallel.document_attention import Documents
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests import test_context_parallel as cp
from tests import test_moe_parallel as moe
from tests import test_ptdp_step as step

CPU = torch.device("cpu")
STEPS = 3
PACKS = 4            # packed sequences per iteration (microbatches of 1)
SEQ = 32
PAD = 0
GRAD_TOL = 1e-5      # relative to each gradient's largest element, as test_context_parallel
# Conversation lengths of each pack: documents crossing the context
# chunks' boundaries (8 positions at c = 2, 4 at c = 4), and padding.
PACK_LENGTHS = [(12, 10, 8), (20, 6, 4), (5, 5, 5, 5, 5, 5), (7, 13, 9)]

# MoE without balancing losses: those weigh each microbatch's own routing
# statistics, which a different grouping of the tokens changes by design.
MOE = dataclasses.replace(moe.MOE, seq_length=SEQ, vocab_size=96, moe_aux_loss_coeff=0.0,
                          moe_z_loss_coeff=0.0)
MODELS = {"rotary": cp.ROTARY, "learned": cp.LEARNED, "moe": MOE}


def _conversations(iteration: int) -> list[list[TokenizedConversation]]:
    """Per pack of the iteration, its conversations: random ids, the loss
    on the second half (the assistant's turn)."""
    rng = np.random.default_rng(100 + iteration)
    packs = []
    for lengths in PACK_LENGTHS:
        pack = []
        for n in lengths:
            mask = np.zeros(n, dtype=np.int8)
            mask[n // 2:] = 1
            pack.append(TokenizedConversation(rng.integers(1, 90, n).astype(np.int64), mask))
        packs.append(pack)
    return packs


def _sample(conversations: list[TokenizedConversation]) -> dict[str, np.ndarray]:
    """An SFT sample (ptdp.data.sft.dataset.SFTDataset's fields) of these conversations."""
    sequence = build_sequence(conversations, range(len(conversations)), SEQ, PAD)
    cu_seqlens = np.full(SEQ + 1, SEQ, dtype=np.int32)
    cu_seqlens[:len(sequence.cu_seqlens)] = sequence.cu_seqlens
    return {"tokens": sequence.tokens, "labels": sequence.labels, "loss_mask": sequence.loss_mask,
            "position_ids": sequence.position_ids, "document_ids": sequence.document_ids,
            "cu_seqlens": cu_seqlens}


def _packed() -> list[dict]:
    return [_sample(pack) for iteration in range(STEPS) for pack in _conversations(iteration)]


def _unpacked() -> list[dict]:
    """The first iteration's conversations, one per sequence."""
    return [_sample([conversation]) for pack in _conversations(0) for conversation in pack]


@dataclasses.dataclass(frozen=True)
class Layout:
    t: int = 1
    p: int = 1
    d: int = 1
    c: int = 1
    ep: int = 1
    comm: str = "p2p"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    k: int | None = None
    recompute: str | None = None
    distributed: bool = False
    model: str = "rotary"

    @property
    def name(self) -> str:
        parts = [f"t{self.t}p{self.p}d{self.d}c{self.c}", self.model]
        parts += [self.comm] * (self.c > 1) + [f"ep{self.ep}"] * (self.ep > 1)
        parts += ["sp"] * self.sequence_parallel + [self.schedule] * (self.p > 1)
        parts += [f"{self.recompute}-recompute"] * bool(self.recompute)
        return "-".join(parts + ["distopt"] * self.distributed)


def _config(layout: Layout, global_batch: int) -> Config:
    model = dataclasses.replace(MODELS[layout.model], recompute_granularity=layout.recompute)
    config = step._config(layout.t, layout.p, layout.d, layout.k, model, layout.sequence_parallel,
                          use_distributed_optimizer=layout.distributed,
                          calculate_per_token_loss=True, global_batch_size=global_batch,
                          train_iters=STEPS, adam_eps=moe.ADAM_EPS)
    config.parallel = dataclasses.replace(
        config.parallel, context_parallel_size=layout.c, cp_comm_type=layout.comm,
        expert_model_parallel_size=layout.ep,
        pipeline_schedule="1f1b" if layout.schedule == "interleaved" else layout.schedule)
    config.data = DataConfig(sft=True, data_path=["conversations.jsonl"],
                             tokenizer_type="HuggingFaceTokenizer")
    validate(config, world_size=layout.t * layout.c * layout.p * layout.d)
    return config


def _trainer(layout: Layout, ctx: ParallelContext, samples: list[dict],
             global_batch: int = PACKS) -> Trainer:
    return Trainer(_config(layout, global_batch), ctx, CPU,
                   data=TrainingData(train=samples, eod=PAD))


def _across_documents(microbatch_fn):
    """`microbatch_fn` whose packs attend across their documents (positions still restart)."""
    def build(iteration: int):
        def microbatch(i: int):
            tokens, labels, mask, documents = microbatch_fn(iteration)(i)
            return tokens, labels, mask, Documents(documents.position_ids, None)
        return microbatch
    return build


_serial: dict[str, tuple] = {}


def _one_process(model: str):
    """The references of a model: the unpacked first iteration's loss and
    gradients; the packed run's records, first gradients and final weights.
    Checked here: packed and unpacked agree, attention across documents not."""
    if model not in _serial:
        ctx = ParallelContext.single()
        unpacked = _trainer(Layout(model=model), ctx, _unpacked(),
                            global_batch=sum(map(len, PACK_LENGTHS)))
        want, _ = unpacked.step(0)
        want_grads = cp._logical(unpacked, ctx, grads=True)
        packed = _trainer(Layout(model=model), ctx, _packed())
        first, stats = packed.step(0)
        # Each conversation's second half is in the loss, less its first token
        # (no earlier token of the conversation predicts it).
        assert stats.batch_tokens.item() == sum(n - n // 2 for pack in PACK_LENGTHS for n in pack)
        assert first["loss"] == pytest.approx(want["loss"], rel=1e-6), model
        grads = cp._logical(packed, ctx, grads=True)
        for name, grad in grads.items():
            cp._close(grad, want_grads[name], GRAD_TOL, f"{model} packed: {name} gradient")
        records = [first] + [packed.step(i)[0] for i in range(1, STEPS)]
        weights = cp._logical(packed, ctx, grads=False)

        crossing = _trainer(Layout(model=model), ctx, _packed())
        crossing.microbatch_fn = _across_documents(crossing.microbatch_fn)
        leaked, _ = crossing.step(0)
        assert abs(leaked["loss"] - want["loss"]) > 1e-4, model
        leaked_grads = cp._logical(crossing, ctx, grads=True)
        assert any((leaked_grads[name] - want_grads[name]).abs().max()
                   > 1e-3 * want_grads[name].abs().max() for name in want_grads), model
        _serial[model] = want_grads, records, grads, weights
    return _serial[model]


def _layouts_vs_one_process(rank: int, layouts: list[Layout], references: dict
                            ) -> list[tuple[str, set, float]]:
    """Each layout against `references` (model -> _one_process(model),
    computed once by the caller): (name, parameters compared, the largest
    weight difference)."""
    results = []
    for layout in layouts:
        unpacked_grads, records, _, weights = references[layout.model]
        ctx = ParallelContext.build(RankGrid(tp=layout.t, dp=layout.d, pp=layout.p, cp=layout.c,
                                             ep=layout.ep))
        trainer = _trainer(layout, ctx, _packed())
        got = [trainer.step(0)[0]]
        if not layout.distributed:  # (sharded: each rank holds part of the gradients)
            for name, grad in cp._logical(trainer, ctx, grads=True).items():
                cp._close(grad, unpacked_grads[name], GRAD_TOL, f"{layout.name}: {name} gradient")
        got += [trainer.step(i)[0] for i in range(1, STEPS)]
        for record, want in zip(got, records):
            assert not record["skipped"], layout.name
            assert record["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), layout.name
            if trainer.holds_loss:
                assert record["loss"] == pytest.approx(want["loss"], rel=1e-5), layout.name
                assert record["loss_tokens"] == want["loss_tokens"], layout.name
        results.append((layout.name, *cp.compare_weights(trainer, ctx, weights, layout.name)))
        del trainer
        ctx.destroy()
    return results


# Four processes, every layout in one call.
LAYOUTS = [
    Layout(t=2, d=2, sequence_parallel=True, recompute="selective"),
    Layout(p=2, d=2, schedule="interleaved", k=1, model="learned", recompute="full"),
    Layout(t=2, p=2, schedule="zbv", sequence_parallel=True),
    Layout(d=4, distributed=True),
    Layout(t=2, p=2, model="learned", recompute="full"),
    Layout(d=4, ep=2, model="moe"),
    Layout(c=2, d=2),
    Layout(c=2, t=2, comm="all_gather", model="learned", sequence_parallel=True),
    Layout(c=2, p=2, comm="a2a"),
    Layout(c=4),
    Layout(c=4, comm="all_gather", model="learned"),
    Layout(c=4, comm="a2a", model="learned"),
]


def test_packed_conversations_train_as_one_per_sequence_under_every_layout(pools):
    # The references once, here, rather than on each of the four ranks.
    references = {layout.model: _one_process(layout.model) for layout in LAYOUTS}
    per_rank = pools(4).run(_layouts_vs_one_process, LAYOUTS, references)
    serial = ParallelContext.single()
    for i, layout in enumerate(LAYOUTS):
        names = set().union(*(results[i][1] for results in per_rank))
        reference = _trainer(Layout(model=layout.model), serial, _packed())
        every = {name for chunk in reference.chunks for name, _ in chunk.named_parameters()}
        assert names == every, layout.name      # every parameter compared on some rank
        assert max(results[i][2] for results in per_rank) < 1e-5, layout.name


# ------------------------------------------------------------------ pretraining text split at EOD

def test_reset_flags_run_the_document_after_an_eod_as_if_alone():
    """Megatron-LM's --reset-position-ids --reset-attention-mask: the tokens
    after an end-of-document token neither see it nor anything before it,
    and count positions from 0, so the document's loss and gradients are
    those of the document run alone; with --reset-position-ids only, the
    attention still crosses and they are not."""
    from ptdp.data.documents import documents_from_eod
    from ptdp.model.gpt import build_chunks

    eod, ctx = 5, ParallelContext.single()
    model = build_chunks(cp.LEARNED, ctx, CPU, seed=3)[0]
    first = torch.tensor([11, 12, 13, 14, 15, 16, 17, eod])
    second = torch.arange(30, 30 + SEQ - len(first) + 1)
    tokens = torch.cat([first, second]).unsqueeze(0)      # [1, s + 1]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = torch.zeros(1, SEQ)
    mask[0, len(first):] = 1.0                             # the second document's labels

    def loss_and_grads(*args, **kwargs):
        model.zero_grad()
        loss = model(*args, **kwargs)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}

    found = documents_from_eod(inputs, eod)
    split = loss_and_grads(inputs, labels, mask,
                           Documents(found["position_ids"], found["document_ids"]))
    alone = loss_and_grads(second[:-1].unsqueeze(0), second[1:].unsqueeze(0))
    assert split[0] == pytest.approx(alone[0], rel=1e-6)
    for name, grad in alone[1].items():
        torch.testing.assert_close(split[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    positions_only = loss_and_grads(inputs, labels, mask, Documents(found["position_ids"], None))
    assert positions_only[0] != pytest.approx(alone[0], rel=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_packing_is_invisible_in_half_precision_to_its_rounding(precision):
    """bf16/fp16 (fp32 main weights, fp16 with loss scaling): packed and
    one-per-sequence runs of the same conversations agree to half
    precision's rounding, in the loss and in the gradients' norm."""
    ctx = ParallelContext.single()

    def first_step(samples: list[dict], global_batch: int) -> dict:
        config = _config(Layout(), global_batch)
        # (fp16: a scale the first step does not overflow, so it is not skipped)
        config.train = dataclasses.replace(config.train, **{precision: True},
                                           initial_loss_scale=2.0 ** 12)
        return Trainer(config, ctx, CPU, data=TrainingData(train=samples, eod=PAD)).step(0)[0]

    packed = first_step(_packed(), PACKS)
    unpacked = first_step(_unpacked(), sum(map(len, PACK_LENGTHS)))
    assert not packed["skipped"] and not unpacked["skipped"]
    assert packed["loss"] == pytest.approx(unpacked["loss"], rel=1e-2)
    assert packed["grad_norm"] == pytest.approx(unpacked["grad_norm"], rel=3e-2)
