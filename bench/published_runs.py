"""The planner against published training runs, and how fast it searches.

1. A validation table, not a fit: every published throughput figure of a
   Megatron-LM / NeMo run that could be found (A100 and H100; sources with
   commit or paper table in `RUNS`) is priced by ptdp's performance model
   on the row's own layout, exactly as published (one layout, as
   `ptdp plan --fix-all` prices it), and its predicted TFLOP/s per GPU is
   set against the published one: error = predicted / published - 1.
   Only the paper's 1.7B row is a calibration point (the a100 profile's
   e_max is fitted to it, ptdp/perf/calibrate/calibration_point.py; the h100's is
   fitted to a measured matmul, not to a run); nothing is tuned to any
   other row. After them, ptdp's own runs on one H200 (bench/gpu.py) against
   the same model (`OWN_RUNS`). Rows the model cannot price (FP8, FSDP, DeepEP,
   architectures ptdp does not train, layouts ptdp cannot express, hardware
   without a profile) are listed as out of scope with the reason, none
   dropped.

   FLOP conventions, compared like with like: "paper" rows count the
   recomputed forward (Narayanan et al. 2021: 96·B·s·l·h²·(1 + s/6h +
   V/16lh) with full recomputation, which is ptdp's own count,
   ptdp.perf.analytic.flops); "model" rows count no recomputation (Megatron-Core's
   num_floating_point_operations, Korthikanti et al.'s MFU and the DGX Cloud
   recipes' formula seq·(12·l·h²·(1 + g/a + s/h) + 18·l·f·h + 6·V·h), all
   equal to ptdp.perf.analytic.flops with recompute=None). The predicted figure is
   the row's FLOPs over the predicted iteration time.
   Software: Megatron-LM of 2021-2022 ran attention as two GEMMs around a
   softmax pass (calibration_point.paper_kernels), and reduced gradients
   either in buckets during the backward (PyTorch's DDP: the paper's 1.7B
   to 18B runs) or after it (its local DDP: the larger ones), as each row's
   run script says; later runs use flash attention (the profile's own
   kernels) and reduce gradient buckets during the backward, as ptdp does. Where a source states overlaps ptdp does not run (the
   parameter all-gather under the next forward, TP collectives pipelined
   with GEMMs) the row is priced with them (`PublishedRun.overlaps`,
   HardwareProfile's software fields) and says so.

2. The README's planner example (39B GPT on 64 A100s, B = 512): the search's
   time, and the exhaustive search's (every layout priced) with its winner,
   which must be the same.

    python bench/published_runs.py                    # the table and both searches (minutes)
    python bench/published_runs.py --no-exhaustive    # the table and the search's time
    python bench/published_runs.py --rows 1.7B,1T --no-search   # some rows only
    python bench/published_runs.py --write            # and append to bench/RESULTS.md,
                                                      # the table in docs/planner.md
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results import cpu_name, publish  # noqa: E402  bench/results.py

from ptdp.config import ModelConfig  # noqa: E402
from ptdp.perf.calibrate.calibration_point import (  # noqa: E402
    KORTHIKANTI_LAYER, KORTHIKANTI_LAYER_MS, korthikanti_layer_ms, paper_kernels,
    selective_overhead_ms)
from ptdp.perf.analytic.flops import model_flops_per_iteration  # noqa: E402
from ptdp.perf.layout import Layout, Workload  # noqa: E402
from ptdp.perf.plan.planner import MEMORY_HEADROOM, describe, evaluate_layout, search  # noqa: E402
from ptdp.perf.price.profiles import (  # noqa: E402
    CALIBRATED_GEMM_EFFICIENCY, HOPPER_ATTENTION_EFFICIENCY, PAPER_ATTENTION_CORE_FRACTION,
    load_profile)

HEADING = "## The planner against published runs"
NOT_STATED = "not stated"
PROFILES = ("a100", "h100")          # ptdp/perf/price/profiles.py's names; other hardware is out of scope
A100_PEAK, H100_PEAK, H100_FP8_PEAK = 312.0, 989.0, 1979.0   # TFLOP/s, as the sources divide by


@dataclass(frozen=True)
class Shape:
    """The model as ptdp's ModelConfig takes it (GPT rows: LayerNorm, GeLU
    MLP of 4h, learned positions, tied embedding; Llama rows: RMSNorm,
    SwiGLU, rope, untied, no biases, GQA)."""
    layers: int
    hidden: int
    heads: int
    groups: int            # key/value heads (= heads without GQA)
    ffn: int
    vocab: int
    seq: int
    swiglu: bool = False
    rmsnorm: bool = False
    rope: bool = False
    untied: bool = False
    # Further ModelConfig settings on top of the option set (Qwen3: head
    # size, q/k norms; mixtures of experts), as (name, value) pairs.
    extra: tuple[tuple[str, Any], ...] = ()

    def config(self) -> ModelConfig:
        llama = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                     untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                     hidden_dropout=0.0, attention_dropout=0.0)
        options = llama if self.swiglu else {}
        if (self.rmsnorm, self.rope, self.untied) != (self.swiglu,) * 3:
            raise ValueError(f"{self}: only the GPT and Llama option sets are tabled")
        if self.groups != self.heads:
            options.update(group_query_attention=True, num_query_groups=self.groups)
        return ModelConfig(num_layers=self.layers, hidden_size=self.hidden,
                           num_attention_heads=self.heads, ffn_hidden_size=self.ffn,
                           seq_length=self.seq, vocab_size=self.vocab, **options,
                           **dict(self.extra))

    def text(self) -> str:
        gqa = f" g={self.groups}" if self.groups != self.heads else ""
        arch = " SwiGLU RMSNorm rope untied" if self.swiglu else ""
        extra = dict(self.extra)
        experts = (f" E={extra['num_experts']} k={extra['moe_router_topk']} "
                   f"F={extra['moe_ffn_hidden_size']}" if extra.get("num_experts") else "")
        heads = f" d={extra['kv_channels']}" if extra.get("kv_channels") else ""
        qk = " qk-norm" if extra.get("qk_layernorm") else ""
        ffn = "" if experts else f" f={self.ffn}"
        return (f"l={self.layers} h={self.hidden} a={self.heads}{gqa}{heads}{ffn}{experts} "
                f"V={self.vocab} s={self.seq}{arch}{qk}")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its model, layout and throughput as the source gives
    them. Fields a source leaves open hold NOT_STATED (out-of-scope rows) or a
    value named in `assumptions` (priced rows)."""
    name: str
    source: str                       # repo + commit + path, or paper + table
    hardware: str                     # a ptdp profile (a100, h100) or the published system
    model: str
    shape: Shape | str                # a description where ptdp has no shape for it
    gpus: int
    global_batch: int
    micro_batch: int
    t: int
    p: int
    v: int
    c: int
    d: int                            # gpus / (t·p·c); the FSDP shards of FSDP rows
    ep: int
    etp: int | str                    # "n/a" for dense models
    recompute: str                    # "none", "selective", "full" or NOT_STATED
    sequence_parallel: bool | str
    distributed_optimizer: bool | str
    precision: str                    # fp16, bf16, fp8
    published_tflops: float           # per GPU
    published_as: str                 # "published", or how it is derived from what is
    flops: str                        # "paper" (recomputation counted), "model" (none), NOT_STATED
    kernels: str                      # "paper" (attention as GEMMs + softmax) or "flash"
    # The source's own model FLOPs per sequence where it states a number
    # (the DGX Cloud READMEs; their MFU divides by it); 0: the source's
    # formula, which ptdp.perf.analytic.flops computes.
    flops_per_sequence: float = 0.0
    assumptions: str = ""             # recalled / assumed fields, pricing assumptions
    # The run's communication overlaps that ptdp does not run, priced as the
    # source states them (HardwareProfile's software fields): "param gather"
    # (--overlap-param-gather), "tp comm" (--tp-comm-overlap).
    overlaps: tuple[str, ...] = ()
    # True where the run reduced its gradients only after the backward
    # (Megatron-LM's local DDP); False: buckets during the backward, as
    # ptdp and PyTorch's DistributedDataParallel do.
    gradients_after_backward: bool = False
    # The optimizer step in fused multi-tensor kernels, as Megatron-LM and
    # NeMo run it (apex's or Transformer Engine's Adam); False: a PyTorch
    # optimizer's element-wise passes, priced as ptdp's.
    fused_optimizer: bool = True
    # Full recomputation rerunning each layer's whole forward, as Megatron-LM's
    # and Megatron-Core's re-entrant checkpoint function does; False: PyTorch's
    # non-re-entrant checkpoint (AutoModel's, ptdp's), which stops once every
    # saved tensor is rebuilt.
    recompute_whole_layer: bool = True
    out_of_scope: str = ""            # the reason it is not priced; "" = priced
    calibration: bool = False         # the one point a constant is fitted to

    @property
    def priced(self) -> bool:
        return not self.out_of_scope

    def layout(self) -> Layout:
        return Layout(t=self.t, p=self.p, d=self.d, b=self.micro_batch, v=self.v, c=self.c,
                      ep=self.ep, etp=self.etp if isinstance(self.etp, int) else None,
                      recompute=None if self.recompute == "none" else self.recompute,
                      sequence_parallel=self.sequence_parallel is True,
                      distributed_optimizer=self.distributed_optimizer is True)

    def layout_text(self) -> str:
        parts = [f"t={self.t} p={self.p}"]
        parts += [f"v={self.v}"] if self.v > 1 else []
        parts += [f"c={self.c}"] if self.c > 1 else []
        parts += [f"EP={self.ep} ETP={self.etp}"] if self.ep > 1 or self.etp != "n/a" else []
        parts += [f"d={self.d} b={self.micro_batch} B={self.global_batch}",
                  f"recompute={self.recompute}"]
        parts += ["SP"] if self.sequence_parallel is True else []
        parts += ["dist-opt"] if self.distributed_optimizer is True else []
        return " ".join(parts) + f", {self.precision}"


