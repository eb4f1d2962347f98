"""`ptdp plan`: the search, one-layout evaluation, output forms, and the
paper's takeaways coming out of the planner by themselves (nothing here is
fitted to them: the a100 profile is calibrated on the 1.7B point only)."""

import dataclasses
import json

import pytest

from ptdp.cli import build_parser, main
from ptdp.config import ModelConfig
from ptdp.perf.analytic.counts import parameter_count
from ptdp.perf.simulate.bounds import compute_lower_bound, partial_bound_shape
from ptdp.perf.layout import Layout, Workload
from ptdp.commands.plan import model_from_args
from ptdp.perf.plan.planner import EXACT_ROWS, candidate_layouts, evaluate_layout, search
from ptdp.perf.price.profiles import HardwareProfile, load_profile

A100 = load_profile("a100")
GPT_18B = ModelConfig(num_layers=40, hidden_size=6144, num_attention_heads=48, seq_length=2048,
                      vocab_size=51200)
GPT_39B = ModelConfig(num_layers=48, hidden_size=8192, num_attention_heads=64, seq_length=2048,
                      vocab_size=51200)


def test_candidates_are_exactly_the_valid_layouts():
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=100)
    workload = Workload(model, 8)
    layouts = list(candidate_layouts(workload, 4))
    assert layouts and all(not layout.valid_for(model, 8) for layout in layouts)
    assert all(layout.devices == 4 for layout in layouts)
    assert Layout(t=2, p=2, d=1, b=1, v=2) in layouts
    assert Layout(t=4, p=1, d=1, b=8) in layouts
    assert not any(layout.t == 3 or layout.v == 3 for layout in layouts)


def test_tensor_parallelism_stays_inside_a_server():
    """Takeaway 1: on DGX A100 servers (8 GPUs), the best layout of a 39B GPT
    on 64 GPUs keeps t <= 8, and the best layout with t = 16 is slower
    because of its tensor all-reduces over InfiniBand."""
    restrictions = dict(microbatch_sizes=(1, 2, 4), chunk_counts=(1, 2), recompute=("full",),
                        distributed_optimizer=(False,))
    best = search(Workload(GPT_39B, 512), 64, A100, **restrictions)[0]
    assert best.layout.t <= 8
    wide = search(Workload(GPT_39B, 512), 64, A100, tensor_sizes=(16, 32, 64), **restrictions)[0]
    assert wide.seconds > best.seconds
    category = "tensor all-reduce"
    assert wide.prediction.seconds_by_category[category] > best.prediction.seconds_by_category[category]


def test_interleaving_helps_most_at_small_batch():
    """Takeaway: the interleaved schedule beats the plain one at small batch;
    the gap shrinks as the batch grows (its bubble shrinks with m anyway)."""
    gains = []
    for batch in (32, 64, 128, 256):
        workload = Workload(GPT_18B, batch)
        plain = evaluate_layout(workload, Layout(t=8, p=4, d=1, b=1, recompute="full"), A100)
        interleaved = evaluate_layout(workload, Layout(t=8, p=4, d=1, b=1, v=2, recompute="full"),
                                      A100)
        gains.append(plain.seconds / interleaved.seconds)
    # Predicted: 3.6 %, 1.6 %, 0.5 %, -0.03 % faster at B = 32 ... 256: the
    # bubble saving shrinks with m while the extra transfers stay, so at
    # large batch the two schedules are even.
    assert gains[0] > 1.02, gains
    assert gains == sorted(gains, reverse=True), gains
    assert abs(gains[-1] - 1) < 0.01, gains


def test_a_middle_microbatch_size_wins():
    """Takeaway 3: with p > 1 the best microbatch size is neither the
    smallest (GEMMs too small) nor the largest (bubble too large)."""
    workload = Workload(GPT_18B, 128)
    times = {b: evaluate_layout(workload, Layout(t=8, p=4, d=1, b=b, recompute="full"),
                                A100).seconds for b in (1, 2, 4, 8, 16)}
    best = min(times, key=times.get)
    assert best not in (1, 16), times


