"""The model section: the transformer's shape (layers, widths, heads, sequence
and vocabulary), dropout and initialisation, activation recomputation, and the
Llama family's options (RMSNorm, SwiGLU, rotary embeddings, grouped-query
attention, untied output layer). Its checks look at these settings alone;
the ones against the parallel layout are in ptdp.config.checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptdp.config.base import divisors, finite_or_none, flag, flag_in, is_count, is_finite_number, \
    positive_integer_problems
from ptdp.config.local_attention import LocalAttentionFields
from ptdp.config.mla import MLAFields
from ptdp.config.moe import MoEFields
from ptdp.config.mtp import MTPFields
from ptdp.config.recompute import RecomputeModuleFields


@dataclass
class ModelConfig(MoEFields, LocalAttentionFields, MTPFields, MLAFields, RecomputeModuleFields):
    num_layers: int = flag(4, "--num-layers", "transformer layers")
    hidden_size: int = flag(128, "--hidden-size", "hidden size h")
    num_attention_heads: int = flag(4, "--num-attention-heads", "attention heads a")
    ffn_hidden_size: int | None = flag(None, "--ffn-hidden-size", "MLP hidden size (default 4·h)")
    seq_length: int = flag(64, "--seq-length", "sequence length s")
    max_position_embeddings: int | None = flag(
        None, "--max-position-embeddings", "learned positions (default --seq-length)")
    vocab_size: int = flag(50257, "--vocab-size",
                           "vocabulary size before padding (GPT-2: 50257; with --tokenizer-type "
                           "NullTokenizer the data's ids are 0..N-1 and the model gets N + 1)")
    make_vocab_size_divisible_by: int = flag(
        128, "--make-vocab-size-divisible-by",
        "pad the vocabulary to a multiple of this × tensor-parallel size; padded entries never "
        "enter the loss")
    hidden_dropout: float = flag(0.1, "--hidden-dropout", "dropout on residual-branch outputs and embeddings")
    attention_dropout: float = flag(0.1, "--attention-dropout", "dropout on attention probabilities")
    init_method_std: float = flag(0.02, "--init-method-std", "std of the normal weight initialisation")
    layernorm_epsilon: float = flag(1e-5, "--layernorm-epsilon", "LayerNorm epsilon")
    bias_gelu_fusion: bool = flag(True, "--no-bias-gelu-fusion", "do not fuse bias + GeLU",
                                  negate=True)
    bias_dropout_fusion: bool = flag(True, "--no-bias-dropout-fusion",
                                     "do not fuse bias + dropout + residual add", negate=True)
    recompute_granularity: str | None = flag(
        None, "--recompute-granularity",
        "activation recomputation: full (store only layer inputs, recompute the layers in "
        "backward) or selective (recompute only the --recompute-modules parts of each layer: by "
        "default the attention core)",
        choices=("full", "selective"))
    recompute_method: str = flag(
        "uniform", "--recompute-method",
        "with full recomputation: uniform (checkpoint groups of --recompute-num-layers layers) or "
        "block (checkpoint only the first --recompute-num-layers layers of each chunk)",
        choices=("uniform", "block"))
    recompute_num_layers: int = flag(1, "--recompute-num-layers",
                                     "layers per checkpointed group (uniform) or checkpointed "
                                     "layers per chunk (block)")
    recompute_activations: bool = flag(
        False, "--recompute-activations",
        "Megatron-LM's alias of --recompute-granularity selective")
    # The Llama family's options (Megatron-LM's flags). Their defaults are GPT-2.
    normalization: str = flag("LayerNorm", "--normalization",
                              "normalization layers: LayerNorm, or RMSNorm (no mean, no bias)",
                              choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float | None = flag(
        None, "--norm-epsilon",
        "epsilon of the normalization layers (Megatron-LM's newer name for --layernorm-epsilon; "
        "default: --layernorm-epsilon)")
    swiglu: bool = flag(False, "--swiglu",
                        "gated MLP: silu(x·W_gate) ⊙ (x·W_up), then W_down; --ffn-hidden-size is "
                        "the gated width (default as Megatron-LM: 4·h·2/3 rounded down to a "
                        "multiple of 64)")
    geglu: bool = flag(
        False, "--geglu",
        "gated MLP with GeLU (tanh approximation) as the gate's activation: gelu(x·W_gate) ⊙ "
        "(x·W_up), then W_down (Gemma's GeGLU). Not a Megatron-LM flag: Megatron-Core sets "
        "gated_linear_unit with an openai_gelu activation_func (Megatron-Bridge's Gemma "
        "providers); --ffn-hidden-size defaults to 4·h")
    quick_geglu: bool = flag(
        False, "--quick-geglu",
        "gated MLP with quick GeLU, g·sigmoid(1.702·g), as the gate g's activation (gpt-oss, "
        "with --glu-linear-offset 1 and --activation-func-clamp-value 7); --ffn-hidden-size "
        "defaults to 4·h")
    glu_linear_offset: float = flag(
        0.0, "--glu-linear-offset",
        "with a gated MLP: added to the up projection before the product, act(gate) ⊙ (up + "
        "offset) (gpt-oss: 1)")
    activation_func_clamp_value: float | None = flag(
        None, "--activation-func-clamp-value",
        "with a gated MLP: the gate is clamped to at most C and the up projection to [-C, C] "
        "before the activation (gpt-oss: 7)")
    position_embedding_type: str = flag(
        "learned_absolute", "--position-embedding-type",
        "learned_absolute (a learned table added to the word embeddings), rope (rotary "
        "embeddings applied to each head's queries and keys) or yarn (rope with YaRN's "
        "long-context frequencies and attention factor: --rotary-scaling-factor, --yarn-*, "
        "--mscale)", choices=("learned_absolute", "rope", "yarn"))
    rotary_base: float = flag(10000.0, "--rotary-base",
                              "with rope: the base θ of the rotary frequencies")
    rotary_base_local: float | None = flag(
        None, "--rotary-base-local",
        "with rope: the base θ of the sliding-window layers' rotary frequencies, unscaled (Gemma "
        "3's rope_local_base_freq, 10000); default: those layers rotate as the others. Not a "
        "Megatron-LM flag: Megatron-Bridge's Gemma 3 provider calls it rotary_base_local")
    group_query_attention: bool = flag(
        False, "--group-query-attention",
        "grouped-query attention: --num-query-groups key/value heads, each shared by "
        "heads/groups query heads")
    num_query_groups: int | None = flag(None, "--num-query-groups",
                                        "with --group-query-attention: key/value heads G")
    untie_embeddings_and_output_weights: bool = flag(
        False, "--untie-embeddings-and-output-weights",
        "an output layer of its own instead of the word embedding's transpose")
    disable_bias_linear: bool = flag(False, "--disable-bias-linear",
                                     "no biases in the linear layers (normalization biases stay)")
    apply_layernorm_1p: bool = flag(
        False, "--apply-layernorm-1p",
        "zero-centred normalization scales: each norm stores w and scales by 1 + w (w starts at "
        "0), which keeps the scale's precision in bf16/fp16")
    softmax_scale: float | None = flag(
        None, "--softmax-scale",
        "the attention scores' scale, softmax(scale · q kᵀ) (default 1/√d, d the head width; "
        "Gemma 3: query_pre_attn_scalar^-0.5). Megatron-Core's TransformerConfig.softmax_scale, "
        "which Megatron-LM's parser does not offer as a flag")
    scale_embeddings: bool = flag(
        False, "--scale-embeddings",
        "word embeddings multiplied by √h, the factor rounded to the embedding's dtype (Gemma's "
        "scaled embeddings). Not a Megatron-LM flag: Megatron-Bridge's Gemma embedding does it")
    sandwich_norm: bool = flag(
        False, "--sandwich-norm",
        "a norm of --normalization's kind also on attention's output and on the MLP's output, "
        "before each residual add (Gemma 2/3's post_attention_layernorm and "
        "post_feedforward_layernorm; ptdp's modules attention_output_layernorm and "
        "mlp_output_layernorm). Not a Megatron-LM flag: Megatron-Bridge's Gemma layer spec puts "
        "a post_layernorm in linear_proj and linear_fc2")
    kv_channels: int | None = flag(
        None, "--kv-channels",
        "width d of each attention head (default --hidden-size / --num-attention-heads); the "
        "queries, keys and values are heads·d wide and the attention's output layer maps heads·d "
        "back to --hidden-size (Qwen3's heads are wider than h/a)")
    qk_layernorm: bool = flag(
        False, "--qk-layernorm",
        "normalize each head's query and key (a norm of --normalization's kind over the head's d "
        "values, one weight per norm shared by the heads) before the rotary embedding, as Qwen3 "
        "and OLMo do")
    add_qkv_bias: bool = flag(
        False, "--add-qkv-bias",
        "biases on the query, key and value projections even with --disable-bias-linear (Qwen2)")
    use_rope_scaling: bool = flag(
        False, "--use-rope-scaling",
        "with rope: Llama 3.1's rescaled rotary frequencies (wavelengths beyond 8192 positions "
        "divided by --rope-scaling-factor, those under 2048 kept, a smooth blend between)")
    rope_scaling_factor: float = flag(8.0, "--rope-scaling-factor",
                                      "with --use-rope-scaling: the factor (Llama 3.1: 8; "
                                      "Llama 3.2: 32)")
    rotary_seq_len_interpolation_factor: float | None = flag(
        None, "--rotary-seq-len-interpolation-factor",
        "with rope: linear position interpolation: positions are divided by F, i.e. every rotary "
        "frequency (Hugging Face's rope_type 'linear' with factor F; Gemma 3 4B and up: 8 on "
        "the full-attention layers); layers with --rotary-base-local are not scaled")
    # YaRN (--position-embedding-type yarn): Megatron-LM's flags and defaults.
    rotary_scaling_factor: float = flag(
        1.0, "--rotary-scaling-factor",
        "with yarn: how many times the original context is stretched (gpt-oss: 32); the "
        "slowest rotary pairs turn this much slower")
    yarn_original_max_position_embeddings: int = flag(
        4096, "--yarn-original-max-position-embeddings",
        "with yarn: the context the model was first trained at, over which each pair's turns "
        "are counted")
    yarn_beta_fast: float = flag(
        32.0, "--yarn-beta-fast",
        "with yarn: pairs turning more often than this over the original context keep their "
        "frequency")
    yarn_beta_slow: float = flag(
        1.0, "--yarn-beta-slow",
        "with yarn: pairs turning less often than this over the original context are slowed by "
        "the whole factor; those between blend linearly")
    mscale: float = flag(
        1.0, "--mscale",
        "with yarn: cos and sin are multiplied by the attention factor "
        "(0.1·mscale·ln f + 1) / (0.1·mscale_all_dim·ln f + 1), f = --rotary-scaling-factor, "
        "so each logit by its square")
    mscale_all_dim: float = flag(0.0, "--mscale-all-dim",
                                 "with yarn: the attention factor's denominator (see --mscale)")
    yarn_correction_range_round_to_int: bool = flag(
        True, "--yarn-correction-range-round-to-int",
        "with yarn: round the blended pairs' range outwards to whole pairs (Hugging Face's "
        "truncate; --no-yarn-correction-range-round-to-int keeps it fractional, as gpt-oss)",
        off_flag="--no-yarn-correction-range-round-to-int")
    use_rotary_position_embeddings: bool = flag(
        False, "--use-rotary-position-embeddings",
        "older Megatron-LM's switch for --position-embedding-type rope")
    add_position_embedding: bool = flag(
        True, "--no-position-embedding",
        "older Megatron-LM's way to say the model has no learned position table; ptdp models "
        "without one use rotary embeddings (--position-embedding-type rope)", negate=True)
    rotary_percent: float = flag(
        1.0, "--rotary-percent",
        "with rope: the fraction p of each head's width d that is rotated: its first int(p·d) "
        "dimensions, paired as halves of that width, turn and the rest pass unchanged "
        "(Hugging Face's partial_rotary_factor)")
    attention_backend: str = flag(
        "auto", "--attention-backend",
        "Megatron-LM's choice of attention implementation; ptdp's is always PyTorch's "
        "scaled_dot_product_attention, which picks its kernel itself: any other value than auto "
        "makes the first rank report the kernel it picks", choices=("auto", "flash", "fused",
                                                                  "unfused", "local"))
    use_flash_attn: bool = flag(
        False, "--use-flash-attn",
        "older Megatron-LM's switch for flash attention; PyTorch's attention picks flash "
        "attention itself where it can: the first rank reports the kernel it picks")
    activations_checkpoint_method: str | None = flag(
        None, "--activations-checkpoint-method",
        "older Megatron-LM's name for full recomputation with --recompute-method METHOD",
        choices=("uniform", "block"))

    def __post_init__(self) -> None:
        super().__post_init__()  # the MoE settings' Megatron-LM readings
        LocalAttentionFields.__post_init__(self)
        if self.use_rotary_position_embeddings and not self.yarn:  # as Megatron-LM reads it
            self.position_embedding_type = "rope"
        self._mla_rotation()
        # The alias sets what every consumer reads; with --recompute-granularity
        # full it is a contradiction that validate reports.
        if self.recompute_activations and self.recompute_granularity is None:
            self.recompute_granularity = "selective"
        # Older Megatron-LM's --activations-checkpoint-method alone turned full
        # recomputation on (what the paper's sc21 scripts rely on).
        if self.activations_checkpoint_method is not None and self.recompute_granularity is None:
            self.recompute_granularity = "full"
            self.recompute_method = self.activations_checkpoint_method

    @property
    def ffn_size(self) -> int:
        return self.ffn_size_at(self.hidden_size)

    def ffn_size_at(self, hidden_size: int) -> int:
        """The MLP width with this hidden size: --ffn-hidden-size if given,
        else the default, which follows h (a hint that changes h changes it)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Megatron-LM's default: the gated MLP's three matrices hold about
            # as many parameters as GPT's two at 4·h, kept a multiple of 64.
            return int(4 * hidden_size * 2 / 3 / 64) * 64
        return 4 * hidden_size

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLP is gated (--swiglu, --geglu, --quick-geglu): its
        first matrix holds the gate's and the up projection's rows."""
        return self.swiglu or self.geglu or self.quick_geglu

    @property
    def gated_activation(self) -> str | None:
        """The gate's activation: silu, gelu (tanh), quick_gelu; None: GeLU MLP."""
        for name, on in (("silu", self.swiglu), ("gelu", self.geglu),
                         ("quick_gelu", self.quick_geglu)):
            if on:
                return name
        return None

    @property
    def epsilon(self) -> float:
        """The normalization layers' epsilon."""
        return self.layernorm_epsilon if self.norm_epsilon is None else self.norm_epsilon

    @property
    def head_dim(self) -> int:
        """Each attention head's width d: --kv-channels, else h/a."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the query/key/value projection has a bias."""
        return self.bias or self.add_qkv_bias

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups under grouped-query attention, else one per head."""
        if self.group_query_attention and self.num_query_groups is not None:
            return self.num_query_groups
        return self.num_attention_heads

    @property
    def rope(self) -> bool:
        """Whether queries and keys are rotated (rope, or rope with YaRN)."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def yarn(self) -> bool:
        return self.position_embedding_type == "yarn"

    @property
    def tied_output(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def bias(self) -> bool:
        """Whether the linear layers have biases."""
        return not self.disable_bias_linear

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple


def model_count_problems(m: ModelConfig) -> list[str]:
    """The model's sizes that must be positive integers."""
    return positive_integer_problems(
        m, ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
            "max_position_embeddings", "vocab_size", "num_query_groups",
            "make_vocab_size_divisible_by"),
        optional=("ffn_hidden_size", "max_position_embeddings", "num_query_groups"))


