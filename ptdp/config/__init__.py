"""Typed configuration: model, parallel layout, training and data settings,
one module per section.

Every field that is a command-line flag carries its flag name (Megatron-LM's
where one exists) in its metadata; the CLI is generated from these dataclasses,
so a field, its flag, its config-file key and its help text live in one place.

`validate` checks every constraint before any process starts. It never adjusts
a value: each problem becomes a message naming the flag, the values and a
valid alternative, and all problems are reported together.

The package, from the bottom: base.py (the flag field, ConfigError and the
checks' helpers), model.py (with moe.py, its mixture-of-experts settings),
parallel.py (its layer split is ptdp.schedules.split's), train.py (with signals.py), data.py and
lora.py (each section's fields and its own checks),
sections.py (the whole Config and the flags across sections), checks.py
(`validate`, composing the sections' checks and the ones across sections)
and files.py (a --config file's settings, read and coerced once).
It imports nothing of ptdp above it but the torch-free ptdp.schedules, and never torch.
"""

from ptdp.config.base import ConfigError, flag
from ptdp.config.checks import validate
from ptdp.config.data import DataConfig
from ptdp.config.lora import LoRAConfig
from ptdp.config.model import ModelConfig
from ptdp.config.moe import MoEFields, parse_layer_pattern
from ptdp.config.parallel import ParallelConfig
from ptdp.config.sections import SECTION_TYPES, Config, flag_fields, flag_of
from ptdp.config.signals import signal_from_name
from ptdp.config.train import TrainConfig

__all__ = ["Config", "ConfigError", "DataConfig", "LoRAConfig", "ModelConfig", "MoEFields",
           "ParallelConfig", "SECTION_TYPES", "TrainConfig", "flag", "flag_fields", "flag_of",
           "parse_layer_pattern", "signal_from_name", "validate"]
