"""``remote_reward``: a ``GRPOTrainer`` reward function that grades on the dataserver.

TRL calls a reward function once per generation batch with this process's completions and the dataset's
columns as keyword lists. Rewards are matched by ``(slot, completion_index)``: a record that a small source
had to serve twice in one step is two prompts, each graded on its own. It never invents a reward: a failed
call raises (after the client's retries), and a completion whose grading failed on the server becomes
``None``, which TRL leaves out of the advantage, unless ``on_error="server"`` asks for the source's
``on_error`` reward instead.

Two ways to the graders:

- **through the experience store** (with ``dataset``, the default then): the completions are written to
  the step's table as soon as generation ends (:class:`~proctor.client.ProctorGRPOTrainer` calls
  :meth:`RemoteReward.post`; under a stock ``GRPOTrainer`` the reward call posts them itself), the grader
  role grades them meanwhile, and the reward call collects the rewards. TRL computes the old-policy and
  reference log-probs between the two, so grading overlaps those passes.
- **through ``/grade``**: one request per generation step, answered when every completion is graded.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from proctor.client.experience import ExperienceClient
from proctor.client.http import ProctorClient
from proctor.experience import CellConflictError, CellsMissingError, RowKey, UnknownIterationError
from proctor.experience import columns as col
from proctor.wire.dataserver import GradeItem

if TYPE_CHECKING:
    from proctor.client.dataset import RemoteRLDataset

__all__ = ["RemoteReward", "remote_reward"]

_WAIT_S = 10.0  # longest a read of rewards not yet written is held by the server

# One completion's reward, the score of each grader that gave one, and the failure, if any.
_Grade = tuple[float, Mapping[str, float], str | None]


def remote_reward(
    client: ProctorClient,
    *,
    on_error: Literal["skip", "server"] = "skip",
    dataset: RemoteRLDataset | None = None,
    through: Literal["store", "grade"] | None = None,
    timeout_s: float = 600.0,
) -> RemoteReward:
    """A reward function for ``GRPOTrainer(reward_funcs=...)`` backed by the dataserver's graders.

    ``through`` picks the way: ``"store"`` (the default with ``dataset``, which it needs for the step's
    layout) or ``"grade"`` (the default without). With ``dataset`` (the run's
    :class:`~proctor.client.RemoteRLDataset`), the prompts of the next steps are fetched while the server
    grades this one: the trainer is waiting then anyway, whereas a prefetch during generation competes with
    it for the interpreter. ``timeout_s`` bounds the wait for the store's rewards.

    Needs the ``sample_id``, ``slot``, ``completion_index`` and ``iteration`` columns that
    :class:`~proctor.client.RemoteRLDataset` provides. Logs each grader's mean (``proctor/<grader>``), the
    number of failed gradings (``proctor/grading_errors``) and the generation step (``proctor/iteration``)
    through TRL's ``log_metric``.
    """
    return RemoteReward(client, on_error=on_error, dataset=dataset, through=through, timeout_s=timeout_s)


class RemoteReward:
    """The reward function :func:`remote_reward` returns (see there)."""

    __name__ = "proctor_reward"  # TRL names a reward function's metrics after it

    def __init__(
        self,
        client: ProctorClient,
        *,
        on_error: Literal["skip", "server"] = "skip",
        dataset: RemoteRLDataset | None = None,
        through: Literal["store", "grade"] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if on_error not in ("skip", "server"):
            raise ValueError(f"on_error must be 'skip' or 'server', got {on_error!r}")
        through = through or ("store" if dataset is not None else "grade")
        if through not in ("store", "grade"):
            raise ValueError(f"through must be 'store' or 'grade', got {through!r}")
        if through == "store" and dataset is None:
            raise ValueError(
                "remote_reward(through='store') needs dataset=, the run's RemoteRLDataset: it gives each step's "
                "table its shape (prompts × num_generations)"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.client = client
        self.on_error = on_error
        self.dataset = dataset
        self.through = through
        self.timeout_s = timeout_s
        self.experience = ExperienceClient(client=client)
        self._opened: set[int] = set()
        self._posted: dict[int, set[RowKey]] = defaultdict(set)
        # Rows graded through /grade, as loose completions of their step: those whose step was generated again
        # (a run resumed mid-generation; the table holds the first attempt's completions), and a refill's slots
        # past the step's batch (the table has none).
        self._again: dict[int, set[RowKey]] = defaultdict(set)
        self._outside: set[int] = set()  # steps whose tables the store no longer keeps
        if dataset is not None:
            dataset.fetcher.prefetch = False  # prefetching moves here, next to the wait for the graders

    # --- the store's way ------------------------------------------------------------------------------------

    def post(
        self,
        inputs: Sequence[Mapping[str, Any]],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Write this process's completions of a generation batch to their steps' tables, for the grader role.

        ``inputs`` are TRL's rows (with the dataset's ``iteration``, ``slot`` and ``completion_index``). A
        completion posted again is a no-op; a no-op too under ``through="grade"``.
        """
        if self.through != "store":
            return
        by_step: defaultdict[int, list[int]] = defaultdict(list)
        for j, row in enumerate(inputs):
            by_step[int(row["iteration"])].append(j)
        assert self.dataset is not None
        batch = self.dataset.layout.prompts_per_generation
        for step, positions in by_step.items():
            rows = [(int(inputs[j]["slot"]), int(inputs[j]["completion_index"])) for j in positions]
            self._again[step].update(row for row in rows if row[0] >= batch)
            fresh = [n for n, row in enumerate(rows) if row not in self._posted[step] and row[0] < batch]
            if not fresh:
                continue
            if not self._open(step):
                continue
            columns: dict[str, list[Any]] = {
                col.COMPLETION: [_text(completions[positions[n]]) for n in fresh],
                col.COMPLETION_TOKENS: [
                    None if completion_ids is None else len(completion_ids[positions[n]]) for n in fresh
                ],
            }
            if completion_ids is not None:
                columns[col.COMPLETION_IDS] = [np.asarray(completion_ids[positions[n]], np.int32) for n in fresh]
            keys = [rows[n] for n in fresh]
            try:
                self.experience.put(step, keys, columns)
            except CellConflictError:
                # The step was generated again (a run resumed mid-generation): rows that hold the first
                # attempt's completions keep them, and the new ones are graded as loose completions.
                again = self._held_by_others(step, keys, columns[col.COMPLETION])
                keep = [m for m, key in enumerate(keys) if key not in again]
                if keep:
                    self.experience.put(
                        step, [keys[m] for m in keep], {k: [v[m] for m in keep] for k, v in columns.items()}
                    )
                self._again[step].update(again)
            self._posted[step].update(rows[n] for n in fresh)
        for step in [s for s in self._posted if s < max(by_step) - 8]:
            del self._posted[step]  # old steps are never posted again: keep memory bounded
            self._again.pop(step, None)

    def _held_by_others(self, step: int, rows: Sequence[RowKey], texts: Sequence[str]) -> set[RowKey]:
        """Those of ``rows`` that already hold another completion than ``texts``."""
        held = self.experience.read(step, rows, (col.COMPLETION,), missing="none")[col.COMPLETION]
        return {row for row, was, now in zip(rows, held, texts, strict=True) if was is not None and was != now}

    def _open(self, step: int) -> bool:
        """Open the step's table; False when the store no longer keeps it (a step older than every table kept:
        its completions are graded through /grade instead)."""
        if step in self._opened:
            return True
        if step in self._outside:
            return False
        assert self.dataset is not None
        layout = self.dataset.layout
        try:
            self.experience.open(step, slots=layout.prompts_per_generation, group_size=layout.num_generations)
        except UnknownIterationError:
            self._outside.add(step)
            if len(self._outside) > 64:
                self._outside.discard(min(self._outside))
            return False
        self._opened.add(step)
        if len(self._opened) > 64:
            self._opened.discard(min(self._opened))
        return True

    def _collect(self, step: int, rows: Sequence[RowKey]) -> list[_Grade]:
        """The grades of ``rows``, once the grader role has written them all: the server holds the read until
        they are (up to a few seconds a request, so that a read never outlives the connection's timeout)."""
        deadline = time.monotonic() + self.timeout_s
        names = (col.REWARD, col.REWARD_DETAIL)
        while True:
            left = deadline - time.monotonic()
            try:
                values = self.experience.read(step, rows, names, wait_s=max(0.0, min(left, _WAIT_S)))
                break
            except CellsMissingError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"completions of iteration {step} were not graded within {self.timeout_s:g}s; is a "
                        "grader role running (the server's grader processes, or `proctor grade-worker --server "
                        "URL` when PROCTOR_GRADER_WORKERS=0)?"
                    ) from None
        grades: list[_Grade] = []
        for reward, detail in zip(values[col.REWARD], values[col.REWARD_DETAIL], strict=True):
            grades.append((float(reward), *col.parse_reward_detail(detail)))
        return grades

    # --- /grade's way ---------------------------------------------------------------------------------------

    def _grade(self, step: int, items: Sequence[GradeItem]) -> list[_Grade]:
        by_key = {(r.slot, r.completion_index): r for r in self.client.grade(items, iteration=step).results}
        grades: list[_Grade] = []
        for item in items:
            r = by_key.get((item.slot, item.completion_index or 0))
            if r is None:
                raise RuntimeError(
                    f"/grade returned no result for slot {item.slot} ({item.sample_id!r}), completion "
                    f"{item.completion_index} of iteration {step}; the server and client disagree on the protocol"
                )
            grades.append((r.reward, r.components, r.error))
        return grades

    # --- TRL's call -----------------------------------------------------------------------------------------

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        *,
        sample_id: Sequence[str] | None = None,
        slot: Sequence[int] | None = None,
        completion_index: Sequence[int] | None = None,
        iteration: Sequence[int] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        **_: Any,
    ) -> list[float | None]:
        if sample_id is None or slot is None or completion_index is None or iteration is None:
            raise TypeError(
                "remote_reward needs the sample_id, slot, completion_index and iteration columns of each row; "
                "train on a proctor.client.RemoteRLDataset"
            )
        by_step: defaultdict[int, list[int]] = defaultdict(list)
        for j, step in enumerate(iteration):
            by_step[int(step)].append(j)
        if self.through == "store":
            rows = [
                {"iteration": iteration[j], "slot": slot[j], "completion_index": completion_index[j]}
                for j in range(len(completions))
            ]
            self.post(rows, completions, completion_ids)  # a no-op for what the trainer posted already
        if self.dataset is not None:
            self.dataset.fetcher.prefetch_after(max(by_step))
        grades: list[_Grade | None] = [None] * len(completions)
        for step, positions in by_step.items():
            again = self._again.get(step, set())
            stored = [j for j in positions if (int(slot[j]), int(completion_index[j])) not in again]
            if step in self._outside:
                stored = []
            if self.through == "store" and stored:
                found = self._collect(step, [(int(slot[j]), int(completion_index[j])) for j in stored])
                for j, got in zip(stored, found, strict=True):
                    grades[j] = got
                positions = [j for j in positions if (int(slot[j]), int(completion_index[j])) in again]
            if positions:
                items = [
                    GradeItem(
                        sample_id=sample_id[j],
                        slot=int(slot[j]),
                        completion=_text(completions[j]),
                        completion_tokens=len(completion_ids[j]) if completion_ids is not None else None,
                        completion_index=int(completion_index[j]),
                    )
                    for j in positions
                ]
                for j, got in zip(positions, self._grade(step, items), strict=True):
                    grades[j] = got

        rewards: list[float | None] = []
        components: defaultdict[str, list[float]] = defaultdict(list)
        errors = 0
        for grade in grades:
            assert grade is not None  # every position belongs to one step
            reward, scores, error = grade
            if error is not None:
                errors += 1
                rewards.append(reward if self.on_error == "server" else None)
            else:
                rewards.append(reward)
            for grader, score in scores.items():
                components[grader].append(score)
        if log_metric is not None:
            for grader, values in sorted(components.items()):
                log_metric(f"proctor/{grader}", sum(values) / len(values))
            log_metric("proctor/grading_errors", float(errors))
            if len(by_step) == 1:
                log_metric("proctor/iteration", float(next(iter(by_step))))
        return rewards


def _text(completion: Any) -> str:
    """A completion as text: TRL passes a string, or for conversational prompts a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")
