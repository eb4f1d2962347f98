"""One pooled check that a small model trains under several layouts as one
process does, for the test files that hold a model of their own against the
layouts (test_local_attention_layouts, test_mtp, test_mla).

A file gives its models (a dict of ModelConfig by name) and its layouts;
`one_process_runs` trains each model once here, in one process, and
`train_under_layouts` runs every layout in one call of the session's pool of
four ranks. Per layout and iteration (STEPS AdamW steps of GLOBAL_BATCH
samples, step.TRAIN's schedule, clipping and weight decay): no skipped step,
the gradient norm within rel 1e-5 of one process's, and on the ranks that
hold the loss the loss and each MTP depth's loss within rel 1e-5; after the
last step every parameter (gathered over its shards; ZeRO-3's gathered whole)
and every expert bias within step.WEIGHT_TOL, and every one of them compared
on some rank.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import Config, DataConfig, ModelConfig, validate
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step

CPU = torch.device("cpu")
STEPS = 3
GLOBAL_BATCH = 4   # microbatches of 1: 4 per iteration at d = 1, enough for p = 2's schedules
# The mock data's commonest token in these steps: the packed documents' boundary.
EOD = 79


@dataclasses.dataclass(frozen=True)
class Layout:
    model: str                           # a key of the file's models
    t: int = 1
    p: int = 1
    d: int = 1
    c: int = 1
    k: int | None = None                 # layers per virtual stage (interleaved)
    comm: str = "p2p"                    # --cp-comm-type
    sequence_parallel: bool = False
    recompute: str | None = None
    distributed: bool = False            # the distributed optimizer
    ep: int = 1
    schedule: str = "1f1b"
    sharding: str | None = None          # --use-megatron-fsdp's --data-parallel-sharding-strategy
    documents: bool = False              # --reset-position-ids --reset-attention-mask
    compile: bool = False                # --compile (against the eager one-process run)

    @property
    def name(self) -> str:
        """The model and every setting that is not the default."""
        changed = [f"{field.name}={getattr(self, field.name)}"
                   for field in dataclasses.fields(self)[1:]
                   if getattr(self, field.name) != field.default]
        return " ".join([self.model, *changed])

    @property
    def reference(self) -> tuple[str, bool]:
        """What decides the one-process run: the model and the data."""
        return self.model, self.documents


def layout_config(models: dict[str, ModelConfig], layout: Layout) -> Config:
    model = dataclasses.replace(models[layout.model], recompute_granularity=layout.recompute)
    config = step._config(layout.t, layout.p, layout.d, layout.k, model, layout.sequence_parallel,
                          use_distributed_optimizer=layout.distributed, train_iters=STEPS,
                          global_batch_size=GLOBAL_BATCH, compile=layout.compile)
    config.parallel = dataclasses.replace(config.parallel, context_parallel_size=layout.c,
                                          cp_comm_type=layout.comm,
                                          expert_model_parallel_size=layout.ep,
                                          pipeline_schedule=layout.schedule)
    config.data = DataConfig(mock_data=True, reset_position_ids=layout.documents,
                             reset_attention_mask=layout.documents)
    if layout.sharding:
        config.train = dataclasses.replace(config.train, use_megatron_fsdp=True,
                                           data_parallel_sharding_strategy=layout.sharding)
    validate(config, world_size=layout.t * layout.p * layout.d * layout.c)
    return config


def trainer(models: dict[str, ModelConfig], layout: Layout, ctx: ParallelContext) -> Trainer:
    built = Trainer(layout_config(models, layout), ctx, CPU)
    built.data.eod = EOD
    return built


def logical_state(trainer: Trainer, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """This rank's parameters as logical tensors (gathered over the tensor
    shards; ZeRO-3's gathered whole while read, copied) and its expert biases."""
    with trainer.buffer.gathered():
        state = {name: weight.clone() for name, weight in step._logical_weights(trainer, ctx).items()}
    state.update({name: bias.clone() for chunk in trainer.chunks
                  for name, bias in chunk.named_buffers() if name.endswith("expert_bias")})
    return state


Reference = tuple[list[dict], dict[str, torch.Tensor]]   # each step's record, the final state


def one_process_runs(models: dict[str, ModelConfig], layouts: list[Layout]
                     ) -> dict[tuple[str, bool], Reference]:
    """Each reference the layouts need, trained once by one process."""
    references = {}
    for layout in layouts:
        if layout.reference not in references:
            alone = trainer(models, Layout(layout.model, documents=layout.documents),
                            ParallelContext.single())
            records = [alone.step(i)[0] for i in range(STEPS)]
            references[layout.reference] = records, logical_state(alone, ParallelContext.single())
    return references


class Compared(NamedTuple):
    """What one rank checked of one layout."""
    layout: str
    names: set[str]                      # the parameters and biases it held and compared
    holds_loss: bool
    saved: dict[str, torch.Tensor] | None   # its logical state, where it saved a checkpoint


def layouts_vs_one_process(rank: int, models: dict[str, ModelConfig], layouts: list[Layout],
                           references: dict, checkpoint: str | None = None) -> list[Compared]:
    """Each layout in turn against its one-process run; the first layout
    saves its trained state into `checkpoint` where one is given."""
    results = []
    for layout in layouts:
        records, state = references[layout.reference]
        ctx = ParallelContext.build(RankGrid(tp=layout.t, dp=layout.d, pp=layout.p, cp=layout.c,
                                             ep=layout.ep))
        trained = trainer(models, layout, ctx)
        for i, want in enumerate(records):
            got = trained.step(i)[0]
            assert not got["skipped"], layout.name
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), layout.name
            if trained.holds_loss:
                for key in ("loss", *trained.mtp_names):
                    assert got[key] == pytest.approx(want[key], rel=1e-5), (layout.name, key)
        logical = logical_state(trained, ctx)
        for name, weight in logical.items():
            assert_close(weight, state[name], **step.WEIGHT_TOL,
                         msg=lambda m, n=name: f"{layout.name}: {n}: {m}")
        saves = checkpoint is not None and layout is layouts[0]
        if saves:
            trained.save(checkpoint, STEPS)
        results.append(Compared(layout.name, set(logical), trained.holds_loss,
                                logical if saves else None))
        ctx.destroy()
    return results


def train_under_layouts(pools, models: dict[str, ModelConfig], layouts: list[Layout],
                        references: dict, checkpoint: str | None = None
                        ) -> list[list[Compared]]:
    """Every layout in one call of a pool of four ranks; each parameter and
    expert bias of the one-process run compared on some rank. Returns each
    rank's results, a Compared per layout."""
    per_rank = pools(4).run(layouts_vs_one_process, models, layouts, references, checkpoint)
    for i, layout in enumerate(layouts):
        names = set().union(*(results[i].names for results in per_rank))
        assert names == set(references[layout.reference][1]), layout.name
    return per_rank
