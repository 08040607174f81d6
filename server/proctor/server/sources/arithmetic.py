"""A procedural arithmetic source: seeded, endless or ``size`` records, with digits/operands/operators as
difficulty knobs."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence

from proctor.server.sources.base import Record, Source, content_version
from proctor.server.spec import ArithmeticSourceSpec

__all__ = ["ArithmeticSource"]

# Bump when the generation procedure changes: the version (and so every sample id) changes with it.
_GENERATOR = "arithmetic/1"
# Per source: enough for the records of the latest steps, which /grade looks up right after /sample made them
# (a record costs ~0.5 KiB kept and ~50 µs regenerated).
_CACHED_RECORDS = 4096
_OP_DIFFICULTY = {"+": 0.0, "-": 0.5, "*": 1.0}


class ArithmeticSource(Source):
    """Record ``k`` is a pure function of (seed, source name, knobs, k)."""

    kind = "arithmetic"

    def __init__(self, name: str, spec: ArithmeticSourceSpec, seed: int) -> None:
        knobs = spec.model_dump(include={"ops", "digits", "operands", "allow_negative", "template"})
        # Only a set size enters the version, so the sample ids of endless sources stay what they were.
        if spec.size is not None:
            knobs["size"] = spec.size
        super().__init__(name, content_version(_GENERATOR, seed, name, knobs))
        self.spec = spec
        self._seed_prefix = f"{seed}:{name}:"
        # /grade looks up the records /sample just generated; regenerating one costs more than keeping it.
        self.record = functools.lru_cache(maxsize=_CACHED_RECORDS)(self._generate)  # type: ignore[method-assign]

    @property
    def size(self) -> int | None:
        return self.spec.size

    def record(self, key: int) -> Record:
        return self._generate(key)

    def derived_difficulty(self) -> float:
        """The mean of three knob scores on [0, 1], each rising with its knob:

        * largest digit count: ``log(max digits) / log(18)``;
        * operand count: ``log(operands - 1) / log(7)``;
        * hardest operator: ``+`` 0, ``-`` 0.5, ``*`` 1.

        Logarithms, because each further digit or operand adds less difficulty than the one before; on this
        scale the shipped arithmetic ladder rises stage by stage (0, 0.25, 0.41, 0.53). ``allow_negative`` and
        the template do not count.
        """
        spec = self.spec
        digits = math.log(spec.digits[1]) / math.log(18)
        operands = math.log(spec.operands - 1) / math.log(7)
        ops = max(_OP_DIFFICULTY[op] for op in spec.ops)
        return (digits + operands + ops) / 3

    def _generate(self, key: int) -> Record:
        if key < 0 or (self.spec.size is not None and key >= self.spec.size):
            raise KeyError(key)
        rng = random.Random(self._seed_prefix + str(key))
        spec = self.spec
        # Retry (deterministically) until the expression is non-negative when negatives are not wanted;
        # the bound only matters for long chains of subtractions.
        for _ in range(64):
            operands = [_operand(rng, *spec.digits) for _ in range(spec.operands)]
            ops = [rng.choice(spec.ops) for _ in range(spec.operands - 1)]
            if spec.allow_negative or _evaluate(operands, ops) >= 0:
                break
        else:
            # Long subtraction chains rarely land non-negative; turn them into sums rather than loop on.
            ops = ["+" if op == "-" else op for op in ops]
        expression = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(ops, operands[1:], strict=True))
        return Record(
            key=key,
            # replace, not str.format: other braces in a template (\\boxed{}) are the author's text.
            prompt=spec.template.replace("{expression}", expression),
            answer=str(_evaluate(operands, ops)),
            system_prompt=spec.system_prompt,
            metadata={"expression": expression},
        )


def _operand(rng: random.Random, lo: int, hi: int) -> int:
    digits = rng.randint(lo, hi)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Usual precedence: products first, then sums and differences left to right."""
    terms = [operands[0]]
    signs = [1]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))
