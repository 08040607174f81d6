"""``proctor grade-worker`` processes as the grader role of a dataserver that has no grader processes of its
own (``--grader-workers 0``): a worker killed mid-batch, a worker that comes back after its lease ended, and
a server restarted under its workers. Real servers, real SQLite, real worker processes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from proctor.cli.launcher import ServerProcess
from proctor.client import ExperienceClient
from proctor.experience import LeaseError
from proctor.experience.columns import GRADER

pytestmark = pytest.mark.e2e

# `gate` holds while the file named after "wait:" in the completion exists, so a test decides when a worker
# finishes; its score is the completion's length, so that each row's reward is known.
GRADERS = """
import os
import time


def gate(sample):
    marker = sample.completion.partition("wait:")[2].strip()
    while marker and os.path.exists(marker):
        time.sleep(0.02)
    return float(len(sample.completion))
"""
CURRICULUM = """
name: workers
seed: 3
sources:
  add: {kind: arithmetic, graders: [gate]}
graders:
  gate: {python: ./graders.py:gate}
stages:
  - {name: only, until_step: 100, mix: [{source: add}]}
"""
SLOTS, GROUP = 2, 2
DEADLINE_S = 60.0  # a liveness bound: every wait below ends far sooner


@pytest.fixture
def curriculum(tmp_path: Path) -> Path:
    folder = tmp_path / "workers"
    folder.mkdir()
    (folder / "graders.py").write_text(GRADERS)
    (folder / "workers.yaml").write_text(CURRICULUM)
    return folder / "workers.yaml"


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "gate"
    path.touch()
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def graderless(server_process: Callable[..., ServerProcess], curriculum: Path, tmp_path: Path) -> ServerProcess:
    """A ``proctor serve`` process with no grader processes: the grader role is left to workers."""
    return server_process([str(curriculum), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "0"])


class Worker:
    """A ``proctor grade-worker`` process with one grader process, its output in a file."""

    def __init__(self, url: str, log: Path, lease_s: float) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "proctor.cli", "grade-worker", "--server", url, "--workers", "1"]
        cmd += ["--lease-s", str(lease_s), "--log-level", "info"]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(url: str, lease_s: float = 1.5) -> Worker:
        worker = Worker(url, tmp_path / f"worker-{len(started)}.log", lease_s)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def eventually(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            found = check()
        except (httpx.TransportError, LeaseError):
            found = None
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {DEADLINE_S}s: {what}")


def completions(step: int, gate: Path) -> list[str]:
    return [f"step {step} row {n} {'x' * n} wait:{gate}" for n in range(SLOTS * GROUP)]


def post_step(url: str, step: int, gate: Path) -> list[str]:
    """Sample ``step``, open its table and write its completions, as a trainer does."""
    httpx.post(url + "/sample", json={"iteration": step, "batch_size": SLOTS}).raise_for_status()
    texts = completions(step, gate)
    with ExperienceClient(url) as experience:
        experience.open(step, slots=SLOTS, group_size=GROUP)
        rows = [(s, k) for s in range(SLOTS) for k in range(GROUP)]
        experience.put(step, rows, {"completion": texts, "completion_tokens": [None] * len(rows)})
    return texts


def grading(url: str, step: int) -> dict[str, Any]:
    return httpx.get(f"{url}/experience/consumers/{GRADER.name}/tables/{step}").json()  # type: ignore[no-any-return]


def all_consumed(url: str, step: int) -> bool:
    """Whether the grader role consumed every row of the step's table."""
    return bool(grading(url, step)["all_consumed"])


def counted(url: str) -> int:
    """Grades in the curriculum's statistics, failed ones included."""
    stages = httpx.get(url + "/curriculum").json()["stages"]
    return sum(s["graded"] + s["errors"] for s in stages)


def rewards(url: str, step: int) -> list[float]:
    with ExperienceClient(url) as experience:
        rows = [(s, k) for s in range(SLOTS) for k in range(GROUP)]
        return [float(r) for r in experience.read(step, rows, ["reward"])["reward"]]


