"""GPT-2 and the Llama family, built from the tensor-parallel layers.

By default GPT-2: pre-LayerNorm blocks, learned position embeddings,
tanh-GeLU MLP, word embeddings tied to the output layer, biases, dropout.
The Llama family's options replace parts of it, each on its own (any
combination works): RMSNorm, a SwiGLU MLP (gate and up in one column-parallel
matrix, so each tensor rank holds matching parts of both), rotary position
embeddings, grouped-query attention (G key/value heads; each tensor rank holds
G/t whole groups and the query heads that use them), an untied output layer
(vocabulary-parallel like the embedding) and no linear biases. Activations
are laid out [s, b, h] (sequence first) as in the paper, so no transposes are
needed between layers. With --apply-layernorm-1p every norm (each layer's two
and the final one) stores its scale as w = scale - 1 and computes with 1 + w.

With `sequence_parallel` (t > 1) the activations outside the tensor-parallel
regions are [s/t, b, h] on each tensor rank: the embedding output is cut
along the sequence, the column-parallel layers gather it and the
row-parallel ones reduce-scatter back to it (ptdp.parallel.tensor), the
final norm runs on s/t positions and the output layer gathers them. Dropout
there draws from the per-rank stream (each rank holds other positions), and
the norms' weights (and row-parallel biases) are marked: each rank's
gradient covers its own positions and is summed over the tensor group.

A GPT can be one pipeline piece: `layer_ids` picks the transformer layers it
holds (global indices, kept as module names so that parameter names are the
same logical names under every layout), `pre_process` adds the embeddings
(first stage) and `post_process` the final LayerNorm, output layer and loss
(last stage).

Activation recomputation (ModelConfig.recompute_*) is wired here with
ptdp.model.recompute.checkpoint: `GPT._run_layers` checkpoints groups of
layers (full, uniform), or the first layers of the chunk one by one (full,
block); selective recomputes the --recompute-modules parts: `Attention._core`
the attention core (core_attn), `TransformerLayer._normed` the norms
(layernorm), `TransformerLayer._mlp` the dense MLP (mlp) or the MoE layer
(moe); ptdp.model.moe the experts' activation (moe_act) and the shared
experts, ptdp.model.mla the up projections (mla_up_proj).

With --compile (build_chunks' `compile`) the layers, their attention and MLP
call ptdp.model.compiled's pieces (`layer_kernels`) for their element-wise
work between the collectives; None (the default) is the eager path below.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.config import ModelConfig
from ptdp.config.lora import LoRAConfig
from ptdp.model.adapters import attach_adapters
from ptdp.model.compiled import LayerKernels, compile_layers, compiles_norm
from ptdp.model.fused import bias_dropout_add, bias_gelu, mlp_activation
from ptdp.model.moe import ExpertLinear, MoELayer
from ptdp.model.mla import MultiLatentAttention
from ptdp.model.mtp import MultiTokenPrediction
from ptdp.model.norms import LayerNorm1p, RMSNorm1p, layer_norm  # noqa: F401 - re-exported
from ptdp.model.recompute import checkpoint, recompute_active, recompute_discarding
from ptdp.model.rotary import rotary_for
from ptdp.parallel.context_attention import context_attention
from ptdp.parallel.context_layout import rank_positions, split_sequence
from ptdp.parallel.document_attention import Documents, document_causal_attention
from ptdp.schedules.kinds import virtual_stage_of
from ptdp.schedules.build import layers_of
from ptdp.parallel.local_attention import document_local_attention, local_attention
from ptdp.parallel.sharding import (COPY_ATTR, SHARD_ATTR, TensorShard, initialize_parameters,
                                    set_init)
from ptdp.parallel.tensor import (
    ColumnParallelLinear,
    RNGStreams,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_partial_grad,
    reduce_scatter_to_sequence_region,
    scaled_init_std,
    sequence_parallel_linear,
    tensor_parallel_linear,
    vocab_parallel_cross_entropy,
)
from ptdp.parallel.weight_grad import DeferredWeightGrads
from ptdp.parallel.topology import ParallelContext


def vocab_parallel_matrix(config: ModelConfig, ctx: ParallelContext) -> VocabParallelEmbedding:
    """A [V, h] matrix split by vocabulary rows: the word embedding, or the
    untied output layer (which has the same shape and split)."""
    return VocabParallelEmbedding(config.vocab_size, config.padded_vocab_size(ctx.tp_size),
                                  config.hidden_size, ctx, init_std=config.init_method_std)


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool = False):
        super().__init__()
        self.ctx, self.rng, self.sequence_parallel = ctx, rng, sequence_parallel
        self.word_embeddings = vocab_parallel_matrix(config, ctx)
        # --scale-embeddings: Gemma's √h, rounded to the embedding's dtype where applied.
        self.embedding_scale = config.hidden_size ** 0.5 if config.scale_embeddings else None
        if not config.rope:  # rotary positions act in attention instead
            self.position_embeddings = nn.Embedding(config.max_positions, config.hidden_size)
            set_init(self.position_embeddings.weight, "normal", config.init_method_std)
            if sequence_parallel:  # each rank looks up its own positions' rows
                mark_partial_grad(self.position_embeddings.weight)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> hidden [s, b, h] ([s/t, b, h] under sequence
        parallelism). `positions` [b, s]: the tokens' own (packed
        documents'), else their places in the sequence."""
        if self.sequence_parallel:
            return self._sequence_parallel_forward(tokens, positions)
        x = self._scaled(self.word_embeddings(tokens))
        if hasattr(self, "position_embeddings"):
            x = x + (self.position_embeddings(self._positions(tokens.shape[1], tokens.device))
                     if positions is None else self.position_embeddings(positions))
        # Replicated activation: the default stream drops the same elements on
        # every tensor rank.
        return self.dropout(x.transpose(0, 1).contiguous())

    def _sequence_parallel_forward(self, tokens: torch.Tensor,
                                   positions: torch.Tensor | None) -> torch.Tensor:
        """The vocabulary-parallel lookup's parts reduce-scattered straight to
        s/t positions (half an all-reduce's traffic), then this rank's
        positions added and dropped from its own stream."""
        partial = self.word_embeddings.partial(tokens).transpose(0, 1).contiguous()
        x = self._scaled(reduce_scatter_to_sequence_region(partial, self.ctx.tp_group))
        if hasattr(self, "position_embeddings"):
            first, count = self.ctx.tp_rank * x.shape[0], x.shape[0]
            if positions is None:
                own = self._positions(tokens.shape[1], tokens.device, first=first, count=count)
                x = x + self.position_embeddings(own).unsqueeze(1)
            else:
                own = positions[:, first:first + count].transpose(0, 1).contiguous()
                x = x + self.position_embeddings(own)
        with self.rng.fork("tensor"):
            return self.dropout(x)

    def _scaled(self, words: torch.Tensor) -> torch.Tensor:
        """The word embeddings times √h (--scale-embeddings), the factor in
        their dtype first, as Gemma's Gemma3TextScaledWordEmbedding does."""
        if self.embedding_scale is None:
            return words
        # The rounded factor is exact as a Python float: no tensor to copy to the device.
        return words * torch.tensor(self.embedding_scale, dtype=words.dtype).item()

    def _positions(self, length: int, device: torch.device, first: int = 0,
                   count: int | None = None) -> torch.Tensor:
        """The positions of this rank's `length` tokens (`count` of them from
        index `first`): 0 .. length - 1, or under context parallelism its two
        chunks' of the c·length sequence. A tensor of its own (the lookup
        saves it for the backward)."""
        c, count = self.ctx.cp_size, length - first if count is None else count
        if c == 1:
            return torch.arange(first, first + count, device=device)
        return rank_positions(length * c, c, self.ctx.cp_rank, device)[first:first + count].clone()


