"""Megatron-LM flags without a setting of their own (ptdp/config/megatron.py)
and the shape flags whose other values ptdp refuses: each accepted flag is
explained in one line before the run, each refused one is reported with the
other problems, before any process starts."""

import importlib.util
import json
import os
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest

from ptdp.argparser import did_you_mean
from ptdp.cli import QUIET_RANK_WAIT_SECONDS, build_parser, main
from ptdp.commands.train import config_from_args
from ptdp.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from ptdp.config.megatron import ACCEPTED, given, notes, refusals
from ptdp.config.megatron_flag_list import MEGATRON_LM_COMMIT, MEGATRON_LM_FLAGS
from ptdp.parallel.block_attention import attention_kernel
from tests.test_config_hints import rank_environment  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "64", "--seq-length", "16", "--train-iters", "1"]


def _args(*flags):
    return build_parser().parse_args(["train", *TINY, *flags])


def _plausible(accepted) -> list[str]:
    """The flag with a value Megatron-LM's parser takes: a refused choice
    where it has some, else its first choice, else a number."""
    if accepted.values == 0:
        return [accepted.name]
    if accepted.alias_of:
        return [accepted.name, "4"]  # TINY's --num-layers and length are 4 and 16
    value = (accepted.refused_choices or accepted.choices or ("1",))[0]
    return [accepted.name, value]


def test_each_table_flag_parses_and_is_explained_or_refused():
    parser = build_parser()
    for accepted in ACCEPTED:
        flags = _plausible(accepted)
        if accepted.alias_of == "model.seq_length":
            flags = [accepted.name, "16"]
        found = given(parser.parse_args(["train", *TINY, *flags]))
        assert [a.name for a, _ in found] == [accepted.name]
        if accepted.refused or accepted.refused_choices:
            assert refusals(found) and not notes(found), flags
            assert refusals(found)[0].startswith(" ".join(flags) + ": ")
        elif accepted.is_alias:
            assert notes(found) == [f"ptdp: {' '.join(flags)}: {accepted.explanation}"]
        else:
            assert notes(found) == [f"ptdp: {' '.join(flags)} has no effect: {accepted.explanation}"]


def test_an_invalid_choice_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--transformer-impl", "te"])
    assert exit_.value.code == 2
    assert "--transformer-impl te: choose from local, transformer_engine" in capsys.readouterr().err


def test_notes_come_before_launch_and_refusals_join_the_other_problems(no_launch, capsys):
    with pytest.raises(AssertionError, match="a training process was started"):
        main(["train", *TINY, "--use-mcore-models", "--overlap-grad-reduce",
              "--use-flash-attn"])
    out = capsys.readouterr().out
    assert out.index("--use-mcore-models has no effect") < out.index("ptdp: starting")
    assert "--use-flash-attn has no effect" in out
    code = main(["train", *TINY, "--fp8-format", "hybrid", "--ckpt-format", "torch_dist",
                 "--context-parallel-size", "2", "--kv-channels", "0", "--rotary-percent", "0.5"])
    err = capsys.readouterr().err
    assert code == 2
    for problem in ("--fp8-format hybrid: FP8 training needs Transformer Engine",
                    "--ckpt-format torch_dist: ptdp writes and reads its own checkpoint format",
                    "--kv-channels=0 must be a positive integer (each attention head's width)",
                    "--rotary-percent 0.5 sets how much of each head is rotated, but the model has"):
        assert problem in err, problem


def test_values_ptdp_has_are_accepted_silently():
    config = config_from_args(_args("--kv-channels", "8", "--rotary-percent", "1.0",
                                    "--context-parallel-size", "1"))
    validate(config)


@pytest.mark.parametrize("v, layers_per_chunk", [(2, 1), (1, None)])
def test_virtual_stages_per_rank_are_layers_per_chunk(v, layers_per_chunk):
    """--num-virtual-stages-per-pipeline-rank v is L/(p·v) layers per chunk
    (Megatron-LM's newer spelling); v = 1 is one chunk, no interleaving."""
    config = config_from_args(_args("-p", "2", "--num-virtual-stages-per-pipeline-rank", str(v),
                                    "--global-batch-size", "4"))
    assert config.parallel.num_layers_per_virtual_pipeline_stage == layers_per_chunk
    assert config.parallel.virtual_stages(4) == v
    assert config.parallel.schedule_kind == ("interleaved" if v > 1 else "1f1b")
    validate(config)


