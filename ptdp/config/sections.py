"""The whole configuration: its five sections together, and the flags across
them (the command line and config files are generated from these)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ptdp.config.base import is_count
from ptdp.config.data import DataConfig
from ptdp.config.lora import LoRAConfig
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig
from ptdp.config.train import TrainConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        # --calculate-per-token-loss: the default under --sft (Megatron-LM's
        # per-microbatch mean weighs a short answer's tokens more), off otherwise.
        if self.train.calculate_per_token_loss is None:
            self.train.calculate_per_token_loss = bool(self.data.sft)
        # --num-virtual-stages-per-pipeline-rank v is L/(p·v) layers per chunk,
        # what every consumer reads; v = 1 is one chunk per rank (no
        # interleaving). validate reports values that do not divide.
        v, k = self.parallel.num_virtual_stages_per_pipeline_rank, \
            self.parallel.num_layers_per_virtual_pipeline_stage
        layers, p = self.model.num_layers, self.parallel.pipeline_model_parallel_size
        if k is None and all(is_count(x, 1) for x in (v, layers, p)) and v > 1 \
                and layers % (p * v) == 0:
            self.parallel.num_layers_per_virtual_pipeline_stage = layers // (p * v)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, sections: dict[str, dict[str, Any]]) -> "Config":
        return cls(**{name: section_type(**sections.get(name, {}))
                      for name, section_type in SECTION_TYPES.items()})


SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig,
    "lora": LoRAConfig}


def flag_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section, field) for every field that is a flag, in declaration order:
    a section's own fields first, then those it inherits (ModelConfig's MoE
    settings, ptdp.config.moe), so --help lists --num-layers before them."""
    return [(section, f) for section, cls in SECTION_TYPES.items()
            for f in _own_fields_first(cls) if "flag" in f.metadata]


def _own_fields_first(cls: type) -> list[dataclasses.Field]:
    inherited = {name for base in cls.__mro__[1:] for name in getattr(base, "__dataclass_fields__", {})}
    fields = dataclasses.fields(cls)
    return [f for f in fields if f.name not in inherited] + [f for f in fields if f.name in inherited]


def flag_of(section: str, name: str) -> str:
    for f in dataclasses.fields(SECTION_TYPES[section]):
        if f.name == name:
            return f.metadata["flag"]
    raise KeyError(f"{section}.{name}")
