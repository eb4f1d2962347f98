"""`ptdp generate` (one process and under tensor/pipeline layouts) and
`ptdp convert` (to and from Hugging Face GPT-2), end to end from a
checkpoint that training wrote."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.generate import PipelinedModel
from ptdp.parallel.topology import ParallelContext
from ptdp.checkpoint.store import load_logical_model
from ptdp.train.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=32, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                    attention_dropout=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    save = tmp_path_factory.mktemp("ckpt")
    config = Config(model=MODEL, train=TrainConfig(micro_batch_size=8, global_batch_size=8, lr=1e-2,
                                                   train_iters=100, lr_decay_style="constant"),
                    data=DataConfig(mock_data=True))
    trainer = Trainer(config, ParallelContext.single(), torch.device("cpu"))
    for i in range(100):
        trainer.step(i)
    trainer.save(str(save), 100)
    chain, token = [], 7  # what the generated data does after the prompt's last token
    for _ in range(10):
        token = trainer.data.train.successor[token]
        chain.append(str(token))
    return save, chain


def _generate(checkpoint, *flags, capsys=None):
    """`ptdp generate`'s continuation of "5 6 7". With `capsys` (one process:
    no launch), through ptdp's entry point in this process; else as a
    command of its own."""
    argv = ["generate", "--load", str(checkpoint), "--prompt", "5 6 7", "--max-new-tokens", "10",
            *flags]
    if capsys is not None:
        capsys.readouterr()
        status = main(argv)
        out, err = capsys.readouterr()
        assert status == 0, err
    else:
        result = subprocess.run([sys.executable, "-m", "ptdp", *argv], cwd=ROOT,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr
        out = result.stdout
    tokens = out.split()
    assert tokens[:3] == ["5", "6", "7"]  # the prompt is echoed before the continuation
    return tokens[3:]


def test_generation_is_the_same_under_every_layout(checkpoint, capsys):
    checkpoint, chain = checkpoint
    greedy, sampled = ["--temperature", "0"], ["--temperature", "0.9", "--top-k", "20", "--seed", "3"]
    reference = {"greedy": _generate(checkpoint, *greedy, capsys=capsys),
                 "sampled": _generate(checkpoint, *sampled, capsys=capsys)}
    assert all(len(tokens) == 10 and all(t.isdigit() and int(t) < 32 for t in tokens)
               for tokens in reference.values())
    assert _generate(checkpoint, *greedy, "-t", "2", "-p", "2") == reference["greedy"]
    # Sampling on the last stage draws the same tokens under t, p and interleaving at once.
    assert _generate(checkpoint, *sampled, "-t", "2", "-p", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1") == reference["sampled"]
    # The model learned the generated data's successor table, and greedy
    # generation follows it from the prompt's last token.
    assert reference["greedy"] == chain


def test_export_to_hugging_face_and_back(checkpoint, tmp_path, capsys):
    checkpoint, _ = checkpoint
    transformers = pytest.importorskip("transformers")
    export, reimported = tmp_path / "hf", tmp_path / "back"
    assert main(["convert", "--load", str(checkpoint), "--to-hf", str(export)]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(export, local_files_only=True).eval()
    config, weights, _ = load_logical_model(checkpoint)
    ours = PipelinedModel(config, ParallelContext.single(), torch.device("cpu"), weights)
    tokens = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits[0, -1]
    torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)

    assert main(["convert", "--from-hf", str(export), "--save", str(reimported)]) == 0
    config_back, weights_back, metadata = load_logical_model(reimported)
    assert config_back.model.num_layers == 4 and metadata["iteration"] == 0
    assert all(torch.equal(weights_back[name], w) for name, w in weights.items())
    assert _generate(reimported, "--temperature", "0", capsys=capsys) == \
        _generate(checkpoint, "--temperature", "0", capsys=capsys)


@pytest.mark.parametrize("argv, message", [
    (["convert", "--load", "x"], "give either --load CKPT --to-hf DIR"),
    (["convert", "--load", "x", "--to-hf", "y", "--save", "z"], "give either"),
    (["convert", "--load", "no/such", "--to-hf", "y"], "no such directory"),
    (["convert", "--from-hf", "no/such", "--save", "z"], "no/such"),
    (["generate", "--load", "no/such", "--prompt", "x"], "no such directory"),
])
def test_bad_requests(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_generate_checks_its_settings_and_layout(checkpoint, capsys):
    checkpoint, _ = checkpoint
    assert main(["generate", "--load", str(checkpoint), "--prompt", "1", "--top-p", "0"]) == 2
    assert "--top-p=0.0 must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--load", str(checkpoint), "--prompt", "1", "-t", "3"]) == 2
    assert "--tensor-model-parallel-size 3" in capsys.readouterr().err
    assert main(["generate", "--load", str(checkpoint), "--prompt", "hello"]) == 2
    assert "give token ids" in capsys.readouterr().err
