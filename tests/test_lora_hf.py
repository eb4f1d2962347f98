"""LoRA against peft on converted Hugging Face models (issue 41's outside
reference), for a Llama 3.1 (llama3 rope scaling) and a Qwen3-MoE model
imported with `ptdp convert --from-hf`, adapters on attention, the MLP and
every routed expert:

- ptdp's adapted model (the base with its adapters attached, as training
  runs it) gives the logits peft gives with the same adapters, written by
  ptdp's PEFT export and loaded by peft.PeftModel.from_pretrained on the
  Hugging Face model, within 1e-5;
- the first step's loss is peft's, and every adapter gradient is what
  peft's gradients give through the export's (linear) map from ptdp's
  adapters to peft's: q, k and v share ptdp's A, so its gradient is the
  sum of theirs, B's rows are theirs, each expert's slice of the fused
  experts' LoRA is its own;
- an adapter trained in peft (its own A for each of q, k, v), imported with
  `ptdp convert --from-hf-peft`, gives ptdp peft's logits; exported again
  with `--to-hf-peft` it gives them in peft.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from ptdp.checkpoint.store import load_logical_model  # noqa: E402
from ptdp.cli import main  # noqa: E402
from ptdp.config.lora import LoRAConfig  # noqa: E402
from ptdp.interop.hf_peft import save_peft_directory, to_peft  # noqa: E402
from ptdp.model.adapters import adapter_shapes  # noqa: E402
from ptdp.model.gpt import build_chunks  # noqa: E402
from ptdp.parallel.sharding import SHARD_ATTR, shard  # noqa: E402
from ptdp.parallel.topology import ParallelContext  # noqa: E402
from tests.test_hf_peft import SMALL, _hf_model  # noqa: E402

TOLERANCE = 1e-5
LORA = LoRAConfig(lora_rank=2, lora_alpha=6.0)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def imported(request, tmp_path_factory):
    """(the Hugging Face source directory, ptdp's imported checkpoint)."""
    root = tmp_path_factory.mktemp(request.param)
    _hf_model(request.param).save_pretrained(root / "source")
    assert main(["convert", "--from-hf", str(root / "source"), "--save", str(root / "base")]) == 0
    return root


def _tokens(seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (2, 13), generator=generator)


def _ptdp_model(config, weights: dict, lora: LoRAConfig):
    """ptdp's one-process model with adapters attached, the weights loaded;
    the MoE balancing losses off (transformers adds none by default)."""
    model_config = dataclasses.replace(config.model, moe_aux_loss_coeff=0.0,
                                       moe_z_loss_coeff=0.0)
    chunk = build_chunks(model_config, ParallelContext.single(), torch.device("cpu"), 0,
                         lora=lora)[0]
    with torch.no_grad():
        for name, param in chunk.named_parameters():  # (the vocabulary padded as a rank's)
            spec = getattr(param, SHARD_ATTR, None)
            param.copy_(weights[name] if spec is None else shard(weights[name], spec))
    return chunk


def _ptdp_logits(chunk, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, V] over the real vocabulary (padding rows dropped)."""
    with torch.no_grad():
        logits = chunk.eval()(tokens)
    return logits.transpose(0, 1)[..., :SMALL["vocab_size"]]


def _peft_model(source, adapter_directory, trainable: bool = False):
    base = transformers.AutoModelForCausalLM.from_pretrained(source)
    return peft.PeftModel.from_pretrained(base, adapter_directory, is_trainable=trainable)


def test_ptdp_adapters_compute_and_train_as_peft(imported, tmp_path):
    config, base, _ = load_logical_model(imported / "base")
    generator = torch.Generator().manual_seed(5)
    adapters = {name: 0.3 * torch.randn(shape, generator=generator)
                for name, shape in adapter_shapes(config.model, LORA).items()}
    chunk = _ptdp_model(config, {**base, **adapters}, LORA)
    save_peft_directory(tmp_path / "peft", adapters, config.model, LORA)
    theirs = _peft_model(imported / "source", tmp_path / "peft", trainable=True)
    tokens = _tokens()

    # Logits, against the base's own (so the adapters act).
    with torch.no_grad():
        peft_logits = theirs.eval()(tokens).logits
        with theirs.disable_adapter():
            plain = theirs(tokens).logits
    assert (peft_logits - plain).abs().max() > 1e-2
    torch.testing.assert_close(_ptdp_logits(chunk, tokens), peft_logits, atol=TOLERANCE, rtol=0)

    # The first step's loss and gradients: the next token's cross entropy, averaged.
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    chunk.train()
    ours = chunk(inputs, labels)
    ours.backward()
    theirs.train()
    logits = theirs(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))
    loss.backward()
    assert ours.item() == pytest.approx(loss.item(), abs=TOLERANCE)
    peft_grads = {name.replace(".default", ""): param.grad
                  for name, param in theirs.named_parameters() if param.requires_grad}
    leaves = {name: tensor.clone().requires_grad_(True) for name, tensor in adapters.items()}
    _, exported = to_peft(leaves, config.model, LORA)
    names = sorted(exported)
    assert set(names) == set(peft_grads)
    expected = torch.autograd.grad([exported[n] for n in names], [leaves[n] for n in leaves],
                                   [peft_grads[n] for n in names], allow_unused=True)
    ours_grads = dict(chunk.named_parameters())
    for name, want in zip(leaves, expected):
        got = ours_grads[name].grad
        assert want is not None and got is not None, name
        scale = max(want.abs().max().item(), 1e-6)
        torch.testing.assert_close(got, want, atol=TOLERANCE * scale, rtol=0, msg=name)


def test_an_adapter_trained_in_peft_imports_and_exports(imported, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(imported / "source")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=5, target_modules=targets))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(tmp_path / "trained")
    tokens = _tokens(seed=11)
    with torch.no_grad():
        want = model.eval()(tokens).logits

    assert main(["convert", "--from-hf-peft", str(tmp_path / "trained"), "--pretrained-checkpoint",
                 str(imported / "base"), "--save", str(tmp_path / "ad")]) == 0
    config, adapters, metadata = load_logical_model(tmp_path / "ad")
    assert config.lora.lora_rank == 6 and config.lora.scale == pytest.approx(5 / 2)
    _, base, _ = load_logical_model(imported / "base")
    chunk = _ptdp_model(config, {**base, **adapters}, config.lora)
    torch.testing.assert_close(_ptdp_logits(chunk, tokens), want, atol=TOLERANCE, rtol=0)

    assert main(["convert", "--to-hf-peft", str(tmp_path / "again"), "--load",
                 str(tmp_path / "ad")]) == 0
    again = _peft_model(imported / "source", tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(tokens).logits, want, atol=TOLERANCE, rtol=0)
