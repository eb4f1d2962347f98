"""Supervised fine-tuning on conversations, packed against one conversation
per sequence, on this CPU (issue 40): training throughput, and the
document-masked attention kernel against the dense masked one.

1. Training. A synthetic chat set with a realistic length spread:
   conversation lengths log-normal (the distribution of
   bench/document_attention.py's packs: median about 300 tokens, mean about
   400), clipped to [16, s], so a long tail reaches the sequence length; one
   to three turns each, the user's share of a turn uniform in [0.2, 0.6]
   (about 40% of the tokens are prompt, out of the loss), the assistant's
   replies in the loss. The same conversations become packed sequences
   (first fit, positions restarting and attention kept inside each
   conversation: ptdp.data.sft.packing, as `ptdp train --sft` builds them)
   and one conversation per padded sequence (--no-sft-packing). Two
   Trainers of the same Llama-style model (bench/llama.py's: RMSNorm,
   SwiGLU, rotary, grouped-query attention, untied output), the per-token
   loss on (--sft's default), train on them: forward, backward and AdamW.
   Their steps alternate, the order swapped every other pair, after a
   warm-up pair, so the machine's noise falls on both alike.

   Reported per layout: the padding fraction and the share of the
   positions in the loss (over the whole set), the median step time,
   tokens/s (sequence positions, padding included) and loss tokens/s (the
   loss tokens a second: the share in the loss times tokens/s, i.e. the
   set's loss tokens over the time an epoch of it takes: the useful
   figure); and the ratios packed / unpacked, with the range of the
   per-pair ratios.
2. Attention kernel. At the same s and the model's heads, key/value groups
   and head size, bench/document_attention.py's measurement: one pack of
   conversation-like lengths, the per-document path (what the model runs on
   CPU) against the dense block-diagonal mask, forward + backward and
   forward alone, fp32.

    python bench/packing.py                 # s = 1024, prints the tables
    python bench/packing.py --write         # also appends them to bench/RESULTS.md
    python bench/packing.py --device cuda   # the training part on a GPU (the kernel part stays on CPU)
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import document_attention  # noqa: E402  bench/document_attention.py
import llama  # noqa: E402  bench/llama.py
from results import cpu_name, publish  # noqa: E402

from ptdp.config import Config, DataConfig, ParallelConfig, TrainConfig  # noqa: E402
from ptdp.data.loader import TrainingData  # noqa: E402
from ptdp.data.sft.packing import PackedSequence, PackingStats, pack_conversations  # noqa: E402
from ptdp.data.sft.template import TokenizedConversation  # noqa: E402
from ptdp.parallel.document_attention import DENSE, PER_DOCUMENT  # noqa: E402
from ptdp.parallel.topology import ParallelContext  # noqa: E402
from ptdp.train.loop import Trainer  # noqa: E402

HEADING = ("## Fine-tuning on conversations: packed sequences against one conversation per "
           "sequence, and the document-masked attention kernel (CPU)")
PAD = 0
# Conversation lengths: log-normal, as bench/document_attention.py's pack_lengths draws them.
LOG_MEAN, LOG_STD = 5.7, 0.8
MIN_LENGTH = 16
PACKED, UNPACKED = "packed", "one per sequence"


def chat_set(count: int, seq: int, vocab: int, seed: int) -> list[TokenizedConversation]:
    """`count` conversations of random token ids: log-normal lengths clipped
    to [16, seq], one to three turns, each a user prompt (a share uniform in
    [0.2, 0.6] of the turn, out of the loss) then the assistant's reply (in it)."""
    rng = np.random.default_rng(seed)
    conversations = []
    for _ in range(count):
        n = int(np.clip(rng.lognormal(LOG_MEAN, LOG_STD), MIN_LENGTH, seq))
        turns = int(rng.integers(1, 4))
        bounds = np.linspace(0, n, turns + 1).astype(int)
        mask = np.zeros(n, dtype=np.int8)
        for start, end in zip(bounds[:-1], bounds[1:]):
            prompt = int(round((end - start) * rng.uniform(0.2, 0.6)))
            mask[start + prompt:end] = 1
        conversations.append(TokenizedConversation(
            rng.integers(1, vocab, n).astype(np.int64), mask))
    return conversations


def sample(sequence: PackedSequence, seq: int) -> dict[str, np.ndarray]:
    """An SFT sample as ptdp.data.sft.dataset.SFTDataset gives one (cu_seqlens padded to s + 1)."""
    cu_seqlens = np.full(seq + 1, seq, dtype=np.int32)
    cu_seqlens[:len(sequence.cu_seqlens)] = sequence.cu_seqlens
    return {"tokens": sequence.tokens, "labels": sequence.labels,
            "loss_mask": sequence.loss_mask, "position_ids": sequence.position_ids,
            "document_ids": sequence.document_ids, "cu_seqlens": cu_seqlens}


