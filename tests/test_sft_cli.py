"""`ptdp train --sft` from the command line, in this process: each bad
input is refused before any rank starts with exit status 2 and one
paragraph (no traceback) naming the file and the row where there is one;
--sft-skip-bad-rows trains on the good rows and says how many it left
out; a good run's banner gives the packing figures and its metrics the
loss tokens, both as counted here from the tokenizer.

The tokenizer is a word-level one (every word one token, whitespace
dropped), so each conversation's length and loss tokens are known exactly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.data.sft.template_files import CHATML_TEMPLATE_FILE

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "system user assistant tool hello how is the cat fine thanks".split()
# ChatML with the replies marked; a tool turn is refused, as templates without tools do.
TEMPLATE = ("{%- for m in messages %}"
            "{%- if m['role'] == 'tool' %}{{ raise_exception('this template has no tool turns') }}"
            "{%- endif %}"
            "{{- '<|im_start|>' + m['role'] + '\\n' }}"
            "{%- if m['role'] == 'assistant' %}"
            "{%- generation %}{{- m['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
            "{%- else %}{{- m['content'] + '<|im_end|>\\n' }}{%- endif %}"
            "{%- endfor %}")
GOOD = {"messages": [{"role": "user", "content": "hello how is the cat"},
                     {"role": "assistant", "content": "fine thanks"}]}
# GOOD's tokens: <|im_start|> user hello how is the cat <|im_end|> <|im_start|> assistant
# fine thanks <|im_end|>; the loss on the reply's three, each a label of the token before.
GOOD_TEXT = ("<|im_start|>user\nhello how is the cat<|im_end|>\n"
             "<|im_start|>assistant\nfine thanks<|im_end|>\n")
GOOD_LOSS_TOKENS = 3
SEQ = 32               # two GOOD conversations fit a sequence, three do not
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--split", "100,0,0"]


def _save_tokenizer(directory: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)},
                                           unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    return directory / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tokenizers")
    return {"chat": _save_tokenizer(folder / "chat", TEMPLATE),
            "bare": _save_tokenizer(folder / "bare", None)}


def _hf(tokenizer: Path) -> list[str]:
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer)]


def _jsonl(path: Path, rows: list) -> str:
    """Rows as JSON lines; a str row is written as it is (a broken line)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in rows))
    return str(path)


