"""The experience store behind a real server killed with SIGKILL: every acknowledged write survives, and so do
the leases (rows held before the crash stay held, and their holder can still collect them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proctor.client.experience import ExperienceClient
from proctor.experience import LeaseError

pytestmark = pytest.mark.e2e


def test_writes_and_leases_survive_kill_and_restart(
    server_process: Callable[..., Any], curriculum_file: Path, tmp_path: Path
) -> None:
    args = [str(curriculum_file), "--database-url", str(tmp_path / "state.db"), "--grader-workers", "1"]
    rows = [(slot, k) for slot in range(4) for k in range(2)]
    ids = [np.arange(slot * 10 + k + 1, dtype=np.int32) for slot, k in rows]
    server = server_process(args)
    with ExperienceClient(server.url) as experience:
        experience.open(0, slots=4, group_size=2)
        experience.register("scorer", needs=["completion_ids"], produces=["reward"])
        experience.put(0, rows, {"completion_ids": ids})
        held = experience.dispatch("scorer", 4, iteration=0, lease_s=600)
        short = experience.dispatch("scorer", 2, iteration=0, lease_s=0.5)
        done = experience.dispatch("scorer", 2, iteration=0, lease_s=600)
        assert held.lease and short.lease and done.lease
        experience.collect(done.lease, {"reward": [1.0, 0.0]})
    server.kill()

    server = server_process(args)
    with ExperienceClient(server.url) as experience:
        assert experience.table(0).written == {"completion_ids": 8, "reward": 2}
        back = experience.read(0, rows, ["completion_ids"])["completion_ids"]
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(back, ids, strict=True))
        state = experience.consumption("scorer", 0)
        assert (state.consumed, state.held + state.ready) == (2, 6)
        assert short.expires_at is not None
        time.sleep(max(0.0, short.expires_at - time.time() + 0.05))
        # The long lease still holds its four rows: only the short lease's rows (expired by now) come back.
        again = experience.dispatch("scorer", 8, iteration=0, lease_s=600)
        assert sorted(again.rows) == sorted(short.rows)
        with pytest.raises(LeaseError, match="expired"):
            experience.collect(short.lease or "", {"reward": [0.5, 0.5]})
        experience.collect(held.lease or "", {"reward": [0.25] * 4})
        experience.collect(again.lease or "", {"reward": [0.5, 0.5]})
        assert experience.all_consumed("scorer", 0)
        assert experience.read(0, list(held.rows), ["reward"])["reward"] == [0.25] * 4
