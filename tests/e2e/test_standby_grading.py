"""A standby of a PostgreSQL database grades the ``/grade`` requests of sampled steps on its own grader processes,
and the serving server stores what it graded: the same answers as the serving server gives, counted once, in the
serving server's experience store; what the serving server refuses, the standby's client gets refused alike."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench._postgresql import PostgreSQLCluster
from proctor.client.experience import ExperienceClient

pytestmark = pytest.mark.e2e
BATCH = 4


def graded_standing_by(url: str) -> float:
    """The process's ``proctor_graded_standing_by`` counter."""
    text = httpx.get(url + "/metrics", timeout=30).text
    [line] = [x for x in text.splitlines() if x.startswith("proctor_graded_standing_by_total ")]
    return float(line.split()[1])


def graded(url: str) -> int:
    stages = httpx.get(url + "/curriculum", timeout=30).json()["stages"]
    return sum(s["graded"] + s["errors"] for s in stages)


def items_of(batch: dict[str, Any], completion: str) -> list[dict[str, Any]]:
    return [
        {"sample_id": s["sample_id"], "slot": n, "completion_index": k, "completion": f"{completion} {n} {k}"}
        for n, s in enumerate(batch["samples"])
        for k in range(2)
    ]


def pair(server_process: Callable[..., Any], curriculum_file: Path, database: str) -> tuple[Any, Any]:
    args = [str(curriculum_file), "--database-url", database, "--grader-workers", "1"]
    return server_process(args), server_process(args)  # the second finds the first serving and stands by


def standby_grades(first: Any, standby: Any) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """A step sampled from the serving server and graded through the standby once the standby grades itself (it
    starts its grader processes as it stands by, and sends /grade on whole until then): the step, its items and
    the standby's answer."""
    deadline = time.monotonic() + 60  # a liveness bound, not a timing claim
    for step in itertools.count():
        batch = httpx.post(first.url + "/sample", json={"iteration": step, "batch_size": BATCH}, timeout=30).json()
        items = items_of(batch, "the answer is")
        answer = httpx.post(standby.url + "/grade", json={"iteration": step, "items": items}, timeout=30)
        assert answer.status_code == 200, answer.text
        if graded_standing_by(standby.url) > 0:
            return step, items, answer.json()
        assert time.monotonic() < deadline, standby.log.read_text()[-3000:]
    raise AssertionError("unreachable")


def test_a_standby_grades_a_step_and_the_serving_server_stores_it(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster
) -> None:
    first, standby = pair(server_process, curriculum_file, postgresql_cluster.new_database())
    step, items, answer = standby_grades(first, standby)
    results = answer["results"]
    assert graded_standing_by(standby.url) == len(items)
    assert [r["cached"] for r in results] == [False] * len(items)
    assert {r["table"] for r in results} == {step}
    # The serving server stored them: posted there, the same completions are answered from its store.
    again = httpx.post(first.url + "/grade", json={"iteration": step, "items": items}, timeout=30).json()["results"]
    assert [r["cached"] for r in again] == [True] * len(items)
    assert [r["reward"] for r in again] == [r["reward"] for r in results]
    # Counted once, and seen alike from both processes.
    assert graded(first.url) == graded(standby.url)
    assert httpx.get(first.url + "/curriculum", timeout=30).text == httpx.get(standby.url + "/curriculum").text
    # In the step's table of the serving server's experience store, with their rewards.
    rows = [(it["slot"], it["completion_index"]) for it in items]
    with ExperienceClient(first.url) as store:
        cells = store.read(step, rows, ["completion", "reward"])
    assert cells["completion"] == [it["completion"] for it in items]
    assert cells["reward"] == [r["reward"] for r in results]
    # Posted to the standby again: the stored grades, graded by nobody.
    repeated = httpx.post(standby.url + "/grade", json={"iteration": step, "items": items}, timeout=30).json()
    assert [r["cached"] for r in repeated["results"]] == [True] * len(items)
    assert graded_standing_by(standby.url) == len(items)
    # Without an iteration the serving server places them (it holds the latest steps' ids): sent on whole.
    bare = [{k: v for k, v in it.items() if k != "slot"} for it in items]
    loose = httpx.post(standby.url + "/grade", json={"items": bare}, timeout=30)
    assert loose.status_code == 200, loose.text
    assert loose.json() == httpx.post(first.url + "/grade", json={"items": bare}, timeout=30).json()
    assert graded_standing_by(standby.url) == len(items)


def refused_alike(urls: list[str], body: dict[str, Any]) -> str:
    """The one 422 every server answers ``body`` with, and its detail."""
    answers = [httpx.post(url + "/grade", json=body, timeout=30) for url in urls]
    assert [a.status_code for a in answers] == [422] * len(urls)
    assert all(a.json() == answers[0].json() for a in answers)
    detail: str = answers[0].json()["detail"]
    return detail


def test_a_standby_refuses_what_the_serving_server_refuses(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster
) -> None:
    first, standby = pair(server_process, curriculum_file, postgresql_cluster.new_database())
    step, items, _ = standby_grades(first, standby)
    kept = graded(first.url)
    # Refused while the request is checked, on the standby.
    wrong_slot = [{**items[0], "slot": 1, "completion": "another"}]
    detail = refused_alike([standby.url, first.url], {"iteration": step, "items": wrong_slot})
    assert detail.startswith("items[0].slot: slot 1 of iteration")
    # Refused where the completions are written, on the serving server: a table of one completion a prompt.
    nxt = step + 1
    batch = httpx.post(first.url + "/sample", json={"iteration": nxt, "batch_size": BATCH}, timeout=30).json()
    with ExperienceClient(first.url) as store:
        store.open(nxt, slots=BATCH, group_size=1)
    beyond = [it for it in items_of(batch, "late") if it["completion_index"] == 1][:1]
    detail = refused_alike([standby.url, first.url], {"iteration": nxt, "items": beyond})
    assert detail.startswith("items[0].completion_index: 1 is not below the group size 1")
    assert graded(first.url) == kept  # nothing of either refused request was kept


def test_the_replica_routes_answer_standbys_only(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster
) -> None:
    first, _ = pair(server_process, curriculum_file, postgresql_cluster.new_database())
    body = {"lease_s": 30, "items": []}
    missing = httpx.post(first.url + "/replica/graded", json=body, timeout=30)
    assert missing.status_code == 403
    assert missing.json()["detail"].startswith("x-proctor-replica-token: missing")
    wrong = httpx.post(
        first.url + "/replica/graded", json=body, headers={"x-proctor-replica-token": "0" * 32}, timeout=30
    )
    assert wrong.status_code == 503
    assert wrong.json()["detail"].startswith("x-proctor-replica-token: not this server's")
    assert "/replica/graded" not in httpx.get(first.url + "/openapi.json", timeout=30).text
