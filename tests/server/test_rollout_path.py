"""One rollout path: every ``/sample`` opens its step's table, every ``/grade`` writes its completions there (or
to the step's loose completions) and is graded by the grader role, and ``proctor export`` gives them back.
A real server in a thread, real SQLite, the real ``datasets`` reader."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import datasets
import httpx

from proctor.cli.main import main
from proctor.client import ExperienceClient

BATCH = 4


def sample(url: str, step: int, batch_size: int = BATCH) -> list[dict[str, Any]]:
    answer = httpx.post(url + "/sample", json={"iteration": step, "batch_size": batch_size})
    answer.raise_for_status()
    return answer.json()["samples"]  # type: ignore[no-any-return]


def answer_of(url: str, step: int, slot: int) -> str:
    with ExperienceClient(url) as experience:
        return str(experience.read(step, [(slot, 0)], ["reference"])["reference"][0]["answer"])


def grade(url: str, items: list[dict[str, Any]], iteration: int | None = None) -> httpx.Response:
    body: dict[str, Any] = {"items": items}
    if iteration is not None:
        body["iteration"] = iteration
    return httpx.post(url + "/grade", json=body)


def test_sample_opens_its_steps_table_with_each_slots_prompt(live_server: Callable[..., Any]) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        samples = sample(url, 0)
        [table] = httpx.get(url + "/experience").json()["tables"]
        assert table == {
            "iteration": 0,
            "slots": BATCH,
            "group_size": None,
            "width": 0,
            "rows": 0,
            "written": {},
        }
        rows = [(s, 0) for s in range(BATCH)]
        values = experience.read(0, rows, ["sample_id", "prompt", "stage"])
        assert values["sample_id"] == [s["sample_id"] for s in samples]
        assert values["prompt"] == [s["prompt"] for s in samples]
        assert values["stage"] == ["warm"] * BATCH
        # A rank's share opens the same table; a trainer opening it later sets its group size.
        httpx.post(url + "/sample", json={"iteration": 0, "batch_size": BATCH, "rank": 1, "world_size": 2})
        info = experience.open(0, slots=BATCH, group_size=2)
        assert (info.group_size, info.rows, info.written["sample_id"]) == (2, 2 * BATCH, 2 * BATCH)


def test_a_plain_sample_then_grade_lands_in_the_store_and_exports(
    live_server: Callable[..., Any], tmp_path: Path
) -> None:
    out = tmp_path / "rollouts.parquet"
    with live_server() as url:
        samples = sample(url, 0)
        # As kolibrify's client sends them: the step, no slot, completions numbered per prompt by the server.
        items = [
            {"sample_id": s["sample_id"], "completion": answer_of(url, 0, slot) if k == 0 else "no idea"}
            for slot, s in enumerate(samples)
            for k in range(2)
        ]
        answer = grade(url, items, iteration=0)
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert [(r["table"], r["slot"], r["completion_index"], r["reward"]) for r in results] == [
            (0, slot, k, 1.0 if k == 0 else 0.0) for slot in range(BATCH) for k in range(2)
        ]
        table = httpx.get(url + "/experience/tables/0").json()
        assert (table["width"], table["written"]["completion"], table["written"]["reward"]) == (2, 8, 8)
        assert main(["export", str(out), "--server", url]) == 0
    rows = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert len(rows) == 2 * BATCH
    assert rows["completion"] == [it["completion"] for it in items]
    assert rows["reward"] == [r["reward"] for r in results]
    assert set(rows["stage"]) == {"warm"} and set(rows["iteration"]) == {0}


def test_a_completion_outside_every_served_batch_goes_to_its_steps_loose_table(
    live_server: Callable[..., Any], tmp_path: Path
) -> None:
    out = tmp_path / "rollouts.jsonl"
    with live_server() as url:
        [s, *_] = sample(url, 0)
        # Iteration 5 was never sampled (a trainer's global step, say): its completions are loose ones of step 5.
        items = [{"sample_id": s["sample_id"], "completion": text} for text in ("7", "8")]
        results = grade(url, items, iteration=5).json()["results"]
        assert [(r["table"], r["slot"], r["completion_index"]) for r in results] == [(-6, None, 0), (-6, None, 1)]
        # Posted again: the stored grades, nothing new in the store.
        again = grade(url, items, iteration=5).json()["results"]
        assert [(r["cached"], r["table"]) for r in again] == [(True, None), (True, None)]
        table = httpx.get(url + "/experience/tables/-6").json()
        assert (table["slots"], table["written"]["completion"], table["written"]["reward"]) == (1, 2, 2)
        assert main(["export", str(out), "--server", url, "--iterations", "5:6"]) == 0
    rows = datasets.load_dataset("json", data_files=str(out), split="train")
    assert [(r["table"], r["iteration"], r["slot"], r["index"], r["completion"]) for r in rows] == [
        (-6, 5, None, 0, "7"),
        (-6, 5, None, 1, "8"),
    ]


def test_another_completion_for_a_graded_row_is_kept_beside_it_as_a_loose_one(live_server: Callable[..., Any]) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        [s, *_] = sample(url, 0, batch_size=1)
        first = grade(url, [{"sample_id": s["sample_id"], "slot": 0, "completion": "1"}], iteration=0)
        # The step generated again (a resumed run): another completion for the same slot and index.
        second = grade(url, [{"sample_id": s["sample_id"], "slot": 0, "completion": "2"}], iteration=0)
        assert [r["table"] for r in first.json()["results"] + second.json()["results"]] == [0, -1]
        assert experience.read(0, [(0, 0)], ["completion"])["completion"] == ["1"]
        assert experience.read(-1, [(0, 0)], ["completion", "step", "step_slot"]) == {
            "completion": ["2"],
            "step": [0],
            "step_slot": [0],
        }
        graded = sum(st["graded"] + st["errors"] for st in httpx.get(url + "/curriculum").json()["stages"])
        assert graded == 2


def test_a_completion_index_beyond_the_group_size_is_refused_and_nothing_is_written(
    live_server: Callable[..., Any],
) -> None:
    with live_server() as url, ExperienceClient(url) as experience:
        samples = sample(url, 0, batch_size=2)
        experience.open(0, slots=2, group_size=2)
        items = [
            {"sample_id": samples[0]["sample_id"], "slot": 0, "completion_index": 0, "completion": "1"},
            {"sample_id": samples[1]["sample_id"], "slot": 1, "completion_index": 2, "completion": "1"},
        ]
        answer = grade(url, items, iteration=0)
        assert answer.status_code == 422
        assert answer.json()["detail"] == (
            "items[1].completion_index: 2 is not below the group size 2 of iteration 0's table; send each "
            "completion's index among its prompt's completions, from 0"
        )
        assert "completion" not in experience.table(0).written


def test_grades_posted_at_once_are_each_kept_once_and_a_refused_one_keeps_nothing(
    live_server: Callable[..., Any], tmp_path: Path, state_target: Callable[[str], str]
) -> None:
    # Requests that arrive together are written in shared transactions: one that the store refuses must fail
    # alone, and a request posted twice at once must be counted once.
    state = state_target(str(tmp_path / "state.db"))
    steps = 6
    with live_server(database_url=state) as url, ExperienceClient(url) as experience:
        bodies = []
        for step in range(steps):
            samples = sample(url, step)
            experience.open(step, slots=BATCH, group_size=2)
            items = [
                {"sample_id": s["sample_id"], "slot": slot, "completion_index": k, "completion": f"{step} {k}"}
                for slot, s in enumerate(samples)
                for k in range(2)
            ]
            bodies.append((items, step))
        bad = [dict(bodies[2][0][0], completion_index=2)]
        posts = [*bodies, (bad, 2), bodies[4]]
        with ThreadPoolExecutor(len(posts)) as pool:
            answers = list(pool.map(lambda post: grade(url, post[0], iteration=post[1]), posts))
        refused = answers[steps]
        assert refused.status_code == 422
        assert refused.json()["detail"].startswith("items[0].completion_index: 2 is not below the group size 2")
        assert all(a.status_code == 200 for n, a in enumerate(answers) if n != steps), [a.text for a in answers]
        repeat, first = ([r["reward"] for r in a.json()["results"]] for a in (answers[steps + 1], answers[4]))
        assert repeat == first
        for step in range(steps):
            assert experience.table(step).written["reward"] == BATCH * 2
    assert rows_in(state, "grades") == steps * BATCH * 2


def test_a_completion_graded_with_an_error_is_graded_again_in_a_row_of_its_own(
    live_server: Callable[..., Any],
) -> None:
    with live_server() as url:
        meta = httpx.get(url + "/meta").json()
        version = next(s["version"] for s in meta["sources"] if s["name"] == "faulty")
        item: dict[str, Any] = {"sample_id": f"faulty:{version}:0", "completion": "3"}
        first, again = (grade(url, [item]).json()["results"][0] for _ in range(2))
        assert first["error"] and again["error"] and not again["cached"]
        table = httpx.get(url + f"/experience/tables/{first['table']}").json()
        assert table["written"]["reward"] == 2


def refuse_grades(state: str) -> None:
    """Make the state refuse every grade from now on, as a full disk would."""
    if state.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(state, autocommit=True) as pg:
            pg.execute(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE 'disk full'; END $$"
            )
            pg.execute("CREATE TRIGGER refuse BEFORE INSERT ON grades FOR EACH ROW EXECUTE FUNCTION refuse()")
        return
    with sqlite3.connect(state) as db:
        db.execute("CREATE TRIGGER refuse BEFORE INSERT ON grades BEGIN SELECT RAISE(ABORT, 'disk full'); END")


def rows_in(state: str, table: str) -> int:
    if state.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(state) as pg:
            found = pg.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    else:
        with sqlite3.connect(state) as db:
            found = db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    assert found is not None
    return int(found[0])


def test_a_completion_its_reward_and_its_grade_are_written_in_one_transaction(
    live_server: Callable[..., Any], tmp_path: Path, state_target: Callable[[str], str]
) -> None:
    state = state_target(str(tmp_path / "state.db"))
    with live_server(database_url=state) as url:
        samples = sample(url, 0)
        refuse_grades(state)
        items = [{"sample_id": s["sample_id"], "slot": slot, "completion": "7"} for slot, s in enumerate(samples)]
        answer = grade(url, items, iteration=0)
        assert answer.status_code == 503, answer.text
        assert "stopped accepting writes" in answer.json()["detail"]
        if state.startswith("postgresql://"):
            # Its server opens the database again by itself, from what it kept.
            deadline = time.monotonic() + 60
            while httpx.get(url + "/healthz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
        # The completions and their rewards went with the refused grades: nothing of the request was kept.
        written = httpx.get(url + "/experience/tables/0").json()["written"]
        assert ("completion" in written, "reward" in written) == (False, False)
    assert (rows_in(state, "grades"), rows_in(state, "groups")) == (0, 0)


def test_export_numbers_the_attempts_at_a_step_generated_again(live_server: Callable[..., Any], tmp_path: Path) -> None:
    out = tmp_path / "rollouts.jsonl"
    with live_server() as url:
        [s, *_] = sample(url, 0, batch_size=1)
        for completion in ("1", "2", "3", "2"):  # generated three times, the second attempt posted again
            assert grade(url, [{"sample_id": s["sample_id"], "slot": 0, "completion": completion}], 0).is_success
        assert main(["export", str(out), "--server", url, "--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["table"], r["slot"], r["completion"], r["attempt"], r["latest"]) for r in rows] == [
        (0, 0, "1", 0, False),
        (-1, 0, "2", 1, False),
        (-1, 0, "3", 2, True),
    ]