# --- the rows -------------------------------------------------------------------------------

MEGATRON_2022 = "Megatron-LM fd5cfec0 README.md"
A100_TABLE = "Megatron-LM fd5cfec0 images/cases_april2021.png (Narayanan et al. 2021, Table 1)"
SC21_SCRIPT = "Megatron-LM d98e8a64 examples/academic_paper_scripts/sc21/run_table_1.sh"
H100_TABLE = "Megatron-LM d98e8a64 images/model_table.png (Megatron-Core r0.8.0)"
KORTHIKANTI = ("Korthikanti et al. 2022 (arXiv 2205.05198); MFU: " + MEGATRON_2022
               + "; config RECALLED (Table 3)")
DGXC = "NVIDIA/dgxc-benchmarking {commit} llama3.1/{path} ({release}, NeMo {container})"
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge 067f987d docs/performance-summary-archive.md ({release})"

LLAMA = {"8B": Shape(32, 4096, 32, 8, 14336, 128256, 8192, True, True, True, True),
         "70B": Shape(80, 8192, 64, 8, 28672, 128256, 8192, True, True, True, True),
         "405B": Shape(126, 16384, 128, 8, 53248, 128256, 8192, True, True, True, True)}


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> Shape:
    return Shape(layers, hidden, heads, heads, 4 * hidden, vocab, seq)


def _a100_2021() -> list[PublishedRun]:
    """Narayanan et al. 2021's weak-scaling table (fp16, full recomputation,
    the paper's FLOPs). Each row's layout is its run script's: t, p, b, the
    global batch and the layers per virtual stage of Megatron-LM's
    examples/academic_paper_scripts/sc21/run_table_1.sh (full recomputation
    of every layer: --activations-checkpoint-method uniform)."""
    # name: (hidden, layers, heads, t, p, b, v, GPUs, batch, TFLOP/s, the script's DDP)
    table = {"1.7B": (2304, 24, 24, 1, 1, 16, 1, 32, 512, 137, "torch"),
             "3.6B": (3072, 30, 32, 2, 1, 16, 1, 64, 512, 138, "torch"),
             "7.5B": (4096, 36, 32, 4, 1, 16, 1, 128, 512, 142, "torch"),
             "18B": (6144, 40, 48, 8, 1, 8, 1, 256, 1024, 135, "torch"),
             "39B": (8192, 48, 64, 8, 2, 4, 1, 512, 1536, 138, "local"),
             "76B": (10240, 60, 80, 8, 4, 2, 3, 1024, 1792, 140, "local"),
             "145B": (12288, 80, 96, 8, 8, 2, 2, 1536, 2304, 148, "local"),
             "310B": (16384, 96, 128, 8, 16, 1, 2, 1920, 2160, 155, "local"),
             "530B": (20480, 105, 128, 8, 35, 1, 3, 2520, 2520, 163, "local"),
             "1T": (25600, 128, 160, 8, 64, 1, 1, 3072, 3072, 163, "local")}
    rows = []
    for name, (hidden, layers, heads, t, p, b, v, gpus, batch, tflops, ddp) in table.items():
        calibration = name == "1.7B"
        reduction = ("DDP=torch: gradient buckets during the backward" if ddp == "torch" else
                     "DDP=local: gradients reduced after the backward")
        assumed = ("the calibration point (e_max fitted here); " + reduction if calibration else
                   "layout and " + reduction + " from run_table_1.sh (" + SC21_SCRIPT + ")")
        rows.append(PublishedRun(
            name=f"{name} A100 2021", source=A100_TABLE, hardware="a100", model="GPT",
            shape=_gpt(layers, hidden, heads, 51200, 2048), gpus=gpus, global_batch=batch,
            micro_batch=b, t=t, p=p, v=v, c=1,
            d=gpus // (t * p), ep=1, etp="n/a", recompute="full", sequence_parallel=False,
            distributed_optimizer=False, precision="fp16", published_tflops=tflops,
            published_as="published", flops="paper", kernels="paper", assumptions=assumed,
            gradients_after_backward=ddp == "local", calibration=calibration))
    rows.append(PublishedRun(
        name="175B A100 README example", source=MEGATRON_2022 + " (GPT-3 175B example)",
        hardware="a100", model="GPT", shape=_gpt(96, 12288, 96, 51200, 2048), gpus=1024,
        global_batch=1536, micro_batch=1, t=8, p=16, v=1, c=1, d=8, ep=1, etp="n/a",
        recompute="full", sequence_parallel=False, distributed_optimizer=False, precision="fp16",
        published_tflops=138, published_as="published", flops="paper", kernels="paper",
        assumptions="b = 1, full recomputation, the paper's FLOP count assumed (the README "
                    "states t, p, B); v = 1; gradients reduced after the backward assumed "
                    "(Megatron-LM's local DDP, its default then)",
        gradients_after_backward=True))
    return rows


