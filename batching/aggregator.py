"""The LCM aggregator: buffer micro-batches up to the service batch, compute once, split back, repeat.

Rollout, ref logps and old logps each walk a batch in their own micro-batch size. Running them once per
training micro-batch pays every fixed cost (launch, sync, scheduling) once per micro-batch; running them on a
*service batch* of at least ``service_target_bs = lcm(rollout, ref, old)`` samples pays it once, and every stage
cuts the service batch evenly. The aggregator does exactly that and then hands the trainer its original
micro-batches back.

One **round** (what one ``prepare_round`` call consumes):

1. take micro-batches from the iterator into a buffer: ``proceed_num_steps`` of them (the gradient accumulation
   steps), or all of them with ``proceed_num_steps=-1`` (eval);
2. as soon as the buffer holds ``≥ service_target_bs`` samples: merge it by key (concatenate along axis 0),
   repeat each sample ``sample_repeat`` times *at sample level*, make **one** ``compute`` call, split the result
   back at the buffered micro-batches' boundaries, and empty the buffer;
3. at the end of the round (``proceed_num_steps`` reached, or the iterator ended in eval mode) flush what is
   left with the same steps even though it is short of the target: the *forced* tail;
4. emit every micro-batch ``batch_repeat`` times in a row.

Shapes, with ``b_i`` the sample count of input micro-batch ``i``, ``r = sample_repeat``, ``μ = batch_repeat``:

- a micro-batch is a mapping ``key -> array``, every array with the same leading length ``b_i ≥ 1``; an array
  is a numpy array, a torch tensor, or a Python list, and one key keeps one kind across micro-batches;
- ``compute`` receives ``{key: array}`` with leading length ``r · Σ b_i`` over the buffered micro-batches,
  sample ``j`` of the merged batch at rows ``r·j … r·j + r − 1`` (order ``a a b b``, never ``a b a b``);
- ``compute`` returns ``{key: array}`` (any keys) with that same leading length;
- the output of a round has ``μ · k`` batches for ``k`` input micro-batches: output ``μ·i + m`` (``0 ≤ m < μ``)
  is rows ``r · (b_0 + … + b_{i−1})`` to ``r · (b_0 + … + b_i)`` of its service batch's result, so micro-batch
  ``i`` comes back with ``r · b_i`` rows; the order is ``a a b b …``, the μ copies of a batch are *the same
  object* (no copy), and numpy/torch outputs are views into the service batch's result.

Invariants the tests check: every input sample appears exactly ``r`` times in each of the μ copies; the split
boundaries are the input boundaries × ``r``; every non-forced ``compute`` call sees ``≥ service_target_bs``
input samples and a forced one fewer; a service batch never spans two rounds.

Running out of data (as tunix's ``_prepare_data``): with ``proceed_num_steps > 0``, an iterator that ends
before the round is complete ends the data. ``prepare_round`` returns ``None``, the partial round's
micro-batches are dropped (``Aggregator.dropped`` counts them; a service batch already computed for them is
wasted, the buffered rest is never computed), because a partial gradient accumulation is not a training step.
With ``proceed_num_steps=-1`` the round takes everything left and always returns a list (empty when nothing
was left).

:class:`BackgroundProducer` runs rounds on a thread and puts them into a bounded queue: the round's batches
one by one, then ``None`` (end of round); at the end one :class:`EndOfData` (with the producer's exception,
if any). Iterating the producer yields rounds as lists and re-raises a producer exception in the consumer.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeAlias, TypeGuard

import numpy as np
import numpy.typing as npt

from proctor.batching.lcm import lcm

if TYPE_CHECKING:
    import torch

__all__ = [
    "AggregationConfig",
    "Aggregator",
    "Array",
    "BackgroundProducer",
    "Batch",
    "Compute",
    "EndOfData",
    "QueueItem",
    "ServiceCall",
    "iter_rounds",
    "merge",
    "prepare_round",
    "repeat_samples",
    "sample_count",
    "skip_micro_batches",
    "split",
]

Array: TypeAlias = "npt.NDArray[Any] | torch.Tensor | list[Any]"
Batch: TypeAlias = "dict[str, Array]"
Compute: TypeAlias = "Callable[[Batch], Mapping[str, Array]]"
_Kind = Literal["numpy", "torch", "list"]


# --- arrays of three kinds ------------------------------------------------------------------------------------


def _is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    # A tensor can only exist once torch is imported, so this never imports torch (numpy-only installs work,
    # and importing this module stays cheap).
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(value, torch_module.Tensor)


def _kind(value: object, where: str) -> _Kind:
    if isinstance(value, np.ndarray):
        return "numpy"
    if _is_tensor(value):
        return "torch"
    if isinstance(value, list):
        return "list"
    raise TypeError(f"{where} is a {type(value).__name__}; expected a numpy array, a torch tensor or a list")


def _length(value: Array, where: str) -> int:
    if isinstance(value, list):
        return len(value)
    if value.ndim == 0:
        raise ValueError(f"{where} is 0-dimensional; it needs a leading batch axis")
    return int(value.shape[0])


def sample_count(batch: Mapping[str, Array], *, name: str = "micro-batch") -> int:
    """The leading length shared by every array of ``batch``.

    Raises ``ValueError`` for an empty mapping, arrays of different leading lengths or a 0-d array, and
    ``TypeError`` for a value that is not a numpy array, a torch tensor or a list.
    """
    if not batch:
        raise ValueError(f"{name} has no arrays")
    lengths: dict[str, int] = {}
    for key, value in batch.items():
        _kind(value, f"{name}[{key!r}]")
        lengths[key] = _length(value, f"{name}[{key!r}]")
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{key!r}: {length}" for key, length in lengths.items())
        raise ValueError(f"{name} has arrays of different leading lengths ({described})")
    return next(iter(lengths.values()))


def _concat(key: str, values: Sequence[Array]) -> Array:
    kinds = [_kind(value, f"micro-batch {index}[{key!r}]") for index, value in enumerate(values)]
    for index, kind in enumerate(kinds):
        if kind != kinds[0]:
            raise TypeError(
                f"key {key!r} is a {kinds[0]} value in micro-batch 0 but a {kind} value in micro-batch {index}; "
                "one key must keep one kind"
            )
    if kinds[0] == "numpy":
        return np.concatenate([value for value in values if isinstance(value, np.ndarray)], axis=0)
    if kinds[0] == "torch":
        import torch  # already imported: _kind found a tensor

        return torch.cat([value for value in values if _is_tensor(value)], dim=0)
    merged: list[Any] = []
    for value in values:
        if isinstance(value, list):
            merged.extend(value)
    return merged


def merge(batches: Sequence[Mapping[str, Array]]) -> Batch:
    """Concatenate micro-batches key by key along axis 0 (``np.concatenate`` / ``torch.cat`` / list ``+``).

    Every micro-batch must have the same keys, and a key the same kind in all of them.
    """
    if not batches:
        raise ValueError("merge needs at least one micro-batch")
    keys = list(batches[0])
    for index, batch in enumerate(batches):
        if set(batch) != set(keys):
            raise ValueError(
                f"micro-batch {index} has keys {sorted(batch)} but micro-batch 0 has {sorted(keys)}; "
                "all micro-batches must have the same keys"
            )
    return {key: _concat(key, [batch[key] for batch in batches]) for key in keys}


def _repeat(value: Array, times: int) -> Array:
    if isinstance(value, np.ndarray):
        return np.repeat(value, times, axis=0)
    if isinstance(value, list):
        # The repeated entries are the same objects: a list holds prompts/strings, which nobody mutates.
        return [item for item in value for _ in range(times)]
    return value.repeat_interleave(times, dim=0)


def repeat_samples(batch: Mapping[str, Array], times: int) -> Batch:
    """Repeat every sample ``times`` times in place: ``a b`` becomes ``a a b b`` (``np.repeat`` axis 0,
    ``torch.repeat_interleave`` dim 0, or the list equivalent)."""
    if times == 1:
        return dict(batch)
    return {key: _repeat(value, times) for key, value in batch.items()}


def split(batch: Mapping[str, Array], sizes: Sequence[int]) -> list[Batch]:
    """Cut ``batch`` into consecutive pieces of ``sizes`` rows (numpy/torch pieces are views)."""
    total = sample_count(batch, name="the batch to split")
    if sum(sizes) != total:
        raise ValueError(f"cannot split {total} rows into pieces of {list(sizes)} (sum {sum(sizes)})")
    pieces: list[Batch] = []
    offset = 0
    for size in sizes:
        window = slice(offset, offset + size)
        pieces.append({key: value[window] for key, value in batch.items()})
        offset += size
    return pieces


# --- the aggregator ---------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, *, allow_minus_one: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value >= 1 or (allow_minus_one and value == -1):
        return
    hint = "a positive integer, or -1 to take everything once" if allow_minus_one else "a positive integer"
    raise ValueError(f"{name} must be {hint}, got {value}")


@dataclass(frozen=True, slots=True)
class AggregationConfig:
    """How a round is aggregated (names as in the tunix LCM aggregation).

    - ``service_target_bs``: compute as soon as the buffer holds this many *input* samples (before
      ``sample_repeat``); normally ``lcm`` of the rollout/ref/old micro-batch sizes (:meth:`from_micro_sizes`).
    - ``sample_repeat``: copies of each sample handed to ``compute`` (GRPO's ``num_generations``).
    - ``batch_repeat``: times each micro-batch is emitted (GRPO's ``num_iterations`` μ).
    - ``proceed_num_steps``: micro-batches per round (the gradient accumulation steps), or -1 for all (eval).
    """

    service_target_bs: int
    sample_repeat: int = 1
    batch_repeat: int = 1
    proceed_num_steps: int = -1

    def __post_init__(self) -> None:
        _check_int("service_target_bs", self.service_target_bs)
        _check_int("sample_repeat", self.sample_repeat)
        _check_int("batch_repeat", self.batch_repeat)
        _check_int("proceed_num_steps", self.proceed_num_steps, allow_minus_one=True)

    @classmethod
    def from_micro_sizes(
        cls, *micro_sizes: int, sample_repeat: int = 1, batch_repeat: int = 1, proceed_num_steps: int = -1
    ) -> AggregationConfig:
        """``service_target_bs = lcm(*micro_sizes)`` (rollout, ref logps, old logps micro-batch sizes)."""
        return cls(lcm(*micro_sizes), sample_repeat, batch_repeat, proceed_num_steps)


@dataclass(frozen=True, slots=True)
class ServiceCall:
    """One ``compute`` call: how many input samples (before ``sample_repeat``) and micro-batches it merged,
    and whether it was the forced tail of a round (short of ``service_target_bs``)."""

    samples: int
    micro_batches: int
    forced: bool


class Aggregator:
    """Runs rounds for one ``compute`` function and one :class:`AggregationConfig`, and keeps count.

    ``calls`` records every ``compute`` call (:class:`ServiceCall`), so one call per service batch can be
    checked; ``dropped`` counts the micro-batches of partial rounds dropped at the end of the data.
    Not thread-safe: use it from one thread at a time (the :class:`BackgroundProducer` thread, say).
    """

    def __init__(self, compute: Compute, config: AggregationConfig) -> None:
        self.compute = compute
        self.config = config
        self.calls: list[ServiceCall] = []
        self.dropped = 0

    @property
    def compute_calls(self) -> int:
        """How many times ``compute`` has been called."""
        return len(self.calls)

    def _flush(self, buffer: list[Mapping[str, Array]], sizes: list[int], *, forced: bool) -> list[Batch]:
        repeat = self.config.sample_repeat
        merged = repeat_samples(merge(buffer), repeat)
        self.calls.append(ServiceCall(samples=sum(sizes), micro_batches=len(sizes), forced=forced))
        result = self.compute(merged)
        expected = sum(sizes) * repeat
        if not result:
            raise ValueError("compute returned no arrays")
        for key, value in result.items():
            where = f"compute's result[{key!r}]"
            _kind(value, where)
            got = _length(value, where)
            if got != expected:
                raise ValueError(
                    f"{where} has {got} rows; expected {expected} ({sum(sizes)} merged samples × "
                    f"sample_repeat {repeat})"
                )
        return split(result, [size * repeat for size in sizes])

    def prepare_round(self, iterator: Iterator[Mapping[str, Array]]) -> list[Batch] | None:
        """Consume one round from ``iterator`` and return its batches in the order ``a a b b …``.

        Takes ``proceed_num_steps`` micro-batches (never one more), or all of them with -1. Returns ``None``
        when ``proceed_num_steps > 0`` and the iterator ends before the round is complete (the partial round
        is dropped and counted in ``dropped``); with -1 always returns a list, empty when nothing was left.
        Exceptions from the iterator or ``compute`` propagate; the round is then lost.
        """
        config = self.config
        produced: list[Batch] = []
        buffer: list[Mapping[str, Array]] = []
        sizes: list[int] = []
        consumed = 0
        while config.proceed_num_steps < 0 or consumed < config.proceed_num_steps:
            try:
                micro_batch = next(iterator)
            except StopIteration:
                if config.proceed_num_steps > 0:
                    self.dropped += consumed
                    return None
                break
            sizes.append(sample_count(micro_batch, name=f"micro-batch {consumed} of the round"))
            buffer.append(micro_batch)
            consumed += 1
            if sum(sizes) >= config.service_target_bs:
                produced.extend(self._flush(buffer, sizes, forced=False))
                buffer, sizes = [], []
        if buffer:
            produced.extend(self._flush(buffer, sizes, forced=True))
        # batch_repeat is applied here, on the whole round, so the order is a a b b whatever the service
        # batches were.
        return [batch for batch in produced for _ in range(config.batch_repeat)]


def prepare_round(
    iterator: Iterator[Mapping[str, Array]], compute: Compute, config: AggregationConfig
) -> list[Batch] | None:
    """One round with a throwaway :class:`Aggregator` (see :meth:`Aggregator.prepare_round`)."""
    return Aggregator(compute, config).prepare_round(iterator)


def _check_skip(count: object) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"skip must be an int of zero or more, got {count!r}")


def skip_micro_batches(iterator: Iterator[Any], count: int) -> int:
    """Advance ``iterator`` past ``count`` micro-batches (resume); returns how many there were to skip.

    To resume after ``R`` complete training rounds, skip ``R × proceed_num_steps`` (input micro-batches,
    before ``batch_repeat``).
    """
    _check_skip(count)
    return sum(1 for _ in itertools.islice(iterator, count))


def iter_rounds(
    iterator: Iterator[Mapping[str, Array]], aggregator: Aggregator, *, skip: int = 0
) -> Iterator[list[Batch]]:
    """The synchronous producer: skip ``skip`` micro-batches, then yield rounds until the data ends.

    Training (``proceed_num_steps > 0``) yields complete rounds only; eval (-1) yields exactly one round.
    """
    skip_micro_batches(iterator, skip)
    if aggregator.config.proceed_num_steps < 0:
        everything = aggregator.prepare_round(iterator)
        if everything is not None:  # always: -1 never reports the end of the data
            yield everything
        return
    while (round_batches := aggregator.prepare_round(iterator)) is not None:
        yield round_batches


# --- the background producer ----------------------------------------------------------------------------------


class EndOfData(NamedTuple):
    """The producer's last queue item: no more rounds; ``error`` is what stopped it, if anything did."""

    error: BaseException | None = None


QueueItem: TypeAlias = "Batch | EndOfData | None"

_POLL_S = 0.05  # how often blocked puts/gets look at the stop flag; bounds close()'s latency


class BackgroundProducer:
    """Rounds prepared on a thread while the trainer trains (tunix's ``executor.submit(_prepare_data)``).

    The thread skips ``skip`` micro-batches, then runs :func:`iter_rounds` and puts into :attr:`queue` each
    round's batches one by one followed by ``None``; after the last round it puts ``EndOfData()``, or
    ``EndOfData(error)`` when the iterator or ``compute`` raised. The queue is bounded (``maxsize`` items), so
    the producer runs at most that far ahead of the consumer.

    Consume either by iterating the producer (rounds as lists; a producer exception is re-raised here) or by
    reading :attr:`queue` directly, not both. ``close()`` (or leaving the ``with`` block) stops the thread once
    the round in flight is prepared.
    """

    def __init__(
        self,
        iterator: Iterator[Mapping[str, Array]],
        aggregator: Aggregator,
        *,
        skip: int = 0,
        maxsize: int = 64,
    ) -> None:
        _check_int("maxsize", maxsize)
        _check_skip(skip)  # now, in the caller's thread, rather than as an error at the first round
        self.aggregator = aggregator
        self._iterator = iterator
        self._skip = skip
        self._queue: queue.Queue[QueueItem] = queue.Queue(maxsize=maxsize)
        self._stop = threading.Event()
        self._end: EndOfData | None = None
        self._thread = threading.Thread(target=self._run, name="proctor-batching-producer", daemon=True)
        self._thread.start()

    @property
    def queue(self) -> queue.Queue[QueueItem]:
        """The bounded queue: batches, ``None`` after each round, one :class:`EndOfData` at the end."""
        return self._queue

    def _put(self, item: QueueItem) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
            except queue.Full:
                continue
            return True
        return False

    def _run(self) -> None:
        try:
            for round_batches in iter_rounds(self._iterator, self.aggregator, skip=self._skip):
                for batch in round_batches:
                    if not self._put(batch):
                        return
                if not self._put(None) or self._stop.is_set():
                    return
        except BaseException as error:
            # Everything, SystemExit included: a thread that dies silently would leave the consumer waiting.
            self._put(EndOfData(error))
            return
        self._put(EndOfData())

    def _get(self) -> QueueItem:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return EndOfData()
                if not self._thread.is_alive() and self._queue.empty():
                    # Unreachable unless _run itself broke; better an error than a hang.
                    return EndOfData(RuntimeError("the producer thread ended without a final EndOfData"))

    def __iter__(self) -> Iterator[list[Batch]]:
        """Rounds as lists of batches; ends at the end of the data, re-raises the producer's exception."""
        round_batches: list[Batch] = []
        while self._end is None:
            if self._stop.is_set():
                return
            item = self._get()
            if item is None:
                yield round_batches
                round_batches = []
            elif isinstance(item, EndOfData):
                self._end = item
            else:
                round_batches.append(item)
        if self._end.error is not None:
            raise self._end.error

    def close(self, timeout: float | None = None) -> None:
        """Stop the producer, wait for its thread (up to ``timeout`` seconds) and drop what it had queued.

        The round in flight, if any, is prepared to its end first (its ``compute`` calls included: a thread
        cannot be interrupted), then dropped. Iterating a closed producer yields nothing more.
        """
        self._stop.set()
        self._thread.join(timeout)
        # Queued rounds hold the service batches' results; nobody will read them now.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    @property
    def running(self) -> bool:
        """Whether the producer thread is still alive."""
        return self._thread.is_alive()

    def __enter__(self) -> BackgroundProducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
