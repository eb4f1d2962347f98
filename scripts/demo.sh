#!/usr/bin/env bash
# Set-up, then the main job: a short training run with tensor, pipeline
# (interleaved) and data parallelism (t = p = d = 2: eight local processes) on
# the shipped Shakespeare corpus with GPT-2's tokenizer (tokenized into the
# user cache on first use), evaluated on held-out works and checkpointed into
# demo-output/; then a sample generated from that checkpoint. Extra arguments
# are passed to `ptdp train` and override examples/demo.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
mkdir -p demo-output
.venv/bin/ptdp train --config examples/demo.yaml "$@"
echo "ptdp: a sample from demo-output/checkpoint:"
exec .venv/bin/ptdp generate --load demo-output/checkpoint --prompt "ROMEO:" --max-new-tokens 48 \
    --temperature 0.8 --top-k 40 --seed 1
