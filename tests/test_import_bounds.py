"""Nothing of a Hugging Face directory or a checkpoint is believed unchecked.

`ptdp convert --from-hf` checks config.json's sizes against the weight
files' headers before anything is built from them (a config claiming a
billion layers is refused at once, in little memory), refuses weights that
are not floating point or not finite, a tokenizer.json that does not load
or does not fit, and a shard index that disagrees with its shards; each
refusal names the field, tensor or file, exits 2 and writes nothing.
`ptdp generate` says what the machine has when --device cuda cannot run,
and a damaged checkpoint is one paragraph naming the file, never a
traceback. The directories are written by ptdp's own exporters (no
transformers needed).
"""

import json
import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from ptdp.cli import main
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.errors import is_user_error
from ptdp.interop.hf_directory import save_hf_directory
from ptdp.interop.logical import logical_shapes
from ptdp.checkpoint.store import CheckpointError, save_logical_model

GPT2 = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                   seq_length=16)
LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                    seq_length=16, normalization="RMSNorm", swiglu=True,
                    position_embedding_type="rope", group_query_attention=True,
                    num_query_groups=2, ffn_hidden_size=48)


def _weights(config, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * 0.1
            for name, shape in logical_shapes(config).items()}


def _hf_directory(path, architecture="GPT-2", **config_changes):
    """A Hugging Face directory of a 2-layer model, config.json edited by
    `config_changes`."""
    config = GPT2 if architecture == "GPT-2" else LLAMA
    save_hf_directory(path, _weights(config), config)
    hf = json.loads((path / "config.json").read_text())
    hf.update(config_changes)
    (path / "config.json").write_text(json.dumps(hf))
    return path


def _convert(directory, save, capsys):
    """`ptdp convert --from-hf`: (exit status, stderr)."""
    status = main(["convert", "--from-hf", str(directory), "--save", str(save)])
    return status, capsys.readouterr().err


def _edit_weights(directory, change):
    path = directory / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})
    return path


# ------------------------------------------------------------------ config.json against the tensors

@pytest.mark.parametrize("architecture, changes, message", [
    ("GPT-2", dict(n_layer=100_000), "n_layer=100000, but the tensors hold 2 layers (h.0 to h.1)"),
    ("Llama", dict(num_hidden_layers=100_000),
     "num_hidden_layers=100000, but the tensors hold 2 layers (layers.0 to layers.1)"),
], ids=["gpt2", "llama"])
def test_a_config_with_absurdly_many_layers_is_refused_in_little_memory(
        tmp_path, capsys, architecture, changes, message):
    directory = _hf_directory(tmp_path / "hf", architecture, **changes)
    tracemalloc.start()
    try:
        status, error = _convert(directory, tmp_path / "ckpt", capsys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 2
    assert f"{directory}: config.json does not match the tensors of the weight files" in error
    assert message in error
    assert "Traceback" not in error and not (tmp_path / "ckpt").exists()
    # Before the check, a name table of 100 000 layers took hundreds of MB
    # (a billion layers: all the memory there is).
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB traced"


@pytest.mark.parametrize("architecture, changes, message", [
    ("GPT-2", dict(vocab_size=1_000_000_000),
     "vocab_size=1000000000, but the tensors' vocabulary is 100 (wte.weight: (100, 32))"),
    ("GPT-2", dict(n_embd=64),
     "n_embd=64, but the tensors' hidden size is 32 (wte.weight: (100, 32))"),
    ("GPT-2", dict(n_positions=4096, n_ctx=4096),
     "n_positions=4096, but the tensors' number of positions is 16 (wpe.weight: (16, 32))"),
    ("GPT-2", dict(n_inner=1000), "n_inner=1000, but the tensors' MLP width is 128 "
                                  "(h.0.mlp.c_fc.weight: (32, 128))"),
    ("Llama", dict(hidden_size=64, head_dim=16),
     "hidden_size=64, but the tensors' hidden size is 32 (embed_tokens.weight: (100, 32))"),
    ("Llama", dict(intermediate_size=4000),
     "intermediate_size=4000, but the tensors' MLP width is 48 "
     "(layers.0.mlp.gate_proj.weight: (48, 32))"),
    ("Llama", dict(num_key_value_heads=4),
     "num_key_value_heads=4 with num_attention_heads=4 (head_dim 8, so 4·8 key/value rows), but "
     "the tensors' key/value width is 16 (layers.0.self_attn.k_proj.weight: (16, 32))"),
    ("Llama", dict(num_attention_heads=8, head_dim=4),
     "num_key_value_heads=2 with num_attention_heads=8 (head_dim 4, so 2·4 key/value rows), but "
     "the tensors' key/value width is 16"),
    ("Llama", dict(vocab_size=7),
     "vocab_size=7, but the tensors' vocabulary is 100 (embed_tokens.weight: (100, 32))"),
], ids=["gpt2-vocab", "gpt2-hidden", "gpt2-positions", "gpt2-ffn", "llama-hidden", "llama-ffn",
        "llama-kv-heads", "llama-heads", "llama-vocab"])
def test_every_size_of_the_config_is_checked_against_the_tensors(
        tmp_path, capsys, architecture, changes, message):
    directory = _hf_directory(tmp_path / "hf", architecture, **changes)
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 2 and message in error, error
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------ the weights themselves

@pytest.mark.parametrize("value, counts", [(float("nan"), "holds 4096 NaN and 0 infinite"),
                                           (float("inf"), "holds 0 NaN and 1 infinite")],
                         ids=["all-nan", "one-inf"])
def test_non_finite_weights_are_refused_naming_tensor_and_file(tmp_path, capsys, value, counts):
    directory = _hf_directory(tmp_path / "hf")
    key = "transformer.h.1.mlp.c_fc.weight"

    def spoil(state):
        if value != value:  # NaN: the whole tensor
            state[key] = torch.full_like(state[key], value)
        else:
            state[key][3, 5] = value

    path = _edit_weights(directory, spoil)
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 2
    assert f"{path}: tensor '{key}' {counts} values" in error
    assert "ptdp imports only finite weights" in error
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("dtype, name", [(torch.int8, "I8"), (torch.int32, "I32"),
                                         (torch.float8_e4m3fn, "F8_E4M3")],
                         ids=["int8", "int32", "float8"])
def test_weights_that_are_not_floating_point_are_refused(tmp_path, capsys, dtype, name):
    directory = _hf_directory(tmp_path / "hf", "Llama")
    key = "model.layers.0.self_attn.q_proj.weight"

    def quantize(state):
        state[key] = (state[key] * 100).to(dtype)

    path = _edit_weights(directory, quantize)
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 2
    assert f"{path}: tensor '{key}' is {name}, not floating point" in error
    assert not (tmp_path / "ckpt").exists()


def test_floating_point_weights_of_every_width_are_imported(tmp_path, capsys):
    directory = _hf_directory(tmp_path / "hf")
    _edit_weights(directory, lambda state: state.update(
        {key: tensor.to(torch.bfloat16 if "ln_" in key else torch.float16)
         for key, tensor in state.items()}))
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 0, error


# ------------------------------------------------------------------ the tokenizer it carries

def _tokenizer(path, size=100, eod="</s>"):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(size - 1)]
    vocab = {eod: 0, **{word: i + 1 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=eod))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([eod])
    tokenizer.save(str(path))


