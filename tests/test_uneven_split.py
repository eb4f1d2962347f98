"""Uneven pipeline stages: Megatron-LM's --decoder-first/last-pipeline-num-layers
and --account-for-embedding/loss-in-pipeline-split.

As data: which layers each virtual stage holds (every layer once, in order,
the counts Megatron-LM's rules give). Refused before launch with the fix
named. Trained: losses and weights equal one process's under 1F1B, GPipe,
zb-h1 and zbv, and checkpoints reshard between different splits (parameter
names are global, so nothing in a checkpoint depends on the split).
Tolerances are test_ptdp_step's, for the same reasons.
"""

import dataclasses

import pytest
import torch

from ptdp.config import ConfigError, validate
from ptdp.schedules.kinds import location_of
from ptdp.schedules.build import layers_of
from ptdp.schedules.split import LayerSplit, stage_layer_counts
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer
from tests.test_ptdp_step import MODEL, _config
from tests.test_zero_bubble import legs_equal_one_process, trains_like_one_process

CPU = torch.device("cpu")


@pytest.mark.parametrize("l,p,v,kind,split,counts", [
    (8, 4, 1, "1f1b", LayerSplit(first=1), None),
    (10, 4, 1, "1f1b", LayerSplit(first=1, last=3), [1, 3, 3, 3]),
    (9, 4, 1, "1f1b", LayerSplit(first=3), [3, 2, 2, 2]),
    (8, 3, 1, "gpipe", LayerSplit(first=2, last=2), [2, 4, 2]),
    (6, 4, 1, "zb-h1", LayerSplit(embedding=True, loss=True), [1, 2, 2, 1]),
    (7, 4, 1, "1f1b", LayerSplit(loss=True), [2, 2, 2, 1]),
    (6, 2, 2, "zbv", LayerSplit(embedding=True, loss=True), [1, 2, 2, 1]),
])
def test_layers_per_stage(l, p, v, kind, split, counts):
    if counts is None:  # 8 layers, first 1: 7 do not split over 3 ranks
        with pytest.raises(Exception, match="must split evenly over the 3 other rank"):
            layers_of(0, 0, p, v, l, kind, split)
        return
    assert stage_layer_counts(l, p, v, kind, split) == counts
    placed = []
    for stage in range(p * v):
        rank, chunk = location_of(kind, p, v, stage)
        placed += layers_of(rank, chunk, p, v, l, kind, split)
    assert placed == list(range(l))


def _uneven(kind, t=1, p=2, d=1, layers=4, **split_flags):
    config = _config(t, p, d, None, dataclasses.replace(MODEL, num_layers=layers))
    return dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, pipeline_schedule=kind, **split_flags))


@pytest.mark.parametrize("kind,p,layers,flags,expected", [
    ("1f1b", 2, 4, dict(decoder_first_pipeline_num_layers=1,
                        account_for_loss_in_pipeline_split=True), "cannot be combined"),
    ("1f1b", 4, 8, dict(decoder_first_pipeline_num_layers=1), "must split evenly over the 3 other"),
    ("1f1b", 2, 4, dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=2),
     "they must add up to 4"),
    ("1f1b", 4, 4, dict(account_for_loss_in_pipeline_split=True), "use --num-layers 7"),
    ("zbv", 2, 4, dict(decoder_first_pipeline_num_layers=1), "not defined under zbv"),
    ("1f1b", 1, 4, dict(decoder_last_pipeline_num_layers=2), ">= 2"),
])
def test_uneven_splits_refused_with_the_fix(kind, p, layers, flags, expected):
    with pytest.raises(ConfigError, match=expected):
        validate(_uneven(kind, p=p, layers=layers, **flags), world_size=p)


def test_uneven_split_with_interleaving_is_refused():
    config = _config(1, 2, 1, 1, dataclasses.replace(MODEL, num_layers=4))
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, decoder_first_pipeline_num_layers=1))
    with pytest.raises(ConfigError, match="not supported with the interleaved schedule"):
        validate(config, world_size=2)


def _trains_like_one_process(rank, kind, p, d, layers, flags):
    ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=p))
    config = _uneven(kind, 1, p, d, layers, **flags)
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, use_distributed_optimizer=d > 1))
    validate(config, world_size=p * d)
    trainer = Trainer(config, ctx, CPU)
    trains_like_one_process(trainer, ctx, _config(model=dataclasses.replace(MODEL, num_layers=layers)))
    return sorted(int(i) for chunk in trainer.chunks for i in chunk.layers)


SPLITS = [
    ("1f1b", 2, 1, 4, dict(decoder_first_pipeline_num_layers=1), [[0], [1, 2, 3]]),
    ("gpipe", 3, 2, 4, dict(decoder_first_pipeline_num_layers=2), [[0, 1], [2], [3]]),
    ("zb-h1", 4, 1, 6, dict(account_for_embedding_in_pipeline_split=True,
                            account_for_loss_in_pipeline_split=True), [[0], [1, 2], [3, 4], [5]]),
    ("zbv", 2, 1, 6, dict(account_for_embedding_in_pipeline_split=True,
                          account_for_loss_in_pipeline_split=True), [[0, 5], [1, 2, 3, 4]]),
]


@pytest.mark.parametrize("kind,p,d,layers,flags,held", SPLITS, ids=[s[0] for s in SPLITS])
def test_uneven_stages_train_like_one_process(pools, kind, p, d, layers, flags, held):
    results = pools(p * d).run(_trains_like_one_process, kind, p, d, layers, flags)
    assert [results[r * d] for r in range(p)] == held  # pipeline rank r is global rank r·d (t = 1)


def test_checkpoints_reshard_between_splits(pools, tmp_path):
    """Layers 1|3, save, load as 3|1: the losses of one process training straight."""
    legs_equal_one_process(pools, tmp_path, [
        (1, 2, 1, _uneven("1f1b", 1, 2, 1, 4, decoder_first_pipeline_num_layers=1)),
        (1, 2, 1, _uneven("1f1b", 1, 2, 1, 4, decoder_last_pipeline_num_layers=1))])


def test_block_recomputation_flops_follow_the_stage_counts():
    """--recompute-method block recomputes the first n layers of each chunk:
    with layers 1, 3 and n = 2 that is 1 + 2 layers, not 2 + 2."""
    from ptdp.perf.analytic.flops import recomputed_layer_count

    model = dataclasses.replace(MODEL, recompute_granularity="full", recompute_method="block",
                                recompute_num_layers=2)
    assert recomputed_layer_count(model, 2) == 4
    assert recomputed_layer_count(model, 2, [1, 3]) == 3
