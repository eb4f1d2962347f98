"""From the data settings to the tensors a microbatch trains on.

Before any process starts, ptdp.checkpoint.data_settings.resolve_data decides
the run's tokenizer (its flags, else the one --load's checkpoint carries)
and vocabulary (`resolve_vocab_size`), and checks the data flags
(`check_data_settings`: files exist, the split parses, the tokenizer's
flags fit together); it lives in train because it reads the checkpoint,
which data never imports. The ranks build the resolved tokenizer with
`tokenizer_for`. `build_training_data`
runs on every rank: the global rank 0 tokenizes the demo corpus (first use
only) and builds the dataset indices while the others wait at a barrier,
then the ranks that read tokens (first and last pipeline stage) open them.

Sample i of the training set is the same for every layout; which samples a
rank reads is the sampler's business (ptdp.data.sampler). `TrainingBatches`
reads a rank's training microbatches, in the training process or, with
--num-workers N, in N background processes ahead of the step.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import multiprocessing.util
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ptdp.config import Config, DataConfig
from ptdp.data.batches import GlobalBatches
from ptdp.data.mock import MockGPTDataset
from ptdp.data.tiktoken_tokenizer import TiktokenSettings
from ptdp.data.tokenizer import (TokenizerError, build_tokenizer, character_counts,
                                  check_tokenizer_settings)
from ptdp.errors import UserError


class DataSettingsError(UserError, ValueError):
    pass


# The settings that name a tokenizer: given any of them, the run's flags decide
# the tokenizer, not the checkpoint it loads.
TOKENIZER_SETTINGS = ("data.tokenizer_type", "data.vocab_file", "data.merge_file",
                      "data.tokenizer_model")


def tokenizer_for(data: DataConfig, model_vocab_size: int | None = None):
    """The tokenizer of resolved data settings (see
    ptdp.checkpoint.data_settings.resolve_tokenizer and `resolve_vocab_size`). NullTokenizer has no files: its size is the
    model's vocabulary, `model_vocab_size` = N + 1."""
    return build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file,
                           merge_file=data.merge_file, tokenizer_model=data.tokenizer_model,
                           vocab_size=None if model_vocab_size is None else model_vocab_size - 1,
                           tiktoken=TiktokenSettings.of(data))


def carried_tokenizer_data(data: DataConfig, tokenizer_file: str | Path) -> DataConfig:
    """`data` with a checkpoint's tokenizer.json as its tokenizer."""
    return dataclasses.replace(data, tokenizer_type="HuggingFaceTokenizer",
                               tokenizer_model=str(tokenizer_file), vocab_file=None, merge_file=None)