def trainer(samples: list[dict], steps: int, args: argparse.Namespace) -> Trainer:
    """A Llama-style model training on `samples` in order (cycled to fill `steps` steps)."""
    model = llama.models(args)["Llama-style"]
    config = Config(model=model, parallel=ParallelConfig(),
                    train=TrainConfig(micro_batch_size=args.micro_batch,
                                      global_batch_size=args.batch, train_iters=steps, lr=1e-4,
                                      seed=5, calculate_per_token_loss=True),
                    data=DataConfig(sft=True, data_path=["chat.jsonl"],
                                    tokenizer_type="HuggingFaceTokenizer"))
    needed = steps * args.batch
    cycled = [samples[i % len(samples)] for i in range(needed)]
    return Trainer(config, ParallelContext.single(), torch.device(args.device),
                   data=TrainingData(train=cycled, eod=PAD))


def train_both(args: argparse.Namespace) -> dict:
    """Both layouts of one chat set, their steps alternating: per layout its
    packing statistics, step times and records; and the per-pair ratios."""
    conversations = chat_set(args.conversations, args.seq, args.vocab, args.seed)
    steps = args.warmup + args.pairs
    runs = {}
    for name, packing in ((PACKED, True), (UNPACKED, False)):
        sequences, stats = pack_conversations(conversations, args.seq, PAD, packing=packing)
        runs[name] = {"stats": stats, "sequences": sequences, "times": [], "records": [],
                      "trainer": trainer([sample(s, args.seq) for s in sequences], steps, args)}
    order = [PACKED, UNPACKED]
    for step in range(steps):
        for name in (order if step % 2 == 0 else order[::-1]):
            began = time.perf_counter()
            record, _ = runs[name]["trainer"].step(step)
            seconds = time.perf_counter() - began
            if step >= args.warmup:
                runs[name]["times"].append(seconds)
                runs[name]["records"].append(record)
    for run in runs.values():
        del run["trainer"]
    return {"conversations": conversations, "runs": runs,
            "summary": summarize(runs, args.batch, args.seq)}


