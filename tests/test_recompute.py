"""Activation recomputation changes memory, never numbers.

With dropout on (hidden 0.1, attention 0.1), every granularity and method
gives BITWISE the same loss and gradients as recomputation off from the same
seed, over two consecutive steps (so the random streams must also advance
identically), on one process and under tensor parallelism (t = 2, where each
rank's attention dropout draws from its own "tensor" stream, which the
recomputation must replay). Bitwise, not within a tolerance: the recomputed
forward runs the same CPU kernels on the same inputs with the same masks.

Also: two microbatches in flight (forward, forward, backward, backward, as
a pipeline schedule runs them) stay bitwise equal and the recomputation
leaves the live streams alone; without the tensor-stream replay the
gradients do differ (so the equality tests can fail); eval mode and no_grad
run the plain forward; block recomputes the first layers of a pipeline piece.

Memory is checked two ways:
* bytes held for backward, counted with saved-tensor hooks installed around
  the model call. Non-reentrant checkpoint packs what is saved inside a
  checkpointed region with its own (inner) hooks and keeps only a small
  handle, so the outer hooks see exactly what stays stored: tensors saved
  outside checkpointed regions plus each checkpoint's inputs. Counted once
  per storage (q, k and v are views of one buffer), parameters excluded.
  This is exact, so the tests check exact relations between the layouts.
* peak resident memory (the kernel's high-water mark, reset after a
  warm-up) of fresh processes running one forward + backward of a model
  whose activations dominate. glibc is told to serve every allocation above
  64 KiB by mmap (MALLOC_MMAP_THRESHOLD_), so that freed tensors leave the
  resident set at once and the peak follows the live tensors; by default
  glibc keeps freed blocks of up to 32 MiB in its heap, and the recomputed
  runs, which free and reallocate more, then look worse than they are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ptdp.config import ModelConfig
from ptdp.model import gpt as gpt_module
from ptdp.model import recompute as recompute_module
from ptdp.model.gpt import GPT
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.perf.analytic.saved import SavedTensorBytes

SEED = 7
LAYERS = 4
CONFIG = ModelConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=16,
                     vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.1,
                     attention_dropout=0.1)


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: extra threads only wait for each other (and
    stall when the machine is busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _full(method: str, n: int) -> dict:
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=n)


# Uniform groups of 1, 2 (divides 4) and 3 (does not: groups of 3 and 1);
# block on the first 1 and 2 layers; selective.
LAYOUTS = {
    "full-uniform-1": _full("uniform", 1),
    "full-uniform-2": _full("uniform", 2),
    "full-uniform-3": _full("uniform", 3),
    "full-block-1": _full("block", 1),
    "full-block-2": _full("block", 2),
    "selective": dict(recompute_granularity="selective"),
}


def _build(config: ModelConfig, ctx: ParallelContext, **kwargs) -> GPT:
    rng = RNGStreams(torch.device("cpu"))
    rng.seed(SEED, ctx)
    return GPT(config, ctx, rng, **kwargs).initialize(SEED).train()


def _batch(config: ModelConfig, batch: int = 3, seed: int = 11):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _train(config: ModelConfig, ctx: ParallelContext, steps: int = 2) -> list[dict]:
    """`steps` forward + backward passes (new batch each, no optimizer):
    per step the loss, every gradient and the random streams afterwards."""
    model = _build(config, ctx)
    results = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        tokens, labels = _batch(config, seed=11 + step)
        loss = model(tokens, labels)
        loss.backward()
        results.append(dict(loss=loss.detach(),
                            grads={n: p.grad.clone() for n, p in model.named_parameters()},
                            rng=model.rng.get_states()))
    return results


def _assert_bitwise(results: list[dict], reference: list[dict], what: str) -> None:
    for step, (got, want) in enumerate(zip(results, reference)):
        assert torch.equal(got["loss"], want["loss"]), f"{what} step {step}: loss"
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            assert torch.equal(got["grads"][name], grad), f"{what} step {step}: grad of {name}"
        assert got["rng"].keys() == want["rng"].keys()
        for stream, state in want["rng"].items():
            assert torch.equal(got["rng"][stream], state), f"{what} step {step}: {stream} stream"


def _check_all_layouts(ctx: ParallelContext, what: str) -> list[float]:
    reference = _train(CONFIG, ctx)
    # Attention dropout really draws from the tensor stream.
    assert reference[0]["rng"]["tensor"].ne(_build(CONFIG, ctx).rng.states["tensor"]).any()
    for name, layout in LAYOUTS.items():
        _assert_bitwise(_train(dataclasses.replace(CONFIG, **layout), ctx), reference,
                        f"{what} {name}")
    return [r["loss"].item() for r in reference]


def test_every_layout_is_bitwise_equal_to_no_recomputation_one_process():
    losses = _check_all_layouts(ParallelContext.single(), "t=1")
    assert losses[0] != losses[1]


def _tensor_parallel_layouts(rank: int) -> tuple[list[float], torch.Tensor]:
    ctx = ParallelContext.build(RankGrid(tp=2, dp=1, pp=1))
    losses = _check_all_layouts(ctx, f"t=2 rank {rank}")
    return losses, _build(CONFIG, ctx).rng.states["tensor"]


def test_every_layout_is_bitwise_equal_to_no_recomputation_tensor_parallel(pools):
    (losses0, tensor0), (losses1, tensor1) = pools(2).run(_tensor_parallel_layouts)
    assert losses0 == losses1  # the loss is replicated over the tensor group
    assert not torch.equal(tensor0, tensor1)  # each rank replayed its own stream


def _in_flight(config: ModelConfig) -> list:
    """Two microbatches in flight, as a pipeline schedule keeps them: both
    forwards, then both backwards, oldest first. Each recomputation must
    replay its own forward's streams and leave the live ones untouched."""
    model = _build(config, ParallelContext.single())
    losses = [model(*_batch(config, seed=20 + i)) for i in range(2)]
    live = model.rng.get_states()
    results = []
    for loss in losses:
        loss.backward()
        assert all(torch.equal(model.rng.get_states()[k], s) for k, s in live.items())
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return [loss.detach() for loss in losses] + results