def _korthikanti() -> list[PublishedRun]:
    """Sequence parallelism with selective recomputation on A100 (bf16), data
    parallel size one; MFU verified, configs recalled (notes E.2)."""
    # name: (heads, hidden, layers, t, p, GPUs, batch, micro batch, MFU)
    table = {"22B": (64, 6144, 48, 8, 1, 8, 4, 4, 0.415),
             "175B": (96, 12288, 96, 8, 8, 64, 64, 1, 0.514),
             "530B": (128, 20480, 105, 8, 35, 280, 280, 1, 0.560),
             "1T": (160, 25600, 128, 8, 64, 512, 512, 1, 0.563)}
    rows = []
    for name, (heads, hidden, layers, t, p, gpus, batch, b, mfu) in table.items():
        rows.append(PublishedRun(
            name=f"{name} SP+selective A100 2022", source=KORTHIKANTI, hardware="a100",
            model="GPT", shape=_gpt(layers, hidden, heads, 51200, 2048), gpus=gpus,
            global_batch=batch, micro_batch=b, t=t, p=p, v=1, c=1, d=gpus // (t * p), ep=1,
            etp="n/a", recompute="selective", sequence_parallel=True,
            distributed_optimizer=False, precision="bf16", published_tflops=round(mfu * A100_PEAK, 1),
            published_as=f"derived: MFU {mfu:.1%} × {A100_PEAK:g}", flops="model", kernels="paper",
            assumptions="unverified config: heads, t, p, batch and micro batch recalled, not "
                        "checked against the paper; v = 1 (interleaving not stated); bf16 assumed; "
                        "gradients reduced after the backward assumed (local DDP, Megatron-LM's "
                        "default then)",
            gradients_after_backward=True))
    rows.append(PublishedRun(
        name="530B SP+selective A100 2022 2240 GPUs",
        source="Korthikanti et al. 2022 abstract (MLSys 2023); config RECALLED", hardware="a100",
        model="GPT", shape=_gpt(105, 20480, 128, 51200, 2048), gpus=2240, global_batch=2240,
        micro_batch=1, t=8, p=35, v=1, c=1, d=8, ep=1, etp="n/a", recompute="selective",
        sequence_parallel=True, distributed_optimizer=False, precision="bf16",
        published_tflops=round(0.542 * A100_PEAK, 1),
        published_as=f"derived: MFU 54.2% × {A100_PEAK:g}", flops="model", kernels="paper",
        assumptions="unverified config: t, p recalled; global batch assumed 8 × the d = 1 "
                    "row's; v = 1; bf16 assumed; gradients reduced after the backward assumed "
                    "(local DDP, Megatron-LM's default then)",
        gradients_after_backward=True))
    return rows


def _h100_2024() -> list[PublishedRun]:
    """Megatron-Core r0.8.0's H100 weak scaling (d = 48, V = 131072, s = 4096)."""
    # name: (heads, hidden, layers, t, p, GPUs, batch, TFLOP/s)
    table = {"1.7B": (16, 2048, 24, 1, 1, 48, 192, 408.8), "7.1B": (32, 4096, 30, 2, 1, 96, 192, 465.9),
             "16B": (48, 6144, 32, 4, 1, 192, 192, 489.1), "32B": (56, 7168, 48, 8, 1, 384, 192, 459.6),
             "70B": (64, 8192, 84, 8, 2, 768, 384, 419.7),
             "119B": (80, 10240, 92, 8, 4, 1536, 768, 420.5),
             "177B": (96, 12288, 96, 8, 6, 2304, 1152, 432.8),
             "314B": (128, 16384, 96, 8, 8, 3072, 1536, 474.4),
             "462B": (144, 18432, 112, 8, 16, 6144, 3072, 459.9)}
    rows = []
    for name, (heads, hidden, layers, t, p, gpus, batch, tflops) in table.items():
        rows.append(PublishedRun(
            name=f"{name} H100 2024", source=H100_TABLE, hardware="h100", model="GPT",
            shape=_gpt(layers, hidden, heads, 131072, 4096), gpus=gpus, global_batch=batch,
            micro_batch=1, t=t, p=p, v=1, c=1, d=48, ep=1, etp="n/a", recompute="selective",
            sequence_parallel=t > 1, distributed_optimizer=True, precision="bf16",
            published_tflops=tflops, published_as="published", flops="model", kernels="flash",
            overlaps=("param gather", "tp comm") if t > 1 else ("param gather",),
            assumptions="b = 1, SP, distributed optimizer, selective recomputation, v = 1 "
                        "assumed (not in the README); the README's benchmark configuration "
                        "overlaps the gradient reduction and the parameter all-gather with "
                        "compute, and the TP collectives with GEMMs: priced so"))
    return rows


