"""--use-checkpoint-args: the model's settings from --load's checkpoint.

Megatron-LM's flag: the model is built with the checkpoint's architecture
instead of the command line's, so a run can resume or fine-tune a checkpoint
without repeating its shape flags. Applied to the configuration before
validation (`with_checkpoint_shape`, called by `ptdp train` before anything
is launched); reads metadata.json only, the same on every rank.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ptdp.config import Config, ConfigError, ModelConfig, flag_of
from ptdp.checkpoint.store import (SHAPE_SETTINGS, CheckpointError, read_metadata, resolve,
                                   saved_model_config)


# --use-checkpoint-args: the model settings taken from the checkpoint. Each
# entry is (fields, view): the fields the user left unset are the
# checkpoint's; for a field the user gave, view(the run's model) must equal
# view(the checkpoint's) (None: the setting does not apply to that model).
# These decide the stored tensors or what they mean. The fields of one entry
# are one setting (the two names of the epsilon): given one, none is taken.
CHECKPOINT_ARCHITECTURE = (
    (("num_layers",), lambda m: m.num_layers),
    (("hidden_size",), lambda m: m.hidden_size),
    (("num_attention_heads",), lambda m: m.num_attention_heads),
    (("group_query_attention",), lambda m: m.group_query_attention),
    (("num_query_groups",), lambda m: m.query_groups),
    (("kv_channels",), lambda m: None if m.multi_latent_attention else
     m.head_dim if m.kv_channels is None else m.kv_channels),
    (("ffn_hidden_size",), lambda m: m.ffn_size),
    (("vocab_size",), lambda m: m.vocab_size),
    (("position_embedding_type",), lambda m: m.position_embedding_type),
    # learned positions: the table's rows; under rope only a limit on --seq-length
    (("max_position_embeddings",), lambda m: None if m.rope else m.max_positions),
    (("rotary_base",), lambda m: m.rotary_base if m.rope else None),
    (("normalization",), lambda m: m.normalization),
    (("layernorm_epsilon", "norm_epsilon"), lambda m: m.epsilon),
    (("apply_layernorm_1p",), lambda m: m.apply_layernorm_1p),
    (("swiglu",), lambda m: m.swiglu),
    # Gemma's and gpt-oss's pieces: the gate's activation, its offset and clamp,
    # the attention's scale, the scaled embeddings and the norms on the outputs.
    (("geglu",), lambda m: m.geglu),
    (("quick_geglu",), lambda m: m.quick_geglu),
    (("glu_linear_offset",), lambda m: m.glu_linear_offset if m.gated_linear_unit else None),
    (("activation_func_clamp_value",),
     lambda m: m.activation_func_clamp_value if m.gated_linear_unit else None),
    (("softmax_scale",), lambda m: m.softmax_scale),
    (("scale_embeddings",), lambda m: m.scale_embeddings),
    (("sandwich_norm",), lambda m: m.sandwich_norm),
    (("untie_embeddings_and_output_weights",), lambda m: m.untie_embeddings_and_output_weights),
    (("disable_bias_linear",), lambda m: m.disable_bias_linear),
    (("add_qkv_bias",), lambda m: m.qkv_bias and not m.bias),
    (("qk_layernorm",), lambda m: m.qk_layernorm),
    (("use_rope_scaling",), lambda m: m.use_rope_scaling if m.rope else None),
    (("rope_scaling_factor",),
     lambda m: m.rope_scaling_factor if m.rope and m.use_rope_scaling else None),
    (("rotary_percent",), lambda m: m.rotary_percent if m.rope else None),
    (("rotary_base_local",), lambda m: m.rotary_base_local if m.rope else None),
    (("rotary_seq_len_interpolation_factor",),
     lambda m: m.rotary_seq_len_interpolation_factor if m.rope else None),
    *(((name,), lambda m, name=name: getattr(m, name) if m.yarn else None)
      for name in ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                   "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim",
                   "yarn_correction_range_round_to_int")),
    # Local attention: the window, which layers use it, the softmax's sinks.
    (("window_size",), lambda m: f"{m.window[0]},{m.window[1]}" if m.window else None),
    (("window_attn_skip_freq",),
     lambda m: "[" + ",".join("1" if w else "0" for w in m.windowed_layers) + "]"
     if m.window else None),
    (("softmax_type",), lambda m: m.softmax_type),
    # Mixtures of experts: which layers, the experts, and how tokens are routed.
    (("num_experts",), lambda m: m.num_experts),
    (("moe_layer_freq",),
     lambda m: "".join("1" if moe else "0" for moe in m.moe_layer_pattern) if m.is_moe else None),
    (("moe_ffn_hidden_size",), lambda m: m.moe_ffn_size if m.is_moe else None),
    (("moe_router_topk",), lambda m: m.moe_router_topk if m.is_moe else None),
    (("moe_router_score_function",), lambda m: m.moe_router_score_function if m.is_moe else None),
    (("moe_router_pre_softmax",), lambda m: m.moe_router_pre_softmax if m.is_moe else None),
    (("moe_router_topk_scaling_factor",),
     lambda m: m.moe_router_topk_scaling_factor if m.is_moe else None),
    (("moe_router_num_groups",), lambda m: m.moe_router_num_groups if m.is_moe else None),
    (("moe_router_group_topk",), lambda m: m.moe_router_group_topk if m.is_moe else None),
    (("moe_router_enable_expert_bias",),
     lambda m: m.moe_router_enable_expert_bias if m.is_moe else None),
    (("moe_shared_expert_intermediate_size",),
     lambda m: m.moe_shared_expert_intermediate_size if m.is_moe else None),
    (("moe_shared_expert_gate",), lambda m: m.moe_shared_expert_gate if m.is_moe else None),
    # Multi-latent attention: its widths and rotation (--rope-type decides an
    # MLA model's rotation, so it is taken with the rest).
    (("multi_latent_attention",), lambda m: m.multi_latent_attention),
    *(((name,), lambda m, name=name: getattr(m, name) if m.multi_latent_attention else None)
      for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                   "v_head_dim", "rope_type", "mla_latent_norm_epsilon")),
    # Multi-token prediction: its modules are stored tensors of the model.
    (("mtp_num_layers",), lambda m: m.mtp_depth or None),
)
# Taken only where the user gave none; a value given is the run's own: they
# neither shape the stored tensors nor change their meaning (a fine-tune may
# use a shorter sequence or other dropout; the vocabulary's padding is cut
# off on save).
CHECKPOINT_RUN_SETTINGS = ("seq_length", "make_vocab_size_divisible_by", "hidden_dropout",
                           "attention_dropout")
# How the experts are trained: the balancing losses and their coefficients,
# the expert-bias update, capacity and the router's precision. Taken only
# where the user gave none (a fine-tune may change them, said in a note);
# an imported model records its family's (Qwen3-MoE's router_aux_loss_coef).
CHECKPOINT_TRAINING_SETTINGS = (
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_router_bias_update_rate", "moe_expert_capacity_factor", "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity", "moe_router_dtype", "mtp_loss_scaling_factor")


def with_checkpoint_shape(config: Config, explicit) -> Config:
    """--use-checkpoint-args: `config` with the model settings of --load's
    checkpoint (CHECKPOINT_ARCHITECTURE and CHECKPOINT_RUN_SETTINGS) in
    place of those the user left unset; `explicit` lists the settings given
    ("section.field"). A given architecture setting that disagrees with the
    checkpoint is a ConfigError naming both values: nothing given is
    overridden. The layout is not taken (a checkpoint loads under any).
    Without the flag, or without --load (which validate reports), `config`
    as it is. Reads metadata.json only: cheap, and the same on every rank."""
    train = config.train
    if not train.use_checkpoint_args or not train.load:
        return config
    try:
        directory = resolve(train.load)
        saved = saved_model_config(read_metadata(directory))
    except (CheckpointError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError([f"--use-checkpoint-args: {error}"]) from None
    given = {key.split(".", 1)[1] for key in explicit if key.startswith("model.")}
    run = dataclasses.asdict(config.model)
    for fields, _ in CHECKPOINT_ARCHITECTURE:
        if not given.intersection(fields):
            run.update({name: getattr(saved, name) for name in fields})
    run.update({name: getattr(saved, name)
                for name in (*CHECKPOINT_RUN_SETTINGS, *CHECKPOINT_TRAINING_SETTINGS)
                if name not in given})
    model = ModelConfig(**run)
    if "max_position_embeddings" not in given and not saved.rope \
            and model.max_positions != saved.max_positions:  # another --seq-length: the table stays
        model = dataclasses.replace(model, max_position_embeddings=saved.max_positions)
    problems = []
    for fields, view in CHECKPOINT_ARCHITECTURE:
        named = [name for name in fields if name in given]
        mine, theirs = view(model), view(saved)
        if fields == ("vocab_size",) and config.data.tokenizer_type == "NullTokenizer" \
                and not config.data.mock_data:
            problems.extend(_null_vocabulary_problem(model.vocab_size if named else None, theirs,
                                                     directory))
        elif named and mine is not None and theirs is not None and mine != theirs:
            problems.append(_disagreement(flag_of("model", named[0]), mine, theirs, directory))
    if problems:
        raise ConfigError(problems)
    sections = config.to_dict()
    sections["model"] = dataclasses.asdict(model)
    if "parallel.num_layers_per_virtual_pipeline_stage" not in explicit:
        # derived from --num-virtual-stages-per-pipeline-rank and the layers: again
        sections["parallel"]["num_layers_per_virtual_pipeline_stage"] = None
    return Config.from_dict(sections)


def changed_settings_note(config: Config) -> list[str]:
    """One note when the run's model settings differ from those --load's
    checkpoint was trained with in what the stored tensors do not show (a
    difference in those is refused by checkpoint.check_model_fits): the
    routing, the balancing losses, rotary and norm settings. The run uses
    its own; the note says what changed and how to keep the checkpoint's."""
    train = config.train
    if not train.load:
        return []
    try:
        directory = resolve(train.load)
        saved = saved_model_config(read_metadata(directory))
    except (CheckpointError, KeyError, TypeError, AttributeError, ValueError):
        return []  # nothing to resume, or refused with the other checkpoint problems
    model = config.model
    if any(view(model) != view(saved) for _, view in SHAPE_SETTINGS):
        return []  # another model: refused before launch
    shapes = {flag for flag, _ in SHAPE_SETTINGS}
    compared = [(fields[0], view) for fields, view in CHECKPOINT_ARCHITECTURE]
    compared += [(name, _moe_view(name)) for name in CHECKPOINT_TRAINING_SETTINGS]
    changes = [f"{flag_of('model', name)} {_value(view(model))} (checkpoint: "
               f"{_value(view(saved))})" for name, view in compared
               if flag_of("model", name) not in shapes and view(model) != view(saved)]
    if not changes:
        return []
    how = ("drop those flags: --use-checkpoint-args takes the checkpoint's" if not
           train.use_checkpoint_args else "drop those flags to take the checkpoint's")
    return [f"ptdp: note: this run's model differs from the one --load {directory} was trained "
            f"with, and the run uses its own: {'; '.join(changes)} ({how})"]


