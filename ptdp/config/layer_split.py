"""How the transformer layers are split over the pipeline's stages, as the
parallel section's settings give it (--decoder-first/last-pipeline-num-layers,
--account-for-embedding/loss-in-pipeline-split), and why a split cannot cut a
model's layers. What each stage then builds is ptdp.parallel.pipeline.split's
(which re-exports these names); they live here, below the parallel package,
because the configuration's checks need them."""

from __future__ import annotations

from dataclasses import dataclass


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


def split_problems(num_layers: int, p: int, v: int, kind: str, split: LayerSplit) -> list[str]:
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
    if kind == "zbv":
        return ["--decoder-first/last-pipeline-num-layers are not defined under zbv, whose rank 0 "
                "holds both the first and the last stage of the V: use "
                "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split"]
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