def _dgxc() -> list[PublishedRun]:
    """DGX Cloud Llama 3.1 BF16 (no recomputation, distributed optimizer; the
    largest GPU count of each model and container), and the FP8 rows beside
    them (out of scope)."""
    releases = {"24.09": dict(commit="35a9aec", release="v24.11.1", container="24.09"),
                "24.12": dict(commit="8f5cbb3", release="v25.02", container="24.12"),
                "25.02": dict(commit="741c886", release="v25.04", container="25.02.01"),
                "25.04": dict(commit="60d6fd3", release="v25.05.01", container="25.04.01")}
    # (model, container, GPUs, GBS, t, p, c, v, BF16 MFU, FP8 MFU)
    table = [("8B", "24.09", 128, 2048, 1, 1, 2, 1, 0.5851, 0.3902),
             ("8B", "24.12", 128, 2048, 1, 1, 2, 1, 0.5828, 0.3941),
             ("8B", "25.02", 128, 2048, 1, 1, 2, 1, 0.6216, 0.4017),
             ("70B", "24.09", 2048, 4096, 4, 4, 2, 5, 0.5338, 0.3496),
             ("70B", "24.12", 2048, 4096, 4, 4, 2, 5, 0.5368, 0.3623),
             ("70B", "25.02", 2048, 4096, 4, 4, 2, 5, 0.5432, None),
             ("405B", "24.09", 2304, 1008, 8, 9, 2, 7, 0.5445, 0.3887),
             ("405B", "24.12", 2304, 1008, 8, 9, 2, 7, 0.5423, 0.4283),
             ("405B", "25.02", 2048, 1024, 8, 8, 2, 8, 0.5522, 0.4368),
             ("405B", "25.04", 512, 256, 8, 8, 2, 8, 0.5534, 0.4212)]
    rows = []
    for model, container, gpus, batch, t, p, c, v, bf16, fp8 in table:
        info = releases[container]
        path = "README.md" if container in ("25.02", "25.04") else f"README_{model.lower()}.md"
        source = DGXC.format(path=path, **info)
        shape = LLAMA[model]
        uneven = shape.layers % (p * v) != 0
        stated = {"8B": 4.74e14, "70B": 3.94e15, "405B": 2.17e16}[model]   # README "Notes"
        common = dict(source=source, hardware="h100", model=f"Llama 3.1 {model}", shape=shape,
                      gpus=gpus, global_batch=batch, micro_batch=1, t=t, p=p, v=v, c=c,
                      d=gpus // (t * p * c), ep=1, etp="n/a", recompute="none",
                      sequence_parallel=t > 1, distributed_optimizer=True, flops="model",
                      kernels="flash", flops_per_sequence=stated,
                      overlaps=("param gather", "tp comm") if t > 1 else ("param gather",))
        overlap = ("the recipe overlaps the gradient reduction and the parameter all-gather "
                   "(overlap_grad_sync, overlap_param_sync) and the TP collectives with GEMMs "
                   "(ub_tp_comm_overlap): priced so" if t > 1 else
                   "the recipe overlaps the gradient reduction and the parameter all-gather "
                   "(overlap_grad_sync, overlap_param_sync): priced so")
        rows.append(PublishedRun(
            name=f"Llama 3.1 {model} H100 BF16 {gpus} GPUs NeMo {container}", precision="bf16",
            published_tflops=round(bf16 * H100_PEAK, 1),
            published_as=f"derived: MFU {bf16:.2%} × {H100_PEAK:g}", assumptions=overlap,
            out_of_scope=(f"layout ptdp cannot express: {shape.layers} layers over p·v = "
                          f"{p * v} virtual stages (Megatron's uneven interleaved split; ptdp's "
                          f"interleaved schedule needs p·v to divide l)") if uneven else "",
            **common))
        if fp8 is not None:
            rows.append(PublishedRun(
                name=f"Llama 3.1 {model} H100 FP8 {gpus} GPUs NeMo {container}", precision="fp8",
                published_tflops=round(fp8 * H100_FP8_PEAK, 1),
                published_as=f"derived: MFU {fp8:.2%} × {H100_FP8_PEAK:g} (FP8 peak)",
                out_of_scope="FP8", **common))
    return rows


def _bridge() -> list[PublishedRun]:
    """Megatron-Bridge's DGX-H100 summaries: every row FP8 or GPT-OSS."""
    # (release, model, GPUs, precision, GBS, MBS, seq, FSDP, TP, PP, CP, VP, EP, TFLOP/s)
    table = [("25.09", "LLAMA3_8B", 8, "fp8", 128, 1, 8192, 8, 1, 1, 1, 1, 1, 725),
             ("25.09", "LLAMA3_70B", 64, "fp8", 128, 1, 8192, 0, 4, 8, 1, 5, 1, 727),
             ("25.09", "LLAMA3.1_405B", 1024, "fp8", 512, 1, 8192, 0, 8, 8, 2, 8, 1, 763),
             ("25.11", "LLAMA3_8B", 8, "fp8", 128, 1, 8192, 8, 1, 1, 1, 1, 1, 744),
             ("25.11", "LLAMA3_70B", 64, "fp8", 128, 1, 8192, 0, 4, 8, 1, 5, 1, 719),
             ("25.11", "LLAMA3.1_405B", 1024, "fp8", 512, 1, 8192, 0, 8, 8, 2, 8, 1, 737),
             ("26.02", "LLAMA3_70B", 64, "fp8", 256, 1, 8192, 0, 4, 8, 1, 5, 1, 728),
             ("26.02", "LLAMA3.1_405B", 1024, "fp8", 1536, 1, 8192, 0, 8, 8, 2, 8, 1, 784),
             ("26.02.01", "LLAMA3_70B", 64, "fp8", 256, 1, 8192, 0, 4, 8, 1, 5, 1, 736),
             ("26.04", "LLAMA3_70B", 64, "fp8", 256, 1, 8192, 0, 4, 8, 1, 5, 1, 734),
             ("26.04.01", "LLAMA3_70B", 64, "fp8", 256, 1, 8192, 0, 4, 8, 1, 5, 1, 731),
             ("26.04.01", "LLAMA3.1_405B", 1024, "fp8", 1536, 1, 8192, 0, 8, 8, 2, 8, 1, 827),
             ("26.06", "LLAMA3.1_405B", 1024, "fp8", 1536, 1, 8192, 0, 8, 8, 2, 8, 1, 822),
             ("25.09", "Qwen3_30B_a3B (tokendrop)", 16, "fp8", 512, 2, 4096, 0, 1, 2, 1, 24, 8, 241),
             ("25.09", "Qwen3_235B_a22B (tokendrop)", 256, "fp8", 2048, 1, 4096, 0, 2, 8, 1, 4, 32, 178),
             ("25.11", "Qwen3_30B_a3B", 16, "fp8", 512, 2, 4096, 0, 1, 2, 1, 24, 8, 121),
             ("25.11", "Qwen3_235B_a22B", 256, "fp8", 2048, 1, 4096, 0, 2, 8, 1, 4, 32, 233),
             ("26.02", "Qwen3_30B_a3B", 16, "fp8", 1024, 1, 4096, 0, 1, 2, 1, 12, 8, 118),
             ("26.02", "Qwen3_235B_a22B", 256, "fp8", 8192, 1, 4096, 0, 2, 8, 1, 4, 32, 242),
             ("26.02.01", "Qwen3_30B_a3B", 16, "fp8", 1024, 1, 4096, 0, 1, 2, 1, 12, 8, 208),
             ("26.02.01", "Qwen3_235B_a22B", 256, "fp8", 8192, 1, 4096, 0, 2, 8, 1, 4, 32, 238),
             ("26.04", "Qwen3_30B_a3B", 16, "fp8", 1024, 1, 4096, 0, 1, 1, 1, 1, 16, 205),
             ("26.04", "Qwen3_235B_a22B", 256, "fp8", 8192, 1, 4096, 0, 2, 8, 1, 4, 32, 250),
             ("26.04.01", "Qwen3_30B_a3B", 16, "fp8", 1024, 1, 4096, 0, 1, 1, 1, 1, 16, 206),
             ("26.04.01", "Qwen3_235B_a22B", 256, "fp8", 8192, 1, 4096, 0, 2, 8, 1, 4, 32, 253),
             ("26.06", "Qwen3_30B_a3B", 16, "fp8", 1024, 1, 4096, 0, 1, 1, 1, 1, 16, 203),
             ("25.11", "GPT-OSS 120B", 64, "bf16", 512, 4, 4096, 0, 1, 4, 1, 1, 8, 153),
             ("26.02", "GPT-OSS 120B", 64, "bf16", 1280, 1, 4096, 0, 1, 4, 1, 1, 8, 163),
             ("26.02.01", "GPT-OSS 120B", 64, "bf16", 1280, 1, 4096, 0, 1, 4, 1, 1, 8, 163),
             ("26.04", "GPT-OSS 120B", 64, "bf16", 1280, 1, 4096, 0, 1, 4, 1, 1, 8, 158),
             ("26.04.01", "GPT-OSS 120B", 64, "bf16", 1280, 1, 4096, 0, 1, 4, 1, 1, 8, 158),
             ("26.06 draft", "GPT-OSS 120B", 64, "bf16", 1280, 1, 4096, 0, 1, 4, 1, 1, 8, 191)]
    rows = []
    for (release, model, gpus, precision, batch, b, seq, fsdp, t, p, c, v, ep, tflops) in table:
        if model.startswith("GPT-OSS"):
            reason = "architecture not trained by ptdp (attention sinks, sliding window, its MoE)"
            if release.endswith("draft"):
                reason += "; a first-draft figure later removed (commit 63b08b397)"
        else:
            reason = "FP8" + ("; FSDP" if fsdp else "")
            if "tokendrop" in model:
                reason += "; token dropping"
            if model.startswith("Qwen3_30B") and release >= "26.04":
                reason += "; HybridEP (DeepEP-style) dispatch and CUDA graphs"
            elif model.startswith("Qwen3_235B"):
                reason += "; EP comm overlap, delayed wgrad"
            elif model.startswith("LLAMA3") and t > 1:
                reason += "; TP comm overlap"
        source = BRIDGE.format(release=release)
        if release == "26.06 draft":
            source = "NVIDIA-NeMo/Megatron-Bridge 63b08b397 docs/performance-summary.md (26.06 draft)"
        moe = "Qwen3" in model or "GPT-OSS" in model
        rows.append(PublishedRun(
            name=f"{model} H100 {precision.upper()} {gpus} GPUs Bridge {release}", source=source,
            hardware="h100", model=model, shape=f"{model}, s={seq}", gpus=gpus, global_batch=batch,
            micro_batch=b, t=t, p=p, v=v, c=c, d=gpus // (t * p * c), ep=ep,
            etp=1 if moe else "n/a", recompute=NOT_STATED, sequence_parallel=NOT_STATED,
            distributed_optimizer=NOT_STATED, precision=precision, published_tflops=tflops,
            published_as="published", flops=NOT_STATED, kernels="flash", out_of_scope=reason))
    return rows


