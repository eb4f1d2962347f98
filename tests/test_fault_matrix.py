"""The fault matrix of docs/reliability.md, run as real jobs of local
processes: ranks killed in each phase, a stopped rank, graceful-exit signals
to a rank, to the launcher and to torchrun (resumed bitwise), a full disk, a
damaged checkpoint, a planted lock file; SIGTERM to the whole process group
under MoE and context parallelism. Each case checks the exit status, the
message's key words, that the job ends well inside a generous bound, that no
rank is left behind, and that the newest complete checkpoint still loads."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ptdp.checkpoint.store import load_logical_model, read_metadata, resolve
from tests.in_process import train_refused
from tests.test_train_cli import _spawned_children

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

ROOT = Path(__file__).resolve().parents[1]
INJECTOR = Path(__file__).resolve().parent / "fault_injection"
# Generous for a loaded 2-core machine; a hang would take the 10-minute
# collective timeout.
EXIT_BOUND_SECONDS = 90
MODEL = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8"]
# Dropout on: a resume is bitwise only if the random streams are restored too.
RESUMABLE = ["--mock-data", "--vocab-size", "256", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4",
             "--global-batch-size", "16", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
             "--train-iters", "16", "--lr", "3e-3", "--seed", "7", "-d", "2"]  # -d 2 last


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """The jobs' error reports (tracebacks kept for bug reports) land in this
    test's folder, not the machine's temp dir."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    return env