class Attention(nn.Module):
    layer_kernels: LayerKernels | None = None  # --compile's pieces (ptdp.model.compiled)

    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool = False, cp_comm_type: str = "p2p", layer_id: int = 0):
        super().__init__()
        self.rng = rng
        # Context parallelism: this rank holds two chunks of each sequence
        # (ptdp.parallel.context_layout); attention runs across the group.
        self.context = (ctx.cp_size, ctx.cp_rank)
        self.cp_group, self.cp_comm_type = ctx.cp_group, cp_comm_type
        t, d = ctx.tp_size, config.head_dim
        self.local_heads = config.num_attention_heads // t
        self.local_groups = config.query_groups // t  # key/value heads on this rank
        self.head_dim = d
        self.dropout = config.attention_dropout
        # --softmax-scale: the queries carry its ratio to the kernels' own 1/√d,
        # so every attention path (context, documents, windows) applies it.
        self.query_scale = (None if config.softmax_scale is None
                            else config.softmax_scale * d ** 0.5)
        self.selective_recompute = config.recomputes("core_attn")
        # YaRN's attention factor is inside the rotation's cos/sin tables.
        # --window-size on the layers --window-attn-skip-freq leaves windowed;
        # --softmax-type's sinks (ptdp.parallel.local_attention).
        self.window = config.layer_window(layer_id)
        self.rotary = rotary_for(config, local=self.window is not None)
        self.softmax_type = config.softmax_type
        if config.softmax_type == "learnable":  # a logit per head, split with the heads
            self.sinks = nn.Parameter(torch.empty(self.local_heads))
            set_init(self.sinks, "normal", config.init_method_std)
            setattr(self.sinks, SHARD_ATTR, TensorShard(dim=0, parts=t, index=ctx.tp_rank))
        h, a, g = config.hidden_size, config.num_attention_heads, config.query_groups
        # Rows: the queries of all heads, then the keys and values of the groups.
        blocks = 3 if g == a else (a * d, g * d, g * d)
        self.query_key_value = ColumnParallelLinear(h, (a + 2 * g) * d, ctx, blocks=blocks,
                                                    bias=config.qkv_bias,
                                                    init_std=config.init_method_std,
                                                    sequence_parallel=sequence_parallel)
        if config.qk_layernorm:
            # One [d] weight shared by the heads; a tensor rank normalizes only
            # its own heads, so its gradient is partial over the tensor group.
            self.q_layernorm = layer_norm(config, ctx.tp_size > 1, size=d)
            self.k_layernorm = layer_norm(config, ctx.tp_size > 1, size=d)
        self.dense = RowParallelLinear(a * d, h, ctx, skip_bias_add=True, bias=config.bias,
                                       init_std=scaled_init_std(config.init_method_std,
                                                                config.num_layers),
                                       sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                documents: Documents | None = None):
        """`positions` [b, s/c]: this rank's tokens' positions in their
        documents (None: their places in the sequence); `documents`: the
        microbatch's, whose ids [b, s] cover the whole sequence, attention
        keeping inside each (None: causal over the whole sequence)."""
        heads, groups, d = self.local_heads, self.local_groups, self.head_dim
        qkv = self.query_key_value(x)  # the whole sequence, also under sequence parallelism
        s, b = qkv.shape[:2]
        q, k, v = qkv.split([heads * d, groups * d, groups * d], dim=-1)
        q = q.view(s, b, heads, d).permute(1, 2, 0, 3)  # [b, heads, s, d]
        k = k.view(s, b, groups, d).permute(1, 2, 0, 3)
        v = v.view(s, b, groups, d).permute(1, 2, 0, 3)
        if hasattr(self, "q_layernorm"):  # --qk-layernorm: before the rotation, as Qwen3
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary is not None and self.layer_kernels is not None:
            q, k = self.layer_kernels.rotate(self.rotary, q, k, self.context, positions,
                                             self.query_scale)
        else:
            if self.rotary is not None:
                q = self.rotary(q, self.context, positions)
                k = self.rotary(k, self.context, positions)
            if self.query_scale is not None and self.query_scale != 1.0:
                q = q * self.query_scale
        if self.selective_recompute and recompute_active(self):
            # Selective recomputation: keep q, k, v; rebuild the s×s scores,
            # softmax and dropout mask in backward.
            out = checkpoint(self._core, self.rng, q, k, v, documents)
        else:
            out = self._core(q, k, v, documents)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.dense(out)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              documents: Documents | None = None) -> torch.Tensor:
        """softmax(q kᵀ/√d, causal) with dropout, times v: [b, heads, s, d]
        (under context parallelism this rank's rows of it, over the whole
        sequence). With `documents` each query sees only the earlier keys
        of its own document (ptdp.parallel.document_attention).
        Under grouped-query attention k and v have fewer heads; query head j
        uses group j // (heads/groups)."""
        sinks = None                                    # --softmax-type vanilla
        if self.softmax_type == "learnable":
            sinks = self.sinks
        elif self.softmax_type == "off-by-one":
            sinks = q.new_zeros(self.local_heads)       # a fixed zero logit
        if self.context[0] > 1:
            # (attention dropout is refused before launch, and windows with
            # packed documents)
            return context_attention(q, k, v, self.cp_group, self.cp_comm_type,
                                     window=self.window, sinks=sinks,
                                     document_ids=None if documents is None
                                     else documents.document_ids)
        if self.window is not None or sinks is not None:
            # (attention dropout is refused before launch)
            if documents is not None:  # within each packed document
                return document_local_attention(q, k, v, documents.document_ids,
                                                window=self.window, sinks=sinks,
                                                plans=documents.plans)
            return local_attention(q, k, v, window=self.window, sinks=sinks)
        dropout = self.dropout if self.training else 0.0
        if documents is not None:
            ids, plans = documents.document_ids, documents.plans
            if dropout > 0.0:
                with self.rng.fork("tensor"):
                    return document_causal_attention(q, k, v, ids, dropout=dropout, plans=plans)
            return document_causal_attention(q, k, v, ids, plans=plans)
        # Passed only when needed: the flag exists from torch 2.5.
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        if dropout > 0.0:
            # Each tensor rank holds other heads: its own stream.
            with self.rng.fork("tensor"):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                      **gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)


