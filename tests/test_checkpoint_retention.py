"""Checkpoint retention: lineages, rollbacks into the same --save directory,
--keep-last, stale partial saves and file permissions. One process, a tiny
model."""

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.interop.logical import logical_shapes
from ptdp.parallel.topology import ParallelContext
from ptdp.checkpoint import retention, snapshot as checkpoint_save, store as checkpoint
from ptdp.checkpoint.store import (CheckpointError, read_metadata, resolve, save_logical_model,
                                   verify_file)
from ptdp.train.loop import Trainer
from tests.legacy_checkpoint import make_version_1

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=2, train_iters=10, lr=1e-2, seed=3)
CPU = torch.device("cpu")
GROUP = re.compile(r"(?P<label>[0-9a-f]{32}|legacy)-\d{8}T\d{6}Z")


def _trainer(**train) -> Trainer:
    config = Config(model=MODEL, train=dataclasses.replace(TRAIN, **train),
                    data=DataConfig(mock_data=True))
    return Trainer(config, ParallelContext.single(), CPU)


def _model_only_config() -> Config:
    return Config(model=MODEL, data=DataConfig(mock_data=True))


def _zero_weights() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape) for name, shape in logical_shapes(MODEL).items()}


def _train_and_save(trainer: Trainer, save: Path, iterations) -> None:
    """Iteration i is trained, then saved as iter_{i+1}."""
    for i in iterations:
        trainer.step(i)
        trainer.save(str(save), i + 1)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _latest(save: Path) -> str:
    return (save / "latest").read_text().strip()


def _run_id(directory: Path) -> str:
    return read_metadata(directory)["lineage"][-1][0]


def _check_complete(directory: Path) -> dict:
    metadata = read_metadata(directory)
    for file in metadata["files"]:
        verify_file(directory, file, metadata)
    return metadata


def _weights_file(directory: Path) -> bytes:
    return (directory / "part-pp0-tp0.safetensors").read_bytes()


def _killed(*args, **kwargs):
    """Stands in for a step of saving: the job dies there."""
    raise KeyboardInterrupt


def _abandoned_groups(save: Path) -> dict[str, Path]:
    """label (run id or legacy) -> its group directory under abandoned/."""
    groups = {}
    for group in (save / "abandoned").iterdir():
        match = GROUP.fullmatch(group.name)
        assert match, group.name
        groups[match["label"]] = group
    return groups


def test_rollback_keeps_the_abandoned_branch_and_prunes_only_its_own_lineage(tmp_path, capsys):
    old = _trainer()
    _train_and_save(old, tmp_path, range(6))  # iter_1 .. iter_6, nothing pruned
    old_run = _run_id(tmp_path / "iter_0000001")
    old_files = {i: _weights_file(tmp_path / f"iter_{i:07d}") for i in (4, 5, 6)}

    # Roll back to iteration 3 with a lower learning rate, saving into the same directory.
    new = _trainer(keep_last=2, lr=5e-3)
    new.load(str(tmp_path / "iter_0000003"))
    _train_and_save(new, tmp_path, [3])
    # The old iter_1..3 are this lineage's ancestors, pruned like its own:
    # 3 and 4 are the newest two.
    assert _names(tmp_path) == ["abandoned", "iter_0000003", "iter_0000004", "latest"]
    printed = capsys.readouterr().out
    assert "iter_0000004, iter_0000005, iter_0000006 -> " in printed
    assert "nothing deleted" in printed
    _train_and_save(new, tmp_path, [4])

    assert _names(tmp_path) == ["abandoned", "iter_0000004", "iter_0000005", "latest"]
    assert _latest(tmp_path) == "iter_0000005"
    new_run = new.checkpoint_lineage.run_id
    assert read_metadata(tmp_path / "iter_0000005")["lineage"] == [[old_run, 3], [new_run, 5]]
    # The abandoned branch, whole and unchanged, in one directory named after its run.
    groups = _abandoned_groups(tmp_path)
    assert list(groups) == [old_run]
    assert _names(groups[old_run]) == ["iter_0000004", "iter_0000005", "iter_0000006"]
    for i, data in old_files.items():
        assert _check_complete(groups[old_run] / f"iter_{i:07d}")["iteration"] == i
        assert _weights_file(groups[old_run] / f"iter_{i:07d}") == data
    assert _weights_file(tmp_path / "iter_0000004") != old_files[4]  # the new branch's own
    # The new checkpoints load; the newest is the rolled-back run's state.
    for i in (4, 5):
        _check_complete(tmp_path / f"iter_{i:07d}")
    resumed = _trainer()
    resumed.load(str(tmp_path))
    assert torch.equal(resumed.buffer.param_data, new.buffer.param_data)


