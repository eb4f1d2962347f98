"""How the transformer layers are split over the pipeline's virtual stages.

By default evenly: l/(p·v) layers per virtual stage. The first stage also
computes the embedding and the last the output layer and the loss, which in
a small-width, large-vocabulary model can cost several layers (bench/peers.py's
GPT: the output layer about 2.7 layers), so Megatron-LM's flags can move
layers away from them:

- `--decoder-first-pipeline-num-layers N` / `--decoder-last-pipeline-num-layers N`:
  the first (last) pipeline rank holds N layers, the other ranks split the
  rest evenly. With v > 1 chunks per rank (interleaved) each rank's layers
  are split evenly over its chunks, as in Megatron-LM.
- `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`:
  the embedding (the output layer with the loss) counts as one layer: the
  l + 1 (+ 1) "layers" split evenly over the p·v virtual stages, and the
  first (last) virtual stage builds one transformer layer fewer.

The two kinds of flags exclude each other (as in Megatron-LM). Under the V
placement, whose rank 0 holds both the first and the last virtual stage,
only the accounting flags are defined. Layer indices stay global, so
parameter names, and with them checkpoints, are the same under every split.

LayerSplit is what the parallel section's settings give
(ptdp.config.parallel's layer_split); `split_problems` is why a split cannot
cut a model's layers, which the configuration's checks ask before any
process starts; `stage_layer_counts` is what each stage then builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.schedules.actions import V_SHAPE
from ptdp.schedules.kinds import location_of, placement_of


@dataclass(frozen=True)
class LayerSplit:
    first: int | None = None        # layers on the first pipeline rank
    last: int | None = None         # layers on the last pipeline rank
    embedding: bool = False         # count the embedding as a layer
    loss: bool = False              # count the output layer and loss as a layer

    @property
    def even(self) -> bool:
        return self == LayerSplit()

    def flags(self) -> list[str]:
        """The `ptdp train` flags that give this split."""
        out = []
        if self.first is not None:
            out += ["--decoder-first-pipeline-num-layers", str(self.first)]
        if self.last is not None:
            out += ["--decoder-last-pipeline-num-layers", str(self.last)]
        if self.embedding:
            out.append("--account-for-embedding-in-pipeline-split")
        if self.loss:
            out.append("--account-for-loss-in-pipeline-split")
        return out


EVEN = LayerSplit()


def split_problems(num_layers: int, p: int, v: int, kind: str | None,
                   split: LayerSplit) -> list[str]:
    """Why `split` cannot cut `num_layers` layers over p ranks × v chunks
    (empty when it can); each message names the flag and a valid value."""
    if split.even:
        return []
    l, stages = num_layers, p * v
    if (split.first is not None or split.last is not None) and (split.embedding or split.loss):
        return ["--decoder-first/last-pipeline-num-layers cannot be combined with "
                "--account-for-embedding/loss-in-pipeline-split (as in Megatron-LM): use one kind"]
    if split.embedding or split.loss:
        total = l + split.embedding + split.loss
        if total % stages:
            return [f"with {_accounted(split)} counted as layers, {l} + {total - l} = {total} "
                    f"must split evenly over the {stages} virtual stages (p·v): use --num-layers "
                    f"{_next_multiple(total, stages) - (total - l)}"]
        return []
    if placement_of(kind) is V_SHAPE:
        return [f"--decoder-first/last-pipeline-num-layers are not defined under {kind}, whose "
                f"rank 0 holds both the first and the last stage of the V: use "
                f"--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split"]
    if p < 2:
        return ["--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size >= 2 "
                "(with one stage there is nothing to balance)"]
    problems = []
    rest, middle = l, p
    for name, value in (("first", split.first), ("last", split.last)):
        if value is None:
            continue
        if value < 1:
            problems.append(f"--decoder-{name}-pipeline-num-layers {value} must be at least 1")
        elif value % v:
            problems.append(f"--decoder-{name}-pipeline-num-layers {value} must divide into the "
                            f"{v} chunks of that rank: use a multiple of {v}")
        rest -= value
        middle -= 1
    if problems:
        return problems
    fixed = l - rest
    if rest < 0 or (middle == 0 and rest != 0):
        return [f"--decoder-first/last-pipeline-num-layers give {fixed} layers to the first and "
                f"last rank, but the model has {l}" + ("" if middle else
                                                        f": they must add up to {l}")]
    if middle and (rest == 0 or rest % (middle * v)):
        options = sorted({fixed_n for fixed_n in range(v, l, v)
                          if (l - fixed_n) > 0 and (l - fixed_n) % (middle * v) == 0})[:6]
        return [f"the {rest} layers left after --decoder-first/last-pipeline-num-layers must split "
                f"evenly over the {middle} other rank(s) × {v} chunk(s)"
                + (f": the first and last rank together could hold {options}" if options else "")]
    return []


def _accounted(split: LayerSplit) -> str:
    return " and ".join(name for name, on in (("the embedding", split.embedding),
                                              ("the output layer with the loss", split.loss)) if on)


def _next_multiple(n: int, k: int) -> int:
    return -(-n // k) * k


def stage_layer_counts(num_layers: int, p: int, v: int, kind: str | None,
                       split: LayerSplit = EVEN) -> list[int]:
    """Layers of each virtual stage, in stage order (split already checked)."""
    stages = p * v
    if split.first is None and split.last is None:
        total = num_layers + split.embedding + split.loss
        counts = [total // stages] * stages
        counts[0] -= split.embedding
        counts[-1] -= split.loss
        return counts
    rest, middle = num_layers, p
    for value in (split.first, split.last):
        if value is not None:
            rest -= value
            middle -= 1
    per_rank = [rest // middle if middle else 0] * p
    if split.first is not None:
        per_rank[0] = split.first
    if split.last is not None:
        per_rank[-1] = split.last
    return [per_rank[location_of(kind, p, v, stage)[0]] // v for stage in range(stages)]
