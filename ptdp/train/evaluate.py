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
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ptdp.data.loader import collate, split_microbatch
from ptdp.data.sampler import microbatch_indices
from ptdp.parallel.pipeline.executor import average_loss
from ptdp.parallel.pipeline.schedules import build_forward_only


def validation_microbatch_fn(trainer, dataset, iteration: int, start_sample: int = 0):
    """`microbatch(i)` for the executor: this data-parallel rank's
    microbatch i of evaluation iteration `iteration`, from `dataset`."""
    config, ctx = trainer.config, trainer.ctx
    tr = config.train

    def microbatch(i: int) -> tuple[torch.Tensor, ...]:
        indices = microbatch_indices(start_sample + iteration * trainer.global_batch, i, ctx.dp_rank,
                                     micro_batch_size=tr.micro_batch_size,
                                     global_batch_size=trainer.global_batch,
                                     data_parallel_size=ctx.dp_size)
        tokens = collate(dataset, indices, config.model.vocab_size)
        return tuple(t.to(trainer.device) for t in split_microbatch(
            tokens, trainer.data.eod, config.data.eod_mask_loss))
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
    was_training = trainer.model.training
    trainer.model.eval()
    losses: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for k in range(num_iters):
                stats = trainer.executor.run(
                    schedule, validation_microbatch_fn(trainer, dataset, k, start_sample),
                    forward_only=True)
                losses.extend(stats.losses)
                tokens.extend(stats.loss_tokens)
    finally:
        trainer.model.train(was_training)

    if not trainer.holds_loss:
        return {"loss": None, "perplexity": None}
    per_token = trainer.config.train.calculate_per_token_loss
    loss = average_loss(losses, tokens if per_token else None, ctx.dp_group)
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}
