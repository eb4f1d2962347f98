"""The rotary variants (ptdp/model/rotary.py, ptdp/model/yarn.py): YaRN
(--position-embedding-type yarn with Megatron-LM's --rotary-scaling-factor,
--yarn-*, --mscale, --mscale-all-dim), partial rotation (--rotary-percent),
linear interpolation (--rotary-seq-len-interpolation-factor, also against
Megatron-Core's positions / F) and Gemma 3's second base for sliding-window
layers (--rotary-base-local),
against transformers' own rope initialisation and rotation; the rotation at
given positions (context parallelism, packed documents) against the whole
sequence's rows; a one-process GPT with them; their refused values."""

import pytest
import torch

from ptdp.checkpoint.args import CHECKPOINT_ARCHITECTURE
from ptdp.cli import build_parser
from ptdp.commands.train import config_from_args
from ptdp.config import ConfigError, ModelConfig, validate
from ptdp.model.gpt import GPT
from ptdp.model.rotary import Rotary, rotary_for
from ptdp.model.yarn import YarnScaling
from ptdp.parallel.context_layout import rank_positions
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--vocab-size", "64", "--seq-length", "16", "--train-iters", "1"]
GPT_OSS_FLAGS = ["--position-embedding-type", "yarn", "--rotary-base", "150000",
                 "--rotary-scaling-factor", "32", "--yarn-beta-fast", "32", "--yarn-beta-slow", "1",
                 "--yarn-original-max-position-embeddings", "4096",
                 "--no-yarn-correction-range-round-to-int"]
CPU = torch.device("cpu")


def _config(*flags):
    return config_from_args(build_parser().parse_args(["train", *TINY, *flags]))


