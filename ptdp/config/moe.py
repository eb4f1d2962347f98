"""The mixture-of-experts settings of the model section (Megatron-LM's flags,
names and defaults), the `--moe-layer-freq` pattern parser, and their checks:
each setting alone (`moe_problems`) and against the parallel layout
(`expert_parallel_problems`). ModelConfig inherits the fields, so they are
model settings on the command line and in --config files."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ptdp.config.base import divisors, finite_or_none, flag, flag_in, is_count, is_finite_number, \
    positive_integer_problems

# The load-balancing types ptdp implements, and the ones it refuses with why.
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_REFUSED_LOAD_BALANCING = {
    "sinkhorn": "Megatron-LM's S-BASE optimal-transport routing is a separate code path ptdp does "
                "not have",
    "quantile_balancing": "Megatron-LM's experimental quantile-balancing routing is not in ptdp",
}
# A pattern longer than this is refused before it is built ("[1]*10**9" would
# take the memory of the machine), and one nested deeper than this before
# Python's recursion limit is reached.
_LONGEST_PATTERN = 100_000
_DEEPEST_PATTERN = 100
# The most routed experts ptdp builds: its checks, memory model and planner
# treat each expert apart, so 10**9 (a typo) would take minutes and the
# machine's memory before any message. The largest open models have 384
# (Kimi K2); fine-grained research models a few thousand.
MOST_EXPERTS = 1 << 16


@dataclass
class MoEFields:
    num_experts: int | None = flag(
        None, "--num-experts",
        "routed experts E per MoE layer; unset (or 0, as in Megatron-LM) is a dense model")
    moe_ffn_hidden_size: int | None = flag(
        None, "--moe-ffn-hidden-size", "each routed expert's MLP width (default --ffn-hidden-size)")
    # "str | int": the command line reads text (an int or a pattern); a
    # --config file may give an int, a pattern string or a list of 0/1.
    moe_layer_freq: str | int | list[int] = flag(
        1, "--moe-layer-freq",
        "which layers are MoE: an int N makes layers 0, N, 2N, ... MoE (1: all); or "
        "Megatron-LM's pattern of 0 (dense) and 1 (MoE), one per layer, such as \"([0]+[1]*23)\" "
        "or \"([1]*3+[0]*1)*3\" (lists of 0/1, +, *N and parentheses only)", metavar="N|PATTERN")
    moe_router_topk: int = flag(2, "--moe-router-topk", "experts k each token is routed to")
    moe_router_score_function: str = flag(
        "softmax", "--moe-router-score-function",
        "the router's score function: softmax or sigmoid (sqrtsoftplus is refused)",
        choices=("softmax", "sigmoid", "sqrtsoftplus"))
    moe_router_pre_softmax: bool = flag(
        False, "--moe-router-pre-softmax",
        "softmax over all experts before the top-k (default: top-k of the logits, then softmax "
        "over the k chosen)")
    moe_router_topk_scaling_factor: float | None = flag(
        None, "--moe-router-topk-scaling-factor", "multiplies the routing probabilities of the top-k")
    moe_router_num_groups: int | None = flag(
        None, "--moe-router-num-groups",
        "group-limited routing: the experts in G equal groups (with --moe-router-group-topk)")
    moe_router_group_topk: int | None = flag(
        None, "--moe-router-group-topk",
        "group-limited routing: each token's experts come from its best groups, this many")
    moe_router_force_load_balancing: bool = flag(
        False, "--moe-router-force-load-balancing",
        "benchmarks: the router's logits replaced by standard normal draws, one per layer, "
        "position and expert, the same under every layout (the gradient reaches the real "
        "logits); the experts' loads come out even")
    moe_router_dtype: str = flag(
        "fp32", "--moe-router-dtype",
        "precision of the router's logits, scores and probabilities (NOTE: ptdp's default is fp32; "
        "Megatron-LM's default is the model's precision)", choices=("fp32", "fp64"))
    # "list[str] | str": Megatron-LM takes several types; ptdp takes one, and
    # reading a list lets it refuse several with a message instead of
    # argparse's "unrecognized arguments".
    moe_router_load_balancing_type: list[str] | str = flag(
        "aux_loss", "--moe-router-load-balancing-type",
        f"load balancing, one of {', '.join(LOAD_BALANCING_TYPES)} (Megatron-LM combines several; "
        f"ptdp takes one)", metavar="TYPE")
    moe_aux_loss_coeff: float = flag(
        0.0, "--moe-aux-loss-coeff",
        "coefficient of the load-balancing loss (0: none; 1e-2 is a usual start)")
    moe_z_loss_coeff: float | None = flag(
        None, "--moe-z-loss-coeff", "coefficient of the router's z-loss (1e-3 is a usual start)")
    moe_router_enable_expert_bias: bool = flag(
        False, "--moe-router-enable-expert-bias",
        "aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the selection, updated from "
        "the token counts (needs --moe-router-score-function sigmoid)")
    moe_router_bias_update_rate: float = flag(
        1e-3, "--moe-router-bias-update-rate", "step of the expert-bias update")
    moe_shared_expert_intermediate_size: int | None = flag(
        None, "--moe-shared-expert-intermediate-size",
        "MLP width of the shared experts (all of them together) every token goes through")
    moe_shared_expert_gate: bool = flag(
        False, "--moe-shared-expert-gate", "a sigmoid gate on the shared experts' output")
    moe_expert_capacity_factor: float | None = flag(
        None, "--moe-expert-capacity-factor",
        "tokens an expert takes, as a multiple of an even share; unset (or negative) is dropless")
    moe_token_drop_policy: str = flag(
        "probs", "--moe-token-drop-policy",
        "over capacity, drop the tokens with the lowest probabilities (probs) or the later ones "
        "(position)", choices=("probs", "position"))
    moe_pad_expert_input_to_capacity: bool = flag(
        False, "--moe-pad-expert-input-to-capacity",
        "pad each expert's tokens to its capacity (needs --moe-expert-capacity-factor)")
    moe_token_dispatcher_type: str = flag(
        "allgather", "--moe-token-dispatcher-type",
        "how tokens reach their experts: allgather or alltoall (flex, Megatron-LM's dispatcher on "
        "DeepEP/HybridEP kernels, runs as alltoall: the same tokens reach the same experts)",
        choices=("allgather", "alltoall", "flex"))
    moe_grouped_gemm: bool = flag(
        False, "--moe-grouped-gemm", "all of a rank's local experts in one grouped GEMM")

    def __post_init__(self) -> None:
        # Megatron-LM's readings: --num-experts 0 is no MoE, a negative
        # capacity factor is dropless, one load-balancing type in a list is
        # that type. The command line gives --moe-layer-freq as text, a
        # --config file maybe as a list: both become an int or a pattern.
        if self.num_experts == 0 and not isinstance(self.num_experts, bool):
            self.num_experts = None
        if is_finite_number(self.moe_expert_capacity_factor) and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None
        lb = self.moe_router_load_balancing_type
        if isinstance(lb, (list, tuple)) and len(lb) == 1:
            self.moe_router_load_balancing_type = lb[0]
        freq = self.moe_layer_freq
        if isinstance(freq, str) and freq.strip().isdigit():
            self.moe_layer_freq = int(freq)
        elif isinstance(freq, (list, tuple)) and all(is_count(x, 0) for x in freq):
            self.moe_layer_freq = "[" + ",".join(map(str, freq)) + "]"

    @property
    def dispatcher(self) -> str:
        """The token dispatcher ptdp runs: flex (Megatron-LM's all-to-all on
        DeepEP/HybridEP/NCCL-EP kernels, which ptdp does not use) is alltoall."""
        return "alltoall" if self.moe_token_dispatcher_type == "flex" else \
            self.moe_token_dispatcher_type

    @property
    def is_moe(self) -> bool:
        """Whether the model has routed experts (--num-experts)."""
        return self.num_experts is not None

    @property
    def moe_ffn_size(self) -> int:
        """Each routed expert's MLP width: --moe-ffn-hidden-size, else the dense one."""
        if self.moe_ffn_hidden_size is not None:
            return self.moe_ffn_hidden_size
        return self.ffn_size  # type: ignore[attr-defined]  # ModelConfig's

    @property
    def moe_layer_pattern(self) -> list[bool]:
        """For each layer (0-based), whether it is an MoE layer; all False for a
        dense model. ValueError for a --moe-layer-freq validate refuses."""
        layers = self.num_layers  # type: ignore[attr-defined]  # ModelConfig's
        if not self.is_moe:
            return [False] * layers
        pattern = layer_pattern(self.moe_layer_freq, layers)
        return [bool(x) for x in pattern]


