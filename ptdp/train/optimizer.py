"""AdamW over the flat gradient buffer: mixed precision, loss scaling,
clipping by the global norm, and the distributed optimizer (ZeRO stage 1).

The optimizer steps fp32 *main* weights. Without sharding they cover the
whole flat buffer (for an fp32 model they are the model's weights
themselves); with `--use-distributed-optimizer` each data-parallel rank keeps
main weights and Adam moments only for its 1/d of every bucket, steps them
from the reduce-scattered gradients, and all-gathers the updated weights
(with --overlap-param-gather: starts to, the next forward waits for them;
see GradBuffer.gather_params).
AdamW is element-wise, so sharding changes no number: the same arithmetic
runs on every element, only on another rank.

bf16 main gradients (--main-grads-dtype bf16) are read as fp32: clipping
scales them and Adam steps with them in fp32 copies of PIECE elements at a
time, so no fp32 copy of the whole buffer is held; the main weights and the
moments stay fp32 (Megatron-LM's precision-aware optimizer reads them so).

Per-parameter rules become index ranges of the flat buffer: weight decay on
matrices only (not biases or norms), and the global gradient norm counting a
parameter replicated over the tensor group once (tensor rank 0) and the
last stage's copy of the tied embedding not at all; and, under
--decoupled-lr, the rate: the word embedding and the output layer step with
their own (see `embedding_and_output_weights`), everything else with --lr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Iterable

import torch
import torch.distributed as dist

from ptdp.config import TrainConfig
from ptdp.parallel.data_parallel import GradBuffer
from ptdp.parallel.sharding import COPY_ATTR, SHARD_ATTR, is_expert
from ptdp.parallel.topology import ParallelContext
from ptdp.train.lr_schedule import LRSchedule

# The longest run of elements whose squares (or zeros) are summed at once:
# bounded so that the squares' scratch stays small (64 MiB) and below CUDA's
# 2^31-element limit, which a 2.7 B-parameter model's one range passed.
PIECE = 1 << 24


SQUARES_PER_ROW = 1 << 14


def sum_of_squares(piece: torch.Tensor) -> torch.Tensor:
    """Σ x², as float64: torch's float32 sums of rows of 2^14 squares
    (pairwise on CPU, a tree on GPUs), the rows' sums added in float64:
    about 1e-8 relative to the exact sum, as near as the float32 squares
    themselves, and on a CPU seven times faster than one float64 reduction,
    which converts every element (27 ms of a 1 s step at 4 M gradients). Not
    a BLAS dot: on CPU it accumulates the whole range in float32 and, over
    the few hundred thousand elements of one range, was 2e-5 off the norm,
    as much as a layout splitting the range differently then disagreed by."""
    squares = piece.float().square()
    whole = squares.numel() - squares.numel() % SQUARES_PER_ROW
    total = squares[:whole].view(-1, SQUARES_PER_ROW).sum(dim=1).sum(dtype=torch.float64)
    if whole < squares.numel():
        total = total + squares[whole:].sum(dtype=torch.float64)
    return total


def counts_in_norm(param: torch.nn.Parameter, ctx: ParallelContext) -> bool:
    """Whether this rank's copy of `param` enters the gradient norm: once
    over the group it is split over (or replicated in), never the tied
    embedding's second copy."""
    if getattr(param, COPY_ATTR, False):
        return False
    if hasattr(param, SHARD_ATTR):
        return True
    return (ctx.etp_rank if is_expert(param) else ctx.tp_rank) == 0


def embedding_and_output_weights(chunks: Iterable[torch.nn.Module]) -> set[torch.nn.Parameter]:
    """The parameters --decoupled-lr applies to, as Megatron-LM marks them
    (is_embedding_or_output_parameter): the word embedding of the first
    stage and the output layer's weight of the last. With a tied output
    layer that is the word embedding on both ends, so the last stage's copy
    steps with the same rate and the copies stay equal. The position
    embeddings and the final norm keep --lr."""
    found = set()
    for chunk in chunks:
        if getattr(chunk, "pre_process", False):
            found.add(chunk.embedding.word_embeddings.weight)
        if getattr(chunk, "post_process", False):
            found.add(chunk.output_matrix.weight)
            if getattr(chunk, "mtp", None) is not None:  # the MTP modules' copy of the embedding
                found.add(chunk.embedding.word_embeddings.weight)
    return found


