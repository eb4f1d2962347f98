"""bench/gpu.py, the GPU benchmark, in its tiny CPU configuration: it runs,
its correctness checks pass, its figures are consistent with the model
(exact parameter count, the paper's FLOPs), and a check can fail."""

import copy
import dataclasses
import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ptdp.config import ModelConfig
from ptdp.perf.analytic.counts import active_parameter_count, parameter_count
from ptdp.perf.analytic.flops import model_flops_per_iteration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    """bench/gpu.py as a module (it imports bench/results.py as a script
    does, from its own folder)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-gpu") / "figures.json"
    # A time budget no machine reaches: on a loaded one the default budget
    # could skip runs, and which runs ran must not depend on speed. The
    # timeout only catches a hang (the run takes well under a minute).
    result = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--json", str(out),
                             "--time-budget", "86400"],
                            cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text()), result.stdout


def test_tiny_run_passes_its_checks(tiny_run):
    report, stdout = tiny_run
    assert report["checks_passed"] is True
    names = [c["name"] for c in report["checks"]]
    assert names == ["fused vs unfused, fp32", "fused vs unfused, bf16", "bf16 vs fp32 reference",
                     "MoE grouped vs looped expert GEMMs, bf16"]
    for check in report["checks"]:
        assert check["passed"]
        assert 0 <= check["loss_difference"] <= check["tolerance"]["loss"]
        assert 0 <= check["gradient_difference"] <= check["tolerance"]["gradient"]
    assert "| config | parameters |" in stdout  # the table is printed


def _positive_and_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_tiny_run_figures_are_sane(tiny_run):
    """The figures are consistent with each other and with the model. None is
    compared with a speed: they are timings of a shared machine (the tiny
    model over a matmul can exceed 1 when the matmul was timed while another
    process ran)."""
    report, _ = tiny_run
    assert report["tiny"] and report["device"] == "cpu"
    assert _positive_and_finite(report["matmul_peak_tflops"])
    runs = report["runs"]
    assert [r["recompute"] for r in runs] == [None, None, None, "selective", "full", "full", "full"]
    assert runs[1]["model"]["swiglu"] and runs[1]["model"]["num_query_groups"] == 2
    assert runs[6]["model"]["num_experts"] == 4 and runs[6]["model"]["moe_grouped_gemm"]
    for run in runs:
        assert "skipped" not in run  # no memory limit on a CPU, and the time budget is unbounded
        model = ModelConfig(**run["model"], recompute_granularity=run["recompute"])
        assert run["parameters"] == parameter_count(model)  # the built model's own count
        assert run["measured_iterations"] >= 1
        for figure in ("tokens_per_s", "model_tflops", "peak_fraction", "iteration_ms"):
            assert _positive_and_finite(run[figure]), (figure, run[figure])
        seconds = run["iteration_ms"] / 1e3
        assert run["tokens_per_s"] == pytest.approx(run["global_batch"] * run["seq_length"] / seconds)
        flops = model_flops_per_iteration(model, run["global_batch"], recompute=run["recompute"])
        assert run["flops_per_iteration"] == pytest.approx(flops)
        assert run["model_tflops"] == pytest.approx(flops / seconds / 1e12)
        assert run["peak_fraction"] == pytest.approx(run["model_tflops"] / report["matmul_peak_tflops"])
        assert all(math.isfinite(loss) for loss in run["losses"])
        assert run["peak_memory_bytes"] is None  # not separable per run on a CPU
    assert report["process_peak_rss_bytes"] > 0


def _observed(gpu, losses, gradient):
    gradient = torch.tensor(gradient, dtype=torch.float32)
    return gpu.Observed(losses=losses, gradient=gradient,
                        parameters=[("first", 0, 2), ("second", 2, len(gradient))])


def test_a_check_fails_on_different_runs(gpu):
    tolerance = gpu.Tolerance(loss=1e-5, gradient=1e-4)
    reference = _observed(gpu, [2.0, 1.5], [1.0, -1.0, 0.5, 0.25])

    same = gpu.compare("same", _observed(gpu, [2.0, 1.5], [1.0, -1.0, 0.5, 0.25]), reference, tolerance)
    assert same.passed and same.loss_difference == 0 and same.gradient_difference == 0

    other_loss = gpu.compare("loss", _observed(gpu, [2.0, 1.6], [1.0, -1.0, 0.5, 0.25]), reference,
                             tolerance)
    assert not other_loss.passed and other_loss.loss_difference == pytest.approx(0.1 / 1.5)

    other_gradient = gpu.compare("gradient", _observed(gpu, [2.0, 1.5], [1.0, -1.0, 0.5, 0.35]),
                                 reference, tolerance)
    assert not other_gradient.passed and other_gradient.loss_difference == 0
    assert other_gradient.worst_parameters[0][0] == "second"
    assert "FAILED" in other_gradient.describe() and "second" in other_gradient.describe()

    diverged = gpu.compare("nan", _observed(gpu, [float("nan"), 1.5], [1.0, -1.0, 0.5, 0.25]),
                           reference, tolerance)
    assert not diverged.passed and diverged.loss_difference == math.inf


def test_cpu_without_tiny_is_refused(gpu, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu.parse_args(["--device", "cpu"])
    assert exit_info.value.code == 2
    assert "--tiny" in capsys.readouterr().err


def test_gpu_plan_on_an_h200_sized_card(gpu):
    """The real configuration, planned without a GPU: the 1.3 B GPT fits
    without recomputation at its micro batch; the 2.7 B GPT at micro batch 24
    fits only with full recomputation; a smaller card shrinks the micro batch
    of the runs allowed to shrink, keeping the global batch."""
    h200 = 139 * 2 ** 30
    plans = [gpu.fit_micro_batch(run, h200) for run in gpu.GPU_SUITE.runs]
    assert [(run.name, run.recompute, run.micro_batch, problem is None) for run, _, problem in plans] == [
        ("GPT 1.3B", None, 8, True), ("Llama-style 1.3B", None, 8, True),
        ("Llama-style 1.3B, --compile", None, 8, True),
        ("GPT 2.7B", None, 24, False),
        ("GPT 2.7B", "selective", 24, False), ("GPT 2.7B", "full", 24, True),
        ("GPT 1.3B", "full", 8, True),
        ("MoE 8 experts top-2, grouped GEMM", "full", 8, True),
        ("MoE 8 experts top-2, looped GEMMs", "full", 8, True)]
    assert 1.25e9 < parameter_count(gpu.GPT_1_3B) < 1.35e9
    # the dense Llama-style model's active parameters, 2.9 times its parameters
    moe, dense = gpu.MOE_8X[True], gpu.LLAMA_1_3B
    assert active_parameter_count(moe) == pytest.approx(parameter_count(dense), rel=0.01)
    assert 2.8 < parameter_count(moe) / parameter_count(dense) < 3.0
    run, _, problem = gpu.fit_micro_batch(gpu.GPU_SUITE.runs[5], 80 * 2 ** 30)
    assert problem is None and run.micro_batch == 12 and run.global_batch == 48


# ------------------------------------------------------------------ context-parallel attention

def test_tiny_run_checks_context_attention(tiny_run):
    """The section of bench/gpu_context_attention.py, run by gpu.py in a
    child process: every CPU kernel in every dtype, both head sizes, causal
    and not, with grouped key/value heads, passes against plain fp32; the
    emulated ring passes against scaled_dot_product_attention."""
    report, stdout = tiny_run
    section = report["context_attention"]
    assert section["passed"] is True and section["errors"] == [] and "crashed" not in section
    blocks = section["blocks"]
    assert sorted((c["kernel"], c["dtype"], c["head_dim"], c["causal"]) for c in blocks) == sorted(
        (kernel, dtype, d, causal) for kernel in ("cpu_flash", "plain")
        for dtype in ("fp32", "bf16", "fp16") for d in (64, 128) for causal in (True, False))
    for case in blocks:
        assert case["passed"] and case["error"] is None, case
        assert case["groups"] < case["heads"]                        # grouped-query attention
        assert set(case["errors"]) == {"out", "lse", "dq", "dk", "dv"}
        for name, error in case["errors"].items():
            assert 0 <= error <= case["tolerance"] * case["scales"][name]
    assert section["chosen"]["fp32 d64"] == section["chosen"]["fp32 d128"] == "cpu_flash"
    assert len(section["chosen"]) == 6 and set(section["chosen"].values()) <= {"cpu_flash", "plain"}
    timing = section["timing"]
    assert timing["ratios"][timing["chosen"]] == 1.0 and set(timing["ratios"]) == {"cpu_flash", "plain"}
    assert all(_positive_and_finite(r) for r in timing["ratios"].values())
    ring = section["ring"]
    assert [(c["dtype"], c["kernel"]) for c in ring] == [
        ("fp32", "cpu_flash"), ("fp32", "plain"), ("bf16", "cpu_flash"), ("bf16", "plain")]
    for case in ring:
        assert case["passed"] and case["cp"] == 4 and set(case["errors"]) == {"out", "dq", "dk", "dv"}
    assert case["tolerance"] == 3e-2 and ring[0]["tolerance"] == 1e-5
    assert "context-parallel attention, cpu_flash bf16: ok, 4/4 cases" in stdout
    assert "context-parallel attention, `block_kernel` picks: fp32 d64 cpu_flash" in stdout
    assert "    fp32 cpu_flash: ok, worst error" in stdout
    assert "| kernel | dtype | block cases passed | worst block error | ring c = 4 vs SDPA |" in stdout
    assert "| cpu_flash | fp16 | 4/4 |" in stdout


@pytest.fixture
def attention(gpu):
    """bench/gpu_context_attention.py (gpu.py has imported it), with the
    kernel choice forgotten before and after: the tests change kernels."""
    from ptdp.parallel import block_attention
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the script: OpenMP's spinning threads crawl on shared cores
    block_attention._chosen.cache_clear()
    yield sys.modules["gpu_context_attention"]
    block_attention._chosen.cache_clear()
    torch.set_num_threads(threads)


def test_a_raising_kernel_is_recorded_and_the_rest_runs(attention, monkeypatch):
    from ptdp.parallel import block_attention

    def broken(*args):
        raise RuntimeError("no kernel image is available\nsecond line")

    monkeypatch.setitem(block_attention._FORWARD, "cpu_flash", broken)
    lines = []
    section = attention.section(torch.device("cpu"), True, lines.append)
    for case in section["blocks"]:
        assert case["passed"] == (case["kernel"] == "plain"), case
        if case["kernel"] == "cpu_flash":
            assert case["error"] == "RuntimeError: no kernel image is available"
    assert set(section["chosen"].values()) == {"plain"}      # the probe passes it over
    assert set(section["timing"]["ratios"]) == {"plain"}
    assert [(c["kernel"], c["passed"], c["error"]) for c in section["ring"]] == [
        ("cpu_flash", False, "RuntimeError: no kernel image is available"), ("plain", True, None)] * 2
    # What runs (plain) works, so the section passes; the failure is reported.
    assert section["passed"] is True
    assert "context-parallel attention, cpu_flash fp32: FAILED, 0/4 cases" in lines
    assert "    fp32 cpu_flash: FAILED, RuntimeError: no kernel image is available" in lines
    assert "| cpu_flash | bf16 | 0/4 | n/a (RuntimeError: no kernel image is available) |" in \
        attention.markdown(section)


def test_a_wrong_kernel_fails_its_case(attention, monkeypatch):
    """A kernel whose LSE is in base 2 (a plausible slip) fails on the LSE."""
    from ptdp.parallel import block_attention

    def base_two(q, k, v, causal, scale):
        out, lse = block_attention._plain_forward(q, k, v, causal, scale)
        return out, lse / math.log(2)

    monkeypatch.setitem(block_attention._FORWARD, "cpu_flash", base_two)
    case = attention.check_block("cpu_flash", "fp32", 64, True, attention.TINY_SIZES,
                                 torch.device("cpu"))
    assert not case["passed"] and case["error"] is None
    assert case["errors"]["lse"] > 0.1 * case["scales"]["lse"]
    assert case["errors"]["out"] <= 1e-5 * case["scales"]["out"]
    assert attention.worst_relative(case)[0] == "lse"


def test_a_dying_check_process_is_recorded(attention):
    """gpu.py goes on when the child process faults or hangs."""
    lines = []
    died = attention.run_isolated("cpu", True, 60, lines.append, command=[
        sys.executable, "-c", "import sys; print('started'); sys.exit('illegal memory access')"])
    assert died == {"crashed": "exit status 1: illegal memory access", "passed": False}
    assert lines == ["started", "context-parallel attention: FAILED, the check exit status 1: "
                                "illegal memory access"]
    hung = attention.run_isolated("cpu", True, 1, lines.append,
                                  command=[sys.executable, "-c", "import time; time.sleep(60)"])
    assert hung["crashed"] == "ran past 1 s"
    assert "did not finish (ran past 1 s)" in attention.markdown(hung)


# ------------------------------------------------------------------ kernel sweep

@pytest.fixture
def sweep(gpu):
    """bench/gpu_kernels_sweep.py (gpu.py has imported it), on one thread as the script runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield sys.modules["gpu_kernels_sweep"]
    torch.set_num_threads(threads)


