"""Generated data and the sample assignment: layout-independent by construction."""

import pytest
import torch

from ptdp.data.mock import MockGPTDataset
from ptdp.data.sampler import microbatch_indices


def test_mock_samples_depend_only_on_seed_and_index():
    a, b = MockGPTDataset(300, 32, seed=3), MockGPTDataset(300, 32, seed=3)
    assert torch.equal(a[17], b[17]) and not torch.equal(a[17], a[18])
    assert not torch.equal(a[17], MockGPTDataset(300, 32, seed=4)[17])
    sample = a[5]
    assert sample.shape == (33,) and sample.dtype == torch.long
    assert 0 <= int(sample.min()) and int(sample.max()) < 300
    # Mostly follows the successor table (9 in 10 on average): learnable.
    follows = sum(a.successor[int(sample[k])] == int(sample[k + 1]) for k in range(32))
    assert follows >= 20


@pytest.mark.parametrize("d,b", [(1, 2), (2, 2), (4, 1), (2, 4)])
def test_every_layout_trains_on_the_same_samples(d, b):
    B = 8
    for iteration in range(3):
        seen = [i for rank in range(d) for micro in range(B // (b * d))
                for i in microbatch_indices(iteration * B, micro, rank, micro_batch_size=b,
                                            global_batch_size=B, data_parallel_size=d)]
        assert sorted(seen) == list(range(iteration * B, (iteration + 1) * B))
