"""Inputs nested past Python's recursion limit are one paragraph, not a
RecursionError (issue 38): a --config file, a Hugging Face config.json."""

from ptdp.cli import main

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_deeply_nested_settings_file(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text(DEEP)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: values nested too deeply for a settings file" in err
    assert "Traceback" not in err and "RecursionError" not in err


def test_a_deeply_nested_hugging_face_config(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(DEEP)
    assert main(["convert", "--from-hf", str(tmp_path / "model"), "--save",
                 str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "config.json nests its values too deeply to be a model's configuration" in err
    assert "Traceback" not in err and not (tmp_path / "ckpt").exists()
