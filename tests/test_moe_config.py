"""The mixture-of-experts settings (ptdp/config/moe.py): Megatron-LM's flags
and defaults on the command line and in --config files, the --moe-layer-freq
pattern parser (no eval), every check with its message, the options ptdp
refuses, and a dense configuration left as it was."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_args
from ptdp.config import Config, ConfigError, ModelConfig, MoEFields, ParallelConfig, flag_fields, \
    parse_layer_pattern, validate
from ptdp.config.megatron import MOE_FLAGS, given, notes, refusals

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "64", "--seq-length", "16"]
MOE = ["--num-experts", "4"]


def parse(*argv: str) -> Config:
    return config_from_args(build_parser().parse_args(["train", "--mock-data", *TINY, *argv]))


def problems(*argv: str, world_size: int | None = None) -> list[str]:
    try:
        validate(parse(*argv), world_size)
    except ConfigError as error:
        return error.problems
    return []


def from_yaml(tmp_path, text: str, *argv: str) -> Config:
    path = tmp_path / "moe.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return parse("--config", str(path), *argv)


# ---------------------------------------------------------------- a dense model is unchanged

def test_a_dense_configuration_is_unchanged():
    m = parse().model
    assert not m.is_moe and m.num_experts is None
    assert m.moe_layer_pattern == [False] * 4
    assert m.moe_ffn_size == m.ffn_size == 128
    assert parse().parallel.expert_model_parallel_size == 1
    assert parse().parallel.expert_tensor_size == 1
    assert problems() == []
    validate(Config())
    # Megatron-LM's defaults.
    defaults = {f.name: f.default for f in dataclasses.fields(MoEFields)}
    assert defaults == {
        "num_experts": None, "moe_ffn_hidden_size": None, "moe_layer_freq": 1,
        "moe_router_topk": 2, "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None,
        "moe_router_num_groups": None, "moe_router_group_topk": None, "moe_router_dtype": "fp32",
        "moe_router_force_load_balancing": False,
        "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None, "moe_router_enable_expert_bias": False,
        "moe_router_bias_update_rate": 1e-3, "moe_shared_expert_intermediate_size": None,
        "moe_shared_expert_gate": False, "moe_expert_capacity_factor": None,
        "moe_token_drop_policy": "probs", "moe_pad_expert_input_to_capacity": False,
        "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False}


def test_the_model_sections_own_flags_come_before_the_moe_ones():
    names = [f.name for section, f in flag_fields() if section == "model"]
    assert names.index("num_layers") == 0
    assert names.index("activations_checkpoint_method") < names.index("num_experts")
    assert {f.name for f in dataclasses.fields(ModelConfig)} >= set(MoEFields.__dataclass_fields__)
    assert "ModelConfig.num_experts" not in str(ModelConfig.__mro__)  # (ModelConfig inherits them)
    assert issubclass(ModelConfig, MoEFields)


# ---------------------------------------------------------------- parsing

def test_every_moe_flag_reaches_its_field():
    c = parse(*MOE, "--moe-ffn-hidden-size", "64", "--moe-layer-freq", "2", "--moe-router-topk",
              "1", "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax",
              "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "2",
              "--moe-router-group-topk", "1", "--moe-router-dtype", "fp64",
              "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
              "--moe-z-loss-coeff", "0.001", "--moe-router-enable-expert-bias",
              "--moe-router-bias-update-rate", "0.01", "--moe-shared-expert-intermediate-size",
              "32", "--moe-shared-expert-gate", "--moe-expert-capacity-factor", "1.5",
              "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity",
              "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
              "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1")
    m, par = c.model, c.parallel
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_layer_freq, m.moe_router_topk) == (4, 64, 2, 1)
    assert (m.moe_router_score_function, m.moe_router_pre_softmax,
            m.moe_router_topk_scaling_factor) == ("sigmoid", True, 2.5)
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_dtype) == (2, 1, "fp64")
    assert m.moe_router_load_balancing_type == "seq_aux_loss"  # one type: not a list
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (0.01, 0.001)
    assert (m.moe_router_enable_expert_bias, m.moe_router_bias_update_rate) == (True, 0.01)
    assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate) == (32, True)
    assert (m.moe_expert_capacity_factor, m.moe_token_drop_policy,
            m.moe_pad_expert_input_to_capacity) == (1.5, "position", True)
    assert (m.moe_token_dispatcher_type, m.moe_grouped_gemm) == ("alltoall", True)
    assert (par.expert_model_parallel_size, par.expert_tensor_parallel_size) == (2, 1)
    assert m.is_moe and m.moe_ffn_size == 64 and m.moe_layer_pattern == [True, False, True, False]


def test_megatron_lms_readings_of_zero_experts_and_a_negative_capacity():
    m = parse("--num-experts", "0", "--moe-expert-capacity-factor", "-1").model
    assert m.num_experts is None and m.moe_expert_capacity_factor is None


def test_megatron_lms_readings_are_said_before_launch(capsys):
    """Issue 38: --num-experts 0 trained a dense model and a negative
    capacity factor ran dropless, without a word."""
    run = ["train", "--mock-data", *TINY, "--micro-batch-size", "2", "--global-batch-size", "2",
           "--train-iters", "1"]
    assert main([*run, "--num-experts", "0"]) == 0
    out = capsys.readouterr().out
    assert "ptdp: note: --num-experts 0 is a dense model (Megatron-LM's reading)" in out
    assert "capacity" not in out
    assert main([*run, *MOE, "--moe-expert-capacity-factor", "-1"]) == 0
    out = capsys.readouterr().out
    assert "a negative --moe-expert-capacity-factor is dropless routing" in out
    assert "--num-experts 0" not in out
    assert main([*run, *MOE]) == 0
    assert "Megatron-LM's reading" not in capsys.readouterr().out


def test_experts_bounded_before_any_work():
    """10**9 experts spun for a minute in the checks and ended in a MemoryError."""
    import time
    began = time.perf_counter()
    found = problems("--num-experts", "1000000000")
    assert time.perf_counter() - began < 5
    assert found == ["--num-experts 1,000,000,000 is more than ptdp builds (65,536; the largest "
                     "open models route over a few hundred): give the number of routed experts "
                     "per MoE layer, e.g. 8, 64 or 256"]
    assert problems("--num-experts", "65536", "--moe-router-topk", "2") == []


def test_a_huge_capacity_factor_drops_nothing_and_prices():
    """1e308 overflowed the capacity's arithmetic (OverflowError)."""
    import torch
    from ptdp.model.moe import Routing, _drop_over_capacity
    from ptdp.perf.fits import memory_problems
    m = parse(*MOE, "--moe-expert-capacity-factor", "1e308").model
    routed = torch.rand(16, 4).argsort(dim=1) < 2
    routing = Routing(torch.rand(16, 4) * routed, routed)
    kept = _drop_over_capacity(routing, m)
    assert torch.equal(kept.routed, routed) and torch.equal(kept.probs, routing.probs)
    assert problems(*MOE, "--moe-expert-capacity-factor", "1e308") == []
    config = parse(*MOE, "--moe-expert-capacity-factor", "1e308")
    assert memory_problems(config, kind="cpu", local_processes=1, device_memory=None) == []