def test_virtual_stages_that_do_not_divide_or_contradict_are_refused():
    with pytest.raises(ConfigError, match=r"--num-layers 4 is not divisible by "
                                          r"--pipeline-model-parallel-size 2 × 4 chunks = 8"):
        validate(config_from_args(_args("-p", "2", "--num-virtual-stages-per-pipeline-rank", "4")))
    with pytest.raises(ConfigError, match="both set the chunks: give one of them"):
        validate(config_from_args(_args("-p", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                                        "--num-layers-per-virtual-pipeline-stage", "2")))


def test_the_old_activations_checkpoint_method_is_full_recomputation():
    config = config_from_args(_args("--activations-checkpoint-method", "block"))
    assert (config.model.recompute_granularity, config.model.recompute_method) == ("full", "block")
    with pytest.raises(ConfigError, match="--activations-checkpoint-method uniform is older "
                                          "Megatron-LM's name"):
        validate(Config(model=ModelConfig(activations_checkpoint_method="uniform",
                                          recompute_granularity="selective")))


def test_the_attention_kernel_is_the_one_pytorch_runs():
    """The report names the backend PyTorch selects; running attention with
    only that backend allowed works, so it is one PyTorch can use here."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = Config(model=ModelConfig(hidden_size=32, num_attention_heads=4, seq_length=16,
                                      attention_dropout=0.0), parallel=ParallelConfig())
    line = attention_kernel(config, torch.device("cpu"), torch.float32)
    name = line.split("(")[1].split(")")[0]
    assert line.endswith("for float32 on cpu, 4 heads of width 8 per rank, sequence 16, causal")
    q = torch.randn(2, 4, 16, 8)
    with sdpa_kernel([getattr(SDPBackend, name)]):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_with_windows_or_sinks_the_report_names_the_block_kernel():
    """A model with sinks (or windows) never runs SDPA: the report names the
    block kernel that runs, one whose blocks return their log-sum-exp (the
    sinks' rescale needs it), as block_attention picks it here."""
    import torch
    from ptdp.parallel.block_attention import KERNELS, block_kernel

    for settings in ({"softmax_type": "learnable"}, {"window_size": "3,0"}):
        config = Config(model=ModelConfig(hidden_size=32, num_attention_heads=4, seq_length=16,
                                          attention_dropout=0.0, **settings),
                        parallel=ParallelConfig())
        line = attention_kernel(config, torch.device("cpu"), torch.float32)
        kernel = block_kernel("cpu", torch.float32, 8)
        assert kernel in KERNELS
        assert line == (f"ptdp's block attention (sliding windows, sinks) runs {kernel} blocks, "
                        f"each returning its rows' log-sum-exp, for float32 on cpu, 4 heads of "
                        f"width 8 per rank, sequence 16, causal")


# --------------------------------------------------------------------------- issue 27's flags

ISSUE_27 = ["--use-legacy-models", "--data-impl", "mmap", "--overlap-p2p-communication",
            "--timing-log-level", "2", "--wandb-project", "p", "--wandb-exp-name", "e",
            "--wandb-save-dir", "d", "--wandb-entity", "n", "--distributed-backend", "nccl"]


def test_megatron_script_flags_of_issue_27_are_explained():
    lines = notes(given(_args(*ISSUE_27)))
    assert len(lines) == 9 and not refusals(given(_args(*ISSUE_27)))
    for start in ("ptdp: --use-legacy-models has no effect: ptdp has one model implementation",
                  "ptdp: --data-impl mmap has no effect: ptdp reads Megatron-LM's mmap indexed",
                  "ptdp: --overlap-p2p-communication has no effect: always so in ptdp",
                  "ptdp: --timing-log-level 2 has no effect: ptdp times each iteration's phases",
                  "ptdp: --wandb-project p has no effect: ptdp does not log to Weights & Biases; it "
                  "writes TensorBoard event files (--tensorboard-dir DIR)",
                  "ptdp: --distributed-backend nccl has no effect: ptdp picks the backend by "
                  "device: nccl for CUDA, gloo for CPU"):
        assert any(line.startswith(start) for line in lines), start


@pytest.mark.parametrize("value, refused", [("mmap", False), ("infer", False), ("lazy", True),
                                            ("cached", True)])
def test_data_impl_takes_what_ptdp_reads(value, refused):
    found = given(_args("--data-impl", value))
    assert bool(refusals(found)) == refused and bool(notes(found)) != refused
    if refused:
        assert refusals(found) == [f"--data-impl {value}: ptdp reads only the mmap indexed format "
                                   "(.idx starting MMIDIDX), not older Megatron-LM's lazy/cached "
                                   "datasets: tokenize the text again with `ptdp preprocess` (or "
                                   "Megatron-LM's preprocess_data.py) and give --data-impl mmap or "
                                   "drop the flag"]


@pytest.mark.parametrize("flag, values", [("--timing-log-level", "3"),
                                          ("--distributed-backend", "mpi")])
def test_megatron_lm_choices_are_kept(flag, values, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", flag, values])
    assert f"{flag} {values}: choose from" in capsys.readouterr().err


def test_encoder_seq_length_is_seq_length():
    base = [a for a in TINY if a not in ("--seq-length", "16")]
    args = build_parser().parse_args(["train", *base, "--encoder-seq-length", "32"])
    assert config_from_args(args).model.seq_length == 32
    assert notes(given(args)) == ["ptdp: --encoder-seq-length 32: Megatron-LM's other name for "
                                  "--seq-length; the run's sequence length is this"]
    same = build_parser().parse_args(["train", *TINY, "--encoder-seq-length", "16"])
    assert config_from_args(same).model.seq_length == 16 and not refusals(given(same))
    for order in (["--seq-length", "16", "--encoder-seq-length", "32"],
                  ["--encoder-seq-length", "32", "--seq-length", "16"]):
        args = build_parser().parse_args(["train", *base, *order])
        assert refusals(given(args)) == [
            "--encoder-seq-length 32: conflicts with --seq-length 16: it is Megatron-LM's other "
            "name for that flag; give one of the two (or the same value)"], order


def test_rotary_seq_len_interpolation_factor_is_a_setting():
    """Once refused with the rope variants, now ptdp's linear interpolation."""
    args = _args("--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "8")
    assert not refusals(given(args)) and not notes(given(args))
    config = config_from_args(args)
    validate(config)
    assert config.model.rotary_seq_len_interpolation_factor == 8.0


def test_log_params_norm_and_num_zeros_are_settings():
    config = config_from_args(_args("--log-params-norm", "--log-num-zeros-in-grad"))
    assert config.train.log_params_norm and config.train.log_num_zeros_in_grad


def test_tiktoken_flags_for_another_tokenizer_are_noted():
    from ptdp.config.megatron import config_notes

    config = config_from_args(_args("--tiktoken-pattern", "v2"))
    assert config.data.tiktoken_pattern == "v2"
    assert config_notes(config) == ["ptdp: --tiktoken-pattern v2 has no effect: only "
                                    "--tokenizer-type TikTokenizer reads it, not the "
                                    "GPT2BPETokenizer"]


def test_pretrained_checkpoint_is_a_fine_tune_only_without_a_checkpoint_to_resume(tmp_path):
    """Megatron-LM's --pretrained-checkpoint: the weights to start from when
    --load has nothing to resume; a checkpoint in --load is resumed instead."""
    from ptdp.commands.train import _pretrained_checkpoint

    config = config_from_args(_args("--pretrained-checkpoint", str(tmp_path / "base")))
    train, said = _pretrained_checkpoint(config.train)
    assert (train.load, train.finetune) == (str(tmp_path / "base"), True)
    assert "as with --load DIR --finetune" in said[0]
    resumed = tmp_path / "run"
    resumed.mkdir()
    (resumed / "latest").write_text("iter_0000004\n")
    config = config_from_args(_args("--pretrained-checkpoint", str(tmp_path / "base"),
                                    "--load", str(resumed)))
    train, said = _pretrained_checkpoint(config.train)
    assert (train.load, train.finetune) == (str(resumed), False)
    assert f"--load {resumed} holds a checkpoint, which the run resumes" in said[0]


# --------------------------------------------------------------------------- every flag (issue 38)

def _train_parser():
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices["train"]


def test_the_pinned_list_is_megatron_lms_parser_at_its_commit():
    """Names only, sorted, once each, with the commit they were read at; and,
    with a Megatron-LM work tree at $PTDP_MEGATRON_CHECKOUT (that commit
    checked out), what scripts/megatron_flag_list.py reads there."""
    assert re.fullmatch(r"[0-9a-f]{40}", MEGATRON_LM_COMMIT)
    assert list(MEGATRON_LM_FLAGS) == sorted(set(MEGATRON_LM_FLAGS))
    assert all(re.fullmatch(r"--[A-Za-z0-9][\w-]*", flag) for flag in MEGATRON_LM_FLAGS)
    assert len(MEGATRON_LM_FLAGS) > 850
    for flag in ("--multi-latent-attention", "--mtp-num-layers", "--window-size", "--softmax-type",
                 "--lr-warmup-init", "--recompute-modules", "--num-layers", "--save"):
        assert flag in MEGATRON_LM_FLAGS
    checkout = os.environ.get("PTDP_MEGATRON_CHECKOUT")
    if not checkout:
        pytest.skip("no Megatron-LM work tree at $PTDP_MEGATRON_CHECKOUT to read again")
    assert _regenerator().collect(Path(checkout)) == list(MEGATRON_LM_FLAGS)


def test_every_megatron_lm_flag_is_classified():
    """Each flag of Megatron-LM's parser is a setting of ptdp (implemented),
    another spelling of one, or in the flag table: accepted with a note or
    refused by name. None is unknown to `ptdp train`, none is in two places."""
    from ptdp.config.megatron import SPELLINGS

    options = _train_parser()._option_string_actions
    table = {accepted.name: accepted for accepted in ACCEPTED}
    assert len(table) == len(ACCEPTED)  # no flag twice in the table
    kinds = {"setting": 0, "spelling": 0, "accepted": 0, "refused": 0}
    for flag in MEGATRON_LM_FLAGS:
        assert flag in options, f"{flag} is not classified"
        setting = "." in options[flag].dest
        assert not (setting and flag in table), f"{flag} is a setting: take it out of the table"
        if flag in SPELLINGS:
            kinds["spelling"] += 1
        elif setting:
            kinds["setting"] += 1
        else:
            kinds["refused" if table[flag].refused else "accepted"] += 1
    assert all(count > 0 for count in kinds.values()), kinds


def _refused_by_main(capsys, *argv) -> str:
    """stderr of `ptdp train argv`, which must stop before launching with
    status 2: SystemExit from a command line's problems, 2 returned for
    settings that cannot work."""
    try:
        code = main(["train", *TINY, *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    captured = capsys.readouterr()
    assert "ptdp: starting" not in captured.out and "Traceback" not in captured.err
    return captured.err


def test_each_refused_flag_is_refused_by_name_in_one_report(no_launch, capsys):
    """Every refused flag of the table, with a plausible value, given to
    `ptdp train` at once: one report that names each (and no flag is
    "unrecognized"), before anything is launched."""
    refused = [accepted for accepted in ACCEPTED
               if accepted.refused or accepted.refused_choices]
    assert len(refused) > 300
    argv = [token for accepted in refused for token in _plausible(accepted)]
    err = _refused_by_main(capsys, *argv)
    assert "unrecognized" not in err
    lines = [line[4:] for line in err.splitlines() if line.startswith("  - ")]
    for accepted in refused:
        assert any(line.startswith(" ".join(_plausible(accepted)) + ": ") for line in lines), \
            accepted.name


@pytest.mark.parametrize("flags, says", [
    (["--cache-mla-latents"], "multi-latent attention"),
    (["--q-lora-rank", "1536"], "multi-latent attention"),
    (["--kv-lora-rank", "512"], "multi-latent attention"),
    (["--mtp-use-repeated-layer"], "multi-token prediction"),
    (["--window-size", "128"], "give two integers L,R"),
    (["--rope-type", "yarn"], "only with --multi-latent-attention"),
    (["--tokenizer-type", "BertWordPieceCase"], "BERT's WordPiece"),
])
def test_architectures_ptdp_lacks_say_what_they_are_and_what_to_use(flags, says, no_launch,
                                                                  capsys):
    err = _refused_by_main(capsys, *flags)
    assert err.count("\n") in (1, 2)  # one problem (after "invalid configuration:")
    assert f"error: {' '.join(flags)}: " in err or f"  - {' '.join(flags)}: " in err
    assert says in err
    assert "did you mean" not in err and any(word in err for word in ("use ", "give ", "drop "))


@pytest.mark.parametrize("flags, note", [
    (["--no-rope-fusion"], "plain PyTorch"),
    (["--disable-bf16-reduced-precision-matmul"], None),  # a setting (configure_matmul)
    (["--log-memory-to-tensorboard"], "always logs each rank's peak memory"),
    (["--logging-level", "20"], "not through Python's logging"),
    (["--enable-experimental"], "no features behind this switch"),
    (["--auto-detect-ckpt-format"], "its own format"),
    (["--recompute-modules", "core_attn"], None),  # a setting (its default)
    (["--lr-warmup-init", "0.0001"], None),  # a setting: nothing to say
])
def test_harmless_megatron_lm_switches_are_accepted_with_a_note(flags, note):
    found = given(_args(*flags))
    assert not refusals(found)
    if note is None:
        assert not found
    else:
        [line] = notes(found)
        assert line.startswith(f"ptdp: {' '.join(flags)} has no effect: ") and note in line


def test_no_load_optim_and_rng_without_load_are_a_note():
    from ptdp.config.megatron import config_notes

    config = config_from_args(_args("--no-load-optim", "--no-load-rng"))
    validate(config)
    assert config_notes(config) == [
        f"ptdp: {name} has no effect without --load: no checkpoint is loaded, so nothing is left "
        f"out of one" for name in ("--no-load-optim", "--no-load-rng")]


def test_recompute_modules_is_a_setting():
    """DeepSeek-V3's script's modules are read as the setting, with nothing
    to note; a module of a model ptdp lacks is refused by validate."""
    args = _args("--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe",
                 "mla_up_proj", "layernorm")
    assert not given(args)
    assert config_from_args(args).model.recompute_modules == ["mlp", "moe", "mla_up_proj",
                                                              "layernorm"]
    config = config_from_args(_args("--recompute-granularity", "selective",
                                    "--recompute-modules", "core_attn", "mhc"))
    with pytest.raises(ConfigError, match="--recompute-modules mhc: Megatron-LM's recomputation"):
        validate(config)


def test_megatron_lms_newer_spellings_are_the_settings():
    config = config_from_args(_args("--load", "x", "--override-opt-param-scheduler",
                                    "--manual-gc", "--disable-manual-gc-eval"))
    assert config.train.override_opt_param_scheduler and not config.train.manual_gc_eval
    config = config_from_args(_args("--load", "x", "--use-checkpoint-opt-param-scheduler"))
    assert config.train.use_checkpoint_opt_param_scheduler
    config = config_from_args(_args("--encoder-num-layers", "4"))
    assert config.model.num_layers == 4


def test_torch_fsdp2_flags_are_ptdps_zero_3_and_a_disagreement_is_refused():
    config = config_from_args(_args("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"))
    assert config.train.sharding_strategy == "optim_grads_params"
    assert not config.train.fsdp_reshard_after_forward
    assert not refusals(given(_args("--use-torch-fsdp2", "--use-megatron-fsdp",
                                    "--data-parallel-sharding-strategy", "optim_grads_params")))
    for flags, setting in [(("--data-parallel-sharding-strategy", "optim_grads", "--use-torch-fsdp2"),
                            "--data-parallel-sharding-strategy optim_grads"),
                           (("--torch-fsdp2-no-reshard-after-forward",
                             "--fsdp-reshard-after-forward"), "--fsdp-reshard-after-forward")]:
        [refusal] = refusals(given(_args(*flags)))
        assert f"conflicts with {setting}: it is Megatron-LM's other name for" in refusal, refusal


# --------------------------------------------------------------------------- did you mean

@pytest.mark.parametrize("flag", ["--mscale", "--mtp-num-layers", "--rotary-scaling-factor",
                                  "--no-rope-fusion", "--kv-lora-rank"])
def test_a_megatron_lm_flag_is_never_guessed_as_another(flag, capsys):
    """Not steered to --save, --num-layers, --rope-scaling-factor or
    --moe-router-fusion; `ptdp plan`, which does not take --no-rope-fusion,
    says so without a guess (it takes YaRN's, MLA's and MTP's flags)."""
    if flag == "--no-rope-fusion":
        with pytest.raises(SystemExit):
            main(["plan", flag, "1"])
        assert capsys.readouterr().err == (f"ptdp plan: error: unrecognized flag {flag} "
                                           f"(ptdp plan --help lists what it takes)\n")
    known = list(_train_parser()._option_string_actions)
    assert did_you_mean(flag, [k for k in known if k != flag]) == ""


@pytest.mark.parametrize("typo, meant, paths", [
    ("--hiden-size", "--hidden-size", ()), ("--num-layer", "--num-layers", ()),
    ("--swiglu-x", "--swiglu", ()), ("--tensorbaord-dir", "--tensorboard-dir", ("--tensorboard-dir",)),
    ("--sav", "--save", ("--save",)), ("--mtp-num-layer", "--mtp-num-layers", ()),
])
def test_real_typos_keep_their_guess(typo, meant, paths):
    known = list(_train_parser()._option_string_actions)
    assert did_you_mean(typo, known, paths) == f" (did you mean {meant}?)"


def test_a_path_flag_is_guessed_only_one_edit_away():
    assert did_you_mean("--svae", ["--save"], ["--save"]) == " (did you mean --save?)"
    assert did_you_mean("--msave", ["--save"], ["--save"]) == " (did you mean --save?)"
    assert did_you_mean("--mysave", ["--save"], ["--save"]) == ""
    assert did_you_mean("--mysave", ["--save"]) == " (did you mean --save?)"


# --------------------------------------------------------------------------- one round

def test_every_problem_of_a_command_line_is_in_one_report(no_launch, capsys):
    """Unknown flags, values that do not parse, a missing value, refused
    flags and invalid settings: one report, exit status 2, nothing started."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", *TINY, "--hiden-size", "8", "--lr", "fast", "--cache-mla-latents",
              "--kv-channels", "0", "--position-embedding-type", "relative", "-t", "3",
              "--pipeline-schedule"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == "ptdp train: error: 7 problems:"
    expected = ["unrecognized flag --hiden-size (did you mean --hidden-size?)",
                "--lr fast: not a number",
                "--position-embedding-type relative: T5's relative position buckets are not yet in",
                "--pipeline-schedule needs a value: choose from",
                "--cache-mla-latents: a cache of multi-latent attention",
                "--kv-channels=0 must be a positive integer",
                "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"]
    assert len(lines) == 1 + len(expected)
    for line, start in zip(lines[1:], expected):
        assert line.startswith("  - " + start), (line, start)


def test_one_problem_is_still_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["train", *TINY, "--position-embedding-type", "mrope"])
    err = capsys.readouterr().err
    assert err == ("ptdp train: error: --position-embedding-type mrope: the multimodal rotary "
                   "embedding (Qwen2-VL's) is not yet in ptdp: give --position-embedding-type rope "
                   "or learned_absolute\n")


@pytest.mark.parametrize("variables, prints", [
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, True),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, False)])
def test_under_torchrun_the_command_line_s_problems_are_said_once(variables, prints,
                                                                   rank_environment, capsys):
    """Each rank of a torchrun job parses the same command line: rank 0
    says what is wrong, the others exit with the same status silently (after
    it), and torchrun's summary carries the message instead of a traceback."""
    error_file = rank_environment(variables)
    with pytest.raises(SystemExit) as exit_:
        main(["train", *TINY, "--mtp-hsm", "--hiden-size", "8"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    if prints:
        assert err.startswith("ptdp train: error: 2 problems:") and "Traceback" not in err
    else:
        assert err == ""
    assert rank_environment.waits == ([] if prints else [QUIET_RANK_WAIT_SECONDS])
    record = json.loads(error_file.read_text())
    assert record["message"]["message"].startswith("ptdp train: error: 2 problems:")
    assert "--mtp-hsm: a variant of multi-token prediction" in record["message"]["message"]


# --------------------------------------------------------------------------- --lr-warmup-init

def test_lr_warmup_init_is_where_the_warm_up_starts():
    """Megatron-LM's OptimizerParamScheduler: init + (max - init) * step / warmup."""
    from ptdp.train.lr_schedule import LRSchedule

    config = config_from_args(_args("--lr", "1e-3", "--lr-warmup-init", "1e-4",
                                    "--lr-warmup-iters", "4", "--global-batch-size", "2",
                                    "--micro-batch-size", "2", "--train-iters", "10"))
    schedule = LRSchedule.from_config(config.train, 2)
    assert schedule.init_lr == 1e-4
    for step in range(0, 9, 2):  # samples: 4 iterations of 2
        assert schedule.lr(step) == pytest.approx(1e-4 + (1e-3 - 1e-4) * step / 8, rel=1e-12)
    with pytest.raises(ConfigError, match=r"--lr-warmup-init=-0.1 must be >= 0"):
        validate(config_from_args(_args("--lr-warmup-init", "-0.1")))


def test_lr_warmup_init_equals_megatron_lms_scheduler(megatron_scheduler):
    from ptdp.train.lr_schedule import LRSchedule

    for style in ("linear", "cosine", "WSD"):
        config = config_from_args(_args(
            "--lr", "3e-3", "--min-lr", "3e-5", "--lr-warmup-init", "2e-4",
            "--lr-warmup-iters", "5", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--train-iters", "30", "--lr-decay-style", style, "--lr-wsd-decay-iters", "10"))
        tr, batch = config.train, 4
        ours = LRSchedule.from_config(tr, batch)
        optimizer = types.SimpleNamespace(param_groups=[{}])
        theirs = megatron_scheduler.OptimizerParamScheduler(
            optimizer, init_lr=tr.lr_warmup_init, max_lr=tr.lr, min_lr=tr.min_lr,
            lr_warmup_steps=tr.lr_warmup_iters * batch, lr_decay_steps=tr.train_iters * batch,
            lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=tr.train_iters * batch,
            wd_incr_style="constant", wsd_decay_steps=tr.lr_wsd_decay_iters * batch,
            lr_wsd_decay_style=tr.lr_wsd_decay_style)
        for iteration in range(1, tr.train_iters + 1):
            theirs.step(increment=batch)
            assert ours.lr_after(iteration, iteration * batch) == optimizer.param_groups[0]["lr"], \
                (style, iteration)


@pytest.fixture(scope="module")
def megatron_scheduler(tmp_path_factory):
    """Megatron-LM's OptimizerParamScheduler from $PTDP_MEGATRON_REPO's HEAD
    (tests/test_megatron_schedules.py reads it the same way)."""
    from tests.test_megatron_schedules import _git_show, _import_source

    source = _git_show("HEAD:megatron/core/optimizer_param_scheduler.py")
    if source is None:
        pytest.skip("no Megatron-LM git checkout at $PTDP_MEGATRON_REPO")
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *args, **kwargs: None
    stand_ins = {"megatron": types.ModuleType("megatron"),
                 "megatron.core": types.ModuleType("megatron.core"), "megatron.core.utils": utils}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        return _import_source("megatron.core.optimizer_param_scheduler", source,
                              tmp_path_factory.mktemp("megatron"))
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# --------------------------------------------------------------------------- the list's script

def _regenerator():
    spec = importlib.util.spec_from_file_location(
        "megatron_flag_list_script", ROOT / "scripts" / "megatron_flag_list.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_reads_add_argument_calls_and_config_dataclasses(tmp_path):
    """A small Megatron-LM-shaped tree: flags from add_argument in the
    functions add_megatron_arguments reaches (not from others), --no-x for
    BooleanOptionalAction, and from a dataclass through ArgumentGroupFactory
    as argument_utils.py makes them (bases first, --no-/--disable- for a bool
    that is not False by default, argparse_meta's names, exclude, init=False)."""
    training = tmp_path / "megatron" / "training"
    (training / "config").mkdir(parents=True)
    (tmp_path / "megatron" / "post_training").mkdir()
    (training / "config" / "__init__.py").write_text(
        "from megatron.training.config.shapes import ShapeConfig\n")
    (training / "config" / "shapes.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass, field
        from typing import Optional

        @dataclass
        class Base:
            base_size: int = 1

        @dataclass
        class ShapeConfig(Base):
            hidden_size: int = 8
            use_thing: bool = False
            fused_thing: bool = True
            maybe_thing: Optional[bool] = None
            renamed: str = field(default="a", metadata={"argparse_meta": {"arg_names": ["--other-name"]}})
            internal: int = field(default=0, init=False)
            left_out: int = 3
        '''))
    (training / "arguments.py").write_text(textwrap.dedent('''
        import argparse
        from megatron.training.config import ShapeConfig

        def add_megatron_arguments(parser):
            parser = _add_sizes(parser)
            return parser

        def _add_sizes(parser):
            ArgumentGroupFactory(ShapeConfig, exclude=["left_out"]).build_group(parser, "shape")
            group = parser.add_argument_group(title="sizes")
            group.add_argument("--num-layers", type=int)
            group.add_argument("--toggle", action=argparse.BooleanOptionalAction)
            return parser

        def _never_called(parser):
            parser.add_argument("--dead-flag")
        '''))
    (tmp_path / "megatron" / "post_training" / "arguments.py").write_text(textwrap.dedent('''
        def add_modelopt_args(parser):
            parser.add_argument("--export-thing", action="store_true")
        '''))
    assert _regenerator().collect(tmp_path) == sorted([
        "--base-size", "--hidden-size", "--use-thing", "--no-fused-thing", "--disable-fused-thing",
        "--no-maybe-thing", "--disable-maybe-thing", "--other-name", "--num-layers", "--toggle",
        "--no-toggle", "--export-thing"])


def test_disable_bf16_reduced_precision_matmul_is_megatron_lms_setting():
    """Megatron-LM sets cuBLAS's allow_bf16_reduced_precision_reduction off."""
    import torch

    from ptdp import device
    assert config_from_args(_args("--disable-bf16-reduced-precision-matmul")).train \
        .disable_bf16_reduced_precision_matmul
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = True
        device.configure_matmul("cpu", True)
        assert matmul.allow_bf16_reduced_precision_reduction
        device.configure_matmul("cuda", False)
        assert matmul.allow_bf16_reduced_precision_reduction
        device.configure_matmul("cuda", True)
        assert not matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def test_megatron_fsdp_flags_of_the_deepseek_v3_script():
    """examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh's Megatron-FSDP
    flags: the buffer and initialisation choices are accepted with a line
    each; its bf16 gradient dtypes are ptdp's settings, as Megatron-FSDP
    means them: --megatron-fsdp-grad-comm-dtype bf16 is --grad-reduce-in-bf16
    (bf16 reductions), --megatron-fsdp-main-grads-dtype bf16 is
    --main-grads-dtype bf16 (bf16 gradient buffers, reduced in bf16)."""
    buffers = ["--fsdp-double-buffer", "--init-model-with-meta-device", "--use-nccl-ub",
               "--no-gradient-accumulation-fusion"]
    found = given(_args(*buffers, "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                        "optim_grads_params", "--megatron-fsdp-main-params-dtype", "fp32"))
    assert refusals(found) == []
    assert sorted(line.split(":")[1].split()[0] for line in notes(found)) == \
        sorted([*buffers, "--megatron-fsdp-main-params-dtype"])
    script = _args("--bf16", "--use-megatron-fsdp", "--megatron-fsdp-grad-comm-dtype", "bf16",
                   "--megatron-fsdp-main-grads-dtype", "bf16")
    assert refusals(given(script)) == []
    assert [line.split(":")[1].strip() for line in notes(given(script))] == [
        "--megatron-fsdp-grad-comm-dtype bf16", "--megatron-fsdp-main-grads-dtype bf16"]
    config = config_from_args(script)
    validate(config)
    assert config.train.grad_reduce_in_bf16 and config.train.main_grads_dtype == "bf16"
    # Each alone, and auto / fp32: ptdp's defaults.
    config = config_from_args(_args("--bf16", "--megatron-fsdp-grad-comm-dtype", "bf16"))
    assert config.train.grad_reduce_in_bf16 and config.train.main_grads_dtype == "fp32"
    config = config_from_args(_args("--bf16", "--megatron-fsdp-main-grads-dtype", "bf16"))
    assert not config.train.grad_reduce_in_bf16 and config.train.main_grads_dtype == "bf16"
    for value in ("fp32", "auto"):
        args = _args("--megatron-fsdp-grad-comm-dtype", value,
                     "--megatron-fsdp-main-grads-dtype", value)
        config = config_from_args(args)
        assert not refusals(given(args)) and len(notes(given(args))) == 2
        assert not config.train.grad_reduce_in_bf16 and config.train.main_grads_dtype == "fp32"


@pytest.mark.parametrize("flags, refusal", [
    ((("--megatron-fsdp-grad-comm-dtype", "fp16"),),
     "--megatron-fsdp-grad-comm-dtype fp16: fp16 reductions are not in ptdp"),
    ((("--megatron-fsdp-main-grads-dtype", "fp16"),),
     "--megatron-fsdp-main-grads-dtype fp16: ptdp's main gradients are fp32 or bf16"),
    # bf16 main gradients are reduced in bf16 (Megatron-FSDP's auto), not fp32.
    ((("--megatron-fsdp-main-grads-dtype", "bf16"), ("--megatron-fsdp-grad-comm-dtype", "fp32")),
     "--megatron-fsdp-grad-comm-dtype fp32: conflicts with --main-grads-dtype bf16: ptdp takes "
     "it as --main-grads-dtype fp32 (ptdp reduces bf16 main gradients in bf16"),
    ((("--megatron-fsdp-grad-comm-dtype", "fp32"), ("--grad-reduce-in-bf16",)),
     "--megatron-fsdp-grad-comm-dtype fp32: conflicts with --grad-reduce-in-bf16"),
    ((("--main-grads-dtype", "bf16"), ("--megatron-fsdp-main-grads-dtype", "fp32")),
     "--megatron-fsdp-main-grads-dtype fp32: conflicts with --main-grads-dtype bf16: it is "
     "Megatron-LM's other name for --main-grads-dtype fp32"),
    # Megatron-LM asserts fp32 main gradients with it.
    ((("--main-grads-dtype", "bf16"), ("--accumulate-allreduce-grads-in-fp32",)),
     "--accumulate-allreduce-grads-in-fp32: conflicts with --main-grads-dtype bf16"),
])
def test_gradient_dtypes_ptdp_cannot_honour_are_refused(flags, refusal):
    """In either order of the flags."""
    for order in (flags, flags[::-1]):
        [found] = refusals(given(_args("--bf16", *(word for flag in order for word in flag))))
        assert found.startswith(refusal), (order, found)


def test_main_grads_dtype_is_a_setting():
    """Megatron-LM's precision-aware optimizer flag, with or without
    --use-precision-aware-optimizer (ptdp's Adam reads bf16 as fp32)."""
    assert "--main-grads-dtype" not in {accepted.name for accepted in ACCEPTED}
    args = _args("--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16")
    assert config_from_args(args).train.main_grads_dtype == "bf16" and not refusals(given(args))
