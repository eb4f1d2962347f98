"""Fine-tuning data (issue 40): conversations read in every layout, rendered
and masked as transformers' apply_chat_template renders and masks them,
and packed whole into sequences that keep their documents apart."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ptdp.data.sft.packing import first_fit, pack_conversations, stack_sequences
from ptdp.data.sft.rows import ConversationError, read_records
from ptdp.data.sft.template import (ChatTemplate, TokenizedConversation, tokenize_record,
                                    tokenize_rows)
from ptdp.data.sft.template_files import CHATML_TEMPLATE_FILE, ChatTemplateError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["you are a helpful bot", "hello how is the cat", "fine thanks, and you?",
          "the dog is fine too", "system user assistant", "Cutting Knowledge Date: December 2023",
          "Today Date: 26 Jul 2024"]
# Qwen's ChatML template as trainers mark it: the reply and its <|im_end|>
# inside {% generation %}, the newline after it outside.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nyou are a helpful bot<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {%- if message.role == 'system' and loop.first %}\n"
    "  {%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n"
    "  {%- elif message.role in ['user', 'system'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "  {%- else %}{{- raise_exception('unknown role ' + message.role|tojson) }}\n"
    "  {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")
# Llama 3.1's template, shortened (no tools): no generation markers.
LLAMA_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n    {%- set system_message = '' %}\n{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- system_message }}\n{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n")
# An eos_token as older tokenizer_config.json files spell it: an AddedToken object.
EOT_ADDED_TOKEN = {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False,
                   "normalized": False, "rstrip": False, "single_word": False, "special": True}
CONVERSATION = [{"role": "system", "content": "you are a bot"},
                {"role": "user", "content": "hello how is the cat"},
                {"role": "assistant", "content": "fine thanks, and you?"},
                {"role": "user", "content": "and the dog"},
                {"role": "assistant", "content": "the dog is fine too"}]


def _bpe():
    """A small byte-level BPE with the chat formats' special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


def _tokenizer_dir(directory: Path, config: dict, jinja: str | None = None) -> Path:
    directory.mkdir()
    _bpe().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
         **config}))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return directory


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _tokenizer_dir(tmp_path_factory.mktemp("q") / "qwen",
                          {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _tokenizer_dir(tmp_path_factory.mktemp("l") / "llama",
                          {"bos_token": "<|begin_of_text|>", "eos_token": EOT_ADDED_TOKEN,
                           "chat_template": LLAMA_TEMPLATE})


def _auto(directory: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


# ------------------------------------------------------------------ templates against transformers

@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:3], [
    {"role": "user", "content": "café ✓ how?"}, {"role": "assistant", "content": "très fine ✓"}]])
def test_marked_template_gives_transformers_ids_and_assistant_mask(qwen_dir, messages):
    theirs = _auto(qwen_dir).apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
    ours = ChatTemplate.for_tokenizer(qwen_dir).tokenize_messages(messages)
    assert ours.ids.tolist() == list(theirs["input_ids"])
    assert ours.loss_mask.tolist() == list(theirs["assistant_masks"])
    assert 0 < ours.loss_mask.sum() < len(ours.ids)


def test_the_shipped_chatml_template_renders_as_transformers(qwen_dir):
    template = CHATML_TEMPLATE_FILE.read_text()
    theirs = _auto(qwen_dir).apply_chat_template(
        CONVERSATION, chat_template=template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True)
    ours = ChatTemplate.for_tokenizer(qwen_dir, CHATML_TEMPLATE_FILE).tokenize_messages(CONVERSATION)
    assert ours.ids.tolist() == list(theirs["input_ids"])
    assert ours.loss_mask.tolist() == list(theirs["assistant_masks"])
    prompt = ChatTemplate.for_tokenizer(qwen_dir, CHATML_TEMPLATE_FILE).render(
        CONVERSATION[:2], add_generation_prompt=True)
    assert prompt == _auto(qwen_dir).apply_chat_template(
        CONVERSATION[:2], chat_template=template, tokenize=False, add_generation_prompt=True)


