"""Pipeline schedules as data, torch-free: the vocabulary (actions.py), one
record per kind and the registry (kinds.py), the generators (one_f_one_b.py,
zero_bubble.py), building a kind's schedule (build.py), the layer splits
(split.py), the one player (player.py) and the invariant checker
(simulate.py). The executor that runs a rank's actions is
ptdp.parallel.pipeline.executor."""
