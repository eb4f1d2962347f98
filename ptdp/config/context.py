"""Context parallelism's rules: the sequence, the heads and the dropout
against --context-parallel-size c and --cp-comm-type, checked before launch
(Megatron-LM's rules where it has them). The world size (t·c·p·d) and the
expert folding over t·c·d are checked with the other sizes
(ptdp.config.checks, ptdp.config.moe)."""

from __future__ import annotations

import math

from ptdp.config.base import divisors, is_finite_number
from ptdp.config.model import ModelConfig
from ptdp.config.parallel import ParallelConfig


def context_parallel_not_wired(par: ParallelConfig) -> list[str]:
    """The one refusal of c > 1 while the model, the data and the training
    loop do not split sequences yet; the rules below are already checked."""
    c = par.context_parallel_size
    if not (isinstance(c, int) and c > 1):  # (a size that is no count: refused as one)
        return []
    return [f"--context-parallel-size {c}: context parallelism is not yet wired into the model, "
            f"the data and the training loop: use --context-parallel-size 1 (--sequence-parallel "
            f"splits long sequences' activations over the tensor-parallel ranks)"]


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