def tokenizer_key(data: DataConfig) -> str:
    """Names a tokenizer by its type and its files' contents, so that the
    cached demo corpus is re-tokenized when the tokenizer changes."""
    parts = [data.tokenizer_type]
    if data.tokenizer_type == "TikTokenizer":  # its splitting and special tokens too
        parts.append(repr(TiktokenSettings.of(data)))
    for path in (data.vocab_file, data.merge_file, data.tokenizer_model):
        if path:
            parts.append(hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return "|".join(parts)


def check_data_settings(config: Config) -> list[str]:
    """Problems with the data flags, found before launching."""
    from ptdp.data.gpt_dataset import DataError, parse_data_path, parse_split

    from ptdp.config.data import sft_flag_problems

    data = config.data
    misplaced = sft_flag_problems(data) if not data.sft else []
    if misplaced:  # (before reading a conversation file as a .bin/.idx prefix)
        return misplaced
    if data.mock_data:
        if data.data_path:
            return ["--mock-data and --data-path exclude each other; drop one"]
        return []
    problems = check_tokenizer_settings(data.tokenizer_type, data.vocab_file, data.merge_file,
                                        data.tokenizer_model)
    if data.tokenizer_type == "NullTokenizer" and data.uses_demo_corpus:
        problems.append("--tokenizer-type NullTokenizer is for data that is token ids already, and "
                        "the demo corpus is text: give --data-path PREFIX (.bin/.idx) or another "
                        "--tokenizer-type")
    paths = _sft_files if data.sft else parse_data_path
    for check, value in ((parse_split, data.split), (paths, data.data_path)):
        if value is None:
            continue
        try:
            check(value)
        except DataError as error:
            problems.append(str(error))
    return problems


def _sft_files(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """--sft's --data-path: one file or weight-file pairs, each file there."""
    from ptdp.data.gpt_dataset import DataError, parse_weighted_paths

    pairs = parse_weighted_paths(data_path, "file")
    for _, path in pairs:
        if not Path(path).is_file():
            raise DataError(f"--data-path {path}: no such file; --sft reads JSON lines (.jsonl) or "
                            "Parquet (.parquet) files of conversations")
    return pairs


def check_datasets(config: Config) -> list[str]:
    """Open the --data-path datasets and check the split holds the samples
    (after `validate`, which makes the batch settings trustworthy)."""
    from ptdp.data.gpt_dataset import DataError, check_gpt_datasets

    data, train = config.data, config.train
    if data.mock_data or not data.data_path:
        return []
    if data.sft:
        from ptdp.data.sft import run_data

        return run_data.prepare(config)
    batches = GlobalBatches(train, config.parallel.dp)
    batch = batches.final
    samples = (batches.consumed_after(0, batches.train_iters),
               train.eval_iters * batch if train.evaluates else 0, 0)
    try:
        weighted, _, _, wanted = check_gpt_datasets(data.data_path, data.split, samples,
                                                    seq_length=config.model.seq_length, warn=False)
    except DataError as error:
        return [str(error)]
    problems = tokenizer_record_problems(config, [prefix for _, prefix in weighted])
    if train.evaluates and 1 not in wanted:
        problems.append(f"--eval-interval {train.eval_interval} needs validation data, but --split "
                        f"{data.split} gives the validation split no documents; give it a share "
                        "(e.g. --split 949,50,1) or drop --eval-interval")
    return problems


def tokenizer_record_problems(config: Config, prefixes: Sequence[str]) -> list[str]:
    """Each dataset whose recorded tokenizer (PREFIX.tokenizer-record.json,
    written by `ptdp preprocess`; ptdp.data.tokenizer_record) is not the
    run's. Datasets without a record (Megatron-LM's) are accepted."""
    from ptdp.data import tokenizer_record as records

    problems, run = [], None
    for prefix in dict.fromkeys(prefixes):
        try:
            record = records.read_record(prefix)
        except records.TokenizerRecordError as error:
            problems.append(str(error))
            continue
        if record is None:
            continue
        if run is None:
            data = config.data
            try:
                tokenizer = tokenizer_for(data, config.model.vocab_size)
            except TokenizerError as error:
                return problems + [str(error)]
            run = records.describe(tokenizer, data.tokenizer_type, dataclasses.asdict(data))
        reason = records.mismatch(record, run)
        if reason:
            problems.append(f"--data-path {prefix}: {reason}")
    return problems


def resolve_vocab_size(config: Config, explicit: bool, *, checkpoint: Config | None = None,
                       carried: bool = False) -> Config:
    """With real data the tokenizer decides the vocabulary. An explicit
    --vocab-size that disagrees is an error, not silently replaced.
    NullTokenizer's --vocab-size N (Megatron-LM's meaning) gives the
    vocabulary N + 1, its end-of-document id being N.

    `checkpoint`: the settings of --load's checkpoint, whose model's
    vocabulary the tokenizer must fit: equal it, or, for the tokenizer the
    checkpoint carries (`carried`), not exceed it (an imported model's
    embedding often has rows no token uses); the model keeps its size."""
    data = config.data
    if data.mock_data:
        return config
    null = data.tokenizer_type == "NullTokenizer"
    if null and not explicit:
        raise DataSettingsError("--tokenizer-type NullTokenizer needs --vocab-size N: the data's "
                                "token ids are 0..N-1 and N is the end-of-document id (the "
                                "vocabulary is N + 1)")
    try:
        tokenizer = build_tokenizer("NullTokenizer", vocab_size=config.model.vocab_size) if null \
            else tokenizer_for(data)
    except TokenizerError as error:
        raise DataSettingsError(str(error)) from None
    if explicit and not null and not carried and config.model.vocab_size != tokenizer.vocab_size:
        raise DataSettingsError(
            f"--vocab-size={config.model.vocab_size} disagrees with the {tokenizer.name}'s "
            f"{tokenizer.vocab_size} tokens; drop --vocab-size (it comes from the tokenizer)")
    vocab = tokenizer.vocab_size
    if checkpoint is not None:
        model_vocab = checkpoint.model.vocab_size
        _check_tokenizer_fits(config, tokenizer, checkpoint, carried)
        if carried:
            if explicit and config.model.vocab_size != model_vocab:
                raise DataSettingsError(
                    f"--vocab-size={config.model.vocab_size} disagrees with the vocabulary of "
                    f"--load {config.train.load}'s model, {model_vocab}; drop --vocab-size (it "
                    "comes from the checkpoint)")
            vocab = model_vocab
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab))


