"""`ptdp generate` from MoE checkpoints under expert parallelism, and a
context that outgrows the model's positions.

A random-weight transformers Qwen2-MoE (4 experts, top-2, a gated shared
expert, q/k/v biases, a dense layer among the MoE layers), imported with
`ptdp convert --from-hf`: greedy `ptdp generate --prompt-ids ... --output-ids`
gives transformers' greedy tokens on one process, at t = 2 with EP = 2
(ETP 1) over p = 2 stages (allgather dispatcher), and at t = 2, EP = 2 on
one stage (alltoall dispatcher). The odd prompt makes every other step's
context padded to a multiple of t. The layouts run on the session's pool of
four processes (the command line's launch replaced by it), so no job starts.
"""

import dataclasses

import pytest
import torch

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.generate import generate_text, request_grid
from ptdp.model.gpt import GPT
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext
from ptdp.checkpoint.store import load_logical_model, save_logical_model

transformers = pytest.importorskip("transformers")

PROMPT, NEW = [5, 17, 3, 60, 41], 8
EP_FLAGS = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """(checkpoint, the same weights with the alltoall dispatcher, transformers' greedy ids)."""
    folder = tmp_path_factory.mktemp("qwen2-moe")
    config = transformers.AutoConfig.for_model(
        "qwen2_moe", vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, moe_intermediate_size=8,
        shared_expert_intermediate_size=12, intermediate_size=16, mlp_only_layers=[1],
        qkv_bias=True, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation="eager").eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("gate.weight"):  # routers and the shared gate far from ties
                param.normal_(0.0, 1.0)
            elif name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT),
                                                                            dtype=torch.long),
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    hf.save_pretrained(str(folder / "hf"))
    checkpoint = folder / "ckpt"
    assert main(["convert", "--from-hf", str(folder / "hf"), "--save", str(checkpoint)]) == 0
    saved, weights, _ = load_logical_model(checkpoint)
    assert saved.model.moe_token_dispatcher_type == "allgather"
    alltoall = folder / "alltoall"
    save_logical_model(alltoall, dataclasses.replace(saved, model=dataclasses.replace(
        saved.model, moe_token_dispatcher_type="alltoall")), weights)
    return checkpoint, alltoall, ",".join(map(str, out[0, len(PROMPT):].tolist()))


def _generate_on_rank(rank, request):
    ctx = ParallelContext.build(request_grid(request))
    return None if ctx is None else generate_text(request, ctx, torch.device("cpu"))


def _generate(capsys, checkpoint, *flags) -> str:
    assert main(["generate", "--load", str(checkpoint), "--prompt-ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", str(NEW), "--temperature", "0", "--output-ids", *flags]) == 0
    out = capsys.readouterr()
    assert "ptdp: note" not in out.err  # the context fits the model's 32 positions
    return out.out.strip()


def test_greedy_tokens_equal_transformers_under_expert_parallel_layouts(qwen2_moe, pools, capsys,
                                                                       monkeypatch):
    checkpoint, alltoall, expected = qwen2_moe
    assert _generate(capsys, checkpoint) == expected
    launched = []

    def launch_on_the_pool(world, worker, request, **options):  # (preload: the pool has it)
        grid = request_grid(request)
        launched.append((world, grid.tp, grid.pp, grid.ep, grid.expert_tp))
        texts = pools(4).run(_generate_on_rank, request)[:world]
        assert texts == [texts[0]] * world  # every rank extends the same context
        print(texts[0])

    monkeypatch.setattr("ptdp.launch.launch_local", launch_on_the_pool)
    assert _generate(capsys, checkpoint, "-t", "2", "-p", "2", *EP_FLAGS) == expected
    assert _generate(capsys, alltoall, "-t", "2", *EP_FLAGS) == expected
    assert launched == [(4, 2, 2, 2, 1), (2, 2, 1, 2, 1)]


def _save_random(folder, **changes):
    """A one-process random-init MoE checkpoint (ptdp's own initialisation)."""
    model = ModelConfig(**{**dict(
        num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32,
        make_vocab_size_divisible_by=8, swiglu=True, ffn_hidden_size=16,
        disable_bias_linear=True, num_experts=4, moe_ffn_hidden_size=8), **changes})
    gpt = GPT(model, ParallelContext.single(), RNGStreams(torch.device("cpu"))).initialize(1)
    save_logical_model(folder, Config(model=model, data=DataConfig(mock_data=True)),
                       {name: p.detach() for name, p in gpt.named_parameters()})
    return str(folder)


def test_a_context_beyond_the_positions_gets_a_note_and_impossible_layouts_are_refused(
        tmp_path, capsys):
    moe = _save_random(tmp_path / "moe")
    # 6 + 5 tokens: the 4th new token is computed from the last 8 only, and said so.
    assert main(["generate", "--load", moe, "--prompt-ids", "1,2,3,4,5,6", "--max-new-tokens", "5",
                 "--temperature", "0", "--output-ids"]) == 0
    out = capsys.readouterr()
    assert len(out.out.strip().split(",")) == 5
    assert out.err == ("ptdp: note: the prompt's 6 tokens and up to 5 new ones exceed this model's "
                       "8 positions: from new token 4 on, the model sees only the last 8 tokens "
                       "(the prompt's oldest drop out first)\n")

    def refused(load, *flags) -> str:
        assert main(["generate", "--load", load, "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                     *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ptdp: error:") and "Traceback" not in err
        return " ".join(err.split())

    # EP · ETP must divide t (no data parallelism here); ETP is t unless given.
    assert ("--expert-model-parallel-size 2 × --expert-tensor-parallel-size 2 = 4 does not divide "
            "--tensor-model-parallel-size 2 × data-parallel size 1 = 2") in \
        refused(moe, "-t", "2", "--expert-model-parallel-size", "2")
    assert "use --expert-model-parallel-size in [1] or --expert-tensor-parallel-size in [1]" in \
        refused(moe, "-t", "2", "--expert-model-parallel-size", "2")
    assert "use --expert-model-parallel-size in [1]" in \
        refused(moe, "--expert-model-parallel-size", "2")
    assert "--data-parallel-size" not in refused(moe, "--expert-model-parallel-size", "2")
    dense = _save_random(tmp_path / "dense", num_experts=None, moe_ffn_hidden_size=None)
    assert ("--expert-model-parallel-size 2: expert parallelism is for MoE models, and this "
            "checkpoint's model has no experts (no --num-experts): drop it") in \
        refused(dense, "-t", "2", "--expert-model-parallel-size", "2")
    # Padding the context would change which tokens a capacity drops.
    capacity = _save_random(tmp_path / "capacity", moe_expert_capacity_factor=1.0)
    assert ("--expert-model-parallel-size 2 and --expert-tensor-parallel-size 1 with "
            "--tensor-model-parallel-size 2: this checkpoint's experts have a capacity "
            "(--moe-expert-capacity-factor 1.0)") in refused(capacity, "-t", "2", *EP_FLAGS)
    # A learned position table of 7 rows cannot hold a context padded to 8.
    odd = _save_random(tmp_path / "odd", seq_length=7)
    assert ("each step's context is padded to a multiple of t, and this model's 7 positions are "
            "not one: its last context, 7 tokens, would need 8 positions; give --max-new-tokens "
            "4 or fewer") in refused(odd, "-t", "2", *EP_FLAGS, "--max-new-tokens", "5")
