"""Supervised fine-tuning data: conversations read from JSON lines or Parquet
(rows.py), rendered with a chat template into token ids and an
assistant-only loss mask (template.py, template_files.py), and packed whole
into fixed-length sequences with per-conversation positions and document
boundaries (packing.py); a file tokenized once into a cache (cache.py) and
served as held-out, seeded, packed fixed-shape samples (dataset.py)."""
