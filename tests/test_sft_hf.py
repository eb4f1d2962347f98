"""`ptdp train --sft` against transformers as the outside reference (issue
40's acceptance), for a random Qwen3 and a Llama 3.1 (rope_type llama3)
chat model, each with a byte-level BPE tokenizer and a chat template of
its family's shape that marks the replies with {% generation %}, imported
with `ptdp convert --from-hf`:

* the token ids ptdp renders each conversation to, with the template and
  tokenizer the checkpoint carries, are `apply_chat_template`'s, and the
  loss mask is `return_assistant_tokens_mask=True`'s;
* the first iteration's loss of `ptdp train --sft --load CK
  --use-checkpoint-args --finetune` is the original model's per-token cross
  entropy (transformers, fp32, each conversation alone) over the global
  batch's loss tokens, within 1e-5, and the run counts the same tokens.

The training conversations are chosen so that every one is longer than a
third of --seq-length and at most half of it: whatever order an epoch
shuffles them into, first fit packs exactly two into each sequence, so
the first global batch (half as many sequences as conversations) holds
every conversation once, and the reference needs nothing of ptdp's
dataset code. Two documents share each sequence, so a loss that matches
also shows attention kept within each conversation (attention across them
moves the loss by some 2e-4 to 2e-3). Attention is sharpened (q and k
weights scaled) so that Llama 3.1's rescaling of the slow rotary
frequencies shows in the loss over these short conversations; the test
checks that it does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ptdp.cli import main
from ptdp.data.sft.template import ChatTemplate

transformers = pytest.importorskip("transformers")

SEQ = 96
SEQUENCES = 4          # the global batch: every training conversation, two a sequence
LOSS_TOL = 1e-5
WORDS = ("hello how is the cat today fine thanks and you the weather is nice yes what time "
         "it three o'clock where are we going home café ☕ please tell me a story about dogs "
         "sure once upon there was dog named rex").split()
# Qwen3's shape: ChatML, no default system prompt, an empty think block
# before the replies after the last user turn, whitespace control and a
# namespace; the reply and its <|im_end|> are generated, the newline not.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unexpected role ' + m['role']) -}}{%- endif -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m['content'] | trim + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# Llama 3.1's shape: the bos token, a system header with the knowledge and
# today's dates, headers per turn, <|eot_id|> generated with each reply.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
VOCAB = 640            # the model's rows: the tokenizer's (at most 600) and room
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=48, max_position_embeddings=SEQ,
              rms_norm_eps=1e-6)
FAMILIES = {
    "qwen3": dict(config="Qwen3Config", specials=QWEN_SPECIALS, template=QWEN3_TEMPLATE,
                  tokens=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                  fields=dict(head_dim=16, tie_word_embeddings=True, bos_token_id=None,
                              eos_token_id=2, pad_token_id=0)),
    # 16-wide heads at θ 500000: the slowest rotary pairs are rescaled by llama3
    "llama3.1": dict(config="LlamaConfig", specials=LLAMA_SPECIALS, template=LLAMA31_TEMPLATE,
                     tokens=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
                     fields=dict(head_dim=16, tie_word_embeddings=False, bos_token_id=0,
                                 eos_token_id=4, pad_token_id=None,
                                 rope_parameters={**LLAMA3, "rope_theta": 500000.0})),
}
# Conversations for the ids and masks: a system turn, several replies, a
# reply that the template trims, text past ASCII (offsets are characters).
CHATS = [
    [{"role": "user", "content": "hello how is the cat today"},
     {"role": "assistant", "content": "fine thanks and you"}],
    [{"role": "system", "content": "you are a dog named rex"},
     {"role": "user", "content": "please tell me a story"},
     {"role": "assistant", "content": "once upon a time there was a dog"},
     {"role": "user", "content": "where are we going"},
     {"role": "assistant", "content": "  home, at three o'clock \n"}],
    [{"role": "user", "content": "what time is it"},
     {"role": "assistant", "content": "café ☕ time"},
     {"role": "user", "content": "sure"},
     {"role": "assistant", "content": "yes"}],
]


def _bpe_tokenizer(specials: list[str], bos: str | None):
    """A byte-level BPE (Qwen's and Llama 3's kind) trained on WORDS, the
    specials first (ids 0, 1, ...); Llama's adds bos when asked for
    special tokens, which a chat template's ids must not get twice."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[k:] + WORDS[:k]) for k in range(len(WORDS))]
    corpus += ["system user assistant\n\n</think> <think>\n\n Cutting Knowledge Date: December "
               "2023\nToday Date: 26 Jul 2024"] * 3
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, specials.index(bos))])
    return tokenizer


