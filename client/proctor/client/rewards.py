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

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from proctor.client.experience import ExperienceClient
from proctor.client.http import ProctorClient
from proctor.errors import ProctorError
from proctor.experience import CellConflictError, CellsMissingError, RowKey, UnknownIterationError
from proctor.experience import columns as col
from proctor.wire.dataserver import GradeItem, JudgeGraderSpec, LocalGraderSpec, RemoteGraderSpec

if TYPE_CHECKING:
    from proctor.client.dataset import RemoteRLDataset

__all__ = ["GraderReward", "RemoteReward", "remote_reward"]

_WAIT_S = 10.0  # longest a read of rewards not yet written is held by the server

# One completion's reward, the score of each grader that gave one, and the failure, if any.
_Grade = tuple[float, Mapping[str, float], str | None]


@overload
def remote_reward(
    client: ProctorClient,
    *,
    on_error: Literal["skip", "server"] = "skip",
    dataset: RemoteRLDataset | None = None,
    through: Literal["store", "grade"] | None = None,
    timeout_s: float = 600.0,
    components: Literal[False] = False,
) -> RemoteReward: ...


@overload
def remote_reward(
    client: ProctorClient,
    *,
    on_error: Literal["skip", "server"] = "skip",
    dataset: RemoteRLDataset | None = None,
    through: Literal["store", "grade"] | None = None,
    timeout_s: float = 600.0,
    components: Literal[True],
) -> list[GraderReward]: ...


