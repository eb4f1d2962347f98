"""`ptdp train` end to end, as a user runs it: every layout prints and records
the same losses as one process (dropout off, fp32 on CPU).

Tolerance: the layouts reorder floating-point sums (tensor all-reduces,
data-parallel averaging), so after a few AdamW steps losses agree to
rtol 1e-5 rather than bitwise; the printed 4-decimal losses are equal.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.in_process import train_refused

COMMON = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--vocab-size", "500", "--make-vocab-size-divisible-by", "16",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
          "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3", "--seed", "5"]


def _ptdp(args, tmp_path: Path, name: str, launcher=None):
    metrics = tmp_path / f"{name}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    command = (launcher or [sys.executable, "-m", "ptdp"]) + ["train", *COMMON, *args,
                                                             "--metrics-file", str(metrics)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)  # hang guard
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    printed = re.findall(r"loss (\d+\.\d{4})", result.stdout)
    return records, printed, result.stdout


@pytest.fixture
def reference(one_process_run):
    return one_process_run


def _assert_same_run(run, reference):
    records, printed, _ = run
    ref_records, ref_printed, _ = reference
    assert printed == ref_printed
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    for got, want in zip(records, ref_records):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["consumed_samples"] == want["consumed_samples"]


def _assert_job_peak_memory(run):
    """Every record and log line carries the job's peak memory: the largest
    rank's resident set (each rank imported torch: above 50 MiB), and which
    rank of the job that is."""
    records, printed, stdout = run
    world = int(re.search(r"ptdp: (\d+) process", stdout).group(1))
    for record in records:
        assert record["peak_memory_gib"] > 50 / 1024 and 0 <= record["peak_memory_rank"] < world
    lines = [line for line in stdout.splitlines() if line.startswith("iteration ")]
    assert len(lines) == len(printed) and all(" | peak memory " in line for line in lines)


def test_one_process_run_learns_and_writes_metrics(reference):
    records, printed, stdout = reference
    assert len(records) == 4 and len(printed) == 4
    for record in records:
        for field in ("iteration", "consumed_samples", "loss", "lr", "grad_norm", "iteration_ms",
                      "forward_backward_ms", "grad_reduce_ms", "optimizer_ms", "tokens_per_s"):
            assert field in record
    assert records[-1]["loss"] < records[0]["loss"]
    assert "vocabulary 500 padded to 512" in stdout
    _assert_job_peak_memory(reference)


# Each a fresh job through the command line and the launcher: one per
# dimension is enough here, since the pooled equivalence tests prove the
# layouts' numerics (t = p = d = 2 in tests/test_ptdp_step.py, every schedule
# in tests/test_schedules.py and the pipeline tests). t = 2 alone
# runs below under torchrun and from a config file; the README workflow
# (tests/test_workflow.py) trains t = 2, p = 2, d = 2 interleaved this way.
LAYOUTS = {
    "t2d2": ["-t", "2", "-d", "2"],
    "p2-1f1b": ["-p", "2"],
    "p2-interleaved-t2": ["-p", "2", "-t", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_parallel_layouts_print_the_same_losses(tmp_path, reference, layout):
    run = _ptdp(layout, tmp_path, "parallel")
    _assert_same_run(run, reference)
    _assert_job_peak_memory(run)


def test_torchrun_launch_and_a_config_file_with_flag_override_take_the_same_path(tmp_path,
                                                                                  reference):
    """One job for two things (each is the same t = 2 run of two ranks):
    torchrun's launch takes the path of ptdp's own launcher, and a config
    file's settings are used, a flag overriding the file's: its t = 2 (each
    of torchrun's ranks reads the file), and the --lr of COMMON over its lr."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    config = tmp_path / "run.yaml"
    config.write_text("parallel:\n  tensor-model-parallel-size: 2\ntrain:\n  lr: 0.5\n")
    run = _ptdp(["--config", str(config)], tmp_path, "torchrun",
                launcher=[torchrun, "--standalone", "--nproc-per-node", "2", "-m", "ptdp"])
    records, _, stdout = run
    assert "t=2" in stdout
    assert records[0]["lr"] == pytest.approx(3e-3 * 3 / 4)  # linear decay over 4 iterations
    _assert_same_run(run, reference)




def test_invalid_layout_is_refused_before_launch(no_launch, capsys):
    status, out, err = train_refused([*COMMON, "-t", "3"], capsys)
    assert status == 2
    assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" in err
    assert "ptdp: 3 processes" not in out


def _spawned_children(parent_pid: int) -> list[int]:
    """PIDs of the rank processes `parent_pid` started (Linux /proc): spawned
    ones are its children, forked ones its fork server's."""
    children: dict[int, list[tuple[int, bytes]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append((int(entry.name), cmdline))
    ranks = [pid for pid, cmdline in children.get(parent_pid, []) if b"spawn_main" in cmdline]
    for server, cmdline in children.get(parent_pid, []):
        if b"multiprocessing.forkserver" in cmdline:
            ranks += [pid for pid, _ in children.get(server, [])]
    return sorted(ranks)


def test_timeline_picture_of_the_last_iteration(tmp_path, reference):
    picture = tmp_path / "timeline.png"
    run = _ptdp(["-p", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--timeline",
                 str(picture)], tmp_path, "timeline")
    _assert_same_run(run, reference)  # the timing barrier changes no number
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote the timeline of the last iteration to {picture}" in run[2]
    # Interleaved 1F1B: the stored activations peak at the schedule's bound
    # (rank 1, the last stage, logs: warm-up (v-1)·p = 2, plus one).
    assert all(r["peak_stored_activations"] == 3 for r in run[0])


def test_timeline_path_is_checked_before_launch(tmp_path, no_launch, capsys):
    missing = tmp_path / "missing" / "t.png"
    status, _, err = train_refused([*COMMON, "-p", "2", "--timeline", str(missing)], capsys)
    assert status == 2 and "--timeline" in err and "does not exist" in err