def _train(capfd, *argv: str, sft: bool = True) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `ptdp train [--sft] ARGV` in this process."""
    try:
        status = main(["train", *(["--sft"] if sft else []), *argv])
    except SystemExit as stop:  # problems found while parsing the flags
        status = stop.code
    out, err = capfd.readouterr()
    return status, out, err


def _refusal(capfd, *argv: str, sft: bool = True) -> str:
    """The one problem `ptdp train` refuses ARGV with: exit 2, no
    traceback, one paragraph (its lines joined)."""
    status, _, err = _train(capfd, *argv, sft=sft)
    assert status == 2, err
    assert "Traceback" not in err, err
    report = err[err.index("ptdp: error:"):].strip()
    problems = re.findall(r"^  - ", report, flags=re.MULTILINE)
    assert len(problems) == 1, report
    return " ".join(report.split("\n  - ", 1)[1].split())


def _bad_tool_row():
    return {"messages": [{"role": "tool", "content": "hello"},
                         {"role": "assistant", "content": "fine"}]}


def _empty_reply_row():
    return {"messages": [{"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "  "}]}


# (name, the rows: a str is written as it is, the 1-based row at fault, what the message says)
BAD_ROWS = [
    ("malformed-json", [GOOD, GOOD, '{"messages": [', GOOD], 3, "is not valid JSON"),
    ("unknown-layout", [GOOD, GOOD, GOOD, {"question_text": "hello", "reply": "fine"}], 4,
     "no conversation layout fits its keys (question_text, reply)"),
    ("template-refuses", [GOOD] * 5 + [_bad_tool_row()], 6,
     "the chat template refuses the conversation (this template has no tool turns)"),
    ("empty-reply", [_empty_reply_row(), GOOD], 1, "turn 2 is an empty assistant turn"),
]


@pytest.mark.parametrize("name, rows, row, says", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_a_bad_row_is_one_paragraph_naming_file_and_row(tmp_path, capfd, no_launch, tokenizers,
                                                        name, rows, row, says):
    data = _jsonl(tmp_path / f"{name}.jsonl", rows)
    problem = _refusal(capfd, "--data-path", data, *_hf(tokenizers["chat"]), *TINY)
    assert problem.startswith(f"{data}, row {row}: "), problem
    assert says in problem, problem


def test_a_tokenizer_without_a_template_is_told_to_give_chat_template(tmp_path, capfd, no_launch,
                                                                      tokenizers):
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD] * 4)
    problem = _refusal(capfd, "--data-path", data, *_hf(tokenizers["bare"]), *TINY)
    assert str(tokenizers["bare"].parent) in problem
    assert f"--chat-template {CHATML_TEMPLATE_FILE}" in problem, problem
    assert CHATML_TEMPLATE_FILE.is_file()


@pytest.mark.parametrize("setup", ["not-parquet", "missing-file", "mock-data", "gpt2-tokenizer",
                                   "every-row-bad"])
def test_a_bad_setting_is_one_paragraph(tmp_path, capfd, no_launch, tokenizers, setup):
    good = _jsonl(tmp_path / "chats.jsonl", [GOOD] * 4)
    tokenizer = _hf(tokenizers["chat"])
    argv, says = {
        "not-parquet": (["--data-path", _jsonl(tmp_path / "chats.parquet", [GOOD] * 4), *tokenizer],
                        f"{tmp_path / 'chats.parquet'} is not a Parquet file"),
        "missing-file": (["--data-path", str(tmp_path / "none.jsonl"), *tokenizer],
                         f"--data-path {tmp_path / 'none.jsonl'}: no such file"),
        "mock-data": (["--mock-data", *tokenizer],
                      "--sft trains on conversation files and --mock-data on generated tokens"),
        "gpt2-tokenizer": (["--data-path", good, "--tokenizer-type", "GPT2BPETokenizer"],
                           "not GPT2BPETokenizer: give --tokenizer-type HuggingFaceTokenizer"),
        "every-row-bad": (["--data-path", _jsonl(tmp_path / "bad.jsonl", ["{", _empty_reply_row()]),
                           "--sft-skip-bad-rows", *tokenizer],
                          "holds no conversation to train on (2 bad rows skipped)"),
    }[setup]
    problem = _refusal(capfd, *argv, *TINY)
    assert says in problem, problem


def test_chat_template_without_sft_says_to_give_sft(tmp_path, capfd, no_launch, tokenizers):
    template = ["--chat-template", str(CHATML_TEMPLATE_FILE)]
    problem = _refusal(capfd, "--mock-data", *template, *TINY, sft=False)
    assert problem == ("--chat-template is a setting of --sft (fine-tuning on conversations); give "
                       "--sft or drop --chat-template")


def test_chat_template_without_sft_on_a_conversation_file_says_to_give_sft(
        tmp_path, capfd, no_launch, tokenizers):
    data = _jsonl(tmp_path / "chats.jsonl", [GOOD] * 4)
    problem = _refusal(capfd, "--data-path", data, *_hf(tokenizers["chat"]),
                       "--chat-template", str(CHATML_TEMPLATE_FILE), *TINY, sft=False)
    assert "--chat-template is a setting of --sft" in problem, problem


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _good_tokens(tokenizer: Path) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(tokenizer)).encode(GOOD_TEXT, add_special_tokens=False).ids)


@pytest.mark.parametrize("bad_rows", [0, 4], ids=["clean", "skip-bad-rows"])
def test_a_run_reports_packing_and_loss_tokens(tmp_path, capfd, tokenizers, bad_rows):
    """Six GOOD conversations (and, skipped, each kind of bad row): two a
    sequence, so three sequences; the first iteration's two hold four."""
    rows = [GOOD] * 6
    if bad_rows:
        rows[1:1] = ['{"messages": [', {"reply": "fine"}, _bad_tool_row(), _empty_reply_row()]
    data = _jsonl(tmp_path / "chats.jsonl", rows)
    metrics = tmp_path / "metrics.jsonl"
    status, out, err = _train(capfd, "--data-path", data, *_hf(tokenizers["chat"]),
                              "--metrics-file", str(metrics),
                              *(["--sft-skip-bad-rows"] if bad_rows else []), *TINY)
    assert status == 0, err
    length = _good_tokens(tokenizers["chat"])
    assert SEQ // 3 < length <= SEQ // 2   # (two a sequence)
    banner = next(line for line in out.splitlines() if "data: conversations of" in line)
    loss_share, padding = 6 * GOOD_LOSS_TOKENS / (3 * SEQ), 1 - 6 * length / (3 * SEQ)
    expected = (f"data: conversations of {data} (6 conversations in 3 sequences: "
                f"{loss_share:.1%} of the tokens in the loss, {padding:.1%} padding"
                + (f"; {bad_rows} bad rows skipped (--sft-skip-bad-rows))" if bad_rows else ")"))
    assert banner.endswith(expected), banner
    [record] = _metrics(metrics)
    assert record["loss_tokens"] == 2 * 2 * GOOD_LOSS_TOKENS
    assert record["loss_token_fraction"] == pytest.approx(4 * GOOD_LOSS_TOKENS / (2 * SEQ))
    assert record["loss"] > 0
