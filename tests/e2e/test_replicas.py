"""Several ``proctor serve`` processes on one PostgreSQL database: one serves, the others stand by and forward to
it, every replica answers alike, and when the serving process is killed a standby takes over from what the
database kept, losing nothing and counting nothing twice; through a load balancer, a two-rank GRPO run does not
notice beyond a few retried requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench._balancer import balancer
from bench._postgresql import PostgreSQLCluster
from proctor.cli.launcher import free_port

pytestmark = pytest.mark.e2e
STEPS = 6


def until_served(call: Callable[[], httpx.Response], seconds: float = 60.0) -> httpx.Response:
    """``call()`` again while it answers 503 (no server serves yet); a liveness bound, not a timing claim."""
    deadline = time.monotonic() + seconds
    while True:
        answer = call()
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        time.sleep(0.1)


def serving(url: str) -> float:
    """The process's ``proctor_serving`` gauge."""
    [line] = [x for x in httpx.get(url + "/metrics", timeout=30).text.splitlines() if x.startswith("proctor_serving ")]
    return float(line.split()[1])


def graded(url: str) -> int:
    stages = httpx.get(url + "/curriculum", timeout=30).json()["stages"]
    return sum(s["graded"] + s["errors"] for s in stages)


def replicas(
    server_process: Callable[..., Any], curriculum_file: Path, database: str, count: int, *extra: str
) -> list[Any]:
    # One after the other: the first serves, the others find it serving and stand by.
    args = [str(curriculum_file), "--database-url", database, "--grader-workers", "1", *extra]
    return [server_process(args) for _ in range(count)]


def test_replicas_answer_alike_and_a_standby_takes_over_from_a_killed_server(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster, tmp_path: Path
) -> None:
    first, *standbys = replicas(server_process, curriculum_file, postgresql_cluster.new_database(), 3)
    urls = [first.url, *(s.url for s in standbys)]
    # The same batch of an iteration from every replica, whichever is asked first.
    batches = [httpx.post(u + "/sample", json={"iteration": 0, "batch_size": 4}, timeout=30) for u in urls[::-1]]
    assert all(b.status_code == 200 for b in batches), [b.text for b in batches]
    assert len({b.text for b in batches}) == 1
    items = [
        {"sample_id": s["sample_id"], "slot": n, "completion": "7"} for n, s in enumerate(batches[0].json()["samples"])
    ]
    # The same completions graded through two replicas: the same rewards, counted once.
    answers = [httpx.post(u + "/grade", json={"iteration": 0, "items": items}, timeout=30).json() for u in urls[1:]]
    rewards = [[r["reward"] for r in a["results"]] for a in answers]
    assert rewards[0] == rewards[1]
    assert [r["cached"] for r in answers[1]["results"]] == [True] * len(items)
    assert {graded(u) for u in urls} == {len(items)}
    views = {httpx.get(u + "/curriculum", timeout=30).text for u in urls}
    assert len(views) == 1
    # Each process's metrics are its own: which one serves.
    assert [serving(u) for u in urls] == [1.0, 0.0, 0.0]

    first.kill()
    # A standby takes over: it serves the run the killed one left, from the database.
    for u in urls[1:]:
        again = until_served(partial(httpx.post, u + "/sample", json={"iteration": 0, "batch_size": 4}, timeout=30))
        assert again.text == batches[0].text
    regraded = httpx.post(urls[1] + "/grade", json={"iteration": 0, "items": items}, timeout=30).json()
    assert [r["reward"] for r in regraded["results"]] == rewards[0]
    assert {graded(u) for u in urls[1:]} == {len(items)}
    nxt = [httpx.post(u + "/sample", json={"iteration": 1, "batch_size": 4}, timeout=30).text for u in urls[1:]]
    assert nxt[0] == nxt[1]
    logs = [(tmp_path / f"server-{n}.log").read_text() for n in (1, 2)]
    # Exactly one of the two serves now; the other stands by for it.
    assert sorted("took over serving" in log for log in logs) == [False, True], logs
    assert sorted(serving(u) for u in urls[1:]) == [0.0, 1.0]


def test_a_serving_server_whose_connection_ends_stops_serving_without_a_request(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster, tmp_path: Path
) -> None:
    """The database ends the serving server's connection (as it does for a machine cut off the network), and
    nothing is asked of that server: it notices by itself, and a server of the database serves on."""
    import psycopg

    database = postgresql_cluster.new_database()
    first, standby = replicas(server_process, curriculum_file, database, 2)
    batch = httpx.post(first.url + "/sample", json={"iteration": 0, "batch_size": 4}, timeout=30).text
    name = database.rsplit("/", 1)[1]
    with psycopg.connect(postgresql_cluster.url(), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND application_name = 'proctor'",
            (name,),
        )
    deadline = time.monotonic() + 60  # a liveness bound, not a timing claim
    while "stopped accepting writes" not in first.log.read_text():
        assert time.monotonic() < deadline, first.log.read_text()[-3000:]
        time.sleep(0.1)
    for url in (first.url, standby.url):
        again = until_served(partial(httpx.post, url + "/sample", json={"iteration": 0, "batch_size": 4}, timeout=30))
        assert again.text == batch