QWEN3_30B_A3B = Shape(48, 2048, 32, 4, 6144, 151936, 4096, True, True, True, True, extra=(
    ("kv_channels", 128), ("qk_layernorm", True), ("num_experts", 128), ("moe_router_topk", 8),
    ("moe_ffn_hidden_size", 768), ("moe_grouped_gemm", True),
    ("moe_token_dispatcher_type", "alltoall")))
QWEN3_TOKENS_PER_GPU = 12040        # the source's tokens/s per GPU


def _qwen3_moe_automodel(source: str) -> PublishedRun:
    """NeMo AutoModel's Qwen3-30B-A3B on 8 H100s (BF16, FSDP2 over 8, EP 8,
    DeepEP), priced under stated assumptions: its figure in ptdp's FLOP
    convention from its tokens/s (its own TFLOP/s count causal attention
    and leave out the input embedding; ptdp's count the whole s² and the
    router), FSDP2 as the distributed optimizer, DeepEP as all-to-all."""
    per_token = model_flops_per_iteration(QWEN3_30B_A3B.config(), 1, recompute=None) / 4096
    return PublishedRun(
        name="Qwen3 MoE 30B H100 BF16 8 GPUs AutoModel", source=source, hardware="h100",
        model="Qwen3-MoE 30B-A3B", shape=QWEN3_30B_A3B, gpus=8, global_batch=512,
        micro_batch=4, t=1, p=1, v=1, c=1, d=8, ep=8, etp=1, recompute="full",
        sequence_parallel=False, distributed_optimizer=True, precision="bf16",
        published_tflops=round(QWEN3_TOKENS_PER_GPU * per_token / 1e12, 1),
        published_as=(f"derived: {QWEN3_TOKENS_PER_GPU:,} tokens/s per GPU × ptdp's "
                      f"{per_token / 1e9:.1f} GFLOP per token (the source's 277 TFLOP/s count "
                      f"about 23.0)"),
        flops="model", kernels="flash", fused_optimizer=False, recompute_whole_layer=False,
        assumptions="the recipe (Automodel 79d0ccfdb examples/benchmark/configs/"
                    "qwen3_moe_30b_te_deepep.yaml) checkpoints every layer's activations "
                    "(full recomputation) and balances the routing (fake_balanced_gate); FSDP2 "
                    "over the 8 GPUs priced as the distributed optimizer (its gathers and "
                    "reduce-scatters of the 1.5 B dense weights each microbatch, about 2 % of "
                    "the step over NVLink and prefetched, not priced); DeepEP priced as ptdp's "
                    "all-to-all dispatch")