class MLP(nn.Module):
    """GeLU MLP, or a gated one (--swiglu, --geglu, --quick-geglu): the first
    matrix holds the gate's and the up projection's rows ([2·ffn, h]), split
    as two blocks so that each tensor rank's half of the gate meets the same
    half of up."""

    layer_kernels: LayerKernels | None = None  # --compile's pieces (ptdp.model.compiled)

    def __init__(self, config: ModelConfig, ctx: ParallelContext, sequence_parallel: bool = False):
        super().__init__()
        self.fused, self.gated = config.bias_gelu_fusion, config.gated_linear_unit
        self.activation = mlp_activation(config)
        self.gate_settings = (config.gated_activation, config.glu_linear_offset,
                              config.activation_func_clamp_value)
        h, ffn = config.hidden_size, config.ffn_size
        # GeLU: the first bias is applied in bias_gelu, fused with the activation.
        self.dense_h_to_4h = ColumnParallelLinear(
            h, 2 * ffn if self.gated else ffn, ctx, blocks=2 if self.gated else 1,
            bias=config.bias, skip_bias_add=not self.gated, init_std=config.init_method_std,
            sequence_parallel=sequence_parallel)
        self.dense_4h_to_h = RowParallelLinear(ffn, h, ctx, skip_bias_add=True, bias=config.bias,
                                               init_std=scaled_init_std(config.init_method_std,
                                                                        config.num_layers),
                                               sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor):
        kernels = self.layer_kernels
        if self.gated:
            y = self.dense_h_to_4h(x)
            return self.dense_4h_to_h(self.activation(y) if kernels is None
                                      else kernels.gated_unit(y, *self.gate_settings))
        y, bias = self.dense_h_to_4h(x)
        return self.dense_4h_to_h(bias_gelu(y, bias, self.fused) if kernels is None
                                  else kernels.bias_gelu(y, bias))


