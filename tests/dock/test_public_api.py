"""``proctor.dock``'s public names: each one listed in ``__all__`` is defined, and nothing public is unlisted."""

from __future__ import annotations

import proctor.dock


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in vars(proctor.dock) if not name.startswith("_")} - {"annotations"}
    modules = {"columns", "dock", "errors", "loop", "persistence", "values", "wire"}
    assert set(proctor.dock.__all__) == public - modules
    assert sorted(proctor.dock.__all__) == proctor.dock.__all__


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(proctor.dock, n) for n in proctor.dock.__all__ if n.endswith("Error")]
    assert len(errors) == 8
    assert all(issubclass(e, proctor.dock.DockError) for e in errors)
