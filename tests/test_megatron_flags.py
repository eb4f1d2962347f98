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
        flags = [accepted.name] if accepted.values == 0 else \
            [accepted.name, (accepted.choices or ("x",))[0]]
        found = given(_args(*flags))
        assert [a.name for a, _ in found] == [accepted.name]
        if accepted.refused:
            assert refusals(found) and not notes(found)
            assert refusals(found)[0].startswith(" ".join(flags) + ": ")
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
                 "--context-parallel-size", "2", "--kv-channels", "4", "--rotary-percent", "0.5"])
    err = capsys.readouterr().err
    assert code == 2
    for problem in ("--fp8-format hybrid: FP8 training needs Transformer Engine",
                    "--ckpt-format torch_dist: ptdp writes and reads its own checkpoint format",
                    "--context-parallel-size 2: ptdp has no context parallelism",
                    "--kv-channels 4: ptdp's attention heads are --hidden-size / "
                    "--num-attention-heads = 32 / 4 = 8 wide: use --kv-channels 8",
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
