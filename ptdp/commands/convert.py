"""`ptdp convert`: its flags and its run. The conversion itself
(ptdp.interop.convert) needs torch and is imported when the command runs:
the command line builds every command's flags at start, and `ptdp plan`,
`--help` and the others start without importing torch."""

from __future__ import annotations

import argparse

from ptdp.config import ConfigError


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert", help="convert checkpoints to or from Hugging Face (GPT-2, Llama, Mistral, "
                        "Qwen2, Qwen3, Gemma 3; MoE: Mixtral, Qwen3-MoE, Qwen2-MoE, gpt-oss, "
                        "GLM-4.5, DeepSeek-V3)",
        description="Export a checkpoint as a Hugging Face directory (--load CKPT --to-hf DIR): "
                    "GPT2LMHeadModel for a GPT-2 style model; for a Llama style one (RMSNorm, "
                    "SwiGLU, rotary embeddings) Qwen3ForCausalLM with --qk-layernorm, "
                    "Qwen2ForCausalLM with --add-qkv-bias --disable-bias-linear, else "
                    "LlamaForCausalLM; an MoE model (--num-experts) as Qwen2MoeForCausalLM with a "
                    "gated shared expert, Qwen3MoeForCausalLM with --qk-layernorm, else "
                    "MixtralForCausalLM; GptOssForCausalLM for gpt-oss's (--quick-geglu with "
                    "sinks); Glm4MoeForCausalLM for sigmoid routing with a shared expert (GLM-4.5, "
                    "its MTP layers included), DeepseekV3ForCausalLM for that with "
                    "--multi-latent-attention (DeepSeek-V3); Gemma3ForCausalLM for Gemma 3's "
                    "pieces (--geglu --sandwich-norm --scale-embeddings ...); MistralForCausalLM "
                    "with a window on every layer. Or import one (--from-hf DIR --save CKPT): "
                    "those, gpt-oss's MXFP4 experts dequantized. The tokenizer travels with the "
                    "model both ways (GPT-2's for a model trained with GPT2BPETokenizer).")
    parser.add_argument("--load", metavar="CKPT", help="ptdp checkpoint to export")
    parser.add_argument("--to-hf", metavar="DIR", help="new Hugging Face directory to write")
    parser.add_argument("--from-hf", metavar="DIR", help="Hugging Face directory to import "
                        "(config.json + model.safetensors or sharded safetensors)")
    parser.add_argument("--save", metavar="CKPT", help="where to write the imported checkpoint")
    parser.add_argument("--merge-lora", action="store_true",
                        help="with --load ADAPTERS --save CKPT: write the base model with the LoRA "
                             "adapters folded in (W + alpha/R·B A), an ordinary checkpoint")
    parser.add_argument("--pretrained-checkpoint", metavar="BASE",
                        help="the base model of the LoRA adapters of --load (default: the one "
                             "they record) or of --from-hf-peft")
    parser.add_argument("--to-hf-peft", metavar="DIR",
                        help="with --load ADAPTERS: write them as a Hugging Face PEFT adapter "
                             "(adapter_config.json, adapter_model.safetensors) for the base "
                             "model --to-hf exports")
    parser.add_argument("--from-hf-peft", metavar="DIR",
                        help="with --pretrained-checkpoint BASE --save CKPT: import a Hugging "
                             "Face PEFT LoRA adapter of that base as ptdp adapters")
    parser.add_argument("--apply-layernorm-1p", action="store_true",
                        help="with --from-hf: store the norms' scales zero-centred (scale - 1), "
                             "for training the imported model with --apply-layernorm-1p (export "
                             "needs no flag: the checkpoint records it)")


def run(args: argparse.Namespace) -> int:
    from ptdp.interop.convert import export_to_hf, import_from_hf, output_problems
    from ptdp.interop.hf_files import ConversionError

    if args.merge_lora or args.to_hf_peft or args.from_hf_peft:
        return _run_lora(args)
    if args.pretrained_checkpoint:
        raise ConfigError(["--pretrained-checkpoint names the base of LoRA adapters: it goes "
                           "with --merge-lora, --to-hf-peft or --from-hf-peft"])
    exporting, importing = bool(args.load or args.to_hf), bool(args.from_hf or args.save)
    if exporting == importing or (exporting and not (args.load and args.to_hf)) \
            or (importing and not (args.from_hf and args.save)):
        raise ConfigError(["give either --load CKPT --to-hf DIR (export) or --from-hf DIR "
                           "--save CKPT (import)"])
    one_plus = getattr(args, "apply_layernorm_1p", False)
    if exporting and one_plus:
        raise ConfigError(["--apply-layernorm-1p is for --from-hf: an exported checkpoint's norms "
                           "follow its own setting, and the Hugging Face files get plain scales"])
    problems = output_problems(args.to_hf if exporting else args.save, exporting)
    if problems:  # before anything is read: an import or export of a large model takes long
        raise ConfigError(problems)
    try:
        if exporting:
            return export_to_hf(args.load, args.to_hf)
        return import_from_hf(args.from_hf, args.save, one_plus)
    except ConversionError as error:
        raise ConfigError([str(error)]) from None


LORA_USAGE = ("give one of: --merge-lora --load ADAPTERS --save CKPT; --to-hf-peft DIR --load "
              "ADAPTERS; --from-hf-peft DIR --pretrained-checkpoint BASE --save CKPT (with the "
              "first two, --pretrained-checkpoint BASE names the base when it is not the one "
              "the adapters record)")


def _run_lora(args: argparse.Namespace) -> int:
    """The LoRA conversions (ptdp.interop.lora_convert): one at a time, each
    with its own inputs and outputs, checked before anything is read."""
    from ptdp.interop.convert import output_problems
    from ptdp.interop.hf_files import ConversionError
    from ptdp.interop import lora_convert

    modes = [flag for flag, on in (("--merge-lora", args.merge_lora),
                                   ("--to-hf-peft", args.to_hf_peft),
                                   ("--from-hf-peft", args.from_hf_peft)) if on]
    needs = {"--merge-lora": ("load", "save"), "--to-hf-peft": ("load",),
             "--from-hf-peft": ("pretrained_checkpoint", "save")}
    mode = modes[0]
    forbidden = {"--merge-lora": ("to_hf", "from_hf"), "--to-hf-peft": ("to_hf", "from_hf", "save"),
                 "--from-hf-peft": ("to_hf", "from_hf", "load")}[mode]
    if len(modes) > 1 or any(not getattr(args, name) for name in needs[mode]) \
            or any(getattr(args, name) for name in forbidden) or args.apply_layernorm_1p:
        raise ConfigError([LORA_USAGE])
    output = args.to_hf_peft if mode == "--to-hf-peft" else args.save
    problems = output_problems(output, mode == "--to-hf-peft")
    if problems:
        raise ConfigError(problems)
    try:
        if mode == "--merge-lora":
            return lora_convert.merge_lora(args.load, args.pretrained_checkpoint, args.save)
        if mode == "--to-hf-peft":
            return lora_convert.export_peft(args.load, args.pretrained_checkpoint, args.to_hf_peft)
        return lora_convert.import_peft(args.from_hf_peft, args.pretrained_checkpoint, args.save)
    except ConversionError as error:
        raise ConfigError([str(error)]) from None
