"""Tests of the `ptdp` command line: flags and config files into a Config.

Nothing here starts a training process: `main` is only run on configurations
that fail before launching, and the launcher is replaced by a tripwire.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_args
from ptdp.config import Config, ConfigError, flag_fields, validate


def parse(*argv: str) -> Config:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def from_file(tmp_path, name: str, text: str, *argv: str) -> Config:
    return parse("--config", write(tmp_path, name, text), *argv)


def file_error(tmp_path, name: str, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        from_file(tmp_path, name, text)
    return caught.value


# --------------------------------------------------------------------------- flags

def test_no_flags_gives_the_defaults():
    assert parse() == Config()


@pytest.mark.parametrize("argv,section,name,value", [
    (["--tensor-model-parallel-size", "2"], "parallel", "tensor_model_parallel_size", 2),
    (["-t", "2"], "parallel", "tensor_model_parallel_size", 2),
    (["-p", "4"], "parallel", "pipeline_model_parallel_size", 4),
    (["-d", "3"], "parallel", "data_parallel_size", 3),
    (["--num-layers-per-virtual-pipeline-stage", "2"], "parallel",
     "num_layers_per_virtual_pipeline_stage", 2),
    (["--device", "cpu"], "parallel", "device", "cpu"),
    (["--num-layers", "12"], "model", "num_layers", 12),
    (["--hidden-size", "256"], "model", "hidden_size", 256),
    (["--ffn-hidden-size", "1000"], "model", "ffn_hidden_size", 1000),
    (["--hidden-dropout", "0.25"], "model", "hidden_dropout", 0.25),
    (["--no-bias-gelu-fusion"], "model", "bias_gelu_fusion", False),
    (["--no-bias-dropout-fusion"], "model", "bias_dropout_fusion", False),
    (["--micro-batch-size", "8"], "train", "micro_batch_size", 8),
    (["--global-batch-size", "64"], "train", "global_batch_size", 64),
    (["--lr", "3e-4"], "train", "lr", 3e-4),
    (["--metrics-file", "m.jsonl"], "train", "metrics_file", "m.jsonl"),
    (["--mock-data"], "data", "mock_data", True),
])
def test_flag_sets_field(argv, section, name, value):
    config = parse(*argv)
    got = getattr(getattr(config, section), name)
    assert got == value and type(got) is type(value)
    # every other field keeps its default
    expected = Config()
    setattr(getattr(expected, section), name, value)
    assert config == expected


def test_every_config_field_has_a_working_flag():
    """Each flag of the dataclasses reaches its own field, with the field's type."""
    for section, f in flag_fields():
        kind = f.type.split("|")[0].strip()
        if kind == "bool" and "off_flag" in f.metadata:  # on by default: the off flag turns it off
            assert getattr(getattr(parse(f.metadata["flag"]), section), f.name) is True
            argv, value = [f.metadata["off_flag"]], False
        elif kind == "bool":
            argv, value = [f.metadata["flag"]], not f.default
        elif "choices" in f.metadata:
            value = [c for c in f.metadata["choices"] if c != f.default][0]
            argv = [f.metadata["flag"], str(value)]
        elif kind == "int":
            argv, value = [f.metadata["flag"], "7"], 7
        elif kind == "float":
            argv, value = [f.metadata["flag"], "0.375"], 0.375
        elif kind == "list[int]":  # --rampup-batch-size START INCREMENT SAMPLES
            argv, value = [f.metadata["flag"], "16", "8", "300"], [16, 8, 300]
        elif kind.startswith("list["):
            argv, value = [f.metadata["flag"], "0.25", "a", "0.75", "b"], ["0.25", "a", "0.75", "b"]
        else:
            argv, value = [f.metadata["flag"], "some-value"], "some-value"
        assert getattr(getattr(parse(*argv), section), f.name) == value, f.metadata["flag"]


def test_bool_flags_default_on():
    config = parse()
    assert config.model.bias_gelu_fusion is True
    assert config.model.bias_dropout_fusion is True
    assert config.data.mock_data is False


