"""bench/memory_soak.py: its RSS readings and growth figure, and a tiny soak of a real server."""

from __future__ import annotations

import os

import pytest

from bench import memory_soak as soak


def test_rss_of_this_process_is_read_and_of_a_gone_process_is_zero() -> None:
    assert soak.read_rss_kib(os.getpid()) > 1024
    assert soak.read_rss_kib(2**22 + 1) == 0  # above the kernel's largest pid


def test_growth_is_measured_from_the_warm_up_mark_to_the_end() -> None:
    marks = [soak.Mark(i, 100.0 + i / 100, 30.0, i / 10) for i in range(0, 1001, 100)]

    start, last, rate = soak.growth(marks)

    assert (start.iterations, last.iterations) == (100, 1000)
    assert rate == pytest.approx(1000 / 100 * 1024)  # 1 MiB per 100 iterations: 10 MiB per 1000
    assert "+9.0 MiB" in soak.table(soak.Soak(1000, 8, 4, 2, marks))


@pytest.mark.e2e
def test_a_tiny_soak_reads_the_server_and_its_graders() -> None:
    result, _ = soak.run(40, 8, grade_every=2, connections=2)

    assert [m.iterations for m in result.marks] == [0, *range(2, 41, 2)]
    assert all(m.server_mib > 10 for m in result.marks)
    assert all(m.graders_mib > 5 for m in result.marks)  # the one grader process was found and read
