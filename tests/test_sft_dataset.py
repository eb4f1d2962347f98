"""Fine-tuning datasets (issue 40): conversation files tokenized once into a
cache that is reused while nothing changed, held out, shuffled and packed
into samples that depend only on the seed; and the document boundaries of
pretraining sequences as Megatron-LM's --reset-position-ids sets them."""

import json
import os

import numpy as np
import pytest
import torch

from ptdp.data.documents import documents_from_eod
from ptdp.data.sft import cache as sft_cache
from ptdp.data.sft.cache import tokenized_file
from ptdp.data.sft.dataset import SFTDataset, blend_stats, build_sft_datasets
from ptdp.data.sft.rows import ConversationError
from ptdp.data.sft.template import ChatTemplate
from tests.test_sft_data import QWEN_TEMPLATE, _tokenizer_dir

WORDS = "hello how is the cat fine thanks and you dog too".split()
FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids", "cu_seqlens")


def _conversation(k: int) -> dict:
    user = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(1 + k % 3))
    reply = " ".join(WORDS[(2 * k + j) % len(WORDS)] for j in range(1 + k % 5))
    return {"messages": [{"role": "user", "content": f"{user} {k}"},
                         {"role": "assistant", "content": reply}]}


def _write(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n"
                            for row in rows))
    return path


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    directory = _tokenizer_dir(tmp_path_factory.mktemp("tok") / "qwen",
                               {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                               QWEN_TEMPLATE)
    return ChatTemplate.for_tokenizer(directory)


@pytest.fixture
def counted(template, monkeypatch):
    """The template, counting the conversations it tokenizes."""
    calls = []
    original = ChatTemplate.tokenize_messages

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "tokenize_messages", counting)
    return template, calls


# ------------------------------------------------------------------ the token cache

def test_cache_is_built_once_reused_and_rebuilt_on_change(tmp_path, counted):
    template, calls = counted
    path = _write(tmp_path / "chat.jsonl", [_conversation(k) for k in range(6)])
    first = tokenized_file(path, template)
    assert first.built and len(calls) == 6 and len(first) == 6
    assert (tmp_path / "index-cache").is_dir()
    again = tokenized_file(path, template)
    assert not again.built and len(calls) == 6  # loaded: nothing tokenized
    assert np.array_equal(again.ids, first.ids) and np.array_equal(again.offsets, first.offsets)
    assert again.conversation(2).ids.tolist() == template.tokenize_messages(
        _conversation(2)["messages"]).ids.tolist()
    calls.clear()
    assert tokenized_file(path, template, train_on_prompt=True).built  # a setting
    os.utime(path, (1, 1))
    assert not tokenized_file(path, template).built  # a touch changes no content
    _write(path, [_conversation(k) for k in [0, 1, 2, 3, 4, 7]])  # same size, new content
    assert tokenized_file(path, template).built
    other = ChatTemplate(template.source + "{{- '' }}", template.tokenizer_path)
    assert tokenized_file(path, other).built  # the template
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes((template.tokenizer_path / "tokenizer.json").read_bytes() + b"\n")
    assert tokenized_file(path, ChatTemplate(template.source, tokenizer)).built  # the tokenizer


def test_an_interrupted_build_leaves_no_cache_that_is_reused(tmp_path, counted, monkeypatch):
    template, calls = counted
    path = _write(tmp_path / "chat.jsonl", [_conversation(k) for k in range(4)])
    saved = sft_cache.IndexCache.save

    def interrupted(self, arrays):
        self.directory.mkdir(parents=True, exist_ok=True)
        np.save(self.array_path("ids"), arrays["ids"])  # one array written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(sft_cache.IndexCache, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenized_file(path, template)
    monkeypatch.setattr(sft_cache.IndexCache, "save", saved)
    calls.clear()
    assert tokenized_file(path, template).built and len(calls) == 4
    assert not any(".tmp-" in name for name in os.listdir(tmp_path / "index-cache"))


