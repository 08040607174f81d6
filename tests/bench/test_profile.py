"""bench/profile.py: py-spy's raw profiles read as each function's inclusive share, per thread group, below a
function when asked; and a real run profiles a real server. No share is asserted of the real run: the numbers
are the profile's to report."""

from __future__ import annotations

import pytest

from bench import profile
from bench.profile import EVENT_LOOP, THREADS, read_profile

LOOP = "main (cli/main.py:10);Runner.run (asyncio/runners.py:118)"
WORKER = "Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83)"
RAW = [
    f"{LOOP};Middleware.__call__ (app/middleware.py:5);route (app/routes.py:20);parse (app/wire.py:3) 6\n",
    f"{LOOP};Middleware.__call__ (app/middleware.py:5);route (app/routes.py:21) 2\n",
    f"{LOOP};Middleware.__call__ (app/middleware.py:5);route (app/routes.py:22);walk (app/tree.py:1);"
    "walk (app/tree.py:1);walk (app/tree.py:2) 2\n",
    f"{LOOP};flush (app/tasks.py:9) 1\n",
    f"{WORKER};write (store/rows.py:40);encode (store/values.py:7) 3\n",
    f"{WORKER};write (store/rows.py:41) 1\n",
    f"{WORKER};read (store/rows.py:60) 1\n",
    "not a stack line\n",
    "\n",
]


def test_a_raw_profile_is_read_as_functions_of_the_event_loop_and_of_other_threads() -> None:
    p = read_profile(RAW)
    assert p.samples == 16
    assert p.by_thread() == {EVENT_LOOP: 11, THREADS: 5}
    assert p.stacks[-1] == (("Thread._bootstrap (threading.py)", "_worker (thread.py)", "read (rows.py)"), 1, THREADS)


def test_shares_count_a_function_once_a_sample_and_leave_out_what_every_stack_or_one_callee_holds() -> None:
    considered, shares = read_profile(RAW).shares()
    assert considered == 16
    # main and Runner.run are on every stack of the event loop, Thread._bootstrap and _worker on every other
    # one's; the middleware passes all of its samples on to the route. walk recurs, and counts once a sample.
    assert dict(shares) == {
        "route (routes.py)": 10,
        "parse (wire.py)": 6,
        "write (rows.py)": 4,
        "encode (values.py)": 3,
        "walk (tree.py)": 2,
        "flush (tasks.py)": 1,
        "read (rows.py)": 1,
    }
    assert shares[0] == ("route (routes.py)", 10)


def test_shares_under_a_function_are_of_the_samples_through_it_and_of_its_callees() -> None:
    p = read_profile(RAW)
    assert p.shares("write") == (4, [("encode (values.py)", 3)])
    assert p.shares("route (routes.py)", top=1) == (10, [("parse (wire.py)", 6)])
    assert p.shares("nowhere") == (0, [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--workers", "2"],
            "--workers N > 1 runs server processes of one PostgreSQL database: add --state postgresql",
        ),
        (["--workers", "9", "--state", "postgresql"], "--workers must be 1 to 8, got 9"),
        (["--seconds", "1"], "--seconds must be at least 3, --rate 1 to 1000, --top at least 1"),
    ],
)
def test_the_command_line_refuses_what_it_cannot_run(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        profile.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_a_real_run_profiles_the_server_during_the_load_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    profile.main(["--load", "sample", "--seconds", "3", "--top", "5"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("/sample new iteration (batch 16), sqlite, 8 connections, 3 s; py-spy --gil at 250 Hz")
    assert out[2].startswith("server: the interpreter held ")
    listed = [line for line in out[3:] if line.strip()]
    assert 1 <= len(listed) <= 5 and all(line.strip()[0].isdigit() for line in listed)
