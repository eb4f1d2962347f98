"""Two torchrun agents as two "nodes" on this machine: a job whose pipeline
spans the nodes (t=1, p=2, d=2 over 2 × 2 processes) prints and records the
same losses as one process, as every layout must (see test_train_cli.py
for the tolerance). And a node that never arrives ends torchrun's wait
after the rendezvous's join timeout, before ptdp starts."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_train_cli import COMMON, _assert_same_run

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this Python")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                "SLURM_NTASKS"):
        env.pop(var, None)
    return env


def _node(port: int, log: Path, *ptdp_args: str,
          rendezvous: tuple[str, ...] = ()) -> subprocess.Popen:
    """One node's torchrun agent (2 processes), its output into `log` (a
    pipe could fill while the test waits on the other node). The c10d
    rendezvous numbers the nodes in the order they arrive (no --node-rank)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "ptdp-two-nodes", *rendezvous, "-m", "ptdp", *ptdp_args],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=_environment())


def test_two_nodes_train_like_one_process(tmp_path, one_process_run):
    reference = one_process_run
    port, metrics = _free_port(), tmp_path / "two-nodes.jsonl"
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [_node(port, log, "train", *COMMON, "-p", "2", "--metrics-file", str(metrics))
             for log in logs]
    try:
        codes = [node.wait(timeout=600) for node in nodes]  # hang guard
    finally:
        for node in nodes:
            node.kill()
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output
    # Each node's agent ran two of the four ranks; whichever logs, logs once.
    assert "ptdp: 4 processes (t=1, p=2, d=2" in output
    assert "failed to bind" not in output  # rank 0 joined the agent's store
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    _assert_same_run((records, re.findall(r"loss (\d+\.\d{4})", output), output), reference)


def test_a_node_that_never_arrives_ends_the_wait_after_the_join_timeout(tmp_path):
    """Only node 0 starts: its agent waits for the rendezvous, not ptdp,
    and gives up after join_timeout (600 s unless set) without starting a
    process."""
    started = time.monotonic()
    node = _node(_free_port(), tmp_path / "node0.log", "train", *COMMON, "-p", "2",
                 rendezvous=("--rdzv-conf", "join_timeout=1"))
    code = node.wait(timeout=300)
    output = (tmp_path / "node0.log").read_text()
    assert code != 0, output
    assert "RendezvousTimeoutError" in output
    assert "ptdp:" not in output  # no rank started
    assert time.monotonic() - started < 120
