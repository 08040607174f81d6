"""What every source provides: records addressed by an integer key, and a content version.

A sample id is ``<source>:<version>:<key>``. The version changes whenever the records behind the keys may
have changed (a data file was edited, a generator's knobs or seed moved), so a completion can never be
graded against a record other than the one it was sampled from.
"""

from __future__ import annotations

import functools
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from proctor.wire.dataserver import check_sample_id

__all__ = ["Record", "SampleId", "Source", "content_version"]


@dataclass(frozen=True, slots=True)
class Record:
    """One prompt with what its graders need."""

    key: int
    prompt: str
    answer: str | None = None
    system_prompt: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SampleId:
    source: str
    version: str
    key: int

    def __str__(self) -> str:
        return f"{self.source}:{self.version}:{self.key}"

    @classmethod
    def parse(cls, text: str) -> SampleId:
        """Parse ``source:version:key``; raises ValueError with the expected shape (the wire's own check)."""
        return _parsed(text)


# A /grade names each of its prompts' ids once per completion, and several stages of it read them: each id is
# parsed once while it is recent (an invalid one is not kept).
_PARSED_KEPT = 16_384


@functools.lru_cache(maxsize=_PARSED_KEPT)
def _parsed(text: str) -> SampleId:
    source, version, key = check_sample_id(text).split(":")
    return SampleId(source=source, version=version, key=int(key))


def content_version(*parts: Any) -> str:
    """A short, stable digest of whatever determines a source's records."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:10]


class Source(ABC):
    """A finite table of records or an infinite generator of them."""

    kind: str
    # The spec's `difficulty`, set by build_source: an author's number outranks one derived from knobs.
    declared_difficulty: float | None = None

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version

    @property
    @abstractmethod
    def size(self) -> int | None:
        """Number of records, or ``None`` for a procedural source with no end."""

    @abstractmethod
    def record(self, key: int) -> Record:
        """The record with this key; raises ``KeyError`` when there is none."""

    def sample_id(self, key: int) -> str:
        return f"{self.name}:{self.version}:{key}"

    def source_difficulty(self) -> float | None:
        """This source's difficulty: the spec's ``difficulty`` when given, else :meth:`derived_difficulty`."""
        if self.declared_difficulty is not None:
            return self.declared_difficulty
        return self.derived_difficulty()

    def derived_difficulty(self) -> float | None:
        """What a procedural source's knobs say about its difficulty, on [0, 1]; ``None`` when they say nothing."""
        return None

    def record_difficulties(self) -> npt.NDArray[np.float64] | None:
        """Every record's difficulty, by key, where the source has one per record; ``None`` otherwise. Built
        once: the samplers read it whole."""
        return None

    def record_difficulty(self, key: int) -> float | None:
        """The difficulty of one record (see :meth:`record_difficulties`); raises ``KeyError`` for a key the
        source does not have."""
        if self.size is not None and not 0 <= key < self.size:
            raise KeyError(key)
        values = self.record_difficulties()
        return None if values is None else float(values[key])
