"""bench/published_runs.py: the table of published runs is complete (every
field set, every out-of-scope row has its reason, no duplicate), its FLOP
conventions are the sources' own formulas, the 1.7B calibration point is the
one ptdp fits to and is flagged so, and the script prints the table for a
couple of rows. The errors themselves are not judged here (they are the
baseline the model work starts from, in bench/RESULTS.md)."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import published_runs as pr  # noqa: E402  bench/published_runs.py

from ptdp.perf.calibrate.calibration_point import calibration_point  # noqa: E402
from ptdp.perf.analytic.flops import model_flops_per_iteration  # noqa: E402
from ptdp.perf.layout import Layout  # noqa: E402

OPTIONAL_TEXT = {"assumptions", "out_of_scope"}   # "" means: none


def test_every_row_has_every_field_and_no_row_is_a_duplicate():
    names = [run.name for run in pr.RUNS]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    keys = [(run.source, run.layout_text(), run.published_tflops) for run in pr.RUNS]
    assert len(keys) == len(set(keys))
    for run in pr.RUNS:
        assert "," not in run.name, f"{run.name}: --rows splits on commas"
        for field in fields(run):
            value = getattr(run, field.name)
            assert value is not None, (run.name, field.name)
            if isinstance(value, str) and field.name not in OPTIONAL_TEXT:
                assert value.strip(), (run.name, field.name)
        assert run.t * run.p * run.c * run.d == run.gpus, run.name
        assert run.published_tflops > 0 and run.precision in ("fp16", "bf16", "fp8")
        assert run.published_as == "published" or run.published_as.startswith("derived: ")
        if run.priced:
            assert run.hardware in pr.PROFILES and isinstance(run.shape, pr.Shape), run.name
            assert run.recompute in ("none", "selective", "full")
            assert isinstance(run.sequence_parallel, bool)
            assert isinstance(run.distributed_optimizer, bool)
            assert run.flops in ("paper", "model") and run.kernels in ("paper", "flash")
            assert run.precision != "fp8"
            # A mixture of experts is priced at its EP and ETP; a dense row has none.
            assert (run.etp == "n/a") == (not run.shape.config().is_moe), run.name
            assert (run.layout().ep, run.layout().etp) == (
                (run.ep, run.etp) if run.shape.config().is_moe else (1, None)), run.name
            assert run.layout().valid_for(run.shape.config(), run.global_batch) == [], run.name
        else:
            assert len(run.out_of_scope) > 2, run.name
        if "RECALLED" in run.source:
            assert "unverified config" in run.assumptions, run.name


def test_the_rows_the_notes_give_are_all_there():
    by_source = {}
    for run in pr.RUNS:
        by_source.setdefault(run.source.split(" ")[0], []).append(run)
    assert len([r for r in pr.RUNS if r.name.endswith("A100 2021")]) == 10
    assert len([r for r in pr.RUNS if r.name.endswith("H100 2024")]) == 9
    assert len([r for r in pr.RUNS if "A100 2022" in r.name]) == 5
    assert len(by_source["NVIDIA-NeMo/Megatron-Bridge"]) == 32     # 13 Llama, 13 Qwen3, 6 GPT-OSS
    dgxc = by_source["NVIDIA/dgxc-benchmarking"]
    assert sum(r.precision == "bf16" for r in dgxc) == 10 and sum(r.priced for r in dgxc) == 8
    reasons = {r.out_of_scope.split(";")[0] for r in pr.RUNS if not r.priced}
    assert {"FP8", "FSDP (FSDP2 over 32, prefetch)"} <= reasons
    assert any(r.startswith("architecture not trained by ptdp") for r in reasons)
    assert any(r.startswith("layout ptdp cannot express") for r in reasons)


def test_the_one_calibration_row_is_the_point_the_a100_profile_is_fitted_to():
    calibrations = [run for run in pr.RUNS if run.calibration]
    assert [run.name for run in calibrations] == ["1.7B A100 2021"]
    run = calibrations[0]
    workload, layout = calibration_point()
    assert run.layout() == layout and run.global_batch == workload.global_batch
    assert run.precision == workload.precision and run.kernels == "paper"
    model, expected = run.shape.config(), workload.model
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                 "ffn_size", "swiglu", "normalization", "position_embedding_type"):
        assert getattr(model, name) == getattr(expected, name), name


def test_each_rows_flop_count_is_its_sources_formula():
    """"paper": Narayanan et al.'s 96·B·s·l·h²·(1 + s/6h + V/16lh); "model"
    for the DGX Cloud Llama rows: their README's formula
    s·(12·l·h²·(1 + g/a + s/h) + 18·l·f·h + 6·V·h) per sequence, and the
    numbers it states (4.74E+14, 3.94E+15, 2.17E+16 for 8B, 70B, 405B; the
    405B one is 0.9 % above its own formula, so the rows divide by it)."""
    run = next(r for r in pr.RUNS if r.name == "1T A100 2021")
    B, s, h, l, V = run.global_batch, 2048, 25600, 128, 51200
    paper = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert model_flops_per_iteration(run.shape.config(), B, recompute="full") == pytest.approx(paper)
    for size, stated in (("8B", 4.74e14), ("70B", 3.94e15), ("405B", 2.17e16)):
        shape = pr.LLAMA[size]
        s, l, h, f, V = shape.seq, shape.layers, shape.hidden, shape.ffn, shape.vocab
        formula = s * (12 * l * h * h * (1 + shape.groups / shape.heads + s / h) + 18 * l * f * h
                       + 6 * V * h)
        ours = model_flops_per_iteration(shape.config(), 1, recompute=None)
        assert ours == pytest.approx(formula, rel=1e-12), size
        assert ours == pytest.approx(stated, rel=0.01), size
        rows = [r for r in pr.RUNS if r.model == f"Llama 3.1 {size}" and "dgxc" in r.source]
        assert rows and all(r.flops_per_sequence == stated for r in rows)


def test_quick_mode_prints_the_table_for_the_rows_asked(capsys):
    assert pr.main(["--rows", "1.7B A100 2021,8B H100 BF16 128 GPUs NeMo 24.09,"
                              "GPT-OSS 120B H100 BF16 64 GPUs Bridge 25.11", "--no-search"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "| row | source | model | layout | published TFLOP/s per GPU | predicted | error | note |" in lines
    calibration = next(line for line in lines if line.startswith("| 1.7B A100 2021 |"))
    assert "| t=1 p=1 d=32 b=16 B=512 recompute=full, fp16 | 137.0 | 137.0 |" in calibration
    assert "**calibration point**" in calibration
    llama = next(line for line in lines if line.startswith("| Llama 3.1 8B H100 BF16 128 GPUs"))
    cells = [cell.strip() for cell in llama.split("|")[1:-1]]
    published, predicted, error = float(cells[4]), float(cells[5]), cells[6]
    assert published == 578.7 and predicted > 0                 # MFU 58.51 % × 989
    assert error == f"{predicted / published - 1:+.1%}"
    assert "t=1 p=1 c=2 d=64 b=1 B=2048 recompute=none dist-opt, bf16" in llama
    assert "model FLOPs, flash kernels" in llama
    assert "Out of scope (not priced):" in out
    oss = next(line for line in lines if line.startswith("| GPT-OSS 120B H100 BF16 64 GPUs"))
    assert oss.endswith("| architecture not trained by ptdp (attention sinks, sliding window, "
                        "its MoE) |")
    assert "Search (" not in out


def test_rows_that_match_nothing_are_refused():
    with pytest.raises(SystemExit, match="--rows 'no such row' matches no row"):
        pr.main(["--rows", "no such row", "--no-search"])


def test_the_2021_rows_take_their_run_scripts_layouts():
    """t, p, b and v of Megatron-LM's sc21/run_table_1.sh, not assumptions."""
    layouts = {r.name.split()[0]: (r.t, r.p, r.micro_batch, r.v) for r in pr.RUNS
               if r.name.endswith("A100 2021")}
    assert layouts["18B"] == (8, 1, 8, 1) and layouts["76B"] == (8, 4, 2, 3)
    assert layouts["530B"] == (8, 35, 1, 3) and layouts["1T"] == (8, 64, 1, 1)