def test_microbatches_in_flight():
    reference = _in_flight(CONFIG)
    for name in ("full-uniform-2", "full-block-1", "selective"):
        result = _in_flight(dataclasses.replace(CONFIG, **LAYOUTS[name]))
        assert all(torch.equal(a, b) for a, b in zip(result[:2], reference[:2])), name
        for got, want in zip(result[2:], reference[2:]):
            assert all(torch.equal(got[n], g) for n, g in want.items()), name


def test_tensor_stream_replay_is_what_makes_it_exact(monkeypatch):
    """Without swapping the saved "tensor" stream in, the recomputed
    attention dropout draws other masks: the gradients (and the live stream)
    differ. So the equality above really tests the replay."""
    class NoReplay:
        def __init__(self, rng, saved):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc_info):
            pass

    ctx = ParallelContext.single()
    reference = _train(CONFIG, ctx, steps=1)[0]
    monkeypatch.setattr(recompute_module, "_ReplayedStreams", NoReplay)
    for name in ("full-uniform-1", "selective"):
        result = _train(dataclasses.replace(CONFIG, **LAYOUTS[name]), ctx, steps=1)[0]
        assert torch.equal(result["loss"], reference["loss"])  # the forward is unchanged
        assert not torch.equal(result["grads"]["layers.0.attention.query_key_value.weight"],
                               reference["grads"]["layers.0.attention.query_key_value.weight"])
        assert not torch.equal(result["rng"]["tensor"], reference["rng"]["tensor"])


