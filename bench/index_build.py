"""GPT dataset index build time for 10^8 tokens (and the blend index for 10^6 samples).

Writes an indexed dataset of 10^8 random uint16 tokens in documents of 100..2000
tokens (numpy straight to .bin/.idx, in a temporary directory), then times
building the GPT index (document order, sample boundaries, sample shuffle)
for seq_length 1024 and 2048, one and three epochs; peak memory is the
largest tracemalloc figure during a build (numpy reports its buffers to
tracemalloc; each call is timed untraced). Also times the whole GPTDataset (build + cache write), loading
it back from the cache, and the greedy blend index of 10^6 samples. Prints a
Markdown table; --write appends it to bench/RESULTS.md under
"## Index build time".

    .venv/bin/python bench/index_build.py [--tokens 100000000] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import struct
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from ptdp.data.gpt_dataset import (GPTDataset, build_blend_index, build_gpt_index, epochs_for,
                                   samples_in_epochs)
from ptdp.data.indexed import MAGIC, VERSION, IndexedDataset

from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

HEADING = "## Index build time"
UINT16_CODE = 8  # Megatron's dtype code of uint16


def write_random_dataset(prefix: str, num_tokens: int, seed: int = 0) -> int:
    """Documents of 100..2000 tokens, num_tokens in all; returns the document count."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(100, 2001, size=num_tokens // 100 + 1, dtype=np.int64)
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, num_tokens)) + 1
    lengths = lengths[:count]
    lengths[-1] -= ends[count - 1] - num_tokens  # trim the last document to the total
    with open(prefix + ".bin", "wb") as file:
        for start in range(0, num_tokens, 1 << 24):
            size = min(1 << 24, num_tokens - start)
            file.write(rng.integers(0, 50257, size=size, dtype=np.uint16).tobytes())
    pointers = np.zeros(count, dtype=np.int64)
    pointers[1:] = np.cumsum(lengths[:-1]) * 2
    with open(prefix + ".idx", "wb") as file:
        file.write(struct.pack("<9sQBQQ", MAGIC, VERSION, UINT16_CODE, count, count + 1))
        file.write(lengths.astype("<i4").tobytes())
        file.write(pointers.astype("<i8").tobytes())
        file.write(np.arange(count + 1, dtype="<i8").tobytes())
    return count


def measured(function):
    """(result, seconds, peak traced bytes): timed in one call, memory traced
    in a second (tracemalloc slows Python-level allocation tenfold)."""
    start = time.perf_counter()
    result = function()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    function()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def run(num_tokens: int, blend_samples: int) -> str:
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as directory:
        prefix = str(Path(directory) / "tokens")
        start = time.perf_counter()
        documents = write_random_dataset(prefix, num_tokens)
        print(f"wrote {num_tokens:,} tokens in {documents:,} documents "
              f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        indexed, open_seconds, _ = measured(lambda: IndexedDataset(prefix))
        lengths = indexed.sequence_lengths
        rows = []
        for seq_length in (1024, 2048):
            for epochs in (1, 3):
                index, seconds, peak = measured(lambda: build_gpt_index(
                    lengths, seq_length=seq_length, seed=1234, num_epochs=epochs))
                size = sum(array.nbytes for array in index.values())
                rows.append(f"| build_gpt_index | {seq_length} | {epochs} | "
                            f"{len(index['shuffle_index']):,} | {seconds:.2f} | {peak / mib:.0f} "
                            f"| {size / mib:.1f} |")
                del index
        cache = Path(directory) / "cache"
        seq_length = 2048
        samples = samples_in_epochs(1, num_tokens, seq_length)
        assert epochs_for(samples, num_tokens, seq_length) == 1

        def dataset(build: bool) -> GPTDataset:
            return GPTDataset(indexed, prefix, range(len(indexed)), split_name="train",
                              num_samples=samples, seq_length=seq_length, seed=1234,
                              cache_dir=cache, build=build)

        start = time.perf_counter()
        built = dataset(True)  # timed alone: a second call would find the cache
        build_seconds = time.perf_counter() - start
        loaded, load_seconds, load_peak = measured(lambda: dataset(False))
        rows.append(f"| GPTDataset, build + write cache | {seq_length} | 1 | {len(built):,} | "
                    f"{build_seconds:.2f} | | |")
        rows.append(f"| GPTDataset, load cache (mmap) | {seq_length} | 1 | {len(loaded):,} | "
                    f"{load_seconds:.3f} | {load_peak / mib:.0f} | |")
        probes = range(0, len(loaded), max(1, len(loaded) // 1000))
        start = time.perf_counter()
        for i in probes:
            loaded[i]
        read_us = (time.perf_counter() - start) / len(probes) * 1e6
        del built, loaded, indexed
    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2]):
        index, seconds, peak = measured(lambda: build_blend_index(weights, blend_samples))
        rows.append(f"| build_blend_index, {len(weights)} datasets | | | {blend_samples:,} | "
                    f"{seconds:.2f} | {peak / mib:.0f} | |")
    command = shlex.join(["python", "bench/index_build.py", *sys.argv[1:]])
    lines = [f"### {datetime.date.today().isoformat()}: {num_tokens:,} uint16 tokens, "
             f"{documents:,} documents of 100..2000 tokens",
             "", f"Command: `{command}`  ",
             f"numpy {np.__version__}, Python {platform.python_version()}, {cpu_name()}; peak = "
             f"tracemalloc peak during the call; opening the indexed dataset (checks every "
             f"index entry) took {open_seconds:.2f} s; reading one sample (s = 2048) takes "
             f"{read_us:.0f} µs.", "",
             "| what | seq length | epochs | samples | seconds | peak memory (MiB) | index (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|", *rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=10 ** 8)
    parser.add_argument("--blend-samples", type=int, default=10 ** 6)
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args(argv)
    block = run(args.tokens, args.blend_samples)
    publish(HEADING, block, write=args.write)


if __name__ == "__main__":
    main()