class LossScaler:
    """fp16 loss scaling (Megatron-LM's dynamic scaler). After `hysteresis`
    overflows the scale halves (not below the minimum); after `window` steps
    without one it doubles. A static scaler keeps its value (1 for bf16 and
    fp32)."""

    def __init__(self, scale: float, *, dynamic: bool, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2):
        self.scale, self.dynamic = float(scale), dynamic
        self.min_scale, self.window, self.hysteresis = min_scale, window, hysteresis
        self.growth_tracker, self.hysteresis_left = 0, hysteresis

    @classmethod
    def from_config(cls, config: TrainConfig) -> "LossScaler":
        if not config.fp16:
            return cls(1.0, dynamic=False)
        if config.loss_scale is not None:
            return cls(config.loss_scale, dynamic=False)
        return cls(config.initial_loss_scale, dynamic=True, min_scale=config.min_loss_scale,
                   window=config.loss_scale_window, hysteresis=config.hysteresis)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker, self.hysteresis_left = 0, self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        """A dynamic scaler resumes where it was; a static one keeps its
        configured value (the run's settings decide, e.g. bf16 after fp16)."""
        if self.dynamic and state:
            self.scale = float(state["scale"])
            self.growth_tracker = int(state["growth_tracker"])
            self.hysteresis_left = int(state["hysteresis_left"])


@dataclass
class StepResult:
    grad_norm: float      # before clipping; nan when the step was skipped
    skipped: bool         # an inf/nan gradient somewhere: no weight changed
    loss_scale: float     # the scale the iteration's loss was multiplied by
    # --log-params-norm: the weights' L2 norm after the step; --log-num-zeros-in-grad:
    # the gradient's elements that are exactly 0 (None when not asked, or skipped).
    params_norm: float | None = None
    num_zeros: int | None = None


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        elif end > start:
            merged.append((start, end))
    return merged


