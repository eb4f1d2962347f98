"""`ptdp generate --chat` (issue 40, item 7): a chat model imported from
Hugging Face answers a user message as transformers makes it answer: the
prompt is `apply_chat_template(messages, add_generation_prompt=True)`, the
greedy reply is `generate(..., do_sample=False)`'s new tokens, stopped at
the end-of-turn token, which is not printed."""

from pathlib import Path

import pytest
import torch

from ptdp.generate import chat_messages, chat_prompt
from ptdp.checkpoint.store import resolve
from ptdp.cli import main
from ptdp.commands.generate import _checkpoint_config
from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.data.sft.template_files import CHATML_TEMPLATE_FILE
from ptdp.sampling import SamplingSettings, generate

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
WORDS = ["system", "user", "assistant", "you", "are", "a", "helpful", "bot", "hello", "how", "is",
         "the", "cat", "fine", "thanks", "dog", "red", "blue", "green", "sun", "moon", "tree",
         "sky", "sea", "rain", "snow", "wind", "day", "night"]
VOCAB = len(SPECIALS) + len(WORDS)  # 32: every id the model writes decodes to a word
END_OF_TURN, END_OF_TEXT = 2, 0
# Qwen's ChatML template (shortened: no tools).
TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
            "{{ '<|im_start|>system\nyou are a helpful bot<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
            "+ '\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGE = "hello how is the cat"
MAX_NEW = 12


def _tokenizer():
    from tests.test_hf_chat_export import _tokenizer as word_level

    return word_level(WORDS)


def _greedy(model, prompt: list[int], eos: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=eos, pad_token_id=END_OF_TEXT)
    return out[0, len(prompt):].tolist()


def _printed_ids(new_tokens: list[int], stops: list[int]) -> str:
    """What --output-ids prints for transformers' new tokens: the token it
    stopped at left out."""
    reply = new_tokens[:-1] if new_tokens[-1] in stops else new_tokens
    return ",".join(map(str, reply)) + "\n"


def _stops_after_a_few_tokens(model, prompt: list[int]) -> None:
    """A random model seldom writes <|im_end|> by itself: its output row is
    scaled up, by the least factor that makes greedy decoding end the turn
    after two tokens or more (the model, hence the case, is fixed by the seed)."""
    row = model.lm_head.weight[END_OF_TURN].detach().clone()
    for scale in torch.arange(1.0, 8.0, 0.25).tolist():
        with torch.no_grad():
            model.lm_head.weight[END_OF_TURN] = row * scale
        reply = _greedy(model, prompt, [END_OF_TURN])
        if reply[-1] == END_OF_TURN and len(reply) >= 3:
            return
    raise AssertionError("no scale of the <|im_end|> row ends the turn after a few tokens")


