"""Optimizer-state bytes per rank, plain vs distributed optimizer, d = 1, 2, 4.

Measured from the tensors each rank's optimizer holds after one training
step (fp32 main weights and the two Adam moments), not computed from a
formula. bf16 model, so the main weights are a copy in both cases.

    .venv/bin/python bench/optimizer_state.py [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

from results import publish  # bench/results.py: the script folder is on sys.path

from ptdp.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from ptdp.distributed import init_process_group
from ptdp.launch import launch_local
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.loop import Trainer

MODEL = ModelConfig(num_layers=6, hidden_size=512, num_attention_heads=8, seq_length=128,
                    vocab_size=50257, hidden_dropout=0.0, attention_dropout=0.0)


def _measure(env, payload):
    d, distributed, out_dir = payload
    torch.set_num_threads(1)
    init_process_group(env, "gloo", timedelta(minutes=10))
    ctx = ParallelContext.build(RankGrid(tp=1, dp=d, pp=1))
    config = Config(model=MODEL, parallel=ParallelConfig(data_parallel_size=d),
                    train=TrainConfig(micro_batch_size=1, global_batch_size=d, bf16=True,
                                      use_distributed_optimizer=distributed),
                    data=DataConfig(mock_data=True))
    trainer = Trainer(config, ctx, torch.device("cpu"))
    trainer.step(0)
    Path(out_dir, f"{env.rank}.json").write_text(json.dumps({
        "state_bytes": trainer.optimizer.state_bytes, "params": trainer.buffer.numel}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    rows = []
    for d in (1, 2, 4):
        for distributed in (False, True):
            with tempfile.TemporaryDirectory() as out:
                launch_local(d, _measure, (d, distributed, out))
                ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(d)]
            rows.append((d, distributed, max(r["state_bytes"] for r in ranks), ranks[0]["params"]))
    plain_d1 = rows[0][2]
    lines = [f"### {datetime.date.today()}", "",
             f"Command: `{' '.join(['python', Path(sys.argv[0]).as_posix()] + sys.argv[1:])}` — GPT 6 × 512, vocab 50257 "
             f"({rows[0][3] / 1e6:.1f} M parameters), bf16 model, fp32 main weights + Adam moments",
             "", "| d | optimizer | state bytes per rank | vs plain d = 1 |", "|---|---|---|---|"]
    for d, distributed, state, _ in rows:
        kind = "distributed" if distributed else "plain"
        lines.append(f"| {d} | {kind} | {state / 2**20:.1f} MiB | {state / plain_d1:.3f} |")
    table = "\n".join(lines) + "\n"
    publish("## Optimizer state per rank", table, write=args.write)


if __name__ == "__main__":
    main()
