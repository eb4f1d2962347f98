"""`ptdp generate`: text from a checkpoint, on one process or under a
tensor/pipeline layout, with expert parallelism for an MoE model.

Every rank builds its model pieces for the layout (as training does) and
loads its shards of the checkpoint's logical weights. Each step runs the
context through the virtual stages in order: stage k = c·p + r is chunk c
of pipeline rank r, hidden states go from one stage's ranks to the next's
by point-to-point sends, and the tensor ranks of a stage compute together.
The last stage's vocabulary-parallel logits are gathered and broadcast to
every rank, and every rank draws the same token from them with the same
seeded generator, so all ranks extend the same context.

An MoE model's experts may be split over expert-parallel ranks
(`--expert-model-parallel-size`, `--expert-tensor-parallel-size`, folded
over the t ranks of a stage: generation has no data parallelism, so EP·ETP
divides t). An MoE layer that dispatches tokens at t > 1 sends each tensor
rank's own shard of the sequence, so such a layout runs the model with
sequence parallelism, and each step's context is padded on the right to a
multiple of t: attention is causal, so tokens after the last real position
change no logits before it, and those are read there.

A context longer than the model's positions is never cut silently: a prompt
longer than them is refused before launch; a prompt that fits but, with the
tokens to generate, outgrows them gets a note on stderr, and from then on
each step sees the last max-positions tokens (the prompt's oldest first drop
out), as a model trained on windows of that length reads text.

The prompt is text (`--prompt`, encoded by the checkpoint's tokenizer: the
tokenizer.json it carries, else the one its data settings name), token
ids (`--prompt-ids`, for any model, and the only way for a NullTokenizer
model) or a chat model's user message (`--chat`: see below); it is turned
into ids and checked before any rank starts, as are
`--device` (against the GPUs this machine has) and the checkpoint's
settings. A damaged checkpoint is one paragraph naming what is wrong, from
the launcher or from a rank, never a traceback. The output is the prompt
followed by its continuation, as text (without the prompt with
`--no-echo-prompt`), or with `--output-ids` the ids of the generated tokens
only (a program that asked for ids knows the prompt's).

With `--chat`, the conversation (an optional system message, then the
user's) is rendered with the chat template of the checkpoint's tokenizer,
with the generation prompt (transformers' `apply_chat_template(..., add_generation_prompt=True)`),
and encoded as transformers encodes it (ptdp.data.sft.template). The
template and the special tokens are those of the Hugging Face files the
checkpoint carries beside its tokenizer.json (ptdp/checkpoint/carry.py: a
model imported with `ptdp convert --from-hf`, and the fine-tunes that keep
its tokenizer), or a template file given with `--chat-template`.

Generation stops at the end of the assistant's turn: at the eos ids of the
carried generation_config.json (what transformers' `generate` stops at),
else at the tokenizer's eos token; and at the end-of-turn marker the
template writes (`<|im_end|>`, `<|eot_id|>`, ...) when it is one token of
the tokenizer, so that a template given with --chat-template (ChatML on a
base model whose eos is `<|endoftext|>`) stops where its turns end too. The
output is then the assistant's reply alone (or its ids), without the token
it stopped at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from ptdp import device as devices
from ptdp.checkpoint import store
from ptdp.checkpoint.data_settings import model_tokenizer
from ptdp.checkpoint.store import CheckpointError
from ptdp.config import Config, ConfigError
from ptdp.distributed import init_process_group
from ptdp.checkpoint.adapters import load_adapted_model
from ptdp.model.gpt import build_chunks
from ptdp.parallel.sharding import SHARD_ATTR, shard
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.sampling import SamplingSettings, generate


@dataclass
class GenerateRequest:
    """What every rank needs: the prompt as token ids (checked before any
    rank starts) and whether to print ids or text."""
    load: str
    prompt_ids: list[int]
    settings: SamplingSettings
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None  # None: t, as for training
    chunks: int = 1
    device: str = "auto"
    output_ids: bool = False
    echo_prompt: bool = True
    # The tokens generation stops at (a chat model's ends of turn:
    # ptdp.chat_prompt); None: the tokenizer's end of document.
    stop_ids: list[int] | None = None
    # --load holds LoRA adapters: their base (None: the one they record).
    pretrained: str | None = None


class PipelinedModel:
    """next_logits(tokens [1, s]) -> logits [V] of the last position, the
    same on every rank of the layout."""

    def __init__(self, config: Config, ctx: ParallelContext, device: torch.device,
                 weights: dict[str, torch.Tensor], num_chunks: int = 1):
        self.config, self.ctx, self.device = config, ctx, device
        self.sequence_parallel = dispatches_tokens(config.model, ctx.tp_size, ctx.ep_size,
                                                   ctx.etp_size)
        self.chunks = build_chunks(config.model, ctx, device, config.train.seed, num_chunks,
                                   sequence_parallel=self.sequence_parallel, lora=config.lora)
        with torch.no_grad():
            for chunk in self.chunks:
                for name, param in chunk.named_parameters():
                    spec = getattr(param, SHARD_ATTR, None)
                    logical = weights[name]
                    param.copy_((shard(logical, spec) if spec is not None else logical).to(param.dtype))
                for name, buffer in chunk.named_buffers():  # the MoE routers' expert biases
                    if name in weights:
                        buffer.copy_(weights[name])
                chunk.eval()
        self.num_stages = ctx.pp_size * num_chunks

    def _rank_of_stage(self, stage: int) -> int:
        c = self.ctx.coord
        return self.ctx.grid.rank(c.tp, c.dp, stage % self.ctx.pp_size)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._next_logits(tokens)

    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        ctx, model = self.ctx, self.config.model
        tokens = tokens.to(self.device)
        s = last = tokens.shape[1]  # `last`: the real positions; s: with the padding
        if self.sequence_parallel and s % ctx.tp_size:
            padding = ctx.tp_size - s % ctx.tp_size
            tokens = torch.cat([tokens, tokens.new_zeros(1, padding)], dim=1)
            s += padding
        local_s = s // ctx.tp_size if self.sequence_parallel else s
        x = None
        for stage in range(self.num_stages):
            owner = stage % ctx.pp_size
            if owner != ctx.pp_rank:
                continue
            chunk = self.chunks[stage // ctx.pp_size]
            if stage == 0:
                x = tokens
            elif (stage - 1) % ctx.pp_size != ctx.pp_rank:
                x = torch.empty(local_s, 1, model.hidden_size, device=self.device)
                dist.recv(x, src=self._rank_of_stage(stage - 1))
            x = chunk(x)
            if stage < self.num_stages - 1 and (stage + 1) % ctx.pp_size != ctx.pp_rank:
                dist.send(x.contiguous(), dst=self._rank_of_stage(stage + 1))
        logits = torch.empty(model.padded_vocab_size(ctx.tp_size), device=self.device)
        if ctx.is_last_stage:
            local = x[last - 1, 0].float()  # all s positions (gathered under sequence parallelism)
            if ctx.tp_group is not None:
                parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
                dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
                local = torch.cat(parts)
            logits.copy_(local)
        if ctx.pp_size > 1:
            c = ctx.coord
            dist.broadcast(logits, src=ctx.grid.rank(c.tp, c.dp, ctx.pp_size - 1),
                           group=ctx.pp_group)
        return logits[:model.vocab_size].cpu()


def dispatches_tokens(model, t: int, ep: int, etp: int | None) -> bool:
    """Whether the MoE layers send each tensor rank's own positions to the
    experts (EP > 1 or ETP != t, at t > 1): then the model runs with sequence
    parallelism, and the context is padded to a multiple of t."""
    return model.is_moe and t > 1 and (ep, t if etp is None else etp) != (1, t)


def prompt_tokens(prompt: str, tokenizer, config: Config) -> list[int]:
    """The prompt's token ids for a model with a text tokenizer, or, for a
    model trained on generated data (no tokenizer), the ids the prompt lists
    separated by spaces. ConfigError, naming --prompt, if there is nothing
    to continue, if the model has no text tokenizer (NullTokenizer), if the
    ids are not the model's, or if the prompt does not fit the model's
    context (the model would silently see only its end)."""
    if tokenizer is None:
        ids_example = "give token ids of its vocabulary, e.g. --prompt '1 2 3'"
        parts = prompt.split()
        if not parts:
            raise ConfigError([f"--prompt is empty: this model was trained on generated data "
                               f"(--mock-data) and has no tokenizer; {ids_example}"])
        if not all(part.isdecimal() for part in parts):
            raise ConfigError([f"--prompt {prompt!r}: this model was trained on generated data "
                               f"(--mock-data) and has no tokenizer; {ids_example}"])
        return check_prompt_ids([int(part) for part in parts], config, f"--prompt {prompt!r}",
                                ids_example)
    if tokenizer.name == "NullTokenizer":
        raise ConfigError(["--prompt needs a text tokenizer, and this model was trained with "
                           "NullTokenizer on data that was token ids already; give the prompt as "
                           "token ids, e.g. --prompt-ids 1,2,3 (and --output-ids to print ids)"])
    tokens = tokenizer.encode(prompt)
    if not tokens:
        what = "is empty" if not prompt else f"{prompt!r} encodes to no tokens"
        raise ConfigError([f"--prompt {what}: give the text to continue, e.g. --prompt "
                           f"'Once upon a time'"])
    return check_prompt_ids(tokens, config, "--prompt",
                            f"the {tokenizer.name} does not fit this model")


def parse_prompt_ids(text: str, config: Config) -> list[int]:
    """--prompt-ids "5,17,923": token ids, checked against the model's
    vocabulary and context."""
    example = "e.g. --prompt-ids 5,17,923"
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ConfigError([f"--prompt-ids is empty: give the token ids to continue, comma-separated, "
                           f"{example}"])
    bad = next((part for part in parts if not part.isdecimal()), None)
    if bad is not None:
        raise ConfigError([f"--prompt-ids {text!r}: {bad!r} is not a token id; give non-negative "
                           f"integers separated by commas, {example}"])
    return check_prompt_ids([int(part) for part in parts], config, f"--prompt-ids {text!r}",
                            "give ids of its vocabulary")


def check_prompt_ids(tokens: list[int], config: Config, what: str, hint: str) -> list[int]:
    """`tokens`, if they are ids of the model's vocabulary and fit its
    context; else a ConfigError that starts with `what` and ends with `hint`."""
    vocab, context = config.model.vocab_size, config.model.max_positions
    outside = [t for t in tokens if not 0 <= t < vocab]
    if outside:
        raise ConfigError([f"{what}: token id {outside[0]} is outside this model's vocabulary of "
                           f"{vocab} (ids 0 to {vocab - 1}); {hint}"])
    if len(tokens) > context:
        flag = what.split()[0]
        raise ConfigError([f"{flag} is {len(tokens)} tokens long, more than this model's context "
                           f"of {context} tokens (its --seq-length/--max-position-embeddings); "
                           f"give a prompt of at most {context} tokens"])
    return tokens


def generate_text(request: GenerateRequest, ctx: ParallelContext, device: torch.device) -> str:
    """The request's prompt and its continuation as text (the continuation
    alone without `echo_prompt`), or with `output_ids` the new token ids,
    comma-separated. Every rank of the layout calls it."""
    config, weights = read_checkpoint_model(request.load, request.pretrained)
    tokenizer = model_tokenizer(config, request.load)
    model = PipelinedModel(config, ctx, device, weights, request.chunks)
    stop = request.stop_ids if request.stop_ids is not None else \
        [tokenizer.eod] if tokenizer is not None else []
    new = generate(model, request.prompt_ids, request.settings,
                   max_context=config.model.max_positions, stop=stop)
    if request.output_ids:
        return ",".join(map(str, new))
    # Prompt and continuation decoded together: a character whose bytes span
    # the two (byte-level BPE) comes out whole.
    shown = request.prompt_ids + new if request.echo_prompt else new
    return tokenizer.decode(shown) if tokenizer is not None else " ".join(map(str, shown))


def read_checkpoint_model(load: str, pretrained: str | None = None
                          ) -> tuple[Config, dict[str, torch.Tensor]]:
    """The settings and logical weights of checkpoint `load` (LoRA adapters:
    the base's weights and the adapters', ptdp.checkpoint.adapters). ptdp.checkpoint
    refuses a damaged checkpoint with a CheckpointError; an error of the
    libraries beneath it (safetensors, JSON) becomes one too, so that a
    damaged checkpoint is a user error, one paragraph, on any rank."""
    try:
        config, weights, _, _ = load_adapted_model(load, pretrained)
    except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
            AttributeError) as error:
        raise CheckpointError(f"--load {load}: the checkpoint cannot be read "
                              f"({error_text(error)}); it is damaged: load another one") from None
    return config, weights


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def request_grid(request: GenerateRequest):
    """The rank grid of the request's layout: t × p ranks (d = 1), the
    experts folded over each stage's t ranks."""
    return RankGrid(tp=request.tensor_parallel, dp=1, pp=request.pipeline_parallel,
                    ep=request.expert_parallel, etp=request.expert_tensor_parallel)


