"""``RemoteRLDataset``: the dataserver's curriculum as the ``train_dataset`` of TRL's ``GRPOTrainer``.

How TRL 1.16 reads a dataset (measured on TRL 1.16; ``tests/client/test_layout.py`` replays its sampler), with B
the per-device batch (completions), P the processes, S ``steps_per_generation``, G ``num_generations``, μ
``num_iterations``:

- One *generation step* consumes ``U = B·P·S / G`` distinct prompts (``generation_batch_size / G``).
- With ``shuffle_dataset=False`` the ``RepeatSampler`` walks indices in order, each index repeated G times
  in a row, so generation step ``g`` reads indices ``g·U … g·U + U − 1``: ``step = index // U`` and
  ``slot = index % U``. This module is the one place that arithmetic lives.
- Process ``r`` receives the ``r``-th block of ``B·S`` rows of each step's ``B·P·S`` rows, and every index is
  fetched ``G·S·μ`` times (plus the loader's look-ahead). So all processes ask for the same step, and each
  step costs one ``/sample`` per process: the answer is cached per step (bounded) and the next step is
  prefetched in the background, so a training step never waits on the network for its prompts.

The dataset is a real ``datasets.Dataset`` (an index column with a transform that fetches a whole loader
batch in one call), so it works with the stock ``GRPOTrainer`` as well as with proctor's subclass.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow as pa

from proctor.client.http import ProctorClient
from proctor.wire.dataserver import Sample

__all__ = ["GenerationLayout", "RemoteRLDataset"]


# Generation steps remote_reward prefetches once a step is graded (_StepFetcher.prefetch_after).
PREFETCH_DEPTH = 2


@dataclass(frozen=True, slots=True)
class GenerationLayout:
    """Where TRL's sampler indices land: which generation step, which prompt slot, which group member."""

    per_device_batch_size: int
    num_processes: int
    steps_per_generation: int
    num_generations: int
    process_index: int = 0

    def __post_init__(self) -> None:
        for name in ("per_device_batch_size", "num_processes", "steps_per_generation", "num_generations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        total = self.per_device_batch_size * self.num_processes * self.steps_per_generation
        if total % self.num_generations:
            raise ValueError(
                f"the generation batch ({self.per_device_batch_size} per device × {self.num_processes} processes × "
                f"{self.steps_per_generation} steps_per_generation = {total}) is not a multiple of "
                f"num_generations={self.num_generations}; change one of them"
            )
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"process_index {self.process_index} is outside 0..{self.num_processes - 1}")

    @property
    def prompts_per_generation(self) -> int:
        """U: distinct prompts in one generation step, across all processes."""
        return self.per_device_batch_size * self.num_processes * self.steps_per_generation // self.num_generations

    @property
    def rows_per_process(self) -> int:
        """Rows of one loader batch on one process (B·S)."""
        return self.per_device_batch_size * self.steps_per_generation

    def locate(self, index: int) -> tuple[int, int]:
        """``(generation step, prompt slot)`` of a sampler index."""
        return divmod(index, self.prompts_per_generation)

    def completion_index(self, position: int) -> int:
        """Which of its prompt's G completions the row at ``position`` of this process's loader batch is.

        A step's rows are G copies of each prompt in a row, cut into per-process blocks of B·S rows, so a
        group may span two processes; counting from the start of the step keeps the numbering global.
        """
        return (self.process_index * self.rows_per_process + position) % self.num_generations

    @classmethod
    def from_args(
        cls, args: Any, *, num_processes: int | None = None, process_index: int | None = None
    ) -> GenerationLayout:
        """From a ``GRPOConfig`` (after its ``__post_init__``, which resolves ``steps_per_generation``)."""
        return cls(
            per_device_batch_size=args.per_device_train_batch_size,
            num_processes=num_processes if num_processes is not None else args.world_size,
            steps_per_generation=args.steps_per_generation,
            num_generations=args.num_generations,
            process_index=process_index if process_index is not None else args.process_index,
        )


