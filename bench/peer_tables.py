"""bench/peers.py's tables: the peer rows, the sharded section's rows with
each side's memory, and the scaling rows."""

from __future__ import annotations

def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def peer_table(results: list[dict], peak: float) -> str:
    lines = ["| section | layout | PyTorch side | ours tokens/s | PyTorch tokens/s | ours / PyTorch "
             "| CPU time PyTorch / ours | losses agree (max rel. diff) | ours utilisation "
             "| PyTorch utilisation | load before / after |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in results:
        agree = ("yes" if r["same_loss"] else "**NO**") + f" ({r['loss_max_rel_diff']:.1e})"
        ratio = f"{r['ratio']:.2f}" if r["same_loss"] else "not counted"
        cpu = f"{r['cpu_ratio']:.2f}" if "cpu_ratio" in r else "—"
        load = " / ".join(f"{values[0]:.1f}" for values in r["load"])
        lines.append(f"| {r['row']['section']} | {r['layout']} | {r['peer']} | "
                     f"{fmt_rate(r['ours_tokens_per_s'])} | {fmt_rate(r['theirs_tokens_per_s'])} | "
                     f"{ratio} | {cpu} | {agree} | {r['ours_gflops'] / peak:.1%} | "
                     f"{r['theirs_gflops'] / peak:.1%} | {load} |")
    return "\n".join(lines)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def sharded_table(results: list[dict], skipped: list[tuple[str, str, str]]) -> str:
    """The sharded section: time, and each side's tensor memory per rank
    (MiB): held after a step (parameters + gradients + optimizer state) and
    the peak during a step; the load average before and after each row.
    `skipped`: (layout, PyTorch side, ConfigError text) of the rows ptdp refuses."""
    lines = ["| layout | PyTorch side | ours tokens/s | PyTorch tokens/s | ours / PyTorch "
             "| losses agree (max rel. diff) | ours held: params + grads + optimizer = total "
             "| PyTorch held | ours step peak | PyTorch step peak | load before / after |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in results:
        agree = ("yes" if r["same_loss"] else "**NO**") + f" ({r['loss_max_rel_diff']:.1e})"
        ratio = f"{r['ratio']:.2f}" if r["same_loss"] else "not counted"
        ours, theirs = r["memory"]["ours"], r["memory"]["theirs"]
        held = ["{} + {} + {} = {}".format(*(_mb(m[k]) for k in ("params", "grads", "optimizer", "total")))
                for m in (ours, theirs)]
        load = " / ".join(f"{values[0]:.1f}" for values in r["load"])
        lines.append(f"| {r['layout']} | {r['peer']} | {fmt_rate(r['ours_tokens_per_s'])} | "
                     f"{fmt_rate(r['theirs_tokens_per_s'])} | {ratio} | {agree} | {held[0]} | "
                     f"{held[1]} | {_mb(ours['peak'])} | {_mb(theirs['peak'])} | {load} |")
    for layout, peer, reason in skipped:
        lines.append(f"| {layout} | {peer} | skipped: ptdp refuses it "
                     f"({_first_problem(reason)}) | | | | | | | | |")
    return "\n".join(lines)


def _first_problem(reason: str) -> str:
    """The first problem a ConfigError lists (its text: a heading line, then
    one "- problem" line each), up to the colon that starts its advice."""
    problems = [line.strip().removeprefix("- ") for line in reason.splitlines()[1:] if line.strip()]
    return (problems or [reason])[0].split(": ")[0]


def scaling_table(results: list[dict], baseline_s: float, peak: float) -> str:
    lines = ["| layout | processes | ours tokens/s | vs one process | utilisation |",
             "|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['layout']} | {r['row']['t'] * r['row']['p'] * r['row']['d']} | {fmt_rate(r['ours_tokens_per_s'])} | "
                     f"{baseline_s / r['ours_s']:.2f} | {r['ours_gflops'] / peak:.1%} |")
    return "\n".join(lines)


SHARDED_NOTE = (
    "Sharded data parallelism: ptdp's --use-megatron-fsdp strategies against FSDP2 "
    "`fully_shard` per layer and on the model (reshard_after_forward=False for optim_grads, "
    "True for optim_grads_params). \"layer buckets\": ptdp's --ddp-bucket-size set to one "
    "layer's parameters, FSDP2's unit; otherwise ptdp's default (40M elements: this model in "
    "one bucket). Memory per rank in MiB, the most any rank has, counted from each side's own "
    "tensors (both sides share each process, so its peak RSS cannot tell them apart, and torch "
    "keeps no allocator statistics on CPU): held = the distinct storages of "
    "parameters, gradients and optimizer state after a step; step peak = the most tensor "
    "storage alive at once during one more (untimed) step, counted through a dispatch mode "
    "from that held state plus every tensor the step creates until it is freed "
    "(bench/tensor_memory.py); gloo's own buffers are not in either. Load: os.getloadavg()'s "
    "one-minute figure before and after the row.")