def _save(model, directory: Path, template: str | None, eos_token: str) -> Path:
    """The model and its tokenizer as transformers saves them; with a
    template, the generation config lists the end of turn and of text."""
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[END_OF_TURN, END_OF_TEXT], pad_token_id=END_OF_TEXT, bos_token_id=None)
    model.save_pretrained(str(directory))
    if template is None:  # a base model: no template, no generation config
        (directory / "generation_config.json").unlink()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token=None,
                                                eos_token=eos_token, pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(the transformers model, its tokenizer, the imported chat checkpoint,
    the same model imported without template or generation config)."""
    folder = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=END_OF_TURN,
                                      pad_token_id=END_OF_TEXT)
    model = transformers.Qwen2ForCausalLM(config).eval()
    in_memory = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer())
    in_memory.chat_template = TEMPLATE
    _stops_after_a_few_tokens(model, _prompt(in_memory, chat_messages(MESSAGE)))
    checkpoints = []
    for name, template, eos_token in (("chat", TEMPLATE, "<|im_end|>"),
                                      ("base", None, "<|endoftext|>")):
        hf = _save(model, folder / f"hf-{name}", template, eos_token)
        assert main(["convert", "--from-hf", str(hf), "--save", str(folder / name)]) == 0
        checkpoints.append(str(folder / name))
    # The directory's tokenizer as transformers reads its tokenizer.json (its
    # AutoTokenizer would rebuild this word-level toy as Qwen2's byte-level BPE).
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder / "hf-chat"),
                                                                     local_files_only=True)
    assert tokenizer.chat_template == TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    return model, tokenizer, *checkpoints


def _prompt(tokenizer, messages, **template) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False,
                                         **template)


def _generate(capsys, load: str, *flags) -> tuple[str, str]:
    assert main(["generate", "--load", load, "--temperature", "0", "--max-new-tokens",
                 str(MAX_NEW), *flags]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_the_prompt_is_apply_chat_templates(chat_model):
    _, tokenizer, chat, _ = chat_model
    config = _checkpoint_config(chat)
    for system in (None, "the sun is red"):
        messages = chat_messages(MESSAGE, system)
        ours = chat_prompt(chat, config, MESSAGE, system)
        assert ours.ids == _prompt(tokenizer, messages)
        assert (ours.ids[:3], ours.ids[-3:]) == ([1, 3, 14 if system else 6], [2, 1, 5])
        # generation_config.json's eos ids, the template's <|im_end|> among them
        assert (ours.stop_ids, ours.stop_tokens) == ([2, 0], ["<|im_end|>", "<|endoftext|>"])


def test_the_greedy_reply_is_transformers_up_to_the_end_of_turn(chat_model, capsys):
    model, tokenizer, chat, _ = chat_model
    expected = _greedy(model, _prompt(tokenizer, chat_messages(MESSAGE)), [END_OF_TURN, END_OF_TEXT])
    assert expected[-1] == END_OF_TURN and 3 <= len(expected) < MAX_NEW  # it stopped there
    reply = expected[:-1]
    out, err = _generate(capsys, chat, "--chat", MESSAGE, "--output-ids")
    assert (out, err) == (",".join(map(str, reply)) + "\n", "")
    out, err = _generate(capsys, chat, "--chat", MESSAGE)
    assert out == tokenizer.decode(reply) + "\n"  # the reply alone: no prompt, no <|im_end|>
    assert "<|im_end|>" not in out and out.strip() and "system" not in out
    assert "the chat message 'hello how is the cat' rendered with the checkpoint's chat template " \
           "(18 tokens)" in err
    assert "until the end of the turn (<|im_end|> or <|endoftext|>):" in err
    # A system message: transformers' reply too, whether or not it ends the turn.
    system = "the sun is red"
    stops = [END_OF_TURN, END_OF_TEXT]
    expected = _greedy(model, _prompt(tokenizer, chat_messages(MESSAGE, system)), stops)
    out, _ = _generate(capsys, chat, "--chat", MESSAGE, "--system", system, "--output-ids")
    assert out == _printed_ids(expected, stops)


def _generate_on_rank(rank: int, request) -> str:
    from ptdp.generate import generate_text, request_grid
    from ptdp.parallel.topology import ParallelContext

    return generate_text(request, ParallelContext.build(request_grid(request)), torch.device("cpu"))


def test_a_tensor_and_pipeline_layout_gives_the_same_reply(chat_model, capsys, monkeypatch, pools):
    """`ptdp generate --chat -t 2 -p 2` builds its request (the rendered
    prompt, the end-of-turn stops, the layout) and launches four ranks; here
    the test's pool runs that request, as ptdp's worker would on each rank.
    (A launched rank's own output cannot be read: once the pools' fork server
    runs, ranks forked from it write to the descriptors it started with, not
    to capfd's.)"""
    model, tokenizer, chat, _ = chat_model
    reply = _greedy(model, _prompt(tokenizer, chat_messages(MESSAGE)), [END_OF_TURN])[:-1]
    launched = []

    def launch_on_the_pool(world, worker, request, **options):
        from ptdp.generate import generate_worker

        launched.append((world, worker is generate_worker, request.tensor_parallel,
                         request.pipeline_parallel))
        texts = pools(4).run(_generate_on_rank, request)
        assert texts == [texts[0]] * world  # every rank extends the same context
        print(texts[0])  # as rank 0 prints it

    monkeypatch.setattr("ptdp.launch.launch_local", launch_on_the_pool)
    out, _ = _generate(capsys, chat, "--chat", MESSAGE, "--output-ids", "-t", "2", "-p", "2",
                       "--device", "cpu")
    assert launched == [(4, True, 2, 2)]
    assert out == ",".join(map(str, reply)) + "\n"


def test_a_model_without_a_template_asks_for_one(chat_model, capsys, tmp_path):
    model, tokenizer, _, base = chat_model
    assert main(["generate", "--load", base, "--chat", MESSAGE]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("ptdp: error:") and "Traceback" not in err
    assert f"--chat: the checkpoint {resolve(base)} has no chat template" in err
    assert f"--chat-template FILE, e.g. ptdp's ChatML template {CHATML_TEMPLATE_FILE}" in err
    # ChatML given: transformers' prompt with that template; the tokenizer's
    # eos is <|endoftext|> (a base model's), and the turn ends at the
    # template's <|im_end|> too.
    chatml = CHATML_TEMPLATE_FILE.read_text()
    ours = chat_prompt(base, _checkpoint_config(base), MESSAGE, None, str(CHATML_TEMPLATE_FILE))
    assert ours.ids == _prompt(tokenizer, chat_messages(MESSAGE), chat_template=chatml)
    assert ours.stop_ids == [END_OF_TEXT, END_OF_TURN]
    expected = _greedy(model, ours.ids, ours.stop_ids)
    out, _ = _generate(capsys, base, "--chat", MESSAGE, "--chat-template",
                       str(CHATML_TEMPLATE_FILE), "--output-ids")
    assert out == _printed_ids(expected, ours.stop_ids)
    # A template that refuses the conversation, and one that is not Jinja.
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system "
                      "messages') }}{% endif %}" + chatml)
    assert main(["generate", "--load", base, "--chat", MESSAGE, "--system", "be brief",
                 "--chat-template", str(strict)]) == 2
    assert f"--chat: the template {strict} refuses the conversation (no system messages); " \
           "change the message or drop --system" in capsys.readouterr().err
    strict.write_text("{% for %}")
    assert main(["generate", "--load", base, "--chat", MESSAGE, "--chat-template",
                 str(strict)]) == 2
    assert f"--chat-template {strict}: the chat template is not valid Jinja" in \
        capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--chat", "hi", "--prompt", "hi"], "--chat and --prompt are two prompts: give --chat TEXT"),
    (["--chat", "hi", "--prompt-ids", "1"], "--chat and --prompt-ids are two prompts"),
    (["--prompt", "hi", "--system", "x"], "--system goes with --chat TEXT (a message to a chat "
                                          "model): add --chat, or drop --system"),
    (["--prompt", "hi", "--system", "x", "--chat-template", "f"],
     "--system and --chat-template go with --chat TEXT"),
    ([], "give the prompt either as text, --prompt TEXT, or as token ids, --prompt-ids 5,17,923; "
         "or a message to a chat model, --chat TEXT"),
])
def test_conflicting_prompt_flags_are_refused(chat_model, capsys, flags, message):
    assert main(["generate", "--load", chat_model[2], *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp: error:") and message in " ".join(err.split())


def test_a_model_without_a_hugging_face_tokenizer_cannot_chat(tmp_path, capsys):
    from ptdp.checkpoint.store import save_logical_model
    from ptdp.model.gpt import GPT
    from ptdp.parallel.topology import ParallelContext
    from ptdp.parallel.tensor import RNGStreams

    model = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8,
                        vocab_size=16, make_vocab_size_divisible_by=8)
    gpt = GPT(model, ParallelContext.single(), RNGStreams(torch.device("cpu"))).initialize(1)
    save_logical_model(tmp_path, Config(model=model, data=DataConfig(mock_data=True)),
                       {name: p.detach() for name, p in gpt.named_parameters()})
    assert main(["generate", "--load", str(tmp_path), "--chat", "hi"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "carries no tokenizer (it was trained on generated data); chat with a model imported " \
           "from Hugging Face" in err


def test_generation_stops_at_any_stop_token():
    # A model that writes 5, 6, 7, ... after its last token.
    def counting(tokens):
        return torch.nn.functional.one_hot(tokens[0, -1] + 1, 16).float()

    greedy = SamplingSettings(temperature=0, max_new_tokens=8)
    assert generate(counting, [3], greedy, max_context=8) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert generate(counting, [3], greedy, max_context=8, stop=[9, 7]) == [4, 5, 6]
    assert generate(counting, [3], greedy, max_context=8, eod=6, stop=[9]) == [4, 5]
