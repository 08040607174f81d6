"""``remote_reward``: a ``GRPOTrainer`` reward function that grades on the dataserver.

TRL calls a reward function once per generation batch with this process's completions and the dataset's
columns as keyword lists. This one posts them to ``/grade``, one request per generation step (one in all,
since a generation batch is one step), and returns the rewards matched by ``(slot, completion_index)``: a
record that a small source had to serve twice in one step is two prompts, each graded on its own. It never
invents a reward: a failed ``/grade`` raises (after the client's retries), and a completion whose grading
failed on the server becomes ``None``, which TRL leaves out of the advantage, unless ``on_error="server"``
asks for the source's ``on_error`` reward instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from proctor.client.http import ProctorClient
from proctor.server.protocol import GradeItem, GradeResult

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

    Needs the ``sample_id``, ``slot``, ``completion_index`` and ``iteration`` columns that
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
        items = [
            GradeItem(
                sample_id=sid,
                slot=int(slot[j]),
                completion=_text(completion),
                completion_tokens=len(completion_ids[j]) if completion_ids is not None else None,
                completion_index=int(completion_index[j]),
            )
            for j, (sid, completion) in enumerate(zip(sample_id, completions, strict=True))
        ]
        by_step: defaultdict[int, list[GradeItem]] = defaultdict(list)
        for item, step in zip(items, iteration, strict=True):
            by_step[int(step)].append(item)
        if dataset is not None:
            dataset.fetcher.prefetch_after(max(by_step))
        results: dict[tuple[int, int | None, int], GradeResult] = {}
        for step, group in by_step.items():
            for r in client.grade(group, iteration=step).results:
                results[step, r.slot, r.completion_index] = r

        rewards: list[float | None] = []
        components: defaultdict[str, list[float]] = defaultdict(list)
        errors = 0
        for item, step in zip(items, iteration, strict=True):
            result = results.get((int(step), item.slot, item.completion_index or 0))
            if result is None:
                raise RuntimeError(
                    f"/grade returned no result for slot {item.slot} ({item.sample_id!r}), completion "
                    f"{item.completion_index} of iteration {step}; the server and client disagree on the protocol"
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
            if len(by_step) == 1:
                log_metric("proctor/iteration", float(next(iter(by_step))))
        return rewards

    return proctor_reward


def _text(completion: Any) -> str:
    """A completion as text: TRL passes a string, or for conversational prompts a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}")
