"""verl's custom reward function, graded by the dataserver (``POST /score``). Name it in verl's config::

    custom_reward_function:
      path: pkg://proctor.client.verl
      name: compute_score            # verl's reward loop or naive manager: one sample a call
      # name: compute_score_batch    # the batch manager (reward_model.use_reward_loop=False,
      #                              # reward_model.reward_manager=batch): the whole batch in one request
      reward_kwargs: {proctor_url: "http://127.0.0.1:8000"}

A sample's record is named by ``extra_info["sample_id"]`` when the dataset carries it (a sample id, as
``/sample`` served it), else by ``ground_truth`` if that is a sample id; any other ``ground_truth`` is the
reference answer for the server's default source (``PROCTOR_PEER_DEFAULT_SOURCE``). The answer is a dict with
the same keys for every sample, as verl's reward loop reads each key of the first answer from all of them:
``score`` (what verl trains on) and ``grading_error`` (1.0 where grading failed; the score is then the source's
``on_error`` reward), which verl logs; with ``components=True`` in ``reward_kwargs``, each grader's score as
well (use it where every source has the same graders).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from proctor.client.http import ProctorClient
from proctor.wire.peers import ScoreItem, ScoreResult

__all__ = ["close", "compute_score", "compute_score_batch"]

_clients: dict[tuple[str, str | None], ProctorClient] = {}
_lock = threading.Lock()


def compute_score(
    data_source: str | None = None,
    solution_str: str = "",
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    *,
    proctor_url: str | None = None,
    api_key: str | None = None,
    components: bool = False,
    **_: Any,
) -> dict[str, float]:
    """One sample's reward, as verl's reward loop and naive reward manager ask for it."""
    [result] = _client(proctor_url, api_key).score([_item(solution_str, ground_truth, extra_info)]).results
    return _answer(result, components)


def compute_score_batch(
    data_sources: Sequence[str | None] = (),
    solution_strs: Sequence[str] = (),
    ground_truths: Sequence[Any] = (),
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    proctor_url: str | None = None,
    api_key: str | None = None,
    components: bool = False,
    **_: Any,
) -> list[dict[str, float]]:
    """A batch's rewards in one request, as verl's batch reward manager asks for them."""
    extras = list(extra_infos) if extra_infos is not None else [None] * len(solution_strs)
    if not len(solution_strs) == len(ground_truths) == len(extras):
        raise ValueError(
            f"solution_strs ({len(solution_strs)}), ground_truths ({len(ground_truths)}) and extra_infos "
            f"({len(extras)}) must have one entry per sample"
        )
    items = [_item(s, g, e) for s, g, e in zip(solution_strs, ground_truths, extras, strict=True)]
    return [_answer(r, components) for r in _client(proctor_url, api_key).score(items).results]


def _item(solution: str, ground_truth: Any, extra_info: Mapping[str, Any] | None) -> ScoreItem:
    label = (extra_info or {}).get("sample_id") or ground_truth
    return ScoreItem(response=solution, label=None if label is None else str(label))


def _answer(result: ScoreResult, components: bool) -> dict[str, float]:
    graders = result.components if components else {}
    return {"score": result.reward, **graders, "grading_error": float(result.error is not None)}


def close() -> None:
    """Close the connections this module opened (verl never calls it: they last as long as its process)."""
    with _lock:
        for client in _clients.values():
            client.close()
        _clients.clear()


def _client(url: str | None, api_key: str | None) -> ProctorClient:
    """One client per server for the process: verl calls the function once per sample."""
    url = url or os.environ.get("PROCTOR_URL", "http://127.0.0.1:8000")
    api_key = api_key or os.environ.get("PROCTOR_API_KEY")
    with _lock:
        client = _clients.get((url, api_key))
        if client is None:
            client = _clients[(url, api_key)] = ProctorClient(url, api_key=api_key)
        return client
