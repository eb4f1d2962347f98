"""Inputs that must be refused with a clear `ptdp: error:` (exit 2) before
any work, not run on or turned into a traceback:

- optimiser and run settings: non-finite floats anywhere, Adam's betas and
  epsilon, weight decay, the initialisation, LayerNorm's epsilon, and the
  settings that stop a run early (--exit-*);
- config files: bytes that are not UTF-8, a key set twice, one setting
  given twice in two spellings or places;
- `ptdp preprocess` on inputs without text (it would write an empty dataset);
- `ptdp generate` with an empty, unknown or too long prompt, or nothing to
  generate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_args
from ptdp.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, flag_fields, validate

ROOT = Path(__file__).resolve().parents[1]
SECTION_OF = {f.name: section for section, f in flag_fields()}
FLOAT_FIELDS = [(section, f) for section, f in flag_fields() if f.type.split("|")[0].strip() == "float"]


def make(**fields) -> Config:
    """A default Config with the named fields (by field name, any section) replaced."""
    config = Config()
    for name, value in fields.items():
        setattr(getattr(config, SECTION_OF[name]), name, value)
    return config


def single_problem(config: Config) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(config)
    assert len(caught.value.problems) == 1, caught.value.problems
    return caught.value.problems[0]


# --------------------------------------------------------------------------- non-finite floats

def test_every_float_setting_is_covered():
    """The generic check walks all float fields; this list must grow with them."""
    names = {f.name for _, f in FLOAT_FIELDS}
    assert {"lr", "min_lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "clip_grad",
            "init_method_std", "layernorm_epsilon", "hidden_dropout", "loss_scale",
            "exit_duration_in_mins", "peak_tflops", "distributed_timeout_minutes"} <= names


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("section,field", FLOAT_FIELDS, ids=[f.name for _, f in FLOAT_FIELDS])
def test_non_finite_float_is_refused_once(section, field, bad):
    message = single_problem(make(**{field.name: bad}))
    flag = field.metadata["flag"]
    assert message.startswith(f"{flag}={bad!r} is not a finite number: give a finite number")
    if field.default is None:
        assert f"or leave {flag} out" in message
    else:
        assert f"(the default is {field.default:g})" in message


@pytest.mark.parametrize("bad", ["fast", True], ids=["text", "bool"])
def test_a_float_setting_that_is_no_number_is_refused(bad):
    message = single_problem(make(lr=bad))
    assert message.startswith(f"--lr={bad!r} is not a number")


# --------------------------------------------------------------------------- optimiser ranges

@pytest.mark.parametrize("name,flag", [("adam_beta1", "--adam-beta1"), ("adam_beta2", "--adam-beta2")])
@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1])
def test_adam_betas_in_zero_one(name, flag, bad):
    message = single_problem(make(**{name: bad}))
    assert message.startswith(f"{flag}={bad} must be in [0, 1)")
    assert "the default is 0.9" in message or "the default is 0.999" in message


@pytest.mark.parametrize("good", [0.0, 0.5, 0.9999])
def test_adam_betas_accept(good):
    validate(make(adam_beta1=good, adam_beta2=good))


@pytest.mark.parametrize("name,flag,bad,words", [
    ("adam_eps", "--adam-eps", 0.0, "must be > 0"),
    ("adam_eps", "--adam-eps", -1e-8, "must be > 0"),
    ("weight_decay", "--weight-decay", -0.1, "must be >= 0 (0 turns weight decay off)"),
    ("init_method_std", "--init-method-std", 0.0, "must be > 0"),
    ("init_method_std", "--init-method-std", -0.02, "must be > 0"),
    ("layernorm_epsilon", "--layernorm-epsilon", 0.0, "must be > 0"),
    ("layernorm_epsilon", "--layernorm-epsilon", -1e-5, "must be > 0"),
    ("clip_grad", "--clip-grad", -1.0, "must be >= 0 (0 turns clipping off)"),
])
def test_optimizer_and_model_ranges(name, flag, bad, words):
    message = single_problem(make(**{name: bad}))
    assert message.startswith(f"{flag}={bad} {words}")


def test_zero_weight_decay_and_zero_lr_are_allowed():
    validate(make(weight_decay=0.0, lr=0.0, min_lr=0.0))


def test_min_lr_above_lr_still_refused():
    message = single_problem(make(lr=1e-4, min_lr=1e-3))
    assert "0 <= min-lr <= lr" in message


# --------------------------------------------------------------------------- stopping settings

@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_exit_interval_positive_or_unset(bad):
    message = single_problem(make(exit_interval=bad))
    assert message.startswith(f"--exit-interval={bad!r} must be a positive integer")
    assert "leave it out" in message


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_exit_duration_positive(bad):
    message = single_problem(make(exit_duration_in_mins=bad))
    assert message.startswith(f"--exit-duration-in-mins={bad} must be > 0")


@pytest.mark.parametrize("bad", [-1, 1.5, False])
def test_max_consecutive_skipped_iterations_non_negative_integer(bad):
    message = single_problem(make(max_consecutive_skipped_iterations=bad))
    assert message.startswith(f"--max-consecutive-skipped-iterations={bad!r} must be an integer >= 0")


def test_stopping_settings_accept_their_valid_values():
    validate(make(exit_interval=None, exit_duration_in_mins=None, max_consecutive_skipped_iterations=0))
    validate(make(exit_interval=1, exit_duration_in_mins=0.5, max_consecutive_skipped_iterations=3))


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR2", "USR2", "usr2", "SigHup", " TERM "])
def test_exit_signal_accepts_long_and_short_names(name):
    validate(make(exit_signal=name))


@pytest.mark.parametrize("name,words", [
    ("SIGKILL", "no process can catch SIGKILL"),
    ("KILL", "no process can catch SIGKILL"),
    ("SIGSTOP", "no process can catch SIGSTOP"),
    ("SIGINT", "Ctrl-C (SIGINT) stops a run at once by design"),
    ("int", "Ctrl-C (SIGINT) stops a run at once by design"),
    ("SIGCHLD", "whenever a child process ends"),
    ("SIGSEGV", "reports a crash"),
])
def test_exit_signal_that_cannot_be_used_says_why(name, words):
    message = single_problem(make(exit_signal=name))
    assert message.startswith(f"--exit-signal={name!r} cannot be the exit signal")
    assert words in message and "use e.g. SIGUSR2" in message


@pytest.mark.parametrize("name", ["SIGUSR3", "NOPE", "", 12])
def test_exit_signal_unknown_to_the_platform(name):
    message = single_problem(make(exit_signal=name))
    assert message.startswith(f"--exit-signal={name!r}")
    assert "is not a signal of this platform" in message or "must name a signal" in message
    assert "use e.g. SIGUSR2" in message


def test_unknown_exit_signal_suggests_close_names():
    message = single_problem(make(exit_signal="SIGUSR3"))
    assert "(did you mean " in message and "SIGUSR2" in message.split("did you mean")[1]


# --------------------------------------------------------------------------- through the CLI

def test_nan_lr_on_the_command_line_exits_2(no_launch, capsys):
    assert main(["train", "--mock-data", "--lr", "nan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:")
    assert "--lr=nan is not a finite number" in err


def test_several_bad_settings_reported_together(no_launch, capsys):
    assert main(["train", "--mock-data", "--lr", "inf", "--adam-beta2", "1", "--exit-signal",
                 "SIGKILL", "--exit-interval", "0", "--weight-decay", "-1"]) == 2
    err = capsys.readouterr().err
    for words in ("--lr=inf", "--adam-beta2=1.0", "--exit-signal='SIGKILL'", "--exit-interval=0",
                  "--weight-decay=-1.0"):
        assert words in err


def test_infinite_lr_in_a_yaml_file_exits_2(no_launch, capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: .inf\n")
    assert main(["train", "--mock-data", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and "--lr=inf is not a finite number" in err


def test_nan_in_a_toml_file_exits_2(no_launch, capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[model]\ninit-method-std = nan\n")
    assert main(["train", "--mock-data", "--config", str(config)]) == 2
    assert "--init-method-std=nan is not a finite number" in capsys.readouterr().err


def test_nan_lr_in_a_real_process_exits_2_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "ptdp", "train", "--mock-data", "--lr", "nan"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("ptdp: error:") and "--lr=nan" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- config files

def parse_file(tmp_path, name: str, content: str | bytes) -> Config:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(textwrap.dedent(content), encoding="utf-8")
    return config_from_args(build_parser().parse_args(["train", "--config", str(path)]))


def file_problems(tmp_path, name: str, content: str | bytes) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_file(tmp_path, name, content)
    return caught.value.problems


@pytest.mark.parametrize("name", ["run.yaml", "run.toml"])
def test_latin1_file_names_the_byte_and_where(tmp_path, name):
    separator = ": " if name.endswith(".yaml") else " = "
    content = f"lr{separator}0.1\n".encode() + "# café\n".encode("latin-1")
    problems = file_problems(tmp_path, name, content)
    assert problems == [f"--config {tmp_path / name}: not UTF-8 text (byte 0xe9 at offset "
                        f"{len(content) - 2}, line 2); save the file as UTF-8"]


def test_utf16_file_is_refused_cleanly(no_launch, capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes("lr: 0.1\n".encode("utf-16"))
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and "not UTF-8 text (byte 0xff at offset 0" in err
    assert "Traceback" not in err


def test_utf8_with_a_byte_order_mark_is_read(tmp_path):
    assert parse_file(tmp_path, "run.yaml", "\ufefflr: 0.5\n".encode()).train.lr == 0.5
    assert parse_file(tmp_path, "run.toml", "\ufefflr = 0.5\n".encode()).train.lr == 0.5


@pytest.mark.parametrize("text,key,lines", [
    ("lr: 0.1\nhidden-size: 64\nlr: 0.2\n", "'lr'", "lines 1 and 3"),
    ("model:\n  num-layers: 2\n  num-layers: 4\n", "'num-layers'", "lines 2 and 3"),
    ("model:\n  num-layers: 2\ntrain:\n  lr: 0.1\nmodel:\n  hidden-size: 64\n", "'model'",
     "lines 1 and 5"),
])
def test_yaml_key_set_twice_is_refused(tmp_path, text, key, lines):
    problems = file_problems(tmp_path, "run.yaml", text)
    assert problems == [f"--config {tmp_path / 'run.yaml'}: {key} is set twice ({lines}); keep one"]


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    """A `<<:` merge supplies defaults that the mapping's own keys override:
    that is YAML's meaning, not a key set twice."""
    config = parse_file(tmp_path, "run.yaml", """\
        model:
          <<: {num-layers: 2, hidden-size: 64}
          num-layers: 4
        """)
    assert (config.model.num_layers, config.model.hidden_size) == (4, 64)