def _check_tokenizer_fits(config: Config, tokenizer, checkpoint: Config, carried: bool) -> None:
    model_vocab = checkpoint.model.vocab_size
    if tokenizer.vocab_size == model_vocab or (carried and tokenizer.vocab_size < model_vocab):
        return
    load = config.train.load
    if carried:
        raise DataSettingsError(
            f"--load {load}: the tokenizer the checkpoint carries has {tokenizer.vocab_size} "
            f"tokens, more than its model's vocabulary of {model_vocab}; name the model's "
            "tokenizer with --tokenizer-type and its files")
    given = (f"--tokenizer-type NullTokenizer --vocab-size {tokenizer.eod} gives "
             f"{tokenizer.vocab_size} (ids 0..{tokenizer.eod - 1} and the end-of-document id "
             f"{tokenizer.eod})" if tokenizer.name == "NullTokenizer" else
             f"the {tokenizer.name} (--tokenizer-type and its files) has {tokenizer.vocab_size}")
    raise DataSettingsError(f"--load {load}: its model has a vocabulary of {model_vocab} tokens, "
                            f"but {given}; {_saved_tokenizer_hint(checkpoint)}")


def _saved_tokenizer_hint(checkpoint: Config) -> str:
    """What to give to train on with the tokenizer a checkpoint was trained with."""
    data, vocab = checkpoint.data, checkpoint.model.vocab_size
    if data.mock_data:
        return "the model was trained on generated data: give --mock-data"
    if data.tokenizer_type == "NullTokenizer":
        return f"it was trained with --tokenizer-type NullTokenizer --vocab-size {vocab - 1}"
    if data.tokenizer_type == "HuggingFaceTokenizer" and not data.tokenizer_model:
        return "the checkpoint carries its tokenizer: drop the tokenizer flags to train with it"
    files = [f"{flag} {path}" for flag, path in (("--vocab-file", data.vocab_file),
                                                 ("--merge-file", data.merge_file),
                                                 ("--tokenizer-model", data.tokenizer_model)) if path]
    return ("give the tokenizer it was trained with (its settings say --tokenizer-type "
            f"{' '.join([data.tokenizer_type, *files])})")


@dataclass
class TrainingData:
    """One rank's datasets: `train`, `valid`, `test` give int64 arrays (or
    tensors) of seq_length + 1 tokens per index; None where a split is empty
    or this rank reads no tokens. `eod` is the end-of-document id.
    `characters`: per token id the characters it decodes to (int64, vocab
    size long; `character_table`), for bits per character; None without
    text (generated data, NullTokenizer) or an exact count."""
    train: Any
    valid: Any = None
    test: Any = None
    eod: int | None = None
    description: str = ""
    characters: torch.Tensor | None = None


