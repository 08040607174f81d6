"""``remote_reward``: a ``GRPOTrainer`` reward function that grades on the dataserver.

TRL calls a reward function once per generation batch with this process's completions and the dataset's
columns as keyword lists. This one posts them to ``/grade`` in one request and returns the rewards matched
by ``(sample_id, completion_index)``. It never invents a reward: a failed ``/grade`` raises (after the
client's retries), and a completion whose grading failed on the server becomes ``None``, which TRL leaves
out of the advantage, unless ``on_error="server"`` asks for the source's ``on_error`` reward instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from proctor.client.http import ProctorClient
from proctor.server.protocol import GradeItem

if TYPE_CHECKING:
    from proctor.client.dataset import RemoteRLDataset

__all__ = ["remote_reward"]

RewardFn = Callable[..., list[float | None]]


def remote_reward(
    client: ProctorClient,
    *,
    on_error: Literal["skip", "server"] = "skip",
    dataset: RemoteRLDataset | None = None,
) -> RewardFn:
    """A reward function for ``GRPOTrainer(reward_funcs=...)`` backed by the dataserver's ``/grade``.

    With ``dataset`` (the run's :class:`~proctor.client.RemoteRLDataset`), the prompts of the next steps are
    fetched while the server grades this one: the trainer is waiting then anyway, whereas a prefetch during
    generation competes with it for the interpreter.

    Needs the ``sample_id``, ``completion_index`` and ``iteration`` columns that
    :class:`~proctor.client.RemoteRLDataset` provides. Logs each grader's mean (``proctor/<grader>``), the
    number of failed gradings (``proctor/grading_errors``) and the generation step (``proctor/iteration``)
    through TRL's ``log_metric``.
    """
    if on_error not in ("skip", "server"):
        raise ValueError(f"on_error must be 'skip' or 'server', got {on_error!r}")
    if dataset is not None:
        dataset.fetcher.prefetch = False  # prefetching moves here, next to the wait for /grade

    def proctor_reward(
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        *,
        sample_id: Sequence[str] | None = None,
        completion_index: Sequence[int] | None = None,
        iteration: Sequence[int] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        **_: Any,
    ) -> list[float | None]:
        if sample_id is None or completion_index is None or iteration is None:
            raise TypeError(
                "remote_reward needs the sample_id, completion_index and iteration columns of each row; "
                "train on a proctor.client.RemoteRLDataset"
            )
        items = [
            GradeItem(
                sample_id=sid,
                completion=_text(completion),
                completion_tokens=len(completion_ids[j]) if completion_ids is not None else None,
                completion_index=int(completion_index[j]),
            )
            for j, (sid, completion) in enumerate(zip(sample_id, completions, strict=True))
        ]
        steps = set(iteration)
        # One generation batch is one generation step; anything else is attributed by the server.
        step = int(next(iter(steps))) if len(steps) == 1 else None
        if dataset is not None and step is not None:
            dataset.fetcher.prefetch_after(step)
        results = {(r.sample_id, r.completion_index): r for r in client.grade(items, iteration=step).results}

        rewards: list[float | None] = []
        components: defaultdict[str, list[float]] = defaultdict(list)
        errors = 0
        for item in items:
            result = results.get((item.sample_id, item.completion_index or 0))
            if result is None:
                raise RuntimeError(
                    f"/grade returned no result for ({item.sample_id!r}, {item.completion_index}); "
                    "the server and client disagree on the protocol"
                )
            if result.error is not None:
                errors += 1
                rewards.append(result.reward if on_error == "server" else None)
            else:
                rewards.append(result.reward)
            for grader, score in result.components.items():
                components[grader].append(score)
        if log_metric is not None:
            for grader, scores in sorted(components.items()):
                log_metric(f"proctor/{grader}", sum(scores) / len(scores))
            log_metric("proctor/grading_errors", float(errors))
            if step is not None:
                log_metric("proctor/iteration", float(step))
        return rewards

    return proctor_reward


def _text(completion: Any) -> str:
    """A completion as text: TRL passes a string, or for conversational prompts a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")
