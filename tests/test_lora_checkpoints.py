"""LoRA checkpoints (issue 41, item 3): a run with --lora-rank saves its
adapters and their optimizer state only, with its base's identity; it
resumes exactly from them on the base they record (named again with
--pretrained-checkpoint, or found from the record), and refuses another
base, other adapter settings, or a full model given as --load."""

from __future__ import annotations

import json

import pytest

from ptdp.checkpoint.adapters import LORA_BASE
from ptdp.checkpoint.integrity import SEAL
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.cli import main

MODEL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "64", "--normalization", "RMSNorm", "--swiglu",
         "--ffn-hidden-size", "64", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-2", "--log-interval", "1"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1"]


def _train(folder, name: str, *extra: str) -> list[dict]:
    metrics = folder / f"{name}.jsonl"
    assert main(["train", *MODEL, "--metrics-file", str(metrics), *extra]) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bases")
    for name, seed in (("base", "1234"), ("other", "99")):
        _train(folder, name, "--train-iters", "2", "--seed", seed, "--save", str(folder / name))
    return folder / "base", folder / "other"


def test_adapters_save_alone_and_resume_exactly_on_their_base(bases, tmp_path, capsys):
    base, _ = bases
    straight = _train(tmp_path, "straight", *LORA, "--pretrained-checkpoint", str(base),
                      "--train-iters", "4", "--save", str(tmp_path / "straight"))
    first = _train(tmp_path, "first", *LORA, "--pretrained-checkpoint", str(base),
                   "--train-iters", "4", "--exit-interval", "2", "--save", str(tmp_path / "ad"))
    assert [r["iteration"] for r in first] == [1, 2]

    adapters = resolve(tmp_path / "ad")
    metadata = read_metadata(adapters)
    names = {name.split("/", 1)[1] for name in metadata["tensors"]}
    assert names and all(".lora." in name for name in names)
    assert any(name.startswith("optimizer/exp_avg/") for name in metadata["tensors"])
    base_metadata = read_metadata(resolve(base))
    record = metadata[LORA_BASE]
    assert record[SEAL] == base_metadata[SEAL] and record["iteration"] == 2
    adapter_bytes = sum(f.stat().st_size for f in adapters.glob("*.safetensors"))
    base_bytes = sum(f.stat().st_size for f in resolve(base).glob("*.safetensors"))
    assert adapter_bytes < base_bytes / 4

    # No --lora-* flag and no --pretrained-checkpoint: both from the adapters' record.
    second = _train(tmp_path, "second", "--train-iters", "4", "--load", str(tmp_path / "ad"),
                    "--save", str(tmp_path / "ad"))
    resumed = first + second
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed, straight):
        assert got["loss"] == want["loss"], got["iteration"]  # bitwise, dropout included
    assert "resumed from" in capsys.readouterr().out


def _refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    return " ".join(capsys.readouterr().err.split())


def test_adapters_refuse_another_base_and_other_settings(bases, tmp_path, capsys):
    base, other = bases
    _train(tmp_path, "ad", *LORA, "--pretrained-checkpoint", str(base), "--train-iters", "1",
           "--save", str(tmp_path / "ad"))
    resume = ["train", *MODEL, "--train-iters", "1", "--load", str(tmp_path / "ad")]
    said = _refused([*resume, "--pretrained-checkpoint", str(other)], capsys)
    assert "holds adapters for another base model: they were trained on" in said
    assert "give that base as --pretrained-checkpoint" in said
    said = _refused([*resume, "--lora-rank", "8", "--lora-alpha", "8", "--lora-dropout", "0.1"],
                    capsys)
    assert "holds other adapters: --lora-rank: checkpoint 4, requested 8" in said
    said = _refused(["train", *MODEL, *LORA, "--train-iters", "3", "--load", str(base)], capsys)
    assert "holds a full model, not LoRA adapters: to train adapters on it, give it as " \
           "--pretrained-checkpoint" in said


@pytest.mark.parametrize("argv, message", [
    (["--lora-target-modules", "linear_q"], "'linear_q' matches no layer of this model"),
    (["--lora-target-modules", "*.layers.7.*"], "'*.layers.7.*' matches no layer"),
    (["--lora-rank", "40"], "--lora-rank 40 is larger than"),
    (["--decoupled-lr", "1e-3"], "--lora-rank freezes them"),
    (["--lora-rank", "0", "--lora-dropout", "0.1"], "--lora-dropout set without adapters"),
    (["--lora-alpha", "0"], "--lora-alpha must be a positive number"),
    (["--lora-share-expert-adapters"], "no routed expert's layer is adapted"),
])
def test_bad_lora_settings_are_refused_before_launch(argv, message, capsys):
    said = _refused(["train", *MODEL, "--lora-rank", "4", "--train-iters", "1", *argv], capsys)
    assert message in said


# ------------------------------------------------------------------ merging, generation

