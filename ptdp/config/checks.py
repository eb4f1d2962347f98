"""`validate`: every section's own checks and the ones across sections (the
layout against the model's shape and the batch), before any process starts.
It never adjusts a value: each problem becomes a message naming the flag, the
values and a valid alternative, and all problems are reported together, in
one order: first each setting alone (the sections' checks, interleaved as the
flags were added), then, once the sizes are positive integers, the layout's
arithmetic."""

from __future__ import annotations

import math
from typing import Any, Sequence

from ptdp.plural import plural
from ptdp.config.base import ConfigError, divisors, flag_in, is_count, is_finite_number, \
    nearest_multiple
from ptdp.config.context import context_parallel_problems
from ptdp.config.local_attention import local_attention_problems
from ptdp.config.data import data_loading_problems
from ptdp.config.lora import lora_problems
from ptdp.config.mla import mla_problems
from ptdp.config.mtp import mtp_problems
from ptdp.config.recompute import recompute_module_problems
from ptdp.schedules.kinds import (KINDS, SEARCHED, ScheduleKind, any_chunks_kind, lower_first,
                                  or_list)
from ptdp.schedules.split import split_problems
from ptdp.config.model import ModelConfig, architecture_problems, dropout_problems, \
    initialisation_problems, model_count_problems, position_problems, recompute_problems
from ptdp.config.moe import expert_parallel_problems, moe_count_problems, moe_problems
from ptdp.config.parallel import ParallelConfig, parallel_count_problems, timeout_problems
from ptdp.config.sections import Config, flag_fields
from ptdp.config.train import TrainConfig, logging_problems, loss_and_rate_problems, \
    optimizer_problems, precision_and_lr_problems, resume_control_problems, run_length_problems, \
    stopping_problems, train_count_problems


def validate(config: Config, world_size: int | None = None) -> None:
    """Check every constraint; raise ConfigError listing all problems.

    `world_size` is the number of processes the job actually has (under
    torchrun or SLURM); for a local launch it is None and t·c·p·d processes
    will be started.
    """
    m, par, tr = config.model, config.parallel, config.train
    count_problems = (model_count_problems(m) + moe_count_problems(m) + parallel_count_problems(par)
                      + train_count_problems(tr))
    problems: list[str] = list(count_problems)
    # Every float setting must be a finite number (argparse's float() and
    # YAML both read nan and inf). Each range check below looks only at the
    # settings that pass, so a nan is reported once, as a nan.
    problems.extend(_float_problems(config))
    problems.extend(dropout_problems(m))
    problems.extend(_choice_problems(config))
    problems.extend(timeout_problems(par))
    problems.extend(initialisation_problems(m))
    problems.extend(architecture_problems(m))
    problems.extend(_gated_unit_problems(m))
    problems.extend(moe_problems(m))
    problems.extend(local_attention_problems(m))
    problems.extend(mla_problems(config))
    problems.extend(mtp_problems(m, par, config.lora))
    problems.extend(precision_and_lr_problems(tr))
    problems.extend(run_length_problems(tr))
    problems.extend(recompute_problems(m) + recompute_module_problems(m))
    problems.extend(optimizer_problems(tr))
    problems.extend(stopping_problems(tr))
    problems.extend(_megatron_shape_problems(config))
    problems.extend(resume_control_problems(tr))
    problems.extend(loss_and_rate_problems(tr))
    problems.extend(logging_problems(tr))
    problems.extend(data_loading_problems(config.data))
    problems.extend(lora_problems(config.lora))
    if config.lora.enabled and tr.decoupled_lr is not None:
        problems.append("--decoupled-lr sets the word embedding's and output layer's rate, but "
                        "--lora-rank freezes them (only the adapters train): leave it out")
    if count_problems:  # the structural checks below would only repeat these problems
        raise ConfigError(problems)

    # World size and the data-parallel size. Later checks use the d the job
    # will really have, so every problem shows up in this one report.
    d, world_problems = _data_parallel_size(par, world_size)
    problems.extend(world_problems)
    problems.extend(_tensor_problems(m, par, world_size))
    problems.extend(context_parallel_problems(m, par, world_size))
    problems.extend(position_problems(m))
    pipeline_problems, offered_pipeline_sizes = _pipeline_problems(m, par, tr, d, world_size)
    problems.extend(pipeline_problems)
    problems.extend(_batch_problems(tr, par, d, offered_pipeline_sizes))
    problems.extend(expert_parallel_problems(m, par, world_size))
    if problems:
        raise ConfigError(problems)


# ---------------------------------------------------------------- helpers of validate

