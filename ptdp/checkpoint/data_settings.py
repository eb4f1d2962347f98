"""The run's data settings as --load's checkpoint completes them.

Before any process starts, `resolve_data` decides the run's tokenizer (its
flags, else the one --load's checkpoint carries) and vocabulary, and checks
the data flags; `model_tokenizer` finds a saved model's tokenizer for
`ptdp generate`. Both read the checkpoint (store.py) and the data settings
(ptdp.data.loader), so they live here, with the checkpoint: ptdp.data never
imports checkpoints.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from ptdp.config import Config, ConfigError, DataConfig
from ptdp.data.loader import (TOKENIZER_SETTINGS, DataSettingsError, carried_tokenizer_data,
                              check_data_settings, resolve_vocab_size, tokenizer_for)
from ptdp.checkpoint.store import (CheckpointError, checkpoint_tokenizer, read_metadata, resolve,
                                   saved_model_config)


def resolve_data(config: Config, explicit: Sequence[str]) -> Config:
    """The one path from a training run's data settings to the resolved
    ones, before launching: the tokenizer (`resolve_tokenizer`), its flags
    checked, and the vocabulary it gives (`resolve_vocab_size`).
    `explicit`: the settings the user gave ("section.field")."""
    config, carried = resolve_tokenizer(config, explicit)
    problems = check_data_settings(config)
    if problems:
        raise ConfigError(problems)
    try:
        return resolve_vocab_size(config, "model.vocab_size" in explicit,
                                  checkpoint=_loaded_settings(config), carried=carried)
    except DataSettingsError as error:
        raise ConfigError([str(error)]) from None


def resolve_tokenizer(config: Config, explicit: Sequence[str]) -> tuple[Config, bool]:
    """The training run's tokenizer: the one its flags (or config file) name
    where they name any; otherwise the tokenizer --load's checkpoint
    carries; otherwise the default. Generated data (--mock-data) has none.
    Returns the config and whether the checkpoint's tokenizer was taken."""
    if config.data.mock_data or any(k in explicit for k in TOKENIZER_SETTINGS) \
            or _loaded_settings(config) is None:
        return config, False
    try:
        carried = checkpoint_tokenizer(config.train.load)
    except CheckpointError as error:
        raise ConfigError([f"{error}; or name a tokenizer (--tokenizer-type and its files), which "
                           "takes the place of the checkpoint's"]) from None
    if carried is None:
        return config, False
    data = carried_tokenizer_data(config.data, carried.absolute())
    return dataclasses.replace(config, data=data), True


def _loaded_settings(config: Config) -> Config | None:
    """--load's checkpoint's model and data settings (the rest default);
    None without --load, or for a checkpoint that cannot be read (the
    checkpoint checks report why)."""
    if not config.train.load:
        return None
    try:
        saved = read_metadata(resolve(config.train.load))
        known = {f.name for f in dataclasses.fields(DataConfig)}
        data = DataConfig(**{k: v for k, v in saved["config"].get("data", {}).items() if k in known})
        return Config(model=saved_model_config(saved), data=data)
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return None


def model_tokenizer(config: Config, load: str | Path | None = None):
    """The tokenizer of a saved model (`config` from its metadata): the file
    the checkpoint `load` carries, else the one its data settings name; None
    for a model of generated data without one."""
    carried = checkpoint_tokenizer(load) if load is not None else None
    if carried is not None:
        return tokenizer_for(carried_tokenizer_data(config.data, carried))
    if config.data.mock_data:
        return None
    return tokenizer_for(config.data, config.model.vocab_size)
