"""What ptdp does with each of Megatron-LM's flags that it has no setting
for, family by family: one line says what the family is in Megatron-LM and
what ptdp does (accepted, no effect) or offers instead (refused).

ptdp/config/megatron_flag_list.py pins every flag of Megatron-LM's parser;
ptdp/config/megatron.py turns each family into flags of `ptdp train` (and
holds the flags that need a note or a refusal of their own). A flag ptdp
implements is an ordinary setting in ptdp.config, not here.

A family is accepted when its flags choose how Megatron-LM computes, logs or
stores what ptdp computes the same way (a fused kernel, a communication
overlap, a checkpoint format's internals): a Megatron-LM script keeps working
and a line before the run says the flag has no effect. It is refused when
its flags change the model, the data, the optimisation or what the run
produces in a way ptdp cannot do (multi-latent attention, FP8, FSDP...):
the run stops before launch with what to use instead. Each family lists its
flags by arity, as Megatron-LM parses them: switches, flags with one value,
and flags with one or more (`lists`) or any number (`optional_lists`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Flags of one kind: `what` they are in Megatron-LM, and `ptdp` what
    ptdp does instead (accepted) or offers instead (refused)."""
    what: str
    ptdp: str
    refused: bool = False
    switches: str = ""
    values: str = ""
    lists: str = ""
    optional_lists: str = ""

    @property
    def explanation(self) -> str:
        if self.refused:
            return f"{self.what}, which ptdp does not have: {self.ptdp}"
        return f"{self.what}; {self.ptdp}"

    def flags(self) -> list[tuple[str, int | str]]:
        """(flag, its arity: 0, 1, "+" or "*") for each flag of the family."""
        return [(name, arity) for names, arity in ((self.switches, 0), (self.values, 1),
                                                    (self.lists, "+"), (self.optional_lists, "*"))
                for name in names.split()]


KERNELS = Family(
    'a choice of fused kernel or implementation (Transformer Engine, Apex, JIT fusion)',
    "ptdp's layers are plain PyTorch with no fused variant to choose; the model computes the same",
    switches="""
        --disable-clone-scatter-output-in-embedding --disable-jit-fuser --fused-residual-rmsnorm
        --no-bias-swiglu-fusion --no-clone-scatter-output-in-embedding --no-persist-layer-norm
        --no-rope-fusion --use-fused-weighted-squared-relu --use-te-activation-func
        --use-transformer-engine-op-fuser""",
    values="""
        --cross-entropy-fusion-impl --flash-attention-version --onnx-safe""")

CUDA_GRAPHS = Family(
    'CUDA-graph capture, which replays the same kernels with less launch overhead',
    'ptdp runs eagerly; the results are the same',
    switches="""
        --delay-offload-until-cuda-graph --enable-cuda-graph --external-cuda-graph
        --optimizer-cuda-graph""",
    values="""
        --cuda-graph-impl --cuda-graph-warmup-steps""",
    lists="""
        --cuda-graph-modules --cuda-graph-scope""")

OVERLAP = Family(
    'how communication is bucketed, scheduled and overlapped with computation',
    "ptdp's own schedule (bucketed gradient reductions overlapped with the backward, batched "
    "pipeline exchanges) computes the same results",
    switches="""
        --create-all-gather-group --ddp-average-in-collective
        --ddp-pad-buckets-for-high-nccl-busbw --defer-embedding-wgrad-compute
        --disable-align-grad-reduce --disable-gloo-process-groups --disable-symmetric-registration
        --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag
        --disable-tp-comm-overlap-rs --disable-tp-comm-split-ag --disable-tp-comm-split-rs
        --ep-overlap-early-attn-memory-release --high-priority-a2a-comm-stream
        --no-align-grad-reduce --no-align-param-gather --no-gradient-reduce-div-fusion
        --no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag
        --no-tp-comm-overlap-rs --no-tp-comm-split-ag --no-tp-comm-split-rs
        --no-use-layer-wise-param-layout --overlap-p2p-communication-warmup-flush
        --overlap-param-gather-with-optimizer-step --tp-comm-overlap --tp-comm-overlap-rs-dgrad
        --use-nccl-ub --use-ring-exchange-p2p --use-sharp""",
    values="""
        --ddp-num-buckets --microbatch-group-size-per-virtual-pipeline-stage
        --nccl-communicator-config-path --pipeline-model-parallel-comm-backend
        --sharp-enabled-group --symmetric-ar-type --tp-comm-bootstrap-backend
        --tp-comm-overlap-cfg --train-sync-interval --wgrad-deferral-limit""",
    lists="""
        --high-priority-stream-groups""")