def test_sweep_shapes_are_the_published_layers(sweep):
    """The GEMM shapes are one layer's forward GEMMs of the priced rows of
    bench/published_runs.py at their layouts (m = b·s/c tokens, n or k
    split by t), deduplicated, the most FLOPs first."""
    shapes = sweep.published_shapes()
    by_shape = {(s["m"], s["n"], s["k"]): s["sources"] for s in shapes}
    # Llama 3.1 8B (DGX Cloud, t = 1, c = 2, b = 1, s = 8192): MLP up [4096, 4096]×[4096, 2·14336]
    assert "Llama 3.1 8B H100 BF16 128 GPUs NeMo 24.09 mlp_up" in by_shape[(4096, 28672, 4096)]
    # Llama 3.1 70B (t = 4, c = 2): the SwiGLU's 2·28672 columns split over 4 ranks
    assert "Llama 3.1 70B H100 BF16 2048 GPUs NeMo 24.09 mlp_up" in by_shape[(4096, 14336, 8192)]
    # GPT 1T (A100 2021, t = 8, b = 1, s = 2048): QKV [2048, 25600]×[25600, 3·25600/8]
    assert "1T A100 2021 qkv" in by_shape[(2048, 9600, 25600)]
    assert "462B H100 2024 proj" in by_shape[(4096, 18432, 2304)]      # k = h/t
    flops = [s["m"] * s["n"] * s["k"] for s in shapes]
    assert flops == sorted(flops, reverse=True) and len(by_shape) == len(shapes)
    priced = [run for run in sys.modules["published_runs"].RUNS if run.priced]
    assert {name.rsplit(" ", 1)[0] for s in shapes for name in s["sources"]} == {
        run.name for run in priced}
    assert len(shapes) <= sweep.GPU_SIZES.published_cap    # the GPU run measures every one


