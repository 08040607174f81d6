"""Group refill: which of a step's graded groups carry no signal under a stage's ``refill`` rule, and the
records that replace them. Pure: the refill service reads the groups' grades from the store and records what
this decides, so that every rank, retry and restart of a step gets the same answer."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from proctor.server.curriculum.permutation import derive_key
from proctor.server.spec import RefillSpec, ZeroVarianceRefillSpec

__all__ = ["GroupGrades", "keeps", "replacement_key"]

# Rewards whose sum of squared deviations is below this (per completion) are alike: float noise, not signal.
_ALIKE = 1e-12
# Draws of a finite source tried before the next free key is looked for in order.
_TRIES = 32
# An endless source's replacement keys are 52-bit: far past any stream position, and exact in JSON and
# JavaScript numbers.
_ENDLESS_BITS = 52


@dataclass(frozen=True, slots=True)
class GroupGrades:
    """A group's graded rewards as the rule reads them: how many (graders' errors left out), their mean and
    Welford's sum of squared deviations."""

    n: int
    mean: float
    m2: float

    @classmethod
    def of(cls, rewards: Iterable[float]) -> GroupGrades:
        values = list(rewards)
        if not values:
            return cls(0, 0.0, 0.0)
        mean = sum(values) / len(values)
        return cls(len(values), mean, sum((v - mean) ** 2 for v in values))


def keeps(spec: RefillSpec, group: GroupGrades) -> bool:
    """Whether ``group`` carries what the rule asks for; a group the rule does not keep is replaced. A group
    with no reward at all (every grading failed) is never kept."""
    if group.n == 0:
        return False
    if isinstance(spec, ZeroVarianceRefillSpec):
        return group.m2 > _ALIKE * group.n
    return spec.low <= group.mean <= spec.high


def replacement_key(
    seed: int, source: str, size: int | None, iteration: int, round_: int, position: int, held: set[int]
) -> int:
    """The record of ``source`` that replaces the group at ``position`` of ``iteration`` in refill round
    ``round_``: uniform over the source, seeded by all of these, and not one of ``held`` (the source's records
    the step holds already) while the source has others."""
    rng = random.Random(derive_key(seed, "refill", source, iteration, round_, position))
    if size is None:
        return rng.getrandbits(_ENDLESS_BITS)
    key = rng.randrange(size)
    for _ in range(_TRIES):
        if key not in held:
            return key
        key = rng.randrange(size)
    if len(held) >= size:
        return key  # the step holds the whole source: a record it holds, in a slot of its own
    while key in held:  # a source the step nearly exhausts: the next free key (held is at most the step's size)
        key = (key + 1) % size
    return key