# ---------------------------------------------------------------- --moe-layer-freq

def layer_pattern(freq: Any, num_layers: int) -> list[int]:
    """--moe-layer-freq as one 0/1 per layer; ValueError saying what is wrong."""
    if is_count(freq, 1):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if not isinstance(freq, str):
        raise ValueError(f"--moe-layer-freq {freq!r} must be a positive integer N (every N-th "
                         f"layer) or a pattern such as \"([0]+[1]*{max(1, num_layers - 1)})\"")
    pattern = parse_layer_pattern(freq)
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {_shown_pattern(freq)} gives {len(pattern)} layers, but --num-layers is "
                         f"{num_layers}: give one 0/1 per layer, e.g. \"([0]+[1]*"
                         f"{max(1, num_layers - 1)})\"")
    return pattern


def parse_layer_pattern(text: str, flag_name: str = "--moe-layer-freq",
                        int_means: str = "every N-th layer is MoE",
                        kinds: tuple[str, str] = ("dense", "MoE")) -> list[int]:
    """Megatron-LM's --moe-layer-freq pattern (and --window-attn-skip-freq's),
    without eval: lists of 0/1 ints joined by +, repeated by *N, in
    parentheses. Grammar:
        expr := term ('+' term)*      term := atom ('*' INT)*
        atom := '[' [INT (',' INT)*] ']' | '(' expr ')'
    `flag_name`, `int_means` (what the flag's int form means) and `kinds`
    (what 0 and 1 mean) word the errors."""
    parser = _PatternParser(text, flag_name, int_means, kinds)
    result = parser.expr()
    parser.skip_spaces()
    if parser.at < len(text):
        parser.fail(f"unexpected {text[parser.at]!r}")
    if not result:
        raise ValueError(f"{flag_name} {_shown_pattern(text)}: the pattern is empty: give one 0/1 "
                         f"per layer")
    return result