def build_training_data(config: Config, *, num_samples: tuple[int, int, int], is_builder: bool,
                        reads_tokens: bool, barrier: Callable[[], None] | None) -> TrainingData:
    model, data, seed = config.model, config.data, config.train.seed
    if data.mock_data:
        mock = MockGPTDataset(model.vocab_size, model.seq_length, seed)
        # Validation: other sequences of the same generator (same successor table).
        return TrainingData(train=mock, valid=_Offset(mock, MOCK_VALID_OFFSET),
                            test=_Offset(mock, 2 * MOCK_VALID_OFFSET), description="generated sequences")
    from ptdp.data.cache import default_cache_dir
    from ptdp.data.corpus import demo_data_prefix
    from ptdp.data.gpt_dataset import build_gpt_datasets

    if data.sft:
        return _sft_training_data(config, num_samples, is_builder, reads_tokens, barrier)
    tokenizer = tokenizer_for(data, model.vocab_size)
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
        cache_dir=data.data_cache_path, is_builder=is_builder, barrier=barrier,
        mmap_bin_files=data.mmap_bin_files)
    note = epochs_note(train, num_samples[0]) if is_builder and train is not None else None
    if note:  # said once, by the rank that builds the indices
        print(note, file=sys.stderr, flush=True)
    if not reads_tokens:  # middle pipeline stages: indices built, nothing to read
        train = valid = test = None
    # Built where labels are read (the first stage's copy is unused, and cheap).
    characters = character_table(tokenizer, model.vocab_size) if reads_tokens else None
    return TrainingData(train, valid, test, eod=tokenizer.eod, description=description,
                        characters=characters)


def _sft_training_data(config: Config, num_samples: tuple[int, int, int], is_builder: bool,
                       reads_tokens: bool, barrier: Callable[[], None] | None) -> TrainingData:
    """--sft: packed conversations (ptdp.data.sft.run_data)."""
    from ptdp.data.sft import run_data

    (train, valid, test), description, eod = run_data.build(
        config, num_samples=num_samples, is_builder=is_builder, barrier=barrier)
    if not reads_tokens:
        train = valid = test = None
    tokenizer = tokenizer_for(config.data, config.model.vocab_size)
    characters = character_table(tokenizer, config.model.vocab_size) if reads_tokens else None
    return TrainingData(train, valid, test, eod=eod, description=description,
                        characters=characters)


def epochs_note(dataset, num_samples: int) -> str | None:
    """One note when the training split will be read more than once
    (`num_samples` samples asked of `dataset`, a GPTDataset or a blend of
    them): how often, and in how many epochs; None when once is enough."""
    from ptdp.data.gpt_dataset import BlendedDataset

    parts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    repeated = [part for part in parts if part.num_epochs > 1]
    if not repeated:
        return None

    def times(part) -> str:
        over = part.num_samples * part.seq_length / part.tokens_per_epoch
        return f"{over:.3g} times over ({part.num_epochs} epochs, each in its own order)"

    if len(parts) == 1:
        part = parts[0]
        what = (f"this run trains on {num_samples:,} samples of {part.seq_length} tokens, and the "
                f"{part.split_name} split of {part.prefix} holds {part.tokens_per_epoch:,} tokens "
                f"(about {part.tokens_per_epoch // part.seq_length:,} samples): it is read "
                f"{times(part)}")
    else:
        what = ("this run reads part of its blend more than once: "
                + "; ".join(f"the {part.split_name} split of {part.prefix} {times(part)}"
                            for part in repeated))
    return (f"ptdp: note: {what}. To see each token once, give more data or train for fewer "
            f"samples (--train-iters, --train-samples)")


def character_table(tokenizer, vocab_size: int) -> torch.Tensor | None:
    """`character_counts(tokenizer)` as an int64 tensor of `vocab_size`
    entries (the ids past the tokenizer's count 0), or None."""
    counts = character_counts(tokenizer)
    if counts is None:
        return None
    table = torch.zeros(vocab_size, dtype=torch.int64)
    table[:len(counts)] = torch.tensor(counts, dtype=torch.int64)
    return table