def test_a_worker_killed_mid_batch_loses_nothing_and_counts_nothing_twice(
    live_server: Callable[..., Any], curriculum: Path, gate: Path, workers: Callable[..., Worker]
) -> None:
    with live_server(curriculum=curriculum, grader_workers=0) as url:
        texts = post_step(url, 0, gate)
        first = workers(url)
        eventually(lambda: grading(url, 0)["held"] == SLOTS * GROUP, "the first worker holds every row")
        first.proc.send_signal(signal.SIGKILL)  # mid-batch: its grader waits on the gate
        first.proc.wait(timeout=10)
        gate.unlink()
        workers(url)
        state = eventually(lambda: (s := grading(url, 0))["all_consumed"] and s, "the second worker grades them")
        assert (state["consumed"], state["held"]) == (SLOTS * GROUP, 0)
        assert rewards(url, 0) == [float(len(t)) for t in texts]
        assert counted(url) == SLOTS * GROUP


def test_a_worker_stopped_mid_batch_collects_what_it_holds_and_takes_nothing_more(
    live_server: Callable[..., Any], curriculum: Path, gate: Path, workers: Callable[..., Worker]
) -> None:
    with live_server(curriculum=curriculum, grader_workers=0) as url:
        texts = post_step(url, 0, gate)
        worker = workers(url, lease_s=30.0)  # no lease ends within the test: only the worker's collection counts
        eventually(lambda: grading(url, 0)["held"] == SLOTS * GROUP, "the worker holds every row")
        post_step(url, 1, gate)
        worker.proc.send_signal(signal.SIGTERM)  # mid-batch: its grader waits on the gate
        eventually(lambda: "SIGTERM: stopping once the rows it holds" in worker.output(), "the worker stops")
        gate.unlink()
        assert worker.proc.wait(timeout=DEADLINE_S) == 0, worker.output()
        state = grading(url, 0)
        assert (state["consumed"], state["held"], state["all_consumed"]) == (SLOTS * GROUP, 0, True)
        assert rewards(url, 0) == [float(len(t)) for t in texts]
        assert counted(url) == SLOTS * GROUP
        # The next step's rows, written before the stop, were left for others.
        assert (grading(url, 1)["held"], grading(url, 1)["consumed"]) == (0, 0)


