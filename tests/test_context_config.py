"""Context parallelism's settings (ptdp/config/context.py and the sizes in
ptdp/config/parallel.py, checks.py, moe.py): --context-parallel-size and
--cp-comm-type as Megatron-LM spells them, the world of t·c·p·d ranks, and
every rule with its message, called directly."""

from __future__ import annotations

import pytest

from ptdp.cli import build_parser
from ptdp.config import Config, ParallelConfig, validate
from ptdp.config.context import context_parallel_problems
from tests import test_moe_config as moe_config

def parse(*argv: str) -> Config:
    """test_moe_config's tiny model, attention dropout off (refused with c > 1)."""
    return moe_config.parse("--attention-dropout", "0", *argv)


def problems(*argv: str, world_size: int | None = None) -> list[str]:
    """Every problem of validate."""
    return moe_config.problems("--attention-dropout", "0", *argv, world_size=world_size)


def context_problems(*argv: str, world_size: int | None = None) -> list[str]:
    config = parse(*argv)
    return context_parallel_problems(config.model, config.parallel, world_size)


def test_flags_are_megatron_lms():
    par = parse().parallel
    assert (par.context_parallel_size, par.cp_comm_type) == (1, "p2p")
    par = parse("--context-parallel-size", "4", "--cp-comm-type", "all_gather").parallel
    assert (par.context_parallel_size, par.cp_comm_type) == (4, "all_gather")
    assert parse("--cp-comm-type", "a2a").parallel.cp_comm_type == "a2a"


def test_an_unknown_comm_type_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--cp-comm-type", "a2a+p2p"])
    assert exit_.value.code == 2
    assert "--cp-comm-type a2a+p2p: choose from p2p, all_gather, a2a" \
        in capsys.readouterr().err


def test_the_world_is_t_c_p_d():
    par = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=3,
                         pipeline_model_parallel_size=2, data_parallel_size=5)
    assert (par.ranks_per_replica, par.world_size) == (12, 60)
    assert ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                          data_parallel_size=5).world_size == 20
    # Under torchrun the data-parallel size is what t·c·p leaves of the world.
    assert problems("-t", "2", "--context-parallel-size", "2", world_size=8) == []
    assert problems("-t", "2", "--context-parallel-size", "2", "-d", "2", world_size=8) == []
    assert problems("-t", "2", "--context-parallel-size", "2", "-d", "4", world_size=8) == [
        "the job has 8 processes but --tensor-model-parallel-size 2 × --context-parallel-size 2 × "
        "--pipeline-model-parallel-size 1 × --data-parallel-size 4 = 16: use --data-parallel-size 2 "
        "or leave it out"]
    assert problems("-t", "2", "--context-parallel-size", "2", world_size=6) == [
        "the job has 6 processes, not a multiple of --tensor-model-parallel-size 2 × "
        "--context-parallel-size 2 × --pipeline-model-parallel-size 1 = 4: choose t, c and p with "
        "t·c·p in [1, 2, 3, 6]"]
    # c = 1: the messages as before.
    assert problems("-t", "4", world_size=6) == [
        "the job has 6 processes, not a multiple of --tensor-model-parallel-size 4 × "
        "--pipeline-model-parallel-size 1 = 4: choose t and p with t·p in [1, 2, 3, 6]"]


def test_the_size_is_a_positive_integer():
    assert problems("--context-parallel-size", "0") == [
        "--context-parallel-size=0 must be a positive integer"]


@pytest.mark.parametrize("c", [2, 3, 4])
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_sequence_rule_is_megatron_lms(c, t, sequence_parallel):
    """s divisible by 2c; with sequence parallelism each rank's s/c by t."""
    if sequence_parallel and t == 1:
        return
    config = parse("-t", str(t), "--context-parallel-size", str(c), "--max-position-embeddings",
                   "128", *(["--sequence-parallel"] if sequence_parallel else []))
    for s in range(8, 100):
        valid = s % (2 * c) == 0 and (not sequence_parallel or (s // c) % t == 0)
        config.model.seq_length = s
        found = context_parallel_problems(config.model, config.parallel)
        assert (found == []) == valid, (s, found)
        if not valid:
            hinted = [int(w.split()[0]) for w in found[0].split("--seq-length ")[2:]]
            assert hinted and all(x % (2 * c) == 0 and (not sequence_parallel or (x // c) % t == 0)
                                  for x in hinted), found


def test_the_sequence_messages():
    assert context_problems("--context-parallel-size", "2", "--seq-length", "30") == [
        "--context-parallel-size 2 needs --seq-length 30 divisible by 2c = 4 (each sequence is cut "
        "into 2c chunks, two per rank): use --seq-length 28 or --seq-length 32"]
    assert context_problems("-t", "4", "--sequence-parallel", "--context-parallel-size", "2",
                            "--seq-length", "20") == [
        "--context-parallel-size 2 needs --seq-length 20 divisible by 8: 2c = 4 chunks, and each "
        "context rank's s/c positions split over --tensor-model-parallel-size 4 by "
        "--sequence-parallel: use --seq-length 16 or --seq-length 24"]
    # The learned position table bounds the lengths offered.
    assert context_problems("--context-parallel-size", "2", "--seq-length", "30",
                            "--max-position-embeddings", "30")[0].endswith(
        "use --seq-length 28 or --seq-length 24")
    # One hint for --seq-length: the tensor checks leave the sequence to these under c > 1.
    assert problems("-t", "4", "--sequence-parallel", "--context-parallel-size", "2",
                    "--seq-length", "18", "--max-position-embeddings", "64") == [
        "--context-parallel-size 2 needs --seq-length 18 divisible by 8: 2c = 4 chunks, and each "
        "context rank's s/c positions split over --tensor-model-parallel-size 4 by "
        "--sequence-parallel: use --seq-length 16 or --seq-length 24"]


def test_a2a_splits_the_heads_of_each_tensor_rank():
    # 4 heads, t = 1: c = 2 and 4 split them, 8 does not (p2p and all_gather need nothing).
    assert context_problems("--context-parallel-size", "4", "--cp-comm-type", "a2a") == []
    assert context_problems("--context-parallel-size", "8", "--cp-comm-type", "a2a") == [
        "--cp-comm-type a2a splits each tensor rank's 4 attention heads over --context-parallel-size "
        "8 (all-to-all trades the sequence split for a head split), which 8 does not divide: use "
        "--cp-comm-type p2p or all_gather, or --context-parallel-size in [2, 4]"]
    for other in ("p2p", "all_gather"):
        assert context_problems("--context-parallel-size", "8", "--cp-comm-type", other) == []
    # t = 2 leaves 2 heads per tensor rank; GQA's key/value groups count too.
    assert context_problems("-t", "2", "--context-parallel-size", "4", "--cp-comm-type", "a2a",
                            "--seq-length", "16") == [
        "--cp-comm-type a2a splits each tensor rank's 2 attention heads over --context-parallel-size "
        "4 (all-to-all trades the sequence split for a head split), which 4 does not divide: use "
        "--cp-comm-type p2p or all_gather, or --context-parallel-size in [2]"]
    gqa = ["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2"]
    assert context_problems(*gqa, "--context-parallel-size", "4", "--cp-comm-type", "a2a") == [
        "--cp-comm-type a2a splits each tensor rank's 8 attention heads and 2 key/value groups over "
        "--context-parallel-size 4 (all-to-all trades the sequence split for a head split), which 4 "
        "does not divide: use --cp-comm-type p2p or all_gather, or --context-parallel-size in [2]"]
    assert context_problems(*gqa, "--context-parallel-size", "2", "--cp-comm-type", "a2a") == []
    # The sizes offered fit the job's processes.
    assert context_problems(*gqa, "--context-parallel-size", "4", "--cp-comm-type", "a2a",
                            world_size=9)[0].endswith("use --cp-comm-type p2p or all_gather")


def test_attention_dropout_is_refused_with_context_parallelism():
    flags = ("--context-parallel-size", "2", "--attention-dropout")
    assert context_problems(*flags, "0.1") == [
        "--attention-dropout 0.1 with --context-parallel-size 2: the context-parallel attention "
        "has no dropout yet: use --attention-dropout 0 (0.1 is the default, as in Megatron-LM)"]
    assert context_problems(*flags, "0") == []
    assert context_problems("--attention-dropout", "0.1") == []  # c = 1


def test_experts_fold_over_the_context_ranks():
    """EP × ETP must divide t·c·d, the ranks of a pipeline stage."""
    moe = ["--num-experts", "4"]
    assert problems(*moe, "--expert-model-parallel-size", "2") != []           # t·d = 1
    assert problems(*moe, "--expert-model-parallel-size", "2", "--context-parallel-size", "2") == []
    found = problems(*moe, "--expert-model-parallel-size", "4", "--context-parallel-size", "2")[0]
    assert found.startswith(
        "--expert-model-parallel-size 4 × --expert-tensor-parallel-size 1 = 4 does not divide "
        "--tensor-model-parallel-size 1 × --context-parallel-size 2 × data-parallel size 1 = 2 (the "
        "t·c·d ranks of a pipeline stage are re-folded into ETP × EP × expert-data-parallel): use "
        "--expert-model-parallel-size in [1, 2]")
    assert found.endswith(" or --data-parallel-size 2")
    # Under torchrun d is what t·c·p leaves of the world.
    assert problems(*moe, "--expert-model-parallel-size", "4", "--context-parallel-size", "2",
                    world_size=4) == []


def test_a_valid_context_parallel_layout_validates():
    validate(parse("--context-parallel-size", "2"))
    validate(parse("--context-parallel-size", "4", "--cp-comm-type", "a2a"))


def test_capacity_factor_experts_are_refused_under_context_parallelism():
    moe = ["--num-experts", "4", "--context-parallel-size", "2"]
    assert problems(*moe) == []
    assert problems(*moe, "--moe-expert-capacity-factor", "1.5") == [
        "--moe-expert-capacity-factor 1.5 with --context-parallel-size 2: an expert's capacity is "
        "counted over the tokens one process routes, and a context rank routes only s/c "
        "positions of each sequence, so it would drop other tokens: drop "
        "--moe-expert-capacity-factor (dropless) or use --context-parallel-size 1"]

