"""Checkpoints under context parallelism (issue 28): each rank's random
states in a file of its own, each tensor written by exactly one rank, the
context size in the layout record; at c = 1 the names and the record of
before. Pure arithmetic over rank grids (no processes), plus one
single-process save and load."""

import base64
import hashlib
import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.checkpoint.state import restore_rng as _restore_rng
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.checkpoint.integrity import seal
from ptdp.checkpoint.layout import (layout_record, part_name, rng_file, writes_state_buffers,
                                          writes_tensor)
from ptdp.train.loop import Trainer


def _contexts(grid: RankGrid) -> list[ParallelContext]:
    """Every rank's view of the grid (coordinates only: no process groups)."""
    return [ParallelContext(grid=grid, rank=rank) for rank in range(grid.world_size)]


def _trainer(ctx, chunks=1, distributed_optimizer=False):
    return SimpleNamespace(ctx=ctx, num_chunks=chunks,
                           buffer=SimpleNamespace(shard=distributed_optimizer))


def test_without_context_parallelism_the_names_and_record_are_the_old_ones():
    grid = RankGrid(tp=2, dp=2, pp=2)
    for ctx in _contexts(grid):
        c = ctx.coord
        assert rng_file(ctx) == f"rng/tp{c.tp}-pp{c.pp}-dp{c.dp}.json"
        assert part_name(ctx) == f"part-pp{c.pp}-tp{c.tp}" + (f"-dp{c.dp}" if c.dp else "")
    assert layout_record(_trainer(_contexts(grid)[0], 2, True)) == {
        "tensor": 2, "pipeline": 2, "data": 2, "chunks": 2, "distributed_optimizer": True}
    moe = RankGrid(tp=2, dp=2, pp=1, ep=2, etp=1)
    assert layout_record(_trainer(_contexts(moe)[0])) == {
        "tensor": 2, "pipeline": 1, "data": 2, "chunks": 1, "distributed_optimizer": False,
        "expert": 2, "expert_tensor": 1}


def test_each_context_rank_has_a_random_state_file_of_its_own():
    grid = RankGrid(tp=2, dp=2, pp=2, cp=2)
    contexts = _contexts(grid)
    names = [rng_file(ctx) for ctx in contexts]
    assert len(set(names)) == grid.world_size == 16
    # rank = tp + t·(cp + c·(dp + d·pp)): rank 11 is tp 1, cp 1, dp 0, pp 1
    assert names[11] == "rng/tp1-cp1-pp1-dp0.json"
    assert names[0] == "rng/tp0-cp0-pp0-dp0.json"


def test_the_layout_record_names_the_context_size_only_above_one():
    flat = layout_record(_trainer(_contexts(RankGrid(tp=2, dp=1, pp=1))[0]))
    split = layout_record(_trainer(_contexts(RankGrid(tp=2, dp=1, pp=1, cp=2))[0]))
    assert "context" not in flat
    assert split == {**flat, "context": 2}  # so a resume under another c reseeds the streams
    four = layout_record(_trainer(_contexts(RankGrid(tp=1, dp=1, pp=1, cp=4))[0]))
    assert four["context"] == 4


GRIDS = {  # dense and MoE foldings, with context ranks
    "c1": RankGrid(tp=2, dp=2, pp=2),
    "c2": RankGrid(tp=2, dp=2, pp=2, cp=2),
    "c4-d1": RankGrid(tp=1, dp=1, pp=2, cp=4),
    "c2-ep2": RankGrid(tp=1, dp=1, pp=1, cp=2, ep=2),
    "c2-ep4-etp1": RankGrid(tp=2, dp=2, pp=1, cp=2, ep=4, etp=1),
    "c2-ep2-etp2-d2": RankGrid(tp=2, dp=2, pp=2, cp=2, ep=2, etp=2),
}


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS)
def test_every_tensor_is_written_by_exactly_one_rank_into_a_file_of_its_own(grid):
    """A stage holds 7 dense tensors (the same on every rank of the stage)
    and 5 routed-expert tensors per expert-parallel rank (other experts on
    each): every one has exactly one writer, and no two writers share a
    part file, so no rank overwrites another's."""
    dense, experts = 7, 5
    written: Counter = Counter()
    files: dict[str, int] = {}
    state_writers: Counter = Counter()
    for ctx in _contexts(grid):
        mine = [("dense", ctx.pp_rank, i) for i in range(dense) if writes_tensor(ctx, False, i)]
        mine += [("expert", ctx.pp_rank, ctx.ep_rank, i) for i in range(experts)
                 if writes_tensor(ctx, True, i)]
        if writes_state_buffers(ctx):
            state_writers[ctx.pp_rank] += 1
            mine.append(("state", ctx.pp_rank))
        written.update(mine)
        if mine:
            assert part_name(ctx) not in files, (ctx.rank, files[part_name(ctx)])
            files[part_name(ctx)] = ctx.rank
    expected = ({("dense", p, i) for p in range(grid.pp) for i in range(dense)}
                | {("expert", p, e, i) for p in range(grid.pp) for e in range(grid.ep)
                   for i in range(experts)}
                | {("state", p) for p in range(grid.pp)})
    assert set(written) == expected  # none skipped
    assert set(written.values()) == {1}, [k for k, n in written.items() if n > 1]  # none twice


