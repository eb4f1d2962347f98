"""Megatron-LM's own example scripts run under ptdp with one change: the
command. tests/fixtures/megatron-scripts holds six of them with their sizes
shrunk (each file's header lists what was shrunk; nothing else changed):
GPT-3 175B (the version with --rampup-batch-size), Llama-3 8B (FP8), the
paper's sc21 interleaved-schedule runs, Mixtral 8x7B, the Qwen3-30B-A3B model
and DeepSeek-V3 with Megatron-FSDP (a SLURM batch script). Each is run by bash
as written, with `torchrun`/`python` shims on PATH that turn `pretrain_gpt.py`
into `-m ptdp train`, what a user edits, and `sbatch`/`srun` shims that run a
batch job on this machine. docs/megatron-flags.md lists every flag they use
and what ptdp does with it."""

import dataclasses
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ptdp.cli import build_parser
from tests.in_process import train_refused

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "fixtures" / "megatron-scripts"
DATA = ROOT / "tests" / "fixtures" / "megatron-indexed" / "megatron_gpt2_uint16"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))

# The one change: Megatron-LM's training script becomes ptdp's command.
_SHIM = """#!{python}
import os, sys
argv = []
for arg in sys.argv[1:]:
    argv += ["-m", "ptdp", "train"] if arg.endswith("pretrain_gpt.py") else [arg]
with open(os.environ["PTDP_SCRIPT_ARGV"], "w") as out:
    out.write("\\0".join(argv))
if not os.environ.get("PTDP_SCRIPT_DRY_RUN"):  # a dry run records the command only
    os.execv({real!r}, [{real!r}] + argv)
"""


# SLURM's two commands, for the DeepSeek-V3 script: `sbatch` runs the batch
# script it reads at once and waits for it (SLURM queues it), with the job's
# variables from its #SBATCH lines; `srun` starts the job's tasks on this
# machine, each with the variables SLURM gives a task, and waits for all.
_SBATCH = """#!{python}
import os, re, subprocess, sys, tempfile
script = sys.stdin.read()
def option(name):
    found = re.search(rf"^#SBATCH --{{name}}=(\\S+)", script, re.M)
    return int(found.group(1)) if found else 1
nodes, per_node = option("nodes"), option("ntasks-per-node")
env = {{**os.environ, "SLURM_JOB_ID": "1", "SLURM_NNODES": str(nodes),
       "SLURM_NTASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node)}}
with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as batch:
    batch.write(script)
sys.exit(subprocess.run(["bash", batch.name], env=env).returncode)
"""
_SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):  # srun's own options; the command follows
    args = args[1:]
tasks = int(os.environ.get("SLURM_NTASKS", "1"))
ranks = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(rank),
                                     "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
                                     "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}})
         for rank in range(tasks)]
sys.exit(max(rank.wait() for rank in ranks))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _shims(folder: Path) -> Path:
    folder.mkdir()
    scripts = {name: _SHIM.format(python=sys.executable, real=real)
               for name, real in (("torchrun", TORCHRUN), ("python", sys.executable))}
    scripts.update(sbatch=_SBATCH.format(python=sys.executable),
                   srun=_SRUN.format(python=sys.executable))
    for name, text in scripts.items():
        shim = folder / name
        shim.write_text(text)
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return folder


def _data_copy(tmp_path: Path) -> Path:
    """The fixture dataset copied into tmp_path: Megatron-LM's and ptdp's
    sample index goes next to the data, and the scripts have no
    --data-cache-path."""
    folder = tmp_path / "data"
    folder.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(str(DATA) + suffix, folder / (DATA.name + suffix))
    return folder / DATA.name


def _gpt2_files(folder: Path) -> tuple[Path, Path]:
    from ptdp.data.tokenizer import dump_vocab_and_merges, load_gpt2_ranks

    return dump_vocab_and_merges(load_gpt2_ranks(), 50256, folder)