# (Hugging Face rope_parameters, head width, ptdp's YarnScaling, rotary percent)
SETTINGS = {
    "gpt-oss": ({"rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "original_max_position_embeddings": 4096, "truncate": False},
                64, YarnScaling(32.0, 4096, 32.0, 1.0, round_to_int=False), 1.0),
    "defaults-rounded": ({"rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 2048},
                         128, YarnScaling(4.0, 2048), 1.0),
    "deepseek-mscale": ({"rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                         "mscale_all_dim": 0.5, "beta_fast": 24.0, "beta_slow": 2.0,
                         "original_max_position_embeddings": 4096},
                        64, YarnScaling(40.0, 4096, 24.0, 2.0, 0.707, 0.5), 1.0),
    # Kimi K2's published YaRN: equal betas, a step instead of a ramp
    "equal-betas": ({"rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096},
                    64, YarnScaling(32.0, 4096, 1.0, 1.0), 1.0),
    "partial": ({"rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 1024,
                 "partial_rotary_factor": 0.25},
                64, YarnScaling(8.0, 1024), 0.25),
}


def _neox(parameters: dict, head_dim: int):
    """A GPT-NeoX config (its rotation pairs halves of the first
    partial_rotary_factor·d dimensions, ptdp's convention) with YaRN."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(hidden_size=2 * head_dim, num_attention_heads=2,
                         max_position_embeddings=32768,
                         rope_parameters={"rope_type": "yarn", "partial_rotary_factor": 1.0,
                                          **parameters})  # (GPT-NeoX's default is 0.25)


@pytest.mark.parametrize("name", SETTINGS)
def test_yarn_frequencies_and_attention_factor_are_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters, d, yarn, percent = SETTINGS[name]
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](_neox(parameters, d), "cpu")
    rotary = Rotary(d, parameters["rope_theta"], rotary_percent=percent, yarn=yarn)
    ours = rotary.inverse_frequencies(CPU)
    assert ours.shape == expected.shape == (int(d * percent) // 2,)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-7, atol=0.0)
    assert rotary.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    # Not plain rope: some pairs are slowed, the fastest kept, the factor above 1.
    plain = Rotary(d, parameters["rope_theta"], rotary_percent=percent).inverse_frequencies(CPU)
    assert (ours < plain * 0.999).any() and ours[0] == plain[0] and attention_factor > 1


@pytest.mark.parametrize("name", SETTINGS)
def test_rotated_queries_and_keys_are_transformers(name):
    """ptdp's rotation of q and k against GPT-NeoX's apply_rotary_pos_emb
    with its rotary embedding's cos/sin (attention factor included)."""
    from transformers.models.gpt_neox.modeling_gpt_neox import (GPTNeoXRotaryEmbedding,
                                                                apply_rotary_pos_emb)

    parameters, d, yarn, percent = SETTINGS[name]
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 3, 40, d, generator=generator)  # [b, heads, s, d] each
    position_ids = torch.arange(40).expand(2, 40)
    cos, sin = GPTNeoXRotaryEmbedding(_neox(parameters, d))(q, position_ids)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    rotary = Rotary(d, parameters["rope_theta"], rotary_percent=percent, yarn=yarn)
    torch.testing.assert_close(rotary(q), expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary(k), expected_k, rtol=1e-5, atol=1e-5)
    width = int(d * percent)
    assert torch.equal(rotary(q)[..., width:], q[..., width:])  # the rest passes unchanged


def test_gemma3_local_and_global_rotations_are_transformers():
    """--rotary-base-local: the sliding-window layers turn at that base
    unscaled, the others with YaRN, as Gemma 3's two rope types."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    hf = Gemma3TextConfig(
        hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=2,
        num_key_value_heads=4, vocab_size=64, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
                                            "original_max_position_embeddings": 1024},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    config = _config("--position-embedding-type", "yarn", "--rotary-base", "1e6",
                     "--rotary-scaling-factor", "8", "--yarn-original-max-position-embeddings",
                     "1024", "--rotary-base-local", "1e4", "--kv-channels", "8").model
    validate(_config("--position-embedding-type", "yarn", "--rotary-base-local", "1e4"))
    x = torch.zeros(1, 12, 32)
    for layer_type, local in (("sliding_attention", True), ("full_attention", False)):
        cos, sin = Gemma3RotaryEmbedding(hf)(x, torch.arange(12)[None], layer_type)
        ours = rotary_for(config, local=local).tables(12, CPU, torch.float32)
        torch.testing.assert_close(ours, (cos[0], sin[0]), rtol=1e-6, atol=1e-6)
    assert rotary_for(config, local=True).yarn is None and rotary_for(config).yarn is not None
    plain = _config("--position-embedding-type", "yarn").model  # no local base: one rotation
    assert rotary_for(plain, local=True).yarn == rotary_for(plain).yarn


def test_linear_interpolation_is_megatrons_and_transformers():
    """--rotary-seq-len-interpolation-factor F: the angle at position p is
    plain rope's at p / F (Megatron-Core's RotaryEmbedding multiplies the
    positions by 1 / F), the frequencies transformers' rope_type 'linear';
    with --rotary-base-local the sliding-window layers are not interpolated,
    without it every layer is (one rotation, as Megatron-LM)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    flags = ["--position-embedding-type", "rope", "--rotary-base", "500",
             "--rotary-seq-len-interpolation-factor", "3"]
    validate(_config(*flags))
    rotary = rotary_for(_config(*flags).model)
    positions = torch.arange(40, dtype=torch.float32)
    angles = torch.outer(positions * (1 / 3), Rotary(8, 500.0).inverse_frequencies(CPU))
    cos, sin = rotary.tables(40, CPU, torch.float32)
    torch.testing.assert_close((cos, sin), (torch.cat([angles.cos()] * 2, -1),
                                            torch.cat([angles.sin()] * 2, -1)),
                               rtol=0, atol=1e-6)
    linear = LlamaConfig(hidden_size=32, num_attention_heads=4, rope_parameters={
        "rope_type": "linear", "factor": 3.0, "rope_theta": 500.0})
    expected, _ = ROPE_INIT_FUNCTIONS["linear"](linear, "cpu")
    torch.testing.assert_close(rotary.inverse_frequencies(CPU), expected, rtol=0, atol=0)
    # the sliding-window layers: their own base unscaled, else the same rotation
    local = _config(*flags, "--rotary-base-local", "1e4").model
    assert rotary_for(local, local=True).inverse_frequencies(CPU).equal(
        Rotary(8, 1e4).inverse_frequencies(CPU))
    assert rotary_for(local).interpolation_factor == 3.0
    assert rotary_for(_config(*flags).model, local=True).inverse_frequencies(CPU).equal(
        rotary.inverse_frequencies(CPU))
    # --use-checkpoint-args takes and compares it (an imported Gemma 3 keeps it)
    views = {fields[0]: view for fields, view in CHECKPOINT_ARCHITECTURE}
    view = views["rotary_seq_len_interpolation_factor"]
    assert (view(local), view(ModelConfig())) == (3.0, None)


@pytest.mark.parametrize("context_size", [2, 4])
def test_rotation_at_given_positions_is_the_whole_sequences_rows(context_size):
    """Under context parallelism a rank rotates its own positions
    (rank_positions); packed documents give positions per token: both equal
    the whole sequence's rotation at those rows."""
    rotary = Rotary(16, 10000.0, rotary_percent=0.5, yarn=YarnScaling(16.0, 64, round_to_int=False))
    s = 8 * context_size
    x = torch.randn(2, 3, s, 16, generator=torch.Generator().manual_seed(1))
    whole = rotary(x)
    for rank in range(context_size):
        own = rank_positions(s, context_size, rank, CPU)
        torch.testing.assert_close(rotary(x[:, :, own], (context_size, rank)), whole[:, :, own],
                                   rtol=0, atol=1e-6)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 0, 1, 0, 1, 2]])
    tokens = torch.stack([x[b, :, positions[b]] for b in range(2)])  # each at its position
    rows = torch.stack([whole[b, :, positions[b]] for b in range(2)])
    torch.testing.assert_close(rotary(tokens, positions=positions), rows, rtol=0, atol=1e-6)