def test_tiny_run_sweeps_kernels(tiny_run):
    """The kernel sweep, a child process of gpu.py: its four parts, each
    measured case beside the h200 profile's prediction of it."""
    from ptdp.perf.price.profiles import load_profile

    report, stdout = tiny_run
    sweep = report["kernels_sweep"]
    assert "crashed" not in sweep and sweep["errors"] == [] and sweep["profile"] == "h200"
    h200 = load_profile("h200")
    gemm = sweep["gemm"]
    assert gemm["published_measured"] == 8 and gemm["skipped_cases"] == 0 and gemm["error"] is None
    assert [c["kind"] for c in gemm["rows"]] == ["published"] * 8 + ["square"] * 3 + ["skinny"] * 2
    for case in gemm["rows"]:
        if case["kind"] == "published":
            assert [d // 64 for d in case["scaled_from"]] == [case["m"], case["n"], case["k"]]
        for dtype in ("bf16", "fp16"):
            entry = case[dtype]
            assert _positive_and_finite(entry["seconds"]) and entry["reps"] >= 2
            predicted = h200.gemm_seconds(case["m"], case["n"], case["k"], precision=dtype)
            assert entry["predicted_s"] == pytest.approx(predicted)
            assert entry["ratio"] == pytest.approx(entry["seconds"] / predicted)
            assert entry["tflops"] == pytest.approx(
                2 * case["m"] * case["n"] * case["k"] / entry["seconds"] / 1e12)
    memory = {(row["op"], row["size"]): row for row in sweep["memory"]["rows"]}
    assert len(memory) == 23 and not any("error" in row for row in memory.values())
    copy = memory[("copy", "1 MiB")]
    assert copy["bytes"] == 2 * 2 ** 20 and copy["class"] == "elementwise"
    assert copy["predicted_s"] == pytest.approx(2 * 2 ** 20 / h200.memory_bandwidth)
    step = memory[("optimizer step, ptdp (fp32 state, bf16 model)", "0.0625 M params")]
    assert step["planner_bytes"] == 122 * 2 ** 16          # after_flush.py's bytes per parameter
    assert step["predicted_s"] == pytest.approx(122 * 2 ** 16 / h200.memory_bandwidth + 30 * 4e-6)
    assert [r["predicted_s"] for r in sweep["launch"]["rows"]] == [4e-6, 4e-6]
    assert "kernel sweep, GEMMs (F.linear; profile h200, 989 TFLOP/s peak): 8 of " in stdout
    assert ("| GEMM | m | n | k | bf16 ms | bf16 TFLOP/s | bf16 of peak | bf16 predicted ms "
            "| bf16 measured / predicted |") in stdout
    assert ("| operator | size | planner class | bytes | ms | GB/s | of profile bandwidth "
            "| predicted ms | measured / predicted |") in stdout
    assert "| launches | µs per launch | profile launch_overhead µs | measured / profile |" in stdout
    assert "Kernel sweep (bench/gpu_kernels_sweep.py) against the planner's `h200` profile" in stdout
    # The sustained GEMM: the largest published shape (scaled), sampled per window.
    sustained = sweep["sustained"]
    largest = gemm["rows"][0]
    assert (sustained["m"], sustained["n"], sustained["k"]) == (largest["m"], largest["n"],
                                                                largest["k"])
    assert len(sustained["tflops"]) >= 2 and all(map(_positive_and_finite, sustained["tflops"]))
    assert sustained["last_over_first"] == pytest.approx(sustained["last"] / sustained["first"])
    assert "kernel sweep, sustained GEMM: [" in stdout and "Sustained GEMM: [" in stdout
    # Fused attention at the published rows' calls (scaled), against the profile.
    calls = sweep["attention"]["rows"]
    assert len(calls) == 3 and all(r["forward_s"] > 0 and r["predicted_forward_s"] > 0
                                   for r in calls)
    assert "kernel sweep, attention (causal bf16 SDPA, 3 published shapes)" in stdout
    assert "| sequences × length × head size | forward ms |" in stdout


def test_a_raising_sweep_case_is_recorded_and_the_rest_runs(sweep, monkeypatch):
    measure_gemm, measure_memory_op = sweep.measure_gemm, sweep.measure_memory_op

    def gemm(m, n, k, dtype, *rest):
        if (m, n, k, dtype) == (128, 128, 128, "fp16"):
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nsecond line")
        return measure_gemm(m, n, k, dtype, *rest)

    def memory(name, *rest):
        if name == "LayerNorm":
            raise torch.cuda.OutOfMemoryError("out of memory")
        return measure_memory_op(name, *rest)

    def launch(*args):
        raise RuntimeError("launch part broke")

    monkeypatch.setattr(sweep, "measure_gemm", gemm)
    monkeypatch.setattr(sweep, "measure_memory_op", memory)
    monkeypatch.setattr(sweep, "launch_part", launch)
    sizes = dataclasses.replace(sweep.TINY_SIZES, published_cap=1, squares=(64, 128), skinny=(),
                                activation_bytes=(2 ** 16,), optimizer_params=(2 ** 12,))
    lines = []
    report = sweep.section(torch.device("cpu"), True, lines.append, sizes)
    rows = report["gemm"]["rows"]
    assert rows[2]["fp16"] == {"error": "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"}
    measured = [row[d] for row in rows for d in ("bf16", "fp16") if (row, d) != (rows[2], "fp16")]
    assert len(measured) == 5 and all("ratio" in entry for entry in measured)
    ops = {row["op"]: row for row in report["memory"]["rows"]}
    assert ops["LayerNorm"]["error"] == "OutOfMemoryError: out of memory"
    assert all("ratio" in row for name, row in ops.items() if name != "LayerNorm")
    assert report["launch"] is None and report["errors"] == ["launch: RuntimeError: launch part broke"]
    assert "kernel sweep, launch: FAILED, RuntimeError: launch part broke" in lines
    text = sweep.markdown(report)
    assert "| square 128 | 128 | 128 | 128 | " in text
    assert "| FAILED: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED | | | | |" in text
    assert "| LayerNorm | 0.0625 MiB | FAILED: OutOfMemoryError: out of memory | | | | | | |" in text
    assert "Parts that failed: launch: RuntimeError: launch part broke." in text

    capped = sweep.gemm_part(torch.device("cpu"), dataclasses.replace(sizes, gemm_cap_s=-1),
                             sweep.load_profile("h200"))
    assert capped["skipped_cases"] == 2 * len(capped["rows"]) == 6
    assert capped["rows"][0]["bf16"] == {"skipped": "over the part's -1 s cap"}
    assert "6 cases skipped (over the -1 s cap)" in sweep.gemm_summary(capped)

    def no_table():
        raise ImportError("cannot import name 'RUNS'")

    monkeypatch.setattr(sweep, "published_shapes", lambda profile: no_table())
    alone = sweep.gemm_part(torch.device("cpu"), dataclasses.replace(sizes, gemm_dtypes=("bf16",)),
                            sweep.load_profile("h200"))
    assert [row["kind"] for row in alone["rows"]] == ["square", "square"]
    assert all("ratio" in row["bf16"] for row in alone["rows"])
    assert "FAILED: published shapes: ImportError: cannot import name 'RUNS'" in sweep.gemm_summary(alone)


def test_a_dying_sweep_process_is_recorded(sweep):
    lines = []
    died = sweep.run_isolated("cpu", True, 60, lines.append, command=[
        sys.executable, "-c", "import sys; print('started'); sys.exit('illegal memory access')"])
    assert died == {"crashed": "exit status 1: illegal memory access"}
    assert lines == ["started", "kernel sweep: FAILED, exit status 1: illegal memory access"]
    assert sweep.markdown(died) == "Kernel sweep: did not finish (exit status 1: illegal memory access).\n"


def test_a_profile_fitted_to_the_sweep(tiny_run, tmp_path):
    """bench/fit_gpu_profile.py turns the sweep into profile numbers: the
    tile model fitted to the bf16 GEMMs (e_max scaled by the sustained
    GEMM's fall), each planner class's bandwidth from ptdp's own operators
    at their largest size, the calibrate chain's launch cost; and prices
    the published rows with it."""
    from ptdp.perf.calibrate.gpu import fit_tile_model
    from ptdp.perf.price.profiles import builtin_profile, load_profile

    spec = importlib.util.spec_from_file_location("fit_gpu_profile",
                                                  SCRIPT.parent / "fit_gpu_profile.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)     # it puts bench/ on the path for published_runs
    report, _ = tiny_run
    sweep = report["kernels_sweep"]
    profile, details = fit.fitted_profile(report)
    base = builtin_profile("h200")
    rows = [dict(m=c["m"], n=c["n"], k=c["k"], seconds=c["bf16"]["seconds"])
            for c in sweep["gemm"]["rows"]]
    overhead, e_max = fit_tile_model(rows, base.peak_flops("bf16"), base.sm_count,
                                     base.gemm_tile, base.memory_bandwidth)
    factor = min(1.0, sweep["sustained"]["last_over_first"])
    assert profile.gemm_efficiency == pytest.approx(e_max * factor)
    assert profile.tile_overhead_seconds == pytest.approx(overhead)
    largest = {}
    for row in sweep["memory"]["rows"]:
        name = row["op"].split(" (rows of")[0]
        if name not in largest or row["elements"] > largest[name]["elements"]:
            largest[name] = row
    assert set(profile.op_bandwidth) == set(fit.PTDP_OPERATORS)
    for op_class, names in fit.PTDP_OPERATORS.items():
        chosen = [largest[name] for name in names]
        assert profile.op_bandwidth[op_class] == pytest.approx(
            sum(r["planner_bytes"] for r in chosen) / sum(r["seconds"] for r in chosen))
    attention = [r for r in sweep["attention"]["rows"] if r.get("backward_s")]
    assert attention and profile.attention_efficiency > 0
    ratios = []
    for r in attention:
        forward, backward = profile.attention_seconds(r["heads"], r["seq"], r["head_dim"])
        ratios += [forward / r["forward_s"], backward / r["backward_s"]]
    # As close to 1 as the model's steps allow (waves, the bytes' floor).
    assert statistics.median(ratios) == pytest.approx(1.0, rel=0.05)
    assert details["attention"]["median_ratio"] == pytest.approx(statistics.median(ratios))
    calibrate_row = [r for r in sweep["launch"]["rows"] if "calibrate" in r["what"]][0]
    assert profile.launch_overhead == calibrate_row["seconds"]
    assert "e_max" in fit.report_text(base, profile, details)
    path = fit.save_profile(profile, tmp_path / "fitted.json")
    assert load_profile(path) == profile
    import published_runs
    original = published_runs.load_profile
    some = [run for run in published_runs.RUNS if run.name.startswith("Llama 3.1 8B H100 BF16")]
    table = fit.priced_with(profile, some)
    assert table.count("| Llama 3.1 8B") == len(some) and "ptdp GPT 1.3B" in table
    assert published_runs.load_profile is original      # the built-in profiles are back
    # No cuDNN on a CPU: its kernel is fitted only where the sweep timed it.
    assert details["cudnn_attention"] is None and not any("cudnn_forward_s" in r for r in attention)


def test_cudnns_attention_timed_by_the_sweep_prices_the_published_rows(tiny_run):
    """Where the sweep timed cuDNN's kernel (on CUDA), its own fraction is
    fitted the same way and the published rows are priced with it, not with
    the rate fitted to the FlashAttention-3 paper; ptdp's own rows keep
    PyTorch's default kernel's. (Timings here: the CPU run's, halved, as if
    cuDNN's kernel were twice as fast.)"""
    spec = importlib.util.spec_from_file_location("fit_gpu_profile",
                                                  SCRIPT.parent / "fit_gpu_profile.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    report, _ = tiny_run
    report = copy.deepcopy(report)
    for r in report["kernels_sweep"]["attention"]["rows"]:
        if r.get("backward_s"):
            r.update(cudnn_forward_s=r["forward_s"] / 2, cudnn_backward_s=r["backward_s"] / 2)
    profile, details = fit.fitted_profile(report)
    ptdps, cudnn = details["attention"], details["cudnn_attention"]
    assert cudnn["calls"] == ptdps["calls"] > 0
    assert cudnn["attention_efficiency"] > ptdps["attention_efficiency"] == profile.attention_efficiency
    assert cudnn["median_ratio"] == pytest.approx(1.0, rel=0.05)
    assert "cuDNN's attention" in fit.report_text(fit.builtin_profile("h200"), profile, details)
    import published_runs
    rates = published_runs.HOPPER_ATTENTION_EFFICIENCY
    llama = [run for run in published_runs.RUNS if run.name.startswith("Llama 3.1 8B H100 BF16")]
    faster = fit.priced_with(profile, llama, cudnn_attention=cudnn["attention_efficiency"] * 2)
    slower = fit.priced_with(profile, llama, cudnn_attention=cudnn["attention_efficiency"])
    assert faster != slower                               # the rows take the rate given
    assert faster.split("ptdp GPT")[1] == slower.split("ptdp GPT")[1]   # ptdp's own do not
    assert published_runs.HOPPER_ATTENTION_EFFICIENCY is rates        # put back