def test_flags_combine():
    config = parse("-t", "2", "-p", "2", "-d", "2", "--num-layers", "8",
                   "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1",
                   "--global-batch-size", "8", "--mock-data")
    assert (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size,
            config.parallel.data_parallel_size) == (2, 2, 2)
    assert config.parallel.world_size == 8
    validate(config)


@pytest.mark.parametrize("argv", [["--hidden-size", "big"], ["-t", "1.5"], ["--device", "tpu"],
                                  ["--no-such-flag"]])
def test_bad_flag_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["train", *argv])
    assert caught.value.code == 2
    assert "error:" in capsys.readouterr().err


# --------------------------------------------------------------------------- YAML files

def test_yaml_file_with_sections(tmp_path):
    config = from_file(tmp_path, "run.yaml", """\
        model:
          num-layers: 8
          hidden-size: 256
          num-attention-heads: 8
          hidden-dropout: 0.0
        parallel:
          tensor-model-parallel-size: 2
          device: cpu
        train:
          micro-batch-size: 4
          global-batch-size: 16
          lr: 3.0e-4
        data:
          mock-data: true
        """)
    assert config.model.num_layers == 8
    assert config.model.hidden_size == 256
    assert config.model.num_attention_heads == 8
    assert config.model.hidden_dropout == 0.0
    assert config.parallel.tensor_model_parallel_size == 2
    assert config.parallel.device == "cpu"
    assert config.train.micro_batch_size == 4
    assert config.train.global_batch_size == 16
    assert config.train.lr == pytest.approx(3e-4)
    assert config.data.mock_data is True
    assert config.model.seq_length == Config().model.seq_length  # untouched keys keep defaults


def test_yml_extension_and_key_spellings(tmp_path):
    # flat, with field names, with dashes and with leading dashes
    config = from_file(tmp_path, "run.yml", """\
        num_layers: 6
        hidden-size: 192
        --num-attention-heads: 6
        """)
    assert (config.model.num_layers, config.model.hidden_size,
            config.model.num_attention_heads) == (6, 192, 6)


def test_yaml_int_for_float_and_null_for_optional(tmp_path):
    config = from_file(tmp_path, "run.yaml", """\
        lr: 1
        ffn-hidden-size: null
        global-batch-size: ~
        """)
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.model.ffn_hidden_size is None
    assert config.train.global_batch_size is None


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert from_file(tmp_path, "empty.yaml", "") == Config()


# --------------------------------------------------------------------------- TOML files

def test_toml_file_flat_keys(tmp_path):
    config = from_file(tmp_path, "run.toml", """\
        hidden-size = 256
        num-attention-heads = 8
        tensor-model-parallel-size = 2
        lr = 0.0005
        mock-data = true
        """)
    assert config.model.hidden_size == 256
    assert config.model.num_attention_heads == 8
    assert config.parallel.tensor_model_parallel_size == 2
    assert config.train.lr == 0.0005
    assert config.data.mock_data is True


def test_toml_file_with_sections(tmp_path):
    config = from_file(tmp_path, "run.toml", """\
        [model]
        num-layers = 6
        hidden-size = 192
        num-attention-heads = 6
        no-bias-dropout-fusion = true

        [parallel]
        pipeline-model-parallel-size = 2

        [train]
        micro-batch-size = 3
        clip-grad = 0

        [data]
        mock-data = true
        """)
    assert config.model.num_layers == 6
    assert config.model.hidden_size == 192
    assert config.model.num_attention_heads == 6
    assert config.model.bias_dropout_fusion is False
    assert config.parallel.pipeline_model_parallel_size == 2
    assert config.train.micro_batch_size == 3
    assert config.train.clip_grad == 0.0 and isinstance(config.train.clip_grad, float)
    assert config.data.mock_data is True


# --------------------------------------------------------------------------- file and flags