OBSERVABILITY = Family(
    "an extra log, trace, profile or debugging dump of Megatron-LM's",
    "ptdp does not write it; the run trains the same (ptdp's log line, --metrics-file, "
    "--tensorboard-dir and --profile are what it records)",
    switches="""
        --disable-flight-recorder-dump-on-timeout --disable-flight-recorder-extra-dump-on-exec
        --disable-flight-recorder-include-only-active --disable-log-loss-scale-to-tensorboard
        --disable-straggler-on-startup --flight-recorder-include-stack-trace --log-energy
        --log-max-attention-logit --log-progress --log-straggler --log-world-size-to-tensorboard
        --moe-routing-trace-capture-hidden-states --moe-routing-trace-capture-logits
        --moe-routing-trace-dump-weights --no-barrier-with-level-1-timing
        --no-flight-recorder-dump-on-timeout --no-flight-recorder-extra-dump-on-exec
        --no-flight-recorder-include-only-active --no-log-loss-scale-to-tensorboard
        --no-one-logger --nvtx-ranges --one-logger-async --otel-enabled
        --pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra
        --pytorch-profiler-collect-shapes --record-memory-history --record-shapes
        --run-workload-inspector-server --test-mode""",
    values="""
        --app-tag-run-name --app-tag-run-version --check-weight-hash-across-dp-replicas-interval
        --config-logger-dir --dump-param-to-param-group-map --flight-recorder-dump-path
        --flight-recorder-trace-buffer-size --gpu-sniff-test-interval --memory-snapshot-path
        --moe-routing-trace-max-training-iters --moe-routing-trace-path --one-logger-project
        --one-logger-run-name --otel-service-name --otel-span-groups
        --result-rejected-tracker-filename --save-activations-interval --save-dgrads-interval
        --save-params-interval --save-tokens-per-expert-interval --save-wgrads-interval
        --straggler-ctrlr-port --straggler-minmax-count --tensorboard-queue-size
        --timing-log-option""")

MEMORY_LOG = Family(
    "Megatron-LM's memory report",
    "ptdp always logs each rank's peak memory (RSS on CPU, the allocator's peak on CUDA) in the "
    "log line, --metrics-file and --tensorboard-dir",
    switches="""
        --log-device-memory-used --log-memory-to-tensorboard""",
    values="""
        --log-memory-interval""")

INFERENCE = Family(
    "a setting of Megatron-LM's inference engine",
    'training does not use it; `ptdp generate` has its own flags',
    switches="""
        --decode-only-cuda-graphs --enable-chunked-prefill --flash-decode
        --inference-cuda-graph-all-prefills --inference-disable-ep-consensus
        --inference-disable-triton-nvls-kernels --inference-dynamic-batching
        --inference-dynamic-batching-prefix-caching
        --inference-dynamic-batching-track-generated-token-events
        --inference-dynamic-batching-track-paused-request-events --inference-fuse-tp-communication
        --inference-moe-disable-fused-quant-kernels --inference-rng-tracker
        --inference-text-gen-server-logging --inference-use-synchronous-zmq-collectives
        --inference-wandb-logging --nccl-all-reduce-for-prefill
        --no-inference-disable-ep-consensus --no-inference-dynamic-batching-prefix-caching
        --no-inference-text-gen-server-logging --no-inference-use-synchronous-zmq-collectives
        --no-inference-wandb-logging --output-bert-embeddings --use-legacy-static-engine
        --use-same-sampling-seed-across-dp-ranks""",
    values="""
        --bert-embedder-type --inference-batch-times-seqlen-threshold --inference-coordinator-port
        --inference-cuda-graph-max-tokens --inference-cuda-graph-scope
        --inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-block-size
        --inference-dynamic-batching-buffer-size-gb
        --inference-dynamic-batching-cuda-graph-mixed-prefill-count
        --inference-dynamic-batching-cuda-graph-sizing-distribution
        --inference-dynamic-batching-logprobs-mode --inference-dynamic-batching-mamba-memory-ratio
        --inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens
        --inference-dynamic-batching-num-cuda-graphs
        --inference-dynamic-batching-paused-buffer-size-gb
        --inference-dynamic-batching-prefix-caching-coordinator-policy
        --inference-dynamic-batching-prefix-caching-eviction-policy
        --inference-dynamic-batching-prefix-caching-mamba-gb
        --inference-dynamic-batching-prefix-caching-routing-alpha
        --inference-dynamic-batching-sampling-backend
        --inference-dynamic-batching-unified-memory-level --inference-grouped-gemm-backend
        --inference-logging-step-interval --inference-moe-token-dispatcher-type --inference-shards
        --mamba-inference-conv-states-dtype --mamba-inference-ssm-states-dtype --max-tokens-to-oom
        --mlp-chunks-for-prefill --num-speculative-tokens""")

