"""`ptdp generate` from a model with sliding windows (issue 43): a
random-weight transformers Qwen2 whose layers 1-3 see the 4 most recent
keys (use_sliding_window, max_window_layers 1) and layer 0 the whole
context, imported with `ptdp convert --from-hf`: greedy `ptdp generate`
gives transformers' greedy 20 tokens (its own cache keeps the window) on
one process and at t = 2, p = 2, the context growing well past the window.
The layout runs on the session's pool of four processes (the command
line's launch replaced by it), as tests/test_generate_moe.py's do."""

import pytest
import torch

from ptdp.checkpoint.store import load_logical_model
from ptdp.cli import main
from tests.test_generate_moe import _generate_on_rank

transformers = pytest.importorskip("transformers")

PROMPT, NEW = [5, 17, 3, 60, 41], 20


@pytest.fixture(scope="module")
def windowed_qwen2(tmp_path_factory):
    """(checkpoint, transformers' greedy ids after the prompt)."""
    folder = tmp_path_factory.mktemp("qwen2-window")
    config = transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
        rms_norm_eps=1e-5, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)  # sharp attention: where each position looks shows
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT),
                                                                            dtype=torch.long),
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    hf.save_pretrained(str(folder / "hf"))
    checkpoint = folder / "ckpt"
    assert main(["convert", "--from-hf", str(folder / "hf"), "--save", str(checkpoint)]) == 0
    saved = load_logical_model(checkpoint)[0].model
    assert saved.window == (3, 0) and saved.windowed_layers == [False, True, True, True]
    return checkpoint, ",".join(map(str, out[0, len(PROMPT):].tolist()))


def _generate(capsys, checkpoint, *flags) -> str:
    assert main(["generate", "--load", str(checkpoint), "--prompt-ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", str(NEW), "--temperature", "0", "--output-ids", *flags]) == 0
    return capsys.readouterr().out.strip()


def test_greedy_tokens_equal_transformers_with_windows_under_a_layout(windowed_qwen2, pools,
                                                                      capsys, monkeypatch):
    checkpoint, expected = windowed_qwen2
    assert len(expected.split(",")) == NEW
    assert _generate(capsys, checkpoint) == expected

    def launch_on_the_pool(world, worker, request, **options):
        texts = pools(4).run(_generate_on_rank, request)[:world]
        assert texts == [texts[0]] * world
        print(texts[0])

    monkeypatch.setattr("ptdp.launch.launch_local", launch_on_the_pool)
    assert _generate(capsys, checkpoint, "-t", "2", "-p", "2") == expected