def _float_problems(config: Config) -> list[str]:
    """A problem for each float setting that is not a finite number."""
    problems = []
    for section, f in flag_fields():
        if f.type.split("|")[0].strip() != "float":
            continue
        value = getattr(getattr(config, section), f.name)
        if (value is None and "None" in f.type) or is_finite_number(value):
            continue
        what = "is not a finite number" if isinstance(value, float) else "is not a number"
        instead = (f"give a finite number or leave {f.metadata['flag']} out" if f.default is None
                   else f"give a finite number (the default is {f.default:g})")
        problems.append(f"{f.metadata['flag']}={value!r} {what}: {instead}")
    return problems


def _choice_problems(config: Config) -> list[str]:
    """A problem for each flag with choices whose value is not one of them."""
    problems = []
    for section, f in flag_fields():
        choices = f.metadata.get("choices")
        value = getattr(getattr(config, section), f.name)
        if choices and value not in choices and not (value is None and "None" in f.type):
            problems.append(f"{f.metadata['flag']}={value!r} is not one of {', '.join(map(str, choices))}")
    return problems


def _gated_unit_problems(m: ModelConfig) -> list[str]:
    """--swiglu/--geglu/--quick-geglu, their offset and clamp, and
    --softmax-scale (each float is finite here or reported by
    _float_problems). Gemma's and gpt-oss's other pieces (--scale-embeddings,
    --sandwich-norm, biases) combine with everything."""
    problems = []
    chosen = [f for f, on in (("--swiglu", m.swiglu), ("--geglu", m.geglu),
                              ("--quick-geglu", m.quick_geglu)) if on]
    if len(chosen) > 1:
        problems.append(f"{' and '.join(chosen)} each choose the gated MLP's activation (silu, "
                        f"tanh GeLU, quick GeLU): give one of them")
    offset, clamp = m.glu_linear_offset, m.activation_func_clamp_value
    given = ([f"--glu-linear-offset {offset:g}"] if is_finite_number(offset) and offset else []) \
        + ([f"--activation-func-clamp-value {clamp:g}"] if is_finite_number(clamp) else [])
    if given and not m.gated_linear_unit:
        verb = "act" if len(given) > 1 else "acts"
        problems.append(f"{' and '.join(given)} {verb} on a gated MLP's gate and up projection, but "
                        f"the MLP is GeLU's: add --quick-geglu (gpt-oss), --swiglu or --geglu, or "
                        f"drop them")
    if is_finite_number(clamp) and clamp <= 0:
        problems.append(f"--activation-func-clamp-value={clamp:g} must be > 0 (the gate is "
                        f"clamped to at most C and the up projection to [-C, C]; gpt-oss uses 7)")
    scale = m.softmax_scale
    if is_finite_number(scale) and scale <= 0:
        problems.append(f"--softmax-scale={scale:g} must be > 0 (it multiplies the attention "
                        f"scores; leave it out for 1/√d, or give query_pre_attn_scalar^-0.5 for "
                        f"Gemma 3, e.g. 0.0625 for 256)")
    return problems


_YARN_SETTINGS = ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                  "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim",
                  "yarn_correction_range_round_to_int")


def _rotary_variant_problems(m: ModelConfig) -> list[str]:
    """--rotary-percent, --rotary-base-local, the interpolation factor and
    YaRN's settings (each float is finite here or reported by _float_problems)."""
    problems = []
    fine = is_finite_number
    if fine(m.rotary_percent) and m.rotary_percent != 1.0:
        if not m.rope:
            problems.append(f"--rotary-percent {m.rotary_percent} sets how much of each head is "
                            f"rotated, but the model has --position-embedding-type "
                            f"{m.position_embedding_type}: add --position-embedding-type rope or "
                            f"drop --rotary-percent")
        elif not 0 < m.rotary_percent <= 1:
            problems.append(f"--rotary-percent={m.rotary_percent} must be in (0, 1]: the fraction "
                            f"of each head's width that is rotated (GPT-NeoX: 0.25)")
        elif is_count(m.hidden_size, 1) and is_count(m.num_attention_heads, 1) and (
                m.kv_channels is None or is_count(m.kv_channels, 1)):
            width = int(m.head_dim * m.rotary_percent)
            if width < 2 or width % 2:
                problems.append(
                    f"--rotary-percent {m.rotary_percent} of the head width {m.head_dim} rotates "
                    f"int({m.rotary_percent}·{m.head_dim}) = {width} dimensions, which must be an "
                    f"even number of at least 2 (rotary pairs): choose a fraction that gives one, "
                    f"e.g. {max(2, width - width % 2) / m.head_dim:g}")
    if m.rotary_base_local is not None and fine(m.rotary_base_local):
        if not m.rope:
            problems.append(f"--rotary-base-local {m.rotary_base_local:g} is the sliding-window "
                            f"layers' rotary base, but the model has --position-embedding-type "
                            f"{m.position_embedding_type}: add --position-embedding-type rope or "
                            f"drop --rotary-base-local")
        elif m.rotary_base_local <= 0:
            problems.append(f"--rotary-base-local={m.rotary_base_local} must be > 0 (Gemma 3 uses "
                            f"10000)")
    problems.extend(_interpolation_problems(m))
    if not m.yarn:
        # (a value that is no finite number is reported as such, once)
        given = ["--no-yarn-correction-range-round-to-int" if value is False else
                 f"{flag_in(ModelConfig, name)} {value}" for name in _YARN_SETTINGS
                 if (value := getattr(m, name)) != getattr(ModelConfig, name)
                 and (isinstance(value, bool) or fine(value))]
        if given and m.multi_latent_attention and m.rope:   # its rotation is --rope-type's
            problems.append(f"{', '.join(given)}: YaRN's settings act only with YaRN, which "
                            f"--rope-type rope turns off for multi-latent attention: drop "
                            f"--rope-type rope (MLA's default is yarn) or drop them")
        elif given:
            problems.append(f"{', '.join(given)}: YaRN's settings act only with "
                            f"--position-embedding-type yarn, but the model has "
                            f"{m.position_embedding_type}: add --position-embedding-type yarn or "
                            f"drop them")
        return problems
    return problems + _yarn_problems(m)