def test_a_pattern_that_makes_no_layer_moe_is_refused():
    assert problems(*MOE, "--moe-layer-freq", "([0]*4)") == [
        "--moe-layer-freq ([0]*4) makes no layer MoE, so --num-experts 4 would build no expert: put "
        "a 1 where a layer is MoE (e.g. \"([0]+[1]*3)\"), or drop --num-experts for a dense model"]


def test_deeply_nested_and_long_patterns_are_one_short_paragraph():
    text = "(" * 5000 + "[1,1]" + ")" * 5000
    [problem] = problems(*MOE, "--moe-layer-freq", text)
    assert "parentheses nested deeper than 100" in problem and len(problem) < 500
    assert "(10,005 characters)" in problem


def test_a_pattern_on_the_command_line():
    m = parse(*MOE, "--moe-layer-freq", "([0]+[1]*3)").model
    assert m.moe_layer_freq == "([0]+[1]*3)"
    assert m.moe_layer_pattern == [False, True, True, True]


def test_the_model_section_of_a_yaml_file(tmp_path):
    c = from_yaml(tmp_path, """
        model:
          num_experts: 8
          moe_layer_freq: 2
          moe-router-topk: 4
          moe_router_load_balancing_type: seq_aux_loss
          moe_aux_loss_coeff: 1e-2
          moe_expert_capacity_factor: -1
          disable_bias_linear: true
          moe_shared_expert_intermediate_size: 64
        parallel:
          expert_model_parallel_size: 1
          expert_tensor_parallel_size: 1
        """)
    m = c.model
    assert (m.num_experts, m.moe_layer_freq, m.moe_router_topk) == (8, 2, 4)
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == ("seq_aux_loss", 0.01)
    assert m.moe_expert_capacity_factor is None and m.moe_shared_expert_intermediate_size == 64
    assert c.parallel.expert_tensor_parallel_size == 1
    validate(c)


