"""Context parallelism's rules: the sequence, the heads and the dropout
against --context-parallel-size c and --cp-comm-type, checked before launch
(Megatron-LM's rules where it has them), and what does not compose with
it. The world size (t·c·p·d) and the
expert folding over t·c·d are checked with the other sizes
(ptdp.config.checks, ptdp.config.moe)."""

from __future__ import annotations

import math

from ptdp.config.base import divisors, is_finite_number
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig


def sequence_step(c: int, t: int, sequence_parallel: bool) -> int:
    """What --seq-length must be a multiple of with c context ranks: 2c
    chunks, and with sequence parallelism each rank's s/c positions split
    over the t tensor ranks (Megatron-LM's rules); 1 without context
    parallelism (the tensor checks cover sequence parallelism alone)."""
    if c == 1:
        return 1
    return math.lcm(2 * c, c * t) if sequence_parallel else 2 * c


def context_parallel_problems(m: ModelConfig, par: ParallelConfig,
                              world_size: int | None = None) -> list[str]:
    """The sequence, the heads (a2a) and the attention dropout against c.
    The sizes are positive integers (checked before)."""
    c, t, s = par.context_parallel_size, par.tensor_model_parallel_size, m.seq_length
    if c == 1:
        return []
    problems = []
    step = sequence_step(c, t, par.sequence_parallel)
    if s % step:
        lengths = _closest_multiples(s, step, m)
        use = ": use " + " or ".join(f"--seq-length {x}" for x in lengths) if lengths else ""
        if par.sequence_parallel and step != 2 * c:
            why = (f"divisible by {step}: 2c = {2 * c} chunks, and each context rank's s/c "
                   f"positions split over --tensor-model-parallel-size {t} by --sequence-parallel")
        else:
            why = f"divisible by 2c = {step} (each sequence is cut into 2c chunks, two per rank)"
        problems.append(f"--context-parallel-size {c} needs --seq-length {s} {why}{use}")
    problems.extend(_a2a_problems(m, par, world_size))
    capacity = m.moe_expert_capacity_factor
    if m.is_moe and is_finite_number(capacity):
        problems.append(
            f"--moe-expert-capacity-factor {capacity:g} with --context-parallel-size {c}: an "
            f"expert's capacity is counted over the tokens one process routes, and a context "
            f"rank routes only s/c positions of each sequence, so it would drop other tokens: "
            f"drop --moe-expert-capacity-factor (dropless) or use --context-parallel-size 1")
    dropout = m.attention_dropout
    if is_finite_number(dropout) and dropout > 0:  # (not a number: reported as one)
        problems.append(
            f"--attention-dropout {dropout:g} with --context-parallel-size {c}: the context-parallel "
            f"attention has no dropout yet: use --attention-dropout 0 (0.1 is the default, as in "
            f"Megatron-LM)")
    return problems


def _a2a_problems(m: ModelConfig, par: ParallelConfig, world_size: int | None) -> list[str]:
    """a2a trades the sequence split for a head split: each tensor rank's
    heads and key/value groups are split over the c context ranks."""
    c, t, p = (par.context_parallel_size, par.tensor_model_parallel_size,
               par.pipeline_model_parallel_size)
    a, g = m.num_attention_heads, m.query_groups
    if par.cp_comm_type != "a2a" or a % t or g % t:  # (heads against t: the tensor checks')
        return []
    heads, groups = a // t, g // t
    if heads % c == 0 and groups % c == 0:
        return []

    def c_fits(x: int) -> bool:
        return (x > 1 and (world_size is None or world_size % (t * x * p) == 0)
                and m.seq_length % sequence_step(x, t, par.sequence_parallel) == 0)

    options = [x for x in divisors(math.gcd(heads, groups)) if c_fits(x)]
    what = f"{heads} attention heads" + (f" and {groups} key/value groups" if g != a else "")
    return [f"--cp-comm-type a2a splits each tensor rank's {what} over --context-parallel-size "
            f"{c} (all-to-all trades the sequence split for a head split), which {c} does not "
            f"divide: use --cp-comm-type p2p or all_gather"
            + (f", or --context-parallel-size in {options}" if options else "")]


def _closest_multiples(s: int, step: int, m: ModelConfig, count: int = 2) -> list[int]:
    """The multiples of `step` nearest `s` (the smaller on a tie) that the
    learned position table, if any, still covers."""
    base = max(1, round(s / step))
    found = [n * step for n in range(max(1, base - 64), base + 65)
             if m.max_position_embeddings is None or n * step <= m.max_positions]
    return sorted(found, key=lambda x: (abs(x - s), x))[:count]