def test_a_truncated_tokenizer_json_is_refused(tmp_path, capsys):
    directory = _hf_directory(tmp_path / "hf")
    path = directory / "tokenizer.json"
    _tokenizer(path)
    text = path.read_bytes()
    path.write_bytes(text[:len(text) // 2])
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 2
    assert f"{path} is not a Hugging Face tokenizer.json" in error
    assert "move it out of the directory to import the model without a tokenizer" in error
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("size, eod, message", [
    (100, "<unk>", "has no end-of-document token"),
    (101, "</s>", "has 101 token ids, more than the model's vocabulary of 100"),
], ids=["no-eod", "too-many-ids"])
def test_a_tokenizer_ptdp_could_not_use_with_the_model_is_refused(tmp_path, capsys, size, eod,
                                                                  message):
    directory = _hf_directory(tmp_path / "hf")
    _tokenizer(directory / "tokenizer.json", size, eod)
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 2 and f"{directory / 'tokenizer.json'}" in error and message in error, error
    assert not (tmp_path / "ckpt").exists()


def test_a_good_tokenizer_is_carried(tmp_path, capsys):
    from ptdp.checkpoint.store import checkpoint_tokenizer

    directory = _hf_directory(tmp_path / "hf")
    _tokenizer(directory / "tokenizer.json")
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 0, error
    carried = checkpoint_tokenizer(tmp_path / "ckpt")
    assert carried.read_bytes() == (directory / "tokenizer.json").read_bytes()


# ------------------------------------------------------------------ sharded weights

def _sharded(path):
    """The GPT-2 directory with its weights in two shards and an index."""
    directory = _hf_directory(path)
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[:len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({key: state[key] for key in part}, str(directory / name),
                  metadata={"format": "pt"})
    weight_map = {key: name for name, part in halves.items() for key in part}
    return directory, weight_map


def _write_index(directory, weight_map):
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_weights_are_read_through_their_index(tmp_path, capsys):
    directory, weight_map = _sharded(tmp_path / "hf")
    _write_index(directory, weight_map)
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 0, error


@pytest.mark.parametrize("edit, message", [
    (lambda m, k: m.update({k: "model-00003-of-00002.safetensors"}),
     "names model-00003-of-00002.safetensors, which is missing from"),
    (lambda m, k: m.update({k: "../outside.safetensors"}),
     "names '../outside.safetensors', not a .safetensors file in"),
    (lambda m, k: m.update({k: "/etc/passwd.safetensors"}), "names '/etc/passwd.safetensors'"),
    (lambda m, k: m.update({k: "sub/model.safetensors"}), "names 'sub/model.safetensors'"),
    (lambda m, k: m.update({k: "config.json"}), "names 'config.json', not a .safetensors file"),
    (lambda m, k: m.update({k: 7}), "\"weight_map\" must be a non-empty object"),
    (lambda m, k: m.update({k: "model-00002-of-00002.safetensors"}
                           if m[k].startswith("model-00001") else
                           {k: "model-00001-of-00002.safetensors"}),
     "does not match its shards"),
    (lambda m, k: m.pop(k), "not listed"),
], ids=["missing-shard", "parent", "absolute", "subdirectory", "not-safetensors", "not-a-name",
        "wrong-shard", "unlisted-tensor"])
def test_an_index_that_disagrees_with_its_shards_is_refused(tmp_path, capsys, edit, message):
    directory, weight_map = _sharded(tmp_path / "hf")
    (tmp_path / "outside.safetensors").write_bytes(
        (directory / "model-00001-of-00002.safetensors").read_bytes())
    edit(weight_map, sorted(weight_map)[0])
    _write_index(directory, weight_map)
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 2 and message in error, error
    assert "model.safetensors.index.json" in error
    assert not (tmp_path / "ckpt").exists()


def test_a_damaged_weight_file_is_refused_naming_it(tmp_path, capsys):
    directory = _hf_directory(tmp_path / "hf")
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])  # the header promises more than is there
    status, error = _convert(directory, tmp_path / "ckpt", capsys)
    assert status == 2 and f"cannot read {path}" in error, error


# ------------------------------------------------------------------ ptdp generate

@pytest.fixture
def checkpoint(tmp_path):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                         seq_length=16)
    save_logical_model(tmp_path / "ckpt", Config(model=config, data=DataConfig(mock_data=True)),
                       _weights(config))
    return tmp_path / "ckpt"


