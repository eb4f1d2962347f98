#!/usr/bin/env bash
# Everything a session lent one GPU measures, in one run, in the order the
# project asks for: the one-GPU benchmark with its kernel sweep, the GPU
# profile fitted to that sweep, then ptdp against Megatron-Core on the GPU.
# Each step has its own time limit so that a stuck step leaves the others
# their time; everything lands in $OUT (default bench/gpu-session), with
# bench/RESULTS.md as the steps appended to it.
#
#   OUT=/some/dir bash bench/gpu_session.sh
#
# Megatron-Core comes from bench/.megatron-core (`python bench/megatron_peers.py
# --install` on a machine with the package registry; carry that folder along).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/gpu-session}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$card" in
  *H100*) profile=h100 ;;
  *) profile=h200 ;;
esac
{ date -u; nvidia-smi; uptime; } > "$OUT/machine.txt" 2>&1

step() {  # step NAME SECONDS COMMAND...: run, log, and say how it ended
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
}

step gpu 420 "$PYTHON" bench/gpu.py --write --json "$OUT/gpu.json" --time-budget 360
if [ -s "$OUT/gpu.json" ]; then
  step fit_profile 60 "$PYTHON" bench/fit_gpu_profile.py "$OUT/gpu.json" --profile "$profile" \
    --out "$OUT/profile-$profile.json"
fi
step megatron_peers 180 "$PYTHON" bench/megatron_peers.py --device cuda --iters 6 --write \
  --json "$OUT/megatron_peers.json"
cp bench/RESULTS.md "$OUT/RESULTS.md"
uptime >> "$OUT/machine.txt"
cat "$OUT/steps.txt"
