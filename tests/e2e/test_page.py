"""The live page at ``GET /``: its routes over real HTTP, and the page itself as headless Chromium renders it.

A real server in a thread is driven through /sample and /grade as a trainer would; the browser tests read the
rendered DOM (through the DevTools Protocol, see cdp.py) and compare it with what /dashboard answers. Chromium
is required, never skipped: without it the browser tests error out, saying how to install it.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from proctor.server.routes import page
from proctor.wire.dataserver import (
    Dashboard,
    GraderErrorEntry,
    IterationPoint,
    PassRateHistogram,
    StageState,
    Transition,
)
from tests.conftest import serve_in_thread
from tests.e2e.cdp import Browser, ChromiumMissing, find_chromium

pytestmark = pytest.mark.e2e

LiveServer = Callable[..., AbstractContextManager[str]]

QA_ANSWERS = {
    "Capital of France?": "Paris",
    "Colour of the sky?": "blue",
    "2 + 2?": "4",
    "Opposite of hot?": "cold",
    "Largest planet?": "Jupiter",
    "Frozen water?": "ice",
}
# A grader whose error message is markup: the page must show it as text.
EVIL_GRADER = """
def evil(sample):
    raise ValueError('<img src=x onerror="window.pwned = 1"><b class="pwned">not bold</b>')
