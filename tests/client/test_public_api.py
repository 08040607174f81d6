"""``proctor.client``'s public names: each one in ``__all__`` resolves (the lazy ones too), the list is sorted,
and every public class or function the package holds is listed."""

from __future__ import annotations

import types

import proctor.client


def test_all_lists_exactly_the_public_names() -> None:
    exported = proctor.client.__all__
    assert exported == sorted(exported)
    for name in exported:
        assert getattr(proctor.client, name) is not None, name  # imported on first use for some
    public = {
        name
        for name, value in vars(proctor.client).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", "").startswith("proctor.")
    }
    assert public <= set(exported), public - set(exported)
