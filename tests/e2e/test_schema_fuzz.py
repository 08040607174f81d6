"""Schemathesis over the live ``/openapi.json``: generated requests, valid and not, against a real server.

No answer may be a 5xx, carry a status the schema does not declare, or break its declared body schema; and
data the schema rejects must be rejected. With an API key, a request without it must be refused. Bounded:
a fixed number of examples per operation.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
]


@pytest.mark.parametrize("api_key", [None, "fuzz-key"], ids=["no-key", "key"])
def test_generated_requests_get_only_documented_answers(
    server_process: Callable[..., Any], tmp_path: Path, api_key: str | None
) -> None:
    # How far past the run's latest iteration a /sample may reach depends on what was sampled before, which no
    # schema can say: here any iteration in the schema's range may be new.
    # A label that is not a sample id is graded by the default source, so that /score and the other trainers'
    # routes grade what the fuzzer sends rather than refuse it.
    env = {
        "PROCTOR_MAX_ITERATION_LEAP": str(2**53 - 1),
        "PROCTOR_PEER_DEFAULT_SOURCE": "add_1d",
        **({"PROCTOR_API_KEY": api_key} if api_key else {}),
    }
    server = server_process(
        ["curricula/arithmetic.yaml", "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"],
        cwd=ROOT,
        env=env,
    )
    checks = [*CHECKS, "ignored_auth"] if api_key else CHECKS
    command = [
        str(Path(sys.executable).parent / "st"),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        ",".join(checks),
        "--max-examples",
        "60",
        # One worker: with two, CPython 3.11's ast.parse (which Hypothesis calls to describe its filters)
        # sometimes fails with "AST constructor recursion depth mismatch" when two threads parse at once.
        "--workers",
        "1",
        "--seed",
        "1",
        # Past the longest long poll a dispatch may ask for (wait_s, at most 30 s): a consumer the stateful
        # phase registered, with no row ready, is answered only then.
        "--request-timeout",
        "35",
        *(["--header", f"Authorization: Bearer {api_key}"] if api_key else []),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    out = result.stdout
    # Any failed check fails the run (above). Schemathesis also warns when most of an operation's generated
    # requests are refused, a sampling heuristic; that is expected only where acceptance depends on what the
    # server holds, which no schema can say: a lease must be live (collect, collections), a consumer registered
    # (dispatch, dispatches), an iteration keeps the batch_size it was first sampled with (/sample), a refill
    # needs a step sampled in a stage that refills and graded (/refill), and a generated label that has a sample
    # id's shape must name a record the server has (/score and the other trainers' routes).
    stateful = {
        "POST /experience/leases/{lease}/collect",
        "POST /experience/consumers/{name}/dispatch",
        "POST /experience/consumers/{name}/dispatches",
        "POST /experience/consumers/{name}/collections",
        "POST /sample",
        "POST /refill",
        "POST /score",
        "POST /openrlhf/reward",
        "POST /slime/reward",
    }
    warned = set(re.findall(r"^\s+- (POST \S+|GET \S+|PUT \S+)$", out, flags=re.MULTILINE))
    assert "No issues found" in out or ("1 warning in" in out and "mostly rejected generated data" in out), out[-3000:]
    assert warned <= stateful, out[-3000:]
    assert "25 selected / 25 total" in result.stdout  # every route was exercised, /openapi.json itself aside
