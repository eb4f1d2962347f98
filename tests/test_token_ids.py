"""Token ids in and out: `ptdp generate --prompt-ids/--output-ids`, and
`--tokenizer-type NullTokenizer --vocab-size N` (Megatron-LM's meaning: the
data's ids are 0..N-1, N is the end of document, the vocabulary N + 1) for
training on data that is token ids already."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ptdp.cli import main
from ptdp.data.indexed import write_documents
from ptdp.data.preprocess import PreprocessError, preprocess
from ptdp.data.tokenizer import NullTokenizer, TokenizerError, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA_VOCAB = 100  # --vocab-size: ids 0..99, end of document 100
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--make-vocab-size-divisible-by", "8", "--split", "1,0,0"]


def _ids_corpus(prefix: Path, top: int = DATA_VOCAB) -> str:
    """Documents of ids 0..top-1, each ending in the end-of-document id top,
    written by ptdp's own writer."""
    rng = np.random.default_rng(0)
    write_documents(prefix, [np.append(rng.integers(0, top, 40), top) for _ in range(30)])
    return str(prefix)


def _null_flags(tmp_path: Path, prefix: str, vocab: int = DATA_VOCAB) -> list[str]:
    return [*MODEL, "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(vocab), "--data-cache-path", str(tmp_path / "cache")]


@pytest.fixture(scope="module")
def null_checkpoint(tmp_path_factory):
    """A model trained 3 iterations with NullTokenizer on ids."""
    folder = tmp_path_factory.mktemp("null")
    prefix = _ids_corpus(folder / "ids")
    assert main(["train", *_null_flags(folder, prefix), "--train-iters", "3",
                 "--save", str(folder / "ckpt")]) == 0
    return folder / "ckpt"


# --------------------------------------------------------------------------- NullTokenizer

def test_null_tokenizer_has_megatron_lms_meaning():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)
    assert tokenizer.decode([5, 17, 100]) == "5 17 100"
    with pytest.raises(TokenizerError, match="NullTokenizer has no text"):
        tokenizer.encode("hello")
    with pytest.raises(TokenizerError, match="needs --vocab-size N"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(TokenizerError, match="takes no tokenizer files"):
        build_tokenizer("NullTokenizer", tokenizer_model="x.json", vocab_size=10)


def test_preprocess_refuses_the_null_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    with pytest.raises(PreprocessError, match="NullTokenizer has no text to tokenize"):
        preprocess([tmp_path / "a.txt"], tmp_path / "out", "NullTokenizer", progress=False)


@pytest.mark.parametrize("argv, message", [
    (["--data-path", "PREFIX", "--tokenizer-type", "NullTokenizer"],
     "--tokenizer-type NullTokenizer needs --vocab-size N: the data's token ids are 0..N-1 and N "
     "is the end-of-document id"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
     "the demo corpus is text: give --data-path PREFIX"),
    (["--data-path", "PREFIX", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
      "--tokenizer-model", "x.json"], "--tokenizer-type NullTokenizer takes no tokenizer files"),
])
def test_null_tokenizer_settings_are_checked_before_launch(tmp_path, capsys, no_launch, argv,
                                                           message):
    prefix = _ids_corpus(tmp_path / "ids")
    argv = [prefix if a == "PREFIX" else a for a in argv]
    assert main(["train", *MODEL, *argv]) == 2
    assert message in capsys.readouterr().err


def test_null_tokenizer_trains_and_records_its_vocabulary(null_checkpoint):
    from ptdp.checkpoint.store import load_logical_model

    config, weights, metadata = load_logical_model(null_checkpoint)
    assert metadata["iteration"] == 3 and "tokenizer" not in metadata  # no file to carry
    assert config.data.tokenizer_type == "NullTokenizer"
    assert config.model.vocab_size == DATA_VOCAB + 1  # ids and the end of document
    assert weights["embedding.word_embeddings.weight"].shape[0] == DATA_VOCAB + 1


def test_resuming_a_null_tokenizer_run_needs_the_same_vocab_size(tmp_path, capsys, no_launch,
                                                                 null_checkpoint):
    prefix = _ids_corpus(tmp_path / "ids")
    flags = [*_null_flags(tmp_path, prefix, DATA_VOCAB + 1), "--load", str(null_checkpoint),
             "--train-iters", "4"]
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert f"its model has a vocabulary of {DATA_VOCAB + 1} tokens, but --tokenizer-type " \
           f"NullTokenizer --vocab-size {DATA_VOCAB + 1} gives {DATA_VOCAB + 2}" in err
    assert f"it was trained with --tokenizer-type NullTokenizer --vocab-size {DATA_VOCAB}" in err
    # Without tokenizer flags the default (GPT-2's) tokenizer does not fit either.
    assert main(["train", *MODEL, "--data-path", prefix, "--load", str(null_checkpoint),
                 "--train-iters", "4"]) == 2
    assert "but the GPT2BPETokenizer (--tokenizer-type and its files) has 50257" in \
        capsys.readouterr().err


def test_ids_beyond_the_vocabulary_are_refused(tmp_path, capsys):
    prefix = _ids_corpus(tmp_path / "ids", top=DATA_VOCAB)
    assert main(["train", *_null_flags(tmp_path, prefix, vocab=DATA_VOCAB - 10),
                 "--train-iters", "1"]) == 1
    err = capsys.readouterr().err
    assert f"is outside the vocabulary of {DATA_VOCAB - 9}" in err
    assert "with NullTokenizer: --vocab-size N must be above every id" in err


# --------------------------------------------------------------------------- generate

def _generate(capsys, checkpoint, *argv) -> str:
    assert main(["generate", "--load", str(checkpoint), *argv]) == 0
    return capsys.readouterr().out.strip()


def test_prompt_ids_and_output_ids_on_one_process(null_checkpoint, capsys):
    flags = ["--prompt-ids", "5,17,99", "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "1"]
    ids = _generate(capsys, null_checkpoint, *flags, "--output-ids")
    assert "\n" not in ids and "," in ids
    tokens = [int(t) for t in ids.split(",")]
    assert 1 <= len(tokens) <= 6 and all(0 <= t < DATA_VOCAB for t in tokens)  # stops at the eod
    # Text output of a NullTokenizer model is the ids (Megatron-LM's detokenize),
    # the prompt's first; --output-ids gives the generated ones only.
    assert _generate(capsys, null_checkpoint, *flags) == " ".join(map(str, [5, 17, 99, *tokens]))
    assert _generate(capsys, null_checkpoint, *flags, "--no-echo-prompt") == \
        " ".join(map(str, tokens))
    # Spaces around the commas are accepted.
    assert _generate(capsys, null_checkpoint, "--prompt-ids", "5, 17 ,99", *flags[2:],
                     "--output-ids") == ids


def test_prompt_ids_under_a_tensor_parallel_layout(null_checkpoint, capsys):
    flags = ["--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "8", "--temperature", "0",
             "--output-ids"]
    reference = _generate(capsys, null_checkpoint, *flags)
    result = subprocess.run([sys.executable, "-m", "ptdp", "generate", "--load",
                             str(null_checkpoint), *flags, "-t", "2"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == reference


def test_text_prompt_for_a_null_tokenizer_model_asks_for_ids(null_checkpoint, capsys):
    assert main(["generate", "--load", str(null_checkpoint), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "--prompt needs a text tokenizer, and this model was trained with NullTokenizer" in err
    assert "--prompt-ids 1,2,3" in err


@pytest.mark.parametrize("argv, message", [
    ([], "give the prompt either as text, --prompt TEXT, or as token ids, --prompt-ids 5,17,923"),
    (["--prompt", "1", "--prompt-ids", "1"], "--prompt-ids 5,17,923, not both"),
    (["--prompt-ids", ""], "--prompt-ids is empty: give the token ids to continue"),
    (["--prompt-ids", " , "], "--prompt-ids is empty"),
    (["--prompt-ids", "1,x,3"], "--prompt-ids '1,x,3': 'x' is not a token id; give non-negative "
                                "integers separated by commas"),
    (["--prompt-ids", "1,-2"], "'-2' is not a token id"),
    (["--prompt-ids", "1,,3"], "'' is not a token id"),
    (["--prompt-ids", f"1,{DATA_VOCAB + 1}"],
     f"token id {DATA_VOCAB + 1} is outside this model's vocabulary of {DATA_VOCAB + 1} "
     f"(ids 0 to {DATA_VOCAB})"),
    (["--prompt-ids", ",".join(["1"] * 17)],
     "--prompt-ids is 17 tokens long, more than this model's context of 16 tokens"),
])
def test_bad_prompt_ids_are_refused_before_launch(null_checkpoint, capsys, argv, message):
    assert main(["generate", "--load", str(null_checkpoint), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and message in err and "Traceback" not in err


def test_space_separated_ids_in_prompt_still_work_for_mock_data_models(tmp_path, capsys):
    save = tmp_path / "mock"
    assert main(["train", "--mock-data", "--vocab-size", "32", *MODEL, "--train-iters", "1",
                 "--save", str(save)]) == 0
    capsys.readouterr()
    flags = ["--max-new-tokens", "4", "--temperature", "0"]
    text = _generate(capsys, save, "--prompt", "5 6 7", *flags)
    assert text.startswith("5 6 7 ")  # the prompt, then its continuation
    assert _generate(capsys, save, "--prompt-ids", "5,6,7", *flags, "--output-ids") == \
        text.removeprefix("5 6 7 ").replace(" ", ",")