def _start(argv, env=None, launcher=None) -> subprocess.Popen:
    command = (launcher or [sys.executable, "-m", "ptdp"]) + ["train", *argv]
    return subprocess.Popen(command, cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(process: subprocess.Popen, since: float) -> tuple[str, str, float]:
    try:
        stdout, stderr = process.communicate(timeout=EXIT_BOUND_SECONDS + 60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return stdout, stderr, time.monotonic() - since


def _record(case: str, seconds: float) -> None:
    """Shown with pytest -s: the figures of docs/reliability.md's table."""
    print(f"\n[fault matrix] {case}: the job ended {seconds:.1f} s after the fault")




def _gone(pids) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(not Path(f"/proc/{pid}").exists()
               or "zombie" in Path(f"/proc/{pid}/status").read_text() for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _newest_loads(save: Path) -> int:
    """Reads every tensor of `latest`, checking each file's sha256."""
    _, weights, metadata = load_logical_model(save)
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    return metadata["iteration"]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_until(condition, process, seconds=120.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the job did not get there in time"
        time.sleep(0.02)


# ------------------------------------------------------------------ uninterrupted twins, in the pool

def _job_config(argv: list[str]):
    """The configuration `ptdp train ARGV` hands its ranks: ptdp's entry point
    in this process, every check and resolution of a launch, stopped where
    it would start the ranks."""
    import ptdp.launch
    from ptdp.cli import main

    launched = []

    def launch_local(world_size, entry, payload, **kwargs):
        launched.append(payload)

    with pytest.MonkeyPatch.context() as patch:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                    "SLURM_NTASKS"):
            patch.delenv(var, raising=False)
        patch.setattr(ptdp.launch, "launch_local", launch_local)
        assert main(["train", *argv]) == 0
    (config,) = launched
    return config


def _train_as_a_rank(rank: int, config) -> None:
    """A pool rank's part of the job: the training loop (ptdp.train.loop.train,
    what each rank of a launched job runs) on the grid the job's ranks build."""
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import train

    par = config.parallel
    t, c, p = (par.tensor_model_parallel_size, par.context_parallel_size,
               par.pipeline_model_parallel_size)
    ctx = ParallelContext.build(RankGrid(tp=t, cp=c, dp=par.world_size // (t * c * p), pp=p,
                                         ep=par.expert_model_parallel_size,
                                         etp=par.expert_tensor_size))
    train(config, ctx, torch.device("cpu"))


def _uninterrupted_run(pools, argv: list[str]) -> None:
    """`ptdp train ARGV` run to its end by the session's pool (no job of its
    own to start): the twin a stopped and resumed job must equal bitwise."""
    config = _job_config(argv)
    pools(config.parallel.world_size).run(_train_as_a_rank, config)


# ------------------------------------------------------------------ ranks killed


@pytest.mark.parametrize("phase", ["startup", "train", "eval", "save"])
def test_a_rank_killed_in_any_phase_ends_the_job_and_the_newest_checkpoint_loads(tmp_path, phase):
    save, stamp = tmp_path / "ckpt", tmp_path / "killed-at"
    env = _env(PTDP_TEST_FAULT=f"{phase}:1", PTDP_TEST_FAULT_STAMP=str(stamp),
               PYTHONPATH=os.pathsep.join([str(INJECTOR), os.environ.get("PYTHONPATH", "")]))
    process = _start([*MODEL, "-p", "2", "--train-iters", "6", "--save", str(save),
                      "--save-interval", "1", "--eval-interval", "3", "--eval-iters", "1"], env=env)
    _, stderr, _ = _finish(process, time.monotonic())
    seconds = time.time() - float(stamp.read_text())
    _record(f"rank killed at {phase}", seconds)
    assert process.returncode == 1, stderr
    assert "ptdp: error: rank 1 failed (killed by SIGKILL)" in stderr, stderr
    assert seconds < EXIT_BOUND_SECONDS
    newest = {"startup": None, "train": 2, "eval": 2, "save": 1}[phase]  # eval comes before that iteration's save
    if newest is None:
        assert not (save / "latest").exists()
    else:
        assert _newest_loads(save) == newest


def test_a_stopped_rank_is_named_when_the_others_time_out(tmp_path):
    process = _start([*MODEL, "-d", "2", "--train-iters", "100000",
                      "--distributed-timeout-minutes", "0.1"])
    ranks = []
    try:
        assert "ptdp: starting 2 processes" in process.stdout.readline()
        assert "ptdp: 2 processes" in process.stdout.readline()
        assert "iteration" in process.stdout.readline()
        ranks = _spawned_children(process.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr, seconds = _finish(process, stopped_at)
        _record("rank stopped (SIGSTOP), timeout 6 s", seconds)
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert process.returncode == 1, stderr
    assert "rank 1" in stderr and "stopped" in stderr, stderr
    assert seconds < EXIT_BOUND_SECONDS


# ------------------------------------------------------------------ graceful exits, resumed bitwise


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, pools):
    folder = tmp_path_factory.mktemp("uninterrupted")
    # A checkpoint after every iteration: whichever iteration a signal stops
    # at, its checkpoint has an uninterrupted twin to equal.
    _uninterrupted_run(pools, [*RESUMABLE, "--save", str(folder / "ckpt"), "--save-interval", "1",
                               "--metrics-file", str(folder / "m.jsonl")])
    return _losses(folder / "m.jsonl"), folder / "ckpt"


def _losses(metrics: Path) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["loss"], r["grad_norm"])
            for r in map(json.loads, metrics.read_text().splitlines())]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _torchrun() -> list[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    return [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "ptdp"]


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("target", ["launcher", "rank", "torchrun"])
def test_sigterm_saves_and_the_resumed_run_equals_the_uninterrupted_one_bitwise(
        tmp_path, uninterrupted, target):
    """Each target's saved checkpoint equals the uninterrupted run's at that
    iteration, bitwise; one target (the launcher's) also resumes to the end,
    where losses and weights equal the uninterrupted run's: the resume path
    does not depend on who received the signal."""
    save, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    launcher = _torchrun() if target == "torchrun" else None
    layout = RESUMABLE[:-2] if target == "torchrun" else RESUMABLE  # torchrun sets the world size
    argv = [*layout, "--save", str(save), "--metrics-file", str(first)]
    process = _start(argv, launcher=launcher)
    at = random.Random().randint(2, 8)  # a random iteration, as a scheduler would
    _wait_until(lambda: _lines(first) >= at, process)
    if target == "rank":
        ranks = _spawned_children(process.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGTERM)
    else:
        os.kill(process.pid, signal.SIGTERM)
    stdout, stderr, seconds = _finish(process, time.monotonic())
    _record(f"SIGTERM to the {target}", seconds)
    if target != "torchrun":  # torchrun reports the signal it got in its own exit status
        assert process.returncode == 0, stderr
    assert seconds < EXIT_BOUND_SECONDS
    stopped = read_metadata(resolve(save))["iteration"]
    assert at <= stopped < 16
    assert (f"stopped after iteration {stopped} of 16: SIGTERM received; saved "
            f"{save}/iter_{stopped:07d}") in stdout

    losses, twins = uninterrupted
    assert _losses(first)[:stopped] == losses[:stopped]  # bitwise: exact floats
    _assert_same_tensors(_tensors(resolve(save)), _tensors(twins / f"iter_{stopped:07d}"))
    if target != "launcher":
        return
    resumed = subprocess.run((launcher or [sys.executable, "-m", "ptdp"])
                             + ["train", *argv[:-1], str(second), "--load", str(save)],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(first)[:stopped] + _losses(second) == losses
    _assert_same_tensors(_tensors(resolve(save)), _tensors(resolve(twins)))


# Two layouts whose ranks exchange in every layer (all-to-all; the ring of
# key/value blocks), short: a group SIGTERM lands in one of their collectives.
GROUP_LAYOUTS = {
    "moe": ["--num-experts", "4", "--expert-model-parallel-size", "2", "-d", "2"],
    "context-parallel": ["--context-parallel-size", "2", "--attention-dropout", "0", "-d", "1"],
}


@pytest.mark.parametrize("layout", sorted(GROUP_LAYOUTS))
def test_sigterm_to_the_whole_process_group_exits_0_and_resumes_bitwise(tmp_path, layout, pools):
    """What `timeout`, `kill -TERM -PGID` and a container's stop send: every
    process of the job, the fork server included, gets SIGTERM. The job
    saves, exits 0 and names the checkpoint (a server that died of it used
    to turn every rank's exit into "failed (exit code 255)"), and the
    resumed run ends where the uninterrupted one (the same training loop on
    the same configuration, run by the session's pool) does, bitwise."""
    argv = [*RESUMABLE[:-2], *GROUP_LAYOUTS[layout], "--train-iters", "8"]
    _uninterrupted_run(pools, [*argv, "--metrics-file", str(tmp_path / "whole.jsonl"), "--save",
                               str(tmp_path / "whole")])
    save, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    process = _start([*argv, "--save", str(save), "--metrics-file", str(first)])
    at = random.Random().randint(2, 5)
    _wait_until(lambda: _lines(first) >= at, process)
    os.killpg(process.pid, signal.SIGTERM)
    stdout, stderr, seconds = _finish(process, time.monotonic())
    _record(f"SIGTERM to the process group ({layout})", seconds)
    assert process.returncode == 0, stderr
    assert "failed" not in stderr and "Traceback" not in stderr, stderr
    stopped = read_metadata(resolve(save))["iteration"]
    assert at <= stopped < 8
    assert (f"stopped after iteration {stopped} of 8: SIGTERM received; saved "
            f"{save}/iter_{stopped:07d}") in stdout
    resumed = subprocess.run([sys.executable, "-m", "ptdp", "train", *argv, "--save", str(save),
                              "--load", str(save), "--metrics-file", str(second)],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(first)[:stopped] + _losses(second) == _losses(tmp_path / "whole.jsonl")
    _assert_same_tensors(_tensors(resolve(save)), _tensors(resolve(tmp_path / "whole")))


def test_sighup_to_the_launcher_stops_gracefully(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    process = _start([*MODEL, "-d", "2", "--train-iters", "100000", "--save", str(save),
                      "--metrics-file", str(metrics)])
    _wait_until(lambda: _lines(metrics) >= 2, process)
    os.kill(process.pid, signal.SIGHUP)
    stdout, stderr, seconds = _finish(process, time.monotonic())
    _record("SIGHUP to the launcher", seconds)
    assert process.returncode == 0, stderr
    assert "SIGHUP received" in stdout and seconds < EXIT_BOUND_SECONDS
    assert _newest_loads(save) >= 2


# ------------------------------------------------------------------ disk and damaged files


def _checkpoint_size(tmp_path: Path) -> int:
    """Bytes of one checkpoint of MODEL (written once here, in this process)."""
    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_args
    from ptdp.parallel.topology import ParallelContext
    from ptdp.train.loop import Trainer

    config = config_from_args(build_parser().parse_args(["train", *MODEL]))
    trainer = Trainer(config, ParallelContext.single(), torch.device("cpu"))
    directory = trainer.save(str(tmp_path / "probe"), 1)
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(options) -> a new tmpfs (skips the test where none can be
    mounted, e.g. without root)."""
    mounts = []

    def mount(options: str) -> Path:
        point = tmp_path / f"disk{len(mounts)}"
        point.mkdir()
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                              capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip() or 'not permitted'})")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path, mount_tmpfs):
    """A tmpfs with room for one checkpoint of MODEL and a half."""
    return mount_tmpfs(f"size={_checkpoint_size(tmp_path) * 3 // 2}")


def test_a_full_disk_is_the_reported_cause_and_the_previous_checkpoint_loads(small_disk):
    save = small_disk / "ckpt"
    started = time.monotonic()
    process = _start([*MODEL, "-p", "2", "--train-iters", "6", "--save", str(save),
                      "--save-interval", "1"])
    _, stderr, seconds = _finish(process, started)
    assert process.returncode == 1, stderr
    assert "No space left on device" in stderr.strip().splitlines()[-1], stderr
    assert "Traceback" not in stderr and "closed by peer" not in stderr.lower()
    assert seconds < EXIT_BOUND_SECONDS + 30
    assert _newest_loads(save) == 1


def _trained_and_saved(rank: int, argv: list[str], save: str, iterations: int) -> None:
    """A pool rank's part of `ptdp train ARGV --save SAVE`: the run's
    iterations, then the save at its end (Trainer.save, as the loop calls it)."""
    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_args
    from ptdp.config import validate
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.train.loop import Trainer

    config = config_from_args(build_parser().parse_args(["train", *argv]))
    par = config.parallel
    validate(config, world_size=par.world_size)
    ctx = ParallelContext.build(RankGrid(tp=par.tensor_model_parallel_size, dp=par.dp,
                                         pp=par.pipeline_model_parallel_size))
    trainer = Trainer(config, ctx, torch.device("cpu"))
    for iteration in range(iterations):
        assert not trainer.step(iteration)[0]["skipped"]
    trainer.save(save, iterations)


def test_a_damaged_checkpoint_is_the_reported_cause(tmp_path, pools):
    save = tmp_path / "ckpt"
    # The checkpoint of a 2-iteration run at p = 2, written by the session's
    # pool of two ranks rather than by a job of its own: only its load is
    # the job under test.
    pools(2).run(_trained_and_saved, [*MODEL, "-p", "2", "--train-iters", "2"], str(save), 2)
    assert read_metadata(resolve(save))["iteration"] == 2
    damaged = resolve(save) / "part-pp1-tp0.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    started = time.monotonic()
    process = _start([*MODEL, "-p", "2", "--train-iters", "4", "--load", str(save),
                      "--use-checkpoint-opt_param-scheduler"])
    _, stderr, seconds = _finish(process, started)
    assert process.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert "part-pp1-tp0.safetensors" in last and "sha256 differs" in last, stderr
    assert "Traceback" not in stderr and "closed by peer" not in stderr.lower()
    assert seconds < EXIT_BOUND_SECONDS + 30


def test_a_save_path_under_a_regular_file_is_refused_before_launch(tmp_path, no_launch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    status, out, err = train_refused([*MODEL, "-d", "2", "--train-iters", "2", "--save",
                                 str(blocker / "ckpt")], capsys)
    assert status == 2
    assert f"--save {blocker / 'ckpt'}: {blocker} is a file" in err
    assert "ptdp: 2 processes" not in out


def test_too_little_space_is_warned_before_launch_and_one_process_reports_the_cause(
        tmp_path, mount_tmpfs):
    disk = mount_tmpfs(f"size={_checkpoint_size(tmp_path) // 2}")
    result = subprocess.run([sys.executable, "-m", "ptdp", "train", *MODEL, "--train-iters", "1",
                             "--save", str(disk / "ckpt")], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    warning, *_ = [line for line in result.stderr.splitlines() if "warning" in line]
    assert f"--save {disk / 'ckpt'} has" in warning and "one checkpoint of this model takes" in warning
    assert result.stderr.strip().splitlines()[-1].startswith("ptdp: error: rank 0: ")
    assert "No space left on device" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_a_read_only_save_directory_is_refused_before_launch(mount_tmpfs, no_launch, capsys):
    disk = mount_tmpfs("size=1m,ro")
    status, out, err = train_refused([*MODEL, "-d", "2", "--train-iters", "2", "--save",
                                 str(disk / "ckpt")], capsys)
    assert status == 2, err
    assert f"--save {disk / 'ckpt'} cannot be created ({disk} is not writable)" in err
    assert "ptdp: 2 processes" not in out


@pytest.mark.parametrize("planted", ["link", "directory"])
def test_a_planted_lock_file_is_refused_before_launch_and_never_followed(tmp_path, planted,
                                                                        no_launch, capsys):
    """SAVE/.ptdp-save.lock as a symbolic link (to a file the job may
    write) or a directory: one paragraph before launch, nothing followed,
    and a rank that meets one planted after that check says the same."""
    from ptdp.checkpoint.lock import LOCK_FILE, LockFileNotUsable, SaveLock

    save, victim = tmp_path / "ckpt", tmp_path / "victim"
    save.mkdir()
    victim.write_text("precious")
    if planted == "link":
        (save / LOCK_FILE).symlink_to(victim)
        what = f"is a symbolic link (to {victim}), which ptdp never follows there"
    else:
        (save / LOCK_FILE).mkdir()
        what = "is not a regular file but a directory"
    paragraph = (f"--save {save}: its lock file {save / LOCK_FILE} {what}; ptdp creates that "
                 f"file itself, as a regular file, to keep a second job from saving into the same "
                 f"directory. Remove it (no job's lock is a link or a directory) and run again")
    with pytest.raises(LockFileNotUsable) as refused:
        SaveLock(save)
    assert str(refused.value) == paragraph
    status, out, err = train_refused([*MODEL, "-d", "2", "--train-iters", "2", "--save", str(save)],
                                capsys)
    assert status == 2, err
    assert err == f"ptdp: error: invalid configuration:\n  - {paragraph}\n"
    assert "ptdp: starting" not in out and victim.read_text() == "precious"
