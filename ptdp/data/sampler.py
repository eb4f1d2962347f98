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
