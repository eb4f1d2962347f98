"""docs/fine-tuning.md's workflow, as the page shows it, on a tiny Qwen2
chat model from transformers: import, --sft fine-tune on a chat file, chat
with the result, export; the export is a model transformers loads with the
original's chat template and generation config. The page's sizes are a real
run's; here the same commands run with a small sequence, batch and length
appended (the last value of a flag wins)."""

from __future__ import annotations

import json
import shlex

import pytest

from ptdp.cli import main
from tests.doc_commands import commands

transformers = pytest.importorskip("transformers")

SMALL = ["--seq-length", "64", "--global-batch-size", "4", "--train-iters", "2",
         "--eval-interval", "1", "--eval-iters", "1"]


def _model_and_chats(tmp_path, monkeypatch, conversations: int):
    """A tiny Qwen2 chat model's directory, and chat.jsonl in the working directory."""
    from tests import test_hf_chat_export as chat

    original = chat._chat_model(tmp_path / "qwen", transformers.Qwen2Config,
                                transformers.Qwen2ForCausalLM)
    words = chat.WORDS[4:-1]
    rows = [{"messages": [{"role": "user", "content": " ".join(words[k % 7:k % 7 + 3])},
                          {"role": "assistant", "content": " ".join(words[k % 5:k % 5 + 2])}]}
            for k in range(conversations)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    return original


def test_the_fine_tuning_workflow_runs_as_documented(tmp_path, monkeypatch, capsys):
    original = _model_and_chats(tmp_path, monkeypatch, conversations=80)
    shown = commands("fine-tuning-workflow")
    assert [shlex.split(c, comments=True)[:2] for c in shown] == [
        ["ptdp", "convert"], ["ptdp", "train"], ["ptdp", "generate"], ["ptdp", "convert"]]
    for command in shown:
        argv = [str(original) if word == "QWEN_DIR" else word
                for word in shlex.split(command, comments=True)[1:]]
        if argv[0] == "train":
            argv += SMALL
        if argv[0] == "generate":
            argv += ["--max-new-tokens", "4"]
        assert main(argv) == 0, (command, capsys.readouterr().err)
    printed = capsys.readouterr().out
    assert "conversations in" in printed and "within each document" in printed
    export = tmp_path / "tuned-hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for name in ("chat_template.jinja", "generation_config.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (original / name).read_bytes(), name


def test_the_lora_workflow_runs_as_documented(tmp_path, monkeypatch, capsys):
    """The LoRA block: adapters trained on the imported model, chatted with,
    exported for peft (which loads them on the original model) and merged
    into a checkpoint that exports to transformers."""
    peft = pytest.importorskip("peft")
    original = _model_and_chats(tmp_path, monkeypatch, conversations=40)
    shown = commands("lora-workflow")
    for command in shown:
        argv = [str(original) if word == "QWEN_DIR" else word
                for word in shlex.split(command, comments=True)[1:]]
        if argv[0] == "train":
            argv += SMALL + ["--lora-rank", "4"]  # (the toy model's heads are 16 wide)
        if argv[0] == "generate":
            argv += ["--max-new-tokens", "4"]
        assert main(argv) == 0, (command, capsys.readouterr().err)
    printed = capsys.readouterr().out
    assert "LoRA" in printed
    base = transformers.AutoModelForCausalLM.from_pretrained(str(original), local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapters-peft"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged-hf"),
                                                               local_files_only=True)
    import torch

    ids = torch.tensor([[3, 8, 21, 5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(adapted.eval()(ids).logits, merged.eval()(ids).logits,
                                   atol=1e-5, rtol=0)
