"""Megatron-LM flags that `ptdp train` takes without a setting of its own:
every flag of Megatron-LM's parser (ptdp/config/megatron_flag_list.py) that is
not a ptdp setting is here, by name or by family
(ptdp/config/megatron_flag_classes.py).

A Megatron-LM script carries flags that choose between implementations ptdp
does not have (Transformer Engine or not, fused kernels or not) or that turn
on what ptdp always does. Refusing them would make every ported script fail
for nothing, and ignoring them silently would leave the user guessing, so
each one is accepted and explained in one line before the run starts.

The others cannot be honoured (FP8, multi-latent attention, Megatron-LM's
checkpoint formats, its newer batch-size schedule, the mixture-of-experts
extras: flex dispatch, upcycling, quantile balancing...): those are refused
by name before launch with what they are and what to use instead, together
with any other invalid setting; so are the values of Megatron-LM's choices
that ptdp's settings lack (`REFUSED_VALUES`: --position-embedding-type mrope...).

The flags whose meaning ptdp implements (--decoupled-lr, --manual-gc,
--attention-backend's report, ...) are ordinary settings in ptdp.config.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any

from ptdp.config.megatron_flag_classes import FAMILIES

# Namespace attributes of these flags; no "." so they are not config settings.
_DEST_PREFIX = "megatron_"


@dataclass(frozen=True)
class AcceptedFlag:
    """A flag accepted for compatibility: `values` is 0 for a switch, 1 for
    one value, "+" or "*" for a list (argparse's nargs); `choices` restricts
    the value as Megatron-LM does, and of them `refused_choices` are refused
    with `refusal`. `alias_of`: the setting ("section.field", an int) the
    flag is another name for; its note says so, and a different value of
    that setting is refused. `alias_settings`: for a switch, the settings
    ((setting, value), ...) it stands for, likewise. `alias_values`: for a
    flag with a value, the settings each value stands for ((value,
    ((setting, value), ...)), ...; a value not listed: none), likewise.
    `needs`: (value, setting, what it must be) that a value sets nothing
    for but contradicts otherwise (refused, with `conflict_reason`)."""
    name: str
    values: int | str
    explanation: str
    choices: tuple[str, ...] | None = None
    refused: bool = False
    refused_choices: tuple[str, ...] = ()
    refusal: str = ""
    alias_of: str | None = None
    alias_settings: tuple[tuple[str, Any], ...] = ()
    alias_values: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    needs: tuple[tuple[Any, str, Any], ...] = ()
    conflict_reason: str = ""
    listed: bool = True  # in `ptdp train --help` (a family's flags are not: hundreds)

    @property
    def dest(self) -> str:
        return _DEST_PREFIX + self.name.lstrip("-").replace("-", "_")

    @property
    def is_alias(self) -> bool:
        return bool(self.alias_of or self.alias_settings or self.alias_values)

    def settings_for(self, value: Any) -> tuple[tuple[str, Any], ...]:
        """The settings the flag given `value` stands for."""
        if self.alias_of:
            return ((self.alias_of, value),)
        if self.alias_values:
            return dict(self.alias_values).get(value, ())
        return self.alias_settings


_FP8 = ("FP8 training needs Transformer Engine's FP8 kernels, which ptdp does not use: train "
        "with --bf16 and drop the --fp8-* flags")

def _moe(name: str, values: int, what: str, instead: str, **extra: Any) -> AcceptedFlag:
    """A Megatron-LM MoE option ptdp refuses: what it is, what to use instead."""
    return AcceptedFlag(name, values, f"{what}, which ptdp does not have: {instead}", refused=True,
                        **extra)


_DROP = "drop it"
_FLEX = ("part of the flex token dispatcher (DeepEP, HybridEP or NCCL-EP communication "
         "libraries)", "use --moe-token-dispatcher-type alltoall or allgather and drop it")
# The flex dispatcher's kernel and resource choices: ptdp runs flex as its
# alltoall dispatcher, so they change nothing it computes.
_FLEX_KERNELS = ("a setting of the flex dispatcher's communication kernels (DeepEP, HybridEP, "
                 "NCCL-EP); ptdp runs --moe-token-dispatcher-type flex as its alltoall "
                 "dispatcher, which dispatches the same tokens to the same experts")
_LOW_PRECISION = ("a Transformer Engine FP8/FP4 or grouped-tensor layout option",
                  "train with --bf16 and drop it")
_OVERLAP = ("overlap of the expert-parallel all-to-all with computation across micro-batches",
            "drop it (the results are the same without it)")

# Megatron-LM's mixture-of-experts extras (ptdp.config.moe has the MoE
# settings ptdp implements).
MOE_FLAGS: tuple[AcceptedFlag, ...] = (
    AcceptedFlag("--moe-router-fusion", 0,
                 "ptdp's router is plain PyTorch; Transformer Engine's fused router kernel "
                 "computes the same"),
    AcceptedFlag("--moe-permute-fusion", 0,
                 "ptdp permutes tokens with plain PyTorch; Transformer Engine's fused permutation "
                 "computes the same"),
    AcceptedFlag("--moe-shared-expert-overlap", 0,
                 "ptdp computes the shared experts in line, not on a side stream during the "
                 "all-to-all; the results are the same"),
    AcceptedFlag("--moe-per-layer-logging", 0,
                 "ptdp logs the load-balancing and z-losses averaged over the MoE layers, not "
                 "per layer"),
    _moe("--moe-input-jitter-eps", 1, "Switch-style multiplicative noise on the router's input",
         _DROP),
    _moe("--moe-router-force-biased", 1, "benchmark-only biased random router logits", _DROP),
    _moe("--moe-router-quantile-balancing-ema", 1, "quantile-balancing routing",
         "use --moe-router-load-balancing-type aux_loss or --moe-router-enable-expert-bias"),
    _moe("--moe-router-topk-limited-devices", 1,
         "device-limited routing (Megatron-LM's deprecated flag)",
         "use --moe-router-num-groups G --moe-router-group-topk N"),
    _moe("--moe-router-padding-for-quantization", 0, *_LOW_PRECISION),
    _moe("--moe-router-padding-for-fp8", 0, *_LOW_PRECISION),
    _moe("--moe-use-grouped-tensor", 0, *_LOW_PRECISION),
    _moe("--moe-single-grouped-weight", 0, *_LOW_PRECISION),
    _moe("--moe-single-grouped-bias", 0, *_LOW_PRECISION),
    _moe("--moe-mlp-glu-interleave-size", 1, *_LOW_PRECISION),
    _moe("--moe-shared-expert-glu-interleave-size", 1, *_LOW_PRECISION),
    _moe("--use-grouped-gemm-for-shared-expert", 0, "Transformer Engine's grouped GEMM for the "
         "shared experts", _DROP),
    _moe("--use-grouped-gemm-for-dense-mlp", 0, "Transformer Engine's grouped GEMM for the dense "
         "MLP", _DROP),
    AcceptedFlag("--moe-enable-deepep", 0, _FLEX_KERNELS),
    AcceptedFlag("--moe-flex-dispatcher-backend", 1, _FLEX_KERNELS),
    AcceptedFlag("--moe-flex-dispatcher-num-sms", 1, _FLEX_KERNELS),
    AcceptedFlag("--moe-deepep-num-sms", 1, _FLEX_KERNELS),
    AcceptedFlag("--moe-hybridep-num-sms", 1, _FLEX_KERNELS),
    AcceptedFlag("--moe-hybridep-num-blocks-permute", 1, _FLEX_KERNELS),
    AcceptedFlag("--moe-hybridep-num-blocks-unpermute", 1, _FLEX_KERNELS),
    AcceptedFlag("--moe-hybridep-num-sms-preprocessing", 1, _FLEX_KERNELS),
    AcceptedFlag("--moe-hybridep-pad-uneven-dispatch-inputs", 0, _FLEX_KERNELS),
    AcceptedFlag("--moe-permute-fusion-into-hybridep", 0, _FLEX_KERNELS),
    AcceptedFlag("--moe-ncclep-zero-copy", 0, _FLEX_KERNELS),
    _moe("--moe-dispatch-fwd-dtype", 1, *_FLEX),
    _moe("--moe-combine-bwd-dtype", 1, *_FLEX),
    _moe("--moe-expert-rank-capacity-factor", 1, *_FLEX),
    _moe("--moe-use-upcycling", 0, "conversion of a dense checkpoint into an MoE model",
         "train the MoE model from its own initialisation and drop it"),
    _moe("--moe-upcycling-granularity", 1, "conversion of a dense checkpoint into an MoE model",
         "train the MoE model from its own initialisation and drop it"),
    _moe("--moe-apply-probs-on-input", 0, "routing probabilities applied to the experts' input",
         "drop it (ptdp weights the experts' outputs, Megatron-LM's default)"),
    _moe("--moe-latent-size", 1, "a latent projection around the MoE layer", _DROP),
    _moe("--moe-layer-recompute", 0, "recomputation of the MoE layers alone (deprecated in "
         "Megatron-LM)", "use --recompute-granularity full"),
    _moe("--moe-paged-stash", 0, "paged stashing of MoE activations", _DROP),
    _moe("--moe-paged-stash-page-size", 1, "paged stashing of MoE activations", _DROP),
    _moe("--moe-paged-stash-buffer-size-factor-cuda", 1, "paged stashing of MoE activations",
         _DROP),
    _moe("--moe-paged-stash-buffer-size-factor-cpu", 1, "paged stashing of MoE activations",
         _DROP),
    _moe("--overlap-moe-expert-parallel-comm", 0, *_OVERLAP),
    _moe("--overlap-dispatch-backward-with-experts-wgrad", 0, *_OVERLAP),
    _moe("--delay-wgrad-compute", 0, "delayed expert weight gradients for the all-to-all "
         "overlap", "drop it (the results are the same without it)"),
    _moe("--moe-enable-routing-replay", 0, "replay of recorded routing decisions", _DROP),
    _moe("--moe-pad-experts-for-cuda-graph-inference", 0, "CUDA-graph inference padding", _DROP),
    _moe("--expert-tensor-parallel-num-weight-shards", 1, "sharded expert weights for "
         "inference", _DROP),
)

_FP32_STATE = ("ptdp keeps the main weights and Adam's moments in fp32: give fp32 or drop the flag")
_DTYPES = ("fp32", "fp16", "bf16", "fp8")

# Megatron-LM's flags with a line of their own: their meaning in ptdp is
# narrower than a family's, or some of their values are refused.
OWN_LINES: tuple[AcceptedFlag, ...] = (
    AcceptedFlag("--dataloader-type", 1,
                 "ptdp's loader reads the dataset's (already shuffled) samples in order, once, as "
                 "Megatron-LM's single sampler does", choices=("single", "cyclic", "external"),
                 refused_choices=("cyclic", "external"),
                 refusal="ptdp's loader is Megatron-LM's single sampler (the dataset's shuffled "
                 "samples in order): give --dataloader-type single or drop the flag"),
    AcceptedFlag("--weight-decay-incr-style", 1, "ptdp's weight decay is constant (--weight-decay)",
                 choices=("constant", "linear", "cosine"), refused_choices=("linear", "cosine"),
                 refusal="ptdp's weight decay is constant (--weight-decay): give constant or drop "
                 "the flag"),
    AcceptedFlag("--encoder-num-layers", 1,
                 "Megatron-LM's other name for --num-layers (its GPT copies one into the other); "
                 "the model's number of layers is this", alias_of="model.num_layers"),
    AcceptedFlag("--use-torch-fsdp2", 0,
                 "Megatron-LM's PyTorch FSDP2 wrapper shards parameters, gradients and optimizer "
                 "state over the data-parallel ranks; ptdp does this with its own ZeRO-3, "
                 "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params, which "
                 "computes the same and composes with every layout",
                 alias_settings=(("train.use_megatron_fsdp", True),
                                 ("train.data_parallel_sharding_strategy", "optim_grads_params"))),
    AcceptedFlag("--torch-fsdp2-no-reshard-after-forward", 0,
                 "with --use-torch-fsdp2, keep each layer's gathered parameters after its forward "
                 "for its backward; ptdp's --no-fsdp-reshard-after-forward keeps them to the "
                 "iteration's end, one gather per layer and iteration, as PyTorch's pipeline "
                 "schedules keep FSDP2's across microbatches",
                 alias_settings=(("train.fsdp_reshard_after_forward", False),)),
    AcceptedFlag("--use-precision-aware-optimizer", 0,
                 "ptdp's Adam keeps fp32 main weights and moments, what that optimizer keeps by "
                 "default, and reads bf16 main gradients (--main-grads-dtype bf16, a setting of "
                 "ptdp's with or without this flag) as fp32; lower precisions for the weights "
                 "and moments are refused"),
    *(AcceptedFlag(name, 1, "fp32 is what ptdp keeps", choices=choices,
                   refused_choices=choices[1:], refusal=_FP32_STATE)
      for name, choices in (("--main-params-dtype", ("fp32", "fp16")),
                            ("--exp-avg-dtype", _DTYPES), ("--exp-avg-sq-dtype", _DTYPES))),
    AcceptedFlag("--enable-experimental", 0,
                 "ptdp keeps no features behind this switch: each has its own flag"),
    AcceptedFlag("--logging-level", 1,
                 "ptdp prints its log lines itself, not through Python's logging, so no level "
                 "filters them"),
    AcceptedFlag("--local-rank", 1,
                 "ptdp takes each rank's place from the environment (LOCAL_RANK, as torchrun sets "
                 "it), not from this flag"),
    AcceptedFlag("--no-initialization", 0,
                 "ptdp initialises the weights before --load's checkpoint replaces them; the loaded "
                 "model is the same"),
    AcceptedFlag("--exit-signal-handler-for-training", 0,
                 "ptdp's --exit-signal-handler (on by default) saves and stops on SIGTERM and "
                 "--exit-signal"),
    AcceptedFlag("--exit-signal-handler-for-dataloader", 0,
                 "ptdp's data-loading workers (--num-workers) stop with their rank"),
    AcceptedFlag("--distributed-timeout-seconds-after-init", 1,
                 "ptdp's process groups keep --distributed-timeout-minutes throughout"),
)

ACCEPTED: tuple[AcceptedFlag, ...] = (
    AcceptedFlag("--use-mcore-models", 0,
                 "ptdp has one model implementation, its own; there is nothing to choose"),
    AcceptedFlag("--transformer-impl", 1,
                 "ptdp's layers are its own PyTorch modules (it never uses Transformer Engine); "
                 "either value trains the same model",
                 choices=("local", "transformer_engine", "inference_optimized"),
                 refused_choices=("inference_optimized",),
                 refusal="Megatron-LM's inference-optimized layers serve its inference engine: give "
                 "local or transformer_engine"),
    AcceptedFlag("--overlap-grad-reduce", 0,
                 "always on in ptdp: each gradient bucket's data-parallel reduction starts as "
                 "soon as its gradients are final, during the rest of the backward (an "
                 "all-reduce, or a reduce-scatter with --use-distributed-optimizer; under "
                 "--use-megatron-fsdp's optim_grads and optim_grads_params one per bucket and "
                 "microbatch)"),
    AcceptedFlag("--no-masked-softmax-fusion", 0,
                 "ptdp has no separate masked-softmax kernel: the causal mask and the softmax "
                 "are inside PyTorch's attention kernel"),
    AcceptedFlag("--no-gradient-accumulation-fusion", 0,
                 "ptdp has no fused weight-gradient accumulation kernel to turn off: autograd's "
                 "gradients are added into the main gradients"),
    # Megatron-FSDP's own dtype flags. Megatron-FSDP reduces in grad_comm_dtype
    # (auto: the main gradients' dtype) and accumulates in main_grads_dtype:
    # bf16 reductions of fp32 main gradients are ptdp's --grad-reduce-in-bf16,
    # bf16 main gradients its --main-grads-dtype bf16 (reduced in bf16, as
    # auto does; fp32 reductions of them are not in ptdp). Their fp16 is not.
    AcceptedFlag("--megatron-fsdp-grad-comm-dtype", 1,
                 "Megatron-FSDP's gradient reduction dtype: bf16 is ptdp's --grad-reduce-in-bf16 "
                 "(bf16 reductions of the main gradients), fp32 its fp32 reductions of fp32 main "
                 "gradients, auto the main gradients' dtype (ptdp's default); under every data "
                 "layout",
                 choices=("fp32", "fp16", "bf16", "auto"), refused_choices=("fp16",),
                 refusal="fp16 reductions are not in ptdp: give bf16 (--grad-reduce-in-bf16), "
                         "fp32 or auto",
                 alias_values=(("bf16", (("train.grad_reduce_in_bf16", True),)),
                               ("fp32", (("train.grad_reduce_in_bf16", False),))),
                 needs=(("fp32", "train.main_grads_dtype", "fp32"),),
                 conflict_reason="ptdp reduces bf16 main gradients in bf16, fp32 ones in fp32 "
                                 "unless --grad-reduce-in-bf16", listed=False),
    AcceptedFlag("--megatron-fsdp-main-grads-dtype", 1,
                 "Megatron-FSDP's main gradient dtype, ptdp's --main-grads-dtype (the buffers "
                 "gradients accumulate in, under every data layout); auto keeps ptdp's (fp32 by "
                 "default)",
                 choices=("fp32", "bf16", "fp16", "auto"), refused_choices=("fp16",),
                 refusal="ptdp's main gradients are fp32 or bf16: give fp32, bf16 (with --bf16) or "
                         "auto",
                 alias_values=(("fp32", (("train.main_grads_dtype", "fp32"),)),
                               ("bf16", (("train.main_grads_dtype", "bf16"),))), listed=False),
    AcceptedFlag("--megatron-fsdp-main-params-dtype", 1,
                 "fp32 is what ptdp keeps under every sharding strategy",
                 choices=("fp32", "bf16", "fp16", "auto"), refused_choices=("bf16", "fp16"),
                 refusal=_FP32_STATE, listed=False),
    AcceptedFlag("--accumulate-allreduce-grads-in-fp32", 0,
                 "ptdp's default: gradients accumulated in fp32 main gradients (--main-grads-dtype "
                 "fp32) and reduced in fp32 (unless --grad-reduce-in-bf16)",
                 needs=((True, "train.main_grads_dtype", "fp32"),),
                 conflict_reason="Megatron-LM refuses bf16 main gradients with it too"),
    AcceptedFlag("--attention-softmax-in-fp32", 0,
                 "PyTorch's attention kernels compute the softmax in fp32 for bf16 and fp16 "
                 "inputs already"),
    AcceptedFlag("--use-cpu-initialization", 0,
                 "ptdp draws each weight whole from a generator seeded by --seed and the "
                 "weight's name and keeps this rank's shard, so every layout starts from the "
                 "same weights wherever they are drawn"),
    AcceptedFlag("--cross-entropy-loss-fusion", 0,
                 "ptdp has one cross-entropy implementation (vocabulary-parallel, fp32); there "
                 "is no fused variant to choose"),
    AcceptedFlag("--DDP-impl", 1,
                 "ptdp has one data-parallel implementation: bucketed gradient reductions "
                 "overlapped with the backward, like Megatron-LM's local DDP",
                 choices=("local", "torch")),
    AcceptedFlag("--no-create-attention-mask-in-dataloader", 0,
                 "ptdp's data loader never builds attention masks: the causal mask is inside "
                 "the attention kernel"),
    # Older and newer Megatron-LM scripts' switches (issue 27).
    AcceptedFlag("--use-legacy-models", 0,
                 "ptdp has one model implementation, its own; there is nothing to choose (Megatron-"
                 "LM's legacy and Megatron-Core GPTs compute the same model)"),
    AcceptedFlag("--data-impl", 1,
                 "ptdp reads Megatron-LM's mmap indexed format (an .idx starting MMIDIDX, what "
                 "its preprocess_data.py and `ptdp preprocess` write), the format 'infer' finds "
                 "in such files; an .idx of another format is refused when read",
                 choices=("mmap", "infer", "lazy", "cached"), refused_choices=("lazy", "cached"),
                 refusal="ptdp reads only the mmap indexed format (.idx starting MMIDIDX), not "
                 "older Megatron-LM's lazy/cached datasets: tokenize the text again with `ptdp "
                 "preprocess` (or Megatron-LM's preprocess_data.py) and give --data-impl mmap or "
                 "drop the flag"),
    AcceptedFlag("--overlap-p2p-communication", 0,
                 "always so in ptdp: each pipeline exchange posts its sends and receives as one "
                 "batch and the sends travel while the rank computes its next step"),
    AcceptedFlag("--no-overlap-p2p-communication", 0,
                 "ptdp always lets pipeline sends travel while the rank computes; the results "
                 "are the same either way"),
    AcceptedFlag("--timing-log-level", 1,
                 "ptdp times each iteration's phases (forward-backward, pipeline transfers, "
                 "gradient reduction, optimizer) at no extra synchronisation whatever the level; "
                 "the log line shows the iteration time and --log-timers-to-tensorboard writes "
                 "the phases", choices=("0", "1", "2")),
    AcceptedFlag("--distributed-backend", 1,
                 "ptdp picks the backend by device: nccl for CUDA, gloo for CPU (--device); the "
                 "results are the same", choices=("nccl", "gloo")),
    AcceptedFlag("--encoder-seq-length", 1,
                 "Megatron-LM's other name for --seq-length; the run's sequence length is this",
                 alias_of="model.seq_length"),
    # Megatron-LM's model-configuration scripts (Qwen3-30B-A3B's) carry these.
    AcceptedFlag("--optimizer", 1,
                 "ptdp's optimizer is Adam with decoupled weight decay (AdamW), what Megatron-LM's "
                 "adam is", choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap",
                                     "adaptive_muon"),
                 refused_choices=("sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
                 refusal="ptdp trains with Adam (decoupled weight decay, Megatron-LM's adam) only: "
                 "give --optimizer adam or drop the flag"),
    AcceptedFlag("--inference-max-seq-length", 1,
                 "a setting of Megatron-LM's inference engine, which training does not use; "
                 "`ptdp generate` takes any context up to the model's positions"),
    AcceptedFlag("--inference-max-requests", 1,
                 "a setting of Megatron-LM's inference engine, which training does not use"),
    AcceptedFlag("--te-rng-tracker", 0,
                 "Transformer Engine's random-state tracker; ptdp keeps its own per-rank streams "
                 "(the same dropout masks under every layout)"),
    AcceptedFlag("--dist-ckpt-strictness", 1,
                 "how Megatron-LM's distributed checkpoints treat unexpected keys; ptdp's "
                 "checkpoints are checked in full (every tensor's name, shape and checksum) "
                 "whatever it says", choices=("assume_ok_unexpected", "log_unexpected", "log_all",
                                              "raise_unexpected", "raise_all", "return_unexpected",
                                              "return_all", "ignore_all")),
    AcceptedFlag("--no-use-tokenizer-model-from-checkpoint-args", 0,
                 "ptdp takes the tokenizer from the command line's flags, else from the "
                 "checkpoint only when no tokenizer flag is given"),
    AcceptedFlag("--tokenizer-hf-include-special-tokens", 0,
                 "it changes how Megatron-LM's Hugging Face tokenizer encodes text, which training "
                 "on preprocessed data or --mock-data does not do; `ptdp preprocess` encodes as "
                 "the tokenizer.json says"),
) + tuple(AcceptedFlag(name, 1, "ptdp does not log to Weights & Biases; it writes TensorBoard "
                       "event files (--tensorboard-dir DIR), under Megatron-LM's tag names")
          for name in ("--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
                       "--wandb-entity")) + (
    # Refused: ptdp cannot do what these ask.
    AcceptedFlag("--fp8-format", 1, _FP8, refused=True),
    AcceptedFlag("--fp8-recipe", 1, _FP8, refused=True),
    AcceptedFlag("--fp8-margin", 1, _FP8, refused=True),
    AcceptedFlag("--fp8-amax-history-len", 1, _FP8, refused=True),
    AcceptedFlag("--fp8-amax-compute-algo", 1, _FP8, refused=True),
    AcceptedFlag("--fp8-param-gather", 0, _FP8, refused=True),
    # fsdp_dtensor is what Megatron-FSDP's sharded runs save (its DeepSeek-V3
    # script gives it): ptdp's own format is that too, loadable under any
    # layout and sharding strategy. The others are refused as before.
    AcceptedFlag("--ckpt-format", 1,
                 "ptdp writes its own checkpoint format (safetensors + JSON), which loads under any "
                 "layout and sharding strategy as fsdp_dtensor does; Megatron-LM cannot read it "
                 "(`ptdp convert --to-hf` exports the model)",
                 choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
                 refused_choices=("torch", "torch_dist", "torch_dcp"),
                 refusal="ptdp writes and reads its own checkpoint format (safetensors + JSON, "
                         "loadable under any layout), not Megatron-LM's: drop --ckpt-format"),
    AcceptedFlag("--step-batch-size-schedule", 1,
                 "Megatron-LM's newest batch-size schedule is not implemented: use "
                 "--rampup-batch-size START INCREMENT SAMPLES with --train-samples", refused=True),
) + MOE_FLAGS + OWN_LINES + tuple(
    AcceptedFlag(name, arity, family.explanation, refused=family.refused, listed=False)
    for family in FAMILIES for name, arity in family.flags())

# Megatron-LM's newer spellings of ptdp's settings: the same setting.
SPELLINGS = {"--override-opt-param-scheduler": "--override-opt_param-scheduler",
             "--use-checkpoint-opt-param-scheduler": "--use-checkpoint-opt_param-scheduler",
             "--disable-manual-gc-eval": "--no-manual-gc-eval"}

# Values of Megatron-LM's choices that ptdp's settings do not have, each
# refused by name (ptdp.argparser.CommandParser reads `refused_values`).
_NOT_YET = "not yet in ptdp: give --position-embedding-type rope or learned_absolute"
REFUSED_VALUES: dict[str, dict[str, str]] = {
    "--position-embedding-type": {
        "mrope": f"the multimodal rotary embedding (Qwen2-VL's) is {_NOT_YET}",
        "relative": f"T5's relative position buckets are {_NOT_YET}",
        "none": f"a model without position information (NoPE) is {_NOT_YET}"},
    "--tokenizer-type": {
        **dict.fromkeys(("BertWordPieceLowerCase", "BertWordPieceCase"),
                        "BERT's WordPiece tokenizers are not in ptdp: give HuggingFaceTokenizer with "
                        "the tokenizer's directory (--tokenizer-model)"),
        "GPTSentencePieceTokenizer": "not in ptdp: give Llama2Tokenizer (the model's bos and eos) or "
                                     "SentencePieceTokenizer (Megatron-LM's added tokens)",
        **dict.fromkeys(("MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"),
                        "Megatron-LM's multimodal and SFT tokenizers are not in ptdp: give "
                        "HuggingFaceTokenizer or NullTokenizer")},
}


def add_accepted_flags(parser: argparse.ArgumentParser) -> None:
    """The flags above, in a help group of their own; after the settings'
    flags, whose Megatron-LM spellings and refused values it adds. A flag
    that has become a setting of ptdp is the setting (tests/test_megatron_flags.py
    asks for it to leave the table)."""
    hidden = sum(not accepted.listed for accepted in ACCEPTED)
    group = parser.add_argument_group(
        "Megatron-LM flags accepted for compatibility",
        f"each is explained in one line when given; the refused ones say what to use instead. "
        f"{hidden} more of Megatron-LM's flags, not listed here, are accepted or refused the same "
        f"way (docs/megatron-flags.md)")
    taken = parser._option_string_actions
    for accepted in ACCEPTED:
        if accepted.name in taken:
            continue
        kind = ("refused: " if accepted.refused else "" if accepted.is_alias else "no effect: ")
        kwargs: dict[str, Any] = {"dest": accepted.dest, "default": argparse.SUPPRESS,
                                  "help": kind + accepted.explanation}
        if accepted.refused_choices:
            kwargs["help"] += (f"; {', '.join(accepted.refused_choices)} refused: "
                               f"{accepted.refusal}")
        if not accepted.listed:
            kwargs["help"] = argparse.SUPPRESS
        if accepted.alias_of:
            kwargs.update(action=_AliasAction, type=int, metavar="N",
                          settings=((accepted.alias_of, None),))
        elif accepted.alias_values:
            kwargs.update(action=_AliasAction, settings=dict(accepted.alias_values),
                          choices=accepted.choices,
                          metavar="{" + ",".join(accepted.choices) + "}")
        elif accepted.alias_settings:
            kwargs.update(action=_AliasAction, nargs=0, settings=accepted.alias_settings)
        elif accepted.values == 0:
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = "VALUE"
            if accepted.values != 1:
                kwargs["nargs"] = accepted.values
            if accepted.choices:
                kwargs["choices"] = accepted.choices
                kwargs["metavar"] = "{" + ",".join(accepted.choices) + "}"
        group.add_argument(accepted.name, **kwargs)
    for spelling, flag in SPELLINGS.items():
        setting = taken[flag]
        group.add_argument(spelling, dest=setting.dest, default=argparse.SUPPRESS,
                           action="store_false" if isinstance(setting, argparse._StoreFalseAction)
                           else "store_true", help=f"Megatron-LM's newer spelling of {flag}")
    for flag, refused in REFUSED_VALUES.items():
        taken[flag].refused_values = refused  # said by name, not as an invalid choice


class _AliasAction(argparse.Action):
    """Stores the value (a switch: True) under the flag's own name and,
    unless the settings it is another name for were given already, as those
    settings too: (setting, value) pairs, a value of None meaning the flag's
    own, or {flag value: such pairs} (`given` finds a disagreement whichever
    came first)."""

    def __init__(self, *args: Any, settings: tuple[tuple[str, Any], ...] | dict, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        settings = (self.settings.get(values, ()) if isinstance(self.settings, dict)
                    else self.settings)
        for setting, value in settings:
            if not hasattr(namespace, setting):
                setattr(namespace, setting, values if value is None else value)


def given(args: argparse.Namespace) -> list[tuple[AcceptedFlag, Any]]:
    """The accepted flags on this command line, with their values; an alias
    whose setting was given another value comes back refused, saying so."""
    found = []
    for accepted in ACCEPTED:
        if not hasattr(args, accepted.dest):
            continue
        value = getattr(args, accepted.dest)
        for setting, wanted in accepted.settings_for(value) + tuple(
                (setting, wanted) for needed_by, setting, wanted in accepted.needs
                if needed_by == value):
            other = getattr(args, setting, wanted)
            if other != wanted:
                accepted = replace(accepted, refused=True,
                                   explanation=_conflict(accepted, setting, wanted, other))
                break
        found.append((accepted, value))
    return found


def _conflict(accepted: AcceptedFlag, setting: str, wanted: Any, other: Any) -> str:
    """Why a flag given with a setting it contradicts is refused."""
    shown = _setting_shown(setting, other)
    if accepted.conflict_reason:
        return (f"conflicts with {shown}: ptdp takes it as {_setting_shown(setting, wanted)} "
                f"({accepted.conflict_reason}); give one of the two (or agreeing values)")
    meant = "that flag" if accepted.alias_of else _setting_shown(setting, wanted)
    return (f"conflicts with {shown}: it is Megatron-LM's other name for {meant}; give one of the "
            f"two (or the same value)")


def _setting_shown(setting: str, value: Any) -> str:
    """A setting's value as its flag: --flag VALUE, or a switch's spelling."""
    from ptdp.config import flag_of
    from ptdp.config.sections import SECTION_TYPES

    section, name = setting.split(".")
    if not isinstance(value, bool):
        return f"{flag_of(section, name)} {value}"
    field = next(f for f in fields(SECTION_TYPES[section]) if f.name == name)
    return field.metadata["flag"] if value else field.metadata.get(
        "off_flag", f"{field.metadata['flag']} false")


def _shown(accepted: AcceptedFlag, value: Any) -> str:
    if accepted.values == 0:
        return accepted.name
    return " ".join([accepted.name, *map(str, value if isinstance(value, list) else [value])])


def _refused(accepted: AcceptedFlag, value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return accepted.refused or any(v in accepted.refused_choices for v in values)


def refusals(flags: list[tuple[AcceptedFlag, Any]]) -> list[str]:
    """One problem per refused flag given (for the pre-launch report)."""
    return [f"{_shown(a, v)}: {a.explanation if a.refused else a.refusal}" for a, v in flags
            if _refused(a, v)]


def notes(flags: list[tuple[AcceptedFlag, Any]]) -> list[str]:
    """One line per accepted flag given, printed before the run starts."""
    return [f"ptdp: {_shown(a, v)}" + (": " if a.is_alias else " has no effect: ") + a.explanation
            for a, v in flags if not _refused(a, v)]


_ATTENTION_NOTE = ("ptdp picks its attention kernels itself: PyTorch's scaled_dot_product_attention, "
                   "which picks its kernel (flash attention where the device, precision and "
                   "shapes allow it) per call, or for sliding windows and sinks block kernels "
                   "that each return their log-sum-exp; the first rank reports the one it picks "
                   "for this run")


def config_notes(config) -> list[str]:
    """Notes for the explained flags that live in the config (the worker
    reads them to report the attention kernel)."""
    lines = []
    data = config.data
    if data.tokenizer_type != "TikTokenizer":  # Megatron-LM's scripts pass them regardless
        for name, value, default in (
                ("--tiktoken-pattern", data.tiktoken_pattern, None),
                ("--tiktoken-num-special-tokens", data.tiktoken_num_special_tokens, 1000),
                ("--tokenizer-special-tokens", data.tokenizer_special_tokens, None)):
            if value != default:
                shown = " ".join(value) if isinstance(value, list) else value
                lines.append(f"ptdp: {name} {shown} has no effect: only --tokenizer-type "
                             f"TikTokenizer reads it, not the {data.tokenizer_type}")
    train = config.train
    if not train.load:  # Megatron-LM accepts them without --load too
        lines += [f"ptdp: {name} has no effect without --load: no checkpoint is loaded, so "
                  f"nothing is left out of one" for name, on in (
                      ("--no-load-optim", train.load_optim is False),
                      ("--no-load-rng", train.load_rng is False)) if on and not train.finetune]
    if config.model.multi_latent_attention and config.model.kv_channels is not None:
        lines.append(f"ptdp: --kv-channels {config.model.kv_channels} has no effect with "
                     f"--multi-latent-attention: MLA's head widths are --qk-head-dim + "
                     f"--qk-pos-emb-head-dim (queries and keys) and --v-head-dim (values), as in "
                     f"Megatron-LM")
    if config.model.moe_token_dispatcher_type == "flex":
        lines.append("ptdp: --moe-token-dispatcher-type flex runs as ptdp's alltoall dispatcher: "
                     "Megatron-LM's flex dispatcher is an all-to-all on DeepEP, HybridEP or NCCL-EP "
                     "kernels, which ptdp does not use; the same tokens reach the same experts")
    if config.model.use_flash_attn:
        lines.append(f"ptdp: --use-flash-attn has no effect: {_ATTENTION_NOTE}")
    if config.model.attention_backend != "auto":
        lines.append(f"ptdp: --attention-backend {config.model.attention_backend} has no effect: "
                     f"{_ATTENTION_NOTE}")
    return lines


def reports_attention_kernel(config) -> bool:
    return config.model.use_flash_attn or config.model.attention_backend != "auto"
