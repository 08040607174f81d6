"""Sampled iterations as they are served: each prompt encoded to JSON once, a response joined from the
encoded prompts, and a cache of recent batches bounded in count and in bytes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from pydantic_core import to_json

from proctor.server.state.rows import IterationRow

__all__ = ["SampleCache", "ServedBatch", "encode_sample"]


def encode_sample(slot: int, sample: dict[str, Any]) -> bytes:
    """One entry of ``SampleResponse.samples``."""
    # The slot is the sample's position. It is added here for the state files of earlier versions, whose
    # stored samples have none (the samples stored now carry it, and `**sample` writes the same value again).
    # pydantic's encoder: compact UTF-8, a third of the time of the json module's.
    return to_json({"sample_id": sample["sample_id"], "slot": slot, **sample})


@dataclass(frozen=True, slots=True)
class ServedBatch:
    """A sampled iteration: each sample already encoded as JSON, with its slot, and the sample ids by slot.
    Past ``batch_size`` come the samples its refill rounds added (``/refill``), which ``/sample`` never serves."""

    iteration: int
    batch_size: int
    stage: int
    stage_name: str
    samples: tuple[bytes, ...]
    sample_ids: tuple[str, ...]
    refill_rounds: int = 0
    """The refill rounds the stage allows (0: it refills nothing)."""

    @property
    def size(self) -> int:
        """Bytes of encoded samples, what the sample cache counts."""
        return sum(map(len, self.samples))

    @classmethod
    def of(cls, row: IterationRow, stage_name: str, refill_rounds: int = 0) -> ServedBatch:
        encoded = tuple(encode_sample(slot, s) for slot, s in enumerate(row.samples))
        ids = tuple(s["sample_id"] for s in row.samples)
        return cls(row.iteration, row.batch_size, row.stage, stage_name, encoded, ids, refill_rounds)

    def extended(self, samples: list[dict[str, Any]]) -> ServedBatch:
        """This batch with ``samples`` appended, in the slots after its last."""
        encoded = tuple(encode_sample(len(self.samples) + n, s) for n, s in enumerate(samples))
        ids = tuple(s["sample_id"] for s in samples)
        return replace(self, samples=self.samples + encoded, sample_ids=self.sample_ids + ids)

    def samples_json(self) -> str:
        """The samples as the store keeps them: a JSON list."""
        return (b"[" + b",".join(self.samples) + b"]").decode()

    def response(self, rank: int | None, world_size: int | None) -> bytes:
        """The JSON of :class:`~proctor.wire.dataserver.SampleResponse`: the whole batch, or a rank's
        contiguous share of it. Joined from the encoded samples: a repeat costs a join, not a serialisation."""
        samples = self.samples[: self.batch_size]
        if rank is not None and world_size is not None:
            share = self.batch_size // world_size
            samples = samples[rank * share : (rank + 1) * share]
        tail = to_json(
            {
                "stage": self.stage_name,
                "stage_index": self.stage,
                "iteration": self.iteration,
                "batch_size": self.batch_size,
                "rank": rank,
                "world_size": world_size,
                "refill_rounds": self.refill_rounds,
            }
        )
        return b'{"samples":[' + b",".join(samples) + b"]," + tail[1:]


class SampleCache:
    """Recently served batches, least recently used out first, at most ``max_batches`` and ``max_bytes``
    (a batch of long prompts may be megabytes). ``max_batches=0`` turns it off."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._batches: OrderedDict[int, ServedBatch] = OrderedDict()
        self.bytes = 0

    def get(self, iteration: int) -> ServedBatch | None:
        batch = self._batches.get(iteration)
        if batch is not None:
            self._batches.move_to_end(iteration)
        return batch

    def put(self, batch: ServedBatch) -> None:
        """Keep ``batch``, in place of the one of its iteration kept before (a refill extends a batch)."""
        if self.max_batches == 0:
            return
        old = self._batches.pop(batch.iteration, None)
        if old is not None:
            self.bytes -= old.size
        self._batches[batch.iteration] = batch
        self.bytes += batch.size
        while self._batches and (len(self._batches) > self.max_batches or self.bytes > self.max_bytes):
            self.bytes -= self._batches.popitem(last=False)[1].size
