"""``proctor regrade`` against a real dataserver: scores beside the old ones under the graders' version, a table of
changed verdicts by source, nothing graded twice, and a regrade killed with SIGKILL going on where it stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proctor.client import ProctorClient
from proctor.client.experience import ExperienceClient
from proctor.server.grade_worker import source_graders
from proctor.server.regrade import grader_version, only_grader

pytestmark = pytest.mark.e2e
PROMPTS, GROUP = 32, 4

# `right` compares with the answer; `nap` gives 1.0, and sleeps when NAP is set (in the regrade's grader
# processes only), so that a regrade takes long enough to be killed in its middle.
GRADERS = """
import os, time

def right(sample):
    return float(sample.response.strip() == (sample.answer or ""))

def nap(sample):
    if os.environ.get("NAP"):
        time.sleep(float(os.environ["NAP"]))
    return 1.0
"""
ROWS = [{"q": f"Say {n}.", "a": str(n)} for n in range(200)]
CURRICULUM = {
    "name": "regrade",
    "seed": 4,
    "sources": {
        "words": {"path": "words.jsonl", "prompt_field": "q", "answer_field": "a", "graders": ["right", "nap"]},
        "sums": {"kind": "arithmetic", "graders": ["numeric"]},
    },
    "graders": {"right": {"python": "./graders.py:right"}, "nap": {"python": "./graders.py:nap"}},
    "stages": [{"name": "only", "until_step": 100, "mix": [{"source": "words", "weight": 3}, {"source": "sums"}]}],
}


@pytest.fixture
def served(server_process: Callable[..., Any], tmp_path: Path) -> Any:
    folder = tmp_path / "regrade"
    folder.mkdir()
    (folder / "graders.py").write_text(GRADERS)
    (folder / "words.jsonl").write_text("".join(f'{{"q": "{r["q"]}", "a": "{r["a"]}"}}\n' for r in ROWS))
    (folder / "regrade.yaml").write_text(yaml.safe_dump(CURRICULUM, sort_keys=False))
    server = server_process(
        [str(folder / "regrade.yaml"), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"]
    )
    with ProctorClient(server.url) as client:
        for iteration in range(2):
            samples = client.sample(iteration, PROMPTS).samples
            items = []
            for s in samples:
                answer = s.prompt.removeprefix("Say ").removesuffix(".") if s.dataset_id == "words" else "0"
                for k in range(GROUP):  # half of each group right
                    text = answer if k % 2 == 0 else "no"
                    items.append({"sample_id": s.sample_id, "slot": s.slot, "completion": text, "completion_index": k})
            httpx.post(
                server.url + "/grade", json={"iteration": iteration, "items": items}, timeout=60
            ).raise_for_status()
        yield server, client


def regrade(url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "proctor.cli", "regrade", "--server", url, "--workers", "1", *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )


def table(out: str) -> dict[str, tuple[int, int, int]]:
    rows = re.findall(r"^\| (\w+) \| ([\d,]+) \| ([\d,]+)(?: \([\d.]+%\))? \| ([\d,]+) \|$", out, flags=re.MULTILINE)
    return {source: tuple(int(x.replace(",", "")) for x in rest) for source, *rest in rows}  # type: ignore[misc]


def test_a_regrade_writes_beside_the_old_scores_and_counts_changed_verdicts(served: Any, tmp_path: Path) -> None:
    server, client = served
    graders = source_graders(client.graders())
    # One grader: `nap` alone gives 1.0, where the reward was right's and nap's mean (1.0 or 0.5).
    run = regrade(server.url, "--grader", "nap")
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 0, out
    counts = table(out)
    version = grader_version(only_grader(graders, "nap"))
    assert f"reward.{version}" in out
    words_rows = counts["words"][0]
    assert counts["words"] == (words_rows, words_rows // 2, 0)  # the wrong half changed: 0.5 → 1.0
    assert counts["sums"] == (counts["sums"][0], 0, counts["sums"][0])  # no `nap` grader there
    assert words_rows + counts["sums"][0] == 2 * PROMPTS * GROUP
    # The old scores are kept, and the new ones sit beside them.
    experience = ExperienceClient(client=client)
    cells = experience.read(0, [(s, k) for s in range(PROMPTS) for k in range(GROUP)], ["reward", f"reward.{version}"])
    assert any(r == 0.5 for r in cells["reward"]) and all(r is not None for r in cells[f"reward.{version}"])
    # Again: nothing left to regrade, the same table.
    again = regrade(server.url, "--grader", "nap")
    out_again, _ = again.communicate(timeout=120)
    assert "regraded 0 completions here" in out_again and table(out_again) == counts
    # Every grader, as the curriculum has them: other columns, and not one verdict changed.
    whole = regrade(server.url, "--iterations", "1:2")
    out_whole, _ = whole.communicate(timeout=120)
    assert f"reward.{grader_version(graders)}" in out_whole
    assert all(changed == 0 and failed == 0 for _, changed, failed in table(out_whole).values())
    assert sum(rows for rows, _, _ in table(out_whole).values()) == PROMPTS * GROUP  # iteration 1 only
    # A stage names the steps it served; one the curriculum does not have is refused, naming its stages.
    staged = regrade(server.url, "--stage", "only", "--grader", "nap")
    assert table(staged.communicate(timeout=120)[0]) == counts
    wrong = regrade(server.url, "--stage", "later")
    out_wrong, _ = wrong.communicate(timeout=120)
    assert wrong.returncode == 2 and "--stage 'later': the curriculum's stages are: only" in out_wrong


def test_a_regrade_killed_in_its_middle_goes_on_where_it_stopped(served: Any) -> None:
    server, client = served
    version = grader_version(only_grader(source_graders(client.graders()), "nap"))
    consumer = f"regrade.{version}"
    first = regrade(server.url, "--grader", "nap", "--rows-per-dispatch", "4", env={"NAP": "0.02"})
    # Killed as soon as it has collected something, and before it is done.
    while True:
        answer = httpx.get(f"{server.url}/experience/consumers/{consumer}/tables/0")
        if answer.status_code == 200 and answer.json()["consumed"] > 0:
            break
        assert first.poll() is None, first.communicate()[0]
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    done_before = httpx.get(f"{server.url}/experience/consumers/{consumer}/tables/0").json()["consumed"]
    second = regrade(server.url, "--grader", "nap", "--rows-per-dispatch", "64")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    regraded = int(re.search(r"regraded (\d+) completions here", out).group(1))  # type: ignore[union-attr]
    counts = table(out)
    total = sum(rows for rows, _, _ in counts.values())
    assert total == 2 * PROMPTS * GROUP  # every graded completion once
    assert 0 < regraded < total and total - regraded >= done_before  # it went on from where the first stopped


def test_the_regrade_pages_commands_run_as_written(server_process: Callable[..., Any], tmp_path: Path) -> None:
    """Each line of docs/regrade.md's first example, against a server of the shipped arithmetic curriculum with
    graded completions."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "regrade.md").read_text()
    block = re.search(r"```bash\n(.*?)```", page, flags=re.DOTALL)
    assert block is not None
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]
    server = server_process(["arithmetic", "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"])
    with ProctorClient(server.url) as client:
        samples = client.sample(0, 4).samples
        items = [{"sample_id": s.sample_id, "slot": s.slot, "completion": str(k)} for s in samples for k in range(2)]
        httpx.post(server.url + "/grade", json={"iteration": 0, "items": items}, timeout=60).raise_for_status()
    env = {**os.environ, "PROCTOR_URL": server.url, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for line in lines:
        run = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (line, run.stdout, run.stderr)
        assert sum(rows for rows, _, _ in table(run.stdout).values()) == len(items), (line, run.stdout)
