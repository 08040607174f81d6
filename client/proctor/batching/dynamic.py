"""Token-budget dynamic batching for padded micro-batches, balanced across data-parallel ranks.

Cost model (padded rectangle)
-----------------------------
A micro-batch of rows ``R`` whose real lengths (attention-mask sums) are ``L`` is run as one padded tensor of
``len(R)`` rows by ``roundup(max L, sequence_length_round)`` columns, so it *computes*
``len(R) × roundup(max L, sequence_length_round)`` tokens whatever the rows hold. ``max_tokens_per_microbatch``
(the cap) bounds that rectangle: it is the memory budget of one forward/backward pass. The cap is hard: a
micro-batch of two or more rows never computes more than the cap. A single row whose rounded length is above
the cap cannot be cut, so it runs alone in its own micro-batch and is listed in ``DynamicBatchPlan.oversized``;
it is never merged with anything.

The knobs are ROLL's (``max_tokens_per_microbatch``, ``sequence_length_round``; use separate values for
training and for log-prob inference, whose memory needs differ). Every row holds at least one token (prompt
plus completion), so zero lengths are rejected rather than given a meaning.

Algorithm
---------
1. Sort the rows by real length (ties by input position). For any number of micro-batches, some plan that
   computes the fewest tokens cuts the sorted order into contiguous runs (swapping a longer row into the
   micro-batch that holds the longest one never widens any micro-batch), and so does some plan with the
   fewest micro-batches. Plans are built from runs of the sorted order: rows of similar length share a
   micro-batch and padding stays small.
2. Cut the whole batch, not each rank's share, into the fewest feasible runs ``M`` and, among those cuts, the
   one computing the fewest tokens (a dynamic programme over run ends; a run of rows ending at width ``w``
   holds at most ``cap // w`` rows, so it is ``O(n × rows)``). ``M`` is a lower bound on the number of
   micro-batches of *any* plan, so every rank needs at least ``K = ceil(M / dp_size)`` of them, rounded up
   to a multiple of ``pp_size``; this plan uses exactly ``K`` on every rank.
3. Reach ``dp_size × K`` runs by splitting, one at a time, the multi-row run that computes the most tokens
   (ROLL's VPP rule), at the cut that minimises the two halves' cost rather than at its midpoint; splitting
   never raises cost. Then settle the boundaries: move each one, in turn, to where its two runs cost least
   (feasibly), until none moves; the fewest-runs cut rarely has its boundaries where more runs want them.
4. Give each rank ``K`` runs with Karmarkar–Karp (``equal_size``) on their computed tokens.
5. Rebalance: while the heaviest rank can shed load, move a boundary row (the shortest or the longest) of one
   of its runs to a run of another rank, or swap boundary rows between two runs, taking the change that
   lowers the heaviest rank the most without lifting the other rank to its old load. Every change keeps
   every micro-batch within the cap and every rank at ``K`` non-empty micro-batches. It stops when the
   heaviest rank is within 0.01 % of the mean, when no change helps, or after a bounded amount of search.
   If that leaves the heaviest rank more than 0.5 % above the mean, steps 3–5 are run again from the cut
   into ``dp_size × K`` runs of near-equal cost (which balances better when a few long rows dominate), and
   the plan with the lighter heaviest rank is kept.
   With ``K == 1`` steps 2–5 are replaced by the exact answer: the contiguous cut into ``dp_size`` runs that
   minimises the costliest run (binary search on the bound, a greedy check); no plan with one micro-batch
   per rank has a lighter heaviest rank.
6. Within a rank, micro-batches run in ascending width; rows inside one micro-batch ascend in length.

Guarantees: every row is placed exactly once; every rank runs the same number of micro-batches, a multiple of
``pp_size`` and the fewest the cap allows; no micro-batch of two or more rows computes more than the cap;
``permutation``/``restore`` map results back to input order. Ranks are balanced on computed tokens, so they
may hold different numbers of rows (normalise losses by the global row or token count, not per rank). The
balance is a heuristic (the problem is NP-hard); ``bench/batching.py`` measures it against the public
baselines. Planning is pure Python: a few milliseconds for 1,024 rows, bounded on degenerate inputs.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

__all__ = ["DynamicBatchPlan", "MicroBatch", "plan_dynamic_batches"]

T = TypeVar("T")

# The dynamic programme scans its window with numpy beyond this many candidates (short rows under a large
# cap); below it a Python loop is cheaper than a numpy call.
_NUMPY_WINDOW = 48
# Rebalancing stops once the heaviest rank is within this fraction of the mean: the rest is noise next to
# kernel-time variance, and the search is what costs time at large n.
_BALANCE_TOLERANCE = 1e-4
# Bounds on the rebalancing search: accepted changes, and (run, partner) pairs examined. Realistic batches
# converge long before either (tens of changes, under 100k pairs at n = 1024); they bound the planning time on
# degenerate ones (e.g. a cap below most rows, where every run is a lone row), about 0.2 µs per pair.
_MAX_REBALANCE_STEPS = 256
_MAX_REBALANCE_PAIRS = 100_000
# Boundary sweeps after splitting (see _settle); it settles in two or three on realistic batches.
_MAX_SETTLE_SWEEPS = 8
# A second start (near-equal-cost runs) is tried when the first leaves the heaviest rank this far above the
# mean: it pays off when a few long rows dominate (small batches, heavy tails) and costs a second search.
_SECOND_START_ABOVE = 5e-3
# With more runs than this, a run only trades rows with runs of the _REACH nearest widths on either side of its
# own, the only useful partners anyway (trading with a much wider or narrower run adds padding); with at most
# this many, with every run.
_FULL_SEARCH_RUNS = 64
_REACH = 4


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward pass on one rank.

    ``indices`` are input positions in execution order (ascending length), ``max_len`` the longest real length
    among them, ``padded_len`` that length rounded up to ``sequence_length_round`` (the tensor's width).
    """

    indices: tuple[int, ...]
    max_len: int
    padded_len: int

    @property
    def rows(self) -> int:
        return len(self.indices)

    @property
    def computed_tokens(self) -> int:
        """Tokens the padded ``rows × padded_len`` tensor computes, padding included."""
        return self.rows * self.padded_len