"""
BATCH = 4
WAIT_S = 15.0  # a liveness bound for what the page shows; it polls every 2 s


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    try:
        executable = find_chromium()
    except ChromiumMissing as exc:
        pytest.fail(str(exc))
    with Browser(executable) as b:
        yield b


@pytest.fixture
def curriculum_with_evil(tiny_doc: dict[str, Any], write_tiny: Callable[[dict[str, Any]], Path]) -> Path:
    """The tiny curriculum plus a source whose grader raises with an HTML message."""
    tiny_doc["sources"]["evil"] = {"kind": "arithmetic", "graders": ["evil"], "on_error": -1.0}
    tiny_doc["graders"]["evil"] = {"python": "./evil.py:evil"}
    path = write_tiny(tiny_doc)
    (path.parent / "evil.py").write_text(EVIL_GRADER)
    return path


class Trainer:
    """Drives a server as a GRPO trainer would: /sample an iteration, /grade two completions per prompt."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=30)
        sources = self.http.get("/meta").json()["sources"]
        self.versions = {s["name"]: s["version"] for s in sources}

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def sample(self, iteration: int) -> list[dict[str, Any]]:
        response = self.http.post("/sample", json={"iteration": iteration, "batch_size": BATCH})
        assert response.status_code == 200, response.text
        samples: list[dict[str, Any]] = response.json()["samples"]
        return samples

    def grade(self, iteration: int, items: list[dict[str, Any]]) -> None:
        response = self.http.post("/grade", json={"iteration": iteration, "items": items})
        assert response.status_code == 200, response.text

    def step(self, iteration: int, *, all_right: bool = False, broken: tuple[str, ...] = ()) -> None:
        """Two completions per prompt: both right for even slots (a zero-variance group), right and wrong for odd
        ones (or both right with ``all_right``); plus one completion for each source in ``broken``, graded
        directly (their graders raise)."""
        items = []
        for s in self.sample(iteration):
            right = str(eval(s["metadata"]["expression"])) if s["dataset_id"] == "add" else QA_ANSWERS[s["prompt"]]
            second = right if all_right or s["slot"] % 2 == 0 else "no idea"
            items += [
                {"sample_id": s["sample_id"], "slot": s["slot"], "completion": right},
                {"sample_id": s["sample_id"], "slot": s["slot"], "completion": second},
            ]
        items += [{"sample_id": f"{name}:{self.versions[name]}:{iteration}", "completion": "3"} for name in broken]
        self.grade(iteration, items)

    def dashboard(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.http.get("/dashboard").json()
        return answer


def js(value: Any) -> str:
    """A Python value as a JavaScript literal."""
    return json.dumps(value)


def texts(browser: Browser, selector: str) -> list[str]:
    found: list[str] = browser.evaluate(
        f"[...document.querySelectorAll({js(selector)})].map((e) => e.textContent.replace(/\\s+/g, ' ').trim())"
    )
    return found


def attrs(browser: Browser, selector: str, name: str) -> list[str | None]:
    found: list[str | None] = browser.evaluate(
        f"[...document.querySelectorAll({js(selector)})].map((e) => e.getAttribute({js(name)}))"
    )
    return found


def text(browser: Browser, selector: str) -> str:
    [found] = texts(browser, selector)
    return found


def wait_for_iteration(browser: Browser, iteration: int) -> None:
    browser.wait_for(
        f"document.body.dataset.state === 'ok' && "
        f"document.getElementById('last-iteration').dataset.value === {js(str(iteration))}",
        f"the page shows last iteration {iteration}",
        WAIT_S,
    )


# --- the routes ---------------------------------------------------------------------------------------------


def raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET ``path`` exactly as written (no client normalises its dots or escapes)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_the_page_and_its_files_are_served_with_their_types(live_server: LiveServer) -> None:
    with live_server() as url, httpx.Client(base_url=url) as client:
        index = client.get("/")
        assert index.status_code == 200
        assert index.headers["content-type"] == "text/html; charset=utf-8"
        assert index.headers["cache-control"] == "no-cache"
        assert 'src="page/app.js"' in index.text and 'href="page/style.css"' in index.text
        for name, media_type, needle in [
            ("app.js", "text/javascript; charset=utf-8", "function poll()"),
            ("style.css", "text/css; charset=utf-8", ":root"),
        ]:
            response = client.get(f"/page/{name}")
            assert response.status_code == 200, name
            assert response.headers["content-type"] == media_type
            assert response.headers["cache-control"] == "no-cache"
            assert needle in response.text
        # The page is no API operation.
        schema_paths = client.get("/openapi.json").json()["paths"]
        assert "/" not in schema_paths and "/page/{name}" not in schema_paths


# Each must be a 404 that shows no file: names the page does not have, and paths that try to leave its folder.
UNSERVED = [
    "/page/nope.js",
    "/page/index.html",  # in the folder, but served at / only
    "/page/",
    "/page/..%2Froutes%2Fpage.py",
    "/page/%2e%2e%2f%2e%2e%2fpyproject.toml",
    "/page/../routes/page.py",
    "/page/..%5C..%5Cpyproject.toml",
    "/page/%2Fetc%2Fpasswd",
    "/page/app.js%00.py",
]


def test_only_the_known_page_files_are_served(live_server: LiveServer) -> None:
    with live_server() as url:
        answers = {path: raw_get(url, path) for path in UNSERVED}
    for path, (status, body) in answers.items():
        assert status == 404, (path, body[:200])
        assert b"from __future__" not in body and b"[build-system]" not in body and b"root:" not in body, path


# --- the page in a browser ----------------------------------------------------------------------------------


def test_the_page_draws_the_run_and_follows_it(
    live_server: LiveServer, curriculum_with_evil: Path, browser: Browser
) -> None:
    with live_server(curriculum=curriculum_with_evil) as url, Trainer(url) as trainer:
        trainer.step(0)
        trainer.step(1, broken=("faulty", "evil"))
        trainer.step(2, all_right=True)  # the gate's window is all right: the next iteration is "main"'s
        trainer.step(3)
        trainer.step(4)
        trainer.sample(5)  # sampled, not graded yet: no reward, no group
        dash = trainer.dashboard()
        assert dash["current_stage"] == "main" and len(dash["transitions"]) == 1, dash["transitions"]
        assert dash["last_iteration"] == 5

        browser.navigate(f"{url}/")
        wait_for_iteration(browser, 5)
        assert browser.evaluate("document.getElementById('notice').hidden") is True

        # The header: curriculum, current stage, last iteration; every stage with its sampler.
        assert text(browser, "#curriculum") == "tiny"
        assert text(browser, "#current-stage") == "main"
        assert text(browser, "#last-iteration") == "5"
        assert text(browser, "#total-iterations") == str(dash["total_iterations"])
        assert attrs(browser, "#stages .stage", "data-stage") == [s["name"] for s in dash["stages"]]
        for stage in dash["stages"]:
            assert (
                text(browser, f"#stages .stage[data-stage={js(stage['name'])}] .sampler")
                == f"sampler {stage['sampler']}"
            )
        assert texts(browser, "#stages .stage .badge") == ["done", "current", "upcoming"]

        # The stage timeline: a band per stage reached, a marker per transition, and the reason in text.
        reached = [s["name"] for s in dash["stages"] if s["started_at"] is not None]
        assert attrs(browser, "#timeline .band", "data-stage") == reached == ["warm", "main"]
        assert len(texts(browser, "#timeline .tr-badge")) == 1
        [transition] = dash["transitions"]
        [listed] = texts(browser, "#transitions li.transition")
        assert transition["reason"] in listed
        assert f"iteration {transition['iteration']} · warm → main" in listed

        # Reward: a point per iteration with graded completions (not the ungraded iteration 5).
        graded = [p["iteration"] for p in dash["iterations"] if p["mean_reward"] is not None]
        assert graded == [0, 1, 2, 3, 4]
        assert attrs(browser, "#reward .pt", "data-iteration") == [str(i) for i in graded]
        # Zero-variance groups: a bar per iteration with groups, its height the share.
        with_groups = [p for p in dash["iterations"] if p["groups"] > 0]
        assert [p["iteration"] for p in with_groups] == [0, 1, 2, 3, 4]
        shares = [float(s or "nan") for s in attrs(browser, "#zero-variance .bar", "data-share")]
        assert shares == [p["zero_variance_groups"] / p["groups"] for p in with_groups]
        assert 0 < min(shares) < 1 and max(shares) == 1  # groups with and without variance

        # Pass rates: each finite source's ten bins as /dashboard counts them; endless ones are not tracked.
        for histogram in dash["pass_rates"]:
            card = f"#pass-rates [data-source={js(histogram['source'])}]"
            if histogram["records"] is None:
                assert "not tracked" in text(browser, card)
                assert texts(browser, f"{card} .hbar") == []
            else:
                assert attrs(browser, f"{card} .hbar", "data-count") == [str(n) for n in histogram["bins"]]
                shown = [int(t) for t in texts(browser, f"{card} .count")]
                assert shown == [n for n in histogram["bins"] if n]
        qa = next(h for h in dash["pass_rates"] if h["source"] == "qa")
        assert sum(qa["bins"]) == qa["graded_records"] > 0

        # Grader errors: the total and the latest, the faulty grader's among them; markup shown as text.
        assert dash["grader_errors"] == 2
        assert text(browser, "#errors-total") == "2"
        rows = texts(browser, "#errors tr.error")
        assert len(rows) == len(dash["recent_errors"]) == 2
        assert any("boom: RuntimeError: boom: this grader fails on purpose" in row for row in rows)
        assert any('<b class="pwned">not bold</b>' in row for row in rows)
        assert browser.evaluate("document.querySelector('.pwned') === null && window.pwned === undefined") is True

        # The page follows the run by itself.
        trainer.step(5)
        trainer.step(6)
        wait_for_iteration(browser, 6)
        browser.wait_for(
            "document.querySelectorAll('#reward .pt').length === 7", "the reward chart shows iterations 5 and 6", WAIT_S
        )
        assert len(texts(browser, "#zero-variance .bar")) == 7
        assert text(browser, "#updated").startswith("updated ")

    # The server is gone: the page says so, keeps what it drew, and keeps trying.
    browser.wait_for(
        "!document.getElementById('notice').hidden && document.body.dataset.state === 'error'",
        "the page notices that /dashboard fails",
        WAIT_S,
    )
    assert "Could not load /dashboard" in text(browser, "#notice")
    assert "Retrying every 2 s" in text(browser, "#notice")
    assert text(browser, "#last-iteration") == "6"


def test_with_an_api_key_the_page_is_open_and_its_data_needs_the_key(live_server: LiveServer, browser: Browser) -> None:
    with live_server(api_key="s3cret-key") as url:
        with httpx.Client(base_url=url) as client:
            for path in ["/", "/page/app.js", "/page/style.css", "/healthz"]:
                assert client.get(path).status_code == 200, path
            assert client.get("/dashboard").status_code == 401
            assert client.get("/page/nope.js").status_code == 401  # only the page's own paths are open
        with Trainer(url, api_key="s3cret-key") as trainer:
            trainer.step(0)

        browser.navigate(f"{url}/")
        browser.wait_for("document.body.dataset.state === 'auth'", "the page reports the missing key", WAIT_S)
        notice = text(browser, "#notice")
        assert "/#key=<PROCTOR_API_KEY>" in notice and "401" in notice
        assert text(browser, "#last-iteration") == "–"

        # A wrong key, then the right one: the page picks up the fragment without a reload.
        browser.navigate(f"{url}/#key=wrong")
        browser.wait_for(
            "document.getElementById('notice').textContent.includes('refused')",
            "the page reports the wrong key",
            WAIT_S,
        )
        browser.navigate(f"{url}/#key=s3cret-key")
        wait_for_iteration(browser, 0)
        assert text(browser, "#curriculum") == "tiny"
        assert browser.evaluate("document.getElementById('notice').hidden") is True


# --- the page on data no small run produces ---------------------------------------------------------------


def stage(index: int, name: str, *, started_at: int | None, until_step: int, **counts: Any) -> StageState:
    values: dict[str, Any] = {"iterations": 0, "samples": 0, "graded": 0, "errors": 0, "rolling_count": 0}
    values.update(counts)
    return StageState(
        name=name,
        index=index,
        until_step=until_step,
        started_at=started_at,
        rolling_reward=values.pop("rolling_reward", None),
        sampler=values.pop("sampler", "uniform"),
        **values,
    )


def empty_run() -> Dashboard:
    return Dashboard(
        curriculum="<i>fresh</i>",
        current_stage="first",
        last_iteration=None,
        total_iterations=300,
        stages=[
            stage(0, "first", started_at=None, until_step=100),
            stage(1, "second", started_at=None, until_step=200, sampler="learnability"),
            stage(2, "third", started_at=None, until_step=300),
        ],
        transitions=[],
        iterations=[],
        pass_rates=[
            PassRateHistogram(source="words", records=40, graded_records=0, bins=[0] * 10, mean_pass_rate=None),
            PassRateHistogram(source="sums", records=None, graded_records=0, bins=[0] * 10, mean_pass_rate=None),
        ],
        grader_errors=0,
        recent_errors=[],
    )


def one_iteration() -> Dashboard:
    run = empty_run()
    run.last_iteration = 0
    run.stages[0] = stage(0, "first", started_at=0, until_step=100, iterations=1, samples=4, graded=8)
    point = IterationPoint(
        iteration=0, stage="first", stage_index=0, graded=8, errors=0, mean_reward=0.5, groups=4, zero_variance_groups=1
    )
    run.iterations = [point]
    return run


def long_run() -> Dashboard:
    """2048 kept iterations of 2200, three stages, null rewards, long reasons, markup in every string."""
    names = ["<script>window.pwned = 1</script>", "middle", "last " + "very long name " * 8]
    starts = [0, 700, 1500]
    stages = [
        stage(i, names[i], started_at=starts[i], until_step=[800, 1600, 3000][i], sampler="target_difficulty")
        for i in range(3)
    ]
    reason = "gate: " + "a reason that goes on and on, " * 60 + "<img src=x onerror='window.pwned=1'>"
    transitions = [
        Transition(iteration=700, from_stage=names[0], to_stage=names[1], reason=reason),
        Transition(iteration=1500, from_stage=names[1], to_stage=names[2], reason="reached until_step 1500"),
    ]
    points = []
    for it in range(152, 2200):
        index = sum(it >= s for s in starts) - 1
        graded = 0 if it % 7 == 0 else 16
        points.append(
            IterationPoint(
                iteration=it,
                stage=names[index],
                stage_index=index,
                graded=graded,
                errors=it % 3,
                mean_reward=None if graded == 0 else -1 + (it % 50) / 20,
                groups=0 if it % 11 == 0 else 8,
                zero_variance_groups=0 if it % 11 == 0 else it % 9,
                # The last stage mixes by learning progress: its weights move between its two sources.
                mix_weights=None
                if index < 2
                else {"<u>src1</u>": 0.2 + (it % 60) / 100, "src2": 0.8 - (it % 60) / 100},
                # Every 13th iteration's trainer refilled groups (POST /refill).
                refill_rounds=0 if it % 13 else 1 + it % 3,
                refilled_groups=0 if it % 13 else 2 + it % 3,
            )
        )
    errors = [
        GraderErrorEntry(iteration=2199 - n, sample_id=f"src:0123456789:{n}", error=f"<b class='pwned'>{n}</b> " * 400)
        for n in range(20)
    ]
    return Dashboard(
        curriculum="big",
        current_stage=names[2],
        last_iteration=2199,
        total_iterations=3000,
        stages=stages,
        transitions=transitions,
        iterations=points,
        pass_rates=[
            PassRateHistogram(
                source=f"<u>src{n}</u>",
                records=1000,
                graded_records=55 * n,
                bins=[n * i for i in range(10)],
                mean_pass_rate=0.6,
            )
            for n in range(1, 4)
        ],
        grader_errors=123456,
        recent_errors=errors,
    )


def test_the_page_draws_edge_cases_and_survives_a_failing_server(browser: Browser) -> None:
    served: dict[str, Any] = {"doc": empty_run(), "fail": False}
    app = FastAPI()
    app.include_router(page.router)

    @app.get("/dashboard")
    async def dashboard() -> JSONResponse:
        if served["fail"]:
            return JSONResponse({"detail": "stub: down for a test"}, status_code=503)
        doc: Dashboard = served["doc"]
        return JSONResponse(doc.model_dump(mode="json"))

    no_markup = "document.querySelector('.pwned, script:not([src]), img') === null && window.pwned === undefined"
    no_overflow = "document.documentElement.scrollWidth <= window.innerWidth"
    with serve_in_thread(app) as url:
        browser.navigate(f"{url}/")
        browser.wait_for("document.body.dataset.state === 'ok'", "the empty run drawn", WAIT_S)
        assert text(browser, "#curriculum") == "<i>fresh</i>"
        assert text(browser, "#last-iteration") == "none yet"
        assert texts(browser, "#timeline .band") == [] and len(texts(browser, "#timeline .planned")) == 3
        assert "No transitions yet" in text(browser, "#transitions")
        assert "No iterations sampled yet" in text(browser, "#reward")
        assert "No grader errors." in text(browser, "#errors")
        assert browser.evaluate("document.getElementById('mix-panel').hidden") is True  # no learning_progress stage
        assert "no graded groups yet" in text(browser, "#pass-rates [data-source=words]")
        assert "not tracked" in text(browser, "#pass-rates [data-source=sums]")

        served["doc"] = one_iteration()
        wait_for_iteration(browser, 0)
        assert len(texts(browser, "#reward .pt")) == 1
        assert attrs(browser, "#zero-variance .bar", "data-share") == ["0.25"]
        assert browser.evaluate("document.getElementById('refill-legend').hidden") is True  # no refill yet
        assert attrs(browser, "#timeline .band", "data-stage") == ["first"]

        served["doc"] = long_run()
        wait_for_iteration(browser, 2199)
        run = long_run()
        assert len(texts(browser, "#reward .pt")) == sum(p.mean_reward is not None for p in run.iterations)
        assert len(texts(browser, "#zero-variance .bar")) == sum(p.groups > 0 for p in run.iterations)
        assert len(texts(browser, "#timeline .band")) == 3
        # A mark above each iteration with refill rounds, its rounds in data-rounds.
        refilled = [p for p in run.iterations if p.refill_rounds]
        assert attrs(browser, "#zero-variance .refill", "data-rounds") == [str(p.refill_rounds) for p in refilled]
        assert browser.evaluate("document.getElementById('refill-legend').hidden") is False
        # The source weights: a line per source over the learning_progress stage's iterations.
        assert browser.evaluate("document.getElementById('mix-panel').hidden") is False
        assert attrs(browser, "#mix .wline", "data-source") == ["<u>src1</u>", "src2"]
        assert texts(browser, "#mix-legend .stage-name") == ["<u>src1</u>", "src2"]
        assert browser.evaluate("document.querySelector('#mix .wline').getAttribute('d').split('M').length") == 2
        listed = texts(browser, "#transitions li.transition")
        assert [run.transitions[0].reason in listed[0], "reached until_step 1500" in listed[1]] == [True, True]
        assert len(texts(browser, "#errors tr.error")) == 20
        assert text(browser, "#errors-total") == "123,456"
        assert attrs(browser, "#pass-rates [data-source='<u>src2</u>'] .hbar", "data-count") == [
            str(2 * i) for i in range(10)
        ]
        assert browser.evaluate(no_markup) is True
        assert browser.evaluate(no_overflow) is True
        # Hovering a chart shows the iteration under the pointer.
        rect = browser.evaluate(
            "(() => { const svg = document.querySelector('#reward svg'); svg.scrollIntoView({block: 'center'});"
            " const r = svg.getBoundingClientRect(); return {x: r.x, y: r.y, width: r.width}; })()"
        )
        browser.call("Input.dispatchMouseEvent", type="mouseMoved", x=rect["x"] + rect["width"] - 20, y=rect["y"] + 60)
        tip = browser.wait_for(
            "!document.getElementById('tooltip').hidden && document.getElementById('tooltip').textContent",
            "the tooltip",
            WAIT_S,
        )
        assert "iteration 2,1" in tip  # one of the last iterations (2,180 to 2,199)

        served["fail"] = True
        browser.wait_for("document.body.dataset.state === 'error'", "the page reports the failing server", WAIT_S)
        notice = text(browser, "#notice")
        assert "HTTP 503: stub: down for a test" in notice and "Retrying every 2 s" in notice
        assert text(browser, "#last-iteration") == "2,199"  # what it drew stays

        served["fail"] = False
        browser.wait_for(
            "document.body.dataset.state === 'ok' && document.getElementById('notice').hidden",
            "the page recovers",
            WAIT_S,
        )
