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


def test_a_deeply_nested_json_line_to_preprocess(tmp_path, capsys):
    corpus = tmp_path / "deep.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": ' + DEEP + "}\n")
    assert main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                 "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{corpus}:2: values nested too deeply for a document" in err
    assert "Traceback" not in err and not list(tmp_path.glob("out*"))


def test_a_deeply_nested_checkpoint_metadata(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt" / "iter_0000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "metadata.json").write_text(DEEP)
    (tmp_path / "ckpt" / "latest").write_text("iter_0000001\n")
    assert main(["train", "--mock-data", "--load", str(tmp_path / "ckpt"), "--train-iters",
                 "2"]) == 2
    err = capsys.readouterr().err
    assert "metadata.json is unreadable" in err and "the checkpoint is damaged" in err
    assert "Traceback" not in err and "RecursionError" not in err


def test_a_deeply_nested_vocabulary_file(tmp_path, capsys):
    (tmp_path / "vocab.json").write_text(DEEP)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "text.jsonl").write_text('{"text": "hello"}\n')
    assert main(["preprocess", "--input", str(tmp_path / "text.jsonl"), "--output-prefix",
                 str(tmp_path / "out"), "--vocab-file", str(tmp_path / "vocab.json"),
                 "--merge-file", str(tmp_path / "merges.txt")]) == 2
    err = capsys.readouterr().err
    assert "vocab.json" in err and "Traceback" not in err and "RecursionError" not in err
