"""The server's exception hierarchy: one root, the refusals under it, and the HTTP layer's status for each."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import proctor.server
from proctor.errors import ProctorError
from proctor.server.errors import status_of
from proctor.server.exceptions import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    RequestError,
    UnavailableError,
)


def server_exceptions() -> dict[str, type[Exception]]:
    """Every exception class defined in a module of proctor.server, by qualified name."""
    found: dict[str, type[Exception]] = {}
    for info in pkgutil.walk_packages(proctor.server.__path__, "proctor.server."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Exception) and obj.__module__ == info.name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_server_exception_derives_from_the_root() -> None:
    classes = server_exceptions()
    assert "proctor.server.spec.CurriculumError" in classes  # the walk reached the subpackages
    outside = sorted(
        name for name, cls in classes.items() if not issubclass(cls, ProctorError) and not cls.__name__.startswith("_")
    )
    assert not outside, f"derive these from proctor.server.exceptions.ProctorError: {outside}"


def test_the_http_layer_gives_each_refusal_its_status() -> None:
    errors = [InvalidRequestError("n", "bad"), NotFoundError("gone"), ConflictError("taken"), UnavailableError("down")]
    assert [status_of(e) for e in errors] == [422, 404, 409, 503]
    assert status_of(RequestError("wrong")) == 400
    for cls in (InvalidRequestError, ConflictError, UnavailableError):
        assert issubclass(cls, RequestError)
    error = InvalidRequestError("batch_size", "must be at least 1")
    assert isinstance(error, ProctorError)
    assert error.detail == "batch_size: must be at least 1"


def test_the_domain_errors_keep_the_builtin_class_their_callers_catch() -> None:
    from proctor.server.grading.registry import GraderResolutionError
    from proctor.server.services.history import HistoryError
    from proctor.server.settings import SettingsError
    from proctor.server.sources.files import SourceDataError
    from proctor.server.spec import CurriculumError
    from proctor.server.store import StateMismatchError

    for cls in (CurriculumError, GraderResolutionError, HistoryError, SettingsError, SourceDataError):
        assert issubclass(cls, ProctorError)
        assert issubclass(cls, ValueError)
    assert issubclass(StateMismatchError, ProctorError)
    assert issubclass(StateMismatchError, RuntimeError)
    # The HTTP errors are not configuration errors: a handler for those does not catch them.
    assert not issubclass(RequestError, ValueError)


def test_one_except_clause_catches_every_side() -> None:
    # A trainer catches the dataserver client's errors and the experience store's with one clause.
    from proctor.client import DataserverError, TransportError
    from proctor.experience import ExperienceError
    from proctor.experience.errors import LeaseError

    for cls in (DataserverError, TransportError, ExperienceError, LeaseError, RequestError):
        assert issubclass(cls, ProctorError)
    assert ProctorError.__module__ == "proctor.errors"