OTHER_MODELS = Family(
    "a setting of Megatron-LM's BERT, T5, retrieval or vision training",
    'pretrain_gpt.py does not read it either',
    switches="""
        --bert-no-binary-head --biencoder-shared-query-context-model --dino-norm-last-layer
        --no-data-sharding --retriever-score-scaling --use-one-sent-docs --vision-pretraining""",
    values="""
        --bert-load --biencoder-projection-dim --block-data-path --classes-fraction
        --data-per-class-fraction --decoder-seq-length --dino-bottleneck-size
        --dino-freeze-last-layer --dino-head-hidden-size --dino-local-crops-number
        --dino-local-img-size --dino-teacher-temp --dino-warmup-teacher-temp
        --dino-warmup-teacher-temp-epochs --embedding-path --evidence-data-path --head-lr-mult
        --ict-head-size --ict-load --img-h --img-w --indexer-batch-size --indexer-log-interval
        --iter-per-epoch --mask-factor --mask-prob --mask-type --num-channels --num-classes
        --patch-dim --query-in-block-prob --sample-rate --short-seq-prob --swin-backbone-type
        --titles-data-path --vision-backbone-type --vision-pretraining-type --vocab-extra-ids""",
    lists="""
        --retriever-report-topk-accuracies""")

CHECKPOINT_INTERNALS = Family(
    'how Megatron-LM writes, reads or checks its own checkpoint formats',
    "ptdp writes its own format (safetensors + JSON), every tensor checksummed and checked when "
    "read, loadable under any layout; a --load with nothing to load is an error, unless it is "
    "also --save (a first run, which starts at iteration 0)",
    switches="""
        --async-ckpt-use-cpu-shm --auto-detect-ckpt-format --ckpt-assume-constant-structure
        --ckpt-convert-update-legacy-dist-opt-format --ckpt-drop-redundant-extra-state
        --ckpt-fully-parallel-load --ckpt-fully-parallel-load-per-rank-objects
        --ckpt-fully-parallel-save --ckpt-pg-tensors-cache-create
        --disable-ckpt-load-validate-sharding-integrity --disable-strict-fsdp-dtensor-load
        --dist-ckpt-optim-fully-reshardable --dist-ckpt-save-pre-mcore-014
        --distrib-optim-fully-reshardable-mem-efficient --exit-on-missing-checkpoint
        --no-ckpt-fully-parallel-save --no-ckpt-load-validate-sharding-integrity
        --no-strict-fsdp-dtensor-load --use-mp-args-from-checkpoint-args
        --use-persistent-ckpt-worker --verify-integrity""",
    values="""
        --async-ckpt-cpu-priority --async-ckpt-io-priority --async-strategy
        --ckpt-fully-parallel-load-exchange-algo --ckpt-fully-parallel-load-process-group
        --ckpt-fully-parallel-save-process-group --ckpt-pg-tensors-cache-path --dist-ckpt-workers""")

CHECKPOINT_CONTENTS = Family(
    'what Megatron-LM leaves out of the checkpoints it saves',
    "ptdp's checkpoints always carry the optimizer and random states and the tokenizer's settings,"
    " so that a resume is exact; --no-load-optim and --no-load-rng leave them out when loading",
    switches="""
        --disable-save-tokenizer-assets --no-save-optim --no-save-rng --no-save-tokenizer-assets""")

TOKENIZER_ENCODING = Family(
    "a setting of how Megatron-LM's tokenizer encodes text",
    "ptdp train reads preprocessed (or mock) data and encodes no text; `ptdp preprocess` encodes "
    "as the tokenizer's own files say",
    switches="""
        --disable-tokenizer-sentencepiece-ignore-extra-whitespaces
        --disable-use-tokenizer-model-from-checkpoint-args
        --no-tokenizer-sentencepiece-ignore-extra-whitespaces
        --tokenizer-hf-no-include-special-tokens --tokenizer-hf-no-use-fast
        --tokenizer-sentencepiece-legacy --trust-remote-code --use-gigatoken""",
    values="""
        --tokenizer-metadata""")