def plain_items(url: str, step: int, gate: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Sample ``step`` and build its /grade items as a client without the store does (no table opened)."""
    answer = httpx.post(url + "/sample", json={"iteration": step, "batch_size": SLOTS})
    samples = answer.raise_for_status().json()["samples"]
    texts = completions(step, gate)
    items = [
        {"sample_id": samples[s]["sample_id"], "completion_index": k, "completion": texts[s * GROUP + k]}
        for s in range(SLOTS)
        for k in range(GROUP)
    ]
    return items, texts


def test_a_plain_grade_is_graded_by_remote_workers_one_of_them_killed_mid_batch(
    live_server: Callable[..., Any], curriculum: Path, gate: Path, workers: Callable[..., Worker]
) -> None:
    with live_server(curriculum=curriculum, grader_workers=0) as url, ThreadPoolExecutor(1) as client:
        items, texts = plain_items(url, 0, gate)
        first = workers(url)
        answer = client.submit(httpx.post, url + "/grade", json={"iteration": 0, "items": items}, timeout=DEADLINE_S)
        eventually(lambda: grading(url, 0)["held"] == SLOTS * GROUP, "the first worker holds every row")
        workers(url)
        first.proc.send_signal(signal.SIGKILL)  # mid-batch: its grader waits on the gate
        first.proc.wait(timeout=10)
        gate.unlink()
        results = answer.result().raise_for_status().json()["results"]
        assert [r["reward"] for r in results] == [float(len(t)) for t in texts]
        assert rewards(url, 0) == [float(len(t)) for t in texts]
        assert counted(url) == SLOTS * GROUP
        # Posted again: the stored grades.
        again = httpx.post(url + "/grade", json={"iteration": 0, "items": items}).json()["results"]
        assert [(r["reward"], r["cached"]) for r in again] == [(float(len(t)), True) for t in texts]
        assert counted(url) == SLOTS * GROUP


def test_requests_of_the_same_completions_each_get_the_rewards_one_worker_collects(
    live_server: Callable[..., Any], curriculum: Path, gate: Path, workers: Callable[..., Worker]
) -> None:
    with live_server(curriculum=curriculum, grader_workers=0) as url, ThreadPoolExecutor(3) as client:
        items, texts = plain_items(url, 0, gate)

        def post() -> list[float]:
            answer = httpx.post(url + "/grade", json={"iteration": 0, "items": items}, timeout=DEADLINE_S)
            return [r["reward"] for r in answer.raise_for_status().json()["results"]]

        waiting = [client.submit(post) for _ in range(3)]  # each waits for the rows the first one wrote
        eventually(lambda: grading(url, 0)["ready"] == SLOTS * GROUP, "the completions are written")
        workers(url)
        eventually(lambda: grading(url, 0)["held"] == SLOTS * GROUP, "the worker holds every row")
        gate.unlink()
        assert [w.result() for w in waiting] == [[float(len(t)) for t in texts]] * 3
        assert counted(url) == SLOTS * GROUP


def test_one_worker_grades_the_rows_of_several_grades_at_once_a_lease_per_table(
    live_server: Callable[..., Any], curriculum: Path, gate: Path, workers: Callable[..., Worker]
) -> None:
    steps = range(3)
    with live_server(curriculum=curriculum, grader_workers=0) as url, ThreadPoolExecutor(len(steps)) as client:
        posted = [plain_items(url, step, gate) for step in steps]
        answers = [
            client.submit(httpx.post, url + "/grade", json={"iteration": step, "items": items}, timeout=DEADLINE_S)
            for step, (items, _) in zip(steps, posted, strict=True)
        ]
        eventually(lambda: all(grading(url, s)["ready"] == SLOTS * GROUP for s in steps), "every step is written")
        workers(url)
        # One grader process and the gate shut: every table's rows held at once came in one dispatch.
        eventually(lambda: all(grading(url, s)["held"] == SLOTS * GROUP for s in steps), "the worker holds them all")
        gate.unlink()
        for answer, (_, texts) in zip(answers, posted, strict=True):
            results = answer.result().raise_for_status().json()["results"]
            assert [r["reward"] for r in results] == [float(len(t)) for t in texts]
        assert counted(url) == len(steps) * SLOTS * GROUP


def test_another_consumer_collects_rows_a_grade_waits_for_and_the_grade_still_gets_its_rewards(
    live_server: Callable[..., Any], curriculum: Path, gate: Path, workers: Callable[..., Worker]
) -> None:
    with live_server(curriculum=curriculum, grader_workers=0) as url, ThreadPoolExecutor(1) as client:
        items, texts = plain_items(url, 0, gate)
        answer = client.submit(httpx.post, url + "/grade", json={"iteration": 0, "items": items}, timeout=DEADLINE_S)
        eventually(lambda: grading(url, 0)["ready"] == SLOTS * GROUP, "the completions are written")
        with ExperienceClient(url) as experience:
            experience.register("scorer", needs=["completion"], produces=["score"])
            batch = experience.dispatch("scorer", SLOTS * GROUP, iteration=0)
            assert batch.lease is not None
            collected = experience.collect(
                batch.lease, {"score": [float(len(str(c))) for c in batch.columns["completion"]]}
            )
            assert len(collected.rows) == SLOTS * GROUP
        workers(url)
        gate.unlink()
        results = answer.result().raise_for_status().json()["results"]
        assert [r["reward"] for r in results] == [float(len(t)) for t in texts]
        assert counted(url) == SLOTS * GROUP


def test_a_server_killed_between_storing_and_answering_a_grade_answers_its_retry_counting_once(
    graderless: ServerProcess, gate: Path, workers: Callable[..., Worker]
) -> None:
    server, url = graderless, graderless.url
    items, texts = plain_items(url, 0, gate)
    workers(url, lease_s=3.0)
    with ThreadPoolExecutor(1) as client:
        answer = client.submit(httpx.post, url + "/grade", json={"iteration": 0, "items": items}, timeout=DEADLINE_S)
        # The completions are stored and a worker grades them (its grader waits on the gate): no answer yet.
        eventually(lambda: grading(url, 0)["held"] == SLOTS * GROUP, "the worker holds every row")
        server.kill()
        with pytest.raises(httpx.TransportError):
            answer.result()
    server.start()
    gate.unlink()
    again = httpx.post(url + "/grade", json={"iteration": 0, "items": items}, timeout=DEADLINE_S)
    assert [r["reward"] for r in again.raise_for_status().json()["results"]] == [float(len(t)) for t in texts]
    assert counted(url) == SLOTS * GROUP
    eventually(lambda: grading(url, 0)["all_consumed"], "every row is graded")
    assert counted(url) == SLOTS * GROUP


def test_a_result_for_rows_no_longer_held_is_refused_with_a_clear_message(
    live_server: Callable[..., Any], curriculum: Path, gate: Path, workers: Callable[..., Worker]
) -> None:
    with live_server(curriculum=curriculum, grader_workers=0) as url:
        texts = post_step(url, 0, gate)
        late = workers(url)
        eventually(lambda: grading(url, 0)["held"] == SLOTS * GROUP, "the first worker holds every row")
        late.proc.send_signal(signal.SIGSTOP)  # frozen past its lease: its renewals stop too
        eventually(lambda: grading(url, 0)["held"] == 0, "its lease ends and the rows go back")
        gate.unlink()
        other = workers(url)
        eventually(lambda: grading(url, 0)["all_consumed"], "another worker grades the rows")
        late.proc.send_signal(signal.SIGCONT)
        line = eventually(
            lambda: re.search(
                r"dropped the rewards of 4 rows: lease \w+… of consumer 'grader' expired .*", late.output()
            ),
            "the late worker's result is refused",
        )
        assert "drop this result" in line.group(0)
        assert rewards(url, 0) == [float(len(t)) for t in texts]
        assert counted(url) == SLOTS * GROUP

        # Over HTTP the refusal is a 409 that says what happened and what to do (no worker left to race).
        late.stop()
        other.stop()
        post_step(url, 1, gate)
        with ExperienceClient(url) as experience:
            stale = experience.dispatch(GRADER.name, SLOTS * GROUP, iteration=1, lease_s=0.2)
        assert stale.lease is not None
        eventually(lambda: grading(url, 1)["held"] == 0, "the short lease ends")
        answer = httpx.post(
            f"{url}/experience/leases/{stale.lease}/collect",
            json={"columns": {"reward": {"values": [0.0] * 4}, "reward_detail": {"values": [{}] * 4}}},
        )
        assert answer.status_code == 409
        assert answer.json()["code"] == "lease"
        assert re.match(
            r"lease \w+… of consumer 'grader' expired [\d.]+s ago; its rows went back to the pool and may be held by "
            r"another worker: drop this result",
            answer.json()["detail"],
        )
        assert counted(url) == SLOTS * GROUP


def test_workers_reconnect_and_finish_after_a_server_restart(
    graderless: ServerProcess, gate: Path, workers: Callable[..., Worker]
) -> None:
    server, url = graderless, graderless.url
    steps = range(3)
    texts = {step: post_step(url, step, gate) for step in steps}
    pool = [workers(url, lease_s=3.0), workers(url, lease_s=3.0)]
    eventually(lambda: sum(grading(url, s)["held"] for s in steps) > 0, "the workers hold rows")
    server.kill()
    gate.unlink()
    time.sleep(1.0)  # the workers find no server for a while
    server.start()
    for step in steps:
        eventually(partial(all_consumed, url, step), f"step {step} is graded after the restart")
        assert rewards(url, step) == [float(len(t)) for t in texts[step]]
    assert counted(url) == len(steps) * SLOTS * GROUP
    exited = [w.output() for w in pool if w.proc.poll() is not None]
    assert not exited, f"a worker exited instead of reconnecting: {exited}"
    assert any("unreachable" in w.output() for w in pool)


def test_a_worker_refuses_remote_graders_whose_headers_were_withheld(
    live_server: Callable[..., Any], tmp_path: Path
) -> None:
    folder = tmp_path / "judged"
    folder.mkdir()
    (folder / "judged.yaml").write_text(
        CURRICULUM.replace("graders: [gate]", "graders: [judge]").replace(
            "gate: {python: ./graders.py:gate}",
            "judge: {url: 'http://127.0.0.1:9/score', headers: {Authorization: 'Bearer secret'}}",
        )
    )
    with live_server(curriculum=folder / "judged.yaml", grader_workers=0) as url:
        assert httpx.get(url + "/graders").json()["sources"]["add"]["remote"][0]["headers"] == {"Authorization": ""}
        cmd = [sys.executable, "-m", "proctor.cli", "grade-worker", "--server", url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == (
        "proctor grade-worker: source 'add' has a remote grader 'judge' with headers, which the server withholds "
        "because it has no API key; start it with PROCTOR_API_KEY and give the worker the key\n"
    )
