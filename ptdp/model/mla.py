"""Multi-latent attention (DeepSeek-V2/V3's MLA), as Megatron-Core's
MLASelfAttention computes it (--multi-latent-attention; settings and
checks: ptdp.config.mla).

With a = heads, r_q = --q-lora-rank, r_kv = --kv-lora-rank, d_n =
--qk-head-dim, d_r = --qk-pos-emb-head-dim, d_v = --v-head-dim:

    queries  q = up_q(norm_q(x W_dq))          [a, d_n + d_r] per position
             (q = x W_q without --q-lora-rank)
    latent   c, k_r = x W_dkv                   [r_kv], [d_r]
    keys     k_n, v = up_kv(norm_kv(c))         [a, d_n], [a, d_v]
    rotated  q_r (each head's last d_r), k_r (one per position, every head's)
    k        = [k_n, rotate(k_r)],  q = [q_n, rotate(q_r)]
    out      = softmax(q kᵀ · scale, causal) v  ->  [a·d_v] -> W_o -> [h]

scale = (d_n + d_r)^-½, times YaRN's mscale² (ModelConfig.mla_softmax_scale);
the norms exist with --qk-layernorm (Megatron-LM's meaning for MLA; without
it the latents pass unnormalized), their epsilon --mla-latent-norm-epsilon
(default --norm-epsilon, as Megatron-Core; transformers' DeepSeek-V3 takes
1e-6). The rotation is Megatron-Core's for MLA
(apply_rotary_pos_emb with mla_rotary_interleaved): the d_r values are read
as interleaved pairs (x0, x1), (x2, x3), ... and turned by rope or YaRN
(ptdp.model.rotary), which is transformers' DeepseekV3 with rope_interleave
True (its default, DeepSeek's checkpoints), so those load without a
permutation. A checkpoint written for rope_interleave False has each rotated
block's rows in "rotate half" order: ptdp's row 2i is its row i and row
2i + 1 its row i + d_r/2 (of q_b_proj's, or q_proj's, rotated rows per head
and of kv_a_proj_with_mqa's last d_r rows).

Tensor parallelism splits the heads: the up projections (and the direct
query projection) are column-parallel, each rank holding whole heads (a
head's query rows [q_n; q_r], its key/value rows [k_n; v]); the output
projection is row-parallel. The down projections and latent norms are
replicated: every rank computes them, and the shared rotated key k_r enters
each rank's heads through copy_to_tensor_region (its gradient summed over
the tensor group). Under sequence parallelism the down projections and
norms run on this rank's s/t positions (their gradients partial over the
tensor group, as the layer norms'), the up projections gather the latents'
positions and k_r is gathered whole (gather_from_sequence_region).

Context parallelism (p2p, all_gather, a2a) and packed documents use kernels
that take one head width for queries, keys and values: there q, k and v are
padded with zeros to the wider of d_n + d_r and d_v (scores and outputs are
unchanged; the scale is passed explicitly) and the output cut back to d_v.

Parameter names, ptdp (under layers.i.attention.) -> Megatron-Core (under
decoder.layers.i.self_attention.) -> transformers DeepseekV3 (under
model.layers.i.self_attn.):

    query_down.weight                 linear_q_down_proj.weight          q_a_proj.weight
    query_latent_layernorm.weight     linear_q_up_proj.layer_norm_weight q_a_layernorm.weight
                                      (q_layernorm.weight, local spec)
    query_up.weight                   linear_q_up_proj.weight            q_b_proj.weight
    query.weight (no --q-lora-rank)   linear_q_proj.weight               q_proj.weight
    key_value_down.weight             linear_kv_down_proj.weight         kv_a_proj_with_mqa.weight
    key_value_latent_layernorm.weight linear_kv_up_proj.layer_norm_weight kv_a_layernorm.weight
                                      (kv_layernorm.weight, local spec)
    key_value_up.weight               linear_kv_up_proj.weight           kv_b_proj.weight
    dense.weight, dense.bias          linear_proj.weight, .bias          o_proj.weight

(LayerNorm adds .bias to each norm; --apply-layernorm-1p stores weight - 1.)
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config import ModelConfig
from ptdp.model.norms import layer_norm
from ptdp.model.recompute import checkpoint, recompute_active, recompute_discarding
from ptdp.model.rotary import Rotary
from ptdp.model.yarn import YarnScaling
from ptdp.parallel.context_attention import context_attention
from ptdp.parallel.document_attention import Documents, document_causal_attention
from ptdp.parallel.sharding import set_init
from ptdp.parallel.tensor import (ColumnParallelLinear, RNGStreams, RowParallelLinear,
                                  copy_to_tensor_region, gather_from_sequence_region,
                                  mark_partial_grad, scaled_init_std)
from ptdp.parallel.topology import ParallelContext


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ with W whole on every tensor rank (MLA's down projections).
    `sequence_parallel`: x is this rank's s/t positions, so W's gradient is
    partial over the tensor group."""

    def __init__(self, in_features: int, out_features: int, init_std: float,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight = set_init(nn.Parameter(torch.empty(out_features, in_features)), "normal",
                               init_std)
        if sequence_parallel:
            mark_partial_grad(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def mla_rotary(config: ModelConfig) -> Rotary:
    """The rotation of MLA's d_r-wide part: rope at --rotary-base, or YaRN
    (ptdp.config.mla refuses the other rotary variants)."""
    yarn = None
    if config.yarn:
        yarn = YarnScaling(config.rotary_scaling_factor, config.yarn_original_max_position_embeddings,
                           config.yarn_beta_fast, config.yarn_beta_slow, config.mscale,
                           config.mscale_all_dim, config.yarn_correction_range_round_to_int)
    return Rotary(config.qk_pos_emb_head_dim, config.rotary_base, yarn=yarn)


def latent_norm(config: ModelConfig, sequence_parallel: bool, size: int) -> nn.Module:
    """A latent's norm (--normalization's, over `size` values) with the latent
    norms' epsilon, ModelConfig.latent_norm_epsilon."""
    norm = layer_norm(config, sequence_parallel, size=size)
    norm.eps = config.latent_norm_epsilon  # (LayerNorm's and RMSNorm's forward read it)
    return norm


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """[..., d] read as pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...],
    the "rotate half" layout in which ptdp.model.rotary turns pair i as
    (i, i + d/2) (Megatron-Core's mla_rotary_interleaved)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def same_width_attention(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
    """attend(q, k, v) for a kernel that takes one head width: q and k (whose
    zero columns add nothing to the scores) and v padded to the wider of
    their widths, and the output cut back to v's."""
    width, value_width = max(q.shape[-1], v.shape[-1]), v.shape[-1]

    def padded(x: torch.Tensor) -> torch.Tensor:
        return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))

    out = attend(padded(q), padded(k), padded(v))
    return out if value_width == width else out[..., :value_width]


