"""docker/: what can be checked without a Docker engine.

The dataserver's command line and environment are read from compose.yaml and the Dockerfile and run here,
outside Docker: the image's paths are mapped onto this checkout (curricula/) and a temporary folder (the
state volume), and the port onto a free one. The image build itself needs a Docker engine.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proctor.cli.launcher import free_port
from tests.conftest import system_command

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return doc


def dockerfile_stage(stage: str) -> dict[str, Any]:
    """ENV, ENTRYPOINT, CMD and HEALTHCHECK of one stage, following its FROM chain."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"FROM (\S+) AS (\S+)", line):
            parent = stages.get(m.group(1), {})
            current = {"env": dict(parent.get("env", {})), **{k: v for k, v in parent.items() if k != "env"}}
            stages[m.group(2)] = current
        elif line.startswith("ENV "):
            current["env"].update(re.findall(r"(\w+)=(\S+)", line[4:]))
        elif line.startswith(("ENTRYPOINT ", "CMD ")):
            key, _, value = line.partition(" ")
            current[key.lower()] = json.loads(value)
        elif line.startswith("HEALTHCHECK "):
            current["healthcheck"] = json.loads(line[line.index("CMD ") + 4 :])
    return stages[stage]


def substitute(value: str) -> str:
    """Compose's ${VAR:-default} with an empty environment."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1), m.group(2)), value)


def host_path(value: str, mounts: dict[str, Path]) -> str:
    for container, host in mounts.items():
        if value.startswith(container):
            return str(host) + value[len(container) :]
    return value


def test_the_compose_dataserver_runs_here(tmp_path: Path) -> None:
    service = compose()["services"]["dataserver"]
    image = dockerfile_stage(service["build"]["target"])
    mounts = {"/data": tmp_path / "state-volume"}
    mounts["/data"].mkdir()
    for volume in service["volumes"]:
        source, target, *_ = volume.split(":")
        if source.startswith("."):  # a bind mount, relative to the compose file
            mounts[target] = (DOCKER / source).resolve()
    # A variable without a value is passed on from the shell when it is set there (none is, here).
    given = {k: substitute(str(v)) for k, v in service["environment"].items() if v is not None}
    env = {**image["env"], **given}
    env = {k: host_path(v, mounts) for k, v in env.items()}
    port = free_port()
    env["PROCTOR_PORT"] = str(port)
    env["PROCTOR_HOST"] = "127.0.0.1"  # 0.0.0.0 in the container; loopback is enough here
    argv = [*image["entrypoint"], *service["command"]]
    assert argv == ["proctor", "serve"]
    proctor = str(Path(sys.executable).with_name("proctor"))
    proc = subprocess.Popen(
        [proctor, *argv[1:]], env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the dataserver did not come up"
            time.sleep(0.1)
        sample = httpx.post(url + "/sample", json={"iteration": 0, "batch_size": 4})
        assert sample.status_code == 200
        assert sample.json()["stage"] == "one_digit"  # the compose default: curricula/arithmetic.yaml
        meta = httpx.get(url + "/meta").json()
        assert meta["curriculum"] == "arithmetic"
        # Both health checks, as Docker would run them (their port mapped like the server's).
        for check in (image["healthcheck"], service["healthcheck"]["test"][1:]):
            cmd = [c.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for c in check]
            cmd[0] = sys.executable if cmd[0] == "python" else cmd[0]
            assert subprocess.run(cmd, env={**os.environ, **env}, timeout=30).returncode == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
    # uvicorn re-raises the SIGTERM it handled once shut down, so the exit status says why it stopped.
    assert proc.returncode == -signal.SIGTERM, out
    assert "stopped: grader processes ended" in out
    # The run's state landed in the volume, named for the curriculum and its hash.
    assert [f.name for f in mounts["/data"].glob("*.db")] == [f"arithmetic-{meta['curriculum_hash']}.db"]


def test_the_image_serves_the_default_curriculum_as_a_non_root_user() -> None:
    image = dockerfile_stage("server")
    assert image["env"]["PROCTOR_CURRICULUM"] == "/app/curricula/arithmetic.yaml"
    assert image["env"]["PROCTOR_STATE_DIR"] == "/data"
    text = (DOCKER / "Dockerfile").read_text()
    assert "USER proctor" in text
    assert 'VOLUME ["/data"]' in text
    assert "EXPOSE 8000" in text
    # The dependency layer is built from pyproject.toml before any source is copied.
    assert text.index("COPY pyproject.toml") < text.index("COPY server")


def test_the_image_copies_every_installed_folder() -> None:
    # `pip install .` in the image installs the packages pyproject.toml finds in the source roots; a root left out
    # of the image (cli/, which holds the `proctor` command) would make the build fail.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()}
    assert folders == {"server", "client", "cli", "curricula"}
    text = (DOCKER / "Dockerfile").read_text()
    for folder in sorted(folders):
        assert f"COPY {folder} ./{folder}" in text, folder


def compose_implementation(version: str) -> list[str]:
    if version == "v1":
        return [system_command("docker-compose")]
    docker = system_command("docker")
    if subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail("docker compose (v2) is not installed: `make test` installs it (as root): docker/compose-v2.sh")
    return [docker, "compose"]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize(
    "profiles",
    [[], ["train"], ["monitoring"], ["cluster"], ["sandbox"]],
    ids=["default", "train", "monitoring", "cluster", "sandbox"],
)
def test_both_compose_implementations_accept_the_file(profiles: list[str], version: str) -> None:
    args = [a for p in profiles for a in ("--profile", p)]
    run = subprocess.run(
        [*compose_implementation(version), "-f", str(DOCKER / "compose.yaml"), *args, "config"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith(("PROCTOR_", "POSTGRES_"))},
    )
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    assert "dataserver" in services
    assert services["dataserver"]["restart"] == "unless-stopped"
    if profiles == ["cluster"]:
        assert {"postgres", "replica", "balancer", "grade-worker"} <= set(services)
        state = services["replica"]["environment"]["PROCTOR_DATABASE_URL"]
        assert state == "postgresql://proctor:proctor@postgres:5432/proctor"
        port = services["balancer"]["ports"][0]  # v1 keeps the short form, v2 writes the long one
        short = port if isinstance(port, str) else f"{port['host_ip']}:{port['published']}:{port['target']}"
        assert short.removesuffix("/tcp") == "127.0.0.1:8080:8000"
    if profiles == ["sandbox"]:
        # Only the code-worker, whose sandbox makes namespaces and mounts, has the privilege to.
        worker = services["code-worker"]
        assert worker["command"] == ["grade-worker", "--server", "http://dataserver:8000"]
        assert (worker["user"], worker["cap_add"], worker["init"]) == ("root", ["SYS_ADMIN"], True)
        assert "cap_add" not in services["dataserver"] and "user" not in services["dataserver"]


def test_the_cluster_balancer_is_the_one_the_docs_show_and_the_tests_run() -> None:
    from bench._balancer import nginx_config, nginx_main

    lines = (DOCKER / "cluster" / "nginx.conf").read_text().splitlines(keepends=True)
    config = "".join(line for line in lines if not line.startswith("#"))
    assert config == nginx_main(nginx_config(["replica:8000"], "8000"))
    cluster = {name: svc for name, svc in compose()["services"].items() if svc.get("profiles") == ["cluster"]}
    assert cluster["balancer"]["volumes"] == ["./cluster/nginx.conf:/etc/nginx/nginx.conf:ro"]
    assert cluster["grade-worker"]["command"] == ["grade-worker", "--server", "http://balancer:8000"]
    assert cluster["replica"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert "ports" not in cluster["replica"]  # reached through the balancer only


def test_the_trainer_waits_for_a_healthy_dataserver() -> None:
    trainer = compose()["services"]["trainer"]
    assert trainer["profiles"] == ["train"]
    assert trainer["depends_on"] == {"dataserver": {"condition": "service_healthy"}}
    assert "http://dataserver:8000" in trainer["command"]
    assert trainer["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_the_dashboard_only_uses_metrics_the_server_exports(live_server: Any) -> None:
    dashboard = json.loads((DOCKER / "monitoring" / "grafana" / "proctor-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bproctor_[a-z_]+", e)}
    with live_server() as url:
        exported = httpx.get(url + "/metrics").text
    names = set(re.findall(r"^# TYPE (\S+) (\S+)", exported, flags=re.MULTILINE))
    available = set()
    for name, kind in names:
        available |= {name, f"{name}_total"} if kind == "counter" else {name}
        if kind == "histogram":
            available |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    assert used <= available, used - available
    assert {"proctor_current_stage", "proctor_stage_rolling_reward", "proctor_grader_errors_total"} <= used


def test_the_documented_build_builds_the_dataserver_and_nothing_of_the_trainer() -> None:
    # The server stage comes before the trainer's, so that a build of --target server never builds torch into a
    # stage (Docker's legacy builder builds every stage up to the target); the documented commands name it.
    text = (DOCKER / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE)
    assert stages.index("server") < stages.index("trainer")
    assert "docker build -f docker/Dockerfile --target server -t proctor ." in text
    assert (
        "docker build -f docker/Dockerfile --target server -t proctor ."
        in (ROOT / "docs" / "getting-started.md").read_text()
    )
    assert compose()["services"]["dataserver"]["build"]["target"] == "server"
    # The trainer is not a server: it has no health check, and none of the server's PROCTOR_* defaults.
    trainer = dockerfile_stage("trainer")
    assert "healthcheck" not in trainer
    assert not any(name.startswith("PROCTOR_") for name in trainer["env"])


def test_the_build_context_leaves_out_local_files_and_keeps_what_the_image_copies() -> None:
    ignored = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()[:1] not in ("", "#")
    ]
    for local in (".git", ".venv", "build", ".proctor", "*.db", "bench/results"):
        assert local in ignored, local
    copied = re.findall(r"^COPY (\S+) ", (DOCKER / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert {"pyproject.toml", "README.md", "server", "cli"} <= set(copied)
    for path in copied:
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), path
