"""A training run that reads its data more than once says so, once, before
training (ptdp.data.loader.epochs_note); a run that reads it once says nothing."""

import numpy as np

from ptdp.config import Config, DataConfig, ModelConfig, TrainConfig
from ptdp.data.indexed import write_documents
from ptdp.data.loader import build_training_data

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=257, make_vocab_size_divisible_by=8)


def _corpus(prefix, documents: int = 10, length: int = 64) -> str:
    """`documents` documents of `length` byte tokens, the last one the end of document."""
    rng = np.random.default_rng(0)
    write_documents(prefix, [np.append(rng.integers(0, 256, length - 1), 256)
                             for _ in range(documents)], dtype=np.uint16)
    return str(prefix)


def _build(data_path, tmp_path, samples: int, *, builder: bool = True):
    config = Config(model=MODEL, train=TrainConfig(train_iters=1),
                    data=DataConfig(data_path=data_path, tokenizer_type="ByteLevelTokenizer",
                                    split="1", data_cache_path=str(tmp_path / "cache")))
    return build_training_data(config, num_samples=(samples, 0, 0), is_builder=builder,
                               reads_tokens=True, barrier=None)


def test_a_run_longer_than_its_data_says_how_many_epochs(tmp_path, capsys):
    prefix = _corpus(tmp_path / "small")  # 640 tokens: 40 samples of 16 per epoch
    _build([prefix], tmp_path, 100)
    err = capsys.readouterr().err
    note = [line for line in err.splitlines() if line.startswith("ptdp: note:")]
    assert note == [
        f"ptdp: note: this run trains on 100 samples of 16 tokens, and the train split of "
        f"{prefix} holds 640 tokens (about 40 samples): it is read 2.5 times over (3 epochs, "
        f"each in its own order). To see each token once, give more data or train for fewer "
        f"samples (--train-iters, --train-samples)"]
    # Once per job: the ranks that do not build the indices say nothing.
    _build([prefix], tmp_path, 100, builder=False)
    assert "ptdp: note:" not in capsys.readouterr().err
    _build([prefix], tmp_path, 39)  # one epoch holds them
    assert "ptdp: note:" not in capsys.readouterr().err


def test_a_blend_names_the_datasets_it_repeats(tmp_path, capsys):
    small = _corpus(tmp_path / "small")
    large = _corpus(tmp_path / "large", documents=200)  # 800 samples
    _build(["1", small, "1", large], tmp_path, 100)
    note = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ptdp: note:")]
    assert len(note) == 1 and "blend more than once" in note[0]
    assert f"the train split of {small} " in note[0] and large not in note[0]