def _interpolation_problems(m: ModelConfig) -> list[str]:
    """--rotary-seq-len-interpolation-factor: positive, on plain rope only."""
    factor = m.rotary_seq_len_interpolation_factor
    if factor is None or not is_finite_number(factor):  # (a non-finite one: _float_problems)
        return []
    given = f"--rotary-seq-len-interpolation-factor {factor:g}"
    if not m.rope:
        return [f"{given} divides the rotary embeddings' positions, but the model has "
                f"--position-embedding-type {m.position_embedding_type}: add "
                f"--position-embedding-type rope or drop --rotary-seq-len-interpolation-factor"]
    if factor <= 0:
        return [f"--rotary-seq-len-interpolation-factor={factor} must be > 0: positions are "
                f"divided by it (Gemma 3 4B and up: 8 on the full-attention layers)"]
    if m.yarn:
        return [f"{given} and --position-embedding-type yarn both rescale the rotary "
                f"frequencies, and ptdp does not combine them: give --position-embedding-type "
                f"rope with the interpolation factor, or YaRN's --rotary-scaling-factor without it"]
    if m.use_rope_scaling:
        return [f"{given} and --use-rope-scaling (Llama 3.1's rescaling) both rescale the "
                f"rotary frequencies, and ptdp does not combine them: drop one of them"]
    return []


def _yarn_problems(m: ModelConfig) -> list[str]:
    """YaRN's settings under --position-embedding-type yarn."""
    problems = []
    fine = is_finite_number
    if m.use_rope_scaling:
        problems.append("--use-rope-scaling (Llama 3.1's rescaling) and --position-embedding-type "
                        "yarn both rescale the rotary frequencies: give one of them")
    factor = m.rotary_scaling_factor
    if fine(factor) and factor < 1:
        problems.append(f"--rotary-scaling-factor={factor} must be at least 1 (how many times the "
                        f"original context is stretched; gpt-oss uses 32)")
    if not is_count(m.yarn_original_max_position_embeddings, 1):
        problems.append(f"--yarn-original-max-position-embeddings="
                        f"{m.yarn_original_max_position_embeddings!r} must be a positive integer "
                        f"(the context the model was first trained at; gpt-oss: 4096)")
    fast, slow = m.yarn_beta_fast, m.yarn_beta_slow
    # (equal betas are a step instead of a ramp, as Kimi K2 publishes them)
    if fine(fast) and fine(slow) and not 0 < slow <= fast:
        problems.append(f"--yarn-beta-fast {fast} and --yarn-beta-slow {slow} must satisfy "
                        f"0 < beta_slow <= beta_fast: they are the turns over the original context "
                        f"above which a pair keeps its frequency and below which it is slowed "
                        f"(YaRN's paper and gpt-oss: 32 and 1)")
    if fine(factor) and factor >= 1 and fine(m.mscale) and fine(m.mscale_all_dim):
        numerator, denominator = (0.1 * scale * math.log(factor) + 1
                                  for scale in (m.mscale, m.mscale_all_dim))
        if numerator <= 0 or denominator <= 0:
            problems.append(f"--mscale {m.mscale} and --mscale-all-dim {m.mscale_all_dim} with "
                            f"--rotary-scaling-factor {factor} give the attention factor "
                            f"{numerator:g} / {denominator:g}, which must be a positive ratio of "
                            f"positive numbers (0.1·mscale·ln f + 1 each): use the defaults 1 and "
                            f"0, or DeepSeek-V3's equal pair")
    return problems


