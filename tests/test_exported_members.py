"""Every module of proctor says what it exports. A module that defines a public class or function lists it in
its ``__all__``, and every name an ``__all__`` lists resolves (``proctor.client``'s lazy ones included). Route
handlers are reached through their module's routers, not by name."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from fastapi import APIRouter

PACKAGES = ("server", "client", "experience", "batching", "cli")
LIBRARIES = ("proctor.client", "proctor.experience")


def modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(f"proctor.{package}")
        names.append(root.__name__)
        names += [m.name for m in pkgutil.walk_packages(root.__path__, f"{root.__name__}.")]
    return sorted(n for n in names if not n.rsplit(".", 1)[-1].startswith("_"))


def defined(module: object, name: str) -> set[str]:
    """The public classes and functions ``module`` defines itself, route handlers aside."""
    routers = [value for value in vars(module).values() if isinstance(value, APIRouter)]
    handlers = {getattr(route, "endpoint", None) for router in routers for route in router.routes}
    return {
        member
        for member, value in vars(module).items()
        if not member.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == name
        and value not in handlers
    }


@pytest.mark.parametrize("name", modules())
def test_all_lists_exactly_the_public_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    public = defined(module, name)
    if exported is None:
        assert not public, f"{name} defines {sorted(public)} and has no __all__ that says so"
        assert name not in LIBRARIES, f"{name} has no __all__"
        return
    for member in exported:
        assert getattr(module, member, None) is not None, f"{name}.__all__ lists {member!r}, which it lacks"
    assert public <= set(exported), f"{name} defines {sorted(public - set(exported))} but does not export them"


def test_every_module_was_found() -> None:
    found = modules()
    assert {
        "proctor.server.app",
        "proctor.client.training.trainer",
        "proctor.experience.store",
        "proctor.cli.main",
    } <= set(found)
