"""ptdp.parallel.local_attention against a dense reference written here: the
explicit masked softmax with the sink as an extra column (as transformers'
gpt-oss eager attention), the window as Hugging Face's sliding window
(kv_idx > q_idx − W, W = L + 1). Outputs and the gradients of q, k, v and
the sinks, in fp64 (1e-12) and fp32 (1e-6 of the largest entry), over block-edge windows, GQA,
odd and Gemma-sized heads; the sink gradient against finite differences;
the visited blocks against the dense mask."""

import math

import pytest
import torch
import torch.nn.functional as F

from ptdp.parallel.local_attention import (local_attention, visited_blocks, window_left,
                                           window_mask)


@pytest.fixture(autouse=True)
def _one_thread():
    """Many tiny blocks: OpenMP's spinning threads crawl on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_mask(s, left):
    """Hugging Face's sliding window with causality, from positions alone."""
    q_idx = torch.arange(s).view(-1, 1)
    kv_idx = torch.arange(s).view(1, -1)
    causal = kv_idx <= q_idx
    return causal if left is None else causal & (kv_idx > q_idx - (left + 1))


def reference_attention(q, k, v, left, sinks, scale=None):
    heads, groups, s, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k = k.repeat_interleave(heads // groups, dim=1)
    v = v.repeat_interleave(heads // groups, dim=1)
    scale = d ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~reference_mask(s, left), -math.inf)
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, s, 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ v


def _inputs(b, heads, groups, s, d, dtype, sink, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    q, k, v = tensor(b, heads, s, d), tensor(b, groups, s, d), tensor(b, groups, s, d)
    sinks = {"none": None, "zero": torch.zeros(heads, dtype=dtype),
             "learnable": tensor(heads) * 2}[sink]
    return q, k, v, sinks, tensor(b, heads, s, d)


def _compare(b, heads, groups, s, d, left, block, sink, dtype, kernel, tolerance, scale=None):
    q, k, v, sinks, dout = _inputs(b, heads, groups, s, d, dtype, sink)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks) if t is not None]
    window = None if left is None else (left, 0)
    out = local_attention(q, k, v, window=window, sinks=sinks, scale=scale, block=block,
                          kernel=kernel)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    # The reference in fp64 from the same inputs.
    exact = [t.detach().double().requires_grad_() for t in leaves]
    q64, k64, v64 = exact[:3]
    sinks64 = exact[3] if sinks is not None else None
    ref = reference_attention(q64, k64, v64, left, sinks64, scale)
    expected = [ref, *torch.autograd.grad(ref, exact, dout.double())]
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for name, a, e in zip(names, got, expected):
        assert a.dtype == dtype and a.shape == e.shape, name
        # Relative to the tensor's largest entry: fp32's rounding over sums of d
        # or s terms (the fp32 dense reference itself is off by ~2e-6 at d = 256).
        error = (a.double() - e).abs().max().item() / max(1.0, e.abs().max().item())
        assert error <= tolerance, (name, error)


# (b, heads, groups, s, d, left, block, sink): the window's edge against the
# blocks (shorter than a block, one more or less than it, straddling two),
# s not a multiple of the block, windows reaching or passing s, GQA, odd
# head sizes and Gemma 3's 256.
CASES = [
    (2, 4, 2, 37, 8, 5, 8, "learnable"),      # window inside a block, tail block of 5
    (1, 4, 4, 40, 8, 8, 8, "zero"),           # L = block: edge on a boundary
    (1, 2, 1, 41, 5, 9, 8, "learnable"),      # L = block + 1: one key of the block before last
    (1, 6, 3, 50, 7, 7, 8, "none"),           # L = block − 1: diagonal exactly covered
    (2, 4, 1, 45, 16, 20, 8, "learnable"),    # edge in the middle, interior rectangle of 1
    (1, 2, 2, 64, 8, 33, 8, "learnable"),     # interior of several blocks merged
    (1, 4, 2, 30, 8, 29, 8, "learnable"),     # L = s − 1: the whole sequence, one call
    (1, 4, 2, 30, 8, 100, 8, "none"),         # L > s
    (1, 2, 1, 24, 8, None, 8, "learnable"),   # unbounded, with a sink
    (1, 2, 1, 33, 8, 0, 8, "learnable"),      # L = 0: each query sees only itself
    (1, 2, 1, 40, 256, 11, 16, "learnable"),  # Gemma 3's head size
    (1, 3, 1, 19, 3, 4, 1, "zero"),           # blocks of one position
    (1, 2, 2, 48, 8, 14, 8, "learnable"),     # one key past the edge block's reach: masked
    (1, 2, 1, 30, 8, 6, 8, "none"),           # L = block − 2: the diagonal masked
]