@pytest.mark.parametrize("text", ["lr = 0.1\nlr = 0.2\n", "[model]\nnum-layers = 2\n[model]\nhidden-size = 64\n"])
def test_toml_key_set_twice_names_the_file(tmp_path, text):
    problems = file_problems(tmp_path, "run.toml", text)
    assert len(problems) == 1
    assert problems[0].startswith(f"--config {tmp_path / 'run.toml'}: cannot parse:")
    assert "line 2" in problems[0] or "line 3" in problems[0]
    assert "given twice; keep one" in problems[0]


@pytest.mark.parametrize("name,text,first,second,flag", [
    ("run.yaml", "hidden-size: 64\nhidden_size: 64\n", "hidden-size", "hidden_size", "--hidden-size"),
    ("run.yaml", "lr: 0.1\n--lr: 0.1\n", "lr", "--lr", "--lr"),
    ("run.yaml", "hidden-size: 64\nmodel:\n  hidden-size: 128\n", "hidden-size", "model.hidden-size",
     "--hidden-size"),
    ("run.yaml", "no-bias-gelu-fusion: true\nbias_gelu_fusion: true\n", "no-bias-gelu-fusion",
     "bias_gelu_fusion", "--no-bias-gelu-fusion"),
    ("run.toml", "num-layers = 2\n[model]\nnum_layers = 4\n", "num-layers", "model.num_layers",
     "--num-layers"),
])
def test_one_setting_in_two_spellings_is_refused(tmp_path, name, text, first, second, flag):
    problems = file_problems(tmp_path, name, text)
    assert problems == [f"--config {tmp_path / name}: {first} and {second} both set {flag}; keep one"]


