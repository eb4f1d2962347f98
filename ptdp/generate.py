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
tokenizer.json it carries, else the one its data settings name) or token
ids (`--prompt-ids`, for any model, and the only way for a NullTokenizer
model); it is turned into ids and checked before any rank starts, as are
`--device` (against the GPUs this machine has) and the checkpoint's
settings. A damaged checkpoint is one paragraph naming what is wrong, from
the launcher or from a rank, never a traceback. The output is the prompt
followed by its continuation, as text (without the prompt with
`--no-echo-prompt`), or with `--output-ids` the ids of the generated tokens
only (a program that asked for ids knows the prompt's).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ptdp.config import Config, ConfigError
from ptdp.sampling import SamplingSettings

if TYPE_CHECKING:
    import torch

    from ptdp.parallel.topology import ParallelContext

# torch and the model are imported where they are used, so that the command
# line (which builds this command's flags for every command) starts without them.


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


class PipelinedModel:
    """next_logits(tokens [1, s]) -> logits [V] of the last position, the
    same on every rank of the layout."""

    def __init__(self, config: Config, ctx: ParallelContext, device: torch.device,
                 weights: dict[str, torch.Tensor], num_chunks: int = 1):
        import torch

        from ptdp.model.gpt import build_chunks
        from ptdp.parallel.sharding import SHARD_ATTR, shard

        self.config, self.ctx, self.device = config, ctx, device
        self.sequence_parallel = dispatches_tokens(config.model, ctx.tp_size, ctx.ep_size,
                                                   ctx.etp_size)
        self.chunks = build_chunks(config.model, ctx, device, config.train.seed, num_chunks,
                                   sequence_parallel=self.sequence_parallel)
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
        import torch

        with torch.no_grad():
            return self._next_logits(tokens)

    def _next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.distributed as dist

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
    from ptdp.checkpoint.data_settings import model_tokenizer
    from ptdp.sampling import generate

    config, weights = read_checkpoint_model(request.load)
    tokenizer = model_tokenizer(config, request.load)
    model = PipelinedModel(config, ctx, device, weights, request.chunks)
    new = generate(model, request.prompt_ids, request.settings,
                   max_context=config.model.max_positions,
                   eod=tokenizer.eod if tokenizer is not None else None)
    if request.output_ids:
        return ",".join(map(str, new))
    # Prompt and continuation decoded together: a character whose bytes span
    # the two (byte-level BPE) comes out whole.
    shown = request.prompt_ids + new if request.echo_prompt else new
    return tokenizer.decode(shown) if tokenizer is not None else " ".join(map(str, shown))


def read_checkpoint_model(load: str) -> tuple[Config, dict[str, torch.Tensor]]:
    """The settings and logical weights of checkpoint `load`. ptdp.checkpoint
    refuses a damaged checkpoint with a CheckpointError; an error of the
    libraries beneath it (safetensors, JSON) becomes one too, so that a
    damaged checkpoint is a user error, one paragraph, on any rank."""
    import json

    from safetensors import SafetensorError

    from ptdp.checkpoint.store import CheckpointError, load_logical_model

    try:
        config, weights, _ = load_logical_model(load)
    except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
            AttributeError) as error:
        raise CheckpointError(f"--load {load}: the checkpoint cannot be read "
                              f"({_error_text(error)}); it is damaged: load another one") from None
    return config, weights


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def request_grid(request: GenerateRequest):
    """The rank grid of the request's layout: t × p ranks (d = 1), the
    experts folded over each stage's t ranks."""
    from ptdp.parallel.topology import RankGrid

    return RankGrid(tp=request.tensor_parallel, dp=1, pp=request.pipeline_parallel,
                    ep=request.expert_parallel, etp=request.expert_tensor_parallel)


def _generate_worker(env, request: GenerateRequest) -> None:
    import torch.distributed as dist

    from ptdp import device as devices
    from ptdp.distributed import init_process_group
    from ptdp.parallel.topology import ParallelContext

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


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate", help="generate text from a checkpoint",
        description="Continue a prompt with a trained model, on one process or under a tensor / "
                    "pipeline layout (any layout: checkpoints reshard on load).")
    parser.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument("--prompt", metavar="TEXT",
                        help="text to continue, encoded with the checkpoint's tokenizer; to give "
                             "token ids instead, use --prompt-ids (a --mock-data model, which has "
                             "no tokenizer, also reads ids separated by spaces here)")
    parser.add_argument("--prompt-ids", metavar="IDS",
                        help="the prompt as token ids, comma-separated (e.g. 5,17,923), instead of "
                             "--prompt; for any model, also one trained with NullTokenizer")
    parser.add_argument("--output-ids", action="store_true",
                        help="print the generated token ids, comma-separated on one line, "
                             "instead of text (without the prompt's)")
    parser.add_argument("--no-echo-prompt", dest="echo_prompt", action="store_false",
                        help="print only the continuation, not the prompt before it")
    defaults = SamplingSettings()
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help=f"0: greedy (default: {defaults.temperature})")
    parser.add_argument("--top-k", type=int, default=defaults.top_k,
                        help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=defaults.top_p,
                        help="sample from the nucleus of this probability (1: all)")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                        help=f"tokens to generate (default: {defaults.max_new_tokens})")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="sampling seed")
    parser.add_argument("--tensor-model-parallel-size", "-t", type=int, default=1, metavar="N")
    parser.add_argument("--pipeline-model-parallel-size", "-p", type=int, default=1, metavar="N")
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        metavar="N")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="N",
                        help="an MoE model's experts split over N of each stage's t ranks")
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None, metavar="N",
                        help="each expert's MLP split over N ranks (default: t); EP × ETP "
                             "divides t")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


