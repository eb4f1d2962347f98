"""A section of bench/gpu.py run in a child process of its own.

A CUDA fault (an illegal memory access) poisons the CUDA context of the
process it happens in, so each section that runs kernels never run before
(bench/gpu_context_attention.py, bench/gpu_kernels_sweep.py) runs as a
child: a fault ends only that child, and the script still measures and
writes the rest. The child prints its lines and writes its report as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


def run_in_child(script: Path, device_type: str, tiny: bool, timeout: float,
                 say: Callable[[str], None], command: list[str] | None = None
                 ) -> tuple[dict[str, Any] | None, str]:
    """Run `script` (`--device`, `--json`, `--tiny` as `section_main` takes
    them), passing its lines on through `say`: (its report, "") or (None,
    why it has none: it died or ran past `timeout` seconds). `command`
    replaces the script's command line (tests)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "section.json"
        command = command or [sys.executable, str(script), "--device", device_type,
                              "--json", str(out)] + (["--tiny"] if tiny else [])
        try:
            child = subprocess.run(command, capture_output=True, text=True,
                                   timeout=max(timeout, 1.0), cwd=script.resolve().parents[1])
        except subprocess.TimeoutExpired:
            return None, f"ran past {timeout:.0f} s"
        for line in child.stdout.splitlines():
            say(line)
        if child.returncode == 0 and out.exists():
            return json.loads(out.read_text()), ""
        tail = (child.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"exit status {child.returncode}: {tail}"


def section_main(description: str, section: Callable[..., dict[str, Any]],
                 argv: list[str] | None = None) -> int:
    """The child's command line: run `section(device, tiny, say)` and write
    its report to --json."""
    import torch

    from ptdp import device as devices

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--tiny", action="store_true", help="small shapes (seconds on a CPU)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    args = parser.parse_args(argv)
    device = devices.device_for(args.device, 0)
    if device.type == "cpu":
        torch.set_num_threads(1)   # as bench/gpu.py: shared cores, small tensors
    report = section(device, args.tiny, lambda line: print(line, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