def test_a_killed_rollback_save_leaves_latest_on_a_complete_checkpoint(tmp_path, monkeypatch):
    """The old branch is moved aside just before publishing: `latest`, which
    named the old branch's newest, must move to the lineage's newest first."""
    _train_and_save(_trainer(), tmp_path, range(4))
    rollback = _trainer()
    rollback.load(str(tmp_path / "iter_0000002"))
    monkeypatch.setattr(checkpoint_save, "publish_directory", _killed)
    with pytest.raises(KeyboardInterrupt):
        _train_and_save(rollback, tmp_path, [2])
    assert _latest(tmp_path) == "iter_0000002"
    _check_complete(resolve(tmp_path))


def test_fresh_run_moves_another_runs_checkpoints_aside(tmp_path, capsys):
    first = _trainer(keep_last=2)
    _train_and_save(first, tmp_path, range(3))  # iter_2, iter_3 remain
    first_run = _run_id(tmp_path / "iter_0000003")
    first_files = {i: _weights_file(tmp_path / f"iter_{i:07d}") for i in (2, 3)}
    capsys.readouterr()

    second = _trainer(keep_last=2, seed=4)
    _train_and_save(second, tmp_path, range(4))
    assert "nothing deleted" in capsys.readouterr().out
    assert _names(tmp_path) == ["abandoned", "iter_0000003", "iter_0000004", "latest"]
    assert _latest(tmp_path) == "iter_0000004"
    assert {_run_id(tmp_path / n) for n in ("iter_0000003", "iter_0000004")} == {
        second.checkpoint_lineage.run_id}
    group = _abandoned_groups(tmp_path)[first_run]
    assert _names(group) == ["iter_0000002", "iter_0000003"]
    for i, data in first_files.items():
        _check_complete(group / f"iter_{i:07d}")
        assert _weights_file(group / f"iter_{i:07d}") == data


def test_a_killed_save_of_a_fresh_run_never_leaves_latest_on_a_moved_checkpoint(tmp_path,
                                                                                monkeypatch):
    _train_and_save(_trainer(), tmp_path, range(2))
    monkeypatch.setattr(checkpoint_save, "publish_directory", _killed)
    with pytest.raises(KeyboardInterrupt):
        _train_and_save(_trainer(), tmp_path, [0])
    # Nothing of this lineage to name yet: no `latest` rather than a dangling one.
    assert not (tmp_path / "latest").exists()
    assert len(list((tmp_path / "abandoned").glob("*/iter_*"))) == 2


def test_publish_never_overwrites_another_lineage(tmp_path, monkeypatch):
    _train_and_save(_trainer(), tmp_path, [0])
    before = _weights_file(tmp_path / "iter_0000001")
    monkeypatch.setattr(checkpoint_save, "set_aside_other_lineages", lambda *args: None)
    with pytest.raises(CheckpointError, match="not of this run's lineage"):
        _train_and_save(_trainer(seed=9), tmp_path, [0])
    assert _weights_file(tmp_path / "iter_0000001") == before


def test_keep_last_never_removes_latests_target(tmp_path):
    trainer = _trainer()
    _train_and_save(trainer, tmp_path, range(4))
    (tmp_path / "latest").write_text("iter_0000002\n")  # e.g. pointed back by hand
    lineage = trainer.checkpoint_lineage.at(4)
    retention.prune(tmp_path, 1, lineage)
    assert _names(tmp_path) == ["iter_0000002", "iter_0000004", "latest"]


def test_rollback_with_keep_last_1_keeps_latest_loadable(tmp_path):
    """The bug: pruning by name kept the old branch's iter_6 and deleted the
    checkpoint just written, which `latest` named."""
    _train_and_save(_trainer(), tmp_path, range(6))
    rollback = _trainer(keep_last=1)
    rollback.load(str(tmp_path / "iter_0000003"))
    _train_and_save(rollback, tmp_path, [3])
    assert _names(tmp_path) == ["abandoned", "iter_0000004", "latest"]
    assert _latest(tmp_path) == "iter_0000004"
    _trainer().load(str(tmp_path))