@pytest.mark.parametrize("case", CASES)
def test_fp64_equals_the_dense_reference(case):
    _compare(*case, torch.float64, "plain", 1e-12)


@pytest.mark.parametrize("case", CASES[:6] + CASES[10:11])
@pytest.mark.parametrize("kernel", ["plain", "auto"])
def test_fp32_equals_the_dense_reference(case, kernel):
    _compare(*case, torch.float32, kernel, 1e-6)


def test_a_given_scale_is_used():
    _compare(1, 2, 1, 30, 16, 6, 8, "learnable", torch.float64, "plain", 1e-12, scale=0.07)


def test_a_skipped_key_block_that_a_row_sees_is_caught():
    """With L = block + 1 only the first row of each query block sees one key
    of the block two back; leaving those blocks out moves exactly those rows."""
    q, k, v, sinks, _ = _inputs(1, 2, 1, 40, 8, torch.float64, "none")
    block, left = 8, 9
    assert (3, 1) in visited_blocks(40, block, (left, 0))
    expected = reference_attention(q, k, v, left, None)
    assert torch.allclose(local_attention(q, k, v, window=(left, 0), sinks=None, block=block,
                                          kernel="plain"), expected, atol=1e-12)
    narrower = local_attention(q, k, v, window=(left - 1, 0), sinks=None, block=block,
                               kernel="plain")
    moved = (narrower - expected).abs().amax(dim=(0, 1, 3)) > 1e-6
    assert moved.nonzero().flatten().tolist() == list(range(left, 40))


def test_a_window_over_the_whole_sequence_is_causal_attention():
    q, k, v, _, _ = _inputs(2, 4, 2, 45, 16, torch.float32, "none")
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                              v.repeat_interleave(2, 1), is_causal=True)
    for window in (None, (-1, 0), (44, 0), (1000, 0)):
        got = local_attention(q, k, v, window=window, sinks=None, block=8)
        assert torch.allclose(got, expected, atol=1e-6, rtol=0), window


def test_the_sink_gradient_equals_finite_differences():
    q, k, v, sinks, dout = _inputs(2, 3, 1, 21, 4, torch.float64, "learnable")
    sinks.requires_grad_()

    def loss(s):
        return (local_attention(q, k, v, window=(6, 0), sinks=s, block=4) * dout).sum()

    (grad,) = torch.autograd.grad(loss(sinks), sinks)
    step = 1e-6
    for h in range(3):
        shift = torch.zeros(3, dtype=torch.float64)
        shift[h] = step
        estimate = (loss(sinks.detach() + shift) - loss(sinks.detach() - shift)) / (2 * step)
        assert abs(grad[h].item() - estimate.item()) < 1e-8, h
    assert grad.abs().min() > 1e-3   # a gradient that is there to get wrong


def test_fp32_sinks_with_bf16_activations():
    q, k, v, _, dout = _inputs(1, 4, 2, 33, 16, torch.bfloat16, "none")
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = local_attention(q, k, v, window=(10, 0), sinks=sinks, block=8)
    (grad,) = torch.autograd.grad(out, sinks, dout)
    ref = reference_attention(q.double(), k.double(), v.double(), 10,
                              sinks.detach().double().requires_grad_())
    assert out.dtype == torch.bfloat16 and grad.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 2e-2


# ------------------------------------------------------------------ masks and blocks

@pytest.mark.parametrize("s, left", [(1, 0), (17, 0), (17, 4), (16, 15), (16, 40), (9, None)])
def test_window_mask_is_hugging_faces_sliding_window(s, left):
    window = None if left is None else (left, 0)
    assert torch.equal(window_mask(s, window), reference_mask(s, left))


@pytest.mark.parametrize("s, block, left", [(37, 8, 5), (40, 8, 8), (41, 8, 9), (50, 8, 7),
                                            (45, 8, 20), (30, 8, 100), (19, 1, 4), (24, 8, None),
                                            (33, 8, 0), (100, 7, 13)])