class TransformerLayer(nn.Module):
    layer_kernels: LayerKernels | None = None  # --compile's pieces (ptdp.model.compiled)

    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams,
                 sequence_parallel: bool = False, layer_id: int = 0, cp_comm_type: str = "p2p"):
        super().__init__()
        self.rng, self.sequence_parallel = rng, sequence_parallel
        self.hidden_dropout = config.hidden_dropout
        self.fused = config.bias_dropout_fusion
        self.input_layernorm = layer_norm(config, sequence_parallel)
        attention = Attention
        if config.multi_latent_attention:
            attention = MultiLatentAttention
        self.attention = attention(config, ctx, rng, sequence_parallel, cp_comm_type, layer_id)
        self.post_attention_layernorm = layer_norm(config, sequence_parallel)
        if config.is_moe and config.moe_layer_pattern[layer_id]:
            self.mlp = MoELayer(config, ctx, rng, sequence_parallel, layer_id)
            self.recompute_mlp = config.recomputes("moe")
        else:
            self.mlp = MLP(config, ctx, sequence_parallel)
            self.recompute_mlp = config.recomputes("mlp")
        self.recompute_norms = config.recomputes("layernorm")
        if config.sandwich_norm:
            # Gemma's post-norms (its post_attention_layernorm and
            # post_feedforward_layernorm): ptdp's post_attention_layernorm
            # already names the norm before the MLP.
            self.attention_output_layernorm = layer_norm(config, sequence_parallel)
            self.mlp_output_layernorm = layer_norm(config, sequence_parallel)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        out, bias = self._normed("input_layernorm", x,
                                 lambda normed: self.attention(normed, positions, documents))
        out, bias = self._output_norm("attention_output_layernorm", out, bias)
        if self._fuses_residual_and_norm():  # --compile: the add and the norm in one pass
            x, normed = self.layer_kernels.residual_norm(out, bias, x,
                                                         self.post_attention_layernorm)
            out, bias = self._mlp(normed)
        else:
            x = self._residual(out, bias, x)
            out, bias = self._normed("post_attention_layernorm", x, self._mlp)
        return self._residual(*self._output_norm("mlp_output_layernorm", out, bias), x)

    def _normed(self, name: str, x: torch.Tensor, consumer):
        """consumer(norm(x)); with --recompute-modules layernorm the norm's
        output is not kept for the consumer's backward but recomputed."""
        norm = getattr(self, name)
        if self.layer_kernels is not None:
            norm = self.layer_kernels.norm(norm)
        if self.recompute_norms and recompute_active(self):
            return recompute_discarding(norm, self.rng, consumer, x)
        return consumer(norm(x))

    def _drops(self) -> bool:
        return self.training and self.hidden_dropout > 0.0

    def _fuses_residual_and_norm(self) -> bool:
        """--compile fuses the attention's residual add with the norm after it,
        unless dropout draws there or the norm's output is recomputed (the
        add and the norm each run on their own then)."""
        return (self.layer_kernels is not None and not self._drops()
                and not (self.recompute_norms and recompute_active(self))
                and compiles_norm(self.post_attention_layernorm))

    def _mlp(self, x: torch.Tensor):
        """The MLP (or MoE layer); checkpointed with --recompute-modules mlp
        (a dense MLP) or moe (an MoE layer)."""
        if self.recompute_mlp and recompute_active(self):
            return checkpoint(self.mlp, self.rng, x)
        return self.mlp(x)

    def _output_norm(self, name: str, out: torch.Tensor, bias: torch.Tensor | None):
        """(out, bias), or with --sandwich-norm (norm(out + bias), None)."""
        norm = getattr(self, name, None)
        if norm is None:
            return out, bias
        return norm(out if bias is None else out + bias), None

    def _residual(self, out, bias, x):
        """x + dropout(out + bias). Under sequence parallelism each tensor rank
        holds other positions: its own dropout stream."""
        if self.layer_kernels is not None and not self._drops():
            return self.layer_kernels.residual(out, bias, x)
        if self.sequence_parallel and self._drops():
            with self.rng.fork("tensor"):
                return bias_dropout_add(out, bias, x, self.hidden_dropout, True, self.fused)
        return bias_dropout_add(out, bias, x, self.hidden_dropout, self.training, self.fused)


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, rng: RNGStreams, *,
                 layer_ids: Sequence[int] | None = None, pre_process: bool = True,
                 post_process: bool = True, sequence_parallel: bool = False,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        self.config, self.ctx, self.rng = config, ctx, rng
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sp = sequence_parallel and ctx.tp_size > 1
        self.layer_ids = list(range(config.num_layers) if layer_ids is None else layer_ids)
        if pre_process:
            self.embedding = Embedding(config, ctx, rng, sp)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, ctx, rng, sp, i, cp_comm_type)
                                     for i in self.layer_ids})
        # --mtp-num-layers: the MTP modules, after the final norm (ptdp.model.mtp).
        self.mtp = None
        if post_process:
            self.final_layernorm = layer_norm(config, sp)
            if not config.tied_output:
                self.output_layer = vocab_parallel_matrix(config, ctx)
            if not pre_process and config.mtp_depth:
                # The MTP modules embed tokens on the last stage: its own copy of
                # the word embedding (as a tied output layer's, below).
                self.embedding = Embedding(config, ctx, rng, sp)
                setattr(self.embedding.word_embeddings.weight, COPY_ATTR, True)
            elif config.tied_output and not pre_process:
                # A later pipeline stage keeps its own copy of the tied word
                # embedding, under the same logical name, so it starts equal.
                self.embedding = nn.Module()
                self.embedding.word_embeddings = vocab_parallel_matrix(config, ctx)
                setattr(self.embedding.word_embeddings.weight, COPY_ATTR, True)
            if config.mtp_depth:
                self.mtp = MultiTokenPrediction(
                    config, ctx, rng, sp, lambda: TransformerLayer(config, ctx, rng, sp,
                                                                   config.num_layers - 1,
                                                                   cp_comm_type))

    def initialize(self, seed: int) -> "GPT":
        initialize_parameters(self, seed)
        return self

    def sharding_units(self) -> list[tuple[nn.Module, list[nn.Parameter], bool]]:
        """ZeRO-3's units in forward order (ptdp.parallel.sharded_params):
        (the module whose forward first uses them, their parameters, whether
        they are one of the chunk's ends: the embeddings; the final norm and
        output layer)."""
        units: list[tuple[nn.Module, list[nn.Parameter], bool]] = []
        if self.pre_process:
            units.append((self.embedding, list(self.embedding.parameters()), True))
        units += [(layer, list(layer.parameters()), False) for layer in self.layers.values()]
        if self.post_process:
            taken = {id(p) for _, params, _ in units for p in params}
            units.append((self.final_layernorm,
                          [p for p in self.parameters() if id(p) not in taken], True))
        return units

    def defer_weight_grads(self, store: DeferredWeightGrads | None) -> None:
        """Zero-bubble schedules: the column- and row-parallel layers of this
        chunk leave their weight gradients to `store`
        (ptdp.parallel.weight_grad); None: one fused backward again. The
        embedding lookups and the norms (cheap) keep theirs in the backward,
        and so does the output layer: deferring it would hold its [s, b, V/t]
        logits gradient until W, and ZB-H1's last rank holds p - 1 pending
        W's (measured: +12 % peak RSS over 1F1B at p = 4 on bench/peers.py's
        GPT; +6 % with the output layer in B, bench/zero_bubble.py)."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ExpertLinear)):
                module.weight_grads = store

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """First stage: x is tokens [b, s]; otherwise hidden [s, b, h]
        ([s/t, b, h] under sequence parallelism, also as returned). Under
        context parallelism tokens, labels and loss mask are the whole
        sequence's (every context rank reads the same microbatch) and this
        rank keeps its s/c positions (ptdp.parallel.context_layout); the
        hidden states are [s/c, b, h] ([s/(c·t), b, h]).

        `documents` (packed sequences, every stage): the microbatch's
        positions and documents (ptdp.parallel.document_attention.Documents),
        whole like the labels.

        Returns hidden [s, b, h] unless this is the last stage; there it
        returns the mean loss over unmasked tokens when `labels` [b, s] are
        given, else this rank's logits [s, b, V'/t]. With --mtp-num-layers,
        in training, the loss's backward also trains the MTP modules' loss
        (ptdp.model.mtp), which its value leaves out.
        """
        positions, packed = None, documents
        if documents is not None:
            positions = self._own_positions(documents.position_ids)
            if documents.document_ids is None:  # positions only: attention crosses documents
                documents = None
        if self.pre_process:
            x = self.embedding(self._own_positions(x), positions)
        x = self._run_layers(x, positions, documents)
        if not self.post_process:
            return x
        hidden = self.final_layernorm(x)
        logits = self.logits(hidden)
        if labels is None:
            return logits
        loss = self.loss(logits, labels, loss_mask)
        if self.mtp is None or not recompute_active(self):  # (MTP trains; evaluation skips it)
            return loss
        return self.mtp.attach(loss, self.mtp(self, hidden, labels, loss_mask, packed, positions))

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                    documents: Documents | None = None) -> torch.Tensor:
        """This chunk's transformer layers, with full recomputation if
        configured: uniform checkpoints consecutive groups of
        `recompute_num_layers` layers (the last may be shorter), block
        checkpoints each of the chunk's first `recompute_num_layers` layers."""
        layers = list(self.layers.values())
        config = self.config
        if config.recompute_granularity != "full" or not recompute_active(self):
            return _run_group(layers, x, positions, documents)
        n = config.recompute_num_layers
        if config.recompute_method == "uniform":
            for start in range(0, len(layers), n):
                x = checkpoint(_run_group, self.rng, layers[start:start + n], x, positions,
                               documents)
            return x
        if config.recompute_method == "block":
            for i, layer in enumerate(layers):
                x = (checkpoint(layer, self.rng, x, positions, documents) if i < n
                     else layer(x, positions, documents))
            return x
        raise ValueError(f"unknown recompute_method {config.recompute_method!r}: "
                         f"use 'uniform' or 'block'")

    @property
    def output_matrix(self) -> VocabParallelEmbedding:
        """The output layer: the word embedding when tied, else its own."""
        return self.embedding.word_embeddings if self.config.tied_output else self.output_layer

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden · Wᵀ with W the output matrix; logits stay split by vocabulary."""
        output = self.output_matrix
        if self.sequence_parallel:  # gather the positions into the vocabulary-parallel product
            logits = sequence_parallel_linear(hidden, output.weight, None, self.ctx.tp_group)
        else:
            logits = tensor_parallel_linear(hidden, output.weight, None, self.ctx.tp_group)
        return output.mask_padding(logits)

    def _own_positions(self, x: torch.Tensor) -> torch.Tensor:
        """This context rank's positions of a whole-sequence [b, s, ...] tensor."""
        if self.ctx.cp_size == 1:
            return x
        return split_sequence(x, self.ctx.cp_size, self.ctx.cp_rank)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor,
             loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss over the microbatch's unmasked tokens. Under context
        parallelism this rank's part of it: its tokens' losses summed, over
        the whole sequence's count (labels and mask come whole), so the
        context ranks' parts add up to the one-process loss and a rank whose
        tokens are all masked gives 0."""
        if self.ctx.cp_size > 1:
            count = (labels.numel() if loss_mask is None else
                     loss_mask.sum(dtype=torch.float32).clamp(min=1.0))
            labels = self._own_positions(labels)
            loss_mask = None if loss_mask is None else self._own_positions(loss_mask)
        losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1),
                                              self.output_matrix.vocab_start, self.ctx.tp_group)
        if self.ctx.cp_size > 1:
            mask = 1.0 if loss_mask is None else loss_mask.transpose(0, 1).to(losses.dtype)
            return (losses * mask).sum() / count
        if loss_mask is None:
            return losses.mean()
        mask = loss_mask.transpose(0, 1).to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def _run_group(layers: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor | None = None,
               documents: Documents | None = None) -> torch.Tensor:
    for layer in layers:
        x = layer(x, positions, documents)
    return x


def build_chunks(config: ModelConfig, ctx: ParallelContext, device: torch.device, seed: int,
                 num_chunks: int = 1, *, sequence_parallel: bool = False,
                 kind: str | None = None, split=None, cp_comm_type: str = "p2p",
                 lora: LoRAConfig | None = None, compile: bool = False) -> list[GPT]:
    """This rank's model chunks, initialised from `seed`, with its dropout
    streams seeded. Chunk c of pipeline rank r is virtual stage c·p + r and
    holds layers c·(l/v) + r·(l/(p·v)) onwards (the paper's interleaving),
    or under a kind of the V placement (ptdp.schedules.kinds) stages r and
    2p - 1 - r; the first virtual stage has the embeddings, the last the
    output layer. Under a V rank 0 holds both, and a tied output layer is
    the same parameter as the embedding (no copy to keep in step). `kind`
    None: the looped placement. `split`: a LayerSplit
    (ptdp.schedules.split) for stages of unequal layer counts. `lora`: with
    --lora-rank, every parameter frozen but the adapters it puts on
    (ptdp.model.adapters). `compile`: --compile's compiled pieces in every
    layer (ptdp.model.compiled; eager, with a note, where they cannot be)."""
    rng = RNGStreams(device)
    rng.seed(seed, ctx)
    p, last = ctx.pp_size, ctx.pp_size * num_chunks - 1
    chunks = []
    for chunk in range(num_chunks):
        stage = virtual_stage_of(kind, p, num_chunks, ctx.pp_rank, chunk)
        model = GPT(config, ctx, rng, layer_ids=layers_of(ctx.pp_rank, chunk, p, num_chunks,
                                                          config.num_layers, kind, split),
                    pre_process=stage == 0, post_process=stage == last,
                    sequence_parallel=sequence_parallel, cp_comm_type=cp_comm_type)
        if lora is not None and lora.enabled:
            attach_adapters(model, config, lora, ctx.tp_size, rng)
        model.initialize(seed)
        first = next((c for c in chunks if c.pre_process), None)
        if model.post_process and config.mtp_depth and first is not None:
            model.embedding = first.embedding  # (zbv: the MTP modules embed with the first chunk's)
        elif model.post_process and config.tied_output and first is not None:
            model.embedding.word_embeddings = first.embedding.word_embeddings
        chunks.append(model.to(device))
    if compile:
        compile_layers(chunks, device, ctx.rank)
    return chunks
