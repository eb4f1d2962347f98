"""bench/megatron_peers.py: the query/key/value reordering, and (only where
megatron-core is installed in bench/.megatron-core; the suite never installs
it) the CPU shims and ptdp's weights copied into Megatron-Core's GPTModel
giving the same loss as ptdp's one-process model."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import megatron_shims  # noqa: E402
from megatron_side import interleaved_qkv  # noqa: E402


def test_fused_qkv_rows_are_reordered_per_query_group():
    # 4 heads in 2 query groups, head dim 3: each row labelled by its
    # (kind, head or group, position) so the expected order is written out.
    heads, groups, d = 4, 2, 3
    rows = [("q", h, i) for h in range(heads) for i in range(d)] \
        + [("k", g, i) for g in range(groups) for i in range(d)] \
        + [("v", g, i) for g in range(groups) for i in range(d)]
    labels = {row: n for n, row in enumerate(rows)}
    weight = torch.tensor([[labels[row], -labels[row]] for row in rows], dtype=torch.float32)
    expected = []
    for g in range(groups):
        expected += [("q", h, i) for h in range(g * 2, g * 2 + 2) for i in range(d)]
        expected += [("k", g, i) for i in range(d)] + [("v", g, i) for i in range(d)]
    want = torch.tensor([[labels[row], -labels[row]] for row in expected], dtype=torch.float32)
    assert torch.equal(interleaved_qkv(weight, heads, groups), want)
    bias = weight[:, 0]
    assert torch.equal(interleaved_qkv(bias, heads, groups), want[:, 0])


needs_megatron = pytest.mark.skipif(not megatron_shims.available(),
                                    reason="megatron-core is not installed in bench/.megatron-core "
                                           "(python bench/megatron_peers.py --install)")


def _same_loss_both_sides(rank: int, family: str) -> dict:
    """One process, the benchmark's tiny model (two layers): ptdp's
    Trainer and Megatron-Core's GPTModel holding ptdp's logical weights
    (megatron_state), forward and backward of the same global batch."""
    sys.path.insert(0, str(BENCH))
    import megatron_peers
    import megatron_shims as shims
    from megatron_side import (Layout, MegatronSide, destroy_megatron, initialize_megatron,
                               ptdp_forward_backward)
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    shims.install_import_shims()
    shims.install_cpu_device()
    shims.install_rng_tracker()
    shims.install_missing_names()
    shims.install_host_splits()
    row = megatron_peers.Row(family)
    model = replace(megatron_peers.model_of(row, tiny=True), num_layers=2)
    trainer = Trainer(megatron_peers.ptdp_config(row, model),
                      ParallelContext.build(RankGrid(tp=1, dp=1, pp=1)), torch.device("cpu"))
    batches = [trainer.microbatch_fn(0)(i)[:2] + (None,) for i in range(trainer.num_micro)]
    initialize_megatron(Layout(), megatron_peers.SEED)
    try:
        theirs = MegatronSide(model, Layout(), megatron_peers._logical_weights(model, megatron_peers.SEED),
                              megatron_peers.MICRO_BATCH, trainer.num_micro)
        shims.install_cpu_device()
        their_loss = theirs.step(batches)
    finally:
        destroy_megatron()
    return {"ours": ptdp_forward_backward(trainer, 0), "theirs": their_loss,
            "shims": [what for what, _ in shims.shims()]}


@needs_megatron
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_megatron_core_with_ptdp_weights_gives_ptdp_loss(pools, family):
    [result] = pools(1).run(_same_loss_both_sides, family)
    assert abs(result["ours"] - result["theirs"]) < 1e-4, result
    # The shims 0.16.1 needs in one process on a CPU, and no others.
    assert set(result["shims"]) == {
        "torch in Megatron-Core's modules", "Megatron-Core's RNG tracker",
        "megatron.core.transformer.moe.moe_utils.te_general_gemm",
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        "Tensor.cuda()"}, result["shims"]
