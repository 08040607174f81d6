"""A run's stage history carried to another server: ``proctor serve --transitions FILE``.

A batch is a pure function of the iteration and the stage history, and the history holds the one thing a
fresh server cannot recompute: which gates fired, and when (they depended on the grades of that run). FILE
is the old server's ``GET /curriculum`` answer. Adopting it records its transitions and its
``last_iteration`` as decided, so that the new server serves every iteration up to there exactly as the old
one did, whatever grades it sees; gates are evaluated again only past it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from proctor.server.curriculum.loader import Curriculum
from proctor.server.exceptions import ProctorError
from proctor.server.state.rows import TransitionRecord
from proctor.server.store import Store
from proctor.wire.dataserver import CurriculumState

__all__ = ["HistoryError", "StageHistory", "adopt_history", "read_history"]


class HistoryError(ProctorError, ValueError):
    """A transitions file that cannot be adopted; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class StageHistory:
    transitions: tuple[TransitionRecord, ...]
    decided_through: int | None


def read_history(path: Path, curriculum: Curriculum) -> StageHistory:
    """The stage history in ``path`` (a ``GET /curriculum`` answer), checked against ``curriculum``."""
    try:
        state = CurriculumState.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise HistoryError(f"--transitions {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, ValidationError) as exc:
        raise HistoryError(
            f"--transitions {path}: not a GET /curriculum answer ({str(exc).splitlines()[0]}); save it with "
            "`curl -s $PROCTOR_URL/curriculum > FILE`"
        ) from None
    if state.curriculum_hash != curriculum.hash:
        raise HistoryError(
            f"--transitions {path}: it belongs to curriculum {state.curriculum!r} (hash {state.curriculum_hash}), "
            f"but this server loaded {curriculum.name!r} (hash {curriculum.hash}); a history only means something "
            "for the curriculum, data and seed that made it"
        )
    index = {stage.name: stage.index for stage in curriculum.stages}
    records: list[TransitionRecord] = []
    for n, t in enumerate(state.transitions):
        frm, to = index.get(t.from_stage), index.get(t.to_stage)
        if frm is None or to is None or to != frm + 1:
            raise HistoryError(f"--transitions {path}: transitions[{n}] goes from {t.from_stage!r} to {t.to_stage!r}")
        if records and t.iteration < records[-1].iteration:
            raise HistoryError(f"--transitions {path}: transitions[{n}] is earlier than the one before it")
        records.append(TransitionRecord(t.iteration, frm, to, t.reason, t.rolling_reward, t.rolling_count))
    return StageHistory(tuple(records), state.last_iteration)


def adopt_history(store: Store, history: StageHistory, *, source: str) -> None:
    """Record ``history`` in ``store``, unless it contradicts what the store already served.

    The store's transitions must be the history's first ones, and every transition it lacks must come after
    the last iteration it served. Adopting the same history twice changes nothing.
    """
    recorded = store.transitions()
    for n, (mine, theirs) in enumerate(zip(recorded, history.transitions, strict=False)):
        if (mine.iteration, mine.from_stage, mine.to_stage) != (theirs.iteration, theirs.from_stage, theirs.to_stage):
            raise HistoryError(
                f"--transitions {source}: {store.described} recorded another transition #{n} (at iteration "
                f"{mine.iteration}, not {theirs.iteration}); adopt a history into a new state file"
            )
    if len(recorded) > len(history.transitions):
        raise HistoryError(
            f"--transitions {source}: {store.described} has {len(recorded)} transitions, the history only "
            f"{len(history.transitions)}; adopt a history into a new state file"
        )
    new = history.transitions[len(recorded) :]
    last = store.last_iteration()
    if new and last is not None and new[0].iteration <= last:
        raise HistoryError(
            f"--transitions {source}: {store.described} already served iterations up to {last}, so a "
            f"transition at {new[0].iteration} would change batches it answered; adopt a history into a new state file"
        )
    store.adopt_transitions(new, history.decided_through)
