"""Megatron-LM flags without a setting of their own (ptdp/megatron_flags.py)
and the shape flags whose other values ptdp refuses: each accepted flag is
explained in one line before the run, each refused one is reported with the
other problems, before any process starts."""

import pytest

from ptdp.cli import build_parser, config_from_args, main
from ptdp.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from ptdp.megatron_flags import ACCEPTED, attention_kernel, given, notes, refusals

TINY = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "64", "--seq-length", "16", "--train-iters", "1"]


def _args(*flags):
    return build_parser().parse_args(["train", *TINY, *flags])


def test_each_accepted_flag_parses_and_is_explained_or_refused():
    for accepted in ACCEPTED:
        value = "16" if accepted.alias_of else (accepted.choices or ("x",))[0]  # TINY's length
        flags = [accepted.name] if accepted.values == 0 else [accepted.name, value]
        found = given(_args(*flags))
        assert [a.name for a, _ in found] == [accepted.name]
        if accepted.refused:
            assert refusals(found) and not notes(found)
            assert refusals(found)[0].startswith(" ".join(flags) + ": ")
        elif accepted.alias_of:
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
                    "--rotary-percent 0.5: ptdp rotates the whole of each head"):
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


def test_log_params_norm_and_num_zeros_are_settings():
    config = config_from_args(_args("--log-params-norm", "--log-num-zeros-in-grad"))
    assert config.train.log_params_norm and config.train.log_num_zeros_in_grad


def test_tiktoken_flags_for_another_tokenizer_are_noted():
    from ptdp.megatron_flags import config_notes

    config = config_from_args(_args("--tiktoken-pattern", "v2"))
    assert config.data.tiktoken_pattern == "v2"
    assert config_notes(config) == ["ptdp: --tiktoken-pattern v2 has no effect: only "
                                    "--tokenizer-type TikTokenizer reads it, not the "
                                    "GPT2BPETokenizer"]


def test_pretrained_checkpoint_is_a_fine_tune_only_without_a_checkpoint_to_resume(tmp_path):
    """Megatron-LM's --pretrained-checkpoint: the weights to start from when
    --load has nothing to resume; a checkpoint in --load is resumed instead."""
    from ptdp.cli import _pretrained_checkpoint

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