def _other_out_of_scope() -> list[PublishedRun]:
    """NeMo 24.07 (FP8), NeMo AutoModel (its Qwen3-MoE row priced under stated
    assumptions, its Llama 3 70B row out of scope: FSDP2 over 4 nodes), the NeMo Framework
    Mixtral rows on Blackwell (FP8, no ptdp profile)."""
    nemo = "NVIDIA/NeMo e2de75c15e docs/source/performance/performance_summary.md (24.07)"
    automodel = "NVIDIA-NeMo/Automodel 36044ad3 docs/performance-summary.mdx"
    framework = "NeMo Framework {release} performance summary (docs.nvidia.com), {system}"
    common = dict(recompute=NOT_STATED, sequence_parallel=NOT_STATED,
                  distributed_optimizer=NOT_STATED, published_as="published", kernels="flash")
    return [
        PublishedRun(name="LLAMA3-8B H100 FP8 8 GPUs NeMo 24.07", source=nemo, hardware="h100",
                     model="Llama 3 8B", shape=LLAMA["8B"], gpus=8, global_batch=128,
                     micro_batch=1, t=1, p=1, v=1, c=2, d=4, ep=1, etp="n/a", precision="fp8",
                     published_tflops=711, flops="model", out_of_scope="FP8", **common),
        PublishedRun(name="LLAMA3-70B H100 FP8 64 GPUs NeMo 24.07", source=nemo,
                     hardware="h100", model="Llama 3 70B", shape=LLAMA["70B"], gpus=64,
                     global_batch=128, micro_batch=1, t=4, p=4, v=5, c=2, d=2, ep=1, etp="n/a",
                     precision="fp8", published_tflops=734, flops="model",
                     out_of_scope="FP8; TP comm overlap", **common),
        _qwen3_moe_automodel(automodel),
        PublishedRun(name="Llama3 70B H100 BF16 64 GPUs AutoModel", source=automodel,
                     hardware="h100", model="Llama 3 70B", shape=LLAMA["70B"], gpus=64,
                     global_batch=128, micro_batch=1, t=1, p=1, v=1, c=2, d=32, ep=1,
                     etp="n/a", precision="bf16", published_tflops=389, flops=NOT_STATED,
                     out_of_scope="FSDP (FSDP2 over 32, prefetch)", **common),
        PublishedRun(name="Mixtral-8x7B GB200 FP8 64 GPUs NeMo 25.04",
                     source=framework.format(release="25.04", system="DGX-GB200"),
                     hardware="gb200", model="Mixtral 8x7B", shape="Mixtral-8x7B, s=4096",
                     gpus=64, global_batch=256, micro_batch=2, t=1, p=1, v=1, c=1, d=64, ep=8,
                     etp=1, precision="fp8", published_tflops=1598, flops=NOT_STATED,
                     out_of_scope="FP8; GB200 has no ptdp profile", **common),
        PublishedRun(name="Mixtral-8x7B B200 FP8 64 GPUs NeMo 25.02",
                     source=framework.format(release="25.02", system="DGX-B200"),
                     hardware="b200", model="Mixtral 8x7B", shape="Mixtral-8x7B, s=4096",
                     gpus=64, global_batch=256, micro_batch=2, t=1, p=1, v=1, c=1, d=64, ep=8,
                     etp=1, precision="fp8", published_tflops=1282, flops=NOT_STATED,
                     out_of_scope="FP8; B200 has no ptdp profile", **common),
    ]


RUNS: list[PublishedRun] = (_a100_2021() + _korthikanti() + _h100_2024() + _dgxc() + _bridge()
                            + _other_out_of_scope())

NOT_ROWS = (
    "Not rows (no per-run figure to hold a prediction against): the smaller GPU counts of the "
    "DGX Cloud tables (the same layouts at fewer data-parallel replicas, and the 405B proxies of "
    "7 to 62 layers; the largest count of each model and container stands for them); the "
    "full-recomputation baselines of Korthikanti et al. (derived from recalled times); the "
    "H100 strong-scaling plot of the Megatron-LM README (no per-point numbers); recipe layouts "
    "without a published throughput (Megatron-Bridge BF16 recipes, NeMo's recommended H100 "
    "configs); the Mixtral H100 rows of the NeMo Framework pages (not retrievable, FP8).")


# --- pricing --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Priced:
    run: PublishedRun
    tflops: float                    # predicted, in the row's FLOP convention
    seconds: float
    memory_gib: float
    fits: bool

    @property
    def error(self) -> float:
        return self.tflops / self.run.published_tflops - 1


OVERLAP_FIELDS = {"param gather": "overlap_param_gather", "tp comm": "tensor_comm_overlap"}


def profile_of(run: PublishedRun):
    """The row's hardware running the row's software: the paper's kernels
    (2021-22 rows), its gradient reduction, the overlaps the source states."""
    profile = load_profile(run.hardware)
    if run.kernels == "paper":
        profile = paper_kernels(profile)
    # The rows with rotary embeddings fuse them: the DGX Cloud recipes'
    # apply_rope_fusion: true (llama3.1/llama3.1_*.yaml), AutoModel's
    # rope_fusion: true. (The GPT rows have learned positions.) Every
    # flash-attention row runs Transformer Engine's attention (Megatron-Core,
    # NeMo, AutoModel's `attn: te`), which picks cuDNN's fused kernel on
    # Hopper ("give FusedAttention preference on Hopper+").
    if run.kernels == "flash" and run.hardware in ("h100", "h200"):
        profile = dataclasses.replace(profile,
                                      attention_efficiency=HOPPER_ATTENTION_EFFICIENCY["cudnn"])
    return dataclasses.replace(profile, overlap_grad_reduce=not run.gradients_after_backward,
                               fused_rope=True, fused_optimizer=run.fused_optimizer,
                               recompute_whole_layer=run.recompute_whole_layer,
                               **{OVERLAP_FIELDS[o]: True for o in run.overlaps})


def predicted_tflops(run: PublishedRun, layout: Layout) -> tuple[float, object]:
    """TFLOP/s per GPU in the row's convention: its FLOPs (ptdp.perf.analytic.flops,
    recomputation counted for "paper" rows only) over the predicted time."""
    model = run.shape.config()
    workload = Workload(model, run.global_batch, run.precision)
    evaluation = evaluate_layout(workload, layout, profile_of(run))
    counted = layout.recompute if run.flops == "paper" else None
    flops = (run.flops_per_sequence * run.global_batch if run.flops_per_sequence else
             model_flops_per_iteration(model, run.global_batch, recompute=counted))
    return flops / (run.gpus * evaluation.seconds) / 1e12, evaluation


def price(run: PublishedRun) -> Priced:
    layout = run.layout()
    if layout.devices != run.gpus:
        raise ValueError(f"{run.name}: t·p·c·d = {layout.devices}, not its {run.gpus} GPUs")
    tflops, evaluation = predicted_tflops(run, layout)
    return Priced(run, tflops, evaluation.seconds, evaluation.memory["total"] / 2**30,
                  evaluation.fits)


def note(priced: Priced) -> str:
    run = priced.run
    parts = ["**calibration point**"] if run.calibration else []
    parts.append(f"{run.flops} FLOPs, {run.kernels} kernels")
    if run.published_as != "published":
        parts.append(f"published figure {run.published_as}")
    if run.flops_per_sequence:
        parts.append(f"FLOPs: the source's {run.flops_per_sequence:.3g} per sequence")
    if run.assumptions:
        parts.append(run.assumptions)
    if not priced.fits:
        parts.append(f"ptdp's memory model: {priced.memory_gib:.0f} GiB per GPU, over "
                     f"{MEMORY_HEADROOM:.0%} of the device")
    return "; ".join(parts)


def signed(error: float) -> str:
    """An error as +x.y % (a rounding of -0.04 % reads +0.0 %, not -0.0 %)."""
    return f"{round(error, 3) + 0.0:+.1%}"


def priced_table(priced: list[Priced]) -> str:
    lines = ["| row | source | model | layout | published TFLOP/s per GPU | predicted | error "
             "| note |", "|---|---|---|---|---:|---:|---:|---|"]
    for p in priced:
        run = p.run
        lines.append(f"| {run.name} | {run.source} | {run.shape.text()} | {run.layout_text()} | "
                     f"{run.published_tflops:.1f} | {p.tflops:.1f} | {signed(p.error)} | "
                     f"{note(p)} |")
    return "\n".join(lines)