def test_the_visited_blocks_are_exactly_those_the_window_touches(s, block, left):
    mask = reference_mask(s, left)
    n = math.ceil(s / block)
    touched = [(qb, kb) for qb in range(n) for kb in range(n)
               if mask[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].any()]
    window = None if left is None else (left, 0)
    assert visited_blocks(s, block, window) == touched


def test_a_short_window_skips_most_blocks():
    # 8 query blocks of 128, L = 128: the diagonal and the block before it.
    assert len(visited_blocks(1024, 128, (128, 0))) == 8 + 7
    assert len(visited_blocks(1024, 128, None)) == 8 * 9 // 2


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("window, words", [((4, 2), "R must be 0"), ((-2, 0), "-1 for all"),
                                           ((3,), "two integers"), ((1.5, 0), "two integers")])
def test_windows_a_causal_attention_cannot_take_are_refused(window, words):
    with pytest.raises(ValueError, match=words):
        window_left(window)


def test_wrong_shapes_are_refused():
    q, k, v, _, _ = _inputs(1, 4, 2, 8, 4, torch.float32, "none")
    with pytest.raises(ValueError, match="one logit per attention head"):
        local_attention(q, k, v, window=(2, 0), sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="groups dividing the heads"):
        local_attention(q, k[:, :, :4], v[:, :, :4], window=(2, 0), sinks=None)
    with pytest.raises(ValueError, match="positive number"):
        local_attention(q, k, v, window=(2, 0), sinks=None, block=0)


# ------------------------------------------------------------------ a device's windowed kernel

def _emulated_window_kernel(monkeypatch, off_by_one: bool = False):
    """window_kernel's two calls of the device op replaced by "plain" blocks
    under the window mask (CPUs have no such op): what is tested is the
    sinks after the kernel, the autograd around it, the probe and the
    routing. `off_by_one`: a kernel whose window is one key too wide."""
    from ptdp.parallel import window_kernel
    from ptdp.parallel.block_attention import block_backward, block_forward

    def mask(q, left):
        return window_mask(q.shape[2], (left + off_by_one, 0)).view(1, 1, q.shape[2], -1)

    def forward(q, k, v, left, scale):
        out, lse = block_forward(q, k, v, False, scale, "plain", mask(q, left))
        return out.to(q.dtype), lse, ()

    def backward(dout, q, k, v, out, lse, left, scale, state):
        return block_backward(dout, q, k, v, out, lse, False, scale, "plain", mask(q, left))

    monkeypatch.setattr(window_kernel, "_forward", forward)
    monkeypatch.setattr(window_kernel, "_backward", backward)
    return window_kernel


def test_the_windowed_kernel_probe_accepts_a_right_kernel_and_refuses_a_wrong_one(monkeypatch):
    window_kernel = _emulated_window_kernel(monkeypatch)
    assert window_kernel._agrees(torch.device("cpu"), torch.float32, 16)
    window_kernel = _emulated_window_kernel(monkeypatch, off_by_one=True)
    assert not window_kernel._agrees(torch.device("cpu"), torch.float32, 16)
    assert window_kernel.windowed_kernel("cpu", torch.bfloat16, 64) is None  # none on a CPU


def test_local_attention_runs_the_windowed_kernel_where_the_device_has_one(monkeypatch):
    """Routed to the device's kernel (emulated), the output and the gradients
    of q, k, v and the sinks equal the dense reference's; a window covering
    the sequence, or a kernel named explicitly, keeps the block plan."""
    window_kernel = _emulated_window_kernel(monkeypatch)
    calls = []
    real = window_kernel.WindowKernelAttention.apply

    def counted(*args):
        calls.append(args[4])
        return real(*args)

    monkeypatch.setattr(window_kernel.WindowKernelAttention, "apply", counted)
    monkeypatch.setattr("ptdp.parallel.local_attention.windowed_kernel",
                        lambda *args: window_kernel.WINDOW_KERNEL)
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, h, 40, 8, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = local_attention(q, k, v, window=(6, 0), sinks=sinks)
    want = reference_attention(q, k, v, 6, sinks)
    assert calls == [6]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    expected = torch.autograd.grad(want, (q, k, v, sinks), dout)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    local_attention(q, k, v, window=(39, 0), sinks=sinks)
    local_attention(q, k, v, window=(6, 0), sinks=sinks, kernel="plain")
    assert calls == [6]
