"""Megatron-Core's side of bench/megatron_peers.py, and ptdp's forward-backward.

Megatron-Core's GPTModel with its local layer spec (no Transformer Engine,
no apex), its parallel_state for the layout, its DistributedDataParallel
wrapper and its own forward-backward schedule
(megatron.core.pipeline_parallel.get_forward_backward_func), with
finalize_model_grads reducing the gradients at the end as Megatron-LM's
training does. Its weights are ptdp's logical weights copied in by name
(`megatron_state`): ptdp's logical names are Megatron-LM's legacy ones, so
the map is a renaming, except that Megatron-Core's fused query/key/value
rows are interleaved per query group where ptdp's logical tensor holds all
queries, then all keys, then all values.

Import this module only after bench/megatron_shims.py made Megatron-Core
importable (megatron_peers.py does).
"""

from __future__ import annotations

import contextlib

import dataclasses
import re

import torch

from ptdp.config import ModelConfig

# ptdp's logical name (within a layer) -> Megatron-Core's, and the dimension
# a tensor-parallel rank's shard is cut from (None: every rank holds it all).
LAYER_NAMES = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "input_layernorm.bias": ("input_layernorm.bias", None),
    "attention.query_key_value.weight": ("self_attention.linear_qkv.weight", 0),
    "attention.query_key_value.bias": ("self_attention.linear_qkv.bias", 0),
    "attention.dense.weight": ("self_attention.linear_proj.weight", 1),
    "attention.dense.bias": ("self_attention.linear_proj.bias", None),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", None),
    "post_attention_layernorm.bias": ("pre_mlp_layernorm.bias", None),
    "mlp.dense_h_to_4h.weight": ("mlp.linear_fc1.weight", 0),
    "mlp.dense_h_to_4h.bias": ("mlp.linear_fc1.bias", 0),
    "mlp.dense_4h_to_h.weight": ("mlp.linear_fc2.weight", 1),
    "mlp.dense_4h_to_h.bias": ("mlp.linear_fc2.bias", None),
    "mlp.router.weight": ("mlp.router.weight", None),
}
EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(dense_h_to_4h|dense_4h_to_h)\.weight")
TOP_NAMES = {
    "embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", 0),
    "embedding.position_embeddings.weight": ("embedding.position_embeddings.weight", None),
    "final_layernorm.weight": ("decoder.final_layernorm.weight", None),
    "final_layernorm.bias": ("decoder.final_layernorm.bias", None),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row's parallel layout, as both sides take it."""
    t: int = 1
    p: int = 1
    d: int = 1
    v: int = 1                      # virtual stages per pipeline rank (interleaved when > 1)
    ep: int = 1                     # expert-parallel size
    etp: int | None = None          # expert tensor-parallel size (None: t)
    sequence_parallel: bool = False
    dispatcher: str = "alltoall"    # MoE token dispatcher

    @property
    def world(self) -> int:
        return self.t * self.p * self.d