def out_of_scope_table(runs: list[PublishedRun]) -> str:
    lines = ["| row | source | layout | published TFLOP/s per GPU | why not priced |",
             "|---|---|---|---:|---|"]
    for run in runs:
        derived = "" if run.published_as == "published" else f" ({run.published_as})"
        lines.append(f"| {run.name} | {run.source} | {run.layout_text()} | "
                     f"{run.published_tflops:.1f}{derived} | {run.out_of_scope} |")
    return "\n".join(lines)


def summary(priced: list[Priced]) -> str:
    checked = [p for p in priced if not p.run.calibration]
    if not checked:
        return ""
    errors = [abs(p.error) for p in checked]
    within = sum(e <= 0.10 for e in errors)
    low, high = min(checked, key=lambda p: p.error), max(checked, key=lambda p: p.error)
    return (f"{len(checked)} rows priced besides the calibration point: {within} within 10 %; "
            f"median |error| {statistics.median(errors):.1%}; from {signed(low.error)} "
            f"({low.run.name}) to {signed(high.error)} ({high.run.name}).")


# --- ptdp's own runs -------------------------------------------------------------------------

@dataclass(frozen=True)
class OwnRun:
    """One of ptdp's own training runs on one GPU (bench/gpu.py's suite:
    t = p = d = 1, bf16, AdamW, mock data), with the model TFLOP/s it
    measured (the paper's FLOPs, recomputation counted, over the mean
    iteration time) in each session that ran it."""
    name: str
    model: ModelConfig
    micro_batch: int
    microbatches: int
    recompute: str | None
    measured: tuple[float, ...]

    @property
    def published_tflops(self) -> float:
        return statistics.fmean(self.measured)


OWN_SOURCE = ("bench/RESULTS.md, \"GPU benchmark\": `python bench/gpu.py --write` on one NVIDIA "
              "H200, torch 2.11, two sessions of 2026-12-04")
_GPT_1_3B = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                        seq_length=2048, vocab_size=50257)
_GPT_2_7B = ModelConfig(num_layers=32, hidden_size=2560, num_attention_heads=32,
                        seq_length=2048, vocab_size=50257)
_LLAMA_1_3B = dataclasses.replace(
    _GPT_1_3B, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
    group_query_attention=True, num_query_groups=4, untie_embeddings_and_output_weights=True,
    disable_bias_linear=True)
# bench/gpu.py's GPU_SUITE (tests/test_bench_gpu.py checks they are its models).
OWN_RUNS = [OwnRun("GPT 1.3B", _GPT_1_3B, 8, 4, None, (501.9, 499.0)),
            OwnRun("Llama-style 1.3B", _LLAMA_1_3B, 8, 4, None, (426.8, 422.3)),
            OwnRun("GPT 2.7B", _GPT_2_7B, 24, 2, "full", (517.4, 517.4)),
            OwnRun("GPT 1.3B", _GPT_1_3B, 8, 4, "full", (505.9, 502.6))]


def price_own(run: OwnRun) -> tuple[float, float]:
    """(predicted TFLOP/s on the h200 profile in the run's convention, error)."""
    model = dataclasses.replace(run.model, recompute_granularity=run.recompute)
    batch = run.micro_batch * run.microbatches
    layout = Layout(b=run.micro_batch, recompute=run.recompute)
    evaluation = evaluate_layout(Workload(model, batch, "bf16"), layout, load_profile("h200"))
    flops = model_flops_per_iteration(model, batch, recompute=run.recompute)
    tflops = flops / evaluation.seconds / 1e12
    return tflops, tflops / run.published_tflops - 1


def own_table() -> str:
    lines = [f"ptdp's own runs on one H200 ({OWN_SOURCE}), priced on the h200 profile as one "
             "layout (t = p = d = 1):", "",
             "| run | recomputation | b × m | measured model TFLOP/s | predicted | error |",
             "|---|---|---|---:|---:|---:|"]
    for run in OWN_RUNS:
        tflops, error = price_own(run)
        measured = " and ".join(f"{x:.1f}" for x in run.measured)
        lines.append(f"| {run.name} | {run.recompute or 'none'} | {run.micro_batch} × "
                     f"{run.microbatches} | {run.published_tflops:.1f} ({measured}) | "
                     f"{tflops:.1f} | {signed(error)} |")
    return "\n".join(lines)


TABLE_PAGE = ROOT / "docs" / "planner.md"
TABLE_BEGIN = "<!-- published-runs table: python bench/published_runs.py --write -->"
TABLE_END = "<!-- end of published-runs table -->"


def validation_table(priced: list[Priced]) -> str:
    """The planner page's validation table: every priced published row and
    ptdp's own runs, each with its layout, published (or measured)
    TFLOP/s per GPU, the prediction and the error."""
    lines = ["| run | hardware, layout | published | predicted | error |",
             "|---|---|---:|---:|---:|"]
    for p in priced:
        mark = " (calibration)" if p.run.calibration else ""
        lines.append(f"| {p.run.name}{mark} | {p.run.hardware}, {p.run.layout_text()} | "
                     f"{p.run.published_tflops:.1f} | {p.tflops:.1f} | {signed(p.error)} |")
    for run in OWN_RUNS:
        tflops, error = price_own(run)
        lines.append(f"| ptdp {run.name} (bench/gpu.py) | h200, t=1 p=1 d=1 b={run.micro_batch} "
                     f"m={run.microbatches} recompute={run.recompute or 'none'}, bf16 | "
                     f"{run.published_tflops:.1f} | {tflops:.1f} | {signed(error)} |")
    return "\n".join(lines)


def write_validation_table(priced: list[Priced]) -> None:
    """Replace the planner page's table between its markers."""
    text = TABLE_PAGE.read_text()
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    TABLE_PAGE.write_text(text[:begin] + "\n" + validation_table(priced) + "\n" + text[end:])


def select(names: str | None) -> list[PublishedRun]:
    """The rows whose name contains one of the comma-separated `names`
    (case-insensitive); all of them without."""
    if not names:
        return list(RUNS)
    wanted = [n.strip().lower() for n in names.split(",") if n.strip()]
    chosen = [run for run in RUNS if any(w in run.name.lower() for w in wanted)]
    if not chosen:
        raise SystemExit(f"--rows {names!r} matches no row: give parts of row names, e.g. "
                         f"--rows '1.7B A100,1T A100'")
    return chosen


# --- the search's speed (the README example) --------------------------------------------------

GPT_39B = ModelConfig(num_layers=48, hidden_size=8192, num_attention_heads=64, seq_length=2048,
                      vocab_size=51200)