def test_unmarked_template_masks_assistant_contents_and_their_end_of_turn(llama_dir):
    template = ChatTemplate.for_tokenizer(llama_dir)
    ours = template.tokenize_messages(CONVERSATION)
    auto = _auto(llama_dir)
    assert ours.ids.tolist() == auto.apply_chat_template(CONVERSATION, tokenize=True,
                                                         return_dict=False)
    # Expected by hand: the characters of each reply and the <|eot_id|> after
    # it in the rendered text, and the tokens (decoded one by one) inside them.
    text = template.render(CONVERSATION)
    assert text.startswith("<|begin_of_text|>") and auto.decode(ours.ids.tolist()) == text
    trained, cursor = [], 0
    for message in CONVERSATION[2::2]:
        header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
        start = text.index(header + message["content"], cursor) + len(header)
        cursor = start + len(message["content"] + "<|eot_id|>")
        trained.append((start, cursor))
    expected, position = [], 0
    for token in ours.ids.tolist():
        piece = auto.decode([token])
        expected.append(int(any(a <= position and position + len(piece) <= b for a, b in trained)))
        position += len(piece)
    assert ours.loss_mask.tolist() == expected
    eot = auto.convert_tokens_to_ids("<|eot_id|>")
    assert [t for t, m in zip(ours.ids.tolist(), expected) if m].count(eot) == 2


def test_train_on_prompt_masks_nothing_out(llama_dir, qwen_dir):
    for directory in (llama_dir, qwen_dir):
        ours = ChatTemplate.for_tokenizer(directory).tokenize_messages(CONVERSATION, True)
        assert ours.loss_mask.tolist() == [1] * len(ours.ids)


def test_a_tokenizer_without_a_template_says_to_pass_one(tmp_path, qwen_dir):
    bare = _tokenizer_dir(tmp_path / "bare", {"eos_token": "<|im_end|>"})
    with pytest.raises(ChatTemplateError, match="has no chat template.*give one with --chat-template FILE"):
        ChatTemplate.for_tokenizer(bare)
    assert ChatTemplate.for_tokenizer(bare / "tokenizer.json", CHATML_TEMPLATE_FILE).tokenize_messages(
        CONVERSATION).ids.tolist() == ChatTemplate.for_tokenizer(
        qwen_dir, CHATML_TEMPLATE_FILE).tokenize_messages(CONVERSATION).ids.tolist()


def test_a_conversation_the_template_refuses_names_file_and_row(tmp_path, qwen_dir):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "narrator", "content": "once"},
                                             {"role": "assistant", "content": "upon"}]}) + "\n")
    (row, record), = read_records(path)
    with pytest.raises(ChatTemplateError, match=rf"{re.escape(str(path))}, row 1: the chat template refuses.*"
                                                r"unknown role \"narrator\""):
        tokenize_record(ChatTemplate.for_tokenizer(qwen_dir), record, path, row)


# ------------------------------------------------------------------ rows

def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


LAYOUT_ROWS = [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "messages", [("user", "hi"), ("assistant", "yo")]),
    ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "yo"}]},
     "conversations", [("system", "s"), ("user", "hi"), ("assistant", "yo")]),
    ({"instruction": "add", "input": "1 2", "output": "3"},
     "alpaca", [("user", "add\n\n1 2"), ("assistant", "3")]),
    ({"question": "why", "context": "", "answer": "because"},
     "alpaca", [("user", "why"), ("assistant", "because")]),
]


def _check_layouts(records):
    for (_, layout, expected), (row, record) in zip(LAYOUT_ROWS, records):
        assert record.layout == layout
        assert [(m["role"], m["content"]) for m in record.messages] == expected


def test_every_layout_is_read_from_json_lines(tmp_path):
    path = _jsonl(tmp_path / "mixed.jsonl", [r for r, _, _ in LAYOUT_ROWS] + ["", {"text": "plain"}])
    records = list(read_records(path))
    _check_layouts(records)
    assert [row for row, _ in records] == [1, 2, 3, 4, 6]   # a blank line is no row
    assert records[-1][1].text == "plain" and not records[-1][1].is_conversation


def test_every_layout_is_read_from_parquet(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    records = []
    for index, (row, _, _) in enumerate(LAYOUT_ROWS):
        path = tmp_path / f"layout{index}.parquet"
        parquet.write_table(pyarrow.Table.from_pylist([row, row]), str(path), row_group_size=1)
        (first, record), (second, again) = read_records(path)   # two row groups, streamed
        assert (first, second) == (1, 2) and again == record
        records.append((first, record))
    _check_layouts(records)
    text = tmp_path / "text.parquet"
    parquet.write_table(pyarrow.table({"text": ["a", "b"]}), str(text))
    assert [r.text for _, r in read_records(text)] == ["a", "b"]


@pytest.mark.parametrize("rows, row, message", [
    (['{"messages": [', ], 1, "is not valid JSON"),
    ([{"text": "ok"}, {"prompt_text": "x", "reply": "y"}], 2,
     r"no conversation layout fits its keys \(prompt_text, reply\); a row needs 'messages'"),
    ([{"messages": [{"role": "user"}]}], 1, "turn 1 of 'messages' has no 'role' or no 'content'"),
    ([{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}], 1,
     "turn 2 is an empty assistant turn"),
    ([{"messages": [{"role": "user", "content": "q"}]}], 1, "has no assistant turn"),
    ([{"conversations": [{"from": "alien", "value": "q"}]}], 1, "is from 'alien'"),
    ([{"messages": [{"role": "user", "content": [{"type": "image"}]}]}], 1, "not a string"),
    (["[1, 2]"], 1, "not an object"),
])
def test_a_bad_row_is_refused_naming_file_and_row(tmp_path, rows, row, message):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConversationError, match=rf"^{re.escape(str(path))}, row {row}: .*{message}"):
        list(read_records(path))


def test_a_parquet_file_that_is_not_one_is_refused(tmp_path):
    fake = tmp_path / "chat.parquet"
    fake.write_text('{"messages": []}\n')
    with pytest.raises(ConversationError, match=rf"{re.escape(str(fake))} is not a Parquet file"):
        list(read_records(fake))
    fake.write_bytes(b"PAR1 but nothing after")
    with pytest.raises(ConversationError, match="is not a Parquet file"):
        list(read_records(fake))
    with pytest.raises(ConversationError, match="no such file"):
        list(read_records(tmp_path / "missing.jsonl"))