def test_an_interrupt_while_tokenizing_writes_nothing(tmp_path, counted, monkeypatch):
    template, calls = counted
    path = _write(tmp_path / "chat.jsonl", [_conversation(k) for k in range(4)])
    tokenize = ChatTemplate.tokenize_messages

    def interrupted(self, *args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        return tokenize(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "tokenize_messages", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenized_file(path, template)
    assert not (tmp_path / "index-cache").exists() or not os.listdir(tmp_path / "index-cache")


def test_bad_rows_are_refused_with_file_and_row_or_counted(tmp_path, template):
    rows = [_conversation(0), "{not json", {"messages": [{"role": "user", "content": "hi"}]},
            _conversation(1), {"weird": 1}]
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConversationError, match=r"bad.jsonl, row 2: is not valid JSON"):
        tokenized_file(path, template)
    skipped = tokenized_file(path, template, skip_bad_rows=True)
    assert len(skipped) == 2 and skipped.skipped_rows == 3
    reloaded = tokenized_file(path, template, skip_bad_rows=True)
    assert not reloaded.built and reloaded.skipped_rows == 3
    with pytest.raises(ConversationError, match=r"row 2: is not valid JSON.*3 rows"):
        tokenized_file(path, template)  # the cache that skipped them is not served as clean
    clean = _write(tmp_path / "clean.jsonl", [_conversation(0)])
    assert tokenized_file(clean, template).built
    assert not tokenized_file(clean, template, skip_bad_rows=True).built


def test_tokenizing_reports_progress(tmp_path, template, monkeypatch, capsys):
    monkeypatch.setattr(sft_cache, "PROGRESS_INTERVAL_S", 0.0)
    path = _write(tmp_path / "chat.jsonl", [_conversation(k) for k in range(2)])
    tokenized_file(path, template)
    err = capsys.readouterr().err
    assert f"ptdp: tokenizing {path}: 2/2 rows (100%)" in err and ": done in" in err


def test_an_unwritable_directory_caches_in_ptdps_cache(tmp_path, template, monkeypatch):
    path = _write(tmp_path / "chat.jsonl", [_conversation(k) for k in range(3)])
    monkeypatch.setenv("PTDP_CACHE", str(tmp_path / "own"))
    monkeypatch.setattr(sft_cache.os, "access", lambda *args: False)
    assert tokenized_file(path, template).cache_dir == tmp_path / "own" / "sft"


# ------------------------------------------------------------------ samples

def _dataset(tokenized, **settings):
    options = dict(split="1", split_name="train", num_samples=12, seq_length=96, pad_id=0,
                   seed=5, pack_window=8, cache_dir=None)
    options.update(settings)
    return SFTDataset(tokenized, **options)


@pytest.fixture
def tokenized(tmp_path, template):
    return tokenized_file(_write(tmp_path / "chat.jsonl", [_conversation(k) for k in range(20)]),
                          template)


def _same(a, b):
    return all(np.array_equal(a[name], b[name]) for name in FIELDS)


def test_samples_are_fixed_shape_whole_conversations_and_pure_functions_of_the_seed(tokenized):
    dataset = _dataset(tokenized)
    assert len(dataset) >= 12
    forward = [dataset[i] for i in range(len(dataset))]
    backward = [dataset[i] for i in reversed(range(len(dataset)))][::-1]
    assert all(_same(a, b) for a, b in zip(forward, backward))
    for i, sample in enumerate(forward):
        assert {name: sample[name].shape for name in FIELDS} == {
            **{name: (96,) for name in FIELDS}, "cu_seqlens": (97,)}
        chosen = dataset.conversations_of(i)
        assert sample["document_ids"].max() in (len(chosen) - 1, len(chosen))
        start = 0
        for k in chosen:  # each conversation whole, positions from 0
            ids = tokenized.conversation(int(k)).ids
            assert sample["tokens"][start:start + len(ids)].tolist() == ids.tolist()
            assert sample["position_ids"][start:start + len(ids)].tolist() == list(range(len(ids)))
            start += len(ids)
    rebuilt = _dataset(tokenized)  # loaded from the pack cache
    assert not rebuilt.built and all(_same(a, rebuilt[i]) for i, a in enumerate(forward))
    other = _dataset(tokenized, seed=6)
    assert not all(_same(a, other[i]) for i, a in enumerate(forward[:len(other)]))
    stats = dataset.stats
    assert stats.sequences == len(dataset) and 0 < stats.loss_token_fraction < 1
    assert stats.conversations > stats.sequences  # packed: several conversations a sample
    assert stats.padding_fraction < _dataset(tokenized, packing=False).stats.padding_fraction


def test_resuming_at_n_continues_with_the_same_samples(tokenized):
    short, longer = _dataset(tokenized, num_samples=6), _dataset(tokenized, num_samples=40)
    assert len(longer) >= 40
    assert all(_same(short[i], longer[i]) for i in range(len(short)))


def test_conversations_longer_than_a_sample_are_cut_and_counted(tokenized):
    dataset = _dataset(tokenized, seq_length=8, num_samples=1)
    assert dataset.stats.truncated == dataset.stats.conversations == len(dataset) == 20
    sample = dataset[0]
    ids = tokenized.conversation(int(dataset.conversations_of(0)[0])).ids
    assert sample["tokens"].tolist() == ids[:8].tolist()
    assert sample["cu_seqlens"].tolist() == [0] + [8] * 8 and sample["loss_mask"][-1] == 0


def test_unpacked_mode_holds_one_conversation_per_sample(tokenized):
    dataset = _dataset(tokenized, packing=False, num_samples=25)
    assert len(dataset) == 40  # two whole epochs of 20
    for i in range(len(dataset)):
        assert len(dataset.conversations_of(i)) == 1
        assert dataset[i]["cu_seqlens"][:3].tolist() == [
            0, len(tokenized.conversation(int(dataset.conversations_of(i)[0])).ids), 96]
    assert sorted(np.concatenate([dataset.conversations_of(i) for i in range(20)])) == list(range(20))


def test_split_holds_out_whole_conversations_disjoint_and_deterministic(tokenized):
    def held(name, seed=5):
        dataset = _dataset(tokenized, split="60,20,20", split_name=name, seed=seed, num_samples=1)
        return {int(k) for i in range(len(dataset)) for k in dataset.conversations_of(i)}

    train, valid, test = held("train"), held("valid"), held("test")
    assert (len(train), len(valid), len(test)) == (12, 4, 4)
    assert train | valid | test == set(range(20)) and not train & valid and not valid & test
    assert held("valid") == valid and held("valid", seed=9) != valid


def test_blend_weights_are_respected(tmp_path, template):
    a = _write(tmp_path / "a.jsonl", [_conversation(k) for k in range(10)])
    b = _write(tmp_path / "b.jsonl", [_conversation(k) for k in range(10, 30)])
    train, valid, test = build_sft_datasets(["0.75", str(a), "0.25", str(b)], template,
                                            split="1", num_samples=(40, 0, 0), seq_length=48,
                                            pad_id=0, seed=1, pack_window=8)
    assert valid is None and test is None and len(train) == 40
    drawn = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert drawn.tolist() == [30, 10]
    assert _same(train[3], train.datasets[int(train.dataset_index[3])][
        int(train.dataset_sample_index[3])])
    assert blend_stats(train).sequences == sum(len(d) for d in train.datasets)


# ------------------------------------------------------------------ pretraining documents

def _megatron_positions(row, eod):
    """Megatron-LM's rule, restated: after EOD at i, positions from i + 1 drop by i + 1 - prev."""
    positions, previous = list(range(len(row))), 0
    for i in [j for j, token in enumerate(row) if token == eod]:
        for j in range(i + 1, len(row)):
            positions[j] -= i + 1 - previous
        previous = i + 1
    return positions


def _megatron_mask(row, eod):
    """Megatron-LM's reset attention mask: causal, and no row after an EOD sees up to it."""
    s = len(row)
    allowed = np.tril(np.ones((s, s), dtype=bool))
    for i in [j for j, token in enumerate(row) if token == eod]:
        allowed[i + 1:, :i + 1] = False
    return allowed


@pytest.mark.parametrize("rows", [[[5, 0, 3, 4, 0, 0, 7]], [[0, 1, 2, 3]], [[1, 2, 3, 0]],
                                  [[1, 2, 3, 4], [0, 0, 0, 0]], [[3, 0, 3, 3, 3, 0, 3, 3]]])
def test_documents_from_eod_follow_megatron(rows):
    tokens = torch.tensor(rows)
    documents = documents_from_eod(tokens, 0)
    for b, row in enumerate(rows):
        assert documents["position_ids"][b].tolist() == _megatron_positions(row, 0)
        ids = documents["document_ids"][b]
        same_document = (ids[:, None] == ids[None, :]).numpy()
        causal = np.tril(np.ones((len(row), len(row)), dtype=bool))
        assert np.array_equal(same_document & causal, _megatron_mask(row, 0))
        ends = documents["cu_seqlens"][b].tolist()
        assert ends[0] == 0 and ends[-1] == len(row) and len(ends) == len(row) + 1
        bounds = ends[:ends.index(len(row)) + 1]
        assert [int(ids[j]) for j in bounds[:-1]] == list(range(len(bounds) - 1))
    assert documents_from_eod(tokens, 0, reset_positions=False)["position_ids"].tolist() == [
        list(range(len(rows[0])))] * len(rows)