def _run_script(script: str, args: list[str], tmp_path: Path, **env_extra: str):
    """bash SCRIPT ARGS in tmp_path with the shims first on PATH: (the
    completed process, the argv ptdp got)."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed next to this Python")
    shims = _shims(tmp_path / "shims")
    (tmp_path / "pretrain_gpt.py").touch()  # the Llama script checks that it exists
    argv_file = tmp_path / "argv"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
           "PTDP_SCRIPT_ARGV": str(argv_file), "MASTER_PORT": str(_free_port()), **env_extra}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    result = subprocess.run(["bash", str(SCRIPTS / script), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)  # hang guard
    argv = argv_file.read_text().split("\0") if argv_file.exists() else []
    return result, argv


def _train_flags(argv: list[str]) -> list[str]:
    """What follows `-m ptdp train` in a shim's argv."""
    return argv[argv.index("train") + 1:]


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| loss (\d+\.\d+)", output)]


def test_gpt3_175b_script_trains(tmp_path):
    """Tensor and pipeline parallelism under torchrun, the batch-size ramp
    with --train-iters (which Megatron-LM itself refuses), fp16, blended
    evaluation, --save/--load on the same folder before it holds a
    checkpoint, TensorBoard."""
    vocab, merges = _gpt2_files(tmp_path / "gpt2")
    checkpoints = tmp_path / "checkpoints"
    result, argv = _run_script("gpt3_175b.sh", [str(checkpoints), str(tmp_path / "tb"), str(vocab),
                                                str(merges), str(_data_copy(tmp_path))], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    build_parser().parse_args(["train", *_train_flags(argv)])  # the flags as the script gives them
    assert "--rampup-batch-size" in argv and "--attention-backend" in argv
    assert "ptdp: 4 processes (t=2, p=2, d=1)" in output
    assert "no checkpoint there yet, so training starts at iteration 0" in output
    assert "global batch ramped up from 2" in output
    losses = _losses(output)
    assert len(losses) == 4 and all(0 < x < 20 for x in losses), output
    assert (checkpoints / "latest").read_text().strip() == "iter_0000004"
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_llama3_8b_script_is_refused_for_fp8_and_torch_dist_only(tmp_path):
    """As written the script trains in FP8 and writes torch_dist checkpoints,
    which ptdp cannot do: refused before launch, naming exactly those flags."""
    result, argv = _run_script("llama3_8b.sh", [str(tmp_path / "ckpt"), str(tmp_path / "tb")],
                               tmp_path)
    # (The script's exit status is its last command's, `set +x`.) Under
    # torchrun each rank checks the configuration; local rank 0 prints it
    # (torchrun's summary then quotes each rank's, indented).
    printed = [line for line in result.stderr.splitlines()
               if line.startswith("ptdp: error: invalid configuration")]
    assert len(printed) == 1, result.stdout + result.stderr
    assert "iteration" not in result.stdout and "ptdp: starting" not in result.stdout
    first_report = result.stderr.split("ptdp: error: invalid configuration:")[1]
    problems = [line for line in first_report.splitlines() if line.startswith("  - ")]
    assert [p.split(":")[0] for p in problems] == [
        "  - --fp8-format hybrid", "  - --fp8-amax-history-len 1024",
        "  - --fp8-amax-compute-algo max", "  - --fp8-param-gather", "  - --ckpt-format torch_dist"]
    assert "train with --bf16" in problems[0] and "drop --ckpt-format" in problems[-1]


def test_llama3_8b_script_trains_without_the_refused_flags(tmp_path, capsys, no_launch):
    """The script's own switch DTYPE=bf16 drops its FP8 flags, which leaves
    --ckpt-format torch_dist the one refused (checked here before any
    process starts, as test_llama3_8b_script_is_refused_for_fp8_and_torch_dist_only
    checks the refusal under the script's own torchrun); with that line taken
    out (the one line a user must delete), the rest runs: GQA, SwiGLU,
    RMSNorm, RoPE, sample-based schedule with decoupled rates, per-token
    loss, the distributed optimizer, mock data with NullTokenizer,
    --sequence-parallel at t = 1 (turned off, as Megatron-LM does), the
    accepted-and-explained flags."""
    result, argv = _run_script("llama3_8b.sh", [str(tmp_path / "ckpt"), str(tmp_path / "tb")],
                               tmp_path, DTYPE="bf16", PTDP_SCRIPT_DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    flags = _train_flags(argv)
    assert not [flag for flag in flags if flag.startswith("--fp8")], flags
    # -d 2 is what the script's torchrun (two processes, t = p = 1) makes of it.
    status, _, error = train_refused([*flags, "--data-parallel-size", "2"], capsys)
    assert status == 2, error
    problems = [line for line in error.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and problems[0].startswith("  - --ckpt-format torch_dist"), error
    at = flags.index("--ckpt-format")
    assert flags[at:at + 2] == ["--ckpt-format", "torch_dist"]
    flags = flags[:at] + flags[at + 2:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    port = _free_port()
    trained = subprocess.run([TORCHRUN, "--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0",
                              "--master_addr", "localhost", "--master_port", str(port), "-m", "ptdp",
                              "train", *flags], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output
    for note in ("--use-mcore-models has no effect", "--sequence-parallel has no effect",
                 "--overlap-grad-reduce has no effect", "--attention-backend fused has no effect",
                 "ptdp: attention: PyTorch's scaled_dot_product_attention picks"):
        assert note in output, note
    assert "ptdp: 2 processes (t=1, p=1, d=2)" in output
    losses = _losses(output)
    assert len(losses) == 4 and all(0 < x < 20 for x in losses), output  # 32 samples / 8
    assert (tmp_path / "ckpt" / "latest").is_file()  # the script's $1, --save and --load


def test_sc21_interleaved_script_trains(tmp_path):
    """The paper's interleaved runs (figure 12): t = 2, p = 2 with two chunks
    per rank, full recomputation by the old --activations-checkpoint-method,
    --DDP-impl, fp16 with a fixed loss scale; ptdp's own launcher."""
    vocab, merges = _gpt2_files(tmp_path / "gpt2")
    result, argv = _run_script("sc21_run_figure_12.sh", [], tmp_path, MEGATRON_CODE_DIR=str(tmp_path),
                               MEGATRON_DATA=str(_data_copy(tmp_path)), BPE_VOCAB_FILE=str(vocab),
                               BPE_MERGE_FILE=str(merges))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "--activations-checkpoint-method" in argv
    assert "interleaved schedule with 2 chunks per rank" in output
    assert "--DDP-impl local has no effect" in output
    assert len(_losses(output)) == 4, output


def test_the_docs_table_covers_every_flag_the_scripts_use():
    """docs/megatron-flags.md has a row for each flag of the scripts,
    and every flag it names is one `ptdp train` takes."""
    table = (ROOT / "docs" / "megatron-flags.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    documented = {flag for row in rows for flag in re.findall(r"`(--[A-Za-z][\w-]*)", row.split("|")[1])}
    used = set()
    for script in SCRIPTS.glob("*.sh"):
        text = "\n".join(line for line in script.read_text().splitlines() if not line.startswith("#"))
        used |= set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", text))
    used -= {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"}  # torchrun's
    used -= {"--mpi", "--container-image", "--container-mounts", "--container-workdir"}  # srun's
    used -= {"--sample", "--cpuctxsw", "--trace", "--capture-range", "--capture-range-end",
             "--cuda-graph-trace", "--cuda-memory-usage"}  # the profiler's (nsys)
    assert used - documented == set()
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    known = {option for action in train._actions for option in action.option_strings}
    assert documented - known == set()


def _sentencepiece_data(folder: Path) -> tuple[Path, Path]:
    """(tokenizer.model, data prefix): a SentencePiece model trained on the
    demo corpus's lines and 25,000 of them preprocessed with it as
    Llama2Tokenizer (enough documents for the script's 99990,8,2 split to
    hold validation documents)."""
    import io

    spm = pytest.importorskip("sentencepiece")
    from ptdp.data.corpus import read_works
    from ptdp.data.preprocess import TokenizerSpec, preprocess

    folder.mkdir()
    lines = [line.strip() for _, text in read_works() for line in text.splitlines()
             if len(line.strip()) > 20][:25_000]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines[:5000]), model_writer=model,
                                   vocab_size=256, model_type="bpe", minloglevel=2)
    tokenizer = folder / "tokenizer.model"
    tokenizer.write_bytes(model.getvalue())
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    preprocess([corpus], folder / "mixtral", TokenizerSpec("Llama2Tokenizer",
                                                           tokenizer_model=str(tokenizer)),
               append_eod=True, progress=False)
    return tokenizer, folder / "mixtral_text_document"


def _script_model(flags: list[str]):
    """The model a script's flags describe, as `ptdp train` reads them."""
    from ptdp.commands.train import config_from_args

    return config_from_args(build_parser().parse_args(["train", *flags])).model


def test_mixtral_8x7b_script_trains_and_its_model_equals_one_process_under_two_layouts(
        tmp_path, pools):
    """Megatron-LM's Mixtral script as written (Llama2Tokenizer data, 8
    experts top-2 with the aux loss, alltoall dispatch, grouped GEMM, p = 2
    with EP = 2 folded over d = 2, the distributed optimizer, bf16); then
    its model, read from the flags the script gave, trains 3 steps under the
    script's layout and under t = 2 with EP = 2 over the tensor ranks as one
    process does (fp32: bf16 rounds differently under each layout)."""
    from tests import test_moe_parallel as moe

    tokenizer, data = _sentencepiece_data(tmp_path / "data")
    checkpoints = tmp_path / "checkpoints"
    result, argv = _run_script("mixtral_8x7b.sh", [str(checkpoints), str(tokenizer), str(data)],
                               tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    flags = _train_flags(argv)
    for flag in ("--tokenizer-type", "--moe-grouped-gemm", "--no-position-embedding", "--bf16"):
        assert flag in flags
    assert "ptdp: 4 processes (t=1, p=2, d=2), experts over EP=2 × ETP=1" in output
    losses = _losses(output)
    assert len(losses) == 4 and all(0 < x < 20 for x in losses), output
    assert len(re.findall(r"val loss \d", output)) == 2
    assert (checkpoints / "latest").read_text().strip() == "iter_0000004"
    assert any((checkpoints / "tensorboard").rglob("events.out.tfevents.*"))

    # The tokenizer gives the vocabulary at launch: the run says which.
    vocabulary = int(re.search(r"vocabulary (\d+) padded", output).group(1))
    model = dataclasses.replace(_script_model(flags), vocab_size=vocabulary)
    assert (model.num_experts, model.moe_router_topk, model.moe_ffn_size) == (8, 2, 96)
    layouts = [moe.Layout(p=2, d=2, ep=2, distributed=True, dispatcher="alltoall",
                          grouped_gemm=True, model="mixtral"),
               moe.Layout(t=2, d=2, ep=2, etp=1, sequence_parallel=True, model="mixtral")]
    per_rank = pools(4).run(moe._layouts_vs_one_process, layouts, {"mixtral": model})
    for i, layout in enumerate(layouts):
        compared = set().union(*(results[i][1] for results in per_rank))
        assert compared == set(moe.logical_shapes(model)), layout.name


def _pretrained_qwen3_moe(folder: Path, vocabulary: int = 300) -> Path:
    """A random Hugging Face Qwen3-MoE of the fixture's shrunk shape with a
    word-level tokenizer.json, converted by `ptdp convert --from-hf`: the
    script's --pretrained-checkpoint (and its tokenizer directory)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ptdp.cli import main

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocabulary, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=0, eos_token_id=1)
    torch = pytest.importorskip("torch")
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    directory = folder / "hf"
    hf.save_pretrained(str(directory))
    words = {"<s>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(vocabulary - 2)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    assert main(["convert", "--from-hf", str(directory), "--save", str(folder / "ckpt")]) == 0
    return directory


def test_qwen3_30b_a3b_model_trains_from_a_converted_checkpoint_and_equals_one_process(
        tmp_path, pools, capsys, no_launch):
    """The Qwen3-30B-A3B model flags (q/k norms, heads twice h/a wide, 8 of
    8 experts top-2, alltoall, --pretrained-checkpoint, the inference and
    Transformer Engine flags): refused for --ckpt-format torch_dist only;
    without that line it fine-tunes a converted Hugging Face Qwen3-MoE
    under torchrun at t = 2, EP = 2 (× ETP 2) with sequence parallelism, in
    bf16. Its model, read from the flags, trains under that layout and at
    p = 2 with EP = 2 over d = 2 as one process does (fp32)."""
    from tests import test_moe_parallel as moe

    from ptdp.cli import main

    tokenizer = _pretrained_qwen3_moe(tmp_path / "pretrained")
    extra = dict(CHECKPOINT=str(tmp_path / "pretrained" / "ckpt"), TOKENIZER=str(tokenizer),
                 VOCAB_SIZE="300", PTDP_SCRIPT_DRY_RUN="1")
    result, argv = _run_script("qwen3_30b_a3b.sh", [], tmp_path, **extra)
    assert result.returncode == 0, result.stderr
    flags = _train_flags(argv)
    capsys.readouterr()
    # Checked here before any process starts; -d 2 is what torchrun's four
    # processes make of the script's t = 2.
    assert main(["train", *flags, "--data-parallel-size", "2"]) == 2
    error = capsys.readouterr().err
    problems = [line for line in error.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1 and problems[0].startswith(
        "  - --ckpt-format torch_dist: ptdp writes and reads its own"), error
    at = flags.index("--ckpt-format")
    flags = flags[:at] + flags[at + 2:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    trained = subprocess.run([TORCHRUN, "--nproc_per_node", "4", "--nnodes", "1", "--node_rank", "0",
                              "--master_addr", "localhost", "--master_port", str(_free_port()),
                              "-m", "ptdp", "train", *flags], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0, output
    for note in ("--pretrained-checkpoint", "as with --load DIR --finetune",
                 "--te-rng-tracker has no effect", "--inference-max-seq-length 32 has no effect",
                 "--optimizer adam has no effect", "--dist-ckpt-strictness log_unexpected has no "
                 "effect"):
        assert note in output, note
    assert "ptdp: 4 processes (t=2, p=1, d=2), experts over EP=2 × ETP=2" in output
    losses = _losses(output)
    assert len(losses) == 4 and all(0 < x < 20 for x in losses), output

    model = _script_model(flags)
    assert (model.kv_channels, model.qk_layernorm, model.num_experts) == (32, True, 8)
    layouts = [moe.Layout(t=2, d=2, ep=2, sequence_parallel=True, dispatcher="alltoall",
                          model="qwen3"),
               moe.Layout(p=2, d=2, ep=2, model="qwen3")]
    per_rank = pools(4).run(moe._layouts_vs_one_process, layouts, {"qwen3": model})
    for i, layout in enumerate(layouts):
        compared = set().union(*(results[i][1] for results in per_rank))
        assert compared == set(moe.logical_shapes(model)), layout.name


def _hf_tokenizer_data(folder: Path) -> tuple[Path, Path]:
    """(tokenizer directory, data prefix): a byte-level BPE tokenizer.json of
    300 tokens trained on the demo corpus's lines, and 5,000 of them
    preprocessed with it as HuggingFaceTokenizer (the script's 99,1,0 split
    leaves about 50 documents for validation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ptdp.data.corpus import read_works
    from ptdp.data.preprocess import TokenizerSpec, preprocess

    directory = folder / "tokenizer"
    directory.mkdir(parents=True)
    lines = [line.strip() for _, text in read_works() for line in text.splitlines()
             if len(line.strip()) > 20][:5000]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<｜end▁of▁sentence｜>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.save(str(directory / "tokenizer.json"))
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    preprocess([corpus], folder / "deepseek",
               TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(directory)),
               append_eod=True, progress=False)
    return directory, folder / "deepseek_text_document"


def test_deepseek_v3_megatron_fsdp_script_trains_and_its_model_equals_one_process(
        tmp_path, pools):
    """Megatron-LM's DeepSeek-V3 Megatron-FSDP script as written, submitted
    with sbatch and started by srun (MLA, MTP, group-limited sigmoid routing
    with expert bias and forced balancing, the dense first layer, shared
    experts, flex dispatch, --recompute-modules mlp moe mla_up_proj
    layernorm, ZeRO-3 with bf16 gradients, per-token loss, bf16, a
    HuggingFaceTokenizer directory): it trains its 4 iterations on 4 SLURM
    tasks, evaluates and saves. Then its model, read from the flags the
    script gave, trains 3 steps under the script's layout (d = 4, EP = 2,
    ZeRO-3) and under t = 2 with sequence parallelism, c = 2 and EP = 2 as
    one process does (fp32)."""
    from tests import test_moe_parallel as moe

    tokenizer, data = _hf_tokenizer_data(tmp_path / "data")
    output_path = tmp_path / "output"
    result, argv = _run_script("deepseek_v3_mfsdp.sh", [], tmp_path, MEGATRON_PATH=str(tmp_path),
                            OUTPUT_PATH=str(output_path), DATA_PATH=str(data),
                            TOKENIZER=str(tokenizer))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "ptdp: 4 processes (t=1, p=1, d=4), experts over EP=2 × ETP=1" in output, output
    assert "optim_grads_params (ZeRO-3" in output
    for note in ("--moe-token-dispatcher-type flex runs as ptdp's alltoall dispatcher",
                 "--ckpt-format fsdp_dtensor has no effect", "--wandb-project"):
        assert note in output, note
    assert "ptdp: error" not in output and "refused" not in output
    losses = _losses(output)
    assert len(losses) == 4 and all(0 < x < 20 for x in losses), output
    assert len(re.findall(r"mtp_1 loss \d", output)) == 4
    assert len(re.findall(r"val loss \d", output)) == 2
    checkpoints = output_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "iter_0000004"
    assert any((output_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert (output_path / "slurm_logs" / "1.log").read_text().count("iteration     4/4") == 1

    flags = _train_flags(argv)
    model = dataclasses.replace(_script_model(flags), vocab_size=300)
    assert (model.multi_latent_attention, model.mtp_num_layers, model.num_experts,
            model.moe_router_force_load_balancing, model.moe_layer_pattern) == \
        (True, 1, 8, True, [0, 1, 1])
    assert model.recompute_modules == ["mlp", "moe", "mla_up_proj", "layernorm"]
    common = dict(ep=2, dispatcher=model.moe_token_dispatcher_type, per_token_loss=True,
                  model="deepseek")
    layouts = [moe.Layout(d=4, distributed=True, grouped_gemm=True,
                          strategy="optim_grads_params", **common),
               moe.Layout(t=2, c=2, etp=1, sequence_parallel=True, **common)]
    per_rank = pools(4).run(moe._layouts_vs_one_process, layouts, {"deepseek": model})
    biases = {f"{layer}.mlp.router.expert_bias"  # buffers: moved by ± the rate, equal exactly
              for layer in ("layers.1", "layers.2", "mtp.layers.0.transformer_layer")}
    for i, layout in enumerate(layouts):
        compared = set().union(*(results[i][1] for results in per_rank))
        assert compared == set(moe.logical_shapes(model)) | biases, layout.name