def _hf_chat_model(directory: Path, family: dict):
    """A random model of the family, saved with its tokenizer and template."""
    config = getattr(transformers, family["config"])(**COMMON, **family["fields"])
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms, sharp attention (module notes)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if re.search(r"\.[qk]_proj\.weight$", name):
                param.mul_(20.0)
    model.save_pretrained(str(directory))
    tokens = family["tokens"]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_bpe_tokenizer(family["specials"], tokens["bos_token"]), **tokens)
    fast.chat_template = family["template"]
    fast.save_pretrained(str(directory))
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
    """(the family's name, the transformers model, its tokenizer as
    transformers reads it, the ptdp checkpoint `ptdp convert --from-hf`
    wrote of it, a scratch folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = _hf_chat_model(folder / "hf", FAMILIES[request.param])
    assert main(["convert", "--from-hf", str(folder / "hf"), "--save", str(folder / "ck")]) == 0
    # PreTrainedTokenizerFast, not AutoTokenizer: transformers 5 may rebuild
    # a tokenizer as its family's when config.json names qwen3 or llama.
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder / "hf"))
    assert reference.chat_template == FAMILIES[request.param]["template"]
    return request.param, model, reference, folder / "ck", folder


def _reference_ids_and_mask(reference, messages) -> tuple[list[int], list[int]]:
    out = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert sum(out["assistant_masks"]) > 0  # (the markers worked)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_ids_and_loss_mask_are_apply_chat_templates(imported):
    _, _, reference, checkpoint, _ = imported
    carried = next(checkpoint.glob("iter_*")) / "tokenizer.json"
    template = ChatTemplate.for_tokenizer(carried)
    assert template.source == reference.chat_template   # the checkpoint's own, carried
    for messages in CHATS:
        ids, mask = _reference_ids_and_mask(reference, messages)
        ours = template.tokenize_messages(messages)
        assert ours.ids.tolist() == ids
        assert ours.loss_mask.tolist() == mask


def _training_chats(reference, count: int) -> list[list[dict]]:
    """`count` conversations of one or two exchanges whose ids are longer
    than SEQ / 3 and at most SEQ / 2 (see the module's notes)."""
    rng = np.random.default_rng(7)
    chats = []
    for _ in range(2000):
        def text(n):
            return " ".join(rng.choice(WORDS, size=n))
        messages = []
        for _ in range(int(rng.integers(1, 3))):
            messages += [{"role": "user", "content": text(int(rng.integers(1, 5)))},
                         {"role": "assistant", "content": text(int(rng.integers(1, 6)))}]
        length = len(_reference_ids_and_mask(reference, messages)[0])
        if SEQ / 3 < length <= SEQ // 2:
            chats.append(messages)
            if len(chats) == count:
                return chats
    raise AssertionError(f"only {len(chats)} conversations of the lengths wanted")


def _reference_loss(model, reference, chats) -> tuple[float, int]:
    """The per-token cross entropy over every chat's loss tokens (label:
    the next token; its mask: the label's), transformers' logits in fp32."""
    total, count = 0.0, 0
    with torch.no_grad():
        for messages in chats:
            ids, mask = _reference_ids_and_mask(reference, messages)
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]),
                                                       reduction="none")
            trained = torch.tensor(mask[1:], dtype=torch.bool)
            total += float(losses[trained].sum())
            count += int(trained.sum())
    return total / count, count


def test_first_iteration_loss_is_transformers_cross_entropy(imported):
    family, model, reference, checkpoint, folder = imported
    chats = _training_chats(reference, 2 * SEQUENCES)
    data = folder / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    metrics = folder / "metrics.jsonl"
    assert main(["train", "--sft", "--load", str(checkpoint), "--use-checkpoint-args",
                 "--finetune", "--train-iters", "1", "--data-path", str(data),
                 "--split", "100,0,0", "--seq-length", str(SEQ), "--micro-batch-size", "2",
                 "--global-batch-size", str(SEQUENCES), "--lr", "1e-3",
                 "--metrics-file", str(metrics)]) == 0
    record = json.loads(metrics.read_text().splitlines()[0])
    expected, tokens = _reference_loss(model, reference, chats)
    assert record["iteration"] == 1
    assert record["loss_tokens"] == tokens
    assert record["loss_token_fraction"] == pytest.approx(tokens / (SEQUENCES * SEQ))
    assert abs(record["loss"] - expected) <= LOSS_TOL, (record["loss"], expected)
    if "rope_parameters" in FAMILIES[family]["fields"]:  # the rescaling shows in the loss
        unscaled, _ = _reference_loss(_plain_rotary_twin(model, family), reference, chats)
        assert abs(unscaled - expected) > 3 * LOSS_TOL, (unscaled, expected)


def _plain_rotary_twin(model, family: str):
    """The model with plain rotary frequencies instead of Llama 3.1's."""
    fields = FAMILIES[family]["fields"]
    theta = fields["rope_parameters"]["rope_theta"]
    config = getattr(transformers, FAMILIES[family]["config"])(
        **COMMON, **{**fields, "rope_parameters": {"rope_type": "default", "rope_theta": theta}})
    twin = transformers.AutoModelForCausalLM.from_config(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin
