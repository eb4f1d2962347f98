"""The divisibility hints of `validate` never lead to a second error: applied
as printed (one alternative per problem, every problem of the report at
once), each set of hints gives a configuration that passes. The hints are
read back from the message mechanically, as a user copying them would."""

from __future__ import annotations

import itertools
import re

import pytest

from ptdp.cli import build_parser
from ptdp.commands.train import config_from_settings, settings_from_args
from ptdp.config import ConfigError, validate

PARSER = build_parser()

# "--flag value", "-t 2" or "--flag in [1, 2, 4]" inside one alternative.
_SETTING = re.compile(r"(--[a-z0-9-]+|-[tpd])\s+(?:in \[([^\]]*)\]|([0-9][0-9a-z]*|[a-z][a-z0-9-]*))")


def problems_of(argv: list[str], world_size: int | None) -> list[str]:
    config = config_from_settings(settings_from_args(PARSER.parse_args(["train", *argv])))
    try:
        validate(config, world_size=world_size)
    except ConfigError as error:
        return error.problems
    return []


def alternatives(problem: str) -> list[list[tuple[str, list[str]]]]:
    """The problem's hint, `use A or B or ...` after its last colon, as a
    list of alternatives, each the settings it names ([(flag, [values it may
    take])]); an alternative that names none ("remove it") is left out."""
    text = re.sub(r"\([^()]*\)", "", problem)  # asides, e.g. "(layers are never dropped or ...)"
    if ": " not in text:
        return []
    hint = text.rsplit(": ", 1)[1]  # "use A or B", "remove it or use C"
    found = []
    for alternative in re.split(r",? or ", hint):
        settings = [(flag, [v.strip() for v in listed.split(",")] if listed else [value])
                    for flag, listed, value in _SETTING.findall(alternative)]
        if settings:
            found.append(settings)
    return found


def choices(problems: list[str]):
    """Every way of following the hints: one alternative per problem (a
    listed value each), as the flags to add; None where two hints set one
    flag differently (which a user could not follow)."""
    per_problem = [[list(zip([flag for flag, _ in alt], values))
                    for alt in alternatives(p) for values in itertools.product(*(v for _, v in alt))]
                   for p in problems]
    for picked in itertools.product(*[options for options in per_problem if options]):
        flags: dict[str, str] = {}
        for flag, value in itertools.chain.from_iterable(picked):
            if flags.setdefault(flag, value) != value:
                yield picked, None
                break
        else:
            yield picked, [x for flag, value in flags.items() for x in (flag, value)]


# (the flags, the world size under torchrun or None for ptdp's own launch)
FAILING = {
    "4 heads at t=3": (["--num-attention-heads", "4", "--hidden-size", "64", "-t", "3"], None),
    "4 heads at t=3 under torchrun": (["--num-attention-heads", "4", "--hidden-size", "64",
                                       "-t", "3"], 2),
    "4 heads at t=3 with swiglu": (["--num-attention-heads", "4", "--hidden-size", "64", "-t", "3",
                                    "--swiglu"], None),
    "hidden 64, 5 heads": (["--hidden-size", "64", "--num-attention-heads", "5"], None),
    "hidden 64, 5 heads, rope": (["--hidden-size", "64", "--num-attention-heads", "5",
                                  "--position-embedding-type", "rope"], None),
    "hidden 130, 3 heads at t=2": (["--hidden-size", "130", "--num-attention-heads", "3",
                                    "-t", "2"], None),
    "t=2, one query group": (["-t", "2", "--group-query-attention", "--num-query-groups", "1"],
                             None),
    "5 layers, p=2, interleaved": (["--num-layers", "5", "-p", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1"], None),
    "10 layers, p=4, interleaved": (["--num-layers", "10", "-p", "4",
                                     "--num-layers-per-virtual-pipeline-stage", "1",
                                     "--global-batch-size", "8"], None),
    "3 layers, p=2 under torchrun": (["--num-layers", "3", "-p", "2", "-t", "2"], 2),
    "interleaved at p=1": (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2",
                            "--global-batch-size", "8"], None),
    "6 layers, p=4, zb-h1": (["--num-layers", "6", "-p", "4", "--pipeline-schedule", "zb-h1",
                              "--global-batch-size", "4"], None),
    "ffn 250 at t=4": (["--ffn-hidden-size", "250", "-t", "4"], None),
    "ffn 250 and 4 heads at t=3": (["--ffn-hidden-size", "250", "--num-attention-heads", "4",
                                    "--hidden-size", "64", "-t", "3"], None),
    "sequence 63 at t=2": (["--sequence-parallel", "-t", "2", "--seq-length", "63"], None),
    "sequence 63 and ffn 250 at t=4": (["--sequence-parallel", "-t", "4", "--seq-length", "63",
                                        "--ffn-hidden-size", "250"], None),
    "batch 10, micro 4, d=2": (["--global-batch-size", "10", "--micro-batch-size", "4",
                                "--data-parallel-size", "2"], None),
    "README: 12 heads at t=8": (["--num-attention-heads", "12", "--hidden-size", "768", "-t", "8"],
                                None),
}


@pytest.mark.parametrize("name", FAILING)
def test_following_the_hints_passes_validation(name):
    argv, world = FAILING[name]
    argv = ["--mock-data", *argv]
    problems = problems_of(argv, world)
    assert problems, f"{name}: expected a failing configuration"
    for problem in problems:  # every problem gives flags to change (the world's names t·p)
        assert alternatives(problem) or problem.startswith("the job has"), problem
    tried = 0
    for picked, flags in choices(problems):
        assert flags is not None, f"{name}: hints that set one flag twice: {picked}\n{problems}"
        left = problems_of(argv + flags, world)
        assert not left, f"{name}: following {flags} of\n{problems}\nleaves\n{left}"
        tried += 1
    assert tried


def test_four_heads_at_t3_suggests_heads_and_hidden_size_together():
    problems = problems_of(["--mock-data", "--num-attention-heads", "4", "--hidden-size", "64",
                            "-t", "3"], None)
    assert problems == [
        "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3: use "
        "--tensor-model-parallel-size in [1, 2, 4] or --num-attention-heads 3 --hidden-size 48 "
        "(together: 3 heads of 16)"]


def test_the_hint_parser_sees_every_alternative():
    """The test's reading of a message, on a message of the old kind."""
    old = ("--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3: use "
           "--tensor-model-parallel-size in [1, 2] or --hidden-size 60")
    assert alternatives(old) == [[("--tensor-model-parallel-size", ["1", "2"])],
                                 [("--hidden-size", ["60"])]]
    # Following the old hint --hidden-size 60 led to a second error: the test catches it.
    assert problems_of(["--num-attention-heads", "4", "--hidden-size", "60", "-t", "3"], None)


# ------------------------------------------------------------------ said once per node

BAD = ["train", "--mock-data", "--num-attention-heads", "4", "--hidden-size", "64", "-t", "3"]
FIRST_LINE = "ptdp: error: invalid configuration:"

# Each rank's variables: torchrun's, RANK/WORLD_SIZE set by hand (a SLURM
# script), SLURM's own; and whether that rank prints.
RANKS = {
    "torchrun, local rank 0": ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, True),
    "torchrun, local rank 1": ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, False),
    "torchrun, second node's local rank 0": (
        {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, True),
    "by hand without LOCAL_RANK, rank 0": ({"RANK": "0", "WORLD_SIZE": "2"}, True),
    "by hand without LOCAL_RANK, rank 1": ({"RANK": "1", "WORLD_SIZE": "2"}, False),
    "by hand with SLURM_LOCALID 0": ({"RANK": "3", "WORLD_SIZE": "4", "SLURM_LOCALID": "0"}, True),
    "SLURM, task 1": ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                       "MASTER_ADDR": "127.0.0.1"}, False),
    "SLURM, task 0": ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                       "MASTER_ADDR": "127.0.0.1"}, True),
}