@pytest.mark.parametrize("value, pattern", [
    ('"([1]*3+[0]*1)"', [True, True, True, False]),
    ("[1, 0, 1, 0]", [True, False, True, False]),  # YAML's own list
    ("'[0,1,1,1]'", [False, True, True, True]),
    ("'3'", [True, False, False, True]),
])
def test_a_pattern_in_a_yaml_file(tmp_path, value, pattern):
    c = from_yaml(tmp_path, f"model:\n  num_experts: 4\n  moe_layer_freq: {value}\n")
    assert c.model.moe_layer_pattern == pattern
    validate(c)


def test_a_yaml_file_with_a_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match=r"moe_layer_freq = 1\.5 should be of type str"):
        from_yaml(tmp_path, "model:\n  moe_layer_freq: 1.5\n")


# ---------------------------------------------------------------- the pattern parser

@pytest.mark.parametrize("text, expected", [
    ("([0]+[1]*23)", [0] + [1] * 23),
    ("([1]*3+[0]*1)*3", [1, 1, 1, 0] * 3),
    ("[1,0,1,0]", [1, 0, 1, 0]),
    (" ( [1] * 2 + [0] ) * 2 ", [1, 1, 0, 1, 1, 0]),
    ("[1]+[0]*2+[1]", [1, 0, 0, 1]),  # * binds tighter than +
    ("(([1]*2)*2)", [1, 1, 1, 1]),
])
def test_valid_patterns(text, expected):
    assert parse_layer_pattern(text) == expected


@pytest.mark.parametrize("text, message", [
    ("__import__('os')", "expected '[', found '_' at character 1"),
    ("[1,2,0]", "2 is not 0 (dense) or 1 (MoE) at character 4"),
    ("[1,0", "expected ']', found the end"),
    ("([1]*2", "expected ')', found the end"),
    ("[1]*2.5", "unexpected '.' at character 6"),
    ("[1]*-1", "expected a number, found '-'"),
    ("[1]**2", "expected a number, found '*'"),
    ("[]", "the pattern is empty"),
    ("[1]*1000000", "the pattern grows to 1000000 layers"),
    ("[0x1]", "expected ']', found 'x'"),
    ("", "expected '[', found the end"),
])
def test_refused_patterns(text, message):
    with pytest.raises(ValueError) as caught:
        parse_layer_pattern(text)
    assert message in str(caught.value)
    assert str(caught.value).startswith(f"--moe-layer-freq {text}: ")


def test_eval_like_input_is_never_run(monkeypatch):
    import builtins
    monkeypatch.setattr(builtins, "eval", lambda *_: pytest.fail("eval called"))
    assert any("--moe-layer-freq [1]+__import__('os').system('true')" in p for p in
               problems(*MOE, "--moe-layer-freq", "[1]+__import__('os').system('true')"))


def test_a_pattern_of_the_wrong_length():
    assert problems(*MOE, "--moe-layer-freq", "([0]+[1]*23)") == [
        "--moe-layer-freq ([0]+[1]*23) gives 24 layers, but --num-layers is 4: give one 0/1 per "
        "layer, e.g. \"([0]+[1]*3)\""]