FAULT_TOLERANCE = Family(
    "NVIDIA's cluster auto-resume, fault-tolerance or in-process restart service",
    'ptdp saves on SIGTERM (and --exit-signal), exits 0, and a requeued job resumes with --load',
    switches="""
        --adlr-autoresume --calc-ft-timeouts --enable-ft-package --inprocess-empty-cuda-cache
        --inprocess-restart""",
    values="""
        --adlr-autoresume-interval --ft-num-warmup-iters --inprocess-active-world-size
        --inprocess-barrier-timeout --inprocess-completion-timeout --inprocess-granularity
        --inprocess-hard-timeout --inprocess-heartbeat-interval --inprocess-heartbeat-timeout
        --inprocess-last-call-wait --inprocess-max-iterations --inprocess-monitor-process-interval
        --inprocess-monitor-thread-interval --inprocess-progress-watchdog-interval
        --inprocess-soft-timeout --inprocess-termination-grace-time""")

DATASET_BUILD = Family(
    'how Megatron-LM builds or caches its dataset indices',
    'ptdp builds the same samples its own way (--data-cache-path keeps its indices)',
    switches="""
        --allow-ambiguous-pad-tokens --dataloader-defer-npy-index-mmap
        --dataloader-fast-cache-load --disable-msc --enable-msc""",
    values="""
        --mid-level-dataset-surplus --num-dataset-builder-threads --object-storage-cache-path
        --per-dataset-sequences-path""")

RERUN = Family(
    "a check of Megatron-LM's re-run state machine",
    "ptdp stops on a non-finite loss or gradient (unless --no-check-for-nan-in-loss-and-grad) and "
    "re-runs no iteration",
    switches="""
        --check-for-large-grads --check-for-spiky-loss""",
    values="""
        --rerun-mode""")

# Multi-latent attention itself (--multi-latent-attention, --q-lora-rank, ...)
# is a ptdp setting (ptdp.config.mla); these two choose how Megatron-LM runs it.
MLA_DOWN_PROJECTION_FUSION = Family(
    "multi-latent attention's query and key/value down projections (and the layer's input norm) "
    "fused into one product",
    "ptdp's MLA computes the two down projections apart, the same model",
    switches="""
        --mla-down-proj-fusion""")

MLA_LATENT_CACHE = Family(
    "a cache of multi-latent attention's latents for Megatron-LM's inference engine (Flash MLA "
    "decoding; it refuses it while training)",
    "drop --cache-mla-latents: ptdp trains, and its generation recomputes keys and values",
    refused=True,
    switches="""
        --cache-mla-latents""")

# --mtp-num-layers and --mtp-loss-scaling-factor are ptdp settings (ptdp.config.mtp);
# these variants of the modules change what they compute or where they run.
MULTI_TOKEN_PREDICTION = Family(
    "a variant of multi-token prediction (detached heads, hidden-state mixing, one module "
    "repeated, MTP on a pipeline stage of its own, a hybrid model's MTP pattern)",
    "use --mtp-num-layers D (D modules of their own, on the last pipeline stage) with "
    "--mtp-loss-scaling-factor, or drop the flag",
    refused=True,
    switches="""
        --mtp-detach-heads --mtp-hsm --mtp-standalone --mtp-use-repeated-layer""",
    values="""
        --mtp-hybrid-override-pattern""")

ROPE_VARIANTS = Family(
    "a variant of the position embedding (interleaved, multimodal or relative rotary, or "
    "layers without it)",
    "use --position-embedding-type rope (halves rotated, Llama's layout) with --rotary-base, or "
    "learned_absolute",
    refused=True,
    switches="""
        --rotary-interleaved""",
    values="""
        --no-rope-freq --relative-attention-max-distance --relative-attention-num-buckets""",
    lists="""
        --mrope-section""")

