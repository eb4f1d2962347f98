"""From the data settings to the tensors a microbatch trains on.

`check_data_settings` runs before any process starts (files exist, the
split parses, the tokenizer's flags fit together). `build_training_data`
runs on every rank: the global rank 0 tokenizes the demo corpus (first use
only) and builds the dataset indices while the others wait at a barrier,
then the ranks that read tokens (first and last pipeline stage) open them.

Sample i of the training set is the same for every layout; which samples a
rank reads is the sampler's business (ptdp.data.sampler).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ptdp.config import Config, DataConfig
from ptdp.data.mock import MockGPTDataset
from ptdp.data.tokenizer import TokenizerError, build_tokenizer, check_tokenizer_settings


class DataSettingsError(ValueError):
    pass


def tokenizer_for(data: DataConfig):
    return build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file,
                           merge_file=data.merge_file, tokenizer_model=data.tokenizer_model)


def tokenizer_key(data: DataConfig) -> str:
    """Names a tokenizer by its type and its files' contents, so that the
    cached demo corpus is re-tokenized when the tokenizer changes."""
    parts = [data.tokenizer_type]
    for path in (data.vocab_file, data.merge_file, data.tokenizer_model):
        if path:
            parts.append(hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return "|".join(parts)


def check_data_settings(config: Config) -> list[str]:
    """Problems with the data flags, found before launching."""
    from ptdp.data.gpt_dataset import DataError, parse_data_path, parse_split

    data = config.data
    if data.mock_data:
        if data.data_path:
            return ["--mock-data and --data-path exclude each other; drop one"]
        return []
    problems = check_tokenizer_settings(data.tokenizer_type, data.vocab_file, data.merge_file,
                                        data.tokenizer_model)
    for check, value in ((parse_split, data.split), (parse_data_path, data.data_path)):
        if value is None:
            continue
        try:
            check(value)
        except DataError as error:
            problems.append(str(error))
    return problems


def check_datasets(config: Config) -> list[str]:
    """Open the --data-path datasets and check the split holds the samples
    (after `validate`, which makes the batch settings trustworthy)."""
    from ptdp.data.gpt_dataset import DataError, check_gpt_datasets

    data, train = config.data, config.train
    if data.mock_data or not data.data_path:
        return []
    batch = train.batch_size(config.parallel.data_parallel_size)
    samples = (train.train_iters * batch, train.eval_iters * batch if train.eval_interval else 0, 0)
    try:
        _, _, _, wanted = check_gpt_datasets(data.data_path, data.split, samples,
                                             seq_length=config.model.seq_length, warn=False)
    except DataError as error:
        return [str(error)]
    if train.eval_interval and 1 not in wanted:
        return [f"--eval-interval {train.eval_interval} needs validation data, but --split "
                f"{data.split} gives the validation split no documents; give it a share (e.g. "
                "--split 949,50,1) or drop --eval-interval"]
    return []


def resolve_vocab_size(config: Config, explicit: bool) -> Config:
    """With real data the tokenizer decides the vocabulary. An explicit
    --vocab-size that disagrees is an error, not silently replaced."""
    if config.data.mock_data:
        return config
    try:
        tokenizer = tokenizer_for(config.data)
    except TokenizerError as error:
        raise DataSettingsError(str(error)) from None
    if explicit and config.model.vocab_size != tokenizer.vocab_size:
        raise DataSettingsError(
            f"--vocab-size={config.model.vocab_size} disagrees with the {tokenizer.name}'s "
            f"{tokenizer.vocab_size} tokens; drop --vocab-size (it comes from the tokenizer)")
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 vocab_size=tokenizer.vocab_size))


@dataclass
class TrainingData:
    """One rank's datasets: `train`, `valid`, `test` give int64 arrays (or
    tensors) of seq_length + 1 tokens per index; None where a split is empty
    or this rank reads no tokens. `eod` is the end-of-document id."""
    train: Any
    valid: Any = None
    test: Any = None
    eod: int | None = None
    description: str = ""


def build_training_data(config: Config, *, num_samples: tuple[int, int, int], is_builder: bool,
                        reads_tokens: bool, barrier: Callable[[], None] | None) -> TrainingData:
    model, data, seed = config.model, config.data, config.train.seed
    if data.mock_data:
        mock = MockGPTDataset(model.vocab_size, model.seq_length, seed)
        # Validation: other sequences of the same generator (same successor table).
        return TrainingData(train=mock, valid=_Offset(mock, MOCK_VALID_OFFSET),
                            test=_Offset(mock, 2 * MOCK_VALID_OFFSET), description="generated sequences")
    from ptdp.data.corpus import default_cache_dir, demo_data_prefix
    from ptdp.data.gpt_dataset import build_gpt_datasets

    tokenizer = tokenizer_for(data)
    if tokenizer.vocab_size > model.vocab_size:
        raise DataSettingsError(f"the {tokenizer.name} has {tokenizer.vocab_size} tokens but "
                                f"--vocab-size is {model.vocab_size}; raise --vocab-size")
    data_path = data.data_path
    description = " ".join(data_path or [])
    if data.uses_demo_corpus:
        cache = Path(data.data_cache_path) if data.data_cache_path else default_cache_dir()
        key = tokenizer_key(data)
        if is_builder:
            demo_data_prefix(tokenizer, key, cache, build=True)
        if barrier is not None:
            barrier()
        data_path = [demo_data_prefix(tokenizer, key, cache, build=False)]
        description = "the demo corpus (Shakespeare, one document per work)"
    train, valid, test = build_gpt_datasets(
        data_path, data.split, num_samples, seq_length=model.seq_length, seed=seed,
        cache_dir=data.data_cache_path, is_builder=is_builder, barrier=barrier)
    if not reads_tokens:  # middle pipeline stages: indices built, nothing to read
        train = valid = test = None
    return TrainingData(train, valid, test, eod=tokenizer.eod, description=description)


MOCK_VALID_OFFSET = 10 ** 9  # far beyond any training run's sample count


@dataclass
class _Offset:
    """Samples [offset, ...) of a dataset, seen from 0."""
    dataset: Any
    offset: int

    def __getitem__(self, i: int):
        return self.dataset[self.offset + i]


def collate(dataset, indices: range, vocab_size: int) -> torch.Tensor:
    """[b, s + 1] int64 tokens of the given samples."""
    tokens = torch.stack([torch.as_tensor(np.asarray(dataset[i]), dtype=torch.long) for i in indices])
    if tokens.numel() and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
        raise DataSettingsError(
            f"token id {bad} in samples {indices.start}..{indices.stop - 1} is outside the "
            f"vocabulary of {vocab_size}: the data was tokenized with another tokenizer than "
            "--tokenizer-type (and its files) say")
    return tokens


def split_microbatch(tokens: torch.Tensor, eod: int | None, eod_mask_loss: bool):
    """(inputs, labels) or (inputs, labels, loss_mask) from [b, s + 1] tokens.
    With --eod-mask-loss a position whose input is the end-of-document token
    is left out (predicting the next document from its end), as Megatron-LM."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if not eod_mask_loss or eod is None:
        return inputs, labels
    return inputs, labels, (inputs != eod).to(torch.float32)