class Optimizer:
    def __init__(self, buffer: GradBuffer, ctx: ParallelContext, config: TrainConfig,
                 decoupled: Collection[torch.nn.Parameter] = ()):
        """`decoupled`: the parameters that step with the rate given to
        `step` as decoupled_lr (--decoupled-lr; see embedding_and_output_weights)."""
        self.buffer, self.ctx, self.config = buffer, ctx, config
        self.scaler = LossScaler.from_config(config)

        # Where each rule applies, in the coordinates of buffer.reduced_grads.
        decay, counted, own_rate, own_rate_decay = [], [], [], []
        # The norm's elements by how many ranks hold each after the reduction
        # (1 when sharded: each rank steps its own part); see `step`.
        counted_by_copies: dict[int, list[tuple[int, int]]] = {}
        decoupled_ids = {id(param) for param in decoupled}
        for segment in buffer.segments:
            bucket = buffer._bucket_of[segment.param]
            own_start, own_end = buffer.owned_range(bucket)
            start, end = max(segment.start, own_start), min(segment.end, own_end)
            if start >= end:
                continue
            local = (bucket.shard_start + (start - own_start), bucket.shard_start + (end - own_start))
            if segment.param.ndim >= 2:
                decay.append(local)
            if counts_in_norm(segment.param, ctx):
                copies = 1 if buffer.shard else bucket.replicas.size
                counted_by_copies.setdefault(copies, []).append(local)
                counted.append(local)
            if id(segment.param) in decoupled_ids:
                own_rate.append(local)
                if segment.param.ndim >= 2:
                    own_rate_decay.append(local)
        self.decay_ranges, self.norm_ranges = _merge(decay), _merge(counted)
        self.norm_ranges_by_copies = {copies: _merge(ranges)
                                      for copies, ranges in sorted(counted_by_copies.items())}
        self.decoupled_ranges = _merge(own_rate)
        self._decoupled_decay_ranges = _merge(own_rate_decay)

        shards = getattr(buffer, "param_shards", None)  # ZeRO-3's parameter shards
        if buffer.shard:
            self.main = torch.cat([buffer.initial_fp32[slice(*buffer.owned_range(b))]
                                   for b in buffer.buckets])
            if shards is not None and shards.dtype == torch.float32:
                self.main = shards.copy_(self.main)  # fp32: the parameters' shard is the main copy
        elif buffer.param_data.dtype == torch.float32:
            self.main = buffer.param_data      # the model's own weights
        else:
            self.main = buffer.initial_fp32.clone()
        del buffer.initial_fp32
        self.exp_avg = torch.zeros_like(self.main)
        self.exp_avg_sq = torch.zeros_like(self.main)
        self.steps = 0

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam moments, plus the fp32
        main weights where they are a copy of the model's."""
        total = self.exp_avg.nbytes + self.exp_avg_sq.nbytes
        if self.main.data_ptr() != self.buffer.param_data.data_ptr():
            total += self.main.nbytes
        return total

    def step(self, lr: float, decoupled_lr: float | None = None) -> StepResult:
        """One optimizer step at rate `lr`; the `decoupled` parameters step
        at `decoupled_lr` (None: at `lr` too)."""
        # --overlap-param-gather: a gather no forward waited for (its bucket
        # used by none) still reads the shard this step changes.
        self.buffer.finish_param_gather()
        grads = self.buffer.reduced_grads
        scale = self.scaler.scale
        if scale != 1.0:
            grads.mul_(1.0 / scale)

        # The global norm doubles as the overflow check: an inf or nan in any
        # gradient makes it non-finite on every rank, and every element left
        # out of the norm (a tensor-replicated or tied copy) is equal to one
        # counted on the same rank's group. One pass and one reduction over
        # every rank instead of two of each. An element held by c replicas
        # (data-parallel, or expert-data-parallel for routed experts; 1
        # under the distributed optimizer) enters at 1/c on each: so an inf
        # on any one replica still reaches every rank.
        norm_sq_value = self._counted_once(sum_of_squares, grads)
        if not math.isfinite(norm_sq_value):
            self.scaler.update(True)
            return StepResult(grad_norm=float("nan"), skipped=True, loss_scale=scale,
                              params_norm=self._params_norm())
        grad_norm = math.sqrt(norm_sq_value)
        clipping = 1.0  # applied as bf16 main gradients are read (`_fp32_pieces`)
        if self.config.clip_grad > 0:
            coefficient = self.config.clip_grad / (grad_norm + 1e-6)
            if coefficient < 1.0 and grads.dtype == torch.float32:
                grads.mul_(coefficient)
            elif coefficient < 1.0:
                clipping = coefficient
        num_zeros = None
        if getattr(self.config, "log_num_zeros_in_grad", False):  # as Megatron-LM: after clipping
            num_zeros = round(self._counted_once(
                lambda part: part.numel() - torch.count_nonzero(part), grads))

        self._adamw(grads, lr, decoupled_lr, clipping)
        if self.buffer.shard:
            self.buffer.gather_params(self.main)
        elif self.main is not self.buffer.param_data:
            self.buffer.param_data.copy_(self.main)
        self.scaler.update(False)
        return StepResult(grad_norm=grad_norm, skipped=False, loss_scale=scale,
                          params_norm=self._params_norm(), num_zeros=num_zeros)

    def _counted_once(self, measure, tensor: torch.Tensor) -> float:
        """The sum of `measure(piece)` over the pieces of `tensor` (in the
        gradient buffer's coordinates) that the gradient norm counts: each
        element once over all ranks (tensor, pipeline and expert shards,
        data-parallel replicas). Summed in float64 and reduced over every rank."""
        total = torch.zeros((), dtype=torch.float64, device=tensor.device)
        for copies, ranges in self.norm_ranges_by_copies.items():
            part = torch.zeros((), dtype=torch.float64, device=tensor.device)
            for start, end in ranges:
                for piece in range(start, end, PIECE):
                    part += measure(tensor[piece:min(end, piece + PIECE)])
            total += part / copies
        if self.ctx.world_group is not None:
            dist.all_reduce(total, group=self.ctx.world_group)
        return total.item()

    def _params_norm(self) -> float | None:
        """--log-params-norm: the L2 norm of the (fp32 main) weights, each
        element counted once, like the gradient norm."""
        if not getattr(self.config, "log_params_norm", False):
            return None
        return math.sqrt(self._counted_once(sum_of_squares, self.main))

    def _rate_groups(self, lr: float, decoupled_lr: float | None):
        """(rate, ranges it steps, of which decayed) for each learning rate;
        the ranges of all groups cover the buffer once."""
        whole = [(0, self.main.numel())]
        if decoupled_lr is None or not self.decoupled_ranges:
            return [(lr, whole, self.decay_ranges)]
        rest = _complement(self.decoupled_ranges, self.main.numel())
        rest_decay = _subtract(self.decay_ranges, self._decoupled_decay_ranges)
        return [(lr, rest, rest_decay),
                (decoupled_lr, self.decoupled_ranges, self._decoupled_decay_ranges)]

    @torch.no_grad()
    def _adamw(self, grads: torch.Tensor, lr: float, decoupled_lr: float | None = None,
               clipping: float = 1.0) -> None:
        """torch.optim.AdamW's arithmetic, element-wise on flat tensors (per
        range where parameters step with rates of their own). `clipping`:
        the factor bf16 main gradients are scaled by as they are read."""
        c = self.config
        self.steps += 1
        for rate, ranges, decayed in self._rate_groups(lr, decoupled_lr):
            if c.weight_decay:
                for start, end in decayed:
                    self.main[start:end].mul_(1.0 - rate * c.weight_decay)
            for start, end in ranges:
                for lo, hi, piece in _fp32_pieces(grads, start, end, clipping):
                    _adam(self.main[lo:hi], piece, self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi],
                          self.steps, rate, c)


