"""--sft in a training run: the conversation files checked and tokenized
before launch (each bad row one paragraph naming file and row), and each
rank's datasets of packed conversations.

The tokenizer is the run's HuggingFaceTokenizer (--tokenizer-model, or the
one --load's checkpoint carries); the template is --chat-template's file or
the tokenizer's own (ptdp.data.sft.template_files). Padding uses the
tokenizer's pad token, else its end-of-document token: it is never in the
loss and attends only to itself.
"""

from __future__ import annotations

import sys
from typing import Callable

from ptdp.data.gpt_dataset import DataError, parse_weighted_paths
from ptdp.data.sft.cache import tokenized_file
from ptdp.data.sft.dataset import blend_stats, build_sft_datasets, split_conversations
from ptdp.data.sft.rows import ConversationError
from ptdp.data.sft.template import ChatTemplate
from ptdp.data.sft.template_files import ChatTemplateError

SUFFIXES = (".jsonl", ".json", ".parquet")


def run_template(config) -> ChatTemplate:
    """The run's template: --chat-template's file, else the tokenizer's own
    (a tokenizer without one is refused, naming --chat-template)."""
    data = config.data
    return ChatTemplate.for_tokenizer(data.tokenizer_model, data.chat_template)


def pad_id(template: ChatTemplate) -> int:
    """The id sequences are padded with: the tokenizer's pad token, else its end of document."""
    tokenizer = template.text_tokenizer
    pad = template.special_tokens.get("pad_token")
    ids = tokenizer.encode(pad) if pad else []
    return ids[0] if len(ids) == 1 else tokenizer.eod


def prepare(config) -> list[str]:
    """Before launch: the files exist and are conversations the template
    renders, tokenized into their caches now (progress shown), so that the
    ranks find them ready; the problems found, each one paragraph."""
    data = config.data
    try:
        files = [path for _, path in parse_weighted_paths(data.data_path, "file")]
    except DataError as error:
        return [str(error)]
    problems = [f"--data-path {path}: --sft reads JSON lines (.jsonl, .json) or Parquet "
                "(.parquet) files of conversations; give one of those" for path in files
                if not path.lower().endswith(SUFFIXES)]
    if problems:
        return problems
    try:
        template = run_template(config)
        tokenized = [tokenized_file(path, template, train_on_prompt=data.sft_train_on_prompt,
                                    skip_bad_rows=data.sft_skip_bad_rows,
                                    cache_dir=data.data_cache_path) for path in files]
    except (ConversationError, ChatTemplateError, DataError) as error:
        return [str(error)]
    wanted = ("train", "validation") if config.train.evaluates else ("train",)
    for file in tokenized:
        held = split_conversations(len(file), data.split, config.train.seed, file.cache_key)
        for split_name, conversations in zip(("train", "validation"), held):
            if split_name in wanted and len(conversations) == 0:
                problems.append(
                    f"--data-path {file.path}: --split {data.split} gives the {split_name} split "
                    f"none of its {len(file)} conversations; give it a share (e.g. --split "
                    "90,10,0)" + (" or drop --eval-interval" if split_name == "validation" else ""))
    return problems


def build(config, *, num_samples: tuple[int, int, int], is_builder: bool,
          barrier: Callable[[], None] | None) -> tuple[list, str, int]:
    """([train, valid, test] datasets, a description, the end-of-document
    id): the rank that builds writes the caches, then the others read them."""
    data, model = config.data, config.model
    template = run_template(config)

    def datasets(build: bool) -> list:
        return build_sft_datasets(
            data.data_path, template, split=data.split, num_samples=num_samples,
            seq_length=model.seq_length, pad_id=pad_id(template), seed=config.train.seed,
            packing=data.sft_packing, train_on_prompt=data.sft_train_on_prompt,
            skip_bad_rows=data.sft_skip_bad_rows, cache_dir=data.data_cache_path, build=build)

    if is_builder:
        built = datasets(True)
    if barrier is not None:
        barrier()
    if not is_builder:
        built = datasets(False)
    train = built[0]
    description = f"conversations of {' '.join(data.data_path)}"
    if train is not None:
        stats = blend_stats(train)
        skipped = sum(part.tokenized.skipped_rows for part in getattr(train, "datasets", [train]))
        description += f" ({stats.summary()}" + (
            f"; {skipped} bad row{'s' if skipped != 1 else ''} skipped (--sft-skip-bad-rows))"
            if skipped else ")")
        if is_builder and stats.truncated:
            print(f"ptdp: note: {stats.truncated} conversations are longer than --seq-length "
                  f"{model.seq_length} and are cut to it ({stats.truncated_tokens} tokens "
                  "dropped); raise --seq-length to keep them whole", file=sys.stderr, flush=True)
    return built, description, template.text_tokenizer.eod