ATTENTION_VARIANTS = Family(
    "an attention variant (Llama 4's qk L2 norm, gated output, qk-clip, linear or sparse "
    "attention: Gated DeltaNet, DSA)",
    "use ptdp's softmax attention, with --qk-layernorm for normalised queries and keys",
    refused=True,
    switches="""
        --attention-output-gate --disable-dsa-indexer-rotate-activation
        --disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-fp32
        --dsa-indexer-rope-interleaved --dsa-indexer-use-sparse-loss --gdp-cutedsl-kernel
        --no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu --qk-clip --qk-l2-norm
        --use-kitchen-attention""",
    values="""
        --dsa-indexer-head-dim --dsa-indexer-k-norm-epsilon --dsa-indexer-loss-coeff
        --dsa-indexer-n-heads --dsa-indexer-skip-topk-offset --dsa-indexer-topk
        --dsa-indexer-topk-freq --dsa-kernel-backend --experimental-attention-variant
        --gdp-num-chunk-states-to-recompute --gdp-num-householder --kitchen-attention-backend
        --linear-attention-freq --linear-conv-kernel-dim --linear-key-head-dim
        --linear-num-key-heads --linear-num-value-heads --linear-value-head-dim --qk-clip-alpha
        --qk-clip-threshold""")

HYBRID_MODELS = Family(
    'Mamba layers and hybrid Mamba-Transformer models',
    'ptdp trains decoder transformers only',
    refused=True,
    switches="""
        --disable-mamba-mem-eff-path --is-hybrid-model""",
    values="""
        --hybrid-layer-pattern --hybrid-override-pattern --mamba-head-dim --mamba-num-groups
        --mamba-num-heads --mamba-state-dim --mamba-training-ssm-states-dtype""")

BLOCK_VARIANTS = Family(
    "a change to the transformer block (hyper-connections, post-norm residuals, per-layer "
    "heterogeneous configs, a custom layer spec)",
    "ptdp's block is the pre-norm GPT/Llama block: drop it",
    refused=True,
    switches="""
        --apply-residual-connection-post-layernorm --enable-mhc-connections""",
    values="""
        --heterogeneous-layers-config-encoded-json --heterogeneous-layers-config-path
        --mhc-init-gating-factor --mhc-num-residual-streams --mhc-recompute-layer-num
        --mhc-sinkhorn-iterations""",
    optional_lists="""
        --spec""")

MUP = Family(
    'maximal update parametrisation (MuP)',
    'drop the --mup flags; set --init-method-std and --lr for the width you train',
    refused=True,
    switches="""
        --use-mup""",
    values="""
        --mup-attn-scale-power --mup-base-head-dim --mup-base-hidden-size --mup-embedding-mult
        --mup-output-mult --mup-width-mult""")

ACTIVATIONS = Family(
    'another MLP activation',
    'use GELU (the default), --swiglu, --geglu or --quick-geglu',
    refused=True,
    switches="""
        --openai-gelu --squared-relu""")

INITIALISATION = Family(
    'another weight initialisation',
    "ptdp draws every weight from N(0, --init-method-std) (output layers scaled by the depth, as "
    "Megatron-LM does), the same on every data-parallel rank",
    refused=True,
    switches="""
        --data-parallel-random-init --init-method-xavier-uniform""",
    values="""
        --embedding-init-method-std""")

NUMERICS = Family(
    "a change to Megatron-LM's numerics (fp32 residuals, query-key layer scaling, fp16 "
    "cross-entropy or logits, deterministic or batch-invariant kernels)",
    "ptdp keeps residuals in the training precision and computes the logits' cross-entropy in "
    "fp32: drop it",
    refused=True,
    switches="""
        --apply-query-key-layer-scaling --batch-invariant-mode --deterministic-mode
        --fp16-lm-cross-entropy --fp32-residual-connection""",
    values="""
        --batch-invariant-backend --output-logit-dtype""")

LOW_PRECISION = Family(
    "FP8/FP4 training through Transformer Engine (or NVIDIA's kitchen quantization)",
    'train with --bf16 and drop it',
    refused=True,
    switches="""
        --disable-fp8-wgrad --first-last-layers-bf16 --fp4-param-gather --fp8-output-proj
        --keep-fp8-transpose-cache --no-fp8-wgrad --reuse-grad-buf-for-mxfp8-param-ag""",
    values="""
        --fp4-format --fp4-quantizer-factory --fp4-recipe --fp8-interval --fp8-quantizer-factory
        --kitchen-config-file --kitchen-recipe-number --num-layers-at-end-in-bf16
        --num-layers-at-start-in-bf16 --te-precision-config-file""")