def _fp32_pieces(grads: torch.Tensor, start: int, end: int, clipping: float):
    """(lo, hi, the fp32 gradients of [lo, hi)) covering [start, end): fp32
    main gradients as they are (clipped already), in one piece; bf16 ones
    copied to fp32 PIECE elements at a time and scaled by `clipping`."""
    if grads.dtype == torch.float32:
        yield start, end, grads[start:end]
        return
    for lo in range(start, end, PIECE):
        hi = min(end, lo + PIECE)
        piece = grads[lo:hi].float()
        yield lo, hi, (piece.mul_(clipping) if clipping != 1.0 else piece)


def _complement(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """[0, size) less the sorted, disjoint `ranges`."""
    rest, position = [], 0
    for start, end in ranges:
        if start > position:
            rest.append((position, start))
        position = end
    if position < size:
        rest.append((position, size))
    return rest


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of sorted, disjoint `ranges` outside sorted, disjoint `holes`."""
    result = []
    for start, end in ranges:
        for hole_start, hole_end in holes:
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                result.append((start, hole_start))
            start = max(start, hole_end)
        if start < end:
            result.append((start, end))
    return result


def _adam(main: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          step: int, lr: float, c: TrainConfig) -> None:
    """The Adam update of one flat range (weight decay already applied)."""
    if _fused_adamw(main, grads, exp_avg, exp_avg_sq, step, lr, c):
        return
    exp_avg.lerp_(grads, 1.0 - c.adam_beta1)
    exp_avg_sq.mul_(c.adam_beta2).addcmul_(grads, grads, value=1.0 - c.adam_beta2)
    bias_correction1 = 1.0 - c.adam_beta1 ** step
    bias_correction2 = 1.0 - c.adam_beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(c.adam_eps)
    main.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def _fused_adamw(main: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, step: int, lr: float, c: TrainConfig) -> bool:
    """The Adam update (weight decay already applied) in PyTorch's fused
    kernel, the one behind torch.optim.AdamW(fused=True): one pass over the
    buffers instead of seven. False where this PyTorch has no such kernel
    for the device; the caller then runs the same arithmetic op by op."""
    kernel = getattr(torch, "_fused_adamw_", None)
    if kernel is None:
        return False
    try:
        kernel([main], [grads], [exp_avg], [exp_avg_sq], [],
               [torch.tensor(float(step), device=main.device)], lr=lr, beta1=c.adam_beta1,
               beta2=c.adam_beta2, weight_decay=0.0, eps=c.adam_eps, amsgrad=False,
               maximize=False)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def learning_rate(iteration: int, config: TrainConfig, global_batch: int = 1) -> float:
    """The rate logged for `iteration` (1-based) of an iteration-based run
    with a constant global batch, none skipped: Megatron-LM's schedule
    (ptdp.train.lr_schedule) after iteration·B samples, which the next
    iteration steps with. Training itself asks its Trainer, which also knows
    sample-based runs, ramp-ups and skipped steps."""
    return LRSchedule.from_config(config, global_batch).lr(iteration * global_batch)
