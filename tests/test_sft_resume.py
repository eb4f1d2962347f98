"""--sft runs resume exactly: the packs are a function of the seed and the
consumed samples (issue 40, item 6), so a run stopped after 2 iterations
and resumed from its checkpoint takes the same packs, losses and held-out
assistant losses as one that never stopped; and the packs of one-per-sequence
(--no-sft-packing) or --sft-train-on-prompt runs differ from the packed
assistant-only run's as those flags say."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main
from tests.test_sft_data import QWEN_TEMPLATE, _tokenizer_dir
from tests.test_sft_dataset import _conversation, _write

ITERS = 4
MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "48", "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "32",
         "--position-embedding-type", "rope", "--disable-bias-linear",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.0"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tokenizer with Qwen's template and a file of 60 conversations."""
    folder = tmp_path_factory.mktemp("sft")
    tokenizer = _tokenizer_dir(folder / "qwen", {"eos_token": "<|im_end|>",
                                                 "pad_token": "<|endoftext|>"}, QWEN_TEMPLATE)
    return tokenizer / "tokenizer.json", _write(folder / "chat.jsonl",
                                                [_conversation(k) for k in range(60)])


def _train(chat, folder, *extra, metrics_name: str = "metrics.jsonl") -> list[dict]:
    tokenizer, data = chat
    folder.mkdir(exist_ok=True)
    metrics = folder / metrics_name
    argv = ["train", "--sft", "--data-path", str(data), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), *MODEL,
            "--split", "90,10,0", "--eval-interval", "1", "--eval-iters", "1",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS),
            "--lr", "1e-3", "--data-cache-path", str(folder.parent / "cache"),
            "--metrics-file", str(metrics), "--save", str(folder / "ck"), *extra]
    assert main(argv) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_a_stopped_sft_run_resumes_exactly(chat, tmp_path, capsys):
    straight = _train(chat, tmp_path / "straight")
    first = _train(chat, tmp_path / "resumed", "--exit-interval", "2")
    assert [r["iteration"] for r in first] == [1, 2]
    second = _train(chat, tmp_path / "resumed", "--load", str(tmp_path / "resumed" / "ck"),
                    metrics_name="resumed.jsonl")
    resumed = first + second
    assert [r["iteration"] for r in resumed] == list(range(1, ITERS + 1))
    for got, want in zip(resumed, straight):
        assert got["loss"] == want["loss"], got["iteration"]           # bitwise
        assert got["loss_tokens"] == want["loss_tokens"]
        assert got["val_loss"] == want["val_loss"]
    printed = capsys.readouterr().out
    assert "conversations in" in printed and "of the tokens in the loss" in printed
    tokens = straight[0]["loss_tokens"]
    assert f"| loss tokens {tokens} ({tokens / (4 * 48):.1%} of the batch) |" in printed


def test_packing_and_the_prompt_flags_change_what_trains(chat, tmp_path):
    longer = ("--train-iters", "1", "--seq-length", "192")  # room for several conversations
    packed = _train(chat, tmp_path / "packed", *longer)[0]
    padded = _train(chat, tmp_path / "padded", *longer, "--no-sft-packing")[0]
    prompt = _train(chat, tmp_path / "prompt", *longer, "--sft-train-on-prompt")[0]
    # One conversation per sequence: fewer conversations, so fewer loss tokens in a batch.
    assert padded["loss_tokens"] < packed["loss_tokens"]
    assert padded["loss_token_fraction"] < packed["loss_token_fraction"]
    # The prompt in the loss: more of the same packs' tokens train.
    assert prompt["loss_tokens"] > packed["loss_tokens"]


def test_the_checkpoint_carries_the_template_the_run_trained_with(chat, tmp_path, capsys):
    """A run given a tokenizer.json carries the chat template beside it (or
    --chat-template's) into its checkpoints: `ptdp generate --chat` then
    renders as training did, with no template flag."""
    from ptdp.checkpoint.store import resolve
    from ptdp.data.sft.template_files import CHATML_TEMPLATE_FILE

    tokenizer, _ = chat
    _train(chat, tmp_path / "own", "--train-iters", "1")
    carried = resolve(tmp_path / "own" / "ck") / "hf"
    assert (carried / "chat_template.jinja").read_text() == QWEN_TEMPLATE
    assert (carried / "tokenizer_config.json").read_bytes() == \
        (tokenizer.parent / "tokenizer_config.json").read_bytes()
    capsys.readouterr()
    assert main(["generate", "--load", str(tmp_path / "own" / "ck"), "--chat", "hello",
                 "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert "the checkpoint's chat template" in capsys.readouterr().err
    _train(chat, tmp_path / "chatml", "--train-iters", "1", "--chat-template",
           str(CHATML_TEMPLATE_FILE))
    carried = resolve(tmp_path / "chatml" / "ck") / "hf"
    assert (carried / "chat_template.jinja").read_bytes() == CHATML_TEMPLATE_FILE.read_bytes()