def search_speed(exhaustive: bool) -> str:
    workload, a100 = Workload(GPT_39B, 512), load_profile("a100")
    start = time.perf_counter()
    pruned = search(workload, 64, a100)
    seconds = time.perf_counter() - start
    lines = [f"Search (`ptdp plan`'s, cold caches): {seconds:.2f} s, {len(pruned)} layouts "
             f"priced; winner {describe(pruned[0].layout, GPT_39B)} at "
             f"{pruned[0].tflops:.1f} TFLOP/s per GPU."]
    if exhaustive:
        start = time.perf_counter()
        everything = search(workload, 64, a100, exhaustive=True)
        full = time.perf_counter() - start
        same = [e.layout for e in everything[:30]] == [e.layout for e in pruned[:30]]
        lines.append(f"Every layout priced: {full:.0f} s, {len(everything)} layouts that fit; "
                     f"winner {describe(everything[0].layout, GPT_39B)}; the first 30 rows "
                     + ("are the same." if same else "DIFFER."))
    return "\n".join(lines)


LAYER_SETTINGS = {(None, False): "no recomputation", (None, True): "sequence parallelism",
                  ("full", False): "full recomputation",
                  ("selective", False): "selective recomputation",
                  ("selective", True): "sequence parallelism + selective recomputation"}


def layer_table() -> str:
    """One 22B layer on 8 A100s as Korthikanti et al. timed it (Table 4)
    against the a100 profile with the paper's kernels: the kernel-level
    check behind the paper attention core's fitted bandwidth (which sees
    only the selective overhead, 1.3 ms, of these five times)."""
    priced = korthikanti_layer_ms(paper_kernels(load_profile("a100")))
    shape = KORTHIKANTI_LAYER
    lines = [f"One 22B layer (h = {shape['hidden']}, a = {shape['heads']}, s = {shape['seq']}, "
             f"t = {shape['t']}, b = {shape['b']}, bf16) on 8 A100s, forward + backward, as "
             f"Korthikanti et al. 2022 timed it (Table 4) and as the a100 profile prices it "
             f"with the paper's kernels (e_max {CALIBRATED_GEMM_EFFICIENCY}; their attention "
             f"core at {PAPER_ATTENTION_CORE_FRACTION:.1%} of the HBM data sheet, fitted to "
             f"the measured cost of selective recomputation, "
             f"{selective_overhead_ms(KORTHIKANTI_LAYER_MS):.1f} ms):", "",
             "| setting | measured ms | priced ms | error |", "|---|---:|---:|---:|"]
    for setting, measured in KORTHIKANTI_LAYER_MS.items():
        lines.append(f"| {LAYER_SETTINGS[setting]} | {measured:.1f} | {priced[setting]:.1f} | "
                     f"{signed(priced[setting] / measured - 1)} |")
    return "\n".join(lines)


# Korthikanti et al. 2022, Table 5: how much faster sequence parallelism with
# selective recomputation trains than full recomputation without sequence
# parallelism, each model on its own layout (notes of the paper's text; the
# MFUs of the same runs are in the README of Megatron-LM, KORTHIKANTI).
KORTHIKANTI_GAINS = {"22B": 0.290, "175B": 0.318, "530B": 0.297, "1T": 0.321}


def recompute_gain_table() -> str:
    """The gain of Table 5 as the model prices it: the row's layout with full
    recomputation and no sequence parallelism against the row as published.
    The ratio of two times on one layout, it depends less on the recalled
    batch (the bubble) than each row's throughput does."""
    lines = ["Korthikanti et al.'s Table 5: throughput of sequence parallelism with selective "
             "recomputation over full recomputation without it, on each row's layout:", "",
             "| model | published gain | priced gain |", "|---|---:|---:|"]
    for run in RUNS:
        name = run.name.split()[0]
        if run.source != KORTHIKANTI or name not in KORTHIKANTI_GAINS:
            continue
        workload = Workload(run.shape.config(), run.global_batch, run.precision)
        profile = profile_of(run)
        selective = evaluate_layout(workload, run.layout(), profile).seconds
        full = evaluate_layout(workload, dataclasses.replace(
            run.layout(), recompute="full", sequence_parallel=False), profile).seconds
        lines.append(f"| {name} | {signed(KORTHIKANTI_GAINS[name])} | {signed(full / selective - 1)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="append to bench/RESULTS.md")
    parser.add_argument("--rows", help="only the rows whose names contain one of these "
                                       "comma-separated parts (case-insensitive)")
    parser.add_argument("--no-search", action="store_true", help="skip the search's timing")
    parser.add_argument("--no-exhaustive", action="store_true",
                        help="skip pricing every layout (minutes)")
    args = parser.parse_args(argv)
    runs = select(args.rows)
    priced = [price(run) for run in runs if run.priced]
    stamp = time.strftime("%Y-%m-%d")
    command = "python bench/published_runs.py" + (f" --rows '{args.rows}'" if args.rows else "")
    block = (f"### {stamp}\n\nCommand: `{command}`; profiles a100 and h100 as built in (the "
             f"a100 e_max fitted to the paper's 1.7B point, the h100's to an H200's measured "
             f"8192³ bf16 matmul, nothing fitted to any other row); "
             f"each row's published layout priced as one layout (`--fix-all`); error = "
             f"predicted / published - 1. FLOPs: \"paper\" counts the recomputed forward (the "
             f"paper's 96·B·s·l·h²·(1 + s/6h + V/16lh)), \"model\" none (Megatron-Core's "
             f"num_floating_point_operations, MFU); kernels: \"paper\" = attention as two "
             f"GEMMs and a softmax pass at the bandwidth fitted to Korthikanti et al.'s "
             f"layer (Megatron-LM 2021-22; the table after the own runs), \"flash\" = flash attention "
             f"(on Hopper at the published rate of cuDNN's kernel, which Transformer Engine "
             f"picks there); memory-bound passes at 88 % of the data sheet's bandwidth; the "
             f"optimizer step as the row's software runs it (Megatron-LM's and NeMo's fused "
             f"Adam); full recomputation rerunning each layer's whole forward (Megatron-LM's "
             f"re-entrant checkpoint; AutoModel's stops before the last GEMM, as ptdp's does); "
             f"gradients reduced in buckets during the backward unless the row's note says after "
             f"it; overlaps a source states and ptdp does not run are priced as stated "
             f"(the row's note).\n\n"
             f"{priced_table(priced)}\n\n{summary(priced)}\n")
    outside = [run for run in runs if not run.priced]
    if outside:
        block += f"\nOut of scope (not priced):\n\n{out_of_scope_table(outside)}\n"
    if not args.rows:
        block += (f"\n{NOT_ROWS}\n\n{own_table()}\n\n{layer_table()}\n\n"
                  f"{recompute_gain_table()}\n")
    publish(HEADING, block, write=args.write)
    if args.write and not args.rows:
        write_validation_table(priced)
    if not args.no_search:
        speed = search_speed(not args.no_exhaustive)
        publish("## Planner search time",
                f"### {stamp}\n\nCommand: `python bench/published_runs.py`; {cpu_name()}; the "
                f"README's 39B GPT on 64 A100s, B = 512.\n\n{speed}\n", write=args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
