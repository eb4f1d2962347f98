"""A checkpoint proves itself (issue 30, item 1): its metadata is sealed,
and what the metadata says is checked against the directory's name, the
stored tensors' names, shapes and dtypes, and the run's own arithmetic.
Every damaged checkpoint is refused naming the file and the field, before
anything is loaded; `ptdp train --load` refuses it before launch (exit 2).

One process, a tiny model trained 6 iterations (4 layers, as the issue's
checkpoint); each test damages a copy."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.parallel.topology import ParallelContext
from ptdp.checkpoint.store import CheckpointError, load_logical_model, read_metadata, resolve
from ptdp.checkpoint.args import with_checkpoint_shape
from ptdp.checkpoint.integrity import seal, tensor_file_metadata
from ptdp.train.loop import Trainer
from ptdp.train.resume import load_summary
from tests.legacy_checkpoint import make_version_1

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=8, train_iters=10, lr=1e-3, seed=5)
CPU = torch.device("cpu")
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
         "16", "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--mock-data"]
CHECKPOINT = "iter_0000006"


def _config() -> Config:
    return Config(model=MODEL, train=TRAIN, data=DataConfig(mock_data=True))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """SAVE with iter_0000006, its tensors split over two part files (as a
    t = 2 run writes them) so that a tensor can point at the wrong one."""
    save = tmp_path_factory.mktemp("trained")
    trainer = Trainer(_config(), ParallelContext.single(), CPU)
    for i in range(6):
        trainer.step(i)
    directory = trainer.save(str(save), 6)

    def split(metadata):
        tensors = load_file(str(directory / "part-pp0-tp0.safetensors"))
        names = sorted(tensors)
        second = {n: tensors[n] for n in names[1::2]}
        marks = tensor_file_metadata()
        save_file({n: tensors[n] for n in names[0::2]}, str(directory / "part-pp0-tp0.safetensors"),
                  metadata=marks)
        save_file(second, str(directory / "part-pp0-tp1.safetensors"), metadata=marks)
        for name in second:
            metadata["tensors"][name] = "part-pp0-tp1.safetensors"
    _reseal(directory, split)
    return save


@pytest.fixture
def save(trained, tmp_path) -> Path:
    copy = tmp_path / "save"
    shutil.copytree(trained, copy)
    return copy


def _reseal(directory: Path, change) -> None:
    """Apply `change(metadata)` as someone who also rewrote every checksum
    would (the files' sha256 and the seal): the cross-checks must catch it."""
    path = directory / "metadata.json"
    metadata = json.loads(path.read_text())
    change(metadata)
    for file in metadata["files"]:
        if (directory / file).is_file():
            metadata["files"][file] = hashlib.sha256((directory / file).read_bytes()).hexdigest()
    for part in directory.glob("part-*.safetensors"):
        metadata["files"].setdefault(part.name, hashlib.sha256(part.read_bytes()).hexdigest())
    path.write_text(json.dumps(seal(metadata)))


def _edit(directory: Path, change) -> None:
    """Apply `change(metadata)` by hand, as a text editor would."""
    path = directory / "metadata.json"
    metadata = json.loads(path.read_text())
    change(metadata)
    path.write_text(json.dumps(metadata, indent=1))


def _refused(directory: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        Trainer(_config(), ParallelContext.single(), CPU).load(str(directory))
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_the_split_checkpoint_is_sound_and_loads(save):
    """The fixture itself is a good checkpoint: the tests below see only
    their own damage."""
    trainer = Trainer(_config(), ParallelContext.single(), CPU)
    metadata = trainer.load(str(save))
    assert metadata["iteration"] == 6 and metadata["consumed_samples"] == 48
    assert metadata["optimizer"]["steps"] == 6
    assert len(set(metadata["tensors"].values())) == 2


@pytest.mark.parametrize("field,value", [("iteration", 60), ("consumed_samples", 49),
                                         ("num_layers", 3)])
def test_a_hand_edited_metadata_is_refused_by_its_seal(save, field, value):
    def change(metadata):
        (metadata["config"]["model"] if field == "num_layers" else metadata)[field] = value
    _edit(save / CHECKPOINT, change)
    _refused(save, "metadata.json differs from its metadata_sha256", "damaged")


def test_the_iteration_must_be_the_directorys(save):
    _reseal(save / CHECKPOINT, lambda m: m.update(iteration=60))
    _refused(save, "says iteration 60, but the directory is iter_0000006")


def test_consumed_samples_must_follow_from_the_runs_batches(save):
    _reseal(save / CHECKPOINT, lambda m: m.update(consumed_samples=49))
    _refused(save, "consumed_samples is 49, but 6 iterations from 0 samples at iteration 0 "
                   "consume 48")


def test_the_optimizer_steps_must_follow_from_the_iterations(save):
    _reseal(save / CHECKPOINT, lambda m: m["optimizer"].update(steps=1))
    _refused(save, "the optimizer took 1 steps, but 6 iterations since its start")


def test_a_configuration_that_leaves_stored_tensors_out_is_refused(save):
    """num_layers 4 -> 3 with --use-checkpoint-args built a 3-layer model
    and ignored layer 3's tensors."""
    _reseal(save / CHECKPOINT, lambda m: m["config"]["model"].update(num_layers=3))
    _refused(save, "(3 layers, hidden size 32) whose tensors are not the stored ones",
             "model/layers.3.")
    config = Config(model=ModelConfig(), train=TrainConfig(load=str(save), use_checkpoint_args=True),
                    data=DataConfig(mock_data=True))
    from ptdp.config import ConfigError
    with pytest.raises(ConfigError, match="layers.3"):
        with_checkpoint_shape(config, explicit=["train.load", "train.use_checkpoint_args"])


def test_a_tensor_placed_in_the_wrong_part_file_is_refused(save):
    def misplace(metadata):
        name = next(n for n, f in sorted(metadata["tensors"].items())
                    if f == "part-pp0-tp1.safetensors")
        metadata["tensors"][name] = "part-pp0-tp0.safetensors"
    _reseal(save / CHECKPOINT, misplace)
    _refused(save, "part-pp0-tp0.safetensors does not hold", "which metadata.json places there")


def _rewrite_tensor(directory: Path, name: str, make) -> None:
    part = directory / json.loads((directory / "metadata.json").read_text())["tensors"][name]
    tensors = load_file(str(part))
    tensors[name] = make(tensors[name])
    save_file(tensors, str(part))


def test_a_wrong_shape_tensor_with_a_matching_checksum_is_refused(save):
    name = "model/layers.1.mlp.dense_h_to_4h.weight"
    _rewrite_tensor(save / CHECKPOINT, name, lambda t: t[:-1].clone())
    _reseal(save / CHECKPOINT, lambda m: None)
    _refused(save, f"{name!r} has shape [127, 32], but the model of metadata.json needs [128, 32]")


def test_an_integer_weight_with_a_matching_checksum_is_refused(save):
    name = "model/layers.0.attention.dense.weight"
    _rewrite_tensor(save / CHECKPOINT, name, lambda t: t.to(torch.int32))
    _reseal(save / CHECKPOINT, lambda m: None)
    _refused(save, f"{name!r} is I32, not a floating-point weight")


def test_a_changed_tensor_file_is_refused_by_its_sha256(save):
    name = "model/final_layernorm.weight"
    _rewrite_tensor(save / CHECKPOINT, name, lambda t: t + 1)
    _refused(save, "sha256 differs from metadata.json")


@pytest.mark.parametrize("content,fragment", [
    ("null", "holds NoneType, not a mapping"),
    ("[]", "holds list, not a mapping"),
    ("{\"format\": \"ptdp-checkpoint\"", "metadata.json is unreadable"),
])
def test_metadata_that_is_not_a_checkpoints_is_refused(save, content, fragment):
    (save / CHECKPOINT / "metadata.json").write_text(content)
    _refused(save, fragment, "damaged")


def test_metadata_without_its_tensors_is_refused(save):
    _reseal(save / CHECKPOINT, lambda m: m.pop("tensors"))
    _refused(save, "'tensors' is None, not a mapping of tensor names to files")


def test_a_file_entry_outside_the_checkpoint_is_refused(save):
    _reseal(save / CHECKPOINT, lambda m: m["files"].update({"../../etc/passwd": "0" * 64}))
    _refused(save, "files entry '../../etc/passwd'")


@pytest.mark.parametrize("content,fragment", [
    (b"\xff\xfe\x00garbage", "holds unreadable bytes"),
    (b"../other/iter_0000012\n", "holds '../other/iter_0000012', not the name of an iter_* "
                                 "checkpoint"),
    (b"/abs/iter_0000006\n", "not the name of an iter_* checkpoint"),
])
def test_latest_names_only_a_checkpoint_beside_it(save, content, fragment):
    (save / "latest").write_bytes(content)
    with pytest.raises(CheckpointError) as caught:
        resolve(save)
    assert fragment in str(caught.value) and "latest" in str(caught.value)


def test_generation_and_export_read_only_verified_checkpoints(save):
    _reseal(save / CHECKPOINT, lambda m: m["config"]["model"].update(num_layers=3))
    with pytest.raises(CheckpointError, match="layers.3"):
        load_logical_model(save)


def test_train_refuses_a_damaged_checkpoint_before_launch(save, capsys):
    _edit(save / CHECKPOINT, lambda m: m.update(iteration=60))
    assert main(["train", *FLAGS, "--load", str(save), "--train-iters", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error: ") and "metadata_sha256" in err and "Traceback" not in err
    assert not (save / "iter_0000007").exists()
    _reseal(save / CHECKPOINT, lambda m: m.update(iteration=6))  # resealed: a sound checkpoint
    (save / "latest").write_text("../elsewhere/iter_0000006\n")
    assert main(["train", *FLAGS, "--load", str(save), "--train-iters", "7"]) == 2
    assert "not the name of an iter_* checkpoint" in capsys.readouterr().err


def test_a_checkpoint_before_the_seal_still_loads(save):
    """Format version 1 (no seal, no arithmetic records) is checked for the
    rest, loads, and the start-up line says it was believed as written."""
    make_version_1(save / CHECKPOINT)
    trainer = Trainer(_config(), ParallelContext.single(), CPU)
    metadata = trainer.load(str(save))
    assert metadata["iteration"] == 6
    summary = load_summary(TRAIN, save / CHECKPOINT, metadata)
    assert "note:" in summary and "before checkpoints were sealed" in summary
    _edit(save / CHECKPOINT, lambda m: m["config"]["model"].update(num_layers=3))
    _refused(save, "model/layers.3.")


def test_a_sealed_checkpoint_cannot_pass_as_one_before_the_seal(save):
    """Issue 38: declaring format version 1 skipped the seal, so edited
    consumed samples and optimizer steps were believed."""
    def downgrade(metadata):
        metadata["format_version"] = 1
        metadata["consumed_samples"] += 8
    _edit(save / CHECKPOINT, downgrade)
    _refused(save, "declares format version 1")
    _refused(save, "metadata_sha256, run_start, optimizer.started_at, which only sealed")

    def thorough(metadata):  # every record of the seal removed as well
        for key in ("metadata_sha256", "run_start"):
            metadata.pop(key)
        metadata["optimizer"].pop("started_at")
        metadata["optimizer"]["steps"] += 1
    _edit(save / CHECKPOINT, thorough)
    _refused(save, "its tensor file part-pp0-tp0.safetensors records format version 2")
    assert main(["train", *FLAGS, "--load", str(save), "--train-iters", "7"]) == 2
    assert not (save / "iter_0000007").exists()


def test_tensor_files_record_the_format_version(trained):
    from ptdp.checkpoint.integrity import FORMAT_VERSION
    fresh = Trainer(_config(), ParallelContext.single(), CPU)
    directory = fresh.save(str(trained.parent / "fresh"), 0)
    from safetensors import safe_open
    with safe_open(str(directory / "part-pp0-tp0.safetensors"), framework="pt") as file:
        assert file.metadata() == {"format": f"ptdp-checkpoint {FORMAT_VERSION}"}