MOCK_VALID_OFFSET = 10 ** 9  # far beyond any training run's sample count


@dataclass
class _Offset:
    """Samples [offset, ...) of a dataset, seen from 0."""
    dataset: Any
    offset: int

    def __getitem__(self, i: int):
        return self.dataset[self.offset + i]


def collate(dataset, indices: range, vocab_size: int):
    """[b, s + 1] int64 tokens of the given samples (SFT samples: a dict of
    [b, s] tensors; see read_samples)."""
    tokens = read_samples(dataset, indices)
    check_token_ids(tokens, indices, vocab_size)
    return tokens


def read_samples(dataset, indices: range):
    """[b, s + 1] int64 tokens of the given samples, unchecked; for samples
    that are dicts of arrays (SFT packs), a dict of the stacked tensors."""
    samples = [dataset[i] for i in indices]
    if samples and isinstance(samples[0], dict):
        return {key: torch.stack([torch.as_tensor(np.asarray(sample[key])) for sample in samples])
                for key in samples[0]}
    return torch.stack([torch.as_tensor(np.asarray(sample), dtype=torch.long) for sample in samples])


def check_token_ids(tokens, indices: range, vocab_size: int) -> None:
    if isinstance(tokens, dict):  # an SFT microbatch: its inputs and labels
        for key in ("tokens", "labels"):
            check_token_ids(tokens[key], indices, vocab_size)
        return
    if tokens.numel() and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
        raise DataSettingsError(
            f"token id {bad} in samples {indices.start}..{indices.stop - 1} is outside the "
            f"vocabulary of {vocab_size}: the data was tokenized with another tokenizer than "
            "--tokenizer-type (and its files) say (with NullTokenizer: --vocab-size N must be "
            "above every id but the end-of-document id N)")


# ---------------------------------------------------------------- background reading (--num-workers)

class TrainingBatches:
    """This rank's training microbatches, [b, s + 1] tokens by their sample
    indices (`read`). The indices alone decide the tokens, so every way of
    reading gives the same batches.

    With --num-workers 0 each microbatch is read when the step asks for it.
    With N > 0, N background processes (a torch DataLoader) read the
    microbatches of `order`, (iteration, indices) in the order the run asks
    for them (ptdp.data.sampler.training_microbatches), ahead of the step.
    A microbatch is kept until the next iteration's first is asked for: a
    rank that holds the first and the last stage (zbv) asks twice. A request
    outside `order` is read here. `close` ends the processes (also at exit)."""

    def __init__(self, dataset, config: Config, order: Iterable[tuple[int, range]] = ()):
        self.dataset, self.vocab_size = dataset, config.model.vocab_size
        self._ready: dict[range, tuple[int, torch.Tensor]] = {}  # indices -> (iteration, tokens)
        self._workers = self._stop = None
        if dataset is not None and config.data.num_workers > 0:
            self._workers = _start_workers(dataset, order, config)
            # Also stopped if this object is dropped unclosed, and at exit:
            # before multiprocessing's exit handling, which would SIGTERM the
            # workers (ignored) and wait for them, and before torch's, after
            # which the DataLoader no longer stops them.
            self._stop = multiprocessing.util.Finalize(self, _stop_workers, args=(self._workers,),
                                                       exitpriority=100)
            atexit.register(self._stop)

    def read(self, indices: range):
        tokens = self._prefetched(indices) if self._workers is not None else None
        if tokens is None:
            tokens = read_samples(self.dataset, indices)
        check_token_ids(tokens, indices, self.vocab_size)
        return tokens

    def _prefetched(self, indices: range) -> torch.Tensor | None:
        # The workers' samples start later with every microbatch; once one
        # starts after `indices`, they will not bring it.
        while indices not in self._ready:
            try:
                iteration, key, tokens = next(self._workers)
            except StopIteration:
                return None
            if isinstance(tokens, BaseException):  # raised by the dataset in a worker
                raise tokens
            self._ready[key] = (iteration, tokens)
            if key.start > indices.start:
                return None
        iteration, tokens = self._ready[indices]
        for key in [k for k, (i, _) in self._ready.items() if i < iteration]:
            del self._ready[key]
        return tokens

    def close(self) -> None:
        """End the worker processes (idempotent)."""
        self._workers = None
        self._ready.clear()
        if self._stop is not None:
            atexit.unregister(self._stop)
            self._stop()  # runs once