def run_generate_command(args: argparse.Namespace) -> int:
    from ptdp import device as devices
    from ptdp.checkpoint.data_settings import model_tokenizer
    from ptdp.data.tokenizer import TokenizerError
    from ptdp.launch import CPU_RANK_MODULES, LocalJobFailed, launch_local
    from ptdp.parallel.topology import ParallelContext
    from ptdp.checkpoint.store import CheckpointError

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ConfigError(["give the prompt either as text, --prompt TEXT, or as token ids, "
                           "--prompt-ids 5,17,923" + (", not both" if args.prompt is not None
                                                      else "")])
    settings = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:
        settings.validate()
    except ValueError as error:
        raise ConfigError([line.strip().removeprefix("- ")
                           for line in str(error).splitlines()[1:]]) from None
    config = _checkpoint_config(args.load)
    layout = _checked_layout(args, config)
    # Checked here, before any rank starts: in a rank it would be a traceback.
    try:
        tokenizer = model_tokenizer(config, args.load)  # the ranks need its end of document
    except (CheckpointError, TokenizerError) as error:
        raise ConfigError([str(error)]) from None
    prompt = (parse_prompt_ids(args.prompt_ids, config) if args.prompt_ids is not None
              else prompt_tokens(args.prompt, tokenizer, config))
    _check_context(prompt, settings.max_new_tokens, config.model, layout)
    request = GenerateRequest(args.load, prompt, settings, layout.tensor_model_parallel_size,
                              layout.pipeline_model_parallel_size,
                              layout.expert_model_parallel_size, layout.expert_tensor_parallel_size,
                              layout.virtual_stages(config.model.num_layers), args.device,
                              output_ids=args.output_ids, echo_prompt=args.echo_prompt)
    world = layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
    kind = _device_kind(args.device, world, layout)
    if not args.output_ids:  # (ids are for a program: it gets them and nothing else)
        _announce(args, prompt, settings)
    if world == 1:
        try:
            text = generate_text(request, ParallelContext.single(), devices.device_for(kind, 0))
        except CheckpointError as error:  # found before any token is generated
            raise ConfigError([str(error)]) from None
        print(text, flush=True)
        return 0
    try:
        launch_local(world, _generate_worker, request,
                     preload=CPU_RANK_MODULES if kind == "cpu" else ())
    except LocalJobFailed as failure:
        failure.report()  # a user error as one paragraph, the cause on the last line
        return 1
    return 0


def _announce(args: argparse.Namespace, prompt: list[int], settings: SamplingSettings) -> None:
    """What is generated from what, on stderr before the sample (stdout
    carries the sample alone, for a program that reads the text)."""
    import sys

    from ptdp.plural import plural
    from ptdp.checkpoint.store import resolve

    given = (f"the ids {args.prompt_ids}" if args.prompt_ids is not None
             else repr(args.prompt if len(args.prompt) <= 60 else args.prompt[:57] + "..."))
    if settings.temperature == 0:
        how = "greedily (temperature 0)"
    else:
        how = ", ".join([f"sampled at temperature {settings.temperature:g}"]
                        + ([f"top-k {settings.top_k}"] if settings.top_k else [])
                        + ([f"top-p {settings.top_p:g}"] if settings.top_p < 1 else [])
                        + [f"seed {settings.seed}"])
    print(f"ptdp: generating up to {plural(settings.max_new_tokens, 'token')} after {given} "
          f"({plural(len(prompt), 'token')}) with the model of {resolve(args.load)}, {how}:",
          file=sys.stderr, flush=True)