def _strip_lineage(directory: Path) -> None:
    """Make a checkpoint look written before lineages existed (format
    version 1: no seal, no arithmetic records either)."""
    make_version_1(directory)
    path = directory / "metadata.json"
    metadata = json.loads(path.read_text())
    assert "metadata.json" not in metadata["files"]  # so the edit leaves it verifiable
    del metadata["lineage"]
    path.write_text(json.dumps(metadata))


def test_legacy_checkpoints_without_lineage(tmp_path):
    _train_and_save(_trainer(), tmp_path, range(4))
    for i in range(1, 5):
        _strip_lineage(tmp_path / f"iter_{i:07d}")
        _check_complete(tmp_path / f"iter_{i:07d}")
    untouched = (tmp_path / "iter_0000001" / "metadata.json").read_bytes()

    resumed = _trainer(keep_last=1)
    resumed.load(str(tmp_path / "iter_0000002"))
    _train_and_save(resumed, tmp_path, [2])
    # legacy iter_2 (loaded) is an ancestor, pruned by keep_last 1; legacy
    # iter_1 belongs to no known lineage and is older than the fork: left
    # alone; legacy iter_3 and iter_4 (the abandoned continuation) moved aside.
    assert _names(tmp_path) == ["abandoned", "iter_0000001", "iter_0000003", "latest"]
    assert (tmp_path / "iter_0000001" / "metadata.json").read_bytes() == untouched
    assert _names(_abandoned_groups(tmp_path)["legacy"]) == ["iter_0000003", "iter_0000004"]
    lineage = read_metadata(tmp_path / "iter_0000003")["lineage"]
    assert lineage[0][0].startswith("legacy-") and lineage[0][1] == 2
    assert lineage[1] == [resumed.checkpoint_lineage.run_id, 3]


def test_stale_partials_of_any_iteration_are_removed(tmp_path):
    for name in ("iter_0000009.partial", "iter_0000002.partial"):
        (tmp_path / name / "rng").mkdir(parents=True)
        (tmp_path / name / "part-pp0-tp0.safetensors").write_bytes(b"half")
    _train_and_save(_trainer(), tmp_path, [0])
    assert _names(tmp_path) == ["iter_0000001", "latest"]


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_checkpoint_files_follow_the_umask(tmp_path, mask):
    previous = os.umask(mask)
    try:
        _train_and_save(_trainer(), tmp_path / "trained", [0])
        save_logical_model(tmp_path / "imported", _model_only_config(), _zero_weights())
    finally:
        os.umask(previous)
    for directory in (tmp_path / "trained" / "iter_0000001",
                      tmp_path / "imported" / "iter_0000000"):
        # SAVE itself and its `latest` too: ptdp made them
        paths = [directory.parent, directory.parent / "latest", directory, *directory.rglob("*")]
        assert any(p.suffix == ".safetensors" for p in paths)
        for path in paths:
            expected = (0o777 if path.is_dir() else 0o666) & ~mask
            assert path.stat().st_mode & 0o777 == expected, (path.name, oct(path.stat().st_mode))


def test_resaving_an_iteration_of_the_same_lineage_replaces_it(tmp_path):
    trainer = _trainer()
    _train_and_save(trainer, tmp_path, range(2))
    first = _weights_file(tmp_path / "iter_0000002")
    with torch.no_grad():  # the weights change; saved again under the same iteration
        for name, param in trainer.model.named_parameters():
            if "layernorm" in name:  # (not the embedding: its padding rows are not saved)
                param.add_(0.5)
    trainer.save(str(tmp_path), 2)
    assert _names(tmp_path) == ["iter_0000001", "iter_0000002", "latest"]  # nothing set aside
    assert _weights_file(tmp_path / "iter_0000002") != first
    reloaded = _trainer()
    reloaded.load(str(tmp_path))
    assert torch.equal(reloaded.buffer.param_data, trainer.buffer.param_data)


def test_importing_a_model_into_a_run_directory_sets_the_run_aside(tmp_path):
    _train_and_save(_trainer(), tmp_path, range(2))
    run = _run_id(tmp_path / "iter_0000002")
    save_logical_model(tmp_path, _model_only_config(), _zero_weights())
    assert _names(tmp_path) == ["abandoned", "iter_0000000", "latest"]
    assert _latest(tmp_path) == "iter_0000000"
    assert _names(_abandoned_groups(tmp_path)[run]) == ["iter_0000001", "iter_0000002"]