def test_a_gpt_with_yarn_and_partial_rotation_runs_and_uses_them():
    """One process: the flags reach every layer's rotation, and the logits
    differ from the same weights under plain rope."""
    yarn = _config(*GPT_OSS_FLAGS, "--rotary-percent", "0.5").model
    validate(_config(*GPT_OSS_FLAGS, "--rotary-percent", "0.5"))
    models = {}
    for name, config in (("yarn", yarn), ("rope", ModelConfig(**{
            **vars(yarn), "position_embedding_type": "rope", "rotary_scaling_factor": 1.0,
            "yarn_correction_range_round_to_int": True}))):
        torch.manual_seed(0)
        models[name] = GPT(config, ParallelContext.single(), RNGStreams(CPU)).initialize(0).eval()
    models["rope"].load_state_dict(models["yarn"].state_dict())
    rotation = models["yarn"].layers["0"].attention.rotary
    assert (rotation.width, rotation.head_dim) == (4, 8)
    assert rotation.yarn == YarnScaling(32.0, 4096, 32.0, 1.0, 1.0, 0.0, False)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = {name: model(tokens)[..., :64] for name, model in models.items()}  # unpadded
    assert logits["yarn"].shape == (16, 2, 64) and torch.isfinite(logits["yarn"]).all()
    assert not torch.allclose(logits["yarn"], logits["rope"])


@pytest.mark.parametrize("flags, says", [
    (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0.5"],
     "--rotary-scaling-factor=0.5 must be at least 1"),
    (["--position-embedding-type", "yarn", "--yarn-beta-fast", "1", "--yarn-beta-slow", "2"],
     "must satisfy 0 < beta_slow <= beta_fast"),
    (["--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "0"],
     "--yarn-original-max-position-embeddings=0 must be a positive integer"),
    (["--position-embedding-type", "yarn", "--use-rope-scaling"], "give one of them"),
    (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "32", "--mscale-all-dim",
      "-10"], "which must be a positive ratio of positive numbers"),
    (["--position-embedding-type", "rope", "--yarn-beta-fast", "16",
      "--no-yarn-correction-range-round-to-int"],
     "--yarn-beta-fast 16.0, --no-yarn-correction-range-round-to-int: YaRN's settings act only "
     "with --position-embedding-type yarn"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.375"],
     "rotates int(0.375·8) = 3 dimensions, which must be an even number"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "must be in (0, 1]"),
    (["--rotary-percent", "0.5"], "but the model has --position-embedding-type learned_absolute"),
    (["--position-embedding-type", "rope", "--rotary-base-local", "0"],
     "--rotary-base-local=0.0 must be > 0"),
    (["--rotary-base-local", "10000"], "is the sliding-window layers' rotary base, but"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0"],
     "--rotary-seq-len-interpolation-factor=0.0 must be > 0"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "inf"],
     "--rotary-seq-len-interpolation-factor=inf is not a finite number"),
    (["--rotary-seq-len-interpolation-factor", "8"],
     "divides the rotary embeddings' positions, but the model has --position-embedding-type "
     "learned_absolute"),
    (["--position-embedding-type", "yarn", "--rotary-seq-len-interpolation-factor", "8"],
     "--rotary-seq-len-interpolation-factor 8 and --position-embedding-type yarn both rescale"),
    (["--position-embedding-type", "rope", "--use-rope-scaling",
      "--rotary-seq-len-interpolation-factor", "8"],
     "and --use-rope-scaling (Llama 3.1's rescaling) both rescale"),
])
def test_bad_rotary_settings_are_one_paragraph_each(flags, says):
    with pytest.raises(ConfigError) as raised:
        validate(_config(*flags))
    problems = raised.value.problems
    assert len(problems) == 1 and says in problems[0], problems
    assert any(word in problems[0] for word in ("give", "add", "drop", "must", "use", "choose"))


def test_megatron_lms_yarn_defaults_and_flags():
    """The settings' defaults are Megatron-LM's (its YarnRotaryEmbedding's,
    which its parser's None stands for); the flags set them."""
    default = ModelConfig()
    assert (default.rotary_scaling_factor, default.yarn_original_max_position_embeddings,
            default.yarn_beta_fast, default.yarn_beta_slow, default.mscale,
            default.mscale_all_dim, default.yarn_correction_range_round_to_int,
            default.rotary_base_local, default.rotary_seq_len_interpolation_factor) \
        == (1.0, 4096, 32.0, 1.0, 1.0, 0.0, True, None, None)
    model = _config(*GPT_OSS_FLAGS, "--mscale", "0.5", "--mscale-all-dim", "0.25").model
    assert model.yarn and model.rope and not model.yarn_correction_range_round_to_int
    assert rotary_for(model).yarn == YarnScaling(32.0, 4096, 32.0, 1.0, 0.5, 0.25, False)
    # --use-checkpoint-args takes and compares them (only under yarn).
    views = {fields[0]: view for fields, view in CHECKPOINT_ARCHITECTURE}
    assert (views["mscale"](model), views["yarn_correction_range_round_to_int"](model),
            views["rotary_scaling_factor"](model)) == (0.5, False, 32.0)
    assert views["mscale"](default) is None and views["rotary_base_local"](default) is None