def test_ptdp_own_rows_are_the_gpu_benchmark_runs_and_their_records():
    """The table of ptdp's own H200 runs prices bench/gpu.py's suite: the
    same models, micro batches, microbatches and recomputation, and each
    measured figure is one that bench/RESULTS.md records for that run."""
    import gpu   # bench/gpu.py

    results = (Path(__file__).resolve().parents[1] / "bench" / "RESULTS.md").read_text()
    suite = {(run.name, run.recompute): run for run in gpu.GPU_SUITE.runs}
    for own in pr.OWN_RUNS:
        run = suite[(own.name, own.recompute)]
        assert (run.model, run.micro_batch, run.microbatches) == (
            own.model, own.micro_batch, own.microbatches)
        for tflops in own.measured:
            assert f"| {own.micro_batch} × {own.microbatches} |" in results
            assert f"| {tflops:.1f} |" in results
        predicted, error = pr.price_own(own)
        assert error == pytest.approx(predicted / own.published_tflops - 1)


def test_the_planner_page_table_is_what_the_model_predicts_today():
    """docs/planner.md's validation table is bench/published_runs.py's, regenerated
    with --write whenever the model changes: every priced row and ptdp's own
    runs, their published figures and today's predictions."""
    page = pr.TABLE_PAGE.read_text()
    begin = page.index(pr.TABLE_BEGIN) + len(pr.TABLE_BEGIN)
    lines = page[begin:page.index(pr.TABLE_END)].strip().splitlines()
    runs = [run for run in pr.RUNS if run.priced]
    assert len(lines) == 2 + len(runs) + len(pr.OWN_RUNS)
    # The rows of 32 stages or more take up to seconds each to simulate (hundreds
    # of microbatches): their name, layout and published figure are checked,
    # their prediction by the bench; every other line is regenerated whole.
    slow = [run.p >= 32 for run in runs]
    priced = [pr.price(run) if not s else pr.Priced(run, 1.0, 1.0, 0.0, True)
              for run, s in zip(runs, slow)]
    expected = pr.validation_table(priced).splitlines()
    assert sum(slow) == 5
    for index, (line, want) in enumerate(zip(lines, expected)):
        if index >= 2 and index - 2 < len(runs) and slow[index - 2]:
            assert line.rsplit("|", 3)[0] == want.rsplit("|", 3)[0]
        else:
            assert line == want


def test_the_gain_of_selective_recomputation_is_priced_near_the_published_one():
    """Korthikanti et al.'s Table 5 (sequence parallelism with selective
    recomputation against full recomputation, each model's layout): the
    model's gains are within 10 points of the published 29 to 32 %, an
    outside check of how it prices recomputation and sequence parallelism."""
    lines = pr.recompute_gain_table().splitlines()[4:]
    assert len(lines) == len(pr.KORTHIKANTI_GAINS) == 4
    for line in lines:
        name, published, priced = (cell.strip() for cell in line.strip("|").split("|"))
        published, priced = float(published.rstrip("%")), float(priced.rstrip("%"))
        assert published == pytest.approx(100 * pr.KORTHIKANTI_GAINS[name], abs=0.05)
        assert 0 < priced and abs(priced - published) < 10, (name, priced, published)