class _StepFetcher:
    """Fetches generation steps from the server, one ``/sample`` per step, with a bounded cache and a
    background prefetch of the next step. Also the dataset's format transform (``__call__``)."""

    def __init__(
        self,
        client: ProctorClient,
        layout: GenerationLayout,
        total_steps: int,
        *,
        chat: bool,
        prefetch: bool,
        cache_steps: int,
    ) -> None:
        self.client = client
        self.layout = layout
        self.total_steps = total_steps
        self.chat = chat
        self.prefetch = prefetch
        # The step being read and the ones prefetched after it must fit, or a prefetch evicts the current step.
        self.cache_steps = max(1 + PREFETCH_DEPTH, cache_steps)
        self._owns_client = False
        self._start()

    def _start(self) -> None:
        # Iterations this process asked the server for, in order (one per generation step).
        self.requested: list[int] = []
        self._steps: OrderedDict[int, Future[list[Sample]]] = OrderedDict()
        self._stages: dict[int, str] = {}
        self._refill_rounds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proctor-prefetch")
        # Called in the fetch thread with each step fetched: remote_reward opens the step's table there, off the
        # training step's critical path. A copy has none (its rows are never posted).
        self.on_fetch: Callable[[int], None] | None = None

    def step_samples(self, step: int) -> list[Sample]:
        """The prompts of generation step ``step`` (one ``/sample`` per step, then from the cache)."""
        with self._lock:
            future = self._steps.get(step)
            # A failed fetch is not kept: a prefetch that ran into a server restart must not fail the step
            # for good once the server is back.
            if future is None or (future.done() and future.exception() is not None):
                future = self._submit(step)
            else:
                self._steps.move_to_end(step)
            if self.prefetch and step + 1 < self.total_steps and step + 1 not in self._steps:
                self._submit(step + 1)
        return future.result()

    def stage_of(self, step: int) -> str:
        """The stage the server served ``step`` in (``"?"`` for a step this process did not fetch)."""
        return self._stages.get(step, "?")

    def refill_rounds_of(self, step: int) -> int:
        """The refill rounds the server's stage allows ``step`` (0 for a step this process did not fetch)."""
        return self._refill_rounds.get(step, 0)

    def prefetch_after(self, step: int, depth: int = PREFETCH_DEPTH) -> None:
        """Start fetching the ``depth`` steps after ``step`` that are not cached yet.

        :func:`~proctor.client.remote_reward` calls this once a generation batch's rewards have arrived: the
        server answers it while the trainer computes the loss, not beside the grading the trainer waits for,
        and the fetch stays out of generation, where it would contend with the training loop for the GIL.
        """
        with self._lock:
            for ahead in range(step + 1, min(step + 1 + depth, self.total_steps)):
                if ahead not in self._steps:
                    self._submit(ahead)

    def _submit(self, step: int) -> Future[list[Sample]]:
        future = self._pool.submit(self._download, step)
        self._steps[step] = future
        while len(self._steps) > self.cache_steps:
            self._steps.popitem(last=False)
        return future

    def _download(self, step: int) -> list[Sample]:
        self.requested.append(step)
        response = self.client.sample(step, self.layout.prompts_per_generation)
        if len(response.samples) != self.layout.prompts_per_generation:
            raise RuntimeError(
                f"/sample for iteration {step} returned {len(response.samples)} prompts, "
                f"expected {self.layout.prompts_per_generation}"
            )
        self._stages[step] = response.stage
        self._refill_rounds[step] = response.refill_rounds
        if self.on_fetch is not None:
            self.on_fetch(step)
        return response.samples

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """The format transform: one loader batch of indices → its rows, fetching whole steps."""
        out: dict[str, list[Any]] = {
            "prompt": [],
            "sample_id": [],
            "slot": [],
            "completion_index": [],
            "iteration": [],
            "stage": [],
            "dataset_id": [],
            "metadata": [],
        }
        steps: dict[int, list[Sample]] = {}  # a loader batch spans one or two steps: look each up once
        for position, index in enumerate(batch["index"]):
            step, slot = self.layout.locate(int(index))
            if step not in steps:
                steps[step] = self.step_samples(step)
            sample = steps[step][slot]
            out["prompt"].append(self.prompt(sample))
            out["sample_id"].append(sample.sample_id)
            out["slot"].append(sample.slot)
            out["completion_index"].append(self.layout.completion_index(position))
            out["iteration"].append(step)
            out["stage"].append(self.stage_of(step))
            out["dataset_id"].append(sample.dataset_id)
            out["metadata"].append(sample.metadata)
        return out

    def prompt(self, sample: Sample) -> Any:
        """A sample's prompt as a row's ``prompt``: chat messages, or the text with its system prompt."""
        system = (sample.system_prompt or "").strip()
        if self.chat:
            messages = [{"role": "system", "content": system}] if system else []
            return [*messages, {"role": "user", "content": sample.prompt}]
        return f"{system}\n\n{sample.prompt}" if system else sample.prompt

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_client:
            self.client.close()

    def __getstate__(self) -> dict[str, Any]:
        # The cache, lock and thread are per process; a copy (a DataLoader worker, or `datasets` hashing
        # the transform for its fingerprint) starts its own.
        keep = ("client", "layout", "total_steps", "chat", "prefetch", "cache_steps")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._owns_client = True  # the unpickled client is this copy's own
        self._start()