def _identity(item):
    return item


class _WorkerReads:
    """What a worker process does with one (iteration, indices): read the
    samples. A dataset error comes back as the value, raised in the
    training process with its own message."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, range]):
        iteration, indices = key
        try:
            return iteration, indices, read_samples(self.dataset, indices)
        except Exception as error:  # noqa: BLE001 - re-raised by TrainingBatches.read
            return iteration, indices, error


def _start_workers(dataset, order: Iterable[tuple[int, range]], config: Config):
    """The DataLoader's iterator over `order`, its processes started.

    fork: the workers inherit the opened datasets instead of unpickling them,
    and are children of this process (under forkserver a SIGTERM to the
    job's processes would end the server, and with it the workers). They
    never use the process group or a GPU, so forking after those exist is
    safe, as in Megatron-LM. A dedicated generator seeds the workers: the
    DataLoader would otherwise draw their seed from torch's global stream,
    which training's dropout uses."""
    from torch.utils.data import DataLoader

    signals = _graceful_signals(config)
    loader = DataLoader(_WorkerReads(dataset), batch_size=None, sampler=_Order(order),
                        collate_fn=_identity, num_workers=config.data.num_workers,
                        persistent_workers=True, multiprocessing_context="fork",
                        generator=torch.Generator(), worker_init_fn=_WorkerInit(signals))
    # The graceful-exit signals stay blocked from before the fork until each
    # worker ignores them (`_WorkerInit`): a job-wide SIGTERM asks the
    # training process to save and stop, and must not end its readers first.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Order:
    """The sampler: yields `order`'s (iteration, indices) as they are."""

    def __init__(self, order: Iterable[tuple[int, range]]):
        self.order = order

    def __iter__(self):
        return iter(self.order)


def _graceful_signals(config: Config) -> set[int]:
    """The signals that ask the run to save and stop (ptdp.graceful_signals)."""
    from ptdp.config import signal_from_name
    from ptdp.graceful_signals import GRACEFUL_SIGNALS

    if not config.train.exit_signal_handler:
        return set()
    return {int(signal_from_name(name)) for name in (*GRACEFUL_SIGNALS, config.train.exit_signal)}


@dataclass
class _WorkerInit:
    """Runs first in each worker process."""
    signals: set[int]

    def __call__(self, worker_id: int) -> None:
        _die_with_parent()
        _close_device_files()
        signal.set_wakeup_fd(-1)  # a graceful-exit handler's, inherited: the training process's
        for signum in self.signals:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)


def _die_with_parent() -> None:
    """Have Linux kill this worker when the training process ends, however
    it ends (the DataLoader's own check notices only every few seconds)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    except (OSError, AttributeError):  # not Linux
        pass


def _close_device_files() -> None:
    """A worker never uses the GPU: closing the driver's files it inherited
    lets the device's memory be freed even while a worker lingers."""
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return
    for descriptor in descriptors:
        try:
            if os.readlink(f"/proc/self/fd/{descriptor}").startswith("/dev/nvidia"):
                os.close(int(descriptor))
        except OSError:
            pass


def _stop_workers(workers) -> None:
    """Ask the workers to finish, then kill any that does not: they ignore
    SIGTERM, which is all the DataLoader sends."""
    processes = list(getattr(workers, "_workers", []))
    workers._shutdown_workers()
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join()