def _config(**train):
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=100, make_vocab_size_divisible_by=8)
    train = TrainConfig(micro_batch_size=1, global_batch_size=2, train_iters=4, lr=1e-3, seed=5,
                        **train)
    return Config(model=model, parallel=ParallelConfig(), train=train,
                  data=DataConfig(mock_data=True))


def test_a_checkpoint_of_another_context_size_passes_its_checks_and_reseeds(tmp_path):
    """One process (c = 1) saves: the old file names and layout record. The
    same checkpoint as a c = 2 run writes it (its random-state files named
    with the context rank, the layout saying context 2) is accepted by the
    integrity checks, and a c = 1 run loading it reseeds its streams from
    (seed, iteration) rather than looking for a file of its own."""
    trainer = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    trainer.step(0)
    trainer.save(str(tmp_path), 1)
    directory = resolve(tmp_path)
    metadata = read_metadata(directory)
    assert sorted(f for f in metadata["files"] if f.startswith("rng/")) == ["rng/tp0-pp0-dp0.json"]
    assert sorted(p.name for p in (directory / "rng").iterdir()) == ["tp0-pp0-dp0.json"]
    assert metadata["layout"] == {"tensor": 1, "pipeline": 1, "data": 1, "chunks": 1,
                                  "distributed_optimizer": False}

    state = (directory / "rng/tp0-pp0-dp0.json").read_bytes()
    (directory / "rng/tp0-pp0-dp0.json").unlink()
    digest = metadata["files"].pop("rng/tp0-pp0-dp0.json")
    for cp in range(2):
        (directory / f"rng/tp0-cp{cp}-pp0-dp0.json").write_bytes(state)
        metadata["files"][f"rng/tp0-cp{cp}-pp0-dp0.json"] = digest
    metadata["layout"]["context"] = 2
    (directory / "metadata.json").write_text(json.dumps(seal(metadata), indent=1, sort_keys=True))
    assert read_metadata(directory)["layout"]["context"] == 2  # verified, sealed

    resumed = Trainer(_config(), ParallelContext.single(), torch.device("cpu"))
    torch.manual_seed(12345)
    resumed.load(str(tmp_path))
    loaded = torch.get_rng_state()
    torch.manual_seed(5 + 1)  # the reseed: --seed + the checkpoint's iteration
    assert torch.equal(loaded, torch.get_rng_state())


class _Streams:
    """A model's random streams, recording what a restore does to them."""

    def __init__(self):
        self.set, self.seeded = None, None

    def set_states(self, states):
        self.set = states

    def seed(self, seed, ctx):
        self.seeded = seed


def _write_rng_checkpoint(directory, file: str, layout: dict) -> dict:
    saved = {"default": torch.arange(8, dtype=torch.uint8), "cpu": torch.get_rng_state()}
    path = directory / file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: base64.b64encode(v.numpy().tobytes()).decode()
                                for k, v in saved.items()}))
    return {"iteration": 3, "layout": layout,
            "files": {file: hashlib.sha256(path.read_bytes()).hexdigest()}}


def test_a_context_rank_restores_its_own_random_states(tmp_path):
    """Context rank 1 of a c = 2 run reads rng/tp0-cp1-pp0-dp0.json under
    the same layout; a c = 1 run (or c = 4) finds another layout and
    reseeds."""
    ctx = _contexts(RankGrid(tp=1, dp=1, pp=1, cp=2))[1]
    trainer = _trainer(ctx)
    trainer.chunks = [SimpleNamespace(rng=_Streams())]
    trainer.config = SimpleNamespace(train=SimpleNamespace(seed=7))
    metadata = _write_rng_checkpoint(tmp_path, "rng/tp0-cp1-pp0-dp0.json", layout_record(trainer))
    _restore_rng(trainer, tmp_path, metadata)
    streams = trainer.chunks[0].rng
    assert streams.seeded is None and torch.equal(streams.set["default"],
                                                  torch.arange(8, dtype=torch.uint8))
    for other in (RankGrid(tp=1, dp=1, pp=1), RankGrid(tp=1, dp=1, pp=1, cp=4)):
        trainer.ctx = _contexts(other)[1 % other.world_size]
        trainer.chunks = [SimpleNamespace(rng=_Streams())]
        _restore_rng(trainer, tmp_path, metadata)
        assert trainer.chunks[0].rng.set is None and trainer.chunks[0].rng.seeded == 7 + 3