def test_plan_command_json_and_flags(capsys, tmp_path):
    picture = tmp_path / "plan.png"
    argv = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "1024", "--vocab-size", "51200", "--gpus", "8", "--gpu", "a100",
            "--global-batch-size", "32"]
    assert main(argv + ["--json", "--top", "3", "--plot", str(picture)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["results"]) == 3
    first = data["results"][0]
    for key in ("layout", "iteration_seconds", "tflops_per_device", "memory_per_device_bytes"):
        assert key in first
    times = [r["iteration_seconds"] for r in data["results"]]
    assert times == sorted(times)
    assert picture.read_bytes()[:4] == b"\x89PNG"

    assert main(argv + ["--print-flags", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "ptdp train --num-layers 8 --hidden-size 1024" in out
    assert "--bf16 --tensor-model-parallel-size" in out

    assert main(argv + ["-t", "2", "-p", "2", "--micro-batch-size", "2", "--fix-all"]) == 0
    out = capsys.readouterr().out
    assert "\nt=2 p=2 d=2 b=2: " in out and "s per iteration" in out


def test_plan_as_a_program_prints_and_writes_everything_before_it_exits(tmp_path):
    """Run as a program, `ptdp plan` ends the process without freeing its
    caches (cli._exit_without_freeing): what it printed and drew is whole,
    and its exit status is the command's, as in-process."""
    import subprocess
    import sys

    picture = tmp_path / "plan.png"
    argv = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "1024", "--vocab-size", "51200", "--gpus", "8", "--gpu", "a100",
            "--global-batch-size", "32", "--json", "--top", "3", "--plot", str(picture)]
    done = subprocess.run([sys.executable, "-m", "ptdp.cli", *argv], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["results"]) == 3
    assert picture.read_bytes()[:4] == b"\x89PNG"
    refused = subprocess.run([sys.executable, "-m", "ptdp.cli", *argv[:-5], "-t", "3"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "not a multiple of t·p = 3" in refused.stderr


@pytest.mark.parametrize("extra, message", [
    (["-t", "3"], "not a multiple of t·p = 3"),
    (["--gpu", "nonesuch"], "--gpu nonesuch"),
    (["--gpus", "0"], "--gpus must be positive"),
])
def test_plan_errors(capsys, extra, message):
    argv = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--gpus", "8", "--global-batch-size", "32"]
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err


# ---- the search's pruning: a lower bound, and the same rows as pricing everything

SMALL_CPU = HardwareProfile(name="cpu-test", kind="cpu", devices_per_server=256, peak_tflops=0.1,
                            peak_tflops_fp32=0.1, gemm_efficiency=1.0, gemm_ramp_seconds=2e-6,
                            memory_bandwidth=10e9, intra_bandwidth=1e9, intra_latency=1e-4,
                            inter_bandwidth=1e9, inter_latency=1e-4, launch_overhead=3e-6,
                            cores=4)
PEERS_GPT = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128,
                        vocab_size=8192)


# A mixture of experts (every layer but the first): the bound prices its
# stages as the simulator does (test_the_lower_bound_is_the_makespan_...).
SMALL_MOE = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                        vocab_size=32000, swiglu=True, normalization="RMSNorm",
                        position_embedding_type="rope", disable_bias_linear=True,
                        hidden_dropout=0.0, attention_dropout=0.0, num_experts=16,
                        moe_router_topk=2, moe_ffn_hidden_size=1024,
                        moe_layer_freq="([0]+[1]*3)")


@pytest.mark.parametrize("workload, devices, profile, priced", [
    # 8 layers of the 18B's width; servers of 8: links of both kinds.
    (Workload(dataclasses.replace(GPT_18B, num_layers=8), 64), 16, A100, 0.5),
    # Contention stretches computes beyond the bound: it prunes less.
    (Workload(PEERS_GPT, 16, "fp32"), 8, SMALL_CPU, 0.75),
], ids=["18B-wide-a100", "small-cpu"])
def test_the_lower_bound_holds_and_the_pruned_search_equals_pricing_everything(
        workload, devices, profile, priced):
    """No layout's simulated time is below its bound (the search's pruning
    rests on it), over every candidate: each schedule, split, recomputation,
    sequence parallelism and optimizer. And the search's first EXACT_ROWS
    rows are exactly those of pricing every layout. The bound without the
    reductions (what a best-only search with a cutoff reads first) is never
    above the whole bound."""
    everything = search(workload, devices, profile, exhaustive=True)
    assert len(everything) > 2 * EXACT_ROWS
    kinds = {e.layout.schedule_kind for e in everything}
    assert {"1f1b", "interleaved", "zb-h1", "zbv"} <= kinds
    assert any(not e.layout.split.even for e in everything)
    for e in everything:
        bound = compute_lower_bound(workload, e.layout, profile)
        assert bound <= e.seconds * (1 + 1e-9), (e.layout, bound, e.seconds)
        # (without its reductions and optimizer: never above the whole bound)
        assert compute_lower_bound(workload, e.layout, profile, reductions=False) <= bound
    # The search bounds a shape's layouts once (partial_bound_shape): each shape's bound alike.
    by_shape: dict[tuple, set] = {}
    for e in everything:
        by_shape.setdefault(partial_bound_shape(e.layout), set()).add(
            compute_lower_bound(workload, e.layout, profile, reductions=False))
    assert all(len(bounds) == 1 for bounds in by_shape.values())
    assert len(by_shape) < len(everything)
    pruned = search(workload, devices, profile)
    assert len(pruned) < len(everything) * priced
    assert [(e.layout, e.seconds) for e in pruned[:EXACT_ROWS]] == \
        [(e.layout, e.seconds) for e in everything[:EXACT_ROWS]]


def test_the_lower_bound_is_the_makespan_when_only_compute_costs():
    """With free links, no optimizer and the same cost per stage, 1F1B's
    bound is its simulated time: the fill and drain are counted exactly."""
    free = HardwareProfile(name="free-links", peak_tflops=100.0, memory_bandwidth=1e15,
                           intra_bandwidth=1e30, intra_latency=0.0, inter_bandwidth=1e30,
                           inter_latency=0.0, launch_overhead=0.0)
    model = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                        vocab_size=128)
    workload = Workload(model, 16)
    for layout in (Layout(p=4, b=1), Layout(p=2, b=2), Layout(p=8, b=1)):
        predicted = evaluate_layout(workload, layout, free).prediction
        bound = compute_lower_bound(workload, layout, free)
        assert bound <= predicted.iteration_seconds * (1 + 1e-12)
        assert bound == pytest.approx(predicted.iteration_seconds, rel=0.02), layout
    # A mixture of experts: the bound prices its MoE layers as the simulator does.
    moe = Workload(dataclasses.replace(SMALL_MOE, seq_length=1024, vocab_size=128), 16)
    for layout in (Layout(p=2, b=1), Layout(p=4, b=1, ep=2, d=2)):
        predicted = evaluate_layout(moe, layout, free).prediction
        bound = compute_lower_bound(moe, layout, free)
        assert bound <= predicted.iteration_seconds * (1 + 1e-12)
        assert bound == pytest.approx(predicted.iteration_seconds, rel=0.05), layout


def test_print_flags_is_a_whole_train_command_for_the_planned_model(capsys):
    """`--print-flags` prints a `ptdp train` command that, parsed by `ptdp
    train`'s own parser, configures the model the plan priced (shape,
    sequence, vocabulary, the Llama options), its precision and layout."""
    import shlex

    from ptdp.cli import build_parser
    from ptdp.commands.train import config_from_settings, settings_from_args

    shape = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "1024", "--vocab-size", "32000", "--ffn-hidden-size", "2816",
             "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
             "--group-query-attention", "--num-query-groups", "4",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    layout = ["-t", "2", "-p", "2", "--micro-batch-size", "2", "--recompute-granularity", "full",
              "--sequence-parallel"]
    assert main(["plan", *shape, "--gpus", "8", "--global-batch-size", "32", "--precision",
                 "fp16", *layout, "--print-flags"]) == 0
    out = capsys.readouterr().out
    assert "assuming: sequence length 1024, vocabulary 32000" in out and "fp16" in out
    command = shlex.split(out.strip().splitlines()[-1])
    assert command[:2] == ["ptdp", "train"]
    config = config_from_settings(settings_from_args(build_parser().parse_args(command[1:])))
    planned = model_from_args(build_parser().parse_args(["plan", *shape, "--gpus", "8",
                                                         "--global-batch-size", "32"]))
    for field in dataclasses.fields(ModelConfig):
        if not field.name.startswith("recompute"):
            assert getattr(config.model, field.name) == getattr(planned, field.name), field.name
    assert config.model.recompute_granularity == "full"
    assert config.train.fp16 and not config.train.bf16
    assert config.train.global_batch_size == 32 and config.train.micro_batch_size == 2
    parallel = config.parallel
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
            parallel.data_parallel_size) == (2, 2, 2)
    assert parallel.sequence_parallel


