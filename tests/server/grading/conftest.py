"""Shared fixtures for the grading tests."""

from __future__ import annotations

import asyncio

import pytest

from proctor.server.grading import builtin


@pytest.fixture(autouse=True)
def cold_reference_cache() -> None:
    """Start every test with the ``math`` grader's reference cache empty.

    The cache is process-wide, so without this a test that counts math_verify's parses of a reference would
    depend on whether an earlier test happened to grade against the same one. The bench clears it the same way.
    """
    builtin._parsed_reference.cache_clear()


async def settle() -> None:
    """Let the tasks started so far run until they wait (for an item, or an answer from another process)."""
    for _ in range(10):
        await asyncio.sleep(0)