class RemoteRLDataset(datasets.Dataset):
    """The curriculum's prompts, addressed the way ``GRPOTrainer`` reads them.

    Args:
        client: a :class:`ProctorClient` for the dataserver.
        args: the ``GRPOConfig`` of the run; must have ``shuffle_dataset=False``.
        processing_class: the tokenizer; prompts are conversational (system + user messages) when it has a
            chat template, plain text otherwise. ``chat`` overrides that choice.
        num_processes, process_index: default to the run's (``args.world_size`` / ``args.process_index``).
        prefetch: fetch the next generation step in the background as soon as a step is first read. Pass
            the dataset to :func:`~proctor.client.remote_reward` instead, which prefetches while the server
            grades (cheaper: no contention with generation); it turns this one off.
        cache_steps: generation steps kept in memory (at least 3: the current one and two prefetched).

    Each row carries ``prompt``, ``sample_id``, ``slot`` (the prompt's place in its step's batch, which tells
    apart two slots of one record), ``completion_index`` (which of the prompt's G completions the row will
    become), ``iteration`` (the generation step), ``stage``, ``dataset_id`` and ``metadata``;
    TRL hands these columns to the reward functions.
    """

    def __init__(
        self,
        client: ProctorClient,
        args: Any,
        *,
        processing_class: Any = None,
        chat: bool | None = None,
        num_processes: int | None = None,
        process_index: int | None = None,
        prefetch: bool = True,
        cache_steps: int = 8,
    ) -> None:
        if getattr(args, "shuffle_dataset", False):
            raise ValueError(
                "RemoteRLDataset serves prompts in curriculum order, so TRL must not shuffle them: "
                "set GRPOConfig(shuffle_dataset=False)"
            )
        if getattr(args, "max_steps", -1) <= 0 and getattr(args, "num_train_epochs", 1) != 1:
            raise ValueError(
                "the curriculum is one pass over its iterations; a second epoch would replay it from iteration 0: "
                f"set GRPOConfig(max_steps=...) or num_train_epochs=1 (got num_train_epochs={args.num_train_epochs})"
            )
        layout = GenerationLayout.from_args(args, num_processes=num_processes, process_index=process_index)
        self.meta = client.meta()
        if chat is None:
            chat = bool(getattr(processing_class, "chat_template", None))
        self.fetcher = _StepFetcher(
            client, layout, self.meta.total_iterations, chat=chat, prefetch=prefetch, cache_steps=cache_steps
        )
        n = self.meta.total_iterations * layout.prompts_per_generation
        table = datasets.table.InMemoryTable(pa.table({"index": pa.array(range(n), type=pa.int64())}))
        # An explicit fingerprint: `datasets` would otherwise hash this object, client and threads included.
        fingerprint = f"proctor-{self.meta.curriculum_hash}-{layout.prompts_per_generation}-{n}"
        super().__init__(table, fingerprint=fingerprint)
        self.set_transform(self.fetcher)

    @property
    def client(self) -> ProctorClient:
        return self.fetcher.client

    @property
    def layout(self) -> GenerationLayout:
        return self.fetcher.layout

    @property
    def requested(self) -> list[int]:
        """Iterations this process fetched from the server, in order (one per generation step)."""
        return self.fetcher.requested

    def step_samples(self, step: int) -> list[Sample]:
        return self.fetcher.step_samples(step)

    def stage_of(self, step: int) -> str:
        return self.fetcher.stage_of(step)

    def refill_rounds(self, step: int) -> int:
        """The refill rounds the server allows ``step`` (``/sample``'s ``refill_rounds``)."""
        return self.fetcher.refill_rounds_of(step)

    def row(self, sample: Sample, like: dict[str, Any]) -> dict[str, Any]:
        """The row ``like`` (a row of this dataset) with ``sample`` in place of its prompt: what a refill puts in
        the row of a replaced group."""
        return {
            **like,
            "prompt": self.fetcher.prompt(sample),
            "sample_id": sample.sample_id,
            "slot": sample.slot,
            "dataset_id": sample.dataset_id,
            "metadata": sample.metadata,
        }

    def close(self) -> None:
        """Stop the prefetch thread (the client belongs to the caller)."""
        self.fetcher.close()

    def __repr__(self) -> str:
        return (
            f"RemoteRLDataset(server={self.client.base_url!r}, curriculum={self.meta.curriculum!r}, "
            f"steps={self.meta.total_iterations}, prompts_per_step={self.layout.prompts_per_generation}, "
            f"rows={len(self)})"
        )