def remote_reward(
    client: ProctorClient,
    *,
    on_error: Literal["skip", "server"] = "skip",
    dataset: RemoteRLDataset | None = None,
    through: Literal["store", "grade"] | None = None,
    timeout_s: float = 600.0,
    components: bool = False,
) -> RemoteReward | list[GraderReward]:
    """A reward function for ``GRPOTrainer(reward_funcs=...)`` backed by the dataserver's graders; with
    ``components=True``, one reward function per grader (:meth:`RemoteReward.components`).

    ``through`` picks the way: ``"store"`` (the default with ``dataset``, which it needs for the step's
    layout) or ``"grade"`` (the default without). With ``dataset`` (the run's
    :class:`~proctor.client.RemoteRLDataset`), the prompts of the next steps are fetched once this step's
    rewards have arrived, while the trainer computes the loss (beside the grading, they would delay the
    rewards the trainer waits for; during generation, they would compete with it for the interpreter), and
    each step's table is opened as its prompts arrive. ``timeout_s`` bounds the wait for the store's rewards.

    Needs the ``sample_id``, ``slot``, ``completion_index`` and ``iteration`` columns that
    :class:`~proctor.client.RemoteRLDataset` provides. Logs each grader's mean (``proctor/<grader>``), the
    number of failed gradings (``proctor/grading_errors``) and the generation step (``proctor/iteration``)
    through TRL's ``log_metric``.
    """
    reward = RemoteReward(client, on_error=on_error, dataset=dataset, through=through, timeout_s=timeout_s)
    return reward.components() if components else reward


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
        # The grades of the latest call's rows: the reward functions of components() share one fetch a step.
        self._last: tuple[tuple[Any, ...], list[_Grade]] | None = None
        self._tables = threading.Lock()  # _opened and _outside, also written by the dataset's fetch thread
        if dataset is not None:
            dataset.fetcher.prefetch = False  # prefetching moves here, after the wait for the graders
            if through == "store":
                dataset.fetcher.on_fetch = self._open_ahead

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
        for step, (keys, columns) in self._unposted(inputs, completions, completion_ids).items():
            self._put(step, keys, columns)

    def _unposted(
        self,
        inputs: Sequence[Mapping[str, Any]],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None,
    ) -> dict[int, tuple[list[RowKey], dict[str, list[Any]]]]:
        """Per step whose table is kept (and opened), the rows of ``inputs`` not posted yet and their columns."""
        by_step: defaultdict[int, list[int]] = defaultdict(list)
        for j, row in enumerate(inputs):
            by_step[int(row["iteration"])].append(j)
        assert self.dataset is not None
        batch = self.dataset.layout.prompts_per_generation
        unposted: dict[int, tuple[list[RowKey], dict[str, list[Any]]]] = {}
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
            unposted[step] = ([rows[n] for n in fresh], columns)
        if by_step:
            for step in [s for s in self._posted if s < max(by_step) - 8]:
                del self._posted[step]  # old steps are never posted again: keep memory bounded
                self._again.pop(step, None)
        return unposted

    def _put(
        self, step: int, keys: list[RowKey], columns: dict[str, list[Any]], *, read: Sequence[str] = ()
    ) -> dict[str, list[Any]] | None:
        """Write the rows' columns. With ``read``, the same request waits (a few seconds at most) for those columns
        of the rows and returns them: None when they are not all written by then, or when some rows hold another
        attempt's completions."""
        values = None
        try:
            if read:
                values = self.experience.put_and_read(step, keys, columns, read, wait_s=min(self.timeout_s, _WAIT_S))
            else:
                self.experience.put(step, keys, columns)
        except CellsMissingError:
            pass  # written, not graded yet: the caller's read waits on
        except CellConflictError:
            # The step was generated again (a run resumed mid-generation): rows that hold the first
            # attempt's completions keep them, and the new ones are graded as loose completions.
            again = self._held_by_others(step, keys, columns[col.COMPLETION])
            keep = [m for m, key in enumerate(keys) if key not in again]
            if keep:
                kept = {name: [cells[m] for m in keep] for name, cells in columns.items()}
                self.experience.put(step, [keys[m] for m in keep], kept)
            self._again[step].update(again)
        self._posted[step].update(keys)
        return values

    def _held_by_others(self, step: int, rows: Sequence[RowKey], texts: Sequence[str]) -> set[RowKey]:
        """Those of ``rows`` that already hold another completion than ``texts``."""
        held = self.experience.read(step, rows, (col.COMPLETION,), missing="none")[col.COMPLETION]
        return {row for row, was, now in zip(rows, held, texts, strict=True) if was is not None and was != now}

    def _open(self, step: int) -> bool:
        """Open the step's table; False when the store no longer keeps it (a step older than every table kept:
        its completions are graded through /grade instead)."""
        with self._tables:
            if step in self._opened:
                return True
            if step in self._outside:
                return False
        assert self.dataset is not None
        layout = self.dataset.layout
        try:
            self.experience.open(step, slots=layout.prompts_per_generation, group_size=layout.num_generations)
        except UnknownIterationError:
            self._remember(self._outside, step)
            return False
        self._remember(self._opened, step)
        return True

    def _remember(self, steps: set[int], step: int) -> None:
        """Add ``step`` to ``steps`` (``_opened`` or ``_outside``), which keep the latest 64 steps."""
        with self._tables:
            steps.add(step)
            if len(steps) > 64:
                steps.discard(min(steps))

    def _open_ahead(self, step: int) -> None:
        """Open a step's table as the dataset fetches its prompts, so that posting its completions is one
        request. A failure here is not the step's: the post opens the table again."""
        with contextlib.suppress(ProctorError):
            self._open(step)

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
        return [_grade_of(r, d) for r, d in zip(values[col.REWARD], values[col.REWARD_DETAIL], strict=True)]

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
        grades = self.grades(
            completions,
            completion_ids,
            sample_id=sample_id,
            slot=slot,
            completion_index=completion_index,
            iteration=iteration,
            log_metric=log_metric,
        )
        if self.on_error == "server":
            return [reward for reward, _, _ in grades]
        return [reward if error is None else None for reward, _, error in grades]

    def components(self) -> list[GraderReward]:
        """One TRL reward function per grader of the curriculum's sources (``GET /graders``), named after it, in
        the curriculum's order; a row whose source has no such grader, or whose grading failed, gets ``None``.
        All of them read one fetch of grades a step: the first to be called makes it, the others reuse it."""
        if self.on_error != "skip":
            raise ValueError(
                "remote_reward(components=True) gives each grader's own score, and a failed grading has none: "
                "use on_error='skip' (the row is left out of the advantages)"
            )
        weights: dict[str, set[float | None]] = {}
        for spec in self.client.graders().sources.values():
            every: list[LocalGraderSpec | RemoteGraderSpec | JudgeGraderSpec] = [
                *spec.local,
                *spec.remote,
                *spec.judges,
            ]
            total = sum(g.weight for g in every if not g.multiplicative)
            for g in every:
                share = None if g.multiplicative or total <= 0 else g.weight / total
                weights.setdefault(g.key, set()).add(share)
        return [GraderReward(self, name, next(iter(w)) if len(w) == 1 else None) for name, w in weights.items()]

    def grades(
        self,
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        *,
        sample_id: Sequence[str] | None,
        slot: Sequence[int] | None,
        completion_index: Sequence[int] | None,
        iteration: Sequence[int] | None,
        log_metric: Callable[[str, float], None] | None = None,
        **_: Any,
    ) -> list[_Grade]:
        """Each completion's ``(reward, score by grader, error)``. A repeated call with the same rows (the
        components' reward functions, one after another) reuses the first call's grades."""
        if sample_id is None or slot is None or completion_index is None or iteration is None:
            raise TypeError(
                "remote_reward needs the sample_id, slot, completion_index and iteration columns of each row; "
                "train on a proctor.client.RemoteRLDataset"
            )
        key = (tuple(iteration), tuple(slot), tuple(completion_index), tuple(map(_text, completions)))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        grades = self._fetch(completions, completion_ids, sample_id, slot, completion_index, iteration, log_metric)
        self._last = (key, grades)
        return grades

    def _fetch(
        self,
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None,
        sample_id: Sequence[str],
        slot: Sequence[int],
        completion_index: Sequence[int],
        iteration: Sequence[int],
        log_metric: Callable[[str, float], None] | None,
    ) -> list[_Grade]:
        by_step: defaultdict[int, list[int]] = defaultdict(list)
        for j, step in enumerate(iteration):
            by_step[int(step)].append(j)
        answered: dict[int, dict[RowKey, _Grade]] = {}
        if self.through == "store":
            rows = [
                {"iteration": iteration[j], "slot": slot[j], "completion_index": completion_index[j]}
                for j in range(len(completions))
            ]
            # What the trainer posted already is not posted again; the rest is written with its grades read back.
            for step, (keys, columns) in self._unposted(rows, completions, completion_ids).items():
                cells = self._put(step, keys, columns, read=(col.REWARD, col.REWARD_DETAIL))
                if cells is not None:
                    answered[step] = dict(
                        zip(keys, map(_grade_of, cells[col.REWARD], cells[col.REWARD_DETAIL]), strict=True)
                    )
        grades: list[_Grade | None] = [None] * len(completions)
        for step, positions in by_step.items():
            again = self._again.get(step, set())
            stored = [j for j in positions if (int(slot[j]), int(completion_index[j])) not in again]
            if step in self._outside:
                stored = []
            if self.through == "store" and stored:
                keys = [(int(slot[j]), int(completion_index[j])) for j in stored]
                have = answered.get(step, {})
                found = [have[k] for k in keys] if all(k in have for k in keys) else self._collect(step, keys)
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

        if self.dataset is not None:
            self.dataset.fetcher.prefetch_after(max(by_step))
        done: list[_Grade] = []
        components: defaultdict[str, list[float]] = defaultdict(list)
        for grade in grades:
            assert grade is not None  # every position belongs to one step
            done.append(grade)
            for grader, score in grade[1].items():
                components[grader].append(score)
        if log_metric is not None:
            for grader, values in sorted(components.items()):
                log_metric(f"proctor/{grader}", sum(values) / len(values))
            log_metric("proctor/grading_errors", float(sum(error is not None for _, _, error in done)))
            if len(by_step) == 1:
                log_metric("proctor/iteration", float(next(iter(by_step))))
        return done


class GraderReward:
    """One grader's score as a TRL reward function (see :meth:`RemoteReward.components`), named after the
    grader. ``weight`` is its share of the reward the dataserver composes (its weight over the sum of the
    additive graders' weights), the same in every source that uses it; None where the sources disagree or the
    grader is multiplicative (a product, which no weighted sum expresses)."""

    def __init__(self, shared: RemoteReward, grader: str, weight: float | None) -> None:
        self.shared = shared
        self.grader = grader
        self.weight = weight
        self.__name__ = grader  # TRL names a reward function's metrics after it

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        """TRL's call, as :class:`RemoteReward`'s (the same columns); this grader's score of each completion."""
        grades = self.shared.grades(completions, completion_ids, **columns)
        return [None if error is not None else scores.get(self.grader) for _, scores, error in grades]

    def __repr__(self) -> str:
        return f"GraderReward({self.grader!r}, weight={self.weight})"


def _text(completion: Any) -> str:
    """A completion as text: TRL passes a string, or for conversational prompts a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")


def _grade_of(reward: Any, detail: Any) -> _Grade:
    """A grade from its row's ``reward`` and ``reward_detail`` cells."""
    parts = col.parse_reward_detail(detail)
    return (float(reward), parts.components, parts.error)
