"""The experience store (:class:`~proctor.experience.ExperienceStore`) behind the dataserver's ``/experience`` routes.

The store keeps its tables in the server's state file, on the state's own writer connection and thread
(:class:`~proctor.server.storage.AsyncStore`): a call's work grows with its rows (encoding, SQLite), and none
of it may hold the event loop; and a call can write the store's cells and the state's grades in one
transaction (:meth:`AsyncExperienceStore.call` with the state's :class:`~proctor.server.store.Store`). The store's
errors become the server's refusals of the same kind, keeping their ``code``; a failed write of the file stops
the server, as the state's own writes do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from proctor.experience import ExperienceError, ExperienceStore
from proctor.experience.errors import (
    CellConflictError,
    CellsMissingError,
    ExperienceInputError,
    LeaseError,
    ShapeConflictError,
    UnknownConsumerError,
    UnknownIterationError,
)
from proctor.server.exceptions import ConflictError, InvalidRequestError, NotFoundError, RequestError
from proctor.server.settings import Settings
from proctor.server.storage import AsyncStore
from proctor.server.store import Store

__all__ = ["AsyncExperienceStore", "refusal"]

P = ParamSpec("P")
T = TypeVar("T")

# Each of the store's outcomes as the server's refusal of the same kind; the HTTP layer gives that its status.
_REFUSALS: dict[type[ExperienceError], type[RequestError]] = {
    UnknownIterationError: NotFoundError,
    UnknownConsumerError: NotFoundError,
    ShapeConflictError: ConflictError,
    CellConflictError: ConflictError,
    CellsMissingError: ConflictError,
    LeaseError: ConflictError,
}


def refusal(error: ExperienceError) -> RequestError:
    """The server's refusal for one of the store's errors, with the error's ``code``."""
    if isinstance(error, ExperienceInputError):
        return InvalidRequestError(error.field, error.reason, code=error.code)
    kind = next((_REFUSALS[cls] for cls in type(error).__mro__ if cls in _REFUSALS), RequestError)
    return kind(error.message, code=error.code)


class AsyncExperienceStore:
    """Create with :meth:`open`, release with :meth:`close`; ``await store.call(ExperienceStore.put, …)``."""

    def __init__(self, store: ExperienceStore, storage: AsyncStore) -> None:
        self.store = store
        self._storage = storage

    @property
    def state(self) -> Store:
        """The state's store, for a call that writes both (on the store's thread, inside :meth:`call`)."""
        return self._storage.store

    @classmethod
    async def open(cls, settings: Settings, storage: AsyncStore) -> AsyncExperienceStore:
        """The store's tables in ``storage``'s state file, on its connection and thread."""
        connection, keep = storage.store.connection, settings.experience_keep_iterations
        store = await storage.write(lambda: ExperienceStore(connection, keep_iterations=keep))
        return cls(store, storage)

    async def close(self) -> None:
        await self._storage.write(self.store.close)

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the store's thread; a :class:`ExperienceError` becomes a :class:`RequestError`."""
        try:
            return await self._storage.write(fn, *args, **kwargs)
        except ExperienceError as exc:
            raise refusal(exc) from exc
