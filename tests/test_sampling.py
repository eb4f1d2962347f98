"""Token sampling: greedy, top-k, nucleus, seeding, settings, the generate loop."""

import math

import pytest
import torch

from ptdp.sampling import SamplingSettings, filter_logits, generate, sample_next


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _support(logits, settings, draws=2000, seed=0):
    batch = logits.expand(draws, -1)
    return set(sample_next(batch, settings, _gen(seed)).tolist())


def test_temperature_zero_is_argmax():
    logits = torch.randn(6, 50, generator=_gen(1))
    settings = SamplingSettings(temperature=0.0, top_k=7, top_p=0.3)
    assert torch.equal(sample_next(logits, settings, _gen()), logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = torch.randn(64, 50, generator=_gen(2))
    settings = SamplingSettings(temperature=temperature, top_k=1)
    for seed in range(3):
        assert torch.equal(sample_next(logits, settings, _gen(seed)), logits.argmax(dim=-1))


def test_plain_sampling_reaches_the_whole_vocabulary_and_follows_the_probabilities():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = sample_next(probs.log().expand(20000, -1), SamplingSettings(), _gen(3))
    frequencies = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(frequencies, probs, atol=0.015)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 2.9]])
    assert _support(logits, SamplingSettings(top_k=3, temperature=3.0)) == {1, 3, 5}
    # ties at the k-th value still leave exactly k tokens
    tied = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert filter_logits(tied, SamplingSettings(top_k=2)).isfinite().sum() == 2


@pytest.mark.parametrize("top_p, nucleus", [
    (0.3, {2}),            # the most likely token alone already reaches 0.3
    (0.45, {2}),
    (0.55, {2, 0}),        # 0.5 < 0.55 <= 0.5 + 0.25
    (0.7, {2, 0}),
    (0.8, {2, 0, 3}),      # 0.75 < 0.8 <= 0.9
    (0.95, {2, 0, 3, 1}),  # 0.9 < 0.95 <= 0.97
    (0.99, {2, 0, 3, 1, 4}),
    (1.0, {2, 0, 3, 1, 4}),
])
def test_top_p_keeps_exactly_the_nucleus(top_p, nucleus):
    probs = torch.tensor([0.25, 0.07, 0.5, 0.15, 0.03])
    logits = probs.log().unsqueeze(0)
    assert _support(logits, SamplingSettings(top_p=top_p), draws=4000) == nucleus
    kept = filter_logits(logits, SamplingSettings(top_p=top_p)).isfinite()
    assert set(kept.nonzero()[:, 1].tolist()) == nucleus


def test_top_p_applies_after_temperature_and_top_k():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0)
    # top-k 2 renormalises to [0.625, 0.375]: top-p 0.6 keeps only the first
    assert _support(logits, SamplingSettings(top_k=2, top_p=0.6)) == {0}
    # without top-k, top-p 0.6 needs two tokens
    assert _support(logits, SamplingSettings(top_p=0.6)) == {0, 1}
    # a high temperature flattens: 1/3 each (nearly), so 0.6 needs two tokens even after top-k
    assert _support(logits, SamplingSettings(top_k=2, top_p=0.6, temperature=1000.0)) == {0, 1}


def test_padding_logits_are_never_sampled():
    logits = torch.zeros(1, 8)
    logits[:, 5:] = float("-inf")
    assert _support(logits, SamplingSettings(temperature=2.0)) == {0, 1, 2, 3, 4}


def test_same_seed_same_tokens():
    logits = torch.randn(32, 100, generator=_gen(4))
    settings = SamplingSettings(temperature=0.8, top_k=20, top_p=0.9)
    a = sample_next(logits, settings, _gen(7))
    b = sample_next(logits, settings, _gen(7))
    c = sample_next(logits, settings, _gen(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("changes, flag", [
    (dict(temperature=-0.5), "--temperature"),
    (dict(temperature=math.nan), "--temperature"),
    (dict(top_k=-1), "--top-k"),
    (dict(top_k=2.5), "--top-k"),
    (dict(top_p=0.0), "--top-p"),
    (dict(top_p=1.5), "--top-p"),
    (dict(max_new_tokens=0), "--max-new-tokens"),
])
def test_invalid_settings_name_the_flag(changes, flag):
    settings = SamplingSettings(**changes)
    with pytest.raises(ValueError, match=flag):
        sample_next(torch.zeros(1, 4), settings, _gen())
    with pytest.raises(ValueError, match=flag):
        generate(lambda t: torch.zeros(1, 4), [0], settings, max_context=4)


def test_all_problems_reported_together():
    with pytest.raises(ValueError, match="(?s)--temperature.*--top-k.*--top-p"):
        SamplingSettings(temperature=-1, top_k=-1, top_p=2.0).validate()


class _Counter:
    """next_logits that predicts (last token + 1) mod V and records its inputs."""

    def __init__(self, vocab=10):
        self.vocab, self.seen = vocab, []

    def __call__(self, tokens):
        assert tokens.dtype == torch.long and tokens.dim() == 2 and tokens.shape[0] == 1
        self.seen.append(tokens[0].tolist())
        logits = torch.full((1, self.vocab), -10.0)
        logits[0, (int(tokens[0, -1]) + 1) % self.vocab] = 10.0
        return logits


def test_generate_crops_the_context():
    model = _Counter()
    out = generate(model, [0, 1, 2], SamplingSettings(temperature=0.0, max_new_tokens=6),
                   max_context=4)
    assert out == [3, 4, 5, 6, 7, 8]
    assert max(len(s) for s in model.seen) == 4
    assert model.seen[0] == [0, 1, 2]
    assert model.seen[1] == [0, 1, 2, 3]
    assert model.seen[2] == [1, 2, 3, 4]
    assert model.seen[-1] == [4, 5, 6, 7]


def test_generate_stops_at_eod_without_returning_it():
    model = _Counter()
    out = generate(model, [5], SamplingSettings(temperature=0.0, max_new_tokens=20),
                   max_context=8, eod=9)
    assert out == [6, 7, 8]
    assert len(model.seen) == 4  # the step that produced eod, then nothing more
    # without eod it runs to max_new_tokens
    assert len(generate(_Counter(), [5], SamplingSettings(temperature=0.0, max_new_tokens=20),
                        max_context=8)) == 20


def test_generate_is_deterministic_given_the_seed():
    torch.manual_seed(0)
    table = torch.randn(10, 10)

    def next_logits(tokens):
        return table[tokens[0, -1]].unsqueeze(0)

    def run(seed):
        return generate(next_logits, [1], SamplingSettings(max_new_tokens=30, seed=seed),
                        max_context=4)

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(_Counter(), [], SamplingSettings(), max_context=4)
    with pytest.raises(ValueError, match="max_context"):
        generate(_Counter(), [1], SamplingSettings(), max_context=0)
    with pytest.raises(ValueError, match=r"\[1, vocab\]"):
        generate(lambda t: torch.zeros(2, 10), [1], SamplingSettings(), max_context=4)
