"""Grade-workers as Ray actors (``proctor grade-worker --ray-actors``), on a local Ray instance: the grader role
of a dataserver that has no grader processes of its own, over the same HTTP lease protocol as any worker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from proctor.cli.grade_worker import GradeWorkerOptions
from proctor.cli.launcher import ServerProcess
from proctor.cli.ray_workers import RayGradeWorkers
from proctor.client import ProctorClient
from proctor.server.shipped import builtin_path
from proctor.wire.dataserver import GradeItem

DEADLINE_S = 120.0  # a liveness bound: every wait below ends far sooner
BATCH, GROUP = 4, 2


@pytest.fixture
def graderless(server_process: Callable[..., ServerProcess], tmp_path: Path) -> ServerProcess:
    """A ``proctor serve`` process with no grader processes: the grader role is left to workers."""
    return server_process(
        [str(builtin_path("arithmetic")), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "0"],
        env={"PROCTOR_GRADER_CLAIM_TIMEOUT_S": str(DEADLINE_S)},
    )


@pytest.fixture
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def grade_a_step(url: str) -> list[float | None]:
    """Sample step 0 and post a group of completions for each prompt, as a plain /grade; the rewards."""
    with ProctorClient(url, timeout=DEADLINE_S) as client:
        batch = client.sample(iteration=0, batch_size=BATCH)
        items = [
            GradeItem(sample_id=s.sample_id, slot=slot, completion=f"The answer is {k}.")
            for slot, s in enumerate(batch.samples)
            for k in range(GROUP)
        ]
        return [r.reward for r in client.grade(items, iteration=0).results]


def test_ray_actors_grade_a_plain_grade(graderless: ServerProcess, local_ray: None) -> None:
    workers = RayGradeWorkers(GradeWorkerOptions(graderless.url, processes=1), actors=2)
    try:
        rewards = grade_a_step(graderless.url)
    finally:
        stats = workers.stop()
    assert len(rewards) == BATCH * GROUP
    assert all(reward is not None for reward in rewards)
    assert sum(s.graded for s in stats) == BATCH * GROUP
    assert sum(s.refused for s in stats) == 0


def test_the_command_line_runs_its_actors_until_they_are_idle(graderless: ServerProcess) -> None:
    command = [
        sys.executable, "-m", "proctor.cli", "grade-worker", "--server", graderless.url,
        "--ray-actors", "2", "--exit-when-idle-s", "5", "--log-level", "warning",
    ]  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        worker = pool.submit(subprocess.run, command, capture_output=True, text=True, timeout=DEADLINE_S)
        rewards = grade_a_step(graderless.url)
        run = worker.result()
    assert run.returncode == 0, run.stderr
    assert all(reward is not None for reward in rewards)
    assert f"2 Ray actors stopped: {BATCH * GROUP} rows graded, 0 results refused (lease ended)" in run.stdout
