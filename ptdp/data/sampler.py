"""Which samples each rank trains on.

An iteration that starts after `consumed` samples takes samples
[consumed, consumed + B). Data-parallel rank r takes the contiguous slice
[r·B/d, (r+1)·B/d) of them and cuts it into microbatches of b. The union
over ranks and microbatches is the same for every layout, which is what
lets a parallel run be compared with one process; and since it depends
only on the consumed count, a resumed run reads what an uninterrupted one
would have.
"""

from __future__ import annotations


def microbatch_indices(consumed: int, microbatch: int, dp_rank: int, *, micro_batch_size: int,
                       global_batch_size: int, data_parallel_size: int) -> range:
    per_rank = global_batch_size // data_parallel_size
    start = consumed + dp_rank * per_rank + microbatch * micro_batch_size
    return range(start, start + micro_batch_size)


def training_microbatches(consumed, start_iteration: int, stop_iteration: int, dp_rank: int, *,
                          micro_batch_size: int, data_parallel_size: int):
    """(iteration, indices) of each microbatch data-parallel rank `dp_rank`
    trains on in iterations [start_iteration, stop_iteration), in the order
    the training loop reads them. `consumed`: the run's
    ptdp.data.batches.ConsumedSamples (an iteration's global batch follows
    from the samples consumed before it)."""
    for iteration in range(start_iteration, stop_iteration):
        before = consumed.before(iteration)
        global_batch = consumed.batches.size_at(before)
        for microbatch in range(global_batch // (micro_batch_size * data_parallel_size)):
            yield iteration, microbatch_indices(
                before, microbatch, dp_rank, micro_batch_size=micro_batch_size,
                global_batch_size=global_batch, data_parallel_size=data_parallel_size)