def _checked_layout(args: argparse.Namespace, config: Config):
    """The command's layout (d = 1), checked against the checkpoint's model
    as for training; batch settings are not used here. A ConfigError lists
    every problem with a valid alternative."""
    import dataclasses
    import re

    from ptdp.config import ParallelConfig, validate

    t, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    model = config.model
    if not model.is_moe and (ep != 1 or etp is not None):
        given = " and ".join(([f"--expert-model-parallel-size {ep}"] if ep != 1 else [])
                             + ([f"--expert-tensor-parallel-size {etp}"] if etp is not None else []))
        raise ConfigError([f"{given}: expert parallelism is for MoE models, and this checkpoint's "
                           f"model has no experts (no --num-experts): drop "
                           f"{'them' if ' and ' in given else 'it'}"])
    sequence_parallel = (all(isinstance(n, int) and n >= 1 for n in (t, ep, etp or t))
                         and dispatches_tokens(model, t, ep, etp))
    layout = ParallelConfig(tensor_model_parallel_size=t, pipeline_model_parallel_size=p,
                            data_parallel_size=1, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=etp, sequence_parallel=sequence_parallel,
                            num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
                            device=args.device)
    if sequence_parallel and model.seq_length % t:
        # Each step's context is padded to a multiple of t, so the training
        # length need not be one.
        model = dataclasses.replace(model, seq_length=max(t, model.seq_length - model.seq_length % t))
    try:
        validate(Config(model=model, parallel=layout, train=config.train.__class__(
            micro_batch_size=1, global_batch_size=p if isinstance(p, int) and p >= 1 else 1),
            data=config.data))
    except ConfigError as error:  # generation has no data parallelism to offer
        raise ConfigError([re.sub(r" or --data-parallel-size \d+", "", problem)
                           for problem in error.problems]) from None
    if sequence_parallel and model.moe_expert_capacity_factor is not None:
        raise ConfigError([
            f"{_expert_flags(layout)} with --tensor-model-parallel-size {t}: this checkpoint's "
            f"experts have a capacity (--moe-expert-capacity-factor "
            f"{model.moe_expert_capacity_factor}), and under this layout each step's context is "
            f"padded to a multiple of t, which would change the tokens the capacity drops: use "
            f"--expert-model-parallel-size 1 with --expert-tensor-parallel-size {t} (the default), "
            f"or --tensor-model-parallel-size 1"])
    return layout


def _expert_flags(layout) -> str:
    EP, ETP = layout.expert_model_parallel_size, layout.expert_tensor_size
    return " and ".join(([f"--expert-model-parallel-size {EP}"] if EP > 1 else [])
                        + ([f"--expert-tensor-parallel-size {ETP}"]
                           if ETP != layout.tensor_model_parallel_size else []))


def _check_context(prompt: list[int], new: int, model, layout) -> None:
    """The context the steps will see, against the model's positions: a note
    on stderr when the window will slide over the prompt; a ConfigError when
    a padded context would run past a learned position table."""
    import sys

    positions, longest = model.max_positions, len(prompt) + new - 1  # the last token is not fed
    t = layout.tensor_model_parallel_size
    padded = -(-min(longest, positions) // t) * t
    if layout.sequence_parallel and not model.rope and padded > positions:
        most = positions - positions % t - len(prompt) + 1
        raise ConfigError([
            f"{_expert_flags(layout)} with --tensor-model-parallel-size {t}: each step's context "
            f"is padded to a multiple of t, and this model's {positions} positions are not one: "
            f"its last context, {min(longest, positions)} tokens, would need {padded} positions; "
            + (f"give --max-new-tokens {most} or fewer, or " if most >= 1 else "give ")
            + f"--expert-model-parallel-size 1 with --expert-tensor-parallel-size {t}"])
    if longest > positions:
        print(f"ptdp: note: the prompt's {len(prompt)} tokens and up to {new} new ones exceed "
              f"this model's {positions} positions: from new token {positions - len(prompt) + 2} "
              f"on, the model sees only the last {positions} tokens (the prompt's oldest drop out "
              f"first)", file=sys.stderr, flush=True)


def _checkpoint_config(load: str) -> Config:
    """The settings a checkpoint was saved with; a ConfigError naming the
    file when the checkpoint is missing or damaged."""
    from ptdp.checkpoint.store import METADATA, CheckpointError, read_metadata, resolve

    try:
        directory = resolve(load)
        metadata = read_metadata(directory)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    try:
        return Config.from_dict(metadata["config"])
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ConfigError([f"{directory / METADATA}: its \"config\" cannot be read "
                           f"({_error_text(error)}); the checkpoint is damaged: load another "
                           f"one"]) from None


def _device_kind(requested: str, world: int, layout) -> str:
    """cpu or cuda for `--device`; a ConfigError saying what this machine
    has and what to give when it cannot run the request."""
    from ptdp import device as devices
    from ptdp.plural import plural

    gpus = devices.cuda_device_count()
    if requested == "cuda" and gpus < world:
        if gpus == 0:
            fix = "give --device cpu, or --device auto (the default: cuda where there are GPUs)"
        else:
            fix = f"give --device cpu, or a layout of at most {plural(gpus, 'process')} (-t × -p)"
        needs = ("one" if world == 1 else
                 f"{world}, one per process (t={layout.tensor_model_parallel_size} × "
                 f"p={layout.pipeline_model_parallel_size})")
        raise ConfigError([f"--device cuda: this machine has {plural(gpus, 'visible GPU')} and "
                           f"generating needs {needs}; {fix}"])
    return devices.resolve_kind(requested, world)
