"""The README's workflow, run command by command exactly as written:
preprocess -> train -> resume under another layout -> generate -> export."""

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.doc_commands import commands

ROOT = Path(__file__).resolve().parents[1]


def _workflow_commands() -> list[str]:
    return commands("workflow")


def test_the_readme_workflow_works_as_written(tmp_path):
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for command in _workflow_commands():
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=1800)  # hang guard: ~70 s idle
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    commands = _workflow_commands()
    train, resume = (out for command, out in zip(commands, outputs) if " train " in command)
    (sample,) = (out for command, out in zip(commands, outputs) if " generate " in command)
    # evaluation ran and the validation loss fell
    val = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", train + resume)]
    assert len(val) == 3 and val[-1] < val[0]
    assert "ptdp: saved checkpoint checkpoints/iter_0000010" in train
    assert "stopped after iteration 10 of 15: --exit-interval 10 reached" in train
    # One schedule over both legs, the resume continuing the checkpoint's: the
    # logged rate (iterations 5, 10, 15) falls to --min-lr 0 at the end only.
    rates = [float(v) for v in re.findall(r"\| lr (\S+) \|", train + resume)]
    assert len(rates) == 3 and rates[0] > rates[1] > rates[2] == 0.0
    assert "resumed from" in resume and "after iteration 10" in resume
    assert "(t=1, p=2, d=4)" in resume and "iteration    15/15" in resume
    assert sample.strip()  # some text
    assert (tmp_path / "gpt2-shakespeare" / "model.safetensors").is_file()
    assert (tmp_path / "gpt2-shakespeare" / "tokenizer.json").is_file()  # GPT-2's, for AutoTokenizer
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000015"