def generate_worker(env, request: GenerateRequest) -> None:
    kind = devices.resolve_kind(request.device, env.local_world_size)
    devices.configure_threads(kind, env.local_world_size)
    device = devices.device_for(kind, env.local_rank)
    timeout = timedelta(minutes=10)
    init_process_group(env, devices.backend_for(kind), timeout)
    try:
        ctx = ParallelContext.build(request_grid(request), timeout=timeout)
        text = generate_text(request, ctx, device)
        if ctx.rank == 0:
            print(text, flush=True)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ --chat

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]          # the rendered conversation with the generation prompt, encoded
    stop_ids: list[int]     # the tokens that end the assistant's turn
    stop_tokens: list[str]  # the same, as text (for the announcement)
    template: str           # where the template came from, in words


def chat_messages(message: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": message}]


def chat_prompt(load: str, config: Config, message: str, system: str | None = None,
                template_file: str | None = None) -> ChatPrompt:
    """The prompt and stop tokens of `--chat message` for checkpoint `load`
    (whose settings are `config`); a ConfigError, one paragraph, for a
    checkpoint that cannot chat (no Hugging Face tokenizer, no template) or
    a template that refuses the conversation."""
    from ptdp.checkpoint.carry import checkpoint_hf_files
    from ptdp.data.sft.template_files import ChatTemplateError

    tokenizer_file = store.checkpoint_tokenizer(load)
    directory = store.resolve(load)
    if tokenizer_file is None:
        has = ("no tokenizer (it was trained on generated data)" if config.data.mock_data
               else f"no tokenizer.json (its model's tokenizer is {config.data.tokenizer_type})")
        raise ConfigError([f"--chat renders the conversation with the chat template of the "
                           f"model's Hugging Face tokenizer, and the checkpoint {directory} "
                           f"carries {has}; chat with a model imported from Hugging Face (ptdp "
                           f"convert --from-hf) or trained with --tokenizer-type "
                           f"HuggingFaceTokenizer, or give the text to continue with --prompt"])
    carried = checkpoint_hf_files(directory, store.read_metadata(directory))
    try:
        template = _template(tokenizer_file, template_file, directory)
    except ChatTemplateError as error:
        raise ConfigError([f"--chat-template {template_file}: {error}" if template_file
                           else f"--chat: {error}"]) from None
    ids = _render(template, chat_messages(message, system), template_file)
    ids = check_prompt_ids(ids, config, "--chat",
                           "the checkpoint's tokenizer does not fit this model")
    stop_ids = _stop_ids(template, carried, config.model.vocab_size)
    if not stop_ids:
        raise ConfigError([
            "--chat: cannot tell where the assistant's turn ends: the checkpoint carries no "
            f"{GENERATION_CONFIG} with eos ids, its tokenizer names no eos token, and the chat "
            "template writes no end-of-turn token of this tokenizer (such as <|im_end|> or "
            "<|eot_id|>); give a template whose turns end with one of the tokenizer's special "
            "tokens (--chat-template FILE)"])
    return ChatPrompt(ids, stop_ids, [template.text_tokenizer.decode([i]) for i in stop_ids],
                      f"the template {template_file}" if template_file
                      else "the checkpoint's chat template")


def _template(tokenizer_file: Path, template_file: str | None, checkpoint: Path):
    """The ChatTemplate of the checkpoint's tokenizer: its tokenizer.json
    with the tokenizer files it carries beside it (tokenizer_config.json's
    template and special tokens, chat_template.jinja,
    special_tokens_map.json), which ChatTemplate finds there."""
    from ptdp.data.sft.template import ChatTemplate
    from ptdp.data.sft.template_files import (CHATML_TEMPLATE_FILE, directory_template,
                                              tokenizer_directory)

    if template_file is None and directory_template(tokenizer_directory(tokenizer_file)) is None:
        raise ConfigError([
            f"--chat: the checkpoint {checkpoint} has no chat template (it carries neither "
            f"chat_template.jinja nor a \"chat_template\" in tokenizer_config.json: models "
            f"imported from a Hugging Face chat model carry theirs), so the conversation "
            f"cannot be rendered; give a Jinja chat template with "
            f"--chat-template FILE, e.g. ptdp's ChatML template {CHATML_TEMPLATE_FILE} (its "
            f"tokenizer needs <|im_start|> and <|im_end|> as special tokens)"])
    return ChatTemplate.for_tokenizer(tokenizer_file, template_file)


def _render(template, messages: list[dict[str, str]], template_file: str | None) -> list[int]:
    """The conversation with the generation prompt, as token ids (one
    string, special tokens recognised, none added: as transformers)."""
    import jinja2

    try:
        text = template.render(messages, add_generation_prompt=True)
    except jinja2.TemplateError as error:
        which = f"the template {template_file}" if template_file else "the checkpoint's chat template"
        raise ConfigError([f"--chat: {which} refuses the conversation ({error}); change the "
                           f"message{' or drop --system' if len(messages) > 1 else ''}, or give "
                           f"another template with --chat-template FILE"]) from None
    return template.text_tokenizer.encode(text)


def _stop_ids(template, carried: dict[str, bytes], vocab_size: int) -> list[int]:
    """The generation config's eos ids, else the tokenizer's eos token's;
    then the template's end-of-turn markers (see the module's notes)."""
    from ptdp.data.sft.template import END_OF_TURN_TOKENS

    ids = _generation_config_eos(carried.get(GENERATION_CONFIG))
    eos = template.special_tokens.get("eos_token")
    if not ids and eos:
        ids = _single_token(template, eos)
    for marker in END_OF_TURN_TOKENS:
        if marker in template.source:
            ids += [i for i in _single_token(template, marker) if i not in ids]
    return [i for i in ids if 0 <= i < vocab_size]


def _generation_config_eos(contents: bytes | None) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list of them; the
    import checked the file), as a list."""
    if contents is None:
        return []
    eos = json.loads(contents).get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return [i for i in dict.fromkeys(eos) if isinstance(i, int) and not isinstance(i, bool)]


def _single_token(template, text: str) -> list[int]:
    """[its id] where `text` is one token of the template's tokenizer, else []."""
    ids = template.text_tokenizer.encode(text)
    return ids if len(ids) == 1 else []
