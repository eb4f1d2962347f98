"""Where a training run's output goes: the metrics file (--metrics-file),
TensorBoard, the progress bar and the logger's lines, from the start-up
banner (banner.py) to the stop line, the loss watch's last warning and the
loss curve."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

import torch.distributed as dist

from ptdp.checkpoint.store import resolve
from ptdp.errors import UserError
from ptdp.schedules.split import stage_layer_counts
from ptdp.parallel.topology import ParallelContext
from ptdp.perf.analytic.flops import configured_flops_per_iteration
from ptdp.train.banner import print_banner
from ptdp.train.report import (Progress, TensorBoardLogger, format_log_line, peak_tflops,
                               plot_loss_curve, throughput)


class RunLog:
    """One rank's output of a run (the logger writes; the others keep quiet)."""

    def __init__(self, trainer, is_logger: bool):
        """Opens the metrics file, prints the banner (every rank takes part),
        then starts TensorBoard and the progress bar."""
        tr, ctx = trainer.config.train, trainer.ctx
        self.trainer, self.is_logger, self.train_iters = trainer, is_logger, trainer.train_iters
        self.metrics_out = (_open_metrics(tr.metrics_file, trainer.start_iteration,
                                          resolve(tr.load) if tr.load else None)
                            if is_logger and tr.metrics_file else None)
        print_banner(trainer, is_logger)
        self.stage_layers = stage_layer_counts(trainer.config.model.num_layers, ctx.pp_size,
                                               trainer.num_chunks, trainer.schedule.kind,
                                               trainer.config.parallel.layer_split)
        self.peak = peak_tflops(trainer.device, trainer.dtype, tr.peak_tflops)
        self.tensorboard = TensorBoardLogger.for_run(tr) if is_logger and tr.tensorboard_dir else None
        self.progress = Progress(self.train_iters, start=trainer.start_iteration,
                                 enabled=None if is_logger else False)

    def add_throughput(self, record: dict, iteration: int) -> None:
        """The iteration's model FLOP/s (a ramp-up's smaller batches do less work)."""
        trainer = self.trainer
        flops = configured_flops_per_iteration(trainer.config.model, trainer.batch_of(iteration),
                                               trainer.ctx.pp_size * trainer.num_chunks,
                                               self.stage_layers, lora=trainer.config.lora)
        record.update(throughput(flops, record["iteration_ms"] / 1e3,
                                 trainer.ctx.grid.world_size, self.peak))

    def timeline(self, iteration: int, stats) -> None:
        """--timeline: the measured timeline of `iteration` (every rank takes part)."""
        trainer = self.trainer
        schedule = trainer.schedule_for(trainer.batch_of(iteration)
                                        // trainer.batches.per_microbatch)
        _draw_measured_timeline(stats.timeline, trainer.ctx, schedule,
                                trainer.config.train.timeline, self.is_logger)

    def warn(self, line: str | None) -> None:
        if line and self.is_logger:
            print(line, file=sys.stderr, flush=True)

    def report(self, record: dict, *, force: bool) -> None:
        _report(record, self.metrics_out, self.tensorboard, self.is_logger, self.train_iters,
                force=force)

    def iteration(self, done: int, record: dict, *, force: bool) -> None:
        """Iteration `done` finished: the progress bar, then its record (report)."""
        self.progress.update(done, record["loss"])
        self.report(record, force=force)

    def stopped(self, done: int, reason: str, newest: str | None) -> None:
        """The line of a run that stops before its last iteration."""
        save = self.trainer.config.train.save
        if self.is_logger:
            saved = (f"saved {newest}; resume with --load {save}" if save
                     else "no --save given, so nothing was saved")
            print(f"ptdp: stopped after iteration {done} of {self.train_iters}: {reason}; "
                  f"{saved}", flush=True)

    def close(self) -> None:
        self.progress.close()
        if self.metrics_out is not None:
            try:
                self.metrics_out.close()
            except OSError:  # what could not be written was reported (_report) or is lost
                pass
        if self.tensorboard is not None:
            self.tensorboard.close()

    def finish(self, history: list[dict[str, Any]]) -> None:
        """After the run: the loss watch's warning, the loss curve."""
        loss_range, tr = self.trainer.loss_range, self.trainer.config.train
        if self.is_logger and loss_range.left_at is not None:
            print(f"ptdp: warning: the loss has been outside its normal range since iteration "
                  f"{loss_range.left_at}; {loss_range.kept()}", file=sys.stderr, flush=True)
        if self.is_logger and tr.loss_curve and history:
            plot_loss_curve(history, tr.loss_curve)
            print(f"ptdp: drew the loss curve to {tr.loss_curve}", flush=True)


def _open_metrics(path: str, start_iteration: int, loaded) -> TextIO:
    """--metrics-file, appended to: a resumed run (or another run) adds its
    records after the earlier ones, behind a marker line saying where it
    starts ({"event": "resume"|"start", ...}: it has no "loss"), so no
    earlier line is lost; a reader takes each iteration's last record."""
    out = open(path, "a", encoding="utf-8")
    if out.seekable() and out.tell() > 0:  # (a stream, /dev/stdout say, has no earlier lines)
        marker = {"event": "resume" if loaded is not None else "start",
                  "iteration": start_iteration,
                  "checkpoint": None if loaded is None else str(loaded),
                  "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        out.write(json.dumps(marker) + "\n")
        out.flush()
    return out


def _report(record: dict, metrics_out: TextIO | None, tensorboard, is_logger: bool,
            train_iters: int, *, force: bool) -> None:
    """One iteration's record to the metrics file, TensorBoard and (on log
    iterations, the last, evaluations and forced ones) the log line."""
    if metrics_out is not None:
        try:
            metrics_out.write(json.dumps(record) + "\n")
            metrics_out.flush()
        except OSError as error:  # a full disk, say: name the file, not just the errno
            raise UserError(f"--metrics-file {metrics_out.name}: cannot write iteration "
                            f"{record['iteration']}'s record ({error.strerror or error}); free "
                            f"space there or give another --metrics-file") from None
    if tensorboard is not None:
        tensorboard.log(record)
    if is_logger and (force or record["iteration"] == train_iters or "val_loss" in record):
        print(format_log_line(record, train_iters), flush=True)


def _draw_measured_timeline(boxes: list, ctx: ParallelContext, schedule, path: str,
                            is_logger: bool) -> None:
    """Collect every pipeline rank's boxes (tensor rank 0, data rank 0) and draw them."""
    everyone: list = [None] * ctx.grid.world_size
    dist.all_gather_object(everyone, (ctx.coord, boxes))
    if not is_logger:
        return
    from ptdp.perf.simulate.timeline import draw_timeline, separate_waits

    rows = [[] for _ in range(ctx.pp_size)]
    for coord, rank_boxes in everyone:
        if coord.tp == 0 and coord.dp == 0:
            rows[coord.pp] = [(op, mb, chunk, start * 1e3, end * 1e3)
                              for op, mb, chunk, start, end in rank_boxes]
    draw_timeline(separate_waits(rows, schedule), path, v=schedule.v, time_unit="ms",
                  title=f"measured {schedule.kind} timeline, p={schedule.p}, m={schedule.m}"
                        + (f", v={schedule.v}" if schedule.v > 1 else ""))
    print(f"ptdp: wrote the timeline of the last iteration to {path}", flush=True)
