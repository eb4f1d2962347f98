"""Tests of `ptdp.config.validate` and `ModelConfig.padded_vocab_size`.

Every constraint `validate` checks gets a configuration that breaks it alone;
the test checks that the message names the flag(s), the offending values and
the concrete valid alternative. A property test then applies each concrete
suggestion and checks that the problem it was given for goes away.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from ptdp.config import Config, ConfigError, ModelConfig, flag_fields, validate

# field name -> section, and flag -> (section, field name), from the dataclasses themselves.
SECTION_OF = {f.name: section for section, f in flag_fields()}
FIELD_OF_FLAG = {f.metadata["flag"]: (section, f.name) for section, f in flag_fields()}


def make(**fields: Any) -> Config:
    """A default Config with the named fields (by field name, any section) replaced."""
    config = Config()
    for name, value in fields.items():
        setattr(getattr(config, SECTION_OF[name]), name, value)
    return config


def problems_of(config: Config, world_size: int | None = None) -> list[str]:
    try:
        validate(config, world_size=world_size)
    except ConfigError as error:
        assert error.problems, "a ConfigError must carry at least one problem"
        return error.problems
    return []


def single_problem(config: Config, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(config, world_size=world_size)
    problems = caught.value.problems
    assert len(problems) == 1, problems
    assert problems[0] in str(caught.value)
    return problems[0]


# --------------------------------------------------------------------------- per-field checks

POSITIVE_INT_FIELDS = [
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("seq_length", "--seq-length"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("vocab_size", "--vocab-size"),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("data_parallel_size", "--data-parallel-size"),
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("micro_batch_size", "--micro-batch-size"),
    ("global_batch_size", "--global-batch-size"),
    ("train_iters", "--train-iters"),
    ("log_interval", "--log-interval"),
]
OPTIONAL_INT_FIELDS = ["ffn_hidden_size", "max_position_embeddings", "data_parallel_size",
                       "num_layers_per_virtual_pipeline_stage", "global_batch_size"]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True], ids=["zero", "negative", "float", "bool"])
@pytest.mark.parametrize("name,flag", POSITIVE_INT_FIELDS, ids=[n for n, _ in POSITIVE_INT_FIELDS])
def test_positive_integer_required(name, flag, bad):
    message = single_problem(make(**{name: bad}))
    assert message.startswith(flag)
    assert f"{flag}={bad!r}" in message
    assert "must be a positive integer" in message


@pytest.mark.parametrize("name", OPTIONAL_INT_FIELDS)
def test_optional_integers_may_be_none(name):
    validate(make(**{name: None}))


@pytest.mark.parametrize("name,flag", [("hidden_dropout", "--hidden-dropout"),
                                       ("attention_dropout", "--attention-dropout")])
@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1])
def test_dropout_range(name, flag, bad):
    message = single_problem(make(**{name: bad}))
    assert f"{flag}={bad}" in message
    assert "[0, 1)" in message


@pytest.mark.parametrize("good", [0.0, 0.5, 0.999])
def test_dropout_range_accepts(good):
    validate(make(hidden_dropout=good, attention_dropout=good))


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_distributed_timeout_positive(bad):
    message = single_problem(make(distributed_timeout_minutes=bad))
    assert f"--distributed-timeout-minutes={bad}" in message
    assert "> 0" in message


def test_clip_grad_non_negative():
    message = single_problem(make(clip_grad=-0.5))
    assert "--clip-grad=-0.5" in message
    assert ">= 0" in message and "0 turns clipping off" in message
    validate(make(clip_grad=0.0))  # 0 is allowed: clipping off


# --------------------------------------------------------------------------- world size

def test_world_size_not_multiple_of_tp():
    config = make(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    message = single_problem(config, world_size=6)
    assert "6 processes" in message
    assert "--tensor-model-parallel-size 2" in message
    assert "--pipeline-model-parallel-size 2" in message
    assert "= 4" in message
    assert "t·p in [1, 2, 3, 6]" in message


def test_world_size_inconsistent_with_explicit_data_parallel_size():
    config = make(tensor_model_parallel_size=2, data_parallel_size=2)
    message = single_problem(config, world_size=8)
    assert "8 processes" in message
    assert "--tensor-model-parallel-size 2" in message
    assert "--pipeline-model-parallel-size 1" in message
    assert "--data-parallel-size 2 = 4" in message
    assert "use --data-parallel-size 4 or leave it out" in message
    # both suggested fixes are valid
    validate(make(tensor_model_parallel_size=2, data_parallel_size=4), world_size=8)
    validate(make(tensor_model_parallel_size=2, data_parallel_size=None), world_size=8)


def test_world_size_infers_data_parallel_size_for_batch_checks():
    # d = 4 / (1·1) = 4: B = 9 is not a multiple of b·d = 4.
    message = single_problem(make(micro_batch_size=1, global_batch_size=9), world_size=4)
    assert "--global-batch-size 9" in message
    assert "--micro-batch-size 1 × data-parallel size 4 = 4" in message
    assert "use --global-batch-size 8" in message
    validate(make(micro_batch_size=1, global_batch_size=8), world_size=4)


# --------------------------------------------------------------------------- model shape

def test_hidden_size_divisible_by_heads():
    message = single_problem(make(hidden_size=100, num_attention_heads=16))
    assert message.startswith("--hidden-size 100 is not divisible by --num-attention-heads 16")
    assert "use --hidden-size 96" in message
    assert "--num-attention-heads in [2, 4, 5, 10, 20, 25]" in message  # nearest to 16


def test_heads_divisible_by_tensor_parallel_size():
    message = single_problem(make(hidden_size=768, num_attention_heads=12,
                                  tensor_model_parallel_size=8))
    assert message.startswith(
        "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8")
    assert "--tensor-model-parallel-size in [1, 2, 3, 4, 6, 12]" in message
    assert "--num-attention-heads in [8, 16, 24, 32, 48]" in message  # multiples of t dividing h


def test_ffn_size_divisible_by_tensor_parallel_size():
    message = single_problem(make(ffn_hidden_size=510, tensor_model_parallel_size=4))
    assert message.startswith(
        "--ffn-hidden-size 510 is not divisible by --tensor-model-parallel-size 4")
    assert "use --ffn-hidden-size 512" in message


def test_seq_length_within_max_position_embeddings():
    message = single_problem(make(seq_length=128, max_position_embeddings=64))
    assert message.startswith("--seq-length 128 exceeds --max-position-embeddings 64")
    assert "use --max-position-embeddings 128" in message
    validate(make(seq_length=64, max_position_embeddings=128))  # fewer positions used is fine
    validate(make(seq_length=128, max_position_embeddings=None))  # defaults to --seq-length


# --------------------------------------------------------------------------- layers and pipeline

def test_layers_divisible_by_pipeline_size():
    message = single_problem(make(num_layers=10, pipeline_model_parallel_size=3))
    assert message.startswith(
        "--num-layers 10 is not divisible by --pipeline-model-parallel-size 3")
    assert "--pipeline-model-parallel-size in [1, 2, 5, 10]" in message
    assert "--num-layers 9" in message


def test_interleaving_needs_two_pipeline_stages():
    message = single_problem(make(num_layers=4, pipeline_model_parallel_size=1,
                                  num_layers_per_virtual_pipeline_stage=2))
    assert "--num-layers-per-virtual-pipeline-stage 2" in message
    assert "--pipeline-model-parallel-size >= 2" in message
    assert "remove it" in message


def test_interleaving_layers_divisible_by_p_times_k():
    message = single_problem(make(num_layers=12, pipeline_model_parallel_size=2,
                                  num_layers_per_virtual_pipeline_stage=5, global_batch_size=4))
    assert message.startswith("--num-layers 12 is not divisible by --pipeline-model-parallel-size 2")
    assert "--num-layers-per-virtual-pipeline-stage 5 = 10" in message
    assert "--num-layers-per-virtual-pipeline-stage in [1, 2, 3, 6]" in message
    assert "--num-layers 10" in message


# --------------------------------------------------------------------------- batch sizes

def test_global_batch_divisible_by_micro_batch_times_dp():
    message = single_problem(make(micro_batch_size=4, global_batch_size=30, data_parallel_size=2))
    assert message.startswith("--global-batch-size 30 is not divisible by --micro-batch-size 4")
    assert "data-parallel size 2 = 8" in message
    assert "use --global-batch-size 32" in message
    assert "--micro-batch-size in [1, 3, 5, 15]" in message


def test_global_batch_not_divisible_by_dp_suggests_only_a_batch_size():
    message = single_problem(make(micro_batch_size=2, global_batch_size=11, data_parallel_size=2))
    assert "--global-batch-size 11" in message
    assert "--micro-batch-size 2 × data-parallel size 2 = 4" in message
    assert "use --global-batch-size 12" in message
    assert "--micro-batch-size in" not in message  # no micro batch size can fix B % d


def test_default_global_batch_is_one_microbatch_per_replica():
    validate(make(micro_batch_size=3, global_batch_size=None, data_parallel_size=5))


def test_interleaved_microbatches_multiple_of_pipeline_size():
    message = single_problem(make(num_layers=8, pipeline_model_parallel_size=4,
                                  num_layers_per_virtual_pipeline_stage=2,
                                  micro_batch_size=2, global_batch_size=10))
    assert "interleaved schedule" in message
    assert "--global-batch-size 10" in message and "--micro-batch-size 2" in message
    assert "= 5" in message
    assert "--pipeline-model-parallel-size 4" in message
    assert "use --global-batch-size 8" in message


def test_interleaved_default_global_batch_is_too_small():
    # without --global-batch-size there is one microbatch: fewer than p = 2
    message = single_problem(make(num_layers=8, pipeline_model_parallel_size=2,
                                  num_layers_per_virtual_pipeline_stage=2,
                                  micro_batch_size=3, data_parallel_size=2))
    assert "= 1)" in message
    assert "use --global-batch-size 12" in message  # p·b·d = 2·3·2


def test_microbatch_count_need_not_be_multiple_of_p_without_interleaving():
    validate(make(num_layers=8, pipeline_model_parallel_size=4, micro_batch_size=2,
                  global_batch_size=6))


# --------------------------------------------------------------------------- several problems

def test_several_problems_reported_together():
    config = make(hidden_size=130, num_attention_heads=3, tensor_model_parallel_size=2,
                  num_layers=5, pipeline_model_parallel_size=2, seq_length=128,
                  max_position_embeddings=64)
    with pytest.raises(ConfigError) as caught:
        validate(config)
    problems = caught.value.problems
    assert len(problems) == 3, problems
    # The heads against h and against t are one problem: one change fixes both.
    starts = ["--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2 and "
              "does not divide --hidden-size 130: use --num-attention-heads in [2, 10]",
              "--seq-length 128 exceeds",
              "--num-layers 5 is not divisible by --pipeline-model-parallel-size 2"]
    for start in starts:
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)
    text = str(caught.value)
    assert text.startswith("invalid configuration:")
    for problem in problems:
        assert f"  - {problem}" in text


def test_several_field_problems_reported_together():
    config = make(num_layers=0, micro_batch_size=-1, hidden_dropout=1.0, clip_grad=-1.0,
                  distributed_timeout_minutes=0.0)
    problems = problems_of(config)
    assert len(problems) == 5, problems
    for piece in ["--num-layers=0", "--micro-batch-size=-1", "--hidden-dropout=1.0",
                  "--clip-grad=-1.0", "--distributed-timeout-minutes=0.0"]:
        assert any(piece in p for p in problems), (piece, problems)


def test_world_size_and_shape_problems_reported_together():
    config = make(tensor_model_parallel_size=4, num_attention_heads=6, hidden_size=96)
    problems = problems_of(config, world_size=6)
    assert len(problems) == 2, problems
    assert any("6 processes" in p for p in problems)
    assert any(p.startswith("--num-attention-heads 6 is not divisible") for p in problems)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    error = ConfigError(["a", "b"])
    assert error.problems == ["a", "b"]
    assert str(error) == "invalid configuration:\n  - a\n  - b"


# --------------------------------------------------------------------------- valid layouts

VALID = {
    "defaults": (make(), None),
    "t2_p2_d2_interleaved": (make(num_layers=8, hidden_size=256, num_attention_heads=8,
                                  tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                  data_parallel_size=2, num_layers_per_virtual_pipeline_stage=2,
                                  micro_batch_size=1, global_batch_size=8), None),
    "t2_p2_world8_inferred_d": (make(num_layers=8, hidden_size=256, num_attention_heads=8,
                                     tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                     num_layers_per_virtual_pipeline_stage=1,
                                     micro_batch_size=2, global_batch_size=16), 8),
    "gpt2_medium_t4_p2": (make(num_layers=24, hidden_size=1024, num_attention_heads=16,
                               seq_length=1024, max_position_embeddings=1024,
                               tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                               micro_batch_size=2, global_batch_size=8), None),
    "gpt3_175b_t8_p8_world512": (make(num_layers=96, hidden_size=12288, num_attention_heads=96,
                                      seq_length=2048, tensor_model_parallel_size=8,
                                      pipeline_model_parallel_size=8,
                                      num_layers_per_virtual_pipeline_stage=6,
                                      micro_batch_size=1, global_batch_size=1536), 512),
    "explicit_ffn_and_d": (make(ffn_hidden_size=300, tensor_model_parallel_size=2,
                                data_parallel_size=3, micro_batch_size=2,
                                global_batch_size=12), 6),
    "dropout_zero": (make(hidden_dropout=0.0, attention_dropout=0.0), None),
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_configs_pass(name):
    config, world_size = VALID[name]
    validate(config, world_size=world_size)


@pytest.mark.parametrize("name", list(VALID))
def test_validate_does_not_mutate_valid_config(name):
    config, world_size = VALID[name]
    before = dataclasses.asdict(config)
    validate(config, world_size=world_size)
    assert dataclasses.asdict(config) == before


@pytest.mark.parametrize("config,world_size", [
    (make(hidden_size=130, num_attention_heads=3, tensor_model_parallel_size=2,
          num_layers=5, pipeline_model_parallel_size=2), None),
    (make(num_layers=0, hidden_dropout=2.0), None),
    (make(tensor_model_parallel_size=2, data_parallel_size=3), 8),
    (make(tensor_model_parallel_size=3), 8),
    (make(num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2,
          micro_batch_size=2), 4),
], ids=["shape", "fields", "dp_mismatch", "world", "interleaved"])
def test_validate_does_not_mutate_invalid_config(config, world_size):
    before = dataclasses.asdict(config)
    with pytest.raises(ConfigError):
        validate(config, world_size=world_size)
    assert dataclasses.asdict(config) == before
    # in particular nothing inferred from the world size is written back
    assert config.parallel.data_parallel_size == before["parallel"]["data_parallel_size"]


# --------------------------------------------------------------------------- padded vocab

@pytest.mark.parametrize("vocab,divisible_by,t,padded", [
    (50257, 128, 1, 50304),
    (50257, 128, 2, 50432),
    (100, 8, 1, 104),
    (100, 8, 2, 112),
    (100, 8, 4, 128),
    (128, 128, 1, 128),  # already a multiple: unchanged
    (256, 128, 2, 256),
    (1, 1, 1, 1),
])
def test_padded_vocab_size(vocab, divisible_by, t, padded):
    model = ModelConfig(vocab_size=vocab, make_vocab_size_divisible_by=divisible_by)
    assert model.padded_vocab_size(t) == padded
    assert padded % (divisible_by * t) == 0
    assert padded >= vocab
    assert padded - vocab < divisible_by * t
    assert model.vocab_size == vocab  # not changed by padding


# --------------------------------------------------------------------------- suggestions fix problems

# What kind of problem a message is, so that one can tell it has gone away.
KINDS = {
    "world_tp": r"processes, not a multiple of --tensor-model-parallel-size",
    "world_dp": r"processes but .*--data-parallel-size \d+ = \d+",
    "hidden_heads": r"^--hidden-size \d+ is not divisible by --num-attention-heads",
    "heads_t": r"^--num-attention-heads \d+ is not divisible by --tensor-model-parallel-size",
    "ffn_t": r"^--ffn-hidden-size \d+ is not divisible",
    "seq": r"^--seq-length \d+ exceeds",
    "layers_p": r"^--num-layers \d+ is not divisible by --pipeline-model-parallel-size \d+:",
    "interleave_p": r"needs --pipeline-model-parallel-size >= 2",
    "layers_pk": r"^--num-layers \d+ is not divisible by --pipeline-model-parallel-size \d+ × ",
    "batch": r"^--global-batch-size \d+ is not divisible by --micro-batch-size",
    "interleave_m": r"^the interleaved schedule needs the number of microbatches",
}


def kind_of(problem: str) -> str:
    kinds = [kind for kind, pattern in KINDS.items() if re.search(pattern, problem)]
    assert len(kinds) == 1, (problem, kinds)
    return kinds[0]


def suggestions(problem: str) -> list[tuple[str, int | None]]:
    """Every concrete (flag, value) a message suggests: `use --flag N`, `or --flag N`,
    `--flag in [a, b, ...]` and `leave it out` (value None)."""
    found: list[tuple[str, int | None]] = []
    advice = problem.split(": use ", 1)[1] if ": use " in problem else ""
    advice = "use " + advice
    for flag, value in re.findall(r"(?:use|or) (--[a-z-]+) (\d+)\b", advice):
        found.append((flag, int(value)))
        if re.search(rf"{flag} {value} or leave it out", advice):
            found.append((flag, None))
    for flag, values in re.findall(r"(--[a-z-]+) in \[([\d, ]*)\]", advice):
        found.extend((flag, int(v)) for v in values.split(","))
    return found


def apply(config: Config, flag: str, value: int | None) -> Config:
    changed = Config.from_dict(dataclasses.asdict(config))
    section, name = FIELD_OF_FLAG[flag]
    setattr(getattr(changed, section), name, value)
    return changed


# (config, world size) with exactly one problem whose message offers concrete alternatives.
SINGLE_PROBLEM = {
    "world_dp": (make(tensor_model_parallel_size=2, data_parallel_size=2), 8),
    "hidden_heads": (make(hidden_size=100, num_attention_heads=16), None),
    "heads_t": (make(hidden_size=768, num_attention_heads=12, tensor_model_parallel_size=8), None),
    "ffn_t": (make(ffn_hidden_size=510, tensor_model_parallel_size=4), None),
    "seq": (make(seq_length=128, max_position_embeddings=64), None),
    "layers_p": (make(num_layers=10, pipeline_model_parallel_size=3), None),
    "layers_pk": (make(num_layers=12, pipeline_model_parallel_size=2,
                       num_layers_per_virtual_pipeline_stage=5, micro_batch_size=2,
                       global_batch_size=4), None),
    "batch": (make(micro_batch_size=4, global_batch_size=30, data_parallel_size=2), None),
    "batch_dp": (make(micro_batch_size=2, global_batch_size=11, data_parallel_size=2), None),
    "batch_world": (make(micro_batch_size=1, global_batch_size=9), 4),
    "interleave_m": (make(num_layers=8, pipeline_model_parallel_size=4,
                          num_layers_per_virtual_pipeline_stage=2, micro_batch_size=2,
                          global_batch_size=10), None),
    "layers_pk_batch": (make(num_layers=16, pipeline_model_parallel_size=4,
                             num_layers_per_virtual_pipeline_stage=3, micro_batch_size=1,
                             global_batch_size=8), None),
}

# Single-problem configurations where an earlier version suggested alternatives
# that were themselves invalid; kept as regression cases.
SUGGESTIONS_ACROSS_CHECKS = {
    # --num-attention-heads 16 does not divide --hidden-size 120 (24 would: 120 % 24 == 0, 24 % 8 == 0)
    "heads_t_vs_hidden": (make(hidden_size=120, num_attention_heads=12,
                               tensor_model_parallel_size=8), None),
    # heads in [2, 4, 5, 10, 20, 25] are offered, but 2, 5, 10, 25 are not divisible by t = 4
    "hidden_heads_vs_t": (make(hidden_size=100, num_attention_heads=8,
                               tensor_model_parallel_size=4), None),
    # --num-layers 16 and p in [1, 2, 7, 14] all ignore the interleaving stage size k = 3
    "layers_p_vs_interleaving": (make(num_layers=14, pipeline_model_parallel_size=4,
                                      num_layers_per_virtual_pipeline_stage=3,
                                      micro_batch_size=1, global_batch_size=4), None),
    # --global-batch-size 12 gives 6 microbatches (not a multiple of p = 4); b in [1, 11] likewise
    "batch_vs_interleaving": (make(num_layers=4, pipeline_model_parallel_size=4,
                                   num_layers_per_virtual_pipeline_stage=1, micro_batch_size=2,
                                   global_batch_size=11), None),
    # under a world of 8 processes, t in [3, 6, 12] cannot be used (t·p must divide 8)
    "heads_t_vs_world_size": (make(hidden_size=768, num_attention_heads=12,
                                   tensor_model_parallel_size=8), 8),
}


@pytest.mark.parametrize("name", list(SINGLE_PROBLEM) + list(SUGGESTIONS_ACROSS_CHECKS))
def test_each_suggestion_removes_its_problem(name):
    config, world_size = {**SINGLE_PROBLEM, **SUGGESTIONS_ACROSS_CHECKS}[name]
    problem = single_problem(config, world_size)
    kind = kind_of(problem)
    alternatives = suggestions(problem)
    assert alternatives, f"no concrete alternative in {problem!r}"
    for flag, value in alternatives:
        after = problems_of(apply(config, flag, value), world_size)
        assert all(kind_of(p) != kind for p in after), (flag, value, after)


@pytest.mark.parametrize("name", list(SINGLE_PROBLEM) + list(SUGGESTIONS_ACROSS_CHECKS))
def test_each_suggestion_of_a_lone_problem_gives_a_valid_config(name):
    config, world_size = {**SINGLE_PROBLEM, **SUGGESTIONS_ACROSS_CHECKS}[name]
    problem = single_problem(config, world_size)
    bad = [(flag, value, problems_of(apply(config, flag, value), world_size))
           for flag, value in suggestions(problem)]
    assert [b for b in bad if b[2]] == []


def test_suggestion_parser():
    assert suggestions("--x 3 is bad: use --hidden-size 96 or --num-attention-heads in [4, 5]") == [
        ("--hidden-size", 96), ("--num-attention-heads", 4), ("--num-attention-heads", 5)]
    assert suggestions("... = 2: use --data-parallel-size 4 or leave it out") == [
        ("--data-parallel-size", 4), ("--data-parallel-size", None)]


def test_world_size_mismatch_and_batch_problem_reported_together():
    # The job has 4 processes, so d is 4 whatever --data-parallel-size says; B = 2 < b·d = 4.
    config = make(data_parallel_size=2, micro_batch_size=1, global_batch_size=2)
    problems = problems_of(config, world_size=4)
    assert any(kind_of(p) == "world_dp" for p in problems), problems
    assert any(kind_of(p) == "batch" for p in problems), problems


def test_interleaving_layer_and_microbatch_problems_reported_together():
    # 12 layers over p=2 × k=5 does not split, and B / (b·d) = 1 microbatch is not a multiple of p.
    config = make(num_layers=12, pipeline_model_parallel_size=2,
                  num_layers_per_virtual_pipeline_stage=5, micro_batch_size=2)
    problems = problems_of(config)
    assert any(kind_of(p) == "layers_pk" for p in problems), problems
    assert any(kind_of(p) == "interleave_m" for p in problems), problems