class MultiLatentAttention(nn.Module):
    """MLA in place of ptdp.model.gpt.Attention (the same call and result:
    (output, bias) of the row-parallel output projection)."""

    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool = False, cp_comm_type: str = "p2p", layer_id: int = 0):
        super().__init__()
        self.rng, self.tp_group = rng, ctx.tp_group
        self.sequence_parallel = sp = sequence_parallel and ctx.tp_size > 1
        self.context = (ctx.cp_size, ctx.cp_rank)
        self.cp_group, self.cp_comm_type = ctx.cp_group, cp_comm_type
        h, a, std = config.hidden_size, config.num_attention_heads, config.init_method_std
        self.local_heads = a // ctx.tp_size
        self.nope_dim, self.rotated_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.value_dim, self.latent_dim = config.v_head_dim, config.kv_lora_rank
        query_dim = config.mla_query_head_dim
        self.softmax_scale = config.mla_softmax_scale
        self.dropout = config.attention_dropout
        self.selective_recompute = config.recomputes("core_attn")
        self.recompute_up = config.recomputes("mla_up_proj")
        self.rotary = mla_rotary(config)
        # The latent norms: whole on every tensor rank; under sequence
        # parallelism each sees s/t positions, so its gradient is partial.
        if config.q_lora_rank is not None:
            self.query_down = ReplicatedLinear(h, config.q_lora_rank, std, sp)
            if config.qk_layernorm:
                self.query_latent_layernorm = latent_norm(config, sp, config.q_lora_rank)
            self.query_up = ColumnParallelLinear(config.q_lora_rank, a * query_dim, ctx,
                                                 bias=False, init_std=std, sequence_parallel=sp)
        else:
            self.query = ColumnParallelLinear(h, a * query_dim, ctx, bias=False, init_std=std,
                                              sequence_parallel=sp)
        self.key_value_down = ReplicatedLinear(h, self.latent_dim + self.rotated_dim, std, sp)
        if config.qk_layernorm:
            self.key_value_latent_layernorm = latent_norm(config, sp, self.latent_dim)
        self.key_value_up = ColumnParallelLinear(
            self.latent_dim, a * (self.nope_dim + self.value_dim), ctx, bias=False, init_std=std,
            sequence_parallel=sp)
        self.dense = RowParallelLinear(a * self.value_dim, h, ctx, skip_bias_add=True,
                                       bias=config.bias,
                                       init_std=scaled_init_std(std, config.num_layers),
                                       sequence_parallel=sp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                documents: Documents | None = None):
        """x [s, b, h] ([s/t, b, h] under sequence parallelism); `positions`
        and `documents` as ptdp.model.gpt.Attention's."""
        query_in = x if hasattr(self, "query") else self.query_down(x)
        latent, shared_rotated = self.key_value_down(x).split(
            [self.latent_dim, self.rotated_dim], dim=-1)

        def up(query_in, latent, shared_rotated):
            return self._up_projections(query_in, latent, shared_rotated, positions)

        def attend(qkv):
            return self._attend(*qkv, documents)
        if self.recompute_up and recompute_active(self):
            # Megatron-Core's output-discarding checkpoint of the up projections.
            return recompute_discarding(up, self.rng, attend, query_in, latent, shared_rotated)
        return attend(up(query_in, latent, shared_rotated))

    def _up_projections(self, query_in: torch.Tensor, latent: torch.Tensor,
                        shared_rotated: torch.Tensor, positions: torch.Tensor | None):
        """q, k, v [b, heads, s, ·] from the down projections' outputs (the
        hidden state itself for the queries without --q-lora-rank): the
        latent norms, up projections and rotation."""
        q = (self.query(query_in) if hasattr(self, "query")
             else self.query_up(self._norm("query_latent_layernorm", query_in)))
        s, b = q.shape[:2]
        heads = self.local_heads
        q = q.view(s, b, heads, -1).permute(1, 2, 0, 3)      # [b, heads, s, d_n + d_r]
        kv = self.key_value_up(self._norm("key_value_latent_layernorm", latent))
        kv = kv.view(s, b, heads, -1).permute(1, 2, 0, 3)    # [b, heads, s, d_n + d_v]
        k_nope, v = kv.split([self.nope_dim, self.value_dim], dim=-1)
        q_nope, q_rotated = q.split([self.nope_dim, self.rotated_dim], dim=-1)
        q_rotated = self.rotary(deinterleaved(q_rotated), self.context, positions)
        k_rotated = self._whole_sequence(shared_rotated).permute(1, 0, 2).unsqueeze(1)
        k_rotated = self.rotary(deinterleaved(k_rotated), self.context, positions)
        q = torch.cat([q_nope, q_rotated], dim=-1)
        k = torch.cat([k_nope, k_rotated.expand(-1, heads, -1, -1)], dim=-1)
        return q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None):
        """The attention core and the output projection: (output, bias)."""
        b, heads, s = q.shape[:3]
        if self.selective_recompute and recompute_active(self):
            # Keep q, k, v; rebuild the s×s scores, softmax and dropout in backward.
            out = checkpoint(self._core, self.rng, q, k, v, documents)
        else:
            out = self._core(q, k, v, documents)
        out = out.permute(2, 0, 1, 3).reshape(s, b, heads * self.value_dim)
        return self.dense(out)

    def _norm(self, name: str, latent: torch.Tensor) -> torch.Tensor:
        norm = getattr(self, name, None)  # (only with --qk-layernorm)
        return latent if norm is None else norm(latent)

    def _whole_sequence(self, shared: torch.Tensor) -> torch.Tensor:
        """The shared rotated key, [s, b, d_r] on every tensor rank, its
        gradient from every rank's heads summed: gathered from the s/t
        positions under sequence parallelism, else copied into the region."""
        if self.sequence_parallel:
            return gather_from_sequence_region(shared, self.tp_group)
        return copy_to_tensor_region(shared, self.tp_group)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              documents: Documents | None = None) -> torch.Tensor:
        """softmax(q kᵀ · scale, causal) with dropout, times v: [b, heads, s,
        d_v] (under context parallelism this rank's rows, over the whole
        sequence; with `documents`, within each)."""
        scale = self.softmax_scale
        if self.context[0] > 1:  # (attention dropout is refused before launch)
            ids = None if documents is None else documents.document_ids

            def across_ranks(q, k, v):
                return context_attention(q, k, v, self.cp_group, self.cp_comm_type, scale=scale,
                                         document_ids=ids)
            return same_width_attention(across_ranks, q, k, v)
        dropout = self.dropout if self.training else 0.0
        if documents is not None:
            def within_documents(q, k, v):
                return document_causal_attention(q, k, v, documents.document_ids, scale=scale,
                                                 dropout=dropout, plans=documents.plans)
            attend = functools.partial(same_width_attention, within_documents)
        else:  # (PyTorch's attention takes values of their own width)
            attend = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout,
                                       is_causal=True, scale=scale)
        if dropout > 0.0:
            with self.rng.fork("tensor"):  # each tensor rank holds other heads: its own stream
                return attend(q, k, v)
        return attend(q, k, v)
