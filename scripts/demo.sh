#!/usr/bin/env bash
# Set-up, then the main job: a small Llama-style model trained on the shipped
# Shakespeare corpus (examples/demo.yaml), evaluated in bits per character on
# held-out works and checkpointed into demo-output/, then a 200-token sample
# from that checkpoint.
#
# Two phases, one run: the first 10 iterations use all three kinds of
# parallelism (t = 2, p = 2 interleaved, d = 2: eight processes) and save a
# checkpoint; the other 290 resume from it under d = 2 (two processes, one
# per core of a laptop), the checkpoint resharded on load. Extra arguments go
# to both `ptdp train` calls and override examples/demo.yaml. loss.png shows
# both phases, iterations 1-300.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
mkdir -p demo-output
# A fresh run: the metrics files are appended to by design (a resumed run adds
# its lines), so the previous demo's go first.
rm -f demo-output/metrics.jsonl demo-output/metrics-3d.jsonl
echo "ptdp demo: iterations 1-10 with tensor, pipeline and data parallelism (8 processes)"
.venv/bin/ptdp train --config examples/demo.yaml --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
    --data-parallel-size 2 --micro-batch-size 4 --exit-interval 10 \
    --metrics-file demo-output/metrics-3d.jsonl "$@"
echo "ptdp demo: iterations 11-300 resumed with data parallelism only (2 processes)"
.venv/bin/ptdp train --config examples/demo.yaml --load demo-output/checkpoint "$@"
# That run drew only its own iterations (11-300) to loss.png: redrawn with
# 1-10 from the first phase, the change of layout marked.
.venv/bin/python scripts/plot_loss_curve.py demo-output/loss.png \
    --phase "t=p=d=2" demo-output/metrics-3d.jsonl --phase "d=2" demo-output/metrics.jsonl
# generate says on stderr what it continues with which model and settings,
# then prints the sample (the prompt and its continuation) on stdout.
echo "ptdp demo: a 200-token sample from the final checkpoint in demo-output/checkpoint"
exec .venv/bin/ptdp generate --load demo-output/checkpoint --prompt "ROMEO:" --max-new-tokens 200 \
    --temperature 0.8 --top-k 40 --seed 1
