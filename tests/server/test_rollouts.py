"""The experience store as the dataserver uses it: the prompt's columns filled when a sampled step's table
opens, the server's grader role grading what a trainer writes, ``/grade`` through the store, the graders a
remote worker runs, and a server without grader processes. A real server in a thread, real SQLite."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from proctor.client import ExperienceClient
from proctor.experience import ShapeConflictError
from proctor.experience.columns import GRADER

SLOTS, GROUP = 3, 2
ROWS = [(s, k) for s in range(SLOTS) for k in range(GROUP)]


def sample(url: str, step: int, batch_size: int = SLOTS) -> list[dict[str, Any]]:
    answer = httpx.post(url + "/sample", json={"iteration": step, "batch_size": batch_size})
    answer.raise_for_status()
    return answer.json()["samples"]  # type: ignore[no-any-return]


def graded(url: str) -> int:
    return sum(s["graded"] + s["errors"] for s in httpx.get(url + "/curriculum").json()["stages"])


def wait_consumed(url: str, step: int) -> None:
    deadline = time.monotonic() + 60  # a liveness bound, not a measurement
    while not httpx.get(f"{url}/experience/consumers/grader/tables/{step}").json()["all_consumed"]:
        assert time.monotonic() < deadline, "the grader role did not grade the rows"
        time.sleep(0.02)


def test_opening_a_sampled_step_fills_each_row_with_its_prompt(live_server: Callable[..., Any]) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        samples = sample(url, 0)
        info = experience.open(0, slots=SLOTS, group_size=GROUP)
        assert {k: info.written[k] for k in ("sample_id", "prompt", "reference", "stage")} == dict.fromkeys(
            ("sample_id", "prompt", "reference", "stage"), SLOTS * GROUP
        )
        values = experience.read(0, ROWS, ["sample_id", "prompt", "reference", "stage"])
        assert values["sample_id"] == [samples[s]["sample_id"] for s, _ in ROWS]
        assert values["prompt"] == [samples[s]["prompt"] for s, _ in ROWS]
        assert values["stage"] == ["warm"] * len(ROWS)
        assert all(set(r) == {"answer", "metadata"} and r["answer"] for r in values["reference"])
        # Every rank opens the table: opening again fills nothing twice and changes nothing.
        assert experience.open(0, slots=SLOTS, group_size=GROUP) == info


def test_a_sampled_step_opened_with_another_batch_size_is_a_conflict(live_server: Callable[..., Any]) -> None:
    with live_server() as url:
        sample(url, 0)
        answer = httpx.put(url + "/experience/tables/0", json={"slots": SLOTS + 1, "group_size": GROUP})
        assert answer.status_code == 409
        assert answer.json()["detail"] == (
            f"iteration 0 was sampled with batch_size {SLOTS}; open its table with slots={SLOTS} (one slot per "
            "prompt of the step, across all ranks)"
        )
        with ExperienceClient(url) as experience:
            with pytest.raises(ShapeConflictError, match=f"^iteration 0 was sampled with batch_size {SLOTS};"):
                experience.open(0, slots=1, group_size=GROUP)  # the store's own error class, on the client too
            # /sample opened the table, without a group size; the refused openings changed nothing.
            info = experience.table(0)
            assert (info.slots, info.group_size, info.rows) == (SLOTS, None, 0)


def test_the_grader_role_grades_what_a_trainer_writes_and_counts_it_once(live_server: Callable[..., Any]) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        samples = sample(url, 0)
        experience.open(0, slots=SLOTS, group_size=GROUP)
        answers = experience.read(0, ROWS, ["reference"])["reference"]
        # Right answers in index 0 of each group, wrong ones in index 1.
        texts = [str(r["answer"]) if k == 0 else "no idea" for (_, k), r in zip(ROWS, answers, strict=True)]
        experience.put(0, ROWS, {"completion": texts, "completion_tokens": [3] * len(ROWS)})
        wait_consumed(url, 0)
        got = experience.read(0, ROWS, ["reward", "reward_detail"])
        assert got["reward"] == [1.0 if k == 0 else 0.0 for _, k in ROWS]
        assert got["reward_detail"][0] == {"components": {"numeric": 1.0}, "error": None}
        assert graded(url) == len(ROWS)

        # /grade of the same completions answers the stored grades and counts nothing again.
        items = [
            {"sample_id": samples[s]["sample_id"], "slot": s, "completion_index": k, "completion": t}
            for (s, k), t in zip(ROWS, texts, strict=True)
        ]
        results = httpx.post(url + "/grade", json={"iteration": 0, "items": items}).json()["results"]
        assert [(r["reward"], r["cached"]) for r in results] == [(1.0 if k == 0 else 0.0, True) for _, k in ROWS]
        assert graded(url) == len(ROWS)


def test_a_write_with_read_answers_the_grader_roles_rewards_of_its_rows(live_server: Callable[..., Any]) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        sample(url, 0)
        experience.open(0, slots=SLOTS, group_size=GROUP)
        answers = experience.read(0, ROWS, ["reference"])["reference"]
        texts = [str(r["answer"]) if k == 0 else "no idea" for (_, k), r in zip(ROWS, answers, strict=True)]
        columns: dict[str, list[str] | list[int]] = {"completion": texts, "completion_tokens": [3] * len(ROWS)}
        got = experience.put_and_read(0, ROWS, columns, ["reward", "reward_detail"], wait_s=30)
        assert got["reward"] == [1.0 if k == 0 else 0.0 for _, k in ROWS]
        assert got["reward_detail"][0] == {"components": {"numeric": 1.0}, "error": None}
        assert graded(url) == len(ROWS)
        # Written again with its read: the same answer, nothing counted twice.
        assert experience.put_and_read(0, ROWS, columns, ["reward", "reward_detail"], wait_s=30) == got
        assert graded(url) == len(ROWS)
        # More rows than one request takes: a write, then a read.
        split = ExperienceClient(client=experience.client, rows_per_request=2)
        assert split.put_and_read(0, ROWS, columns, ["reward", "reward_detail"], wait_s=30) == got

        # A column nothing writes: the cells are written, and the read is the 409 of a read that does not wait.
        sample(url, 1)
        body = {"rows": [[0, 0]], "columns": {"completion": {"values": ["7"]}}, "read": ["advantage"]}
        answer = httpx.post(url + "/experience/tables/1/rows", json=body)
        assert (answer.status_code, answer.json()["code"]) == (409, "cells_missing")
        assert experience.read(1, [(0, 0)], ["completion"]) == {"completion": ["7"]}
        plain = httpx.post(url + "/experience/tables/1/rows", json={k: body[k] for k in ("rows", "columns")})
        assert (plain.status_code, plain.content) == (204, b"")
        bad = httpx.post(url + "/experience/tables/1/rows", json={**body, "wait_s": 61})
        assert bad.status_code == 422
        assert bad.json()["detail"].startswith("wait_s: ")


def test_a_writer_that_writes_a_reward_of_its_own_reads_its_own_back(live_server: Callable[..., Any]) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        sample(url, 0)
        experience.open(0, slots=SLOTS, group_size=GROUP)
        columns: dict[str, list[Any]] = {"completion": ["no idea"], "completion_tokens": [3], "reward": [0.5]}
        assert experience.put_and_read(0, [(0, 0)], columns, ["reward"], wait_s=30) == {"reward": [0.5]}
        # The grader role holds nothing there: it has no result to give the row (it would be refused).
        role = experience.consumption(GRADER.name, 0)
        assert (role.consumed, role.held) == (1, 0)


def test_grade_for_an_open_table_goes_through_the_store(live_server: Callable[..., Any]) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        samples = sample(url, 0)
        experience.open(0, slots=SLOTS, group_size=GROUP)
        items = [
            {"sample_id": samples[s]["sample_id"], "slot": s, "completion_index": k, "completion": f"answer {s}{k}"}
            for s, k in ROWS
        ]
        results = httpx.post(url + "/grade", json={"iteration": 0, "items": items}).json()["results"]
        assert [(r["slot"], r["completion_index"], r["cached"]) for r in results] == [(s, k, False) for s, k in ROWS]
        stored = experience.read(0, ROWS, ["completion", "reward"])
        assert stored["completion"] == [it["completion"] for it in items]
        assert stored["reward"] == [r["reward"] for r in results]
        assert experience.consumption(GRADER.name, 0).all_consumed
        assert graded(url) == len(ROWS)


def test_graders_describes_each_source_for_a_remote_worker(live_server: Callable[..., Any]) -> None:
    with live_server() as url:
        body = httpx.get(url + "/graders").json()
    assert body["timeout_s"] > 0
    assert body["headers_withheld"] is True
    qa = body["sources"]["qa"]
    assert qa["on_error"] == -1.0
    assert qa["names"] == ["exact_match", "half"]
    assert qa["local"][0] == {
        "key": "exact_match",
        "ref": "builtin:exact_match",
        "params": {},
        "weight": 1.0,
        "multiplicative": False,
    }
    assert qa["local"][1]["ref"].endswith("graders.py:half")


def test_without_a_grader_a_plain_grade_answers_503_naming_the_command_and_keeps_the_completion(
    live_server: Callable[..., Any],
) -> None:
    with live_server(grader_workers=0, grader_claim_timeout_s=0.3) as url, ExperienceClient(url) as experience:
        samples = sample(url, 0)
        item = {"sample_id": samples[0]["sample_id"], "completion": "4"}
        answer = httpx.post(url + "/grade", json={"items": [item]})
        assert answer.status_code == 503
        assert answer.json()["detail"] == (
            "no grader claimed the 1 completions of table 0 within 0.3s (PROCTOR_GRADER_CLAIM_TIMEOUT_S): this "
            "server has no grader processes (PROCTOR_GRADER_WORKERS=0); start one with `proctor grade-worker "
            "--server URL`. They stay queued: post them again to get their rewards"
        )
        # Without an iteration the item takes the slot its record fills in the step that served it, queued for
        # a grader.
        assert experience.read(0, [(0, 0)], ["completion", "sample_id"]) == {
            "completion": ["4"],
            "sample_id": [samples[0]["sample_id"]],
        }
        assert experience.consumption(GRADER.name, 0).ready == 1
        assert httpx.get(url + "/healthz").status_code == 200


def test_a_read_with_wait_s_answers_once_the_cells_are_written(live_server: Callable[..., Any]) -> None:
    import threading

    with live_server() as url, ExperienceClient(url) as experience:
        samples = sample(url, 0)
        experience.open(0, slots=SLOTS, group_size=GROUP)
        body = {"rows": [[0, 0]], "columns": ["reward"], "wait_s": 30}
        # Nothing writes it: after wait_s, the 409 of a read that does not wait.
        late = httpx.post(url + "/experience/tables/0/read", json={**body, "wait_s": 0.2})
        assert (late.status_code, late.json()["code"]) == (409, "cells_missing")
        item = {"sample_id": samples[0]["sample_id"], "slot": 0, "completion_index": 0, "completion": "7"}
        grading = threading.Timer(0.3, lambda: httpx.post(url + "/grade", json={"iteration": 0, "items": [item]}))
        grading.start()
        answer = httpx.post(url + "/experience/tables/0/read", json=body, timeout=60)
        grading.join()
        assert answer.status_code == 200
        assert answer.json()["columns"]["reward"]["values"][0] in (0.0, 1.0)
        too_long = httpx.post(url + "/experience/tables/0/read", json={**body, "wait_s": 61})
        assert too_long.status_code == 422
        assert too_long.json()["detail"].startswith("wait_s: ")