WEIGHT_DECAY_VARIANTS = Family(
    'a weight-decay schedule, selection or parameter freezing',
    "ptdp applies a constant --weight-decay to the matrices (not to biases and norms) and trains "
    "every weight",
    refused=True,
    switches="""
        --apply-wd-to-qk-layernorm --freeze-all-layers""",
    values="""
        --end-weight-decay --no-weight-decay-cond-type --start-weight-decay""")

OTHER_OPTIMIZERS = Family(
    'a setting of an optimizer ptdp does not have (Muon, Lion, SGD)',
    'ptdp trains with Adam (--adam-beta1, --adam-beta2, --adam-eps): drop it',
    refused=True,
    switches="""
        --muon-nesterov --muon-no-split-qkv --muon-use-syrk""",
    values="""
        --lion-beta1 --lion-beta2 --muon-coefficient-type --muon-extra-scale-factor
        --muon-fp32-matmul-prec --muon-momentum --muon-num-ns-steps --muon-scalar-optimizer
        --muon-scale-mode --muon-tp-mode --sgd-momentum""")

OFFLOADING = Family(
    "offloading activations or optimizer state to host memory (or splitting the MLP along the "
    "sequence) to save device memory",
    "use activation recomputation (--recompute-granularity selective or full) and "
    "--use-distributed-optimizer",
    refused=True,
    switches="""
        --cpu-offloading-retain-pinned-cpu-buffers --distribute-saved-activations
        --fine-grained-activation-offloading --no-pin-cpu-grads --no-pin-cpu-params
        --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
        --use-torch-optimizer-for-cpu-offload""",
    values="""
        --activation-offload-fraction --cpu-offloading-num-layers
        --delta-offload-bytes-across-pp-ranks --fine-grained-offloading-max-inflight-offloads
        --min-offloaded-tensor-size --mlp-chunks-for-training --optimizer-offload-fraction""",
    lists="""
        --offload-modules""")

FSDP_BUFFERS = Family(
    "Megatron-FSDP's buffer, registration, prefetch and initialisation choices",
    "ptdp's sharding (--use-megatron-fsdp --data-parallel-sharding-strategy) keeps its own "
    "buffers and computes the same",
    switches="""
        --fsdp-db-use-persist-buf-on-alloc-fail --fsdp-double-buffer --fsdp-manual-registration
        --init-model-with-meta-device --megatron-fsdp-enable-fine-grained-param-gather
        --megatron-fsdp-max-pool-double-buffer""",
    values="""
        --megatron-fsdp-version --suggested-communication-unit-size""")

FSDP = Family(
    "Megatron-FSDP's and torch FSDP2's other settings (HSDP, accumulation patterns)",
    'ptdp shards with --use-megatron-fsdp --data-parallel-sharding-strategy; leave these out',
    refused=True,
    switches="""
        --ddp-reduce-scatter-with-fp32-accumulation --enable-full-sharding-in-hsdp""",
    values="""
        --num-distributed-optimizer-instances --outer-dp-sharding-strategy""",
    lists="""
        --ddp-param-name-patterns-for-fp32-local-accumulation""")

GTP = Family(
    'GTP weight sharding beyond the tensor-parallel ranks',
    'use --tensor-model-parallel-size and --use-distributed-optimizer',
    refused=True,
    switches="""
        --gtp-expert-remat-nccl-ub --gtp-remat-nccl-ub
        --gtp-remat-reduce-scatter-with-fp32-accumulation""",
    values="""
        --tensor-parallel-num-weight-shards""",
    lists="""
        --gtp-remat-opt-in-modules""")

CONTEXT_VARIANTS = Family(
    'hierarchical or hybrid (workload-balanced) context parallelism',
    'use --context-parallel-size with --cp-comm-type p2p, all_gather or a2a',
    refused=True,
    switches="""
        --hybrid-context-parallel""",
    values="""
        --max-seqlen-per-dp-cp-rank""",
    lists="""
        --hierarchical-context-parallel-sizes""")

LAYOUT = Family(
    'a custom pipeline layout or rank order',
    "ptdp orders ranks tensor, context, data, pipeline (Megatron-Core's default) and splits layers"
    " evenly or by --decoder-first/last-pipeline-num-layers",
    refused=True,
    switches="""
        --use-tp-pp-dp-mapping""",
    values="""
        --pipeline-model-parallel-layout""")