def test_backward_twice_with_retained_graph_recomputes_the_same():
    """A retained graph is recomputed on each backward, each time with the
    streams of the original forward."""
    results = []
    for layout in ({}, LAYOUTS["full-uniform-2"], LAYOUTS["selective"]):
        # The layers only: the cross entropy's backward works in place on
        # what it saved, so the whole model cannot run backward twice.
        model = _build(dataclasses.replace(CONFIG, **layout), ParallelContext.single(),
                       post_process=False)
        hidden = model(_batch(CONFIG)[0])
        loss = (hidden * torch.linspace(-1.0, 1.0, hidden.numel()).view_as(hidden)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        results.append(({n: p.grad for n, p in model.named_parameters()}, model.rng.get_states()))
    for grads, states in results[1:]:
        assert all(torch.equal(grads[n], g) for n, g in results[0][0].items())
        assert all(torch.equal(states[k], s) for k, s in results[0][1].items())


def test_no_recomputation_in_eval_or_without_grad(monkeypatch):
    def refuse(*args):
        raise AssertionError("checkpoint called outside training with grad")

    monkeypatch.setattr(gpt_module, "checkpoint", refuse)
    tokens, labels = _batch(CONFIG)
    for layout in (LAYOUTS["full-uniform-1"], LAYOUTS["full-block-2"], LAYOUTS["selective"]):
        model = _build(dataclasses.replace(CONFIG, **layout), ParallelContext.single())
        model.eval()(tokens, labels).backward()
        with torch.no_grad():
            model.train()(tokens, labels)


def _layer_entries(model: GPT, run) -> dict[int, int]:
    """How often each transformer layer's forward is entered during `run`."""
    counts = {i: 0 for i in model.layer_ids}

    def enter(i):
        return lambda *_: counts.__setitem__(i, counts[i] + 1)

    handles = [layer.register_forward_pre_hook(enter(int(i))) for i, layer in model.layers.items()]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return counts


def test_which_layers_are_recomputed_in_a_pipeline_piece():
    """A checkpointed layer runs twice (forward, then recomputed in backward).
    Block recomputes the first n layers of the piece; uniform every layer."""
    config = dataclasses.replace(CONFIG, num_layers=6)
    ctx = ParallelContext.single()
    hidden = torch.randn(config.seq_length, 3, config.hidden_size, requires_grad=True)
    _, labels = _batch(config)
    expected = {
        "full-block-2": {2: 2, 3: 2, 4: 1},
        "full-uniform-2": {2: 2, 3: 2, 4: 2},
        "selective": {2: 1, 3: 1, 4: 1},
        "off": {2: 1, 3: 1, 4: 1},
    }
    for name, counts in expected.items():
        layout = LAYOUTS.get(name, {})
        piece = _build(dataclasses.replace(config, **layout), ctx, layer_ids=[2, 3, 4],
                       pre_process=False)
        assert _layer_entries(piece, lambda: piece(hidden, labels).backward()) == counts, name


def _saved_activation_bytes(config: ModelConfig, batch: int = 2) -> int:
    """Bytes of distinct storages held for backward after one forward,
    parameters excluded (see the module docstring)."""
    model = _build(config, ParallelContext.single())
    tokens, labels = _batch(config, batch=batch)
    with SavedTensorBytes(model.parameters()) as saved:
        loss = model(tokens, labels)
    loss.backward()
    return saved.bytes


def test_saved_activation_bytes():
    config = dataclasses.replace(CONFIG, seq_length=64)
    layer_input = config.seq_length * 2 * config.hidden_size * 4  # [s, b, h] fp32
    saved = {name: _saved_activation_bytes(dataclasses.replace(config, **layout))
             for name, layout in [("off", {}), *LAYOUTS.items(),
                                  ("full-uniform-4", _full("uniform", LAYERS)),
                                  ("full-block-4", _full("block", LAYERS))]}
    # Uniform keeps one layer input per group of n layers, nothing else inside
    # the layers: ceil(l/n) inputs.
    for n in (1, 2, 3):
        groups = math.ceil(LAYERS / n)
        assert saved[f"full-uniform-{n}"] - saved["full-uniform-4"] == (groups - 1) * layer_input
    # Block over every layer is uniform with groups of one; fewer checkpointed
    # layers keep more, and block 0 would be "off".
    assert saved["full-block-4"] == saved["full-uniform-1"]
    assert saved["full-uniform-1"] < saved["full-block-2"] < saved["full-block-1"] < saved["off"]
    # Selective drops the attention internals (s×s scores, softmax, mask) but
    # keeps the rest of each layer.
    assert saved["full-block-4"] < saved["selective"] < saved["off"]
    per_layer_off = (saved["off"] - saved["full-uniform-1"]) / LAYERS
    per_layer_selective = (saved["selective"] - saved["full-uniform-1"]) / LAYERS
    assert per_layer_selective < 0.6 * per_layer_off


_PEAK_RSS_SCRIPT = """
import gc, json, re, sys
import torch
from ptdp.config import ModelConfig
from ptdp.model.gpt import GPT
from ptdp.parallel.tensor import RNGStreams
from ptdp.parallel.topology import ParallelContext

def status(field):
    text = open("/proc/self/status").read()
    return int(re.search(field + r":\\s+(\\d+) kB", text).group(1)) * 1024

torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
batch = spec.pop("batch")
config = ModelConfig(**spec)
rng = RNGStreams(torch.device("cpu"))
rng.seed(7, ParallelContext.single())
model = GPT(config, ParallelContext.single(), rng).initialize(7).train()
tokens = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1),
                       generator=torch.Generator().manual_seed(0))
# Warm up on a tiny batch, so that code and modules first touched by a
# backward pass (checkpoint imports parts of torch._dynamo) are in the
# baseline rather than in the measured peak.
model(tokens[:1, :9], tokens[:1, 1:10]).backward()
model.zero_grad(set_to_none=True)
gc.collect()
try:  # reset the peak (VmHWM) to the current resident set (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    print(json.dumps(None))
    sys.exit()
baseline = status("VmRSS")
model(tokens[:, :-1], tokens[:, 1:]).backward()
print(json.dumps(dict(baseline=baseline, peak=status("VmHWM"))))
"""


def test_peak_resident_memory_of_fresh_processes():
    """One forward + backward in a fresh process per layout (run side by
    side, one thread each): full recomputation clearly lowers the peak,
    selective lowers it too. Sizes: attention (s = 512) dominates.

    The peak is the kernel's high-water mark (VmHWM), reset after warm-up;
    ru_maxrss cannot be reset and, on Linux, also carries the resident size
    of the parent at fork (it survives exec), i.e. of this test process."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset and read the peak resident set")
    base = dict(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=512,
                vocab_size=1000, hidden_dropout=0.1, attention_dropout=0.1, batch=2)
    layouts = {"off": {}, "full-uniform-1": LAYOUTS["full-uniform-1"],
               "selective": LAYOUTS["selective"]}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    processes = {name: subprocess.Popen([sys.executable, "-c", _PEAK_RSS_SCRIPT,
                                         json.dumps({**base, **layout})],
                                        cwd=root, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                 for name, layout in layouts.items()}
    peaks = {}
    try:
        for name, process in processes.items():
            out, err = process.communicate(timeout=600)  # a hang guard; seconds when idle
            assert process.returncode == 0, f"{name}:\n{err}"
            result = json.loads(out.strip().splitlines()[-1])
            if result is None:
                pytest.skip("cannot reset the peak resident set (/proc/self/clear_refs)")
            peaks[name] = result["peak"] - result["baseline"]
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    report = {name: f"{peak / 2**20:.0f} MiB" for name, peak in peaks.items()}
    assert peaks["full-uniform-1"] < 0.75 * peaks["off"], report
    assert peaks["selective"] < peaks["off"], report