def test_parquet_columns_of_no_layout_are_refused(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    path = tmp_path / "odd.parquet"
    parquet.write_table(pyarrow.table({"a": [1], "b": [2]}), str(path))
    with pytest.raises(ConversationError, match=rf"{re.escape(str(path))}, row 1: .*keys \(a, b\)"):
        list(read_records(path))


# ------------------------------------------------------------------ packing

def _conversation(n: int, first: int) -> TokenizedConversation:
    ids = np.arange(first, first + n, dtype=np.int64)
    return TokenizedConversation(ids, (np.arange(n) % 2).astype(np.int8))


def test_packing_keeps_conversations_whole_and_apart():
    lengths = [5, 3, 7, 2, 4, 12]
    conversations = [_conversation(n, 100 * i) for i, n in enumerate(lengths)]
    sequences, stats = pack_conversations(conversations, 8, pad_id=-1)
    assert [s.conversations for s in sequences] == [(0, 1), (2,), (3, 4), (5,)]   # first fit
    assert stats.truncated == 1 and stats.truncated_tokens == 4
    for sequence in sequences:
        bounds = sequence.cu_seqlens.tolist()
        assert bounds[0] == 0 and bounds[-1] == 8
        for document, index in enumerate(sequence.conversations):
            start, end = bounds[document], bounds[document + 1]
            whole = conversations[index]
            n = min(len(whole.ids), 8)
            assert end - start == n
            assert sequence.tokens[start:end].tolist() == whole.ids[:n].tolist()
            assert sequence.labels[start:end - 1].tolist() == whole.ids[1:n].tolist()
            assert sequence.loss_mask[start:end - 1].tolist() == whole.loss_mask[1:n].tolist()
            assert sequence.loss_mask[end - 1] == 0    # no label across the boundary
            assert sequence.position_ids[start:end].tolist() == list(range(n))
            assert (sequence.document_ids[start:end] == document).all()
        padded = bounds[len(sequence.conversations)]
        assert (sequence.loss_mask[padded:] == 0).all() and (sequence.tokens[padded:] == -1).all()
    assert stats.sequence_tokens == 32 and stats.conversation_tokens == 29
    assert stats.loss_tokens == sum(int(s.loss_mask.sum()) for s in sequences)
    assert stats.padding_fraction == pytest.approx(3 / 32)
    assert "truncated" not in stats.summary() and "cut to it" in stats.summary()


def test_packing_is_deterministic_and_unpacked_is_one_per_sequence():
    conversations = [_conversation(n, 10 * i) for i, n in enumerate([3, 6, 2, 5, 1, 4])]
    first, _ = pack_conversations(conversations, 8, pad_id=0)
    again, _ = pack_conversations(conversations, 8, pad_id=0)
    assert all(np.array_equal(a.tokens, b.tokens) and np.array_equal(a.cu_seqlens, b.cu_seqlens)
               for a, b in zip(first, again)) and len(first) == len(again)
    unpacked, stats = pack_conversations(conversations, 8, pad_id=0, packing=False)
    assert [s.conversations for s in unpacked] == [(i,) for i in range(6)]
    packed_loss = sum(s.loss_mask.sum() for s in first)
    assert packed_loss == sum(s.loss_mask.sum() for s in unpacked) == stats.loss_tokens
    assert stats.padding_fraction == pytest.approx(1 - 21 / 48)


def test_first_fit_takes_the_first_bin_with_room_as_a_scan_does():
    rng = np.random.default_rng(0)
    for _ in range(50):
        seq_length = int(rng.integers(1, 30))
        lengths = rng.integers(1, seq_length + 1, size=int(rng.integers(0, 40))).tolist()
        bins, room = [], []
        for index, length in enumerate(lengths):
            b = next((b for b, r in enumerate(room) if length <= r), len(bins))
            if b == len(bins):
                bins.append([])
                room.append(seq_length)
            bins[b].append(index)
            room[b] -= length
        assert first_fit(lengths, seq_length) == bins


def test_tokenized_rows_pack_with_their_assistant_mask(tmp_path, qwen_dir):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[1:3]},
                                            {"instruction": "how is the dog", "output": "fine"},
                                            {"text": "the cat"}])
    tokenized = list(tokenize_rows(path, ChatTemplate.for_tokenizer(qwen_dir)))
    assert tokenized[2].loss_mask.all() and tokenized[2].ids[-1] == 0   # text ends with <|endoftext|>
    sequences, stats = pack_conversations(tokenized + tokenized, 64, pad_id=0)
    assert stats.loss_tokens == 2 * sum(int(t.loss_mask[1:].sum()) for t in tokenized)
    batch = stack_sequences(sequences)
    assert batch["tokens"].shape == (len(sequences), 64) and batch["cu_seqlens"].shape[1] == 65
    for row, sequence in enumerate(sequences):
        segments = int(batch["num_segments"][row])
        assert batch["cu_seqlens"][row, :segments + 1].tolist() == sequence.cu_seqlens.tolist()
        assert (batch["cu_seqlens"][row, segments + 1:] == 64).all()


def test_an_unmarked_template_that_rewrites_earlier_turns_asks_for_markers(tmp_path, qwen_dir):
    template_file = tmp_path / "last-only.jinja"
    template_file.write_text("{% for m in messages %}{{ m.role }}: {{ m.content if loop.last else "
                             "'...' }}<|im_end|>{% endfor %}"
                             "{% if add_generation_prompt %}assistant: {% endif %}")
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[1:3]}])
    with pytest.raises(ChatTemplateError, match=r"row 1: cannot find assistant turn 2 .*"
                                                r"\{% generation %\}"):
        list(tokenize_rows(path, ChatTemplate.for_tokenizer(qwen_dir, template_file)))
