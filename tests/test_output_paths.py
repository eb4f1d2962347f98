"""Everything a run will write is checked before launch (issue 30, item 4):
every output flag of `ptdp train`, `ptdp plan --plot` and `ptdp preprocess
--output-prefix` goes through ptdp.output_paths, so that a dangling link, a
path under /proc, a directory, a socket or a directory nobody can write is a
`ptdp: error:` (exit 2) naming the flag, with nothing launched or written;
and a model that cannot fit the machine's memory by the memory model's
estimate is refused before its ranks allocate it (ptdp.perf.fits)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.output_paths import PROBE_PREFIX, file_system_type, output_path_problems
from ptdp.perf.fits import memory_problems
from tests.test_fault_matrix import mount_tmpfs  # noqa: F401  (a fixture: a small tmpfs)

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--mock-data", "--train-iters", "1"]
ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0
needs_proc = pytest.mark.skipif(file_system_type("/proc") != "proc", reason="no /proc mounted")


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# --------------------------------------------------------------------------- the shared check

def test_writable_paths_pass_and_the_probe_leaves_nothing(tmp_path):
    (tmp_path / "old.jsonl").write_text("kept\n")
    before = _listing(tmp_path)
    assert output_path_problems("--metrics-file", str(tmp_path / "new.jsonl")) == []
    assert output_path_problems("--metrics-file", str(tmp_path / "old.jsonl")) == []
    assert output_path_problems("--save", str(tmp_path / "a" / "b"), directory=True) == []
    assert output_path_problems("--save", str(tmp_path), directory=True) == []
    assert output_path_problems("--timeline", str(tmp_path / "t.png"), suffix=".png") == []
    assert _listing(tmp_path) == before   # no probe file, no directory made
    assert (tmp_path / "old.jsonl").read_text() == "kept\n"
    assert not any(name.startswith(PROBE_PREFIX) for name in os.listdir(tmp_path))


@pytest.mark.parametrize("directory", [False, True], ids=["file", "directory"])
def test_a_dangling_symbolic_link_is_refused_saying_where_it_points(tmp_path, directory):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone" / "target")
    (problem,) = output_path_problems("--flag", str(link), directory=directory)
    assert problem.startswith(f"--flag {link}: it is a symbolic link to {tmp_path}/gone/target, "
                              f"which does not exist")
    # A dangling link higher up: the directory cannot be made through it.
    (problem,) = output_path_problems("--flag", str(link / "sub" / "x.jsonl"), directory=directory)
    assert f"{link} is a symbolic link to {tmp_path}/gone/target, which does not exist" in problem


def test_a_link_to_an_existing_file_is_written_through(tmp_path):
    (tmp_path / "real.jsonl").write_text("")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    assert output_path_problems("--metrics-file", str(tmp_path / "link.jsonl")) == []


@needs_proc
@pytest.mark.parametrize("path,directory", [
    ("/proc/ptdp-test.jsonl", False), ("/proc/ptdp-test-dir/sub", True),
    ("/proc/self/status", False), ("/sys/ptdp-test.png", False)])
def test_pseudo_file_systems_are_refused(path, directory):
    (problem,) = output_path_problems("--flag", path, directory=directory)
    assert problem.startswith(f"--flag {path}: ")
    assert "file system, which holds no files; choose a path on a disk" in problem


def test_a_file_output_that_is_a_directory_or_a_socket(tmp_path):
    import socket

    (problem,) = output_path_problems("--metrics-file", str(tmp_path))
    assert problem == f"--metrics-file {tmp_path}: is a directory; give a file path"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "sock"))
        (problem,) = output_path_problems("--metrics-file", str(tmp_path / "sock"))
    assert "is not a regular file (a socket)" in problem
    # Streams the user may write are outputs too: --metrics-file /dev/stdout.
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert output_path_problems("--metrics-file", str(pipe)) == []
    assert output_path_problems("--metrics-file", os.devnull) == []
    (problem,) = output_path_problems("--metrics-file", str(tmp_path) + "/")
    assert "ends with '/': give a file path" in problem


def test_a_file_output_whose_directory_is_missing_or_a_file(tmp_path):
    (problem,) = output_path_problems("--loss-curve", str(tmp_path / "nope" / "l.png"),
                                      suffix=".png")
    assert problem == (f"--loss-curve {tmp_path}/nope/l.png: directory {tmp_path}/nope does not "
                       f"exist; create it or choose another path")
    (tmp_path / "file").write_text("")
    (problem,) = output_path_problems("--timeline", str(tmp_path / "file" / "t.png"))
    assert f"directory {tmp_path}/file is not a directory" in problem


def test_a_directory_output_that_is_a_file_or_under_one(tmp_path):
    (tmp_path / "file").write_text("")
    (problem,) = output_path_problems("--tensorboard-dir", str(tmp_path / "file"), directory=True)
    assert problem == f"--tensorboard-dir {tmp_path}/file: is a file; give a directory"
    (problem,) = output_path_problems("--tensorboard-dir", str(tmp_path / "file" / "x"),
                                      directory=True)
    assert "is a file, so the directory cannot be created under it" in problem


def test_the_format_follows_the_suffix(tmp_path):
    (problem,) = output_path_problems("--loss-curve", str(tmp_path / "l.jpg"), suffix=".png")
    assert problem.endswith("the file written is a PNG; use a .png path")
    (problem,) = output_path_problems("--plot", str(tmp_path / "p.gif"),
                                      suffix=(".png", ".pdf", ".svg"))
    assert problem.endswith("use one of .png, .pdf, .svg")


@pytest.mark.skipif(ROOT_USER, reason="root may write into any directory")
def test_a_directory_nobody_may_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        (problem,) = output_path_problems("--metrics-file", str(locked / "m.jsonl"))
        assert f"no file can be created in {locked}" in problem
        (problem,) = output_path_problems("--save", str(locked / "ck"), directory=True)
        assert f"no file can be created in {locked}" in problem
    finally:
        locked.chmod(0o700)


# --------------------------------------------------------------------------- through `ptdp train`

def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and "Traceback" not in err
    return err


@pytest.mark.parametrize("flag,name,directory", [
    ("--save", "ck", True), ("--metrics-file", "m.jsonl", False), ("--timeline", "t.png", False),
    ("--loss-curve", "l.png", False), ("--tensorboard-dir", "tb", True),
    ("--data-cache-path", "cache", True)])
def test_every_train_output_flag_refuses_a_dangling_link(no_launch, capsys, tmp_path, flag, name,
                                                         directory):
    link = tmp_path / name
    link.symlink_to(tmp_path / "elsewhere" / name)
    err = _refused(capsys, ["train", *TINY, flag, str(link)])
    assert f"{flag} {link}: it is a symbolic link to {tmp_path}/elsewhere/{name}" in err
    assert _listing(tmp_path) == [name]   # nothing written, the link untouched
    assert os.path.islink(link) and not os.path.exists(link)


@needs_proc
@pytest.mark.parametrize("flag,path", [
    ("--save", "/proc/ptdp-ck"), ("--metrics-file", "/proc/ptdp.jsonl"),
    ("--timeline", "/proc/ptdp.png"), ("--loss-curve", "/proc/ptdp.png"),
    ("--tensorboard-dir", "/proc/ptdp-tb"), ("--data-cache-path", "/sys/ptdp-cache")])
def test_every_train_output_flag_refuses_a_pseudo_file_system(no_launch, capsys, flag, path):
    err = _refused(capsys, ["train", *TINY, flag, path])
    assert f"{flag} {path}: /" in err and "file system, which holds no files" in err


def test_the_loss_curve_is_checked_before_the_run_not_after(no_launch, capsys, tmp_path):
    err = _refused(capsys, ["train", *TINY, "--loss-curve", str(tmp_path / "no" / "loss.png")])
    assert f"--loss-curve {tmp_path}/no/loss.png: directory {tmp_path}/no does not exist" in err


def test_all_output_problems_are_reported_together(no_launch, capsys, tmp_path):
    os.mkfifo(tmp_path / "pipe")
    err = _refused(capsys, ["train", *TINY, "--metrics-file", str(tmp_path),
                            "--timeline", str(tmp_path), "--tensorboard-dir",
                            str(tmp_path / "pipe")])
    assert f"--metrics-file {tmp_path}: is a directory" in err
    assert f"--timeline {tmp_path}: the file written is a PNG" in err
    assert f"--tensorboard-dir {tmp_path}/pipe: is a file; give a directory" in err


# --------------------------------------------------------------------------- `ptdp plan --plot`

PLAN = ["plan", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
        "--seq-length", "256", "--vocab-size", "1024", "--gpus", "2",
        "--global-batch-size", "8", "-t", "1", "-p", "2"]


@needs_proc
def test_plan_plot_is_checked_before_the_search(capsys, tmp_path):
    err = _refused(capsys, [*PLAN, "--plot", "/proc/ptdp-plan.png"])
    assert "--plot /proc/ptdp-plan.png: /proc is on the kernel's proc file system" in err
    assert capsys.readouterr().out == ""   # nothing was searched or printed


def test_plan_plot_refuses_a_format_it_cannot_draw_and_draws_svg(capsys, tmp_path):
    err = _refused(capsys, [*PLAN, "--plot", str(tmp_path / "plan.gif")])
    assert "use one of .png, .pdf, .svg" in err and not (tmp_path / "plan.gif").exists()
    assert main([*PLAN, "--plot", str(tmp_path / "plan.svg")]) == 0
    assert (tmp_path / "plan.svg").read_text().lstrip().startswith("<?xml")


# --------------------------------------------------------------------------- preprocess

@needs_proc
def test_preprocess_output_prefix_on_a_pseudo_file_system(capsys, tmp_path):
    source = tmp_path / "a.txt"
    source.write_text("some text")
    err = _refused(capsys, ["preprocess", "--input", str(source), "--output-prefix", "/proc/ptdp",
                            "--tokenizer-type", "ByteLevelTokenizer", "--workers", "1"])
    assert "--output-prefix /proc/ptdp: /proc is on the kernel's proc file system" in err


@needs_proc
def test_tokenizer_train_output_is_checked_before_training(capsys, tmp_path):
    source = tmp_path / "a.txt"
    source.write_text("some text to learn merges from " * 20)
    err = _refused(capsys, ["tokenizer", "train", "--input", str(source), "--vocab-size", "300",
                            "--output", "/proc/ptdp-tokenizer"])
    assert "--output /proc/ptdp-tokenizer: /proc is on the kernel's proc file system" in err


# --------------------------------------------------------------------------- memory

def _config(**model) -> Config:
    return Config(model=ModelConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4,
                                              seq_length=32, vocab_size=512), **model}),
                  train=TrainConfig(micro_batch_size=2, global_batch_size=8))


@pytest.mark.parametrize("argv,words", [
    (["--vocab-size", "10000000000"], "--vocab-size"),
    (["--hidden-size", "4000000"], "--hidden-size")])
def test_a_model_that_cannot_fit_is_refused_before_launch(no_launch, capsys, argv, words):
    flags = list(TINY)
    flags[flags.index(argv[0]) + 1] = argv[1]
    err = _refused(capsys, ["train", *flags])
    assert "the model does not fit this machine's memory: by ptdp's memory model its one " \
           "process needs" in err
    assert "(weights " in err and "optimizer " in err and "activations " in err
    assert "but the machine has" in err and words in err and "-p, -t" in err


def test_the_estimate_adds_up_every_local_rank():
    config = _config(vocab_size=2_000_000)
    config.parallel = ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=2)
    config.train.global_batch_size = 8
    one = memory_problems(_config(vocab_size=2_000_000), kind="cpu", local_processes=1,
                          host_memory=1 << 40)
    assert one == []
    (problem,) = memory_problems(config, kind="cpu", local_processes=4, host_memory=1 << 30)
    assert "its 4 local processes need" in problem and "the largest rank" in problem
    assert "fewer data-parallel ranks" in problem and "1.0 GiB" in problem
    # Under torchrun, a share of a larger job: at least the smallest rank per local process.
    (problem,) = memory_problems(config, kind="cpu", local_processes=2, host_memory=1 << 20)
    assert "at least its 2 local processes need" in problem


def test_on_gpus_the_largest_rank_is_compared_with_one_gpu():
    config = _config(hidden_size=8192, num_attention_heads=64, num_layers=48)
    (problem,) = memory_problems(config, kind="cuda", local_processes=1, device_memory=80 << 30)
    assert problem.startswith("the model does not fit one GPU: by ptdp's memory model its largest "
                              "rank needs")
    assert "a GPU here has 80.0 GiB" in problem and "(-p, -t)" in problem
    assert memory_problems(config, kind="cuda", local_processes=1, device_memory=1 << 50) == []


def test_on_a_cuda_machine_the_gpu_is_asked_for_its_memory(no_launch, capsys):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    flags = list(TINY)
    flags[flags.index("--vocab-size") + 1] = "10000000000"
    err = _refused(capsys, ["train", *flags, "--device", "cuda"])
    assert "the model does not fit one GPU: by ptdp's memory model its largest rank needs" in err
    assert "a GPU here has" in err


def test_ordinary_runs_are_not_refused():
    """The default model, the tiny test model on 8 ranks and both phases of
    the demo fit in 4 GiB (the refusal is for clearly impossible runs only)."""
    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_args
    from tests.test_demo import _phases

    demo = [config_from_args(build_parser().parse_args(["train", *phase])) for phase in _phases()]
    for config in demo:
        config.model.vocab_size = 2048   # what the demo's tokenizer gives when it runs
    tiny8 = _config()
    tiny8.parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                    data_parallel_size=2)
    for config in (Config(), tiny8, *demo):
        assert memory_problems(config, kind="cpu", local_processes=config.parallel.world_size,
                               host_memory=4 << 30) == []


# --------------------------------------------------------------------------- `ptdp convert`
# Its outputs are checked before the checkpoint or directory it converts is
# read (the inputs named here do not exist: the output's paragraph comes
# first); a write that fails (a full disk) leaves nothing behind.

@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    """A model-only checkpoint of a tiny GPT-2 (about 70 KB of weights)."""
    import torch

    from ptdp.interop.logical import logical_shapes
    from ptdp.checkpoint.store import save_logical_model

    model = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=512)
    weights = {name: torch.randn(shape) for name, shape in logical_shapes(model).items()}
    save = tmp_path_factory.mktemp("convert") / "ckpt"
    save_logical_model(save, Config(model=model, data=DataConfig(mock_data=True)), weights)
    return save


def _convert_refused(capsys, *argv) -> str:
    return _refused(capsys, ["convert", *argv])


@pytest.mark.parametrize("direction", ["--save", "--to-hf"])
def test_convert_refuses_a_dangling_link_before_reading(capsys, tmp_path, direction):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone" / "out")
    source = ["--from-hf", str(tmp_path / "no-such-model")] if direction == "--save" else \
        ["--load", str(tmp_path / "no-such-checkpoint")]
    err = _convert_refused(capsys, *source, direction, str(link))
    assert f"{direction} {link}: it is a symbolic link to {tmp_path}/gone/out" in err
    assert "no-such" not in err   # the input was not read
    assert _listing(tmp_path) == ["out"]


@needs_proc
@pytest.mark.parametrize("direction", ["--save", "--to-hf"])
def test_convert_refuses_a_pseudo_file_system(capsys, tmp_path, direction):
    source = ["--from-hf", str(tmp_path)] if direction == "--save" else ["--load", str(tmp_path)]
    err = _convert_refused(capsys, *source, direction, "/proc/ptdp-convert")
    assert f"{direction} /proc/ptdp-convert: /proc is on the kernel's proc file system" in err


@pytest.mark.parametrize("direction", ["--save", "--to-hf"])
def test_convert_refuses_a_file_where_its_directory_goes(capsys, tmp_path, direction):
    (tmp_path / "a-file").write_text("kept")
    source = ["--from-hf", str(tmp_path / "x")] if direction == "--save" else \
        ["--load", str(tmp_path / "x")]
    err = _convert_refused(capsys, *source, direction, str(tmp_path / "a-file"))
    assert f"{direction} {tmp_path / 'a-file'}: is a file; give a directory" in err
    err = _convert_refused(capsys, *source, direction, str(tmp_path / "a-file" / "under"))
    assert f"{tmp_path / 'a-file'} is a file, so the directory cannot be created under it" in err
    assert (tmp_path / "a-file").read_text() == "kept"


def test_convert_never_writes_into_a_directory_that_holds_a_model(capsys, tmp_path,
                                                                   small_checkpoint):
    """An export writes a new directory: one that holds another model (or
    anything) is refused before the checkpoint is read, and left as it was."""
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"theirs")
    err = _convert_refused(capsys, "--load", str(tmp_path / "x"), "--to-hf", str(other))
    assert f"--to-hf {other} is not an empty directory: it holds a model (config.json, " \
           f"model.safetensors); an export writes a new directory and never replaces or mixes " \
           f"with what is there" in err
    assert _listing(other) == ["config.json", "model.safetensors"]
    assert (other / "model.safetensors").read_bytes() == b"theirs"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("")
    err = _convert_refused(capsys, "--load", str(small_checkpoint), "--to-hf",
                           str(tmp_path / "notes"))
    assert f"--to-hf {tmp_path / 'notes'} is not an empty directory; an export" in err
    (tmp_path / "empty").mkdir()   # an empty directory is a new one
    assert main(["convert", "--load", str(small_checkpoint), "--to-hf",
                 str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_convert_refuses_a_save_a_training_job_holds(capsys, tmp_path, small_checkpoint):
    from ptdp.checkpoint.lock import SaveLock

    hf = tmp_path / "hf"
    assert main(["convert", "--load", str(small_checkpoint), "--to-hf", str(hf)]) == 0
    save = tmp_path / "held"
    with SaveLock(save):   # what a running `ptdp train --save` holds
        before = _listing(save)
        err = _convert_refused(capsys, "--from-hf", str(hf), "--save", str(save))
        assert f"--save {save} is in use by another job, process {os.getpid()}" in err
        assert "Wait for it to end, or give this run another --save" in err
        assert _listing(save) == before   # no iter_0000000.partial
    assert main(["convert", "--from-hf", str(hf), "--save", str(save)]) == 0   # once it ended


def test_convert_refuses_a_save_inside_a_checkpoint(capsys, tmp_path, small_checkpoint):
    inside = small_checkpoint / "iter_0000000"
    err = _convert_refused(capsys, "--from-hf", str(tmp_path), "--save", str(inside))
    assert f"--save {inside} is the checkpoint {inside}" in err


def test_convert_to_a_read_only_directory(capsys, mount_tmpfs, small_checkpoint):
    disk = mount_tmpfs("size=1m,ro")
    err = _convert_refused(capsys, "--load", str(small_checkpoint), "--to-hf", str(disk / "hf"))
    assert f"--to-hf {disk / 'hf'}: no file can be created in {disk} (Read-only file system)" in err
    err = _convert_refused(capsys, "--from-hf", str(disk), "--save", str(disk / "ckpt"))
    assert f"--save {disk / 'ckpt'}: no file can be created in {disk}" in err


def test_a_full_disk_leaves_nothing_of_the_conversion(capsys, tmp_path, mount_tmpfs,
                                                       small_checkpoint):
    """Export and import onto a disk with room for neither: one paragraph
    naming the output, and nothing of it on the disk (no partial directory,
    no iter_0000000.partial, no lock file, no directory made for it)."""
    disk = mount_tmpfs("size=16k")
    err = _convert_refused(capsys, "--load", str(small_checkpoint), "--to-hf",
                           str(disk / "a" / "hf"))
    assert f"--to-hf {disk / 'a' / 'hf'}: writing the Hugging Face directory failed: No space " \
           f"left on device" in err
    assert "Nothing of it was kept; free space there (or choose another --to-hf)" in err
    assert _listing(disk) == []
    hf = tmp_path / "hf"
    assert main(["convert", "--load", str(small_checkpoint), "--to-hf", str(hf)]) == 0
    err = _convert_refused(capsys, "--from-hf", str(hf), "--save", str(disk / "ckpt"))
    assert f"--save {disk / 'ckpt'}: writing the checkpoint failed: No space left on device" in err
    assert _listing(disk) == []