def test_flags_override_file(tmp_path):
    config = from_file(tmp_path, "run.yaml", """\
        model:
          hidden-size: 256
          num-layers: 8
        parallel:
          tensor-model-parallel-size: 2
        """, "--hidden-size", "512", "-t", "4")
    assert config.model.hidden_size == 512
    assert config.parallel.tensor_model_parallel_size == 4
    assert config.model.num_layers == 8  # not given as a flag: the file's value


def test_negated_bool_flag_overrides_file(tmp_path):
    config = from_file(tmp_path, "run.yaml", "bias-gelu-fusion: true\n", "--no-bias-gelu-fusion")
    assert config.model.bias_gelu_fusion is False


@pytest.mark.parametrize("text,expected", [
    ("no-bias-gelu-fusion: true\n", False),
    ("no-bias-gelu-fusion: false\n", True),
    ("bias-gelu-fusion: false\n", False),
    ("bias_gelu_fusion: true\n", True),
    ("model:\n  no-bias-gelu-fusion: true\n", False),
])
def test_file_negated_bool_keys(tmp_path, text, expected):
    assert from_file(tmp_path, "run.yaml", text).model.bias_gelu_fusion is expected


def test_config_from_args_does_not_validate(tmp_path):
    # building the config and validating it are separate steps
    config = from_file(tmp_path, "run.yaml", "num-attention-heads: 3\n", "-t", "2")
    assert config.model.num_attention_heads == 3
    with pytest.raises(ConfigError):
        validate(config)


# --------------------------------------------------------------------------- file errors

def test_unknown_key_suggests_close_match(tmp_path):
    error = file_error(tmp_path, "run.yaml", "hiden-size: 256\n")
    assert len(error.problems) == 1
    message = error.problems[0]
    assert "run.yaml" in message
    assert "unknown setting 'hiden-size'" in message
    assert "did you mean" in message
    assert "did you mean hidden-size" in message  # in the form the user wrote


def test_unknown_key_inside_a_section(tmp_path):
    error = file_error(tmp_path, "run.toml", "[train]\nmicro-bach-size = 4\n")
    assert "'micro-bach-size'" in str(error)
    assert re.search(r"did you mean [^?]*micro-batch-size", str(error)), str(error)


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    """YAML 1.1 reads `1e-3` as text; a float setting still takes it."""
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\nmodel:\n  init_method_std: 2e-2\n")
    config = config_from_args(build_parser().parse_args(["train", "--config", str(path)]))
    assert config.train.lr == 1e-3 and config.model.init_method_std == 2e-2


def test_unknown_key_without_close_match(tmp_path):
    error = file_error(tmp_path, "run.yaml", "zzzzqqqq: 1\n")
    assert "unknown setting 'zzzzqqqq'" in str(error)
    assert "did you mean" not in str(error)


@pytest.mark.parametrize("text,key,shown,kind", [
    ('hidden-size: "big"\n', "hidden-size", "'big'", "int"),
    ("num-layers: true\n", "num-layers", "True", "int"),
    ("micro-batch-size: 2.5\n", "micro-batch-size", "2.5", "int"),
    ('lr: "fast"\n', "lr", "'fast'", "float"),
    ("hidden-dropout: false\n", "hidden-dropout", "False", "float"),
    ("mock-data: 1\n", "mock-data", "1", "bool"),
    ("metrics-file: 3\n", "metrics-file", "3", "str"),
    ("num-layers: null\n", "num-layers", "None", "int"),  # not optional
])
def test_wrong_type_names_the_key(tmp_path, text, key, shown, kind):
    error = file_error(tmp_path, "run.yaml", text)
    assert len(error.problems) == 1
    message = error.problems[0]
    assert key in message
    assert shown in message
    assert f"should be of type {kind}" in message


def test_wrong_type_in_toml(tmp_path):
    error = file_error(tmp_path, "run.toml", '[model]\nhidden-size = "big"\n')
    assert "hidden-size" in str(error) and "'big'" in str(error) and "int" in str(error)


def test_choice_not_allowed(tmp_path):
    error = file_error(tmp_path, "run.yaml", "device: tpu\n")
    assert "device" in str(error) and "'tpu'" in str(error)
    assert "cpu" in str(error) and "cuda" in str(error)


