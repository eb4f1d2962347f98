"""Start-up feedback: the slow phases say what they do (ptdp/status.py)."""

import io

import numpy as np

from ptdp.status import Periodic, phase


def test_a_phase_says_what_it_does_and_how_long_it_took():
    out = io.StringIO()
    with phase("loading the checkpoint x", stream=out):
        pass
    first, second = out.getvalue().splitlines()
    assert first == "ptdp: loading the checkpoint x ..."
    assert second.startswith("ptdp: loading the checkpoint x: done in ") and second.endswith(" s")


def test_periodic_lines_without_a_terminal():
    out = io.StringIO()
    progress = Periodic("tokenizing", 1000, "bytes", interval=0.0, stream=out)
    progress.advance(250)
    progress.advance(750)
    assert out.getvalue().splitlines() == ["ptdp: tokenizing: 250/1,000 bytes (25%)",
                                           "ptdp: tokenizing: 1,000/1,000 bytes (100%)"]
    quiet = io.StringIO()
    Periodic("tokenizing", 10, "bytes", interval=3600.0, stream=quiet).advance(5)
    assert quiet.getvalue() == ""   # at most one line per interval


def test_building_a_dataset_index_is_announced(tmp_path, capsys):
    from ptdp.data.gpt_dataset import GPTDataset
    from ptdp.data.indexed import IndexedDataset, IndexedDatasetWriter

    prefix = tmp_path / "corpus_text_document"
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for n in range(20):
            writer.add_document(np.arange(n + 10, dtype=np.uint16))
    GPTDataset(IndexedDataset(prefix), str(prefix), range(20), split_name="train",
               num_samples=8, seq_length=16, seed=1, cache_dir=tmp_path / "cache")
    err = capsys.readouterr().err
    assert "ptdp: building the dataset index" in err and ": done in " in err
    # The second time it is read from the cache: nothing to announce.
    GPTDataset(IndexedDataset(prefix), str(prefix), range(20), split_name="train",
               num_samples=8, seq_length=16, seed=1, cache_dir=tmp_path / "cache")
    assert "building" not in capsys.readouterr().err


def test_the_launcher_and_preprocess_say_what_they_start(tmp_path, capsys):
    import subprocess
    import sys

    from ptdp.cli import main

    text = tmp_path / "a.txt"
    text.write_text("To be, or not to be, that is the question.\n")
    # (one process: through ptdp's entry point here)
    capsys.readouterr()
    assert main(["preprocess", "--input", str(text), "--output-prefix", str(tmp_path / "a"),
                 "--workers", "1"]) == 0
    done = capsys.readouterr()
    assert f"ptdp: tokenizing {text} with the GPT2BPETokenizer into {tmp_path / 'a'}_*" in done.out
    run = subprocess.run([sys.executable, "-m", "ptdp", "train", "--mock-data", "-p", "2",
                          "--train-iters", "1", "--num-layers", "2", "--hidden-size", "32",
                          "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
                          "--micro-batch-size", "1", "--global-batch-size", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ptdp: starting 2 processes on this machine (t=1, p=2, d=1) "
                                 "on cpu, gloo"), run.stdout