def _megatron_shape_problems(config: Config) -> list[str]:
    """Megatron-LM's flags whose other values ptdp cannot honour, and the
    chunk count --num-virtual-stages-per-pipeline-rank."""
    m, par = config.model, config.parallel
    problems = []
    if m.kv_channels is not None and not is_count(m.kv_channels, 1):
        problems.append(f"--kv-channels={m.kv_channels!r} must be a positive integer (each "
                        f"attention head's width), or left out (--hidden-size / "
                        f"--num-attention-heads)")
    problems.extend(_rotary_variant_problems(m))
    if m.activations_checkpoint_method is not None and (
            m.recompute_granularity != "full" or m.recompute_method != m.activations_checkpoint_method):
        problems.append(
            f"--activations-checkpoint-method {m.activations_checkpoint_method} is older Megatron-LM's "
            f"name for --recompute-granularity full --recompute-method "
            f"{m.activations_checkpoint_method}, which --recompute-granularity/--recompute-method "
            f"contradict: give one of them")
    v, k = par.num_virtual_stages_per_pipeline_rank, par.num_layers_per_virtual_pipeline_stage
    layers, p = m.num_layers, par.pipeline_model_parallel_size
    if v is not None:
        if not is_count(v, 1):
            problems.append(f"--num-virtual-stages-per-pipeline-rank={v!r} must be a positive integer")
        elif is_count(layers, 1) and is_count(p, 1):
            if layers % (p * v):
                options = [x for x in divisors(layers // p) if layers % p == 0]
                problems.append(
                    f"--num-virtual-stages-per-pipeline-rank {v}: --num-layers {layers} is not "
                    f"divisible by --pipeline-model-parallel-size {p} × {v} chunks = {p * v}"
                    + (f": use a chunk count in {options}" if options else ""))
            elif k is not None and (v == 1 or k != layers // (p * v)):
                problems.append(
                    f"--num-virtual-stages-per-pipeline-rank {v} and "
                    f"--num-layers-per-virtual-pipeline-stage {k} both set the chunks: give one "
                    f"of them")
    return problems


def _interleaved(par: ParallelConfig) -> bool:
    """Whether each pipeline rank's layers are in chunks of
    --num-layers-per-virtual-pipeline-stage (interleaving)."""
    return par.interleaved


def _data_parallel_size(par: ParallelConfig, world_size: int | None) -> tuple[int, list[str]]:
    """d, and what is wrong with the world size against t·c·p and --data-parallel-size."""
    t, c, p = (par.tensor_model_parallel_size, par.context_parallel_size,
               par.pipeline_model_parallel_size)
    model = t * c * p  # the ranks of one data-parallel replica
    # The context size is named only when it is used (the messages at c = 1 as before).
    sizes = (f"--tensor-model-parallel-size {t} × "
             + (f"--context-parallel-size {c} × " if c > 1 else "")
             + f"--pipeline-model-parallel-size {p}")
    problems = []
    if world_size is not None:
        if world_size % model:
            product, names = ("t·c·p", "t, c and p") if c > 1 else ("t·p", "t and p")
            problems.append(
                f"the job has {plural(world_size, 'process')}, not a multiple of {sizes} = "
                f"{model}: choose {names} with {product} in {divisors(world_size)}")
            d = par.dp
        else:
            d = world_size // model
            if par.data_parallel_size is not None and par.data_parallel_size != d:
                problems.append(
                    f"the job has {plural(world_size, 'process')} but {sizes} × --data-parallel-size "
                    f"{par.data_parallel_size} = {model * par.data_parallel_size}: use "
                    f"--data-parallel-size {d} or leave it out")
    else:
        d = par.dp
    return d, problems


def _closest(value: int, step: int, ok: Any, count: int = 1, reach: int = 64) -> list[int]:
    """Up to `count` multiples of `step` for which `ok` holds, the closest to
    `value` first (the smaller on a tie), searched `reach` steps either way."""
    base = max(1, round(value / step))
    found = [n * step for n in range(max(1, base - reach), base + reach + 1) if ok(n * step)]
    return sorted(found, key=lambda c: (abs(c - value), c))[:count]


# Why the hints below look as they do: a user applies every hint of one report
# together, one alternative per problem, and must then pass. So an alternative
# either fixes every rule its flags take part in, or names the flags to change
# together ("--num-attention-heads 3 --hidden-size 48"); the tensor-parallel
# sizes are offered by one problem only, and the other problems' values hold
# at the current size and at each one offered (tests/test_config_hints.py).

def _tensor_problems(m: ModelConfig, par: ParallelConfig, world_size: int | None) -> list[str]:
    """The heads, query groups, MLP and sequence against the tensor-parallel size."""
    t, p, h, a = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                  m.hidden_size, m.num_attention_heads)
    c = par.context_parallel_size  # (with c > 1 the context checks hold the sequence's rule)
    g, grouped = m.query_groups, m.query_groups != m.num_attention_heads
    problems = []

    def shape_ok(hidden: int, heads: int, tp: int) -> bool:
        """Every rule on h, a and t at once, the MLP's default width (which
        follows h) included; the query groups' and a given MLP width's own
        rules apart (their problems' hints hold at t)."""
        if hidden % heads or heads % tp or (grouped and heads % g):
            return False
        width, mlp = m.kv_channels or hidden // heads, m.ffn_size_at(hidden)
        return ((not m.rope or width % 2 == 0)
                and (m.ffn_hidden_size is not None or (mlp >= 1 and mlp % tp == 0)))

    def tp_ok(tp: int) -> bool:
        """Whether t = tp would satisfy every tensor-parallel rule at once."""
        return (shape_ok(h, a, tp) and g % tp == 0 and m.ffn_size % tp == 0
                and (world_size is None or world_size % (tp * c * p) == 0)
                and (not par.sequence_parallel or (tp > 1 and m.seq_length % (c * tp) == 0)))

    tp_options = [x for x in divisors(a) if x != t and tp_ok(x)] if h % a == 0 else []
    # The one problem that offers them: the heads', else the query groups', else
    # the sequence's; the others' values hold at t and at each one offered.
    heads_problem = bool(h % a or a % t)
    groups_problem = grouped and not (a % g or a % t) and g % t != 0
    sequence_problem = par.sequence_parallel and t > 1 and m.seq_length % t != 0 and c == 1
    offers_tp = ("heads" if heads_problem and a % t else
                 None if heads_problem else
                 "groups" if groups_problem else "sequence" if sequence_problem else None)
    offered_tp = tp_options if offers_tp else []
    offer_tp = f"--tensor-model-parallel-size in {tp_options}"

    # Attention heads and hidden size.
    offered_heads: list[int] = []
    if h % a or a % t:
        head_options = sorted(_closest(a, t, lambda x: x <= 4 * a and shape_ok(h, x, t), count=6,
                                       reach=4 * a // t + 1))
        offered_heads = list(head_options)
        alternatives = []
        if offers_tp == "heads" and tp_options:
            alternatives.append(offer_tp)
        if a % t == 0:
            alternatives += [f"--hidden-size {x}" for x in _closest(h, a, lambda x: shape_ok(x, a, t))]
        if world_size is not None and world_size % (t * c) and offers_tp == "heads" and tp_options:
            pass  # t cannot stay (the job's processes are not a multiple of it): only t's sizes
        elif head_options:
            alternatives.append(f"--num-attention-heads in {head_options}")
        elif a % t:  # no head count divisible by t divides h: change both
            width = m.kv_channels or max(1, h // a) + (1 if m.rope and max(1, h // a) % 2 else 0)
            together = _closest(a, math.lcm(t, g) if grouped else t,
                                lambda x: shape_ok(x * width, x, t))
            alternatives += [f"--num-attention-heads {x} --hidden-size {x * width} (together: {x} "
                             f"heads of {width})" for x in together]
            offered_heads += together
        use = ": use " + " or ".join(alternatives) if alternatives else ""
        if h % a and a % t:
            problems.append(f"--num-attention-heads {a} is not divisible by "
                            f"--tensor-model-parallel-size {t} and does not divide --hidden-size "
                            f"{h}{use}")
        elif h % a:
            problems.append(f"--hidden-size {h} is not divisible by --num-attention-heads {a}{use}")
        else:
            problems.append(f"--num-attention-heads {a} is not divisible by "
                            f"--tensor-model-parallel-size {t}{use}")
    # (heads not divisible by the groups or by t: reported above)
    if groups_problem:
        alternatives = [offer_tp] if offers_tp == "groups" and tp_options else []
        robust = t if offers_tp == "groups" else math.lcm(t, *offered_tp)
        group_options = [x for x in divisors(a) if x % robust == 0
                         and all(heads % x == 0 for heads in offered_heads)]
        if group_options:
            alternatives.append(f"--num-query-groups in {group_options}")
        problems.append(
            f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size {t} (each "
            f"tensor rank holds whole key/value groups and the query heads that use them)"
            + (": use " + " or ".join(alternatives) if alternatives else ""))
    # The MLP. Its default width follows h, so a fix above fixes it too.
    if m.ffn_size % t and not (heads_problem and m.ffn_hidden_size is None):
        problems.append(
            f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {t}: "
            f"use --ffn-hidden-size {nearest_multiple(m.ffn_size, math.lcm(t, *offered_tp))}")
    if par.sequence_parallel and t == 1:
        problems.append("--sequence-parallel splits the sequence over the tensor-parallel ranks and "
                        "needs --tensor-model-parallel-size > 1: drop --sequence-parallel or raise t")
    elif sequence_problem:
        own_tp = offers_tp == "sequence" and tp_options
        robust = t if offers_tp == "sequence" else math.lcm(t, *offered_tp)
        lengths = _closest(m.seq_length, robust, lambda x: x <= m.max_positions
                           or m.max_position_embeddings is None)
        alternatives = [f"--seq-length {x}" for x in lengths] + ([offer_tp] if own_tp else [])
        problems.append(
            f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
            f"--tensor-model-parallel-size {t} (each tensor rank holds s/t positions)"
            + (": use " + " or ".join(alternatives) if alternatives else ""))
    return problems


def _pipeline_problems(m: ModelConfig, par: ParallelConfig, tr: TrainConfig, d: int,
                       world_size: int | None) -> tuple[list[str], list[int]]:
    """The layers over the pipeline stages and model chunks; and the pipeline
    sizes a problem offered (the batch's hints must hold at each of them)."""
    p, l, k = (par.pipeline_model_parallel_size, m.num_layers,
               par.num_layers_per_virtual_pipeline_stage)
    schedule, interleaved = par.pipeline_schedule, _interleaved(par)
    problems: list[str] = []
    offered: list[int] = []

    def p_fits(x: int) -> bool:
        """Whether p = x fits the world, and the batch wherever the batch fits p
        (where it does not, the batch's own hint holds at x too)."""
        return ((world_size is None
                 or world_size % (par.tensor_model_parallel_size * par.context_parallel_size * x) == 0)
                and (not _batch_fits(tr, par, d, p) or _batch_fits(tr, par, d, x)))

    # Layers over pipeline stages and model chunks (k layers per chunk).
    chunk = k if interleaved else 1
    record = KINDS.get(schedule)   # (an unknown schedule is the choices' problem)
    fixed = record.fixed_chunks if record is not None else None   # a fixed v > 1 (a V)
    if record is not None and record.keeps_its_chunks and not fixed and k is not None:
        problems.append(
            f"--pipeline-schedule {schedule} has one model chunk per rank, so "
            f"--num-layers-per-virtual-pipeline-stage {k} does not apply: drop it"
            + _other_chunks_hint(record, ", or use"))
    split = par.layer_split
    if not split.even and interleaved:
        problems.append(
            "an uneven split (--decoder-first/last-pipeline-num-layers, --account-for-embedding/"
            "loss-in-pipeline-split) is not supported with the interleaved schedule "
            "(--num-layers-per-virtual-pipeline-stage fixes every chunk's size): drop one of them, "
            f"or use --pipeline-schedule {or_list(SEARCHED)}")
    elif not split.even:
        if k is not None:
            problems.append(
                f"--num-layers-per-virtual-pipeline-stage {k} fixes every chunk's size, which an "
                f"uneven split changes: drop it")
        if fixed and p < record.fewest_stages:
            problems.extend(_fixed_chunks_layer_problems(record, l, p, k))
        else:
            problems.extend(split_problems(l, p, fixed or 1, schedule, split))
    elif fixed:
        problems.extend(_fixed_chunks_layer_problems(record, l, p, k))
    elif interleaved and p < 2:
        stage_options = [x for x in divisors(l) if x >= 2 and (l // x) % chunk == 0 and p_fits(x)][:6]
        offered += stage_options
        problems.append(
            f"--num-layers-per-virtual-pipeline-stage {k} needs --pipeline-model-parallel-size "
            f">= 2 (interleaving splits each pipeline rank's layers into chunks): remove it"
            + (f" or use --pipeline-model-parallel-size in {stage_options}" if stage_options else ""))
    elif l % (p * chunk):
        stage_options = [x for x in divisors(l) if (l // x) % chunk == 0
                         and x >= (2 if interleaved else 1) and p_fits(x)]
        if l % p:
            offered += stage_options
            # p cannot stay where the job's processes are not a multiple of t·p.
            p_must_change = world_size is not None and world_size % (
                par.tensor_model_parallel_size * par.context_parallel_size * p)
            problems.append(
                f"--num-layers {l} is not divisible by --pipeline-model-parallel-size {p}: use "
                + (f"--pipeline-model-parallel-size in {stage_options}" if stage_options else "")
                + ("" if stage_options and p_must_change else
                   (" or " if stage_options else "") + f"--num-layers "
                   f"{nearest_multiple(l, p * chunk)} (layers are never dropped or added silently)"))
        else:
            problems.append(
                f"--num-layers {l} is not divisible by --pipeline-model-parallel-size {p} × "
                f"--num-layers-per-virtual-pipeline-stage {k} = {p * k}: use "
                f"--num-layers-per-virtual-pipeline-stage in {divisors(l // p)} or --num-layers "
                f"{nearest_multiple(l, p * k)}")

    if interleaved and record.with_chunks is None:
        title = lower_first(any_chunks_kind().title)
        problems.append(
            f"--pipeline-schedule {schedule} cannot be combined with --num-layers-per-virtual-"
            f"pipeline-stage (interleaving uses the {title} schedule): drop "
            f"one of them")
    return problems, offered


def _batch_fits(tr: TrainConfig, par: ParallelConfig, d: int, p: int) -> bool:
    """Whether the global batch gives whole microbatches on each data-parallel
    rank, as many as the schedule needs with p pipeline stages."""
    b, B = tr.micro_batch_size, tr.batch_size(d)
    if B % (b * d):
        return False
    group = p if _interleaved(par) and p >= 2 else 1
    fewest = _fewest_microbatches(par.pipeline_schedule, p)
    return (B // (b * d)) % group == 0 and B // (b * d) >= fewest


def _batch_problems(tr: TrainConfig, par: ParallelConfig, d: int,
                    offered_pipeline_sizes: Sequence[int] = ()) -> list[str]:
    """The global batch, the microbatches and the ramp-up against d and the
    schedule; the batch sizes offered hold at p and at each pipeline size
    offered by the layers' problem."""
    p, schedule, interleaved = par.pipeline_model_parallel_size, par.pipeline_schedule, \
        _interleaved(par)
    problems = []
    # Batch sizes. The interleaved schedule also needs m, the microbatches per
    # pipeline, to be a multiple of p.
    b, B = tr.micro_batch_size, tr.batch_size(d)
    group = p if interleaved and p >= 2 else 1
    record = KINDS.get(schedule)
    fewest = _fewest_microbatches(schedule, p)   # zero-bubble: m >= p or 2p
    # What a hinted batch must hold: every pipeline size that may be chosen.
    hinted_group = math.lcm(group, *offered_pipeline_sizes) if interleaved else 1
    per_rank = record.microbatches_per_rank if record is not None else 0
    hinted_fewest = per_rank * max([p, *offered_pipeline_sizes]) or 1
    if fewest > 1 and B % (b * d) == 0 and B // (b * d) < fewest:
        problems.append(
            f"--pipeline-schedule {schedule} needs at least {fewest} microbatches per iteration "
            f"({record.fewest_text} with --pipeline-model-parallel-size {p}), "
            f"not --global-batch-size {B} / (--micro-batch-size {b} × d {d}) = {B // (b * d)}: use "
            f"--global-batch-size {hinted_fewest * b * d} or more"
            + _fewer_microbatches_hint(record, B // (b * d), p))

    if tr.rampup_batch_size is not None and tr.train_samples is not None:  # (else: refused above)
        problems.extend(_rampup_problems(tr.rampup_batch_size, B, b, d, group, fewest, schedule, p))
    if tr.train_samples is not None and tr.rampup_batch_size is None and tr.train_samples < B:
        problems.append(f"--train-samples {tr.train_samples} is less than one global batch "
                        f"(--global-batch-size {B}), so no iteration would run: use --train-samples "
                        f"{B} or more")

    def micro_ok(micro: int, group: int = group, fewest: int = fewest) -> bool:
        return (B % (micro * d) == 0 and (B // (micro * d)) % group == 0
                and B // (micro * d) >= fewest)

    if not micro_ok(b, fewest=1):
        micro_options = [x for x in divisors(B) if micro_ok(x, hinted_group, hinted_fewest)]
        alternative = (f" or --micro-batch-size in {micro_options}" if micro_options else "")
        unit = b * d * hinted_group
        valid_batch = max(nearest_multiple(B, unit), -(-hinted_fewest * b * d // unit) * unit)
        if B % (b * d):
            problems.append(
                f"--global-batch-size {B} is not divisible by --micro-batch-size {b} × data-parallel "
                f"size {d} = {b * d}: use --global-batch-size {valid_batch}{alternative}")
        else:
            problems.append(
                f"the interleaved schedule needs the number of microbatches (--global-batch-size "
                f"{B} / (--micro-batch-size {b} × d {d}) = {B // (b * d)}) to be a multiple of "
                f"--pipeline-model-parallel-size {p}: use --global-batch-size {valid_batch}"
                f"{alternative}")
    return problems


def _fewest_microbatches(schedule: str, p: int) -> int:
    record = KINDS.get(schedule)
    return record.fewest_microbatches(p) if record is not None else 1


def _fewer_microbatches_hint(record: ScheduleKind, m: int, p: int) -> str:
    """The schedule to offer where m microbatches are too few for `record`'s."""
    other = KINDS.get(record.fewer_microbatches) if record.fewer_microbatches else None
    if other is None:
        return ""
    if other.microbatches_per_rank == 0:
        return f" or --pipeline-schedule {other.name}"
    return (f" or --pipeline-schedule {other.name} (needs {other.fewest_text})"
            if m >= other.fewest_microbatches(p) else "")


def _other_chunks_hint(record: ScheduleKind, before: str, after: str = "") -> str:
    """' --pipeline-schedule zbv (two chunks per rank in a V)': the kind of
    the other chunk count, if the record names one."""
    if record.other_chunks is None:
        return ""
    other = KINDS[record.other_chunks]
    return f"{before} --pipeline-schedule {other.name} ({other.chunks_words}){after}"


def _fixed_chunks_layer_problems(record: ScheduleKind, l: int, p: int, k: int | None) -> list[str]:
    """A schedule with a fixed v > 1 (two chunks per rank in a V), so p
    >= its fewest stages and v·p equal chunks of layers."""
    name, n, words = record.name, record.fixed_chunks, record.chunks_word
    if p < record.fewest_stages:
        return [f"--pipeline-schedule {name} places {words} model chunks per rank{record.in_a_v} "
                f"across the pipeline, so it needs --pipeline-model-parallel-size >= "
                f"{record.fewest_stages}, not {p}: use" + _other_chunks_hint(record, "", " or")
                + " a larger p"]
    if l % (n * p):
        options = [x for x in divisors(l) if x >= record.fewest_stages and l % (n * x) == 0]
        return [f"--pipeline-schedule {name} splits --num-layers {l} into {n}p = {n * p} equal "
                f"chunks ({words} per rank): use --num-layers {nearest_multiple(l, n * p)}"
                + (f" or --pipeline-model-parallel-size in {options}" if options else "")]
    if k is not None and k * n * p != l:
        return [f"--pipeline-schedule {name} has {words} chunks per rank, {l // (n * p)} layers "
                f"each with --num-layers {l} and --pipeline-model-parallel-size {p}, so "
                f"--num-layers-per-virtual-pipeline-stage {k} disagrees: drop it or use "
                f"{l // (n * p)}"]
    return []


def _rampup_problems(ramp: Any, B: int, b: int, d: int, group: int, fewest: int, schedule: str,
                     p: int) -> list[str]:
    """--rampup-batch-size START INCREMENT SAMPLES against the batch settings:
    every global batch of the ramp whole microbatches on every data-parallel
    rank (Megatron-LM's rule), arriving at B exactly; and the pipeline
    schedule's own needs from the smallest batch on."""
    if not (isinstance(ramp, (list, tuple)) and len(ramp) == 3 and all(is_count(x, 1) for x in ramp)):
        shown = " ".join(map(str, ramp)) if isinstance(ramp, (list, tuple)) else repr(ramp)
        return [f"--rampup-batch-size {shown} must be three positive integers: START INCREMENT "
                f"SAMPLES (e.g. 16 8 300000)"]
    start, increment, _ = ramp
    unit = b * d
    if start >= B:
        return [f"--rampup-batch-size starts at {start}, not below --global-batch-size {B}, so "
                f"there is nothing to ramp: use a START below {B} or drop --rampup-batch-size"]
    problems = []
    for name, value in (("START", start), ("INCREMENT", increment)):
        if value % unit:
            problems.append(
                f"--rampup-batch-size {name} {value} is not divisible by --micro-batch-size {b} × "
                f"data-parallel size {d} = {unit} (every global batch of the ramp must be whole "
                f"microbatches on every data-parallel rank): use {nearest_multiple(value, unit)}")
    if (B - start) % increment:
        options = [x for x in divisors(B - start) if x % unit == 0][:6]
        problems.append(
            f"--rampup-batch-size from {start} in steps of {increment} does not arrive at "
            f"--global-batch-size {B} ({B} - {start} = {B - start} is not a multiple of {increment})"
            + (f": use INCREMENT in {options}" if options else
               f": use a START with {B} - START a multiple of {unit}"))
    if problems:
        return problems
    first = start // unit
    if first < fewest:
        problems.append(
            f"--pipeline-schedule {schedule} needs at least {fewest} microbatches per iteration "
            f"({KINDS[schedule].fewest_text} with --pipeline-model-parallel-size {p}), but "
            f"--rampup-batch-size starts at {start} / (--micro-batch-size {b} × d {d}) = {first}: "
            f"use START {fewest * unit} or more")
    if group > 1 and (first % group or (increment // unit) % group):
        problems.append(
            f"the interleaved schedule needs every iteration's microbatches to be a multiple of "
            f"--pipeline-model-parallel-size {p}, so --rampup-batch-size START {start} and "
            f"INCREMENT {increment} must be multiples of {p} × --micro-batch-size {b} × d {d} = "
            f"{group * unit}: use START {nearest_multiple(start, group * unit)} and INCREMENT "
            f"{nearest_multiple(increment, group * unit)}")
    return problems