def interleaved_qkv(weight: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """ptdp's fused query/key/value rows ([all queries; all keys; all values],
    each head's d rows together) in Megatron-Core's order: for each query
    group its heads' queries, then its key, then its value."""
    d = weight.shape[0] // (heads + 2 * groups)
    per_group = heads // groups
    q, k, v = weight.split([heads * d, groups * d, groups * d])
    q = q.reshape(groups, per_group * d, *weight.shape[1:])
    k = k.reshape(groups, d, *weight.shape[1:])
    v = v.reshape(groups, d, *weight.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(weight.shape)


def _shard(tensor: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    return tensor if dim is None or size == 1 else tensor.chunk(size, dim=dim)[rank]


def megatron_state(logical: dict[str, torch.Tensor], model: ModelConfig, chunk, *, tp_rank: int,
                   tp_size: int, ep_rank: int, ep_size: int, etp_rank: int,
                   etp_size: int) -> dict[str, torch.Tensor]:
    """The state of one Megatron-Core GPTModel chunk (its own names and this
    rank's shards) from ptdp's logical weights: each decoder layer by its
    global layer_number, each routed expert by its global number."""
    heads, groups = model.num_attention_heads, model.query_groups
    wanted = set(chunk.state_dict(keep_vars=True))
    state: dict[str, torch.Tensor] = {}
    for name, (theirs, dim) in TOP_NAMES.items():
        if theirs in wanted and name in logical:
            state[theirs] = _shard(logical[name], dim, tp_rank, tp_size)
    if "output_layer.weight" in wanted:  # the last stage's copy of the tied embedding
        state["output_layer.weight"] = _shard(logical["embedding.word_embeddings.weight"], 0,
                                              tp_rank, tp_size)
    experts_per_rank = (model.num_experts or 0) // ep_size
    for local, layer in enumerate(chunk.decoder.layers):
        prefix, ours = f"decoder.layers.{local}.", f"layers.{layer.layer_number - 1}."
        for name, tensor in logical.items():
            if not name.startswith(ours):
                continue
            inner = name[len(ours):]
            if inner in LAYER_NAMES:
                theirs, dim = LAYER_NAMES[inner]
                if inner.startswith("attention.query_key_value"):
                    tensor = interleaved_qkv(tensor, heads, groups)
                state[prefix + theirs] = _shard(tensor, dim, tp_rank, tp_size)
                continue
            match = EXPERT.fullmatch(inner)
            if match is None:
                raise KeyError(f"no Megatron-Core name for ptdp's {name}")
            expert, matrix = int(match.group(1)), match.group(2)
            if expert // experts_per_rank != ep_rank:
                continue
            fc, dim = ("linear_fc1", 0) if matrix == "dense_h_to_4h" else ("linear_fc2", 1)
            state[f"{prefix}mlp.experts.local_experts.{expert % experts_per_rank}.{fc}.weight"] = \
                _shard(tensor, dim, etp_rank, etp_size)
    missing = sorted(name for name in wanted - set(state)
                     if not name.endswith("_extra_state") and "expert_bias" not in name)
    if missing:
        raise KeyError(f"ptdp's logical weights give no value for Megatron-Core's {missing[:5]}")
    return state


def transformer_config(model: ModelConfig, layout: Layout):
    """Megatron-Core's TransformerConfig for ptdp's `model` on `layout`: fp32,
    dropout as the model's (off in the benchmark), no fusions that need CUDA."""
    from megatron.core.transformer import TransformerConfig

    moe = dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
               moe_aux_loss_coeff=model.moe_aux_loss_coeff, moe_router_dtype="fp32",
               moe_router_load_balancing_type="aux_loss",
               moe_ffn_hidden_size=model.moe_ffn_size,
               moe_token_dispatcher_type=layout.dispatcher, moe_grouped_gemm=False,
               expert_model_parallel_size=layout.ep,
               expert_tensor_parallel_size=layout.etp or layout.t) if model.is_moe else {}
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.query_groups,
        ffn_hidden_size=model.ffn_size, kv_channels=model.head_dim,
        hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout,
        layernorm_epsilon=model.layernorm_epsilon, add_bias_linear=model.bias,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=layout.t, pipeline_model_parallel_size=layout.p,
        virtual_pipeline_model_parallel_size=layout.v if layout.v > 1 else None,
        sequence_parallel=layout.sequence_parallel, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
        # Batched p2p posts a rank's sends and receives to its previous and
        # next stage in one fixed order; at p = 2 both are the same rank, and
        # gloo matches messages between two ranks in posting order, so an
        # interleaved schedule's activation and gradient swap. Megatron-Core's
        # unbatched p2p orders them by even and odd rank, which matches.
        batch_p2p_comm=False, **moe)


class MegatronSide:
    """One rank's share of Megatron-Core's GPT for a layout, with ptdp's weights."""

    def __init__(self, model: ModelConfig, layout: Layout, logical: dict[str, torch.Tensor],
                 micro_batch: int, num_microbatches: int, device: torch.device = torch.device("cpu")):
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron_shims import tensor_cuda_is_identity

        self.model_config, self.layout, self.device = model, layout, device
        # On a CPU Megatron-Core's Tensor.cuda() calls are shimmed away; on a GPU they run.
        building = tensor_cuda_is_identity if device.type == "cpu" else contextlib.nullcontext
        self.micro_batch, self.num_microbatches = micro_batch, num_microbatches
        self.config = transformer_config(model, layout)
        spec = get_gpt_layer_local_spec(num_experts=model.num_experts, moe_grouped_gemm=False)
        vp = layout.v if layout.v > 1 else None
        self.chunks = []
        for stage in range(layout.v):
            with building():
                chunk = GPTModel(self.config, spec, vocab_size=model.vocab_size,
                                 max_sequence_length=model.seq_length,
                                 pre_process=parallel_state.is_pipeline_first_stage(
                                     ignore_virtual=False, vp_stage=stage if vp else None),
                                 post_process=parallel_state.is_pipeline_last_stage(
                                     ignore_virtual=False, vp_stage=stage if vp else None),
                                 share_embeddings_and_output_weights=model.tied_output,
                                 position_embedding_type="learned_absolute",
                                 vp_stage=stage if vp else None)
            ranks = dict(tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=layout.t,
                         ep_rank=parallel_state.get_expert_model_parallel_rank(), ep_size=layout.ep,
                         etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
                         etp_size=layout.etp or layout.t)
            with torch.no_grad():
                for name, tensor in megatron_state(logical, model, chunk, **ranks).items():
                    chunk.get_parameter(name).copy_(tensor)
            self.chunks.append(chunk.to(device))  # (built on the CPU: use_cpu_initialization)
        self.has_first = parallel_state.is_pipeline_first_stage()
        self.has_last = parallel_state.is_pipeline_last_stage()
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
        self.modules = [DistributedDataParallel(self.config, ddp, chunk, disable_bucketing=i > 0)
                        for i, chunk in enumerate(self.chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = [module.no_sync for module in self.modules] if vp \
            else self.modules[0].no_sync
        self.config.grad_sync_func = None
        self.forward_backward = get_forward_backward_func()

    def step(self, batches: list[tuple]) -> float | None:
        """Forward and backward of one global batch (`batches`: this rank's
        microbatches, or empty where no stage reads them); the mean loss of
        its microbatches where the last stage is, else None."""
        for module in self.modules:
            module.zero_grad_buffer()
        seq = self.model_config.seq_length
        positions = torch.arange(seq, device=self.device).expand(self.micro_batch, seq)

        def forward_step(data_iterator, module):
            tokens, labels, mask = next(data_iterator) if batches else (None, None, None)
            output = module(tokens, positions if tokens is not None else None, None, labels=labels)

            def loss_func(per_token):
                loss = (per_token.float() * mask).sum() / mask.sum() if mask is not None \
                    else per_token.float().mean()
                # (a copy: the schedule divides the returned loss in place)
                return loss, {"loss": loss.detach().clone()}
            return output, loss_func
        iterators = [iter(list(batches)) for _ in self.modules]
        outputs = self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(self.modules) > 1 else iterators[0],
            model=self.modules if len(self.modules) > 1 else self.modules[0],
            num_microbatches=self.num_microbatches, seq_length=seq,
            micro_batch_size=self.micro_batch, forward_only=False)
        if not self.has_last:
            return None
        return sum(out["loss"].item() for out in outputs) / len(outputs)


def initialize_megatron(layout: Layout, seed: int, cuda: bool = False) -> None:
    """Megatron-Core's parallel_state for `layout` (default process group
    already started), with its CPU shims' RNG tracker, or on a GPU its own
    CUDA RNG tracker seeded."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.t, pipeline_model_parallel_size=layout.p,
        virtual_pipeline_model_parallel_size=layout.v if layout.v > 1 else None,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp or layout.t)
    torch.manual_seed(seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)


def destroy_megatron() -> None:
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()


# ------------------------------------------------------------------------------------------
# ptdp's forward-backward of one global batch (Trainer.step without the optimizer)


def ptdp_forward_backward(trainer, iteration: int) -> float | None:
    """What Trainer.step does before its optimizer step: every microbatch's
    forward and backward through ptdp's pipeline executor, then the
    gradient reduction (buffer.finish); the iteration's mean loss on the
    loss's stage, else None."""
    from ptdp.parallel.pipeline.executor import average_loss
    from ptdp.train.moe_metrics import set_aux_loss_scale, start_iteration

    trainer.model.train()
    num_micro = trainer.num_micro
    trainer.buffer.start_iteration(num_micro)
    set_aux_loss_scale(trainer.moe_layers, 1.0 / num_micro)
    start_iteration(trainer.moe_layers)
    stats = trainer.executor.run(trainer.schedule, trainer.microbatch_fn(iteration), loss_scale=1.0)
    trainer.buffer.finish()
    if not trainer.holds_loss:
        return None
    return average_loss(stats.losses, None, trainer.ctx.grad_reduce_group, trainer.ctx.cp_size)