@dataclass(frozen=True, slots=True)
class DynamicBatchPlan:
    """Micro-batches per data-parallel rank, with the metrics and the index maps a trainer needs.

    ``ranks[r]`` lists rank ``r``'s micro-batches in execution order; every rank has the same number.
    ``oversized`` lists the input positions whose rounded length exceeds the cap (each runs alone).
    """

    ranks: tuple[tuple[MicroBatch, ...], ...]
    seq_lens: tuple[int, ...]
    max_tokens_per_microbatch: int
    sequence_length_round: int
    oversized: tuple[int, ...]

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (equal on every rank)."""
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def real_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def computed_tokens(self) -> int:
        return sum(self.rank_loads)

    @property
    def padding_ratio(self) -> float:
        """Computed ÷ real tokens (1.0 means no padding at all)."""
        return self.computed_tokens / self.real_tokens

    @property
    def rank_loads(self) -> tuple[int, ...]:
        """Computed tokens per rank; the largest is the step's critical path under this cost model."""
        return tuple(sum(mb.computed_tokens for mb in rank) for rank in self.ranks)

    @property
    def imbalance(self) -> float:
        """Largest ÷ mean rank load (1.0 is perfect balance)."""
        loads = self.rank_loads
        return max(loads) * len(loads) / sum(loads)

    @property
    def cap_violations(self) -> int:
        """Micro-batches over the cap other than a lone oversized row (0 for this planner by construction)."""
        cap = self.max_tokens_per_microbatch
        return sum(1 for rank in self.ranks for mb in rank if mb.rows > 1 and mb.computed_tokens > cap)

    def permutation(self, rank: int | None = None) -> list[int]:
        """Input positions in execution order: rank ``rank``'s rows, or every rank's rows one rank after another.

        Gather a batch with it (``tensor[plan.permutation(r)]``) to lay rank ``r``'s rows out micro-batch by
        micro-batch.
        """
        ranks = self.ranks if rank is None else (self.ranks[rank],)
        return [i for micro_batches in ranks for mb in micro_batches for i in mb.indices]

    def inverse_permutation(self, rank: int | None = None) -> list[int]:
        """Where each row sits in plan order, listed in input order: ``values[inv[k]]`` is the k-th input row.

        With ``rank`` given, "input order" means rank ``rank``'s rows sorted by input position.
        """
        perm = self.permutation(rank)
        return sorted(range(len(perm)), key=perm.__getitem__)

    def restore(self, values: Sequence[T], rank: int | None = None) -> list[T]:
        """Per-row results computed in plan order, put back in input order.

        ``values`` follows ``permutation(rank)``: with ``rank=None`` it holds every row (rank 0's in execution
        order, then rank 1's, ...) and the result has ``values`` for input row ``i`` at position ``i``; with a
        rank it holds that rank's rows and the result lists them by ascending input position.
        """
        inverse = self.inverse_permutation(rank)
        if len(values) != len(inverse):
            where = "the plan" if rank is None else f"rank {rank}"
            raise ValueError(f"restore got {len(values)} values for the {len(inverse)} rows of {where}")
        return [values[k] for k in inverse]

    def metrics(self, prefix: str = "dynamic_batching/") -> dict[str, float]:
        """Scalars for a training log: micro-batches per rank, padding ratio, imbalance, oversized rows."""
        return {
            f"{prefix}num_micro_batches": float(self.num_micro_batches),
            f"{prefix}padding_ratio": self.padding_ratio,
            f"{prefix}imbalance": self.imbalance,
            f"{prefix}real_tokens": float(self.real_tokens),
            f"{prefix}computed_tokens": float(self.computed_tokens),
            f"{prefix}oversized": float(len(self.oversized)),
        }


