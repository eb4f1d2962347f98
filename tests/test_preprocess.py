"""`ptdp preprocess`: text and JSON lines to Megatron indexed datasets, in
input order for any worker count, with bad inputs refused before writing."""

import json
from pathlib import Path

import numpy as np
import pytest

from ptdp.data.indexed import IndexedDataset
from ptdp.data.preprocess import PreprocessError, TokenizerSpec, preprocess
from ptdp.data.tokenizer import ByteTokenizer, TokenizerError

BYTES = "ByteLevelTokenizer"
EOD = ByteTokenizer.eod


def _documents(prefix) -> list[list[int]]:
    """Each document's tokens (its sequences joined)."""
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [[t for s in range(bounds[d], bounds[d + 1]) for t in dataset[s].tolist()]
            for d in range(dataset.num_documents)]


def _jsonl(path: Path, records, blank_lines=()) -> Path:
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    for index in blank_lines:
        lines.insert(index, "   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


RECORDS = [{"text": "Hello, world.", "title": "first"},
           {"text": "", "title": "empty text"},
           {"text": "Ünïcode ✓ and\nnewlines", "title": ""},
           {"text": "last one", "title": "last", "extra": 3}]


@pytest.mark.parametrize("append_eod", [False, True])
def test_plain_text_files_are_one_document_each(tmp_path, append_eod):
    texts = ["first file\r\nkeeps its bytes\n", "second ✓", ""]
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_bytes(text.encode("utf-8"))
    result = preprocess(paths, tmp_path / "out", BYTES, append_eod=append_eod, progress=False)
    eod = [EOD] if append_eod else []
    expected = [list(t.encode("utf-8")) + eod if t else [] for t in texts]
    assert _documents(tmp_path / "out_text_document") == expected
    assert result["documents"] == 3 and result["tokens"] == sum(map(len, expected))
    assert result["dtype"] == "uint16" and IndexedDataset(tmp_path / "out_text_document").dtype == np.uint16
    assert result["files"] == [str(tmp_path / "out_text_document.bin"),
                               str(tmp_path / "out_text_document.idx"),
                               str(tmp_path / "out_text_document.tokenizer-record.json")]


@pytest.mark.parametrize("append_eod", [False, True])
def test_json_lines_with_several_keys(tmp_path, append_eod):
    source = _jsonl(tmp_path / "data.jsonl", RECORDS, blank_lines=[2])
    result = preprocess([source], tmp_path / "out", BYTES, json_keys=["text", "title"],
                        append_eod=append_eod, progress=False)
    eod = [EOD] if append_eod else []
    for key in ("text", "title"):
        # Megatron-LM: an empty text is a document without sequences and without eod.
        expected = [list(r[key].encode("utf-8")) + eod if r[key] else [] for r in RECORDS]
        assert _documents(tmp_path / f"out_{key}_document") == expected
        dataset = IndexedDataset(tmp_path / f"out_{key}_document")
        assert len(dataset) == sum(1 for r in RECORDS if r[key])  # empty ones hold no sequence
    assert result["documents"] == 4
    assert set(result["tokens_per_key"]) == {"text", "title"}
    assert _names(tmp_path) == ["data.jsonl", "out_text_document.bin", "out_text_document.idx",
                                "out_text_document.tokenizer-record.json",
                                "out_title_document.bin", "out_title_document.idx",
                                "out_title_document.tokenizer-record.json"]


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    records = [{"text": f"document {i}: " + "words " * (i % 13), "id": str(i)} for i in range(600)]
    inputs = [_jsonl(tmp_path / "a.jsonl", records[:400]), tmp_path / "b.txt",
              _jsonl(tmp_path / "c.json", records[400:])]
    inputs[1].write_text("a plain text document in the middle")
    outputs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        out.mkdir()
        result = preprocess(inputs, out / "data", BYTES, json_keys=["text"], append_eod=True,
                            workers=workers, progress=False, chunk_bytes=2048)  # ~15 chunks
        assert result["workers"] == workers and result["documents"] == 601
        outputs[workers] = {name: (out / name).read_bytes() for name in _names(out)}
    assert list(outputs[1]) == ["data_text_document.bin", "data_text_document.idx",
                                "data_text_document.tokenizer-record.json"]
    assert outputs[1] == outputs[2]
    documents = _documents(tmp_path / "w2" / "data_text_document")
    assert documents[400] == list(b"a plain text document in the middle") + [EOD]
    assert documents[599] == list(records[598]["text"].encode()) + [EOD]


def test_gpt2_tokens_decode_to_the_input(tmp_path):
    from ptdp.data.tokenizer import build_tokenizer

    texts = ["The quick brown fox jumps over the lazy dog.", "Megatron-LM's .bin/.idx format ✓"]
    source = _jsonl(tmp_path / "gpt2.jsonl", [{"text": t} for t in texts])
    result = preprocess([source], tmp_path / "gpt2", TokenizerSpec("GPT2BPETokenizer"),
                        append_eod=True, progress=False)
    tokenizer = build_tokenizer("GPT2BPETokenizer")
    documents = _documents(tmp_path / "gpt2_text_document")
    assert result["dtype"] == "uint16"
    assert [d[-1] for d in documents] == [50256, 50256]
    assert [tokenizer.decode(d[:-1]) for d in documents] == texts
    assert documents[0][:-1] == tokenizer.encode(texts[0])


# ---------------------------------------------------------------- bad inputs

def _bad_jsonl(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "fine too"}\n' + line + "\n", encoding="utf-8")
    return [path]


BAD_INPUTS = {
    "missing input": (lambda t: [t / "absent.txt"], {}, r"--input .*absent\.txt: no such file"),
    "directory input": (lambda t: [t], {}, "not a file"),
    "invalid json": (lambda t: _bad_jsonl(t, '{"text": "no end'), {}, r"bad\.jsonl:3: not valid JSON"),
    "json array file": (lambda t: _bad_jsonl(t, "[1, 2]"), {}, r"bad\.jsonl:3: a JSON array, not an object"),
    "missing key": (lambda t: _bad_jsonl(t, '{"body": "x"}'), {},
                    r"bad\.jsonl:3: no key 'text' \(keys: 'body'\); choose the keys with --json-keys"),
    "not a string": (lambda t: _bad_jsonl(t, '{"text": 5}'), {},
                     r"bad\.jsonl:3: 'text' is a JSON number, not a string"),
    "output directory under a file": (lambda t: [t / "a.txt"], {"output_prefix": "a.txt/sub/out"},
                                      r"--output-prefix .*a\.txt/sub/out: .*a\.txt is a file, so the "
                                      r"directory cannot be created under it"),
    "text file with two keys": (lambda t: [t / "a.txt"], {"json_keys": ["text", "title"]},
                                "plain text .* --json-keys names 2 keys"),
    "repeated key": (lambda t: [t / "a.txt"], {"json_keys": ["text", "text"]}, "a key is repeated"),
    "not UTF-8": (lambda t: [t / "latin1.txt"], {}, r"latin1\.txt: not UTF-8 text \(byte 4"),
    "no workers": (lambda t: [t / "a.txt"], {"workers": 0}, "--workers 0: use 1 or more"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_are_refused_before_anything_is_written(tmp_path, name):
    make_inputs, overrides, message = BAD_INPUTS[name]
    overrides = dict(overrides)
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes("abc ÿ".encode("latin-1"))
    inputs = make_inputs(tmp_path)
    before = _names(tmp_path)
    kwargs = dict(output_prefix=tmp_path / overrides.pop("output_prefix", "out"), progress=False)
    kwargs.update(overrides)
    with pytest.raises(PreprocessError, match=message):
        preprocess(inputs, tokenizer=BYTES, **kwargs)
    assert _names(tmp_path) == before


def test_a_missing_output_directory_is_made(tmp_path):
    (tmp_path / "a.txt").write_text("fine")
    result = preprocess([tmp_path / "a.txt"], tmp_path / "new" / "deeper" / "out", BYTES,
                        progress=False)
    assert all(Path(f).parent == tmp_path / "new" / "deeper" for f in result["files"])
    assert (tmp_path / "new" / "deeper" / "out_text_document.bin").is_file()


def test_bad_lines_are_reported_with_their_line_numbers_across_chunks(tmp_path):
    lines = [json.dumps({"text": f"line {n} " * 10}) for n in range(1, 301)]
    lines[149] = "{broken"
    lines[249] = json.dumps({"other": 1})
    (tmp_path / "big.jsonl").write_text("\n".join(lines))  # no final line break
    for workers in (1, 2):
        with pytest.raises(PreprocessError) as error:
            preprocess([tmp_path / "big.jsonl"], tmp_path / "out", BYTES, workers=workers,
                       progress=False, chunk_bytes=1024)
        message = str(error.value)
        assert "big.jsonl:150: not valid JSON" in message and "big.jsonl:250: no key 'text'" in message
    assert _names(tmp_path) == ["big.jsonl"]


def test_bad_tokenizer_settings_fail_before_work(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        preprocess([tmp_path / "a.txt"], tmp_path / "out", TokenizerSpec("HuggingFaceTokenizer"),
                   progress=False)
    assert _names(tmp_path) == ["a.txt"]


def test_a_failure_while_encoding_leaves_no_output(tmp_path, monkeypatch):
    source = _jsonl(tmp_path / "data.jsonl", [{"text": f"doc {i}"} for i in range(50)])
    calls = []

    def failing_encode(self, text):
        calls.append(text)
        if len(calls) == 30:
            raise RuntimeError("tokenizer crashed")
        return list(text.encode())

    monkeypatch.setattr(ByteTokenizer, "encode", failing_encode)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        preprocess([source], tmp_path / "out", BYTES, progress=False)
    assert _names(tmp_path) == ["data.jsonl"]


# ---------------------------------------------------------------- command line

def test_command_line(tmp_path, capsys):
    from ptdp.cli import main

    source = _jsonl(tmp_path / "data.jsonl", RECORDS)
    prefix = tmp_path / "corpus"
    code = main(["preprocess", "--input", str(source), "--output-prefix", str(prefix),
                 "--tokenizer-type", BYTES, "--json-keys", "text", "title", "--append-eod",
                 "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "4 documents" in out and f"wrote {prefix}_title_document.bin" in out
    assert _documents(f"{prefix}_text_document")[0] == list(b"Hello, world.") + [EOD]

    code = main(["preprocess", "--input", str(tmp_path / "absent.jsonl"), "--output-prefix",
                 str(prefix), "--tokenizer-type", BYTES])
    assert code == 2
    assert "absent.jsonl: no such file" in capsys.readouterr().err


def test_command_line_in_a_fresh_process_with_spawned_workers(tmp_path):
    """`python -m ptdp preprocess` as users run it: spawned workers must start
    from the real entry point."""
    import os
    import subprocess
    import sys

    records = [{"text": f"document number {i} " * 30} for i in range(300)]  # > 2 chunks of 64 KiB
    source = _jsonl(tmp_path / "data.jsonl", records)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                                     os.environ.get("PYTHONPATH")]))}
    process = subprocess.run(
        [sys.executable, "-m", "ptdp", "preprocess", "--input", str(source), "--output-prefix",
         str(tmp_path / "out"), "--tokenizer-type", BYTES, "--workers", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr
    assert "300 documents" in process.stdout and "2 workers" in process.stdout
    assert _documents(tmp_path / "out_text_document") == [list(r["text"].encode()) for r in records]