PROCESS_GROUP = Family(
    "Megatron-LM's deferred or fake process-group set-up",
    "ptdp joins the job's process group itself: drop it",
    refused=True,
    switches="""
        --fake-process-group --lazy-mpu-init""")

DATA_FEATURES = Family(
    "a data feature ptdp's GPT dataset does not have (fill-in-the-middle, data phases, "
    "skipped iterations, Megatron-LM's own inter-document masking and SFT prompt formats)",
    "drop it; for document-wise attention and positions give --reset-attention-mask and "
    "--reset-position-ids, for conversations --sft with the tokenizer's chat template",
    refused=True,
    switches="""
        --dataloader-inter-document-masking --fim-data""",
    values="""
        --fim-eod-token --fim-fragment-rate --fim-middle-token --fim-no-prefix --fim-pad-token
        --fim-prefix-token --fim-rate --fim-split-sample --fim-spm-rate --fim-suffix-token
        --phase-transition-iterations --sft-tokenizer-prompt-format""",
    lists="""
        --iterations-to-skip""")

SPLIT_PATHS = Family(
    'separate data paths per split',
    'give one --data-path (weights and prefixes) and --split',
    refused=True,
    values="""
        --data-args-path --per-split-data-args-path""",
    optional_lists="""
        --test-data-path --train-data-path --valid-data-path""")

EVALUATION_VARIANTS = Family(
    'an evaluation setting ptdp does not have',
    "ptdp evaluates --eval-iters batches of the training batch size every --eval-interval "
    "iterations",
    refused=True,
    switches="""
        --full-validation --multiple-validation-sets --skip-train""",
    values="""
        --eval-global-batch-size --eval-micro-batch-size --start-eval-at-iter""",
    lists="""
        --validation-set-names""")

CHECKPOINT_FEATURES = Family(
    "a Megatron-LM checkpointing feature (its distributed format, conversion, non-persistent or "
    "replicated checkpoints, retention, loading a chosen step or its main weights)",
    "ptdp saves its own format to --save every --save-interval iterations (--keep-last N keeps the"
    " newest); give --load DIR or DIR/iter_NNNNNNN; `ptdp convert` converts",
    refused=True,
    switches="""
        --load-main-params-from-ckpt --replication --use-dist-ckpt""",
    values="""
        --ckpt-convert-format --ckpt-convert-save --ckpt-step --dist-ckpt-format
        --non-persistent-ckpt-type --non-persistent-global-ckpt-dir
        --non-persistent-local-ckpt-algo --non-persistent-local-ckpt-dir
        --non-persistent-save-interval --override-ckpt-iteration --persistent-save-interval
        --replication-factor --replication-jump --save-retain-interval""")

VOCABULARY = Family(
    "another vocabulary padding or NullTokenizer's special ids",
    "ptdp pads the vocabulary to a multiple of --make-vocab-size-divisible-by × t (as Megatron-LM "
    "does) and NullTokenizer's end of document is the last id",
    refused=True,
    switches="""
        --disable-pad-vocab-size --no-pad-vocab-size""",
    values="""
        --null-tokenizer-eod-id --null-tokenizer-pad-id --padded-vocab-size""")

REMOVED = Family(
    'a flag Megatron-LM itself no longer accepts (or its encoder-decoder and YAML settings)',
    "use --micro-batch-size, --lr-warmup-fraction, --tensor-model-parallel-size, "
    "--recompute-activations, --num-layers or --config FILE, as Megatron-LM says",
    refused=True,
    switches="""
        --checkpoint-activations --decrease-batch-size-if-needed""",
    values="""
        --batch-size --decoder-num-layers --model-parallel-size --warmup --yaml-cfg""")

