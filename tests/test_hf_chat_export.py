"""A chat model imported from Hugging Face, fine-tuned and exported, is the
original to transformers (issue 38, item 1): the same chat template,
special tokens (eos `<|im_end|>`, pad `<|endoftext|>`, no bos), generation
config (eos ids with the end of turn, pad) and config.json token ids,
checked against the ORIGINAL directory's files with transformers' own
readers. The files are data: each malformed one is refused naming it,
with nothing written."""

import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from ptdp.cli import main
from ptdp.data.preprocess import TokenizerSpec, preprocess
from ptdp.checkpoint.store import read_metadata, resolve
from ptdp.checkpoint.carry import checkpoint_hf_files, hf_files_to_carry

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
WORDS = ["system", "user", "assistant", "you", "are", "a", "helpful", "bot", "hello", "how",
         "is", "the", "cat", "fine", "thanks", "\n"]
VOCAB = 32  # the model's rows: the tokenizer's 19 ids and room
# Qwen's ChatML template (shortened: no tools).
TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
            "{{ '<|im_start|>system\nyou are a helpful bot<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
            "+ '\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "user", "content": "hello how is the cat"},
            {"role": "assistant", "content": "fine thanks"},
            {"role": "user", "content": "how are you"}]
TINY = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
            tie_word_embeddings=True)


def _tokenizer(words=None):
    """A word-level tokenizer: the special tokens, then `words` (default WORDS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = SPECIALS + (WORDS if words is None else words)
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocabulary)},
                                           unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def _chat_model(directory: Path, config_class, model_class, **fields) -> Path:
    """A random chat model saved as transformers saves one: config.json
    (eos <|im_end|> = 2, pad <|endoftext|> = 0), generation_config.json
    (eos [2, 0]), tokenizer.json + tokenizer_config.json, the template in
    chat_template.jinja."""
    torch.manual_seed(0)
    config = config_class(**{**TINY, **fields}, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    model = model_class(config)
    model.generation_config = transformers.GenerationConfig(eos_token_id=[2, 0], pad_token_id=0,
                                                            bos_token_id=None)
    model.save_pretrained(str(directory))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token=None,
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def qwen2_chat(tmp_path_factory) -> Path:
    """The Qwen2 chat model as transformers 5 saves it (read only: copy to change it)."""
    return _chat_model(tmp_path_factory.mktemp("hf") / "qwen2", transformers.Qwen2Config,
                       transformers.Qwen2ForCausalLM)


def _convert(capsys, *argv) -> str:
    assert main(["convert", *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _auto(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _assert_same_use(original: Path, export: Path) -> None:
    """What transformers makes of the export equals what it makes of the original."""
    ours, theirs = _auto(export), _auto(original)
    for generation_prompt in (False, True):
        text = theirs.apply_chat_template(MESSAGES, tokenize=False,
                                          add_generation_prompt=generation_prompt)
        assert "<|im_start|>assistant" in text  # (a real template ran)
        assert ours.apply_chat_template(MESSAGES, tokenize=False,
                                        add_generation_prompt=generation_prompt) == text
    assert ours.apply_chat_template(MESSAGES, tokenize=True) == \
        theirs.apply_chat_template(MESSAGES, tokenize=True)
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id"), name
    assert (ours.eos_token, ours.pad_token) == ("<|im_end|>", "<|endoftext|>")
    ours_generation = transformers.GenerationConfig.from_pretrained(str(export))
    theirs_generation = transformers.GenerationConfig.from_pretrained(str(original))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours_generation, key) == getattr(theirs_generation, key), key
    exported = json.loads((export / "config.json").read_text())
    source = json.loads((original / "config.json").read_text())
    assert (exported["eos_token_id"], exported["pad_token_id"], exported["bos_token_id"]) == \
        (2, 0, None)
    # Every key the export writes that the source has: the source's value
    # (but max_window_layers, which counts only with use_sliding_window true).
    for key in sorted(set(exported) & set(source) - {"max_window_layers"}):
        assert exported[key] == source[key], key


def _chat_corpus(folder: Path, tokenizer: Path) -> str:
    text = ("<|im_start|>user\nhello how is the cat<|im_end|>\n"
            "<|im_start|>assistant\nfine thanks<|im_end|>\n")
    (folder / "chat.jsonl").write_text((json.dumps({"text": text}) + "\n") * 40)
    preprocess([folder / "chat.jsonl"], folder / "chat",
               TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=tokenizer), append_eod=True,
               progress=False)
    return str(folder / "chat_text_document")


def test_a_fine_tuned_chat_model_exports_as_the_original(tmp_path, capsys, qwen2_chat):
    original = qwen2_chat
    assert (original / "chat_template.jinja").is_file()   # transformers 5's layout
    imported, tuned, export = tmp_path / "ck", tmp_path / "tuned", tmp_path / "export"
    printed = _convert(capsys, "--from-hf", str(original), "--save", str(imported))
    assert "chat_template.jinja, generation_config.json, tokenizer_config.json" in printed
    assert main(["train", "--load", str(imported), "--use-checkpoint-args", "--train-iters", "1",
                 "--data-path", _chat_corpus(tmp_path, original / "tokenizer.json"),
                 "--data-cache-path", str(tmp_path / "cache"), "--split", "1,0,0",
                 "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
                 "--lr", "1e-3", "--save", str(tuned)]) == 0
    capsys.readouterr()
    # The fine-tune's checkpoint carries the files on, checked by their sha256.
    metadata = read_metadata(resolve(tuned))
    assert metadata["iteration"] == 1
    assert sorted(_carried(tuned)) == sorted(_carried(imported)) == \
        ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer_config.json"]
    printed = _convert(capsys, "--load", str(tuned), "--to-hf", str(export))
    assert "kept from the original" in printed
    _assert_same_use(original, export)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (export / name).read_bytes() == (original / name).read_bytes(), name
    # The trained weights, not the original's, and transformers reads them.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    before = transformers.AutoModelForCausalLM.from_pretrained(str(original), local_files_only=True)
    assert not torch.equal(model.model.embed_tokens.weight, before.model.embed_tokens.weight)


def _older_layout(directory: Path) -> Path:
    """A Qwen3 chat model as transformers 4 saved one: the template inside
    tokenizer_config.json with added_tokens_decoder, special_tokens_map.json,
    and no generation_config.json; config.json's eos is <|endoftext|>, the
    tokenizer's <|im_end|>."""
    torch.manual_seed(1)
    config = transformers.Qwen3Config(**TINY, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(directory))
    (directory / "generation_config.json").unlink()
    _tokenizer().save(str(directory / "tokenizer.json"))
    added = {str(i): {"content": token, "special": True, "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False}
             for i, token in enumerate(SPECIALS)}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE, "model_max_length": 64, "clean_up_tokenization_spaces": False}))
    (directory / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}))
    return directory


