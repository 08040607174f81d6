"""``proctor.experience``'s public names: each one listed in ``__all__`` is defined, and nothing public is unlisted."""

from __future__ import annotations

import proctor.experience


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in vars(proctor.experience) if not name.startswith("_")} - {"annotations"}
    modules = {
        "cells",
        "columns",
        "consumers",
        "database",
        "errors",
        "limits",
        "loop",
        "persistence",
        "store",
        "tables",
        "values",
        "wire",
    }
    assert set(proctor.experience.__all__) == public - modules
    assert sorted(proctor.experience.__all__) == proctor.experience.__all__


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(proctor.experience, n) for n in proctor.experience.__all__ if n.endswith("Error")]
    assert len(errors) == 8
    assert all(issubclass(e, proctor.experience.ExperienceError) for e in errors)