def _shown_pattern(text: str, limit: int = 80) -> str:
    """A pattern as a message quotes it: a long one cut in the middle."""
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}...{text[-limit // 2:]} ({len(text):,} characters)"


class _PatternParser:
    def __init__(self, text: str, flag_name: str, int_means: str, kinds: tuple[str, str]):
        self.text, self.at, self.depth = text, 0, 0
        self.flag_name, self.int_means, self.kinds = flag_name, int_means, kinds

    def fail(self, what: str) -> None:
        raise ValueError(
            f"{self.flag_name} {_shown_pattern(self.text)}: {what} at character {self.at + 1}: a "
            f"pattern is lists of 0 and 1 joined by +, repeated by *N, in parentheses, such as "
            f"\"([0]+[1]*23)\" or \"([1]*3+[0]*1)*3\"; or give an int N ({self.int_means})")

    def skip_spaces(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def peek(self) -> str:
        self.skip_spaces()
        return self.text[self.at] if self.at < len(self.text) else ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            self.fail(f"expected {char!r}" + (f", found {self.peek()!r}" if self.peek() else
                                              ", found the end"))
        self.at += 1

    def integer(self) -> int:
        self.skip_spaces()
        start = self.at
        while self.at < len(self.text) and self.text[self.at] in "0123456789":
            self.at += 1
        if start == self.at:
            self.fail("expected a number" + (f", found {self.peek()!r}" if self.peek() else
                                             ", found the end"))
        return int(self.text[start:self.at])

    def expr(self) -> list[int]:
        result = self.term()
        while self.peek() == "+":
            self.at += 1
            result = result + self.term()
            self._bounded(len(result))
        return result

    def term(self) -> list[int]:
        result = self.atom()
        while self.peek() == "*":
            self.at += 1
            times = self.integer()
            self._bounded(len(result) * times)
            result = result * times
        return result

    def atom(self) -> list[int]:
        if self.peek() == "(":
            self.depth += 1
            if self.depth > _DEEPEST_PATTERN:
                self.fail(f"parentheses nested deeper than {_DEEPEST_PATTERN}")
            self.at += 1
            result = self.expr()
            self.expect(")")
            self.depth -= 1
            return result
        self.expect("[")
        items: list[int] = []
        if self.peek() != "]":
            items.append(self._bit())
            while self.peek() == ",":
                self.at += 1
                items.append(self._bit())
        self.expect("]")
        return items

    def _bit(self) -> int:
        start = self.at
        value = self.integer()
        if value not in (0, 1):
            self.at = start
            self.fail(f"{value} is not 0 ({self.kinds[0]}) or 1 ({self.kinds[1]})")
        return value

    def _bounded(self, length: int) -> None:
        if length > _LONGEST_PATTERN:
            self.fail(f"the pattern grows to {length} layers")


# ---------------------------------------------------------------- checks

# The MoE settings validate looks at when --num-experts is not given.
_MOE_FIELDS = tuple(name for name in MoEFields.__dataclass_fields__ if name != "num_experts")


def moe_count_problems(m: Any) -> list[str]:
    """The MoE sizes that must be positive integers."""
    optional = ("num_experts", "moe_ffn_hidden_size", "moe_router_num_groups",
                "moe_router_group_topk", "moe_shared_expert_intermediate_size")
    problems = positive_integer_problems(m, optional + ("moe_router_topk",), optional=optional)
    E = m.num_experts
    if is_count(E, 1) and E > MOST_EXPERTS:
        problems.append(f"--num-experts {E:,} is more than ptdp builds ({MOST_EXPERTS:,}; the "
                        f"largest open models route over a few hundred): give the number of "
                        f"routed experts per MoE layer, e.g. 8, 64 or 256")
    return problems


def _given(m: Any, name: str) -> bool:
    """Whether the MoE setting `name` differs from its default (a float that
    is not a finite number is reported as that alone)."""
    value = getattr(m, name)
    if isinstance(value, float) and not finite_or_none(value):
        return False
    return value != MoEFields.__dataclass_fields__[name].default


def moe_problems(m: Any) -> list[str]:
    """The MoE settings alone and against the model's shape (Megatron-LM's
    checks, and the options ptdp refuses)."""
    if not m.is_moe:
        given = [flag_in(m, name) for name in _MOE_FIELDS if _given(m, name)]
        if not given:
            return []
        return [f"{', '.join(given)} {'is an MoE setting' if len(given) == 1 else 'are MoE settings'}"
                f", but --num-experts is not given or is 0 (the model is dense): add --num-experts E or "
                f"drop {'it' if len(given) == 1 else 'them'}"]
    problems = []
    E, k = m.num_experts, m.moe_router_topk
    if not is_count(E, 1) or not is_count(k, 1):
        return problems  # moe_count_problems reports them
    if k > E:
        problems.append(f"--moe-router-topk {k} exceeds --num-experts {E} (each token goes to k "
                        f"different experts): use --moe-router-topk in 1..{E}")
    if k == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax:
        problems.append("--moe-router-topk 1 with --moe-router-score-function softmax needs "
                        "--moe-router-pre-softmax (a softmax over the one chosen logit is always 1, "
                        "so the router would get no gradient): add --moe-router-pre-softmax or use "
                        "--moe-router-topk 2")
    problems.extend(_group_problems(m, E, k))
    if m.moe_router_score_function == "sqrtsoftplus":
        problems.append("--moe-router-score-function sqrtsoftplus is not in ptdp (a niche third "
                        "score function): use softmax or sigmoid")
    problems.extend(_load_balancing_problems(m))
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        problems.append(f"--moe-router-enable-expert-bias needs --moe-router-score-function "
                        f"sigmoid (the bias shifts sigmoid scores; Megatron-LM refuses it with "
                        f"{m.moe_router_score_function}): add --moe-router-score-function sigmoid "
                        f"or drop --moe-router-enable-expert-bias")
    rate = m.moe_router_bias_update_rate
    if finite_or_none(rate) and rate <= 0:
        problems.append(f"--moe-router-bias-update-rate {rate} must be > 0 (the default is 0.001)")
    scale = m.moe_router_topk_scaling_factor
    if finite_or_none(scale) and scale is not None and scale <= 0:
        problems.append(f"--moe-router-topk-scaling-factor {scale} must be > 0 (DeepSeek-V3 uses "
                        f"2.5), or leave it out")
    capacity = m.moe_expert_capacity_factor
    if finite_or_none(capacity) and capacity == 0:
        problems.append("--moe-expert-capacity-factor 0 would drop every token: use a factor > 0 "
                        "(e.g. 1.0), or leave it out for dropless routing")
    if m.moe_pad_expert_input_to_capacity and capacity is None:
        problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
                        "(the capacity it pads to): add --moe-expert-capacity-factor 1.0 or drop "
                        "--moe-pad-expert-input-to-capacity")
    if m.moe_shared_expert_intermediate_size is not None and m.bias:
        problems.append("--moe-shared-expert-intermediate-size needs --disable-bias-linear (the "
                        "shared experts have no biases, as in Megatron-LM): add "
                        "--disable-bias-linear or drop the shared experts")
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        problems.append("--moe-shared-expert-gate gates the shared experts, which "
                        "--moe-shared-expert-intermediate-size adds: give it or drop the gate")
    if is_count(m.num_layers, 1):
        try:
            pattern = layer_pattern(m.moe_layer_freq, m.num_layers)
        except ValueError as error:
            problems.append(str(error))
        else:
            if not any(pattern):
                problems.append(f"--moe-layer-freq {_shown_pattern(str(m.moe_layer_freq))} makes "
                                f"no layer MoE, so --num-experts {E} would build no expert: put a "
                                f"1 where a layer is MoE (e.g. \"([0]+[1]*"
                                f"{max(1, m.num_layers - 1)})\"), or drop --num-experts for a "
                                f"dense model")
    return problems


def megatron_reading_notes(m: Any, explicit) -> list[str]:
    """What Megatron-LM's readings of --num-experts 0 and a negative
    --moe-expert-capacity-factor (applied in MoEFields.__post_init__) did
    to values the user gave, said before launch."""
    notes = []
    if "model.num_experts" in explicit and m.num_experts is None:
        notes.append("ptdp: note: --num-experts 0 is a dense model (Megatron-LM's reading): no "
                     "layer has experts; drop the flag, or give E > 0 for a mixture of experts")
    if "model.moe_expert_capacity_factor" in explicit and m.moe_expert_capacity_factor is None \
            and m.is_moe:
        notes.append("ptdp: note: a negative --moe-expert-capacity-factor is dropless routing "
                     "(Megatron-LM's reading): no token is dropped; give a factor > 0 to cap "
                     "each expert's tokens")
    return notes


def _group_problems(m: Any, E: int, k: int) -> list[str]:
    """Group-limited routing: --moe-router-num-groups, --moe-router-group-topk."""
    groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
    if not is_count(groups, 1) and groups is not None or not is_count(chosen, 1) and chosen is not None:
        return []  # moe_count_problems reports them
    if groups is None and chosen is None:
        return []
    if groups is None:
        return [f"--moe-router-group-topk {chosen} needs --moe-router-num-groups G (the groups "
                f"the experts are split into): add it, with G dividing --num-experts {E}"]
    if chosen is None:
        return [f"--moe-router-num-groups {groups} has no effect without --moe-router-group-topk "
                f"(the groups each token may use): add it or drop --moe-router-num-groups"]
    problems = []
    if E % groups:
        problems.append(f"--moe-router-num-groups {groups} does not divide --num-experts {E} (the "
                        f"groups are equal): use --moe-router-num-groups in {divisors(E)}")
    if chosen > groups:
        problems.append(f"--moe-router-group-topk {chosen} exceeds --moe-router-num-groups "
                        f"{groups}: use --moe-router-group-topk in 1..{groups}")
    elif k % chosen:
        problems.append(f"--moe-router-topk {k} is not divisible by --moe-router-group-topk {chosen} "
                        f"(ptdp requires it: each chosen group is scored by its best k / group-topk "
                        f"experts; Megatron-LM does not check it): use --moe-router-group-topk in "
                        f"{[x for x in divisors(k) if x <= groups]}")
    elif E % groups == 0 and k // chosen > E // groups:
        problems.append(f"--moe-router-topk {k} / --moe-router-group-topk {chosen} = "
                        f"{k // chosen} experts per chosen group, but each group has only "
                        f"{E // groups}: choose more groups per token or fewer, larger groups")
    return problems


def _load_balancing_problems(m: Any) -> list[str]:
    """--moe-router-load-balancing-type (one type) and the coefficients."""
    problems = []
    lb = m.moe_router_load_balancing_type
    if isinstance(lb, (list, tuple)):
        shown = " ".join(map(str, lb))
        problems.append(f"--moe-router-load-balancing-type {shown}: ptdp takes one type (Megatron-LM "
                        f"can combine several): give one of aux_loss, seq_aux_loss, global_aux_loss, none")
    elif lb in _REFUSED_LOAD_BALANCING:
        problems.append(f"--moe-router-load-balancing-type {lb}: {_REFUSED_LOAD_BALANCING[lb]}: use "
                        f"aux_loss, seq_aux_loss or global_aux_loss (with --moe-aux-loss-coeff), or none")
    elif lb not in LOAD_BALANCING_TYPES:
        problems.append(f"--moe-router-load-balancing-type {lb!r} is not one of "
                        f"{', '.join(LOAD_BALANCING_TYPES)}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(m, name)
        if finite_or_none(value) and value is not None and value < 0:
            problems.append(f"{flag_in(m, name)} {value} must be >= 0 (it scales a loss that is "
                            f"minimised)")
    return problems


def expert_parallel_problems(m: Any, par: Any, world_size: int | None) -> list[str]:
    """The expert layout (EP × ETP folded over the t·c·d ranks of a pipeline
    stage) against the model and the layout."""
    EP, ETP_given = par.expert_model_parallel_size, par.expert_tensor_parallel_size
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    if not m.is_moe:
        given = [f"--expert-model-parallel-size {EP}"] if EP != 1 else []
        given += [f"--expert-tensor-parallel-size {ETP_given}"] if ETP_given is not None else []
        if not given:
            return []
        return [f"{' and '.join(given)}: expert parallelism is for MoE models, and --num-experts "
                f"is not given: add --num-experts E or drop "
                f"{'it' if len(given) == 1 else 'them'}"]
    E, ETP = m.num_experts, par.expert_tensor_size
    c = par.context_parallel_size
    d = (world_size // (t * c * p) if world_size is not None and world_size % (t * c * p) == 0
         else par.dp)
    ranks = t * c * d  # one pipeline stage's ranks
    problems = []

    def ep_ok(ep: int) -> bool:
        return E % ep == 0 and ranks % (ep * ETP) == 0

    ep_options = [x for x in divisors(E) if ep_ok(x)]
    if E % EP:
        problems.append(f"--expert-model-parallel-size {EP} does not divide --num-experts {E} "
                        f"(each expert-parallel rank holds E/EP whole experts): use "
                        f"--expert-model-parallel-size in {ep_options or divisors(E)}")
    if ranks % (EP * ETP):
        etp_options = [x for x in divisors(ranks) if ranks % (EP * x) == 0]
        fewest_d = EP * ETP // math.gcd(t * c, EP * ETP)  # the least d: t·c·d divisible by EP·ETP
        context, tcd = (f" × --context-parallel-size {c}", "t·c·d") if c > 1 else ("", "t·d")
        problems.append(
            f"--expert-model-parallel-size {EP} × --expert-tensor-parallel-size {ETP} = {EP * ETP} "
            f"does not divide --tensor-model-parallel-size {t}{context} × data-parallel size {d} = "
            f"{ranks} (the {tcd} ranks of a pipeline stage are re-folded into ETP × EP × expert-data-"
            f"parallel): use --expert-model-parallel-size in {ep_options or [1]}"
            + (f" or --expert-tensor-parallel-size in {etp_options}" if etp_options else "")
            + (f" or --data-parallel-size {fewest_d}" if world_size is None else ""))
    width = m.moe_ffn_size
    if is_count(width, 1) and width % ETP:
        problems.append(f"--moe-ffn-hidden-size {width} (each expert's MLP width) is not divisible "
                        f"by --expert-tensor-parallel-size {ETP}: use a multiple of {ETP}, e.g. "
                        f"{max(ETP, round(width / ETP) * ETP)}")
    shared = m.moe_shared_expert_intermediate_size
    if is_count(shared, 1) and shared % t:
        problems.append(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                        f"--tensor-model-parallel-size {t} (the shared experts are split like the "
                        f"dense MLP): use a multiple of {t}, e.g. {max(t, round(shared / t) * t)}")
    if (EP, ETP) != (1, t) and t > 1 and not par.sequence_parallel:
        given = " and ".join(([f"--expert-model-parallel-size {EP}"] if EP > 1 else [])
                             + ([f"--expert-tensor-parallel-size {ETP}"] if ETP != t else []))
        problems.append(f"{given} with --tensor-model-parallel-size {t} needs --sequence-parallel "
                        f"(as in Megatron-Core, each rank dispatches its own sequence-parallel "
                        f"shard of the tokens to the experts): add --sequence-parallel, or use "
                        f"--expert-model-parallel-size 1 with --expert-tensor-parallel-size {t}")
    return problems