@pytest.fixture
def rank_environment(monkeypatch, tmp_path):
    """Sets one rank's variables (none of the test's own leak in); returns
    the torchrun error file that rank writes."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    # A quiet rank waits for the speaking one to exit first (ptdp.cli.main):
    # recorded here, not slept.
    waits: list[float] = []
    import ptdp.cli
    monkeypatch.setattr(ptdp.cli.time, "sleep", waits.append)

    def set_variables(variables: dict[str, str], error_file_name: str = "error.json"):
        error_file = tmp_path / error_file_name
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return error_file
    set_variables.waits = waits
    return set_variables


@pytest.mark.parametrize("name", RANKS)
def test_a_configuration_error_is_printed_by_one_rank_per_node(name, rank_environment, capsys):
    from ptdp.cli import main

    variables, prints = RANKS[name]
    error_file = rank_environment(variables)
    assert main(BAD) == 2  # every rank stops at once, with the status of a usage error
    captured = capsys.readouterr()
    assert captured.out == ""
    if prints:
        assert captured.err.startswith(FIRST_LINE) and captured.err.count(FIRST_LINE) == 1
        assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" \
            in captured.err
        assert "Traceback" not in captured.err
    else:
        assert captured.err == ""
    # The quiet rank outlasts the one that prints (torchrun stops every worker
    # at the first exit, which must not come before the message).
    from ptdp.cli import QUIET_RANK_WAIT_SECONDS
    assert rank_environment.waits == ([] if prints else [QUIET_RANK_WAIT_SECONDS])
    # Every rank's torchrun error file carries the whole message (torchrun may
    # see any of them first).
    assert FIRST_LINE in error_file.read_text()


def test_torchrun_s_root_cause_is_the_rank_that_printed(rank_environment, capsys):
    """Ranks 0 and 1 fail alike in the same second; torchrun's summary (read
    with torch's own code) names rank 0, which printed, as the root cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ptdp.cli import main

    files = {}
    for rank in (1, 0):  # the silent one first: the order of exits does not matter
        files[rank] = rank_environment({"RANK": str(rank), "WORLD_SIZE": "2",
                                        "LOCAL_RANK": str(rank)}, f"{rank}.json")
        assert main(BAD) == 2
    assert capsys.readouterr().err.count(FIRST_LINE) == 1
    # (rank 1 listed first: on a tie torchrun takes the first listed)
    failures = {rank: ProcessFailure(rank, 1000 + rank, 2, str(files[rank])) for rank in (1, 0)}
    root, failure = ChildFailedError("ptdp", failures).get_first_failure()
    assert root == 0 and failure.message["message"].startswith(FIRST_LINE)


def test_ptdp_s_own_launcher_refuses_before_starting_the_ranks_once(no_launch, capsys):
    from ptdp.cli import main

    assert main(BAD[:-2] + ["-t", "2", "--num-attention-heads", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count(FIRST_LINE) == 1 and "ptdp: starting" not in err