def test_a_template_in_tokenizer_config_and_a_derived_generation_config(tmp_path, capsys):
    original = _older_layout(tmp_path / "qwen3")
    _convert(capsys, "--from-hf", str(original), "--save", str(tmp_path / "ck"))
    _convert(capsys, "--load", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "export"))
    export = tmp_path / "export"
    ours, theirs = _auto(export), _auto(original)
    text = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == text
    assert (ours.eos_token, ours.eos_token_id, ours.pad_token, ours.pad_token_id, ours.bos_token) \
        == (theirs.eos_token, theirs.eos_token_id, theirs.pad_token, theirs.pad_token_id, None) \
        == ("<|im_end|>", 2, "<|endoftext|>", 0, None)
    config = json.loads((export / "config.json").read_text())
    # The source's ids; its null pad id: the pad token its tokenizer_config.json names.
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 0, 0)
    # The source had none: derived, so that generate stops at the end of a turn too.
    generation = transformers.GenerationConfig.from_pretrained(str(export))
    assert (generation.eos_token_id, generation.pad_token_id, generation.bos_token_id) == \
        ([0, 2], 0, 0)
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (original / name).read_bytes(), name


def test_a_qwen3_moe_keeps_its_aux_loss_coefficient_and_chat_settings(tmp_path, capsys):
    original = _chat_model(tmp_path / "moe", transformers.Qwen3MoeConfig,
                           transformers.Qwen3MoeForCausalLM, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=8, router_aux_loss_coef=0.001)
    _convert(capsys, "--from-hf", str(original), "--save", str(tmp_path / "ck"))
    # Fine-tuned with the checkpoint's settings (issue 38: the coefficient
    # trained as 0 and was exported as 0).
    assert main(["train", "--load", str(tmp_path / "ck"), "--use-checkpoint-args",
                 "--train-iters", "1", "--data-path",
                 _chat_corpus(tmp_path, original / "tokenizer.json"), "--data-cache-path",
                 str(tmp_path / "cache"), "--split", "1,0,0", "--seq-length", "16",
                 "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
                 "--save", str(tmp_path / "tuned")]) == 0
    capsys.readouterr()
    trained = read_metadata(resolve(tmp_path / "tuned"))["config"]["model"]
    assert trained["moe_aux_loss_coeff"] == 0.001
    _convert(capsys, "--load", str(tmp_path / "tuned"), "--to-hf", str(tmp_path / "export"))
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["router_aux_loss_coef"] == 0.001
    _assert_same_use(original, tmp_path / "export")