def _moe_view(name: str):
    return lambda m: getattr(m, name) if m.is_moe else None


def _value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _disagreement(flag: str, mine: Any, theirs: Any, directory: Path) -> str:
    advice = (f"drop {flag} (--use-checkpoint-args takes it from the checkpoint) or load another "
              f"checkpoint")
    if isinstance(theirs, bool):
        return (f"--use-checkpoint-args: {flag} is {'given' if mine else 'off'}, but the model of "
                f"--load {directory} was trained {'with' if theirs else 'without'} it: {advice}")
    return (f"--use-checkpoint-args: {flag} {mine} disagrees with the checkpoint's {theirs} (--load "
            f"{directory}): {advice}")


def _null_vocabulary_problem(given: int | None, theirs: int, directory: Path) -> list[str]:
    """NullTokenizer's --vocab-size N is a vocabulary of N + 1 (N: end of
    document); it says what the data's ids are, so it is never taken."""
    if given is None:
        return [f"--use-checkpoint-args with --tokenizer-type NullTokenizer: give --vocab-size "
                f"{theirs - 1} (the data's token ids are 0..{theirs - 2} and {theirs - 1} ends a "
                f"document: the vocabulary of {theirs} of the model of --load {directory})"]
    if given + 1 == theirs:
        return []
    return [f"--use-checkpoint-args: --tokenizer-type NullTokenizer --vocab-size {given} gives a "
            f"vocabulary of {given + 1}, but the model of --load {directory} has {theirs}: use "
            f"--vocab-size {theirs - 1}"]
