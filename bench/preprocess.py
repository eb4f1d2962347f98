"""Preprocessing throughput (tokens/s), one worker vs several, GPT-2 BPE.

Tokenizes a corpus with `ptdp.data.preprocess.preprocess` once per worker
count (default 1 and 2) into a temporary directory and reports tokens/s,
input MB/s and the speed-up over the first count, and whether every run
wrote the same bytes. The time is the whole call as a user sees it:
worker start-up (spawn), the check pass, encoding, merging and the commit.
Input files are read once beforehand so every run finds them in the page
cache. Prints a Markdown table; --write appends it to bench/RESULTS.md
under "## Preprocessing throughput".

    .venv/bin/python bench/preprocess.py                      # the demo corpus (Shakespeare) × 4
    .venv/bin/python bench/preprocess.py --input a.jsonl b.txt --workers 1 2 4 --write
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ptdp.data.preprocess import TokenizerSpec, preprocess

from results import cpu_name, publish  # bench/results.py: the script folder is on sys.path

HEADING = "## Preprocessing throughput"


def demo_corpus_files(directory: Path, copies: int) -> list[Path]:
    """The demo corpus as text files, one per work (one document each),
    `copies` times over: 5 MB once is too little to amortise worker start-up."""
    from ptdp.data.corpus import read_works

    paths = []
    for copy in range(copies):
        for name, text in read_works():
            path = directory / f"{copy}-{Path(name).name}"
            path.write_text(text, encoding="utf-8")
            paths.append(path)
    return paths


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def measure(inputs: list[Path], spec: TokenizerSpec, workers: int, json_keys: list[str],
            repeat: int, scratch: Path) -> tuple[dict, bytes]:
    """The fastest of `repeat` runs, and the bytes it wrote (to compare runs)."""
    best = None
    out = scratch / f"workers{workers}"
    out.mkdir()
    for _ in range(repeat):
        result = preprocess(inputs, out / "bench", spec, json_keys=json_keys, append_eod=True,
                            workers=workers, progress=False)
        if best is None or result["seconds"] < best["seconds"]:
            best = result
    written = b"".join(Path(path).read_bytes() for path in best["files"])
    return best, written


def report(rows: list[tuple[int, dict]], identical: bool, description: str, command: str,
           spec: TokenizerSpec) -> str:
    first = rows[0][1]
    lines = [
        f"### {datetime.date.today().isoformat()}: {description}",
        "",
        f"Command: `{command}`  ",
        f"{first['documents']:,} documents, {first['input_bytes'] / 1e6:.1f} MB, "
        f"{first['tokens']:,} tokens ({spec.tokenizer_type}, end-of-document appended, "
        f"{first['dtype']}); {cpu_name()}, {os.cpu_count()} CPUs; numpy "
        f"{package_version('numpy')}, torch {package_version('torch')}, tiktoken "
        f"{package_version('tiktoken')}; output identical for every worker count: "
        f"{'yes' if identical else 'NO'}.",
        "",
        "| workers | seconds | tokens/s | input MB/s | speed-up vs 1st row |",
        "|---:|---:|---:|---:|---:|",
    ]
    for workers, result in rows:
        seconds = result["seconds"]
        lines.append(f"| {workers} | {seconds:.2f} | {result['tokens'] / seconds:,.0f} "
                     f"| {result['input_bytes'] / seconds / 1e6:.2f} "
                     f"| {first['seconds'] / seconds:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", metavar="FILE",
                        help="text or JSON-lines files (default: the demo corpus)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY")
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2], metavar="N",
                        help="worker counts to compare (default: 1 2)")
    parser.add_argument("--copies", type=int, default=4, metavar="N",
                        help="times to repeat the demo corpus (default: 4, about 20 MB)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="runs per worker count; the fastest counts (default: 1)")
    parser.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args(argv)
    spec = TokenizerSpec("GPT2BPETokenizer")
    command = shlex.join(["python", "bench/preprocess.py", *(sys.argv[1:] if argv is None else argv)])

    with tempfile.TemporaryDirectory(prefix="ptdp-bench-preprocess-") as scratch:
        scratch = Path(scratch)
        if args.input:
            inputs = [Path(p) for p in args.input]
            description = f"{len(inputs)} input file{'s' if len(inputs) > 1 else ''}"
        else:
            corpus = scratch / "corpus"
            corpus.mkdir()
            inputs = demo_corpus_files(corpus, args.copies)
            description = (f"demo corpus (Shakespeare, one document per work) × {args.copies}")
        for path in inputs:  # into the page cache, so no run pays for the disk
            Path(path).read_bytes()
        spec.build()  # load the BPE ranks once, outside the timed runs
        rows, outputs = [], []
        for workers in args.workers:
            print(f"workers {workers} ...", file=sys.stderr, flush=True)
            result, written = measure(inputs, spec, workers, args.json_keys, args.repeat, scratch)
            rows.append((workers, result))
            outputs.append(written)
    block = report(rows, all(o == outputs[0] for o in outputs), description, command, spec)
    publish(HEADING, block, write=args.write)


if __name__ == "__main__":
    main()
