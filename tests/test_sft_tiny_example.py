"""examples/sft-tiny.yaml and its shipped chat set (issue 40, item 7): the
files under ptdp/data/assets/sft-tiny/ are what scripts/make_sft_tiny.py
makes, transformers renders the chat set with that directory's template
to the same ids and assistant masks as ptdp, the example is a valid `ptdp
train` configuration, and a reduced run of it trains and answers."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_args
from ptdp.config import validate
from ptdp.data.sft.template import ChatTemplate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sft-tiny.yaml"
SHIPPED = ROOT / "ptdp" / "data" / "assets" / "sft-tiny"
MADE_FILES = ["chat.jsonl", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
VOCABULARY = 2050  # the Shakespeare BPE's 2048 and <|im_start|>, <|im_end|>


def _make_sft_tiny():
    spec = importlib.util.spec_from_file_location("make_sft_tiny", ROOT / "scripts" / "make_sft_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_sft_tiny


def _rows(count: int) -> list[list[dict]]:
    with open(SHIPPED / "chat.jsonl") as lines:
        rows = [json.loads(line)["messages"] for line in lines]
    longest = max(rows, key=lambda messages: len(json.dumps(messages)))
    return rows[:count] + [longest]


def test_the_shipped_directory_is_what_the_script_makes(tmp_path):
    made = _make_sft_tiny()(tmp_path / "sft-tiny")
    assert sorted(path.name for path in made.iterdir()) == MADE_FILES
    for name in MADE_FILES:
        assert (SHIPPED / name).read_bytes() == (made / name).read_bytes(), name
    assert (SHIPPED / "chat.jsonl").stat().st_size < 600_000  # small enough to ship


def test_transformers_renders_the_chat_set_as_ptdp_does():
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(SHIPPED), local_files_only=True)
    assert theirs.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == [2048, 2049, 0]
    assert (theirs.eos_token, theirs.pad_token, len(theirs)) == ("<|im_end|>", "<|endoftext|>", VOCABULARY)
    ours = ChatTemplate.for_tokenizer(SHIPPED / "tokenizer.json")
    for messages in _rows(4):
        expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
        got = ours.tokenize_messages(messages)
        assert got.ids.tolist() == list(expected["input_ids"])
        assert got.loss_mask.tolist() == list(expected["assistant_masks"])
        assert 0 < got.loss_mask.sum() < len(got.ids)
        prompt = messages[:1]
        assert ours.render(prompt, add_generation_prompt=True) == theirs.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True)


def test_the_example_is_a_valid_sft_run_and_the_command_line_overrides_it():
    config = config_from_args(build_parser().parse_args(
        ["train", "--config", str(EXAMPLE), "--train-iters", "2"]))
    validate(config)
    assert config.train.train_iters == 2
    assert config.data.sft and config.data.split == "95,5,0"
    assert config.parallel.world_size == 2 and config.train.eval_interval > 0
    assert Path(ROOT / config.data.tokenizer_model).parent == SHIPPED
    assert [Path(ROOT / path) for path in config.data.data_path] == [SHIPPED / "chat.jsonl"]
    assert config.train.save == "sft-output/checkpoint"


def test_a_reduced_run_of_the_example_trains_and_answers_in_chat(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the checkout
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--config", str(EXAMPLE), "--train-iters", "2", "--data-parallel-size", "1",
                 "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                 "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "0",
                 "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
                 "--save", str(tmp_path / "checkpoint"), "--metrics-file", str(metrics),
                 "--data-cache-path", str(tmp_path / "cache")]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # A fresh model predicts about uniformly: the loss over the assistant
    # tokens starts near ln(vocabulary), and it covers some of a sequence's tokens.
    assert abs(records[0]["loss"] - math.log(VOCABULARY)) < 0.3
    assert 0 < records[0]["loss_tokens"] < 2 * 256
    assert math.isfinite(records[-1]["val_loss"])
    carried = tmp_path / "checkpoint" / "iter_0000002" / "tokenizer.json"
    assert carried.read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    capsys.readouterr()
    # It carries the template too: generate --chat needs no template flag.
    assert main(["generate", "--load", str(tmp_path / "checkpoint"), "--chat", "What is 3 plus 4?",
                 "--temperature", "0", "--max-new-tokens", "4"]) == 0
    assert "the checkpoint's chat template" in capsys.readouterr().err
