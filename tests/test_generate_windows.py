"""`ptdp generate` from models with sliding windows (issue 43), against
transformers' own greedy `generate` (its cache keeps each layer's window)
for 20 tokens, the context growing well past the window:

* Qwen2 whose layers 1-3 see the 4 most recent keys (use_sliding_window,
  max_window_layers 1) and layer 0 the whole context;
* Mistral with a window of 4 on every layer;
* Gemma 3 (text): five local layers then a global one, two rotary bases,
  sandwich norms, GeGLU, a query pre-attention scalar;
* gpt-oss: alternating windows, learnable sinks, experts with biases and the
  clamped SwiGLU, YaRN.

Each random-weight model is imported with `ptdp convert --from-hf` and gives
transformers' tokens on one process and at t = 2, p = 2; gpt-oss also at
t = 2 with EP = 2 over p = 2 stages. The layouts run on the session's pool of
four processes (the command line's launch replaced by it), as
tests/test_generate_moe.py's do."""

import pytest
import torch

from ptdp.checkpoint.store import load_logical_model
from ptdp.cli import main
from tests.test_generate_moe import EP_FLAGS, _generate_on_rank
from tests.test_hf_gemma3 import HF_FIELDS as GEMMA_FIELDS
from tests.test_hf_gemma3 import S, F
from tests.test_hf_gpt_oss import _hf_config as gpt_oss_config
from tests.test_hf_gpt_oss import _hf_model as gpt_oss_model

transformers = pytest.importorskip("transformers")

PROMPT, NEW = [5, 17, 3, 60, 41], 20
SMALL = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)


def _sharpened(model):
    """Biases and norms away from 0 and 1, and sharp attention, so that where
    each position looks shows in the tokens."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)
    return model


def _qwen2():
    torch.manual_seed(5)
    config = transformers.Qwen2Config(**SMALL, num_hidden_layers=4, intermediate_size=48,
                                      rms_norm_eps=1e-5, use_sliding_window=True,
                                      sliding_window=4, max_window_layers=1)
    return _sharpened(transformers.AutoModelForCausalLM.from_config(config)), \
        [False, True, True, True]


def _mistral():
    torch.manual_seed(6)
    config = transformers.MistralConfig(**SMALL, num_hidden_layers=4, intermediate_size=40,
                                        rms_norm_eps=1e-5, sliding_window=4, head_dim=16)
    return _sharpened(transformers.AutoModelForCausalLM.from_config(config)), [True] * 4


def _gemma3():
    torch.manual_seed(7)
    fields = {**GEMMA_FIELDS, "vocab_size": 97, "num_hidden_layers": 6,
              "layer_types": [S] * 5 + [F]}
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1 + (1.0 if "_norm" in name else 0.0))
    return model, [True] * 5 + [False]


def _gpt_oss():
    config = gpt_oss_config(vocab_size=97, num_hidden_layers=4, num_local_experts=4,
                            sliding_window=4, layer_types=[S, F, S, F])
    return gpt_oss_model(config, seed=8), [True, False, True, False]


FAMILIES = {"qwen2": (_qwen2, ()), "mistral": (_mistral, ()), "gemma3": (_gemma3, ()),
            "gpt-oss": (_gpt_oss, (EP_FLAGS,))}


@pytest.fixture(scope="module", params=list(FAMILIES))
def windowed(request, tmp_path_factory):
    """(checkpoint, transformers' greedy ids after the prompt, extra layouts' flags)."""
    build, extra_layouts = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf, windowed_layers = build()
    hf = hf.eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT),
                                                                            dtype=torch.long),
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    hf.save_pretrained(str(folder / "hf"))
    checkpoint = folder / "ckpt"
    assert main(["convert", "--from-hf", str(folder / "hf"), "--save", str(checkpoint)]) == 0
    saved = load_logical_model(checkpoint)[0].model
    assert saved.window == (3, 0) and saved.windowed_layers == windowed_layers
    return checkpoint, ",".join(map(str, out[0, len(PROMPT):].tolist())), extra_layouts


def _generate(capsys, checkpoint, *flags) -> str:
    assert main(["generate", "--load", str(checkpoint), "--prompt-ids", ",".join(map(str, PROMPT)),
                 "--max-new-tokens", str(NEW), "--temperature", "0", "--output-ids", *flags]) == 0
    return capsys.readouterr().out.strip()


def test_greedy_tokens_equal_transformers_with_windows_under_layouts(windowed, pools, capsys,
                                                                     monkeypatch):
    checkpoint, expected, extra_layouts = windowed
    assert len(expected.split(",")) == NEW
    assert _generate(capsys, checkpoint) == expected

    def launch_on_the_pool(world, worker, request, **options):
        texts = pools(4).run(_generate_on_rank, request)[:world]
        assert texts == [texts[0]] * world
        print(texts[0])

    monkeypatch.setattr("ptdp.launch.launch_local", launch_on_the_pool)
    for flags in [(), *extra_layouts]:
        assert _generate(capsys, checkpoint, "-t", "2", "-p", "2", *flags) == expected