def _carried(load) -> dict[str, bytes]:
    directory = resolve(load)
    return checkpoint_hf_files(directory, read_metadata(directory))


def test_a_run_with_another_tokenizer_does_not_carry_them(tmp_path, capsys, qwen2_chat):
    """The files describe the checkpoint's tokenizer: a fine-tune that
    trains with another drops them (and says so); one with the same keeps them."""
    original = qwen2_chat
    _convert(capsys, "--from-hf", str(original), "--save", str(tmp_path / "ck"))
    directory = resolve(tmp_path / "ck")
    metadata = read_metadata(directory)
    same = types.SimpleNamespace(carried_tokenizer=(original / "tokenizer.json").read_bytes())
    assert hf_files_to_carry(same, directory, metadata) == checkpoint_hf_files(directory, metadata)
    other = types.SimpleNamespace(carried_tokenizer=b"{}")
    assert hf_files_to_carry(other, directory, metadata) == {}
    assert "this run trains with another" in capsys.readouterr().err
    assert hf_files_to_carry(types.SimpleNamespace(), directory, metadata) == {}  # --mock-data


# --------------------------------------------------------------------------- malformed files

@pytest.mark.parametrize("name,contents,words", [
    ("tokenizer_config.json", "{not json", "is not valid JSON"),
    ("tokenizer_config.json", "[" * 100_000 + "]" * 100_000, "nests its brackets too deeply"),
    ("tokenizer_config.json", '["a list"]', "holds a JSON list, not an object"),
    ("tokenizer_config.json", '{"eos_token": "<|nowhere|>"}',
     "eos_token '<|nowhere|>' is not a token of the directory's tokenizer.json"),
    ("tokenizer_config.json", '{"chat_template": 7}', "chat_template is 7, not a template"),
    ("tokenizer_config.json", '{"added_tokens_decoder": {"5": {"content": "<|im_end|>"}}}',
     "added_tokens_decoder gives '<|im_end|>' the id 5"),
    ("special_tokens_map.json", '{"pad_token": 3}', "pad_token is 3, not a token"),
    ("generation_config.json", '{"eos_token_id": [2, 99]}',
     "eos_token_id is [2, 99], not a token id of the model's vocabulary (0..31)"),
    ("generation_config.json", '{"pad_token_id": "0"}', "pad_token_id is \"0\", not a token id"),
    ("chat_template.jinja", b"\xff\xfe{{ x }}", "is not UTF-8 text (byte 0xff at offset 0)"),
    ("chat_template.json", '{"template": "x"}', "has no \"chat_template\""),
])
def test_a_malformed_file_is_refused_naming_it(tmp_path, capsys, qwen2_chat, name, contents,
                                               words):
    original = Path(shutil.copytree(qwen2_chat, tmp_path / "qwen2"))
    path = original / name
    path.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    assert main(["convert", "--from-hf", str(original), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and "Traceback" not in err
    assert f"{path}: {words}" in err
    assert "move it out of the directory to import the model without it" in err
    assert not (tmp_path / "ck").exists()