def dropout_problems(m: ModelConfig) -> list[str]:
    """--hidden-dropout, --attention-dropout."""
    problems = []
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(m, name)
        if finite_or_none(p) and not 0.0 <= p < 1.0:
            problems.append(f"{flag_in(ModelConfig, name)}={p} must be in [0, 1)")
    return problems


def initialisation_problems(m: ModelConfig) -> list[str]:
    """--init-method-std, --layernorm-epsilon."""
    problems = []
    if finite_or_none(m.init_method_std) and m.init_method_std <= 0:
        problems.append(f"--init-method-std={m.init_method_std} must be > 0 (weights all equal at "
                        f"initialisation cannot learn different features; GPT-2 uses 0.02)")
    if finite_or_none(m.layernorm_epsilon) and m.layernorm_epsilon <= 0:
        problems.append(f"--layernorm-epsilon={m.layernorm_epsilon} must be > 0 (it keeps LayerNorm "
                        f"finite on a constant input; GPT-2 uses 1e-05)")
    return problems


def architecture_problems(m: ModelConfig) -> list[str]:
    """The Llama-family options: each alone and against the shape."""
    problems = []
    if is_finite_number(m.norm_epsilon) and m.norm_epsilon <= 0:
        problems.append(f"--norm-epsilon={m.norm_epsilon} must be > 0 (it keeps the normalization "
                        f"finite on a constant input; Llama uses 1e-05 or 1e-06)")
    default_epsilon = ModelConfig.layernorm_epsilon
    if (m.norm_epsilon is not None and m.layernorm_epsilon != default_epsilon
            and m.norm_epsilon != m.layernorm_epsilon):
        problems.append(f"--norm-epsilon {m.norm_epsilon} and --layernorm-epsilon "
                        f"{m.layernorm_epsilon} disagree (they are one setting): give one of them")
    if is_finite_number(m.rotary_base) and m.rotary_base <= 0:
        problems.append(f"--rotary-base={m.rotary_base} must be > 0 (Llama 2 uses 10000, Llama 3 "
                        f"500000)")
    if m.rope and m.kv_channels is not None and isinstance(m.kv_channels, int) \
            and m.kv_channels > 0 and m.kv_channels % 2:
        problems.append(f"--position-embedding-type rope needs an even head dimension, but "
                        f"--kv-channels is {m.kv_channels}: use an even --kv-channels, "
                        f"e.g. {m.kv_channels + 1}")
    elif m.rope and m.kv_channels is None and isinstance(m.hidden_size, int) \
            and isinstance(m.num_attention_heads, int) and m.num_attention_heads > 0 \
            and m.hidden_size % m.num_attention_heads == 0 and m.head_dim % 2:
        problems.append(f"--position-embedding-type rope needs an even head dimension, but "
                        f"--hidden-size {m.hidden_size} / --num-attention-heads "
                        f"{m.num_attention_heads} = {m.head_dim}: choose heads that give an even "
                        f"quotient")
    problems += _position_option_problems(m)
    groups = m.num_query_groups
    if groups is not None and not is_count(groups, 1):
        pass  # reported with the other positive integers
    elif groups is not None and not m.group_query_attention:
        problems.append(f"--num-query-groups {groups} is only used with --group-query-attention: "
                        f"add --group-query-attention or drop --num-query-groups")
    elif m.group_query_attention and groups is None:
        problems.append("--group-query-attention needs --num-query-groups G (the key/value heads; "
                        "G must divide --num-attention-heads)")
    elif groups is not None and isinstance(m.num_attention_heads, int) \
            and m.num_attention_heads % groups:
        heads = m.num_attention_heads
        problems.append(f"--num-query-groups {groups} does not divide --num-attention-heads {heads} "
                        f"(each key/value group serves the same number of query heads): use "
                        f"--num-query-groups in {divisors(heads)}")
    if m.swiglu and m.ffn_hidden_size is None and isinstance(m.hidden_size, int) and m.ffn_size < 1:
        problems.append(f"--swiglu with --hidden-size {m.hidden_size} gives a default "
                        f"--ffn-hidden-size of 0 (4·h·2/3 rounded down to a multiple of 64): give "
                        f"--ffn-hidden-size, e.g. {max(1, round(8 * m.hidden_size / 3))}")
    return problems


