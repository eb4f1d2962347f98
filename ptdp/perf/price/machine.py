"""Where the ranks of a layout sit, and what their collectives and
point-to-point messages cost on a hardware profile.

Ranks are numbered rank = tp + t·(cp + c·(dp + d·pp)), as ptdp's launcher
numbers them (Megatron-Core's order; cp = 0 and c = 1 without context
parallelism); a group whose ranks sit on more than one server of
`devices_per_server` devices pays the inter-server link. Collectives are
rings: an all-reduce of n ranks is 2(n−1)/n of the bytes over the slowest
link and 2(n−1) latency steps, an all-gather or reduce-scatter half of
that; inside a server, where the profile has measured times T(bytes) of a
2-process all-reduce, (n−1)·T(2·bytes/n) instead.
"""

from __future__ import annotations

import functools
import math

from ptdp.perf.layout import Layout
from ptdp.perf.price.profiles import HardwareProfile


def ring_allreduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def ring_gather_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """All-gather (or reduce-scatter) of `nbytes` in total over n ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


class Machine:
    """Where the ranks of a layout sit, and what their links cost."""

    def __init__(self, layout: Layout, profile: HardwareProfile):
        self.layout, self.profile = layout, profile
        self.per_server = max(1, profile.devices_per_server)

    def rank(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        lay = self.layout
        return tp + lay.t * (cp + lay.c * (dp + lay.d * pp))

    def server(self, rank: int) -> int:
        return rank // self.per_server

    def link(self, ranks: list[int]) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link among `ranks`."""
        prof = self.profile
        if self.spans_servers(ranks):
            return prof.inter_bandwidth, prof.inter_latency
        return prof.intra_bandwidth, prof.intra_latency

    def spans_servers(self, ranks: list[int]) -> bool:
        # A rank's server grows with the rank: the lowest and the highest
        # rank decide (a search asks this of d·c-rank groups many times).
        return bool(ranks) and self.server(min(ranks)) != self.server(max(ranks))

    def allreduce(self, nbytes: float, ranks: list[int]) -> float:
        """Ring all-reduce over `ranks`: 2(n−1) steps of bytes/n each. Inside
        a server with measured times T(bytes) of a 2-process all-reduce (two
        steps of bytes/2), that is (n−1)·T(2·bytes/n)."""
        n = len(ranks)
        if n <= 1 or nbytes <= 0:
            return 0.0
        if not self.spans_servers(ranks):
            measured = self.profile.measured_seconds("allreduce", 2 * nbytes / n)
            if measured is not None:
                return (n - 1) * measured
        return ring_allreduce_seconds(nbytes, n, *self.link(ranks))

    def gather(self, nbytes: float, ranks: list[int]) -> float:
        """All-gather (or reduce-scatter) of `nbytes` in total: half an all-reduce."""
        n = len(ranks)
        if n <= 1 or nbytes <= 0:
            return 0.0
        if not self.spans_servers(ranks):
            measured = self.profile.measured_seconds("allreduce", 2 * nbytes / n)
            if measured is not None:
                return (n - 1) * measured / 2
        return ring_gather_seconds(nbytes, n, *self.link(ranks))

    def tensor_group(self, dp: int = 0, pp: int = 0) -> list[int]:
        return [self.rank(tp, dp, pp) for tp in range(self.layout.t)]

    def tensor_allreduce(self, nbytes: float) -> float:
        return self.allreduce(nbytes, self.tensor_group())

    def tensor_allgather(self, nbytes: float) -> float:
        return self.gather(nbytes, self.tensor_group())

    def p2p(self, nbytes: float, pp_a: int, pp_b: int) -> float:
        """One point-to-point message between two pipeline ranks (tensor 0, data 0)."""
        ranks = [self.rank(0, 0, pp_a), self.rank(0, 0, pp_b)]
        if not self.spans_servers(ranks):
            measured = self.profile.measured_seconds("exchange", nbytes)
            if measured is not None:
                return measured
        bandwidth, latency = self.link(ranks)
        return nbytes / bandwidth + latency

    def context_group(self, dp: int = 0, pp: int = 0) -> list[int]:
        """The c context ranks of (tp 0, dp, pp): t apart, inside one server
        when t·c devices fit in it."""
        return [self.rank(0, dp, pp, cp) for cp in range(self.layout.c)]

    def context_step(self, nbytes: float) -> float:
        """One step of the context ring: every rank sends `nbytes` to the
        next and receives as much from the previous, all at once, so the
        slowest link of the group sets the pace (a measured exchange inside
        a server, where the profile has one)."""
        group = self.context_group()
        if len(group) <= 1 or nbytes <= 0:
            return 0.0
        if not self.spans_servers(group):
            measured = self.profile.measured_seconds("exchange", nbytes)
            if measured is not None:
                return measured
        bandwidth, latency = self.link(group)
        return nbytes / bandwidth + latency

    def context_gather(self, nbytes: float) -> float:
        """All-gather (or reduce-scatter) of `nbytes` in total over the context group."""
        return self.gather(nbytes, self.context_group())

    def context_all_to_all(self, nbytes: float) -> float:
        """All-to-all of a rank's `nbytes` over the context group: (c−1)/c of
        them leave, in c−1 pairwise steps."""
        group = self.context_group()
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return 0.0
        bandwidth, latency = self.link(group)
        return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency

    def data_parallel(self, nbytes: float, pp: int, *, reduce_scatter_only: bool = False) -> float:
        """Hierarchical ring over the d·c replicas of (tp 0, pp) (data ×
        context ranks hold the same parameters): inside each server first,
        then between servers on 1/g of the bytes, then inside again.
        `reduce_scatter_only`: half of it (distributed optimizer)."""
        lay = self.layout
        group, local, leaders = _replica_servers(lay.t, lay.c, lay.d, pp, self.per_server)
        if local is None:
            total = self.allreduce(nbytes, list(group))
        else:
            total = (2 * self.gather(nbytes, list(local))
                     + self.allreduce(nbytes / len(local), list(leaders)))
        return total / 2 if reduce_scatter_only else total

    def world_latency(self) -> float:
        """A tiny all-reduce over every rank (a tree: log2(n) rounds of a
        2-process all-reduce)."""
        n = self.layout.devices
        if n <= 1:
            return 0.0
        return math.ceil(math.log2(n)) * self.allreduce(4, [0, n - 1])


@functools.lru_cache(maxsize=4096)
def _replica_servers(t: int, c: int, d: int, pp: int, per_server: int
                     ) -> tuple[tuple[int, ...], tuple[int, ...] | None, tuple[int, ...] | None]:
    """The d·c replicas of (tp 0, pp) (Machine.rank), and, when they span
    servers, the most of them on one server and each server's first: the
    same for every layout of these sizes (a search asks for them often)."""
    group = [t * (cp + c * (dp + d * pp)) for dp in range(d) for cp in range(c)]
    servers: dict[int, list[int]] = {}
    for r in group:
        servers.setdefault(r // per_server, []).append(r)
    if len(servers) == 1:
        return tuple(group), None, None
    local = max(servers.values(), key=len)
    return tuple(group), tuple(local), tuple(members[0] for members in servers.values())
