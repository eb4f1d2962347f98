"""`ptdp generate`: its flags, and its run: the prompt and the layout
checked against the checkpoint before any rank starts, then the ranks
launched (ptdp.generate holds the generation itself, which needs torch and
is imported when the command runs)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from ptdp.config import Config, ConfigError, ParallelConfig, validate
from ptdp.plural import plural
from ptdp.sampling import SamplingSettings


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate", help="generate text from a checkpoint",
        description="Continue a prompt with a trained model, on one process or under a tensor / "
                    "pipeline layout (any layout: checkpoints reshard on load).")
    parser.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument("--pretrained-checkpoint", metavar="BASE",
                        help="with --load of LoRA adapters: the base model they apply to "
                             "(default: the base they record; its seal must match)")
    parser.add_argument("--prompt", metavar="TEXT",
                        help="text to continue, encoded with the checkpoint's tokenizer; to give "
                             "token ids instead, use --prompt-ids (a --mock-data model, which has "
                             "no tokenizer, also reads ids separated by spaces here)")
    parser.add_argument("--prompt-ids", metavar="IDS",
                        help="the prompt as token ids, comma-separated (e.g. 5,17,923), instead of "
                             "--prompt; for any model, also one trained with NullTokenizer")
    parser.add_argument("--chat", metavar="TEXT",
                        help="instead of --prompt: a user message to a chat model, rendered with "
                             "the chat template its checkpoint carries (one imported from Hugging "
                             "Face) and the assistant's turn begun; generation stops at the end "
                             "of the turn, and the reply alone is printed")
    parser.add_argument("--system", metavar="TEXT",
                        help="with --chat: a system message before the user's")
    parser.add_argument("--chat-template", metavar="FILE",
                        help="with --chat: a Jinja chat template to render with instead of the "
                             "checkpoint's (ptdp ships ChatML's: ptdp/data/assets/chatml.jinja)")
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


def run(args: argparse.Namespace) -> int:
    from ptdp import device as devices
    from ptdp.checkpoint.data_settings import model_tokenizer
    from ptdp.data.tokenizer import TokenizerError
    from ptdp.generate import (GenerateRequest, chat_prompt, generate_text, generate_worker,
                               parse_prompt_ids, prompt_tokens)
    from ptdp.launch import CPU_RANK_MODULES, LocalJobFailed, launch_local
    from ptdp.parallel.topology import ParallelContext
    from ptdp.checkpoint.adapters import check_adapter_base
    from ptdp.checkpoint.store import CheckpointError

    _check_prompt_flags(args)
    settings = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:
        settings.validate()
    except ValueError as error:
        raise ConfigError([line.strip().removeprefix("- ")
                           for line in str(error).splitlines()[1:]]) from None
    try:
        check_adapter_base(args.load, args.pretrained_checkpoint)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    config = _checkpoint_config(args.load)
    layout = _checked_layout(args, config)
    # Checked here, before any rank starts: in a rank it would be a traceback.
    try:
        tokenizer = model_tokenizer(config, args.load)  # the ranks need its end of document
    except (CheckpointError, TokenizerError) as error:
        raise ConfigError([str(error)]) from None
    chat = None
    if args.chat is not None:
        try:
            chat = chat_prompt(args.load, config, args.chat, args.system, args.chat_template)
        except CheckpointError as error:
            raise ConfigError([str(error)]) from None
        prompt = chat.ids
    elif args.prompt_ids is not None:
        prompt = parse_prompt_ids(args.prompt_ids, config)
    else:
        prompt = prompt_tokens(args.prompt, tokenizer, config)
    _check_context(prompt, settings.max_new_tokens, config.model, layout)
    request = GenerateRequest(args.load, prompt, settings, layout.tensor_model_parallel_size,
                              layout.pipeline_model_parallel_size,
                              layout.expert_model_parallel_size, layout.expert_tensor_parallel_size,
                              layout.virtual_stages(config.model.num_layers), args.device,
                              output_ids=args.output_ids,
                              # a chat prints the assistant's reply, not the rendered template
                              echo_prompt=args.echo_prompt and chat is None,
                              stop_ids=chat.stop_ids if chat is not None else None,
                              pretrained=args.pretrained_checkpoint)
    world = layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
    kind = _device_kind(args.device, world, layout)
    if not args.output_ids:  # (ids are for a program: it gets them and nothing else)
        _announce(args, prompt, settings, chat)
    if world == 1:
        try:
            text = generate_text(request, ParallelContext.single(), devices.device_for(kind, 0))
        except CheckpointError as error:  # found before any token is generated
            raise ConfigError([str(error)]) from None
        print(text, flush=True)
        return 0
    try:
        launch_local(world, generate_worker, request,
                     preload=CPU_RANK_MODULES if kind == "cpu" else ())
    except LocalJobFailed as failure:
        failure.report()  # a user error as one paragraph, the cause on the last line
        return 1
    return 0


def _check_prompt_flags(args: argparse.Namespace) -> None:
    """One prompt: --prompt, --prompt-ids or --chat; --system and
    --chat-template only with --chat."""
    if args.chat is None:
        extras = [flag for flag, value in (("--system", args.system),
                                           ("--chat-template", args.chat_template))
                  if value is not None]
        if extras:
            raise ConfigError([f"{' and '.join(extras)} {'go' if len(extras) > 1 else 'goes'} "
                               f"with --chat TEXT (a message to a chat model): add --chat, or "
                               f"drop {' and '.join(extras)}"])
    elif args.prompt is not None or args.prompt_ids is not None:
        given = "--prompt" if args.prompt is not None else "--prompt-ids"
        raise ConfigError([f"--chat and {given} are two prompts: give --chat TEXT to talk to a "
                           f"chat model (the message rendered with its chat template), or "
                           f"{given} to continue a text, not both"])
    if args.chat is None and (args.prompt is None) == (args.prompt_ids is None):
        raise ConfigError(["give the prompt either as text, --prompt TEXT, or as token ids, "
                           "--prompt-ids 5,17,923" + (", not both" if args.prompt is not None
                                                      else "; or a message to a chat model, "
                                                           "--chat TEXT")])


def _quoted(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _announce(args: argparse.Namespace, prompt: list[int], settings: SamplingSettings,
              chat=None) -> None:
    """What is generated from what, on stderr before the sample (stdout
    carries the sample alone, for a program that reads the text)."""
    from ptdp.checkpoint.store import resolve

    if chat is not None:
        given = (f"the chat message {_quoted(args.chat)}"
                 + (f" (system {_quoted(args.system)})" if args.system is not None else "")
                 + f" rendered with {chat.template}")
    else:
        given = (f"the ids {args.prompt_ids}" if args.prompt_ids is not None
                 else _quoted(args.prompt))
    if settings.temperature == 0:
        how = "greedily (temperature 0)"
    else:
        how = ", ".join([f"sampled at temperature {settings.temperature:g}"]
                        + ([f"top-k {settings.top_k}"] if settings.top_k else [])
                        + ([f"top-p {settings.top_p:g}"] if settings.top_p < 1 else [])
                        + [f"seed {settings.seed}"])
    print(f"ptdp: generating up to {plural(settings.max_new_tokens, 'token')} after {given} "
          f"({plural(len(prompt), 'token')}) with the model of {resolve(args.load)}, {how}"
          + (f", until the end of the turn ({' or '.join(chat.stop_tokens)})" if chat else "")
          + ":",
          file=sys.stderr, flush=True)


def _checked_layout(args: argparse.Namespace, config: Config):
    """The command's layout (d = 1), checked against the checkpoint's model
    as for training; batch settings are not used here. A ConfigError lists
    every problem with a valid alternative."""
    from ptdp.generate import dispatches_tokens

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
    from ptdp.generate import error_text
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
                           f"({error_text(error)}); the checkpoint is damaged: load another "
                           f"one"]) from None


def _device_kind(requested: str, world: int, layout) -> str:
    """cpu or cuda for `--device`; a ConfigError saying what this machine
    has and what to give when it cannot run the request."""
    from ptdp import device as devices

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