def _position_option_problems(m: ModelConfig) -> list[str]:
    """Llama 3.1's rescaling and Megatron-LM's older position switches."""
    problems = []
    if m.use_rope_scaling and not m.rope:
        problems.append(f"--use-rope-scaling rescales rotary frequencies, but the model has "
                        f"--position-embedding-type {m.position_embedding_type}: add "
                        f"--position-embedding-type rope or drop --use-rope-scaling")
    if is_finite_number(m.rope_scaling_factor) and m.rope_scaling_factor < 1:
        problems.append(f"--rope-scaling-factor={m.rope_scaling_factor} must be at least 1 (it "
                        f"divides the low frequencies; Llama 3.1 uses 8, Llama 3.2 32)")
    if not m.add_position_embedding and not m.rope:
        problems.append("--no-position-embedding leaves the model without positions: ptdp's "
                        "models without a learned position table use rotary embeddings, so add "
                        "--position-embedding-type rope (or --use-rotary-position-embeddings), or "
                        "drop --no-position-embedding")
    return problems


def recompute_problems(m: ModelConfig) -> list[str]:
    """--recompute-activations against --recompute-granularity, --recompute-num-layers."""
    problems = []
    if m.recompute_activations and m.recompute_granularity not in (None, "selective"):
        problems.append(f"--recompute-activations is Megatron-LM's alias of --recompute-granularity "
                        f"selective, so it contradicts --recompute-granularity "
                        f"{m.recompute_granularity}: give one of them")
    if not isinstance(m.recompute_num_layers, int) or m.recompute_num_layers < 1:
        problems.append(f"--recompute-num-layers={m.recompute_num_layers!r} must be a positive "
                        f"integer")
    return problems


def position_problems(m: ModelConfig) -> list[str]:
    """--seq-length against the learned positions."""
    problems = []
    if m.seq_length > m.max_positions:
        problems.append(
            f"--seq-length {m.seq_length} exceeds --max-position-embeddings {m.max_positions}: "
            f"use --max-position-embeddings {m.seq_length} or a shorter --seq-length")
    return problems