REINFORCEMENT_LEARNING = Family(
    "Megatron-LM's reinforcement learning (GRPO)",
    'ptdp does pretraining and fine-tuning on token data: drop it',
    refused=True,
    switches="""
        --grpo-filter-groups-with-same-reward --no-rl-inference-logprobs-is-correction
        --no-rl-offload-inference-model-weights-when-idle --no-rl-partial-rollouts
        --no-rl-persist-cuda-graphs --no-rl-skip-bos-token --no-rl-training-cuda-graphs
        --no-rl-use-sequence-packing --no-rl-verify-model-weights-swap --perform-rl-step
        --rl-durable-rollout-bank --rl-inference-logprobs-is-correction
        --rl-offload-inference-model-weights-when-idle --rl-offload-optimizer-during-inference
        --rl-partial-rollouts --rl-persist-cuda-graphs --rl-profile --rl-skip-bos-token
        --rl-training-cuda-graphs --rl-use-sequence-packing --rl-verify-model-weights-swap""",
    values="""
        --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-entropy-term-weight --grpo-group-size
        --grpo-iterations --grpo-kl-beta --grpo-prompts-per-step --langrl-env-config
        --refit-method --rl-consumption-granularity --rl-default-temperature --rl-default-top-k
        --rl-default-top-p --rl-generation-lag --rl-importance-sampling-truncation-coef
        --rl-inference-expert-model-parallel-size --rl-inference-expert-tensor-model-parallel-size
        --rl-inference-model-unified-memory-level --rl-inference-pipeline-model-parallel-size
        --rl-inference-tensor-model-parallel-size --rl-kv-cache-management-mode
        --rl-max-inflight-requests --rl-profile-dir --rl-prompts-per-eval --rl-rollout-bank-dir
        --rl-rollout-bank-max-bytes --rl-sequence-packing-algo
        --rl-sequence-packing-max-sequences-per-bin --rl-submission-granularity""",
    optional_lists="""
        --rl-inference-parsers""")

DISTILLATION = Family(
    "logits distillation from a teacher's saved logits",
    'drop it',
    refused=True,
    switches="""
        --logits-load-ignore-errors""",
    values="""
        --logits-load-decode-threads --logits-load-dir --logits-load-kd-loss-alpha
        --logits-load-msc-prefetch-depth --logits-load-prefetch-factor --logits-save-dir
        --logits-save-dtype --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k""")

MODEL_OPTIMIZER = Family(
    "NVIDIA Model Optimizer's quantization, distillation or export",
    'drop it; `ptdp convert --to-hf` exports',
    refused=True,
    switches="""
        --enable-gpt-oss --export-default-te-spec --export-force-local-attention
        --export-legacy-megatron --export-moe-apply-probs-on-input --export-offline-model
        --export-qk-l2-norm --export-te-mcore-model --freeze-base-for-mtp --modelopt-enabled""",
    values="""
        --export-kd-cfg --export-kd-teacher-ckpt-format --export-kd-teacher-load
        --export-kd-teacher-model-config --export-kv-cache-quant --export-model-type
        --export-quant-cfg --export-real-quant-cfg --finetune-data-split --finetune-hf-dataset
        --qad-train-target""",
    lists="""
        --finetune-data-files""")

FAULT_INJECTION = Family(
    "Megatron-LM's fault injection for testing",
    'drop it',
    refused=True,
    values="""
        --error-injection-rate --error-injection-type --fault-injector-delay-start-iteration
        --fault-injector-fault-delay --fault-injector-fault-probabilities
        --fault-injector-fault-types --fault-injector-mtti-seconds --fault-injector-num-ranks
        --fault-injector-offset-seconds --fault-injector-ranks --fault-injector-seed""")


FAMILIES: tuple[Family, ...] = (
    KERNELS,
    CUDA_GRAPHS,
    OVERLAP,
    OBSERVABILITY,
    MEMORY_LOG,
    INFERENCE,
    OTHER_MODELS,
    CHECKPOINT_INTERNALS,
    CHECKPOINT_CONTENTS,
    TOKENIZER_ENCODING,
    FAULT_TOLERANCE,
    DATASET_BUILD,
    RERUN,
    MLA_DOWN_PROJECTION_FUSION,
    MLA_LATENT_CACHE,
    MULTI_TOKEN_PREDICTION,
    ROPE_VARIANTS,
    ATTENTION_VARIANTS,
    HYBRID_MODELS,
    BLOCK_VARIANTS,
    MUP,
    ACTIVATIONS,
    INITIALISATION,
    NUMERICS,
    LOW_PRECISION,
    WEIGHT_DECAY_VARIANTS,
    OTHER_OPTIMIZERS,
    OFFLOADING,
    FSDP_BUFFERS,
    FSDP,
    GTP,
    CONTEXT_VARIANTS,
    LAYOUT,
    PROCESS_GROUP,
    DATA_FEATURES,
    SPLIT_PATHS,
    EVALUATION_VARIANTS,
    CHECKPOINT_FEATURES,
    VOCABULARY,
    REMOVED,
    REINFORCEMENT_LEARNING,
    DISTILLATION,
    MODEL_OPTIMIZER,
    FAULT_INJECTION,
)
