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

The two kinds of flags exclude each other (as in Megatron-LM). Under zbv,
whose rank 0 holds both the first and the last virtual stage, only the
accounting flags are defined. Layer indices stay global, so parameter names,
and with them checkpoints, are the same under every split.

LayerSplit and `split_problems` (why a split cannot cut a model's layers) are
the configuration's (ptdp.config.layer_split), which checks them before any
process starts; they are re-exported here. This module computes what each
stage builds.
"""

from __future__ import annotations

from ptdp.config.layer_split import EVEN, LayerSplit, split_problems  # noqa: F401 (re-exported)
from ptdp.parallel.pipeline.actions import location_of


def stage_layer_counts(num_layers: int, p: int, v: int, kind: str,
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