def plan_dynamic_batches(
    seq_lens: Sequence[int],
    *,
    max_tokens_per_microbatch: int,
    sequence_length_round: int = 1,
    dp_size: int = 1,
    pp_size: int = 1,
) -> DynamicBatchPlan:
    """Plan padded micro-batches for ``dp_size`` ranks under a per-micro-batch token cap.

    Args:
        seq_lens: real length (attention-mask sum, ≥ 1) of every row of the batch, in input order.
        max_tokens_per_microbatch: cap on ``rows × roundup(max length, sequence_length_round)`` per
            micro-batch; a row longer than the cap after rounding runs alone and is reported in ``oversized``.
        sequence_length_round: micro-batch widths are padded to a multiple of this (e.g. TP × CP, 64, 128).
        dp_size: data-parallel ranks; each gets its own rows and the same number of micro-batches.
        pp_size: the micro-batch count per rank is made a multiple of this (Megatron's interleaved schedule).

    Returns:
        The plan: micro-batches per rank in execution order, the oversized rows, metrics and index maps.

    Raises:
        ValueError: a non-positive cap, round, dp_size or pp_size; a length below 1; or too few rows to give
            every rank the same number of non-empty micro-batches (the message says what to change).
        TypeError: a parameter or a length that is not an integer.

    Example:
        >>> plan = plan_dynamic_batches([7, 6, 8, 5, 1, 3, 8, 6], max_tokens_per_microbatch=10,
        ...                             sequence_length_round=2, dp_size=2)
        >>> plan.num_micro_batches, plan.computed_tokens, plan.rank_loads
        (4, 48, (24, 24))
        >>> [mb.indices for mb in plan.ranks[0]]
        [(4,), (1,), (0,), (6,)]
    """
    cap = _positive("max_tokens_per_microbatch", max_tokens_per_microbatch, "e.g. 16384")
    rnd = _positive("sequence_length_round", sequence_length_round, "use 1 for no rounding, or e.g. 64 or 128")
    dp = _positive("dp_size", dp_size, "the number of data-parallel ranks, 1 without data parallelism")
    pp = _positive("pp_size", pp_size, "the pipeline-parallel size, 1 without pipeline parallelism")
    lengths = _lengths(seq_lens)
    n = len(lengths)
    if n < dp * pp:
        raise ValueError(
            f"{n} sequences cannot fill dp_size={dp} ranks × pp_size={pp} micro-batches each (every rank needs at "
            f"least pp_size non-empty micro-batches): pass at least {dp * pp} sequences, or lower dp_size or pp_size"
        )

    order = sorted(range(n), key=lambda i: (lengths[i], i))
    widths = [-(-lengths[i] // rnd) * rnd for i in order]  # ascending, as the order is
    ends = _fewest_runs(widths, cap)
    per_rank = -(-len(ends) // dp)
    per_rank = -(-per_rank // pp) * pp
    if dp * per_rank > n:
        raise ValueError(
            f"the cap max_tokens_per_microbatch={cap} forces at least {len(ends)} micro-batches, i.e. {per_rank} on "
            f"each of dp_size={dp} ranks (a multiple of pp_size={pp}), which needs at least {dp * per_rank} "
            f"sequences but there are {n}: raise max_tokens_per_microbatch, lower dp_size or pp_size, or pass "
            "more sequences"
        )

    if per_rank == 1:
        # One micro-batch per rank: the contiguous min-max cut is optimal, nothing to rebalance.
        runs = [list(range(start, end)) for start, end in _split(_min_max_runs(widths, cap, dp), widths, dp)]
        owner = list(range(dp))
    else:
        target = dp * per_rank
        starts = [0, *ends[:-1]]
        cuts = _settle(_split(list(zip(starts, ends, strict=True)), widths, target), widths, cap)
        runs, owner, loads, budget = _distribute(cuts, widths, cap, dp, _MAX_REBALANCE_PAIRS)
        if max(loads) * dp > sum(loads) * (1 + _SECOND_START_ABOVE) and budget > 0:
            # Second start: runs of near-equal cost (the min-max cut into dp × K runs) are easier to balance
            # when a few long rows dominate; keep whichever plan has the lighter heaviest rank.
            cuts = _split(_min_max_runs(widths, cap, target), widths, target)  # not settled: that undoes it
            other = _distribute(cuts, widths, cap, dp, budget)
            if (max(other[2]), sum(other[2])) < (max(loads), sum(loads)):
                runs, owner, loads = other[:3]

    by_rank: list[list[MicroBatch]] = [[] for _ in range(dp)]
    for run, rank in zip(runs, owner, strict=True):
        top = lengths[order[run[-1]]]
        by_rank[rank].append(MicroBatch(tuple(order[p] for p in run), top, widths[run[-1]]))
    for micro_batches in by_rank:
        micro_batches.sort(key=lambda mb: (mb.padded_len, mb.max_len, mb.indices[0]))
    oversized = tuple(sorted(order[p] for p in range(n) if widths[p] > cap))
    return DynamicBatchPlan(tuple(tuple(mbs) for mbs in by_rank), tuple(lengths), cap, rnd, oversized)


# --- validation -------------------------------------------------------------------------------------------


def _positive(name: str, value: int, hint: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}: {hint}") from None
    if isinstance(value, bool) or number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}: {hint}")
    return number


def _lengths(seq_lens: Sequence[int]) -> list[int]:
    to_list = getattr(seq_lens, "tolist", None)  # numpy arrays and torch tensors convert in one C call
    raw = to_list() if callable(to_list) else list(seq_lens)
    lengths: list[int] = []
    for i, value in enumerate(raw):
        try:
            length = operator.index(value)
        except TypeError:
            raise TypeError(f"seq_lens[{i}] = {value!r} is not an integer token count") from None
        if length < 1:
            raise ValueError(
                f"seq_lens[{i}] = {length}: every row must hold at least one token (lengths are attention-mask "
                "sums of prompt + completion); drop empty rows before planning"
            )
        lengths.append(length)
    return lengths


# --- cutting the sorted order into runs --------------------------------------------------------------------


def _row_limit(width: int, cap: int) -> int:
    """Most rows a run of this width may hold: a lone row is always allowed, even over the cap."""
    return max(1, cap // width)


def _fewest_runs(widths: list[int], cap: int) -> list[int]:
    """Run ends of the cut of ascending ``widths`` into the fewest feasible runs, then the fewest computed tokens.

    best[j] encodes (runs, tokens) of the best cut of the first j rows as runs × big + tokens, one integer so
    that a single comparison is lexicographic.
    """
    n = len(widths)
    big = n * widths[-1] + 1
    best = [0] * (n + 1)
    back = [0] * (n + 1)
    use_numpy = n * n * widths[-1] < 2**62  # the encoded values must fit int64
    best_np = np.zeros(n + 1, dtype=np.int64) if use_numpy else None
    positions = np.arange(n + 1, dtype=np.int64) if use_numpy else None
    for j in range(1, n + 1):
        w = widths[j - 1]
        lo = max(0, j - _row_limit(w, cap))
        if best_np is not None and positions is not None and j - lo > _NUMPY_WINDOW:
            # best[i] + (j - i) * w minimised over the window: the i-dependent part is best[i] - i * w.
            k = int(np.argmin(best_np[lo:j] - positions[lo:j] * w))
            arg = lo + k
            value = best[arg] + (j - arg) * w
        else:
            arg = j - 1
            value = best[arg] + w
            for i in range(lo, j - 1):
                candidate = best[i] + (j - i) * w
                if candidate < value:
                    value, arg = candidate, i
        best[j] = value + big
        back[j] = arg
        if best_np is not None:
            best_np[j] = best[j]
    ends: list[int] = []
    j = n
    while j > 0:
        ends.append(j)
        j = back[j]
    ends.reverse()
    return ends


def _min_max_runs(widths: list[int], cap: int, count: int) -> list[tuple[int, int]]:
    """The contiguous cut into at most ``count`` feasible runs whose costliest run is as cheap as possible."""

    def greedy(bound: int) -> list[tuple[int, int]]:
        # Longest runs first is optimal for "every run costs at most bound": a sub-run of a feasible run is
        # feasible (fewer rows, no wider).
        limit = min(bound, cap)
        runs = []
        start = 0
        n = len(widths)
        while start < n:
            end = start + 1
            while end < n and (end + 1 - start) * widths[end] <= limit:
                end += 1
            runs.append((start, end))
            start = end
        return runs

    lo, hi = max(widths), max(max(widths), cap)  # hi is feasible: the caller checked ceil(M / count) == 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(greedy(mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    return greedy(lo)


def _split(runs: list[tuple[int, int]], widths: list[int], target: int) -> list[tuple[int, int]]:
    """Split the costliest multi-row run, at its cheapest cut, until there are ``target`` runs."""
    runs = list(runs)
    # Max-heap of multi-row runs by computed tokens; a split run's halves are pushed back if still splittable.
    heap = [(-(e - s) * widths[e - 1], s, e) for s, e in runs if e - s > 1]
    heapq.heapify(heap)
    removed: set[tuple[int, int]] = set()
    added: list[tuple[int, int]] = []
    for _ in range(target - len(runs)):
        _, s, e = heapq.heappop(heap)  # the caller guarantees enough rows, so the heap is never empty here
        cut = min(range(s + 1, e), key=lambda c: ((c - s) * widths[c - 1] + (e - c) * widths[e - 1], -c))
        removed.add((s, e))
        for half in ((s, cut), (cut, e)):
            added.append(half)
            if half[1] - half[0] > 1:
                heapq.heappush(heap, (-(half[1] - half[0]) * widths[half[1] - 1], *half))
    kept = [run for run in runs + added if run not in removed]
    return sorted(kept)


def _settle(cuts: list[tuple[int, int]], widths: list[int], cap: int) -> list[tuple[int, int]]:
    """Move each boundary between two neighbouring runs to where their combined cost is lowest, until none moves.

    Splitting leaves the other boundaries where the fewest-runs cut put them, which is rarely where the cut
    into more runs wants them; this coordinate descent recovers most of the difference (it is exact for one
    boundary at a time, not for all at once).
    """

    def cost(start: int, end: int) -> int | None:
        rows, width = end - start, widths[end - 1]
        return rows * width if rows == 1 or rows * width <= cap else None

    bounds = [cuts[0][0]] + [end for _, end in cuts]
    for _ in range(_MAX_SETTLE_SWEEPS):
        moved = False
        for k in range(1, len(bounds) - 1):
            lo, at, hi = bounds[k - 1], bounds[k], bounds[k + 1]
            left, right = cost(lo, at), cost(at, hi)
            assert left is not None and right is not None, "the current cut is always feasible"
            best = left + right
            for c in range(lo + 1, hi):
                left = cost(lo, c)
                right = cost(c, hi) if left is not None else None
                if left is not None and right is not None and left + right < best:
                    best, at = left + right, c
            if at != bounds[k]:
                bounds[k], moved = at, True
        if not moved:
            break
    return list(itertools.pairwise(bounds))


# --- ranks ----------------------------------------------------------------------------------------------------


def _distribute(
    cuts: list[tuple[int, int]], widths: list[int], cap: int, dp: int, budget: int
) -> tuple[list[list[int]], list[int], list[int], int]:
    """Runs (lists of sorted positions), the rank of each, the rank loads after balancing, the budget left."""
    runs = [list(range(start, end)) for start, end in cuts]
    owner = [0] * len(runs)
    if dp > 1:
        costs = [len(run) * widths[run[-1]] for run in runs]
        for rank, members in enumerate(_karmarkar_karp(costs, dp)):
            for t in members:
                owner[t] = rank
        budget -= _rebalance(runs, owner, widths, cap, dp, budget)
    loads = [0] * dp
    for run, rank in zip(runs, owner, strict=True):
        loads[rank] += len(run) * widths[run[-1]]
    return runs, owner, loads, budget


def _karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """k-way largest differencing with equal set sizes (``len(weights)`` is a multiple of k): index lists."""
    ranked = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    tie = itertools.count()
    heap: list[tuple[int, int, int, list[tuple[int, list[int]]]]] = []

    def push(sets: list[tuple[int, list[int]]]) -> None:
        sets.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (sets[-1][0] - sets[0][0], -sets[0][0], next(tie), sets))

    for start in range(0, len(ranked), k):
        push([(weights[i], [i]) for i in ranked[start : start + k]])
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        # The heaviest set of one partial solution takes the lightest of the other: differences cancel.
        push([(first[j][0] + second[-1 - j][0], first[j][1] + second[-1 - j][1]) for j in range(k)])
    return [members for _, members in heap[0][3]]


def _rebalance(runs: list[list[int]], owner: list[int], widths: list[int], cap: int, dp: int, budget: int) -> int:
    """Lower the heaviest rank's load by trading boundary rows between runs of different ranks (in place).

    Examines at most about ``budget`` (run, partner) pairs and returns how many it examined.
    """
    count = len(runs)
    rows = [len(run) for run in runs]
    last = [widths[run[-1]] for run in runs]  # the run's width
    first = [widths[run[0]] for run in runs]
    second = [widths[run[-2]] if len(run) > 1 else 0 for run in runs]  # width once the last row is gone
    cost = [r * w for r, w in zip(rows, last, strict=True)]
    load = [0] * dp
    for t in range(count):
        load[owner[t]] += cost[t]
    total = sum(load)
    reach = count if count <= _FULL_SEARCH_RUNS else _REACH  # in distinct widths
    pairs = 0

    for _ in range(_MAX_REBALANCE_STEPS):
        if pairs > budget:
            return pairs
        heavy = max(range(dp), key=load.__getitem__)
        top = load[heavy]
        if top * dp <= total * (1 + _BALANCE_TOLERANCE):
            return pairs
        # Partners of a run are the runs whose width is among the `reach` widths on either side of its own.
        # Runs alike in owner, rows and boundary widths are interchangeable here, so each width keeps one
        # of each kind: with coarse rounding hundreds of runs share a width and would crowd out the rest.
        pairs += count  # grouping the runs costs about as much as examining as many pairs
        groups: list[list[int]] = []
        group_of: dict[int, int] = {}
        kinds: set[tuple[int, int, int, int]] = set()
        for t in sorted(range(count), key=lambda t: (last[t], runs[t][0])):
            if last[t] not in group_of:
                group_of[last[t]] = len(groups)
                groups.append([])
                kinds.clear()
            kind = (owner[t], rows[t], first[t], second[t])
            if kind not in kinds:
                kinds.add(kind)
                groups[-1].append(t)
        best_max, best_delta = top, 0
        change: tuple[int, int, int, int | None, int, int] | None = None
        for a in range(count):
            if owner[a] != heavy:
                continue
            rows_a, cost_a = rows[a], cost[a]
            base_a = top - cost_a
            # (end, width of that row, width of the run without it); a lone row can only be swapped.
            ends_a = ((0, first[a], last[a]), (-1, last[a], second[a])) if rows_a > 1 else ((0, last[a], 0),)
            g = group_of[last[a]]
            partners = [t for group in groups[max(0, g - reach) : g + reach + 1] for t in group]
            pairs += len(partners)
            for b in partners:
                other = owner[b]
                if other == heavy or load[other] >= top:
                    continue
                rows_b, cost_b, width_b = rows[b], cost[b], last[b]
                base_b = load[other] - cost_b
                ends_b = ((0, first[b], width_b), (-1, width_b, second[b])) if rows_b > 1 else ((0, width_b, 0),)
                for end_a, x, rest_a in ends_a:
                    if rows_a > 1:
                        # Move the row to b: a loses a row, b gains one (and maybe width).
                        new_b = (rows_b + 1) * (x if x > width_b else width_b)
                        if new_b <= cap:
                            new_a = (rows_a - 1) * rest_a
                            load_a, load_b = base_a + new_a, base_b + new_b
                            worst = load_a if load_a > load_b else load_b
                            delta = new_a + new_b - cost_a - cost_b
                            if worst < best_max or (worst == best_max and change is not None and delta < best_delta):
                                best_max, best_delta, change = worst, delta, (a, b, end_a, None, new_a, new_b)
                    for end_b, y, rest_b in ends_b:
                        # Swap with one of b's boundary rows: both runs keep their row counts.
                        if y == x:
                            continue
                        new_a = rows_a * (y if y > rest_a else rest_a)
                        new_b = rows_b * (x if x > rest_b else rest_b)
                        if (rows_a > 1 and new_a > cap) or (rows_b > 1 and new_b > cap):
                            continue
                        load_a, load_b = base_a + new_a, base_b + new_b
                        worst = load_a if load_a > load_b else load_b
                        delta = new_a + new_b - cost_a - cost_b
                        if worst < best_max or (worst == best_max and change is not None and delta < best_delta):
                            best_max, best_delta, change = worst, delta, (a, b, end_a, end_b, new_a, new_b)
        if change is None:
            return pairs
        a, b, from_a, from_b, new_a, new_b = change
        row = runs[a].pop(from_a)
        if from_b is not None:
            bisect.insort(runs[a], runs[b].pop(from_b))
        bisect.insort(runs[b], row)
        for t, new in ((a, new_a), (b, new_b)):
            run = runs[t]
            rows[t], last[t], first[t] = len(run), widths[run[-1]], widths[run[0]]
            second[t] = widths[run[-2]] if len(run) > 1 else 0
            load[owner[t]] += new - cost[t]
            total += new - cost[t]
            cost[t] = new
    return pairs