def test_plan_shows_its_assumptions_and_progress(capsys):
    argv = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--gpus", "8", "--global-batch-size", "32"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert ("assuming: sequence length 2048, vocabulary 51200 (padded to a multiple of 128·t), "
            "bf16, global batch 32, 8 devices of profile a100") in captured.out
    # Not a terminal here: one line as the search starts and one as it ends.
    assert "ptdp plan: searching" in captured.err and "ptdp plan: priced" in captured.err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = capsys.readouterr().out
    assert "sequence length the plan assumes (default: 2048)" in help_text
    assert "(default: 51200)" in help_text and "(default: bf16" in help_text


def test_moe_flags_describe_an_moe_and_other_moe_flags_are_refused_with_the_reason(capsys):
    """The MoE flags of the model are train's and describe the model plan
    prices (here its parameters); the others are refused, saying why."""
    argv = ["plan", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--gpus", "4", "--global-batch-size", "8", "--seq-length", "256",
            "--disable-bias-linear", "--fix-all", "--json"]
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
           "--moe-shared-expert-intermediate-size", "256", "--moe-layer-freq", "([0]+[1]*3)"]
    assert main(argv + moe) == 0
    planned = model_from_args(build_parser().parse_args(argv + moe))
    assert (planned.num_experts, planned.moe_router_topk, planned.moe_ffn_hidden_size,
            planned.moe_shared_expert_intermediate_size) == (8, 2, 512, 256)
    assert planned.moe_layer_pattern == [False, True, True, True]
    assert json.loads(capsys.readouterr().out)["parameters"] == parameter_count(planned)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] < parameter_count(planned)
    # The routing and balancing settings are taken (DeepSeek-V3's flags paste)...
    assert main(argv + moe + ["--moe-aux-loss-coeff", "0.01", "--moe-router-score-function",
                              "sigmoid", "--moe-router-enable-expert-bias"]) == 0
    capsys.readouterr()
    # ...a kernel flag of `ptdp train`'s is not: no cost of the plan's changes with it.
    with pytest.raises(SystemExit) as stopped:
        main(argv + moe + ["--moe-permute-fusion"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(
        "ptdp plan: error: --moe-permute-fusion: ptdp plan takes the MoE flags that describe the "
        "model (--num-experts, --moe-ffn-hidden-size, --moe-router-topk, "
        "--moe-shared-expert-intermediate-size, --moe-layer-freq, --moe-expert-capacity-factor, "
        "--moe-token-dispatcher-type, --moe-router-load-balancing-type, --moe-aux-loss-coeff, ")
    assert error.endswith("); this one does not change its costs: drop it")


def test_the_hopper_profiles_say_how_far_to_trust_them_for_ptdps_own_runs(capsys):
    """ptdp's own H200 runs measure slower than the h100/h200 model predicts
    (bench/RESULTS.md): a plan on those profiles says so; on a100 it does not."""
    args = ["plan", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
            "--gpus", "8", "--global-batch-size", "16", "--top", "1"]
    for gpu, noted in (("h100", True), ("h200", True), ("a100", False)):
        assert main([*args, "--gpu", gpu]) == 0
        assert ("ptdp's own runs on an H200 measured slower" in capsys.readouterr().out) is noted


LONG_CONTEXT = ["plan", "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
                "--seq-length", "131072", "--max-position-embeddings", "131072",
                "--position-embedding-type", "rope", "--gpus", "16", "--gpu", "h100",
                "--global-batch-size", "8", "--json"]


def test_attention_dropout_that_keeps_context_parallelism_out_is_said(capsys):
    """Issue 38: under the default attention dropout the search left c out
    saying only "one value here: c=1"; the plan it gave was slower than the
    one without dropout."""
    assert main(LONG_CONTEXT) == 0
    with_dropout = json.loads(capsys.readouterr().out)
    assert "c=1 (--attention-dropout: ptdp's context-parallel attention has no dropout yet)" in \
        with_dropout["dimensions"]
    assert all("c" not in row["layout"] for row in with_dropout["results"])  # c = 1
    [note] = with_dropout["notes"]
    assert note.startswith("note: context parallelism was not searched") and \
        "--attention-dropout is 0.1 (the default, as in Megatron-LM)" in note
    # The layout it names is what the plan without dropout finds, at that time.
    assert main([*LONG_CONTEXT, "--attention-dropout", "0"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert without["notes"] == []
    best = without["results"][0]
    assert best["layout"]["c"] > 1
    assert f"takes {best['iteration_seconds']:.3f} s per iteration" in note
    assert best["iteration_seconds"] * 1.05 <= with_dropout["results"][0]["iteration_seconds"]


# Megatron-LM's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh: its model
# flags as the script gives them (MLA, MoE routing, MTP, the recomputed
# modules, the benchmark's forced balancing, the precision), less two of
# ptdp train's that describe kernels rather than the model
# (--moe-flex-dispatcher-backend, --moe-permute-fusion).
DEEPSEEK_V3 = (
    "--recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm "
    "--seq-length 4096 --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
    "--num-attention-heads 128 --kv-channels 128 --max-position-embeddings 4096 "
    "--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232 "
    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights "
    "--multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 --qk-layernorm "
    "--num-experts 256 --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048 "
    "--moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss "
    "--moe-router-topk 8 --moe-token-dispatcher-type flex --moe-router-pre-softmax "
    "--moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4 "
    "--moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5 "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 "
    "--moe-router-force-load-balancing --q-lora-rank 1536 "
    "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
    "--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 "
    "--mtp-loss-scaling-factor 0.1 --init-method-std 0.02 --disable-bias-linear --bf16").split()
DEEPSEEK_LAYOUT = ["--vocab-size", "129280", "--gpus", "256", "--global-batch-size", "2048",
                   "--micro-batch-size", "4", "-t", "1", "--expert-model-parallel-size", "8",
                   "--expert-tensor-parallel-size", "1", "--data-parallel-size", "256",
                   "--gpu", "h100", "--fix-all"]


def test_plan_prices_megatron_lms_deepseek_v3_model_flags(capsys):
    """The DeepSeek-V3 script's model flags paste into `ptdp plan` as they
    are, describe the model (MLA widths, YaRN, MTP, routing, the recomputed
    modules: DeepSeek-V3's 671 B parameters and its MTP module's own) and
    are priced: the MTP module costs a layer and an output layer more, and
    --print-flags gives a `ptdp train` command of the same model."""
    import shlex

    from ptdp.commands.train import config_from_settings, settings_from_args

    assert main(["plan", *DEEPSEEK_V3, *DEEPSEEK_LAYOUT, "--json", "--print-flags"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    plan, command = json.loads("\n".join(out[:-1])), shlex.split(out[-1])
    planned = model_from_args(build_parser().parse_args(["plan", *DEEPSEEK_V3,
                                                         *DEEPSEEK_LAYOUT]))
    assert (planned.multi_latent_attention, planned.q_lora_rank, planned.kv_lora_rank,
            planned.mtp_depth, planned.yarn) == (True, 1536, 512, 1, True)
    assert planned.recompute_modules == ["mlp", "moe", "mla_up_proj", "layernorm"]
    without_mtp = dataclasses.replace(planned, mtp_num_layers=None)
    assert 671e9 < parameter_count(without_mtp) < 672e9          # DeepSeek-V3's published 671 B
    # DeepSeek-V3's MTP module: 14 B, of which 11.5 B its own (the embedding
    # and the output layer are the model's, counted once)
    assert 11.5e9 < plan["parameters"] - parameter_count(without_mtp) < 11.7e9
    (result,) = plan["results"]
    assert result["layout"]["recompute"] == "selective" and result["iteration_seconds"] > 0
    assert result["memory_breakdown_bytes"]["activations"] > 0
    # MTP's layer and output layer: more time and activations than without it
    assert main(["plan", *DEEPSEEK_V3, *DEEPSEEK_LAYOUT, "--json", "--mtp-num-layers", "0"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)["results"]
    assert plain["iteration_seconds"] < result["iteration_seconds"]
    assert plain["memory_breakdown_bytes"]["activations"] < \
        result["memory_breakdown_bytes"]["activations"]
    # The printed command trains the model the plan priced, with the modules.
    assert command[:2] == ["ptdp", "train"]
    config = config_from_settings(settings_from_args(build_parser().parse_args(command[1:])))
    for field in dataclasses.fields(ModelConfig):
        if field.name != "recompute_granularity":
            assert getattr(config.model, field.name) == getattr(planned, field.name), field.name
    assert config.model.recompute_granularity == "selective"


def test_recompute_modules_need_selective_recomputation_as_in_ptdp_train(capsys):
    """--recompute-modules without --recompute-granularity selective is
    refused with `ptdp train`'s message; mla_up_proj without MLA too."""
    shape = ["plan", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--gpus", "4", "--global-batch-size", "8", "--seq-length", "256"]
    for extra, message in (
            (["--recompute-modules", "mlp"], "add --recompute-granularity selective"),
            (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
             "add --multi-latent-attention or drop mla_up_proj")):
        assert main(shape + extra) == 2
        assert message in capsys.readouterr().err
