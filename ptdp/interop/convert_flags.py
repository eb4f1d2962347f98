"""`ptdp convert`'s flags, apart from the conversion code (convert.py), which
needs torch: the command line builds every command's flags at start, and
`ptdp plan`, `--help` and the others start without importing torch."""

from __future__ import annotations

import argparse


def add_convert_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert", help="convert checkpoints to or from Hugging Face (GPT-2, Llama, Mistral, "
                        "Qwen2, Qwen3; MoE: Mixtral, Qwen3-MoE, Qwen2-MoE)",
        description="Export a checkpoint as a Hugging Face directory (--load CKPT --to-hf DIR): "
                    "GPT2LMHeadModel for a GPT-2 style model; for a Llama style one (RMSNorm, "
                    "SwiGLU, rotary embeddings) Qwen3ForCausalLM with --qk-layernorm, "
                    "Qwen2ForCausalLM with --add-qkv-bias --disable-bias-linear, else "
                    "LlamaForCausalLM; an MoE model (--num-experts) as Qwen2MoeForCausalLM with a "
                    "gated shared expert, Qwen3MoeForCausalLM with --qk-layernorm, else "
                    "MixtralForCausalLM. Or import one (--from-hf DIR --save CKPT): those and "
                    "MistralForCausalLM without a sliding window. The tokenizer travels with "
                    "the model both ways (GPT-2's for a model trained with GPT2BPETokenizer).")
    parser.add_argument("--load", metavar="CKPT", help="ptdp checkpoint to export")
    parser.add_argument("--to-hf", metavar="DIR", help="new Hugging Face directory to write")
    parser.add_argument("--from-hf", metavar="DIR", help="Hugging Face directory to import "
                        "(config.json + model.safetensors or sharded safetensors)")
    parser.add_argument("--save", metavar="CKPT", help="where to write the imported checkpoint")
    parser.add_argument("--apply-layernorm-1p", action="store_true",
                        help="with --from-hf: store the norms' scales zero-centred (scale - 1), "
                             "for training the imported model with --apply-layernorm-1p (export "
                             "needs no flag: the checkpoint records it)")
