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
    assert "resumed from" in resume and "after iteration 10" in resume
    assert "(t=1, p=2, d=4)" in resume and "iteration    15/15" in resume
    assert sample.strip()  # some text
    assert (tmp_path / "gpt2-shakespeare" / "model.safetensors").is_file()
    assert (tmp_path / "gpt2-shakespeare" / "tokenizer.json").is_file()  # GPT-2's, for AutoTokenizer
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000015"