def test_file_problems_reported_together(tmp_path):
    error = file_error(tmp_path, "run.yaml", """\
        hiden-size: 256
        num-layers: "four"
        device: tpu
        """)
    assert len(error.problems) == 3, error.problems


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as caught:
        parse("--config", path)
    assert path in str(caught.value)
    assert "no such file" in str(caught.value)


@pytest.mark.parametrize("name", ["run.json", "run.ini", "run"])
def test_unsupported_extension(tmp_path, name):
    error = file_error(tmp_path, name, '{"hidden-size": 256}\n')
    assert name in str(error)
    assert ".yaml" in str(error) and ".toml" in str(error)


@pytest.mark.parametrize("name,text", [("bad.yaml", "model: [unclosed\n"),
                                       ("bad.toml", "hidden-size = = 3\n")])
def test_unparsable_file(tmp_path, name, text):
    error = file_error(tmp_path, name, text)
    assert name in str(error) and "cannot parse" in str(error)


def test_top_level_must_be_a_mapping(tmp_path):
    error = file_error(tmp_path, "list.yaml", "- 1\n- 2\n")
    assert "mapping" in str(error)


def test_config_directory_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError):
        parse("--config", str(tmp_path))


# --------------------------------------------------------------------------- main

def test_main_invalid_config_exits_2(no_launch, capsys):
    code = main(["train", "--mock-data", "--num-attention-heads", "3", "-t", "2"])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("ptdp: error:")
    assert "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2" in captured.err
    assert captured.out == ""


def test_main_reports_every_problem(no_launch, capsys):
    code = main(["train", "--mock-data", "--hidden-dropout", "1.5", "--clip-grad", "-1"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:")
    assert "--hidden-dropout=1.5" in err and "--clip-grad=-1.0" in err


def test_main_bad_config_file_exits_2(no_launch, capsys, tmp_path):
    path = write(tmp_path, "run.yaml", "hiden-size: 256\n")
    assert main(["train", "--mock-data", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and "did you mean" in err


def test_main_missing_config_file_exits_2(no_launch, capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "ptdp: error:" in capsys.readouterr().err


def test_main_argparse_error_exits_2(no_launch, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["train", "--hidden-size", "big"])
    assert caught.value.code == 2
    assert "--hidden-size" in capsys.readouterr().err


def test_main_needs_a_command(capsys):
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2


@pytest.mark.parametrize("text", ["data-path: [0.3, a, 0.7, b]\n", "data-path: 0.3 a 0.7 b\n",
                                  "data:\n  data_path:\n    - 0.3\n    - a\n    - 0.7\n    - b\n"])
def test_data_path_in_a_config_file(tmp_path, text):
    """Weights written as YAML numbers still arrive as Megatron-style strings."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    config = config_from_args(build_parser().parse_args(["train", "--config", str(path)]))
    assert config.data.data_path == ["0.3", "a", "0.7", "b"]


@pytest.mark.parametrize("command", [["train"], ["schedule"], ["plan"], ["calibrate"], ["generate"],
                                     ["convert"], ["preprocess"], ["tokenizer", "train"]])
def test_every_command_prints_its_help(command, capsys):
    # argparse formats help strings with %: a bare % in a flag's help crashes --help.
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: ptdp" in capsys.readouterr().out


def test_mock_data_with_a_tokenizer_path_that_names_nothing(tmp_path):
    """Issue 38: with --mock-data a --tokenizer-model naming no file was ignored."""
    with pytest.raises(ConfigError) as caught:
        validate(parse("--mock-data", "--tokenizer-model", str(tmp_path / "none"), "--vocab-file",
                       str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path)))
    assert caught.value.problems == [
        f"{flag} {tmp_path / name}: no such file or directory; with --mock-data no tokenizer is "
        f"used (generated data are token ids), so fix the path or drop {flag}"
        for flag, name in (("--tokenizer-model", "none"), ("--vocab-file", "vocab.json"))]
    validate(parse("--mock-data", "--tokenizer-model", str(tmp_path)))  # there: a script's path