def _generate(checkpoint, *flags):
    return main(["generate", "--load", str(checkpoint), "--prompt", "1 2", "--max-new-tokens", "2",
                 *flags])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("layout, needs", [((), "needs one;"),
                                           (("-t", "2"), "needs 2, one per process (t=2 × p=1)")],
                         ids=["one-process", "t2"])
def test_generate_on_cuda_without_a_gpu_says_what_to_give(checkpoint, capsys, layout, needs):
    assert _generate(checkpoint, "--device", "cuda", *layout) == 2
    error = capsys.readouterr().err
    assert "--device cuda: this machine has 0 visible GPUs" in error and needs in error
    assert "give --device cpu, or --device auto" in error and "Traceback" not in error


def test_generate_from_a_damaged_checkpoint_names_the_file(checkpoint, capsys):
    assert _generate(checkpoint) == 0  # the checkpoint as written generates
    capsys.readouterr()
    part = checkpoint / "iter_0000000" / "part-pp0-tp0.safetensors"
    data = bytearray(part.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in a weight
    part.write_bytes(bytes(data))
    assert _generate(checkpoint) == 2
    # The line saying what is generated comes first; the weights are
    # checked as they are read, after it, and the error is the rest.
    announcement, error = capsys.readouterr().err.split("\n", 1)
    assert announcement.startswith("ptdp: generating up to 2 tokens")
    assert error.startswith("ptdp: error:") and "damaged" in error
    assert str(part.parent) in error and part.name in error
    assert "Traceback" not in error


def test_a_damaged_checkpoint_is_a_user_error_on_a_rank(checkpoint):
    """Under -t/-p every rank reads the weights: what it raises must be shown
    as one paragraph (a user error), not as a bug's traceback."""
    from ptdp.generate import read_checkpoint_model

    part = checkpoint / "iter_0000000" / "part-pp0-tp0.safetensors"
    part.write_bytes(part.read_bytes()[:-8])
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint_model(str(checkpoint))
    assert part.name in str(caught.value) and str(part.parent) in str(caught.value)
    assert is_user_error(caught.value)


def test_library_errors_beneath_the_checkpoint_read_become_checkpoint_errors(checkpoint,
                                                                          monkeypatch, capsys):
    """What the checkpoint's own checks do not catch (an error inside
    safetensors or json) is still one paragraph naming the checkpoint."""
    from safetensors import SafetensorError

    import ptdp.checkpoint.store as checkpoints

    def unreadable(load):
        raise SafetensorError("Error while deserializing header: HeaderTooLarge")

    monkeypatch.setattr(checkpoints, "load_logical_model", unreadable)
    assert _generate(checkpoint) == 2
    error = capsys.readouterr().err
    assert f"--load {checkpoint}: the checkpoint cannot be read (SafetensorError: Error while " \
           f"deserializing header: HeaderTooLarge); it is damaged" in error
