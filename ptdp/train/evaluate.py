"""Validation loss through the pipeline, forward only.

`evaluate` runs `num_iters` evaluation iterations with the training layout:
each is a forward-only schedule (`build_forward_only`: every microbatch's
forward through every chunk, no backward) over one global batch of B
validation samples, cut into data-parallel slices and microbatches exactly
as training cuts its batches (ptdp.data.sampler). Evaluation iteration k
reads validation samples [start + k·B, start + (k+1)·B).

Which samples: the loop passes start_sample = 0, so every evaluation reads
the same first eval_iters·B validation samples and the numbers are
comparable from one evaluation to the next (Megatron-LM instead continues
through the validation set, so its successive values also differ by
sample). The validation dataset must hold those eval_iters·B samples.

The model runs in eval mode (no dropout, so no random numbers are drawn and
training's dropout streams are untouched) without autograd: no gradient,
gradient buffer or optimizer state changes; the previous mode is restored.

The loss is the mean of the per-microbatch losses (each the mean over its
tokens, or its unmasked tokens with --eod-mask-loss, as in training) over
microbatches, iterations and data-parallel replicas; under
--calculate-per-token-loss the mean over every counted token of them all
(Megatron-LM's Σ loss / Σ tokens). It is computed on the last pipeline
stage; every stage takes part in the pipeline's transfers.

Bits per character, comparable across tokenizers (a loss per token is not:
a tokenizer with longer tokens has fewer, harder ones):

    bits_per_char = Σ loss (nats, every label counted in the loss) / ln 2
                    / Σ characters those labels decode to

over the same microbatches, iterations and data-parallel replicas as the
loss (Σ loss is Σ mean · tokens, whatever --calculate-per-token-loss says).
The characters come from the data's table (TrainingData.characters: per id
its UTF-8 characters, ptdp.data.tokenizer.character_counts). The
end-of-document token counts no characters but its loss stays in: marking
where documents end is information the model must encode. Reported only
when the table exists (a text tokenizer, not --mock-data or NullTokenizer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ptdp.data.loader import collate
from ptdp.data.microbatch import MicrobatchSettings, to_microbatch
from ptdp.data.sampler import microbatch_indices
from ptdp.parallel.pipeline.executor import average_loss
from ptdp.schedules.build import build_forward_only


def validation_microbatch_fn(trainer, dataset, iteration: int, start_sample: int = 0):
    """`microbatch(i)` for the executor: this data-parallel rank's
    microbatch i of evaluation iteration `iteration`, from `dataset`."""
    config, ctx = trainer.config, trainer.ctx
    tr = config.train
    settings = MicrobatchSettings.from_config(config, trainer.data.eod)

    def microbatch(i: int) -> tuple[torch.Tensor, ...]:
        indices = microbatch_indices(start_sample + iteration * trainer.global_batch, i, ctx.dp_rank,
                                     micro_batch_size=tr.micro_batch_size,
                                     global_batch_size=trainer.global_batch,
                                     data_parallel_size=ctx.dp_size)
        return to_microbatch(collate(dataset, indices, config.model.vocab_size), settings,
                             trainer.device)
    return microbatch


def evaluate(trainer, dataset, num_iters: int, start_sample: int = 0) -> dict[str, Any]:
    """Validation loss and perplexity of `trainer`'s model over `num_iters`
    global batches of `dataset` from sample `start_sample`.

    Returns {"loss": mean loss, "perplexity": exp(loss)} on the last
    pipeline stage and {"loss": None, "perplexity": None} on the others.
    Every rank of the job must call it together (pipeline transfers, and the
    data-parallel all-reduce on the last stage). `dataset` is only read on
    the first and last pipeline stages; elsewhere it may be None."""
    ctx = trainer.ctx
    if num_iters < 1:
        raise ValueError(f"evaluation needs at least one iteration, not {num_iters}")
    if dataset is None and (ctx.is_first_stage or trainer.holds_loss):
        raise ValueError("no validation dataset on a stage that reads tokens: the split gives the "
                         "validation set no samples (see --split)")
    schedule = build_forward_only(ctx.pp_size, trainer.num_micro, trainer.num_chunks,
                                  placement=trainer.schedule.kind)
    table = getattr(trainer.data, "characters", None) if trainer.holds_loss else None
    if table is not None:
        table = table.to(trainer.device)
    was_training = trainer.model.training
    trainer.model.eval()
    losses: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    characters: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for k in range(num_iters):
                microbatch = validation_microbatch_fn(trainer, dataset, k, start_sample)
                if table is not None:
                    microbatch = _counting_characters(microbatch, table, characters)
                stats = trainer.executor.run(schedule, microbatch, forward_only=True)
                losses.extend(stats.losses)
                tokens.extend(stats.loss_tokens)
    finally:
        trainer.model.train(was_training)

    if not trainer.holds_loss:
        return {"loss": None, "perplexity": None}
    per_token = trainer.config.train.calculate_per_token_loss
    replicas, c = ctx.grad_reduce_group, ctx.cp_size  # data × context
    loss = average_loss(losses, tokens if per_token else None, replicas, c)
    result = {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}
    bits = (bits_per_character(losses, tokens, characters, replicas, c) if table is not None
            else None)
    if bits is not None:  # absent, not None, without text: the metrics file has no field then
        result["bits_per_char"] = bits
    return result


def _counting_characters(microbatch, table: torch.Tensor, characters: list[torch.Tensor]):
    """`microbatch` that also appends each microbatch's label characters to
    `characters`, once per microbatch: a rank holding the first and the
    last stage (zbv) reads a microbatch twice."""
    counted: set[int] = set()

    def read(i: int) -> tuple[torch.Tensor, ...]:
        batch = microbatch(i)
        if i not in counted:
            counted.add(i)
            characters.append(label_characters(batch, table))
        return batch
    return read


def label_characters(batch: tuple[torch.Tensor, ...], table: torch.Tensor) -> torch.Tensor:
    """Characters of a microbatch's labels counted in the loss (those its
    loss mask keeps, when it has one)."""
    chars = table[batch[1]]
    if len(batch) > 2 and batch[2] is not None:
        chars = chars * (batch[2] != 0)
    return chars.sum()


def bits_per_character(losses: list[torch.Tensor], tokens: list[torch.Tensor],
                       characters: list[torch.Tensor], group,
                       context_size: int = 1) -> float | None:
    """Σ loss / ln 2 / Σ characters over a rank's microbatches and its
    data-parallel replicas (`group`, with the context ranks: see
    average_loss): each microbatch loss is a mean, so its sum is
    mean · tokens. In float64, so the sums do not round the figure.
    None when the labels hold no characters (only end-of-document tokens)."""
    # A microbatch with no counted token adds nothing (its mean is 0/0).
    nats = sum(torch.where(count > 0, loss.double() * count.double(), 0.0)
               for loss, count in zip(losses, tokens))
    totals = torch.stack([nats, sum(c.double() for c in characters) / context_size])
    if group is not None:
        dist.all_reduce(totals, group=group)
    nats, chars = totals.tolist()
    return nats / math.log(2) / chars if chars > 0 else None


class Evaluator:
    """When a run evaluates, and its evaluation into the iteration's record."""

    def __init__(self, trainer, housekeeping, evaluation=evaluate):
        """`evaluation`: the function that evaluates (`evaluate`'s signature)."""
        self.trainer, self.housekeeping, self.evaluation = trainer, housekeeping, evaluation

    def due(self, done: int, verdict) -> bool:
        """Every rank evaluates (the pipeline needs them all), decided by the
        settings alone (never with --eval-iters 0, the last iteration's
        included); not when a signal gives little time left (`verdict`: the
        ranks' agreed view, ptdp.train.stopping.Verdict)."""
        tr = self.trainer.config.train
        return bool(tr.evaluates and (done % tr.eval_interval == 0
                                      or done == self.trainer.train_iters) and not verdict.signal)

    def run(self, record: dict) -> None:
        """Evaluate now; the validation loss, perplexity and (text data only)
        bits per character into `record`."""
        trainer = self.trainer
        with self.housekeeping.evaluation():
            result = self.evaluation(trainer, trainer.data.valid, trainer.config.train.eval_iters)
        record["val_loss"], record["val_perplexity"] = result["loss"], result["perplexity"]
        if "bits_per_char" in result:  # text data only (absent with --mock-data)
            record["val_bits_per_char"] = result["bits_per_char"]
