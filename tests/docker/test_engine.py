"""docker/ on a real Docker engine: the image built, compose's dataserver up, the docs' curl tour against the
container, its state kept across a stop and a start (with ``docker-compose`` v1); the python_code curriculum,
whose programs the unprivileged dataserver refuses to run and the sandbox profile's code-worker runs isolated;
an image built with the procedural extras serving their sources; then the cluster profile (with ``docker
compose`` v2): PostgreSQL, two servers of it behind nginx, two grade-worker containers that do the grading, and
the serving server killed, the other taking over.

The base image comes from Debian's packages (``docker/debian-base.sh``: debootstrap, then ``docker import``), or
from ``PROCTOR_TEST_BASE_IMAGE`` where a registry is reachable (``python:3.11-slim``); the cluster's postgres and
nginx images are built on it from Debian's packages too (``tests/docker/services/``). Without a running engine
(``dockerd``) the module is skipped, saying so; ``.ci/run`` starts one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from proctor.cli.launcher import free_port
from tests.conftest import system_command
from tests.e2e.test_readme import readme_examples

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"
IMAGE = "proctor-e2e:test"
BASE = "proctor-base:bookworm"
SERVICES = ROOT / "tests" / "docker" / "services"
pytestmark = pytest.mark.e2e


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert run.returncode == 0, f"docker {' '.join(args)}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def image() -> str:
    """The dataserver's image, built from this checkout."""
    if shutil.which("docker") is None or docker("info", check=False, timeout=30).returncode != 0:
        pytest.skip("needs a running Docker engine: apt-get install docker.io, then start dockerd")
    base = os.environ.get("PROCTOR_TEST_BASE_IMAGE", BASE)
    if docker("image", "inspect", base, check=False).returncode != 0:
        if base != BASE or os.geteuid() != 0 or shutil.which("debootstrap") is None:
            pytest.skip(
                f"no image {base}, and building {BASE} needs root and debootstrap (apt-get install debootstrap)"
            )
        build = subprocess.run(
            [str(ROOT / "docker" / "debian-base.sh"), BASE], capture_output=True, text=True, timeout=900
        )
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    args = ["build", "-f", "docker/Dockerfile", "--target", "server", "--build-arg", f"BASE_IMAGE={base}"]
    built = subprocess.run(["docker", *args, "-t", IMAGE, "."], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return IMAGE


EXTRAS_IMAGE = "proctor-e2e-extras:test"


@pytest.fixture(scope="module")
def extras_image(image: str) -> str:
    """The dataserver's image with the procedural extras (``--build-arg EXTRAS=…``), on the same base."""
    base = os.environ.get("PROCTOR_TEST_BASE_IMAGE", BASE)
    args = ["build", "-f", "docker/Dockerfile", "--target", "server", "--build-arg", f"BASE_IMAGE={base}"]
    args += ["--build-arg", "EXTRAS=reasoning-gym,reasoning-core", "-t", EXTRAS_IMAGE, "."]
    built = subprocess.run(["docker", *args], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return EXTRAS_IMAGE


@pytest.fixture(scope="module")
def services(image: str) -> dict[str, str]:
    """The cluster's postgres and nginx images, from Debian's packages on the same base, as compose's variables."""
    base = os.environ.get("PROCTOR_TEST_BASE_IMAGE", BASE)
    tags = {"POSTGRES_IMAGE": "proctor-e2e-postgres:test", "NGINX_IMAGE": "proctor-e2e-nginx:test"}
    for target, tag in zip(("postgres", "nginx"), tags.values(), strict=True):
        args = ["build", "-f", "Dockerfile", "--target", target, "--build-arg", f"BASE_IMAGE={base}", "-t", tag, "."]
        built = subprocess.run(["docker", *args], cwd=SERVICES, capture_output=True, text=True, timeout=900)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return tags


@dataclass
class Deployment:
    url: str
    project: str
    env: dict[str, str]
    implementation: list[str]  # docker-compose (v1), or docker compose (v2)

    def compose(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        # The profiles named always: `up` starts what is asked for, and `down` stops all of it.
        command = [*self.implementation, "-f", str(COMPOSE), "-p", self.project]
        command += ["--profile", "cluster", "--profile", "sandbox"]
        command += args
        run = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert run.returncode == 0, f"{' '.join(args)}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
        return run

    def container(self) -> str:
        return self.compose("ps", "-q", "dataserver").stdout.strip()

    def wait_until_healthy(self) -> None:
        wait_until_healthy(self.container(), lambda: self.compose("logs").stdout)


def wait_until_healthy(container: str, output: Callable[[], str]) -> None:
    """Up, and healthy by the image's own health check (as Docker runs it); ``output`` says why not."""
    deadline = time.monotonic() + 180  # a liveness bound: the first health check comes 10 s after start
    while True:
        status = docker("inspect", "--format", "{{.State.Health.Status}}", container).stdout.strip()
        if status == "healthy":
            return
        assert time.monotonic() < deadline, f"the dataserver is {status}:\n{output()[-3000:]}"
        time.sleep(1)


def compose_v1() -> list[str]:
    return [system_command("docker-compose")]


def compose_v2() -> list[str]:
    if docker("compose", "version", check=False).returncode != 0:
        pytest.fail("docker compose (v2) is not installed: `make test` installs it (as root): docker/compose-v2.sh")
    return ["docker", "compose"]


@contextlib.contextmanager
def deployed(
    image: str, name: str, *up: str, implementation: list[str], cluster: bool = False, **env: str
) -> Iterator[Deployment]:
    """``compose up -d UP…`` on a free loopback port, with fresh volumes; down at the end. With ``cluster``, the
    balancer's port is the one published, and the deployment is up once it answers."""
    port = free_port()
    # None of the shell's PROCTOR_* variables (an API key, say): compose would pass them into the container.
    shell = {k: v for k, v in os.environ.items() if not k.startswith("PROCTOR_")}
    published = "PROCTOR_CLUSTER_PUBLISH" if cluster else "PROCTOR_PUBLISH"
    environment = {**shell, "PROCTOR_IMAGE": image, published: f"127.0.0.1:{port}", **env}
    d = Deployment(f"http://127.0.0.1:{port}", f"proctor-e2e-{name}-{os.getpid()}", environment, implementation)
    try:
        d.compose("up", "-d", "--no-build", *up, timeout=300)
        if cluster:
            answers(lambda: httpx.get(d.url + "/healthz", timeout=10), d)
        else:
            d.wait_until_healthy()
        yield d
    finally:
        d.compose("down", "--volumes", timeout=300)


def answers(call: Callable[[], httpx.Response], d: Deployment) -> httpx.Response:
    """``call()`` until it answers other than 502, 503 or 504 (nothing serves yet, a server is taking over, or the
    balancer timed out connecting to the servers that are gone and got no answer from the others) and connects;
    a liveness bound, not a timing claim."""
    deadline = time.monotonic() + 180
    while True:
        try:
            answer = call()
            if answer.status_code not in (502, 503, 504):
                return answer
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, d.compose("logs", "--no-color").stdout[-3000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def deployment(image: str) -> Iterator[Deployment]:
    """compose's dataserver alone."""
    with deployed(image, "single", "dataserver", implementation=compose_v1()) as d:
        yield d


def test_the_docs_curl_tour_runs_against_the_container(deployment: Deployment) -> None:
    system_command("curl")
    env = {**os.environ, "PROCTOR_URL": deployment.url}
    examples = readme_examples()
    assert len(examples) >= 8
    for command, out_lang, expected in examples:
        result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, (command, result.stderr)
        if out_lang == "json":
            assert json.loads(result.stdout) == json.loads(expected), command
        else:
            assert result.stdout.strip() == expected.strip(), command


def test_the_state_survives_a_stop_and_a_start(deployment: Deployment) -> None:
    body = {"iteration": 50, "batch_size": 4}
    first = httpx.post(deployment.url + "/sample", json=body, timeout=30)
    assert first.status_code == 200, first.text
    before = httpx.get(deployment.url + "/curriculum", timeout=30).json()
    deployment.compose("stop", "dataserver")  # SIGTERM, as for any stop
    deployment.compose("start", "dataserver")
    deployment.wait_until_healthy()
    again = httpx.post(deployment.url + "/sample", json=body, timeout=30)
    assert again.json() == first.json()  # the same batch, read back from the volume
    after = httpx.get(deployment.url + "/curriculum", timeout=30).json()
    assert (after["last_iteration"], after["transitions"]) == (before["last_iteration"], before["transitions"])
    logs = deployment.compose("logs", "--no-color", "dataserver").stdout
    assert "stopped: grader processes ended" in logs  # the stop was a clean shutdown
    assert "GET /healthz" not in logs  # the health checks stay out of the INFO log


CODE = "/app/curricula/python_code.yaml"
# The processes of the sandbox's uids (its runs take uids from 1,900,000 on), zombies included, as a Python line.
LEFT_BEHIND = "[p for p in os.listdir('/proc') if p.isdigit() and os.stat('/proc/' + p).st_uid >= 1_900_000]"
# Programs that reach beyond their sandbox: each test of theirs errs, where the reference solution's pass.
REACHING_OUT = {
    "network": "import socket\nsocket.create_connection(('dataserver', 8000), timeout=2)\n",
    "write": "open('/tmp/escaped', 'w').write('out')\n",
}


# A program that passes, and leaves a process running for the sandbox to kill (and the container's init to reap).
LEAVING = "import subprocess\nsubprocess.Popen(['sleep', '300'])\n"


def code_items(batch: dict[str, object]) -> list[dict[str, object]]:
    """For each sampled function: its reference solution (index 0), the solution after ``LEAVING`` (index 1),
    then each program of ``REACHING_OUT`` followed by the solution."""
    records = (ROOT / "curricula" / "data" / "python_functions.jsonl").read_text().splitlines()
    items: list[dict[str, object]] = []
    for s in batch["samples"]:  # type: ignore[attr-defined]
        solution = json.loads(records[int(s["sample_id"].rsplit(":", 1)[1])])["answer"]
        programs = [solution, LEAVING + solution, *(prelude + solution for prelude in REACHING_OUT.values())]
        for n, program in enumerate(programs):
            item = {"sample_id": s["sample_id"], "slot": s["slot"], "completion_index": n}
            items.append({**item, "completion": f"```python\n{program}```"})
    return items


def test_code_is_refused_by_the_dataserver_and_run_isolated_by_the_sandbox_profile(image: str) -> None:
    """The dataserver runs as an unprivileged user: its grader refuses to run programs, saying what to change.
    With the sandbox profile the code-worker container grades them, each run in namespaces and a uid of its
    own: the reference solutions pass, and a program reaching the network or writing outside its directory
    fails every test."""
    body = {"iteration": 0, "batch_size": 2}
    with deployed(image, "code", "dataserver", implementation=compose_v1(), PROCTOR_CURRICULUM=CODE) as d:
        batch = httpx.post(d.url + "/sample", json=body, timeout=30).json()
        results = httpx.post(d.url + "/grade", json={"iteration": 0, "items": code_items(batch)}, timeout=60).json()
        for r in results["results"]:
            assert r["reward"] == 0.0
            assert "needs namespaces isolation, this machine gives rlimits" in r["error"], r["error"]
            assert "docker/compose.yaml's sandbox profile" in r["error"]
    up = ["dataserver", "code-worker"]
    with deployed(
        image, "sandbox", *up, implementation=compose_v1(), PROCTOR_GRADER_WORKERS="0", PROCTOR_CURRICULUM=CODE
    ) as d:
        batch = httpx.post(d.url + "/sample", json=body, timeout=30).json()
        items = code_items(batch)
        graded = answers(lambda: httpx.post(d.url + "/grade", json={"iteration": 0, "items": items}, timeout=120), d)
        assert graded.status_code == 200, graded.text
        for item, r in zip(items, graded.json()["results"], strict=True):
            code = r["details"]["code"]
            assert r["error"] is None and code["isolation"] == "namespaces", r
            if item["completion_index"] in (0, 1):
                assert r["reward"] == 1.0, r
            else:
                assert r["reward"] == 0.0 and set(code["tests"]) == {"error"}, r
        worker = d.compose("ps", "-q", "code-worker").stdout.strip()
        assert docker("exec", worker, "test", "-e", "/tmp/escaped", check=False).returncode == 1
        # Nothing of the runs' uids is left, not even a zombie.
        assert docker("exec", worker, "python", "-c", f"import os; print({LEFT_BEHIND})").stdout.strip() == "[]"


# Run in the image as root without CAP_SYS_ADMIN (Docker's default): the sandbox's uid isolation, and what it keeps.
UID_LEVEL = f"""
import json, os, subprocess
from proctor.server.grading.sandbox import Isolation, SandboxLimits, SandboxUnavailable, available_isolation, run_program
program = "import os, subprocess\\nsubprocess.Popen(['sleep', '300'])\\nopen('/tmp/uid-level', 'w').write('x')\\n"
tests = ["assert os.getuid() >= 1_900_000", "assert os.getuid() != 0"]
run = run_program(program, tests, SandboxLimits(), require=Isolation.UID)
left = {LEFT_BEHIND}
try:
    run_program("pass", ["pass"], SandboxLimits())
    refused = ""
except SandboxUnavailable as exc:
    refused = str(exc)
print(json.dumps({{"level": available_isolation().name, "verdicts": run.verdicts, "isolation": run.isolation.name,
                  "wrote": os.path.exists('/tmp/uid-level'), "left": left, "refused": refused}}))
"""


def test_the_sandbox_falls_back_to_uid_isolation_as_root_without_the_capability(image: str) -> None:
    """Root in a container without CAP_SYS_ADMIN: no namespaces, so a run asking for them is refused, naming the
    fix; one that accepts ``uid`` runs under a uid of its own (it may write to /tmp, as documented), and nothing it
    started outlives it."""
    # With an init as PID 1, as the sandbox profile runs (proctor as PID 1 would not reap what the sandbox killed).
    command = ["run", "--rm", "--init", "--user", "root", "--entrypoint", "python", image, "-c", UID_LEVEL]
    run = docker(*command, timeout=120)
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["level"] == "UID" and seen["isolation"] == "UID"
    assert seen["verdicts"] == ["pass", "pass"]
    assert seen["wrote"] and seen["left"] == []
    assert "needs namespaces isolation, this machine gives uid" in seen["refused"]
    assert "docker/compose.yaml's sandbox profile" in seen["refused"]


PROCEDURAL = """\
name: procedural
seed: 5
sources:
  sums: {kind: reasoning_gym, dataset: chain_sum, size: 100, graders: [reasoning_gym]}
  logic: {kind: reasoning_core, task: arithmetics, level: 0, size: 100, graders: [reasoning_core]}
stages:
  - name: both
    until_step: 10
    mix: [{source: sums, weight: 1.0}, {source: logic, weight: 1.0}]
"""


def test_an_image_built_with_the_procedural_extras_serves_and_grades_their_sources(
    extras_image: str, tmp_path: Path
) -> None:
    """``--build-arg EXTRAS=reasoning-gym,reasoning-core``: the shipped reasoning ladder and a curriculum of both
    kinds serve, and each record's own answer grades 1.0 there (the answers read from the same curricula here)."""
    from proctor.server.curriculum.loader import load_curriculum
    from proctor.server.shipped import builtin_path
    from proctor.server.sources.base import SampleId

    (tmp_path / "procedural.yaml").write_text(PROCEDURAL)
    tmp_path.chmod(0o755)  # mounted into the container, whose server runs as another user
    for path, inside in [
        (builtin_path("reasoning_ladder"), "/app/curricula/reasoning_ladder.yaml"),
        (tmp_path / "procedural.yaml", "/extra/procedural.yaml"),
    ]:
        port = free_port()
        run = ["run", "-d", "--init", "-p", f"127.0.0.1:{port}:8000", "-v", f"{tmp_path}:/extra:ro"]
        container = docker(*run, "-e", f"PROCTOR_CURRICULUM={inside}", extras_image).stdout.strip()
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_healthy(container, functools.partial(logs, container))
            curriculum = load_curriculum(path)
            batch = httpx.post(url + "/sample", json={"iteration": 0, "batch_size": 8}, timeout=60).json()
            items = []
            for s in batch["samples"]:
                sid = SampleId.parse(s["sample_id"])
                answer = curriculum.sources[sid.source].record(sid.key).answer
                completion = f"<think>reasoning</think><answer>{answer}</answer>"
                items.append({"sample_id": s["sample_id"], "slot": s["slot"], "completion": completion})
            graded = httpx.post(url + "/grade", json={"iteration": 0, "items": items}, timeout=120)
            assert graded.status_code == 200, graded.text
            assert [(r["reward"], r["error"]) for r in graded.json()["results"]] == [(1.0, None)] * len(items)
        finally:
            docker("rm", "-f", container)


def test_the_cluster_serves_through_its_balancer_and_survives_losing_its_serving_server(
    image: str, services: dict[str, str]
) -> None:
    """Three servers of the database behind nginx, two grade-workers. The serving server is cut off the network
    (another takes over once PostgreSQL's keepalive probes drop its connection), then the next one is killed
    (the last takes over at once); each time the same batch and the same grades, counted once."""
    up = ["--scale", "replica=3", "--scale", "grade-worker=2", "balancer", "grade-worker"]
    # No grader processes in the servers: a /grade is answered only if the grade-workers grade.
    with deployed(
        image, "cluster", *up, implementation=compose_v2(), cluster=True, PROCTOR_GRADER_WORKERS="0", **services
    ) as d:
        replicas = d.compose("ps", "-q", "replica").stdout.split()
        assert len(replicas) == 3 and len(d.compose("ps", "-q", "grade-worker").stdout.split()) == 2
        assert not d.compose("ps", "-q", "dataserver").stdout.strip()  # the single server stays down
        # Each server, asked directly inside its container, answers the same batch for the same iteration.
        ask = (
            "import urllib.request; r = urllib.request.Request('http://127.0.0.1:8000/sample', "
            'data=b\'{"iteration": 0, "batch_size": 4}\', headers={"Content-Type": "application/json"}); '
            "print(urllib.request.urlopen(r, timeout=30).read().decode())"
        )
        direct = [json.loads(docker("exec", c, "python", "-c", ask).stdout) for c in replicas]
        assert direct[0] == direct[1] == direct[2]
        batch = httpx.post(d.url + "/sample", json={"iteration": 0, "batch_size": 4}, timeout=30).json()
        assert batch == direct[0]
        items = [{"sample_id": s["sample_id"], "slot": s["slot"], "completion": "7"} for s in batch["samples"]]
        graded = httpx.post(d.url + "/grade", json={"iteration": 0, "items": items}, timeout=120)
        assert graded.status_code == 200, graded.text
        rewards = [r["reward"] for r in graded.json()["results"]]
        assert [r["error"] for r in graded.json()["results"]] == [None] * 4

        def serving(candidates: list[str]) -> str:
            [one] = [c for c in candidates if "serving curriculum" in logs(c) or "took over serving" in logs(c)]
            return one

        def serves_on() -> None:
            again = answers(
                lambda: httpx.post(d.url + "/sample", json={"iteration": 0, "batch_size": 4}, timeout=30), d
            )
            assert again.json() == batch  # from the database
            regraded = answers(
                lambda: httpx.post(d.url + "/grade", json={"iteration": 0, "items": items}, timeout=120), d
            )
            assert [r["reward"] for r in regraded.json()["results"]] == rewards
            assert all(r["cached"] for r in regraded.json()["results"])  # graded once

        cut = serving(replicas)
        docker("network", "disconnect", f"{d.project}_default", cut)
        serves_on()
        left = [c for c in replicas if c != cut]
        killed = serving(left)
        docker("kill", killed)
        serves_on()
        [last] = [c for c in left if c != killed]
        assert "took over serving" in logs(last)


def logs(container: str) -> str:
    run = docker("logs", container)
    return run.stdout + run.stderr