def test_a_layer_freq_below_one():
    assert problems(*MOE, "--moe-layer-freq", "0") == [
        "--moe-layer-freq 0 must be a positive integer N (every N-th layer) or a pattern such as "
        "\"([0]+[1]*3)\""]


# ---------------------------------------------------------------- the checks

@pytest.mark.parametrize("argv, message", [
    (["--moe-router-topk", "5"],
     "--moe-router-topk 5 exceeds --num-experts 4 (each token goes to k different experts): use "
     "--moe-router-topk in 1..4"),
    (["--moe-router-topk", "0"], "--moe-router-topk=0 must be a positive integer"),
    (["--moe-router-topk", "1"],
     "--moe-router-topk 1 with --moe-router-score-function softmax needs --moe-router-pre-softmax "
     "(a softmax over the one chosen logit is always 1, so the router would get no gradient): "
     "add --moe-router-pre-softmax or use --moe-router-topk 2"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups 3 does not divide --num-experts 4 (the groups are equal): use "
     "--moe-router-num-groups in [1, 2, 4]"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk 3 exceeds --moe-router-num-groups 2: use --moe-router-group-topk in "
     "1..2"),
    (["--moe-router-topk", "3", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     "--moe-router-topk 3 is not divisible by --moe-router-group-topk 2 (ptdp requires it: each "
     "chosen group is scored by its best k / group-topk experts; Megatron-LM does not check it): "
     "use --moe-router-group-topk in [1, 3]"),
    (["--moe-router-topk", "4", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     "--moe-router-topk 4 / --moe-router-group-topk 2 = 2 experts per chosen group, but each "
     "group has only 1: choose more groups per token or fewer, larger groups"),
    (["--moe-router-group-topk", "1"],
     "--moe-router-group-topk 1 needs --moe-router-num-groups G (the groups the experts are split "
     "into): add it, with G dividing --num-experts 4"),
    (["--moe-router-num-groups", "2"],
     "--moe-router-num-groups 2 has no effect without --moe-router-group-topk (the groups each "
     "token may use): add it or drop --moe-router-num-groups"),
    (["--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the bias shifts "
     "sigmoid scores; Megatron-LM refuses it with softmax): add --moe-router-score-function "
     "sigmoid or drop --moe-router-enable-expert-bias"),
    (["--moe-router-bias-update-rate", "0"],
     "--moe-router-bias-update-rate 0.0 must be > 0 (the default is 0.001)"),
    (["--moe-router-topk-scaling-factor", "0"],
     "--moe-router-topk-scaling-factor 0.0 must be > 0 (DeepSeek-V3 uses 2.5), or leave it out"),
    (["--moe-aux-loss-coeff", "-0.1"],
     "--moe-aux-loss-coeff -0.1 must be >= 0 (it scales a loss that is minimised)"),
    (["--moe-z-loss-coeff", "-0.001"],
     "--moe-z-loss-coeff -0.001 must be >= 0 (it scales a loss that is minimised)"),
    (["--moe-expert-capacity-factor", "0"],
     "--moe-expert-capacity-factor 0 would drop every token: use a factor > 0 (e.g. 1.0), or leave "
     "it out for dropless routing"),
    (["--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity it pads "
     "to): add --moe-expert-capacity-factor 1.0 or drop --moe-pad-expert-input-to-capacity"),
    (["--moe-shared-expert-intermediate-size", "64"],
     "--moe-shared-expert-intermediate-size needs --disable-bias-linear (the shared experts have "
     "no biases, as in Megatron-LM): add --disable-bias-linear or drop the shared experts"),
    (["--moe-shared-expert-gate"],
     "--moe-shared-expert-gate gates the shared experts, which --moe-shared-expert-intermediate-"
     "size adds: give it or drop the gate"),
    (["--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size=0 must be a positive integer"),
    (["--moe-aux-loss-coeff", "nan"],
     "--moe-aux-loss-coeff=nan is not a finite number: give a finite number (the default is 0)"),
])
def test_each_check(argv, message):
    assert problems(*MOE, *argv) == [message]


def test_negative_experts():
    assert problems("--num-experts", "-2") == ["--num-experts=-2 must be a positive integer"]


def test_moe_settings_without_experts_are_named():
    assert problems("--moe-router-topk", "1", "--moe-grouped-gemm") == [
        "--moe-router-topk, --moe-grouped-gemm are MoE settings, but --num-experts is not given or is 0 (the "
        "model is dense): add --num-experts E or drop them"]
    assert problems("--num-experts", "0", "--moe-layer-freq", "2") == [
        "--moe-layer-freq is an MoE setting, but --num-experts is not given or is 0 (the model is dense): "
        "add --num-experts E or drop it"]
    assert problems("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1") == [
        "--expert-model-parallel-size 2 and --expert-tensor-parallel-size 1: expert parallelism is "
        "for MoE models, and --num-experts is not given: add --num-experts E or drop them"]


@pytest.mark.parametrize("argv, message", [
    (["--moe-router-score-function", "sqrtsoftplus"],
     "--moe-router-score-function sqrtsoftplus is not in ptdp (a niche third score function): use "
     "softmax or sigmoid"),
    (["--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-router-load-balancing-type sinkhorn: Megatron-LM's S-BASE optimal-transport routing is "
     "a separate code path ptdp does not have: use aux_loss, seq_aux_loss or global_aux_loss "
     "(with --moe-aux-loss-coeff), or none"),
    (["--moe-router-load-balancing-type", "quantile_balancing"],
     "--moe-router-load-balancing-type quantile_balancing: Megatron-LM's experimental "
     "quantile-balancing routing is not in ptdp: use aux_loss, seq_aux_loss or global_aux_loss "
     "(with --moe-aux-loss-coeff), or none"),
    (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"],
     "--moe-router-load-balancing-type aux_loss seq_aux_loss: ptdp takes one type (Megatron-LM can "
     "combine several): give one of aux_loss, seq_aux_loss, global_aux_loss, none"),
    (["--moe-router-load-balancing-type", "z_loss"],
     "--moe-router-load-balancing-type 'z_loss' is not one of aux_loss, seq_aux_loss, "
     "global_aux_loss, none"),
])
def test_refused_options(argv, message):
    assert problems(*MOE, *argv) == [message]


def test_the_accepted_choices_pass():
    for argv in (["--moe-router-score-function", "sigmoid"],
                 ["--moe-router-load-balancing-type", "none"],
                 ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity",
                  "--moe-token-drop-policy", "position"],
                 ["--moe-router-topk", "1", "--moe-router-pre-softmax"],
                 ["--moe-router-topk", "4", "--moe-router-num-groups", "2",
                  "--moe-router-group-topk", "2"],
                 ["--disable-bias-linear", "--moe-shared-expert-intermediate-size", "64",
                  "--moe-shared-expert-gate"],
                 ["--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp64"]):
        assert problems(*MOE, *argv) == [], argv


# ---------------------------------------------------------------- expert parallelism

def test_every_expert_layout_problem_is_reported_at_once():
    found = problems("--num-experts", "6", "--expert-model-parallel-size", "4", "-t", "2", "-d", "2")
    assert found == [
        "--expert-model-parallel-size 4 does not divide --num-experts 6 (each expert-parallel rank "
        "holds E/EP whole experts): use --expert-model-parallel-size in [1, 2]",
        "--expert-model-parallel-size 4 × --expert-tensor-parallel-size 2 = 8 does not divide "
        "--tensor-model-parallel-size 2 × data-parallel size 2 = 4 (the t·d ranks of a pipeline "
        "stage are re-folded into ETP × EP × expert-data-parallel): use "
        "--expert-model-parallel-size in [1, 2] or --expert-tensor-parallel-size in [1] or "
        "--data-parallel-size 4",
        "--expert-model-parallel-size 4 with --tensor-model-parallel-size 2 needs "
        "--sequence-parallel (as in Megatron-Core, each rank dispatches its own sequence-parallel "
        "shard of the tokens to the experts): add --sequence-parallel, or use "
        "--expert-model-parallel-size 1 with --expert-tensor-parallel-size 2"]


def test_too_few_ranks_for_the_expert_layout():
    assert problems(*MOE, "--expert-model-parallel-size", "2", "-t", "2", "--sequence-parallel",
                    "--disable-bias-linear", "--expert-tensor-parallel-size", "2")[0] == (
        "--expert-model-parallel-size 2 × --expert-tensor-parallel-size 2 = 4 does not divide "
        "--tensor-model-parallel-size 2 × data-parallel size 1 = 2 (the t·d ranks of a pipeline "
        "stage are re-folded into ETP × EP × expert-data-parallel): use "
        "--expert-model-parallel-size in [1] or --expert-tensor-parallel-size in [1] or "
        "--data-parallel-size 2")
    assert "--data-parallel-size" not in problems(
        *MOE, "--expert-model-parallel-size", "4", "--disable-bias-linear", world_size=2)[0]


def test_the_world_size_gives_d():
    # 8 processes with t = 2: d = 4, so EP 4 × ETP 2 = 8 divides t·d.
    assert problems(*MOE, "--expert-model-parallel-size", "4", "-t", "2", "--sequence-parallel",
                    "--disable-bias-linear", world_size=8) == []
    assert problems(*MOE, "--expert-model-parallel-size", "4", "-t", "2", "--sequence-parallel",
                    "--disable-bias-linear", world_size=4)[0].startswith(
        "--expert-model-parallel-size 4 × --expert-tensor-parallel-size 2 = 8 does not divide")


def test_expert_widths_against_the_tensor_sizes():
    assert problems(*MOE, "-t", "2", "--disable-bias-linear", "--moe-ffn-hidden-size", "33",
                    "--moe-shared-expert-intermediate-size", "35") == [
        "--moe-ffn-hidden-size 33 (each expert's MLP width) is not divisible by "
        "--expert-tensor-parallel-size 2: use a multiple of 2, e.g. 32",
        "--moe-shared-expert-intermediate-size 35 is not divisible by --tensor-model-parallel-size "
        "2 (the shared experts are split like the dense MLP): use a multiple of 2, e.g. 36"]


def test_an_expert_tensor_size_other_than_t_needs_sequence_parallelism():
    assert problems(*MOE, "-t", "2", "--expert-tensor-parallel-size", "1") == [
        "--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2 needs "
        "--sequence-parallel (as in Megatron-Core, each rank dispatches its own sequence-parallel "
        "shard of the tokens to the experts): add --sequence-parallel, or use "
        "--expert-model-parallel-size 1 with --expert-tensor-parallel-size 2"]
    assert problems(*MOE, "--expert-model-parallel-size", "0") == [
        "--expert-model-parallel-size=0 must be a positive integer"]


def test_the_expert_layouts_that_fold_pass():
    assert problems(*MOE, "-t", "2", "-d", "2", "--disable-bias-linear", "--sequence-parallel") == []
    assert problems(*MOE, "-t", "2", "--disable-bias-linear", "--expert-tensor-parallel-size",
                    "2") == []
    # EP spanning tensor and data-parallel ranks; ETP 1 with linear biases; EP at t = 1.
    assert problems(*MOE, "-t", "2", "-d", "2", "--disable-bias-linear", "--sequence-parallel",
                    "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1") == []
    assert problems(*MOE, "-t", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                    "--expert-tensor-parallel-size", "1") == []
    assert problems(*MOE, "-d", "2", "--expert-model-parallel-size", "2") == []


# ---------------------------------------------------------------- Megatron-LM's MoE extras

def test_each_moe_extra_is_refused_or_explained_and_takes_its_value():
    for extra in MOE_FLAGS:
        flags = [extra.name] if extra.values == 0 else [extra.name, "1"]
        args = build_parser().parse_args(["train", *flags, "--num-experts", "4"])
        found = given(args)
        assert [a.name for a, _ in found] == [extra.name]
        assert args.__dict__["model.num_experts"] == 4  # the value did not swallow the next flag
        if extra.refused:
            assert refusals(found)[0].startswith(" ".join(flags) + ": ")
        else:
            assert notes(found)[0].startswith(f"ptdp: {' '.join(flags)} has no effect: ")
    names = {extra.name for extra in MOE_FLAGS}
    for name in ("--moe-input-jitter-eps", "--moe-router-fusion", "--moe-permute-fusion",
                 "--moe-enable-deepep", "--moe-flex-dispatcher-backend", "--moe-use-upcycling",
                 "--moe-upcycling-granularity", "--moe-router-padding-for-fp8",
                 "--moe-router-padding-for-quantization", "--moe-apply-probs-on-input",
                 "--moe-shared-expert-overlap", "--moe-per-layer-logging", "--moe-layer-recompute",
                 "--moe-router-quantile-balancing-ema",
                 "--overlap-moe-expert-parallel-comm", "--moe-enable-routing-replay",
                 "--moe-latent-size", "--delay-wgrad-compute", "--moe-router-topk-limited-devices"):
        assert name in names, name


def test_refused_extras_stop_the_run_before_launch(capsys):
    code = main(["train", "--mock-data", *TINY, *MOE, "--moe-input-jitter-eps", "0.01",
                 "--moe-use-upcycling", "--moe-router-topk-limited-devices", "2",
                 "--moe-router-score-function", "sqrtsoftplus"])
    err = capsys.readouterr().err
    assert code == 2
    for line in ("--moe-input-jitter-eps 0.01: Switch-style multiplicative noise on the router's "
                 "input, which ptdp does not have: drop it",
                 "--moe-use-upcycling: conversion of a dense checkpoint into an MoE model, which "
                 "ptdp does not have: train the MoE model from its own initialisation and drop it",
                 "--moe-router-topk-limited-devices 2: device-limited routing (Megatron-LM's "
                 "deprecated flag), which ptdp does not have: use --moe-router-num-groups G "
                 "--moe-router-group-topk N",
                 "--moe-router-score-function sqrtsoftplus is not in ptdp"):
        assert line in err, line


def test_parallel_defaults():
    par = ParallelConfig()
    assert (par.expert_model_parallel_size, par.expert_tensor_parallel_size) == (1, None)
    assert ParallelConfig(tensor_model_parallel_size=4).expert_tensor_size == 4


def test_the_flex_dispatcher_runs_as_alltoall_with_a_note(capsys):
    """Megatron-LM's DeepSeek-V3 script's --moe-token-dispatcher-type flex
    --moe-flex-dispatcher-backend hybridep: accepted, each with a line that
    names what ptdp runs instead; the model's MoE layers build the alltoall
    dispatcher."""
    from ptdp.config.megatron import config_notes
    from ptdp.parallel.expert import AllToAllDispatcher, TokenDispatcher

    assert problems(*MOE, "--moe-token-dispatcher-type", "flex") == []
    args = build_parser().parse_args(["train", "--mock-data", *TINY, *MOE,
                                      "--moe-token-dispatcher-type", "flex",
                                      "--moe-flex-dispatcher-backend", "hybridep"])
    found = given(args)
    assert refusals(found) == []
    assert notes(found) == [
        "ptdp: --moe-flex-dispatcher-backend hybridep has no effect: a setting of the flex "
        "dispatcher's communication kernels (DeepEP, HybridEP, NCCL-EP); ptdp runs "
        "--moe-token-dispatcher-type flex as its alltoall dispatcher, which dispatches the same "
        "tokens to the same experts"]
    config = config_from_args(args)
    assert config.model.dispatcher == "alltoall"
    assert [line for line in config_notes(config) if "flex" in line] == [
        "ptdp: --moe-token-dispatcher-type flex runs as ptdp's alltoall dispatcher: Megatron-LM's "
        "flex dispatcher is an all-to-all on DeepEP, HybridEP or NCCL-EP kernels, which ptdp does "
        "not use; the same tokens reach the same experts"]
    assert TokenDispatcher.registry[config.model.dispatcher] is AllToAllDispatcher