def test_different_settings_with_similar_names_are_not_duplicates(tmp_path):
    config = parse_file(tmp_path, "run.yaml", "lr: 0.1\nmin-lr: 0.01\nmodel:\n  seq-length: 32\n"
                                              "  max-position-embeddings: 64\n")
    assert (config.train.lr, config.train.min_lr) == (0.1, 0.01)
    assert (config.model.seq_length, config.model.max_position_embeddings) == (32, 64)


# --------------------------------------------------------------------------- preprocess

PRE = ["preprocess", "--tokenizer-type", "ByteLevelTokenizer", "--workers", "1"]


def _outputs(directory: Path) -> list[str]:
    """Everything preprocessing may have left, temporary files included."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(("out", ".")))


@pytest.mark.parametrize("name,content,words", [
    ("empty.txt", "", "no text (every input file is empty)"),
    ("empty.jsonl", "", "no documents (the input is empty, or has only blank lines)"),
    ("blank.jsonl", "\n  \n\n", "no documents (the input is empty, or has only blank lines)"),
    ("texts.jsonl", '{"text": ""}\n{"text": ""}\n',
     "no text under --json-keys text: the 2 documents have only empty text there"),
])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_preprocess_without_text_writes_nothing(tmp_path, capsys, name, content, words, workers):
    source = tmp_path / name
    source.write_text(content, encoding="utf-8")
    argv = [*PRE, "--input", str(source), "--output-prefix", str(tmp_path / "out")]
    argv[argv.index("--workers") + 1] = workers
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ptdp: error: --input {source}: {words}; nothing was written")
    assert _outputs(tmp_path) == []


def test_preprocess_with_one_key_without_text_writes_no_key(tmp_path, capsys):
    source = tmp_path / "data.jsonl"
    source.write_text('{"text": "some words", "title": ""}\n{"text": "more", "title": ""}\n')
    assert main([*PRE, "--input", str(source), "--output-prefix", str(tmp_path / "out"),
                 "--json-keys", "text", "title"]) == 2
    err = capsys.readouterr().err
    assert "no text under --json-keys title: the 2 documents" in err and "nothing was written" in err
    assert _outputs(tmp_path) == []


def test_preprocess_failure_keeps_an_earlier_output(tmp_path, capsys):
    """A refused run leaves the dataset of an earlier run as it was."""
    good, empty = tmp_path / "good.txt", tmp_path / "empty.txt"
    good.write_text("some text")
    empty.write_text("")
    prefix = str(tmp_path / "out")
    assert main([*PRE, "--input", str(good), "--output-prefix", prefix]) == 0
    before = {name: (tmp_path / name).read_bytes() for name in _outputs(tmp_path)}
    assert sorted(before) == ["out_text_document.bin", "out_text_document.idx",
                              "out_text_document.tokenizer-record.json"]
    assert main([*PRE, "--input", str(empty), "--output-prefix", prefix]) == 2
    assert {name: (tmp_path / name).read_bytes() for name in _outputs(tmp_path)} == before
    capsys.readouterr()


def test_preprocess_an_empty_file_among_others_is_an_empty_document(tmp_path):
    from ptdp.data.preprocess import preprocess

    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("")
    result = preprocess([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out",
                        "ByteLevelTokenizer", progress=False)
    assert result["documents"] == 2 and result["tokens"] == 3


# --------------------------------------------------------------------------- generate

TINY = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
                   make_vocab_size_divisible_by=8)


def _save_untrained(directory: Path, model: ModelConfig, data: DataConfig) -> Path:
    import torch

    from ptdp.parallel.topology import ParallelContext
    from ptdp.train.loop import Trainer

    config = Config(model=model, train=TrainConfig(micro_batch_size=2, global_batch_size=2,
                                                   train_iters=1), data=data)
    Trainer(config, ParallelContext.single(), torch.device("cpu")).save(str(directory), 0)
    return directory


@pytest.fixture(scope="module")
def mock_checkpoint(tmp_path_factory):
    return _save_untrained(tmp_path_factory.mktemp("mock-ckpt"), TINY, DataConfig(mock_data=True))


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """A model with a tokenizer (bytes), trained on a corpus `ptdp preprocess` wrote."""
    from ptdp.data.preprocess import preprocess

    folder = tmp_path_factory.mktemp("text-ckpt")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of some text"}) + "\n"
                              for i in range(40)))
    preprocess([corpus], folder / "corpus", "ByteLevelTokenizer", progress=False)
    data = DataConfig(data_path=[str(folder / "corpus_text_document")], split="1,0,0",
                      tokenizer_type="ByteLevelTokenizer", data_cache_path=str(folder / "cache"))
    return _save_untrained(folder / "ckpt", dataclasses.replace(TINY, vocab_size=257), data)


def _generate_error(capsys, checkpoint, *argv) -> str:
    assert main(["generate", "--load", str(checkpoint), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and "Traceback" not in err
    return err


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt_for_a_mock_data_model_asks_for_token_ids(mock_checkpoint, capsys, prompt):
    err = _generate_error(capsys, mock_checkpoint, "--prompt", prompt)
    assert "--prompt is empty: this model was trained on generated data (--mock-data)" in err
    assert "give token ids of its vocabulary, e.g. --prompt '1 2 3'" in err


def test_token_id_outside_the_vocabulary(mock_checkpoint, capsys):
    err = _generate_error(capsys, mock_checkpoint, "--prompt", "3 32")
    assert "--prompt '3 32': token id 32 is outside this model's vocabulary of 32 (ids 0 to 31)" in err


def test_prompt_longer_than_the_context_mock(mock_checkpoint, capsys):
    err = _generate_error(capsys, mock_checkpoint, "--prompt", " ".join(["1"] * 9))
    assert "--prompt is 9 tokens long, more than this model's context of 8 tokens" in err
    assert "give a prompt of at most 8 tokens" in err


@pytest.mark.parametrize("count", ["0", "-3"])
def test_nothing_to_generate(mock_checkpoint, capsys, count):
    err = _generate_error(capsys, mock_checkpoint, "--prompt", "1 2", "--max-new-tokens", count)
    assert f"--max-new-tokens={count} must be a positive integer" in err


def test_empty_prompt_for_a_model_with_a_tokenizer_asks_for_text(text_checkpoint, capsys):
    err = _generate_error(capsys, text_checkpoint, "--prompt", "")
    assert "--prompt is empty: give the text to continue, e.g. --prompt 'Once upon a time'" in err


def test_prompt_longer_than_the_context_text(text_checkpoint, capsys):
    err = _generate_error(capsys, text_checkpoint, "--prompt", "twelve bytes")  # 12 byte tokens
    assert "--prompt is 12 tokens long, more than this model's context of 8 tokens" in err


def test_a_fitting_prompt_generates(text_checkpoint, capsys):
    """The checks refuse only what cannot work: 8 bytes fit the context."""
    assert main(["generate", "--load", str(text_checkpoint), "--prompt", "8 bytes!",
                 "--max-new-tokens", "3", "--device", "cpu"]) == 0
    capsys.readouterr()


def test_prompt_is_checked_before_any_rank_starts(mock_checkpoint, capsys, monkeypatch):
    """Under a layout the ranks are other processes: a bad prompt must be
    refused before they start, not end them with a traceback each."""
    import ptdp.launch

    def tripwire(*args, **kwargs):
        raise AssertionError("generation processes were started")

    monkeypatch.setattr(ptdp.launch, "launch_local", tripwire)
    err = _generate_error(capsys, mock_checkpoint, "--prompt", "", "-t", "2", "--device", "cpu")
    assert "--prompt is empty" in err