def _generate_at_t2(rank: int, load: str, base: str) -> list[int]:
    """Greedy ids from adapters on their base under t = 2 (a pool's two ranks)."""
    import torch

    from ptdp.generate import GenerateRequest, generate_text
    from ptdp.parallel.topology import ParallelContext, RankGrid
    from ptdp.sampling import SamplingSettings

    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=1))
    request = GenerateRequest(load, [3, 17, 9, 40], SamplingSettings(temperature=0.0,
                                                                     max_new_tokens=6),
                              tensor_parallel=2, output_ids=True, pretrained=base)
    try:
        return [int(i) for i in generate_text(request, ctx, torch.device("cpu")).split(",")]
    finally:
        ctx.destroy()


def test_merged_adapters_compute_base_plus_adapters_and_generate_alike(bases, tmp_path, capfd,
                                                                      pools):
    """--merge-lora writes W + (α/R)·B A: its logits equal those of the base
    with its adapters attached (the model training runs) within 1e-5, and
    `ptdp generate` gives the same tokens from the adapters on their base
    (one process and t = 2) as from the merged checkpoint."""
    import torch

    from ptdp.generate import PipelinedModel, read_checkpoint_model
    from ptdp.parallel.topology import ParallelContext

    base, _ = bases
    _train(tmp_path, "ad", *LORA, "--pretrained-checkpoint", str(base), "--train-iters", "3",
           "--save", str(tmp_path / "ad"))
    assert main(["convert", "--merge-lora", "--load", str(tmp_path / "ad"),
                 "--save", str(tmp_path / "merged")]) == 0
    assert "adapters of rank 4 merged" in capfd.readouterr().out

    prompt = torch.tensor([[3, 17, 9, 40, 2, 33]])
    ctx, cpu = ParallelContext.single(), torch.device("cpu")

    def logits(load: str) -> torch.Tensor:
        config, weights = read_checkpoint_model(load)
        return PipelinedModel(config, ctx, cpu, weights)(prompt)

    adapted, merged = logits(str(tmp_path / "ad")), logits(str(tmp_path / "merged"))
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
    assert (logits(str(base)) - adapted).abs().max() > 1e-3  # the adapters did train

    def generated(load, *layout: str) -> str:
        capfd.readouterr()
        assert main(["generate", "--load", str(load), "--prompt-ids", "3,17,9,40",
                     "--max-new-tokens", "6", "--temperature", "0", "--output-ids",
                     *layout]) == 0
        return capfd.readouterr().out.strip().splitlines()[-1]

    want = generated(tmp_path / "merged")
    assert generated(tmp_path / "ad") == want
    # t = 2 (two ranks of the test pool), the base named
    ids = [int(i) for i in want.split(",")]
    assert pools(2).run(_generate_at_t2, str(tmp_path / "ad"), str(base)) == [ids, ids]


def test_adapters_reshard_to_another_layout(bases, tmp_path):
    """Adapters saved at d = 2 under ZeRO-3 (the frozen base loaded into
    its shards) resume under t = 2 with sequence parallelism (column
    adapters' B split by the q/k/v and gate/up blocks, row adapters' A by
    columns) as the one-process run that never stopped continues."""
    base, _ = bases
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--pretrained-checkpoint", str(base),
            "--hidden-dropout", "0", "--attention-dropout", "0"]  # (no stream to match)
    straight = _train(tmp_path, "straight", *lora, "--train-iters", "4")
    first = _train(tmp_path, "first", *lora, "--train-iters", "4", "--exit-interval", "2",
                   "--save", str(tmp_path / "ad"), "--data-parallel-size", "2",
                   "--use-megatron-fsdp")
    assert [r["loss"] for r in first] == pytest.approx([r["loss"] for r in straight[:2]],
                                                       rel=1e-5)
    resumed = _train(tmp_path, "t2", "--train-iters", "4", "--load", str(tmp_path / "ad"),
                     "--tensor-model-parallel-size", "2", "--sequence-parallel", *lora[6:])
    assert [r["iteration"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, straight[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), got["iteration"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), got["iteration"]


def test_expert_adapters_saved_under_expert_parallelism_resume_in_one_process(tmp_path):
    """An MoE model's adapters (each routed expert's on its expert-parallel
    rank) saved at d = 2 with EP = 2 resume in one process as a run that
    never stopped continues."""
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5"]
    straight = _train(tmp_path, "straight", *moe, *LORA[:4], "--train-iters", "4")
    _train(tmp_path, "first", *moe, *LORA[:4], "--train-iters", "4", "--exit-interval", "2",
           "--data-parallel-size", "2", "--expert-model-parallel-size", "2",
           "--save", str(tmp_path / "ad"))
    metadata = read_metadata(resolve(tmp_path / "ad"))
    assert {f"model/layers.1.mlp.experts.{e}.dense_h_to_4h.lora.B" for e in range(4)} \
        <= set(metadata["tensors"])
    resumed = _train(tmp_path, "one", *moe, "--train-iters", "4", "--load", str(tmp_path / "ad"))
    for got, want in zip(resumed, straight[2:]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), got["iteration"]