def summarize(runs: dict, batch: int, seq: int) -> dict:
    """Per layout: tokens/s and loss tokens/s from the median step; the
    ratios packed / unpacked, of the medians and pair by pair."""
    figures = {}
    for name, run in runs.items():
        stats: PackingStats = run["stats"]
        step = statistics.median(run["times"])
        tokens_per_s = batch * seq / step
        steps_per_epoch = -(-stats.sequences // batch)
        figures[name] = {"step_s": step, "tokens_per_s": tokens_per_s,
                         "loss_tokens_per_s": stats.loss_token_fraction * tokens_per_s,
                         "epoch_s": steps_per_epoch * step}
    packed, unpacked = runs[PACKED], runs[UNPACKED]
    gain = packed["stats"].loss_token_fraction / unpacked["stats"].loss_token_fraction
    pair_ratios = [u / p * gain for p, u in zip(packed["times"], unpacked["times"])]
    return {"figures": figures,
            "tokens_ratio": figures[PACKED]["tokens_per_s"] / figures[UNPACKED]["tokens_per_s"],
            "loss_tokens_ratio": (figures[PACKED]["loss_tokens_per_s"]
                                  / figures[UNPACKED]["loss_tokens_per_s"]),
            "pair_ratios": pair_ratios}


def kernel_comparison(args: argparse.Namespace) -> tuple[argparse.Namespace, list[dict]]:
    """bench/document_attention.py's measurement at each --kernel-seq, with
    the model's attention shape: the shape, and a row per length."""
    shape = argparse.Namespace(heads=args.heads, groups=max(1, args.heads // 4),
                               head_dim=args.hidden // args.heads, pairs=args.kernel_pairs,
                               flex=False)
    return shape, [document_attention.measure(seq, shape) for seq in args.kernel_seq]


def training_table(result: dict) -> list[str]:
    lines = ["| layout | sequences | conversations per sequence | padding | positions in the loss "
             "| step (s) | tokens/s | loss tokens/s | epoch of the set (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in result["runs"].items():
        stats, figures = run["stats"], result["summary"]["figures"][name]
        lines.append(f"| {name} | {stats.sequences} | {stats.conversations / stats.sequences:.2f} "
                     f"| {stats.padding_fraction:.1%} | {stats.loss_token_fraction:.1%} | "
                     f"{figures['step_s']:.2f} | {figures['tokens_per_s']:,.0f} | "
                     f"{figures['loss_tokens_per_s']:,.0f} | {figures['epoch_s']:.0f} |")
    return lines


def kernel_table(rows: list[dict]) -> list[str]:
    lines = ["| s | documents | median length | causal work inside documents | per-document "
             "fwd+bwd (s) | dense fwd+bwd (s) | dense/per-document | per-document fwd (s) | "
             "dense fwd (s) | dense/per-document |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        m = row["median"]
        per_doc, dense = ((m[(PER_DOCUMENT, True)], m[(PER_DOCUMENT, False)]),
                          (m[(DENSE, True)], m[(DENSE, False)]))
        lines.append(f"| {row['seq']} | {row['documents']} | {row['median_length']:.0f} | "
                     f"{row['inside']:.3f} | {per_doc[0]:.4f} | {dense[0]:.4f} | "
                     f"{dense[0] / per_doc[0]:.1f}x | {per_doc[1]:.4f} | {dense[1]:.4f} | "
                     f"{dense[1] / per_doc[1]:.1f}x |")
    return lines


def report(args: argparse.Namespace, result: dict, kernels: tuple, loads: list) -> str:
    lengths = [len(c.ids) for c in result["conversations"]]
    prompt = 1 - sum(int(c.loss_mask.sum()) for c in result["conversations"]) / sum(lengths)
    summary, (shape, kernel_rows) = result["summary"], kernels
    pair_ratios = summary["pair_ratios"]
    device = (f"{cpu_name()}, {torch.get_num_threads()} threads" if args.device == "cpu"
              else f"{torch.cuda.get_device_name()} (training), {cpu_name()} (kernels)")
    load = "; ".join(f"{when} {', '.join(f'{x:.2f}' for x in values)}" for when, values in loads)
    command = "python bench/packing.py" + "".join(
        f" --{key.replace('_', '-')} " + (" ".join(map(str, value)) if isinstance(value, list)
                                          else str(value))
        for key, value in vars(args).items()
        if key != "write" and value != DEFAULTS.get(key)) + (" --write" if args.write else "")
    return "\n".join([
        f"### {datetime.date.today().isoformat()}: s = {args.seq}, Llama-style l = {args.layers}, "
        f"h = {args.hidden}, a = {args.heads} ({shape.groups} key/value groups), V = {args.vocab}, "
        f"b = {args.micro_batch}, B = {args.batch}, fp32, {args.device}",
        "",
        f"Command: `{command}`  ",
        f"torch {torch.__version__}, {device}. Load average (1, 5, 15 min): {load}. "
        f"{len(lengths)} synthetic conversations: length median {statistics.median(lengths):.0f}, "
        f"mean {statistics.mean(lengths):.0f}, 90th percentile "
        f"{np.percentile(lengths, 90):.0f}, longest {max(lengths)} (log-normal, clipped to "
        f"[{MIN_LENGTH}, s]); {prompt:.0%} of their tokens are prompt (out of the loss). "
        f"Training: median of {args.pairs} alternating steps per layout after {args.warmup} "
        f"warm-up; tokens/s counts every sequence position, loss tokens/s the positions in the "
        f"loss (the share over the whole set times tokens/s); 'epoch of the set' is the steps "
        f"that cover every conversation once times the median step.",
        "",
        *training_table(result),
        "",
        f"Packed / one per sequence: tokens/s **{summary['tokens_ratio']:.2f}x**, loss tokens/s "
        f"**{summary['loss_tokens_ratio']:.2f}x** (pair by pair: median "
        f"{statistics.median(pair_ratios):.2f}x, from {min(pair_ratios):.2f}x to "
        f"{max(pair_ratios):.2f}x).",
        "",
        f"Attention kernel in the model's shape (b = 1, {shape.heads} heads, {shape.groups} "
        f"key/value groups, head size {shape.head_dim}, fp32, CPU), bench/document_attention.py's "
        f"measurement: per s one pack of conversation-like lengths (its own draw from the same "
        f"distribution), median seconds per call over {shape.pairs} alternating pairs:",
        "",
        *kernel_table(kernel_rows),
        "",
    ])


DEFAULTS: dict = {}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8, help="query heads; key/value groups a/4")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--pairs", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per layout first")
    parser.add_argument("--kernel-seq", type=int, nargs="+", default=[1024, 2048],
                        help="pack lengths of the kernel comparison")
    parser.add_argument("--kernel-pairs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--device", default="cpu", help="where the training part runs")
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    DEFAULTS.update(vars(parser.parse_args([])))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    loads = [("before", os.getloadavg())]
    result = train_both(args)
    loads.append(("after training", os.getloadavg()))
    kernels = kernel_comparison(args)
    loads.append(("after the kernels", os.getloadavg()))
    publish(HEADING, report(args, result, kernels, loads), write=args.write)


if __name__ == "__main__":
    sys.exit(main())