def test_a_standby_forwards_the_api_key_and_the_answer_as_they_are(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster
) -> None:
    database = postgresql_cluster.new_database()
    args = [str(curriculum_file), "--database-url", database, "--grader-workers", "1"]
    env = {"PROCTOR_API_KEY": "s3cret"}
    serving, standby = (server_process(args, env=env) for _ in range(2))
    key = {"Authorization": "Bearer s3cret"}
    refused = httpx.post(standby.url + "/sample", json={"iteration": 0, "batch_size": 2})
    assert refused.status_code == 401, refused.text  # by the standby itself, before anything is forwarded
    wrong = httpx.post(standby.url + "/sample", json={"iteration": 0, "batch_size": 2}, headers={"Authorization": "x"})
    assert wrong.status_code == 401
    forwarded = httpx.post(standby.url + "/sample", json={"iteration": 0, "batch_size": 2}, headers=key)
    direct = httpx.post(serving.url + "/sample", json={"iteration": 0, "batch_size": 2}, headers=key)
    assert (forwarded.status_code, forwarded.text) == (direct.status_code, direct.text)
    assert forwarded.headers["content-type"] == direct.headers["content-type"]
    # An error answer comes back as the serving server gave it, status and detail.
    conflict = httpx.post(standby.url + "/sample", json={"iteration": 0, "batch_size": 4}, headers=key)
    assert conflict.status_code == 409
    assert conflict.json()["detail"].startswith("iteration 0 was sampled with batch_size 2")
    # The live page too, a static file.
    page = httpx.get(standby.url + "/")
    assert page.status_code == 200 and page.text == httpx.get(serving.url + "/").text


def test_a_replica_of_another_curriculum_is_refused(
    server_process: Callable[..., Any], curriculum_file: Path, postgresql_cluster: PostgreSQLCluster
) -> None:
    database = postgresql_cluster.new_database()
    [serving] = replicas(server_process, curriculum_file, database, 1)
    with pytest.raises(RuntimeError, match="server exited with 2") as info:
        replicas(server_process, curriculum_file, database, 1, "--seed", "6")
    assert f"the PostgreSQL database {database} belongs to curriculum 'tiny'" in str(info.value)
    assert "Traceback" not in str(info.value)
    assert httpx.get(serving.url + "/healthz").status_code == 200


def test_a_two_rank_run_through_a_balancer_survives_the_serving_replica_killed(
    server_process: Callable[..., Any],
    curriculum_file: Path,
    postgresql_cluster: PostgreSQLCluster,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """GRPO on two processes through nginx in front of three replicas; the serving one is killed with SIGKILL
    after the run's first steps. The run finishes, every step's completions are graded once, and the batches
    are the ones a single server of the curriculum serves."""
    servers = replicas(server_process, curriculum_file, postgresql_cluster.new_database(), 3)
    script = Path(__file__).with_name("ddp_grpo.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with balancer([f"127.0.0.1:{s.port}" for s in servers]) as url:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(script), url, str(tiny_model), str(tmp_path), str(STEPS),
        ]  # fmt: skip
        run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while (httpx.get(url + "/healthz", timeout=30).json()["last_iteration"] or 0) < 1:
                assert run.poll() is None, run.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "the run did not reach its second step"
                time.sleep(0.05)
            servers[0].kill()
            running_at_kill = run.poll() is None
            output, _ = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
        assert run.returncode == 0, output[-3000:]
        assert running_at_kill
        assert any("took over serving" in s.log.read_text() for s in servers[1:])
        batches = {i: httpx.post(url + "/sample", json={"iteration": i, "batch_size": 1}).json() for i in range(STEPS)}
        assert graded(url) == 4 * STEPS  # each step's four completions, once
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["requested"] == ranks[1]["requested"] == list(range(len(ranks[0]["requested"])))
    for step in range(STEPS):
        rows = [(sid, idx) for r in ranks for call in r["calls"] if call["iteration"][0] == step
                for sid, idx in zip(call["sample_id"], call["completion_index"], strict=True)]  # fmt: skip
        assert Counter(rows) == Counter((s["sample_id"], k) for s in batches[step]["samples"] for k in range(4))
    # The batches a single server of the curriculum serves, on a state of its own.
    single = server_process(
        [str(curriculum_file), "--database-url", str(tmp_path / "single.db"), "--grader-workers", "1"]
    )
    for step in range(STEPS):
        alone = httpx.post(single.url + "/sample", json={"iteration": step, "batch_size": 1}).json()
        assert alone["samples"] == batches[step]["samples"]
