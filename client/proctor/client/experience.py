"""``ExperienceClient``: the dataserver's experience store (``/experience``), with the methods, answers and
exceptions of the in-process :class:`proctor.experience.ExperienceStore`, so a worker runs unchanged against
either."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from proctor.client.errors import DataserverError, ServerError
from proctor.client.http import ProctorClient
from proctor.experience.consumers import Collected, Consumer, Consumption, Dispatch
from proctor.experience.errors import ExperienceError, ExperienceInputError, LeaseError, error_class
from proctor.experience.tables import RowKey, TableInfo
from proctor.experience.values import Value, as_stored
from proctor.wire import experience as dw

__all__ = ["ExperienceClient"]

M = TypeVar("M", bound=BaseModel)

# Rows per write request: a 512-token array column is about 2.7 KB a row on the wire, so 256 rows stay well
# under the server's default 2 MiB body limit.
ROWS_PER_REQUEST = 256


class ExperienceClient:
    """The experience store of the dataserver at ``base_url`` (or of an existing ``ProctorClient``).

    Failed calls raise the store's own exceptions (:mod:`proctor.experience.errors`); transport failures and
    server failures raise the client's (:mod:`proctor.client.errors`) after its retries.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        client: ProctorClient | None = None,
        rows_per_request: int = ROWS_PER_REQUEST,
    ) -> None:
        if (base_url is None) == (client is None):
            raise ValueError("give base_url or client, not both")
        if rows_per_request < 1:
            raise ValueError(f"rows_per_request must be at least 1, got {rows_per_request}")
        self._owned = client is None
        self.client = client if client is not None else ProctorClient(str(base_url))
        self.rows_per_request = rows_per_request

    def close(self) -> None:
        if self._owned:
            self.client.close()

    def __enter__(self) -> ExperienceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- tables ---------------------------------------------------------------------------------------------

    def open(self, iteration: int, *, slots: int, group_size: int | None = None) -> TableInfo:
        body = _request(dw.OpenRequest, slots=slots, group_size=group_size)
        return self._call("PUT", f"/experience/tables/{iteration}", dw.TableBody, body).info()

    def tables(self) -> list[TableInfo]:
        return [t.info() for t in self._call("GET", "/experience", dw.ExperienceOverview).tables]

    def table(self, iteration: int) -> TableInfo:
        return self._call("GET", f"/experience/tables/{iteration}", dw.TableBody).info()

    # --- consumers ------------------------------------------------------------------------------------------

    def register(
        self, name: str, *, needs: Sequence[str], produces: Sequence[str] = (), dispatch_size: int | None = None
    ) -> Consumer:
        body = _request(dw.RegisterRequest, needs=list(needs), produces=list(produces), dispatch_size=dispatch_size)
        return self._call("PUT", f"/experience/consumers/{_segment(name)}", dw.ConsumerBody, body).consumer()

    def consumers(self) -> list[Consumer]:
        return [c.consumer() for c in self._call("GET", "/experience", dw.ExperienceOverview).consumers]

    # --- writes and reads by index ---------------------------------------------------------------------------

    def put(self, iteration: int, rows: Sequence[RowKey], columns: Mapping[str, Sequence[Value]]) -> None:
        """Write cells, ``rows_per_request`` rows per request (each cell is written once, so a part retried
        or repeated is harmless)."""
        stored = _checked(rows, columns)
        for start in range(0, max(len(rows), 1), self.rows_per_request):
            part = slice(start, start + self.rows_per_request)
            body = _request(
                dw.PutRequest,
                rows=list(rows[part]),
                columns=dw.columns_to_wire({n: v[part] for n, v in stored.items()}),
            )
            self._send("POST", f"/experience/tables/{iteration}/rows", body)

    def put_and_read(
        self,
        iteration: int,
        rows: Sequence[RowKey],
        columns: Mapping[str, Sequence[Value]],
        read: Sequence[str],
        *,
        wait_s: float = 0.0,
    ) -> dict[str, list[Value]]:
        """:meth:`put`, then :meth:`read` of the ``read`` columns of the same rows (waiting up to ``wait_s`` for
        another role to write them, such as the grader's rewards): one request where the rows fit one."""
        if len(rows) > self.rows_per_request:
            self.put(iteration, rows, columns)
            return self.read(iteration, rows, read, wait_s=wait_s)
        body = _request(
            dw.PutRequest,
            rows=list(rows),
            columns=dw.columns_to_wire(_checked(rows, columns)),
            read=list(read),
            wait_s=wait_s,
        )
        return dw.columns_from_wire(
            self._call("POST", f"/experience/tables/{iteration}/rows", dw.ReadBody, body).columns
        )

    def read(
        self,
        iteration: int,
        rows: Sequence[RowKey],
        columns: Sequence[str],
        *,
        missing: Literal["error", "none"] = "error",
        wait_s: float = 0.0,
    ) -> dict[str, list[Value]]:
        """As :meth:`ExperienceStore.read`; with ``wait_s``, the server waits that long for unwritten cells to be
        written before it answers that they are not."""
        body = _request(dw.ReadRequest, rows=list(rows), columns=list(columns), missing=missing, wait_s=wait_s)
        return dw.columns_from_wire(
            self._call("POST", f"/experience/tables/{iteration}/read", dw.ReadBody, body).columns
        )

    # --- consuming ------------------------------------------------------------------------------------------

    def dispatch(
        self,
        consumer: str,
        count: int | None = None,
        *,
        iteration: int | None = None,
        groups: bool = False,
        dp_size: int = 1,
        balance_by: str | None = None,
        max_tokens_per_microbatch: int | None = None,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> Dispatch:
        """As :meth:`ExperienceStore.dispatch`; with ``wait_s`` (at most 30 s) the server holds the request until a
        row is ready or that long passed (a long poll)."""
        body = _request(
            dw.DispatchRequest,
            count=count,
            iteration=iteration,
            groups=groups,
            dp_size=dp_size,
            balance_by=balance_by,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            lease_s=lease_s,
            wait_s=wait_s,
        )
        return self._call(
            "POST", f"/experience/consumers/{_segment(consumer)}/dispatch", dw.DispatchBody, body
        ).dispatch()

    def collect(self, lease: str, columns: Mapping[str, Sequence[Value]]) -> Collected:
        body = _request(dw.CollectRequest, columns=dw.columns_to_wire(as_stored(columns)))
        path = f"/experience/leases/{_segment(lease)}/collect"
        return self._call("POST", path, dw.CollectedBody, body).collected()

    def collect_and_dispatch(
        self,
        lease: str,
        columns: Mapping[str, Sequence[Value]],
        count: int | None = None,
        *,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[Collected, Dispatch]:
        """As :meth:`ExperienceStore.collect_and_dispatch`, in one request."""
        then = _request(dw.DispatchRequest, count=count, lease_s=lease_s, wait_s=wait_s)
        body = _request(dw.CollectRequest, columns=dw.columns_to_wire(as_stored(columns)), next=then)
        answer = self._call("POST", f"/experience/leases/{_segment(lease)}/collect", dw.CollectedBody, body)
        if answer.next is None:
            raise ExperienceError("the server answered the collection without the dispatch it was asked for")
        return answer.collected(), answer.next.dispatch()

    def dispatch_many(
        self, consumer: str, count: int | None = None, *, tables: int = 8, lease_s: float = 60.0, wait_s: float = 0.0
    ) -> tuple[Dispatch, ...]:
        """As :meth:`ExperienceStore.dispatch_many`; ``wait_s`` (at most 30 s) is a long poll, as for
        :meth:`dispatch`."""
        body = _request(dw.DispatchManyRequest, count=count, tables=tables, lease_s=lease_s, wait_s=wait_s)
        path = f"/experience/consumers/{_segment(consumer)}/dispatches"
        return self._call("POST", path, dw.DispatchesBody, body).all()

    def collect_many(
        self, consumer: str, results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]]
    ) -> tuple[Collected | LeaseError, ...]:
        """As :meth:`ExperienceStore.collect_many`, in one request."""
        return self._collections(consumer, results, None).outcomes()

    def collect_and_dispatch_many(
        self,
        consumer: str,
        results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]],
        count: int | None = None,
        *,
        tables: int = 8,
        lease_s: float = 60.0,
        wait_s: float = 0.0,
    ) -> tuple[tuple[Collected | LeaseError, ...], tuple[Dispatch, ...]]:
        """As :meth:`ExperienceStore.collect_and_dispatch_many`, in one request."""
        then = _request(dw.DispatchManyRequest, count=count, tables=tables, lease_s=lease_s, wait_s=wait_s)
        answer = self._collections(consumer, results, then)
        if answer.next is None:
            raise ExperienceError("the server answered the collections without the dispatches they asked for")
        return answer.outcomes(), answer.next.all()

    def _collections(
        self,
        consumer: str,
        results: Sequence[tuple[str, Mapping[str, Sequence[Value]]]],
        then: dw.DispatchManyRequest | None,
    ) -> dw.CollectedManyBody:
        collections = [
            _request(dw.Collection, lease=lease, columns=dw.columns_to_wire(as_stored(columns)))
            for lease, columns in results
        ]
        body = _request(dw.CollectManyRequest, collections=collections, next=then)
        path = f"/experience/consumers/{_segment(consumer)}/collections"
        return self._call("POST", path, dw.CollectedManyBody, body)

    def renew(self, lease: str, lease_s: float = 60.0) -> float:
        body = _request(dw.RenewRequest, lease_s=lease_s)
        return self._call("POST", f"/experience/leases/{_segment(lease)}/renew", dw.RenewBody, body).expires_at

    def consumption(self, consumer: str, iteration: int) -> Consumption:
        path = f"/experience/consumers/{_segment(consumer)}/tables/{iteration}"
        return self._call("GET", path, dw.ConsumptionBody).consumption()

    def all_consumed(self, consumer: str, iteration: int) -> bool:
        return self.consumption(consumer, iteration).all_consumed

    # --- plumbing -------------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, model: type[M], body: BaseModel | None = None) -> M:
        with _experience_errors():
            return self.client._call(method, path, model, body)

    def _send(self, method: str, path: str, body: BaseModel) -> None:
        with _experience_errors():
            self.client._send(method, path, body)


def _request(model: type[M], **fields: Any) -> M:
    """The request body, checked here as the server would check it, so that a bad value is the same
    :class:`ExperienceInputError` on both faces."""
    try:
        return model(**fields)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field = ""
        for part in error["loc"]:
            field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
        raise ExperienceInputError(field or "body", f"{error['msg']}; got {error.get('input')!r}") from None


def _checked(rows: Sequence[RowKey], columns: Mapping[str, Sequence[Value]]) -> dict[str, list[Value]]:
    """``columns`` as stored, each checked to hold one value per row: every value is checked before a request
    goes, so that a bad one never leaves part of a write done."""
    for name, values in columns.items():
        if len(values) != len(rows):
            raise ExperienceInputError(
                f"columns.{name}", f"{len(values)} values for {len(rows)} rows; send one per row"
            )
    return as_stored(columns)


def _segment(text: str) -> str:
    return quote(text, safe="")


@contextmanager
def _experience_errors() -> Iterator[None]:
    """The store's exception for an answer that names one (``code``), and for a request the schema refused."""
    try:
        yield
    except ServerError as exc:
        raise _as_experience_error(exc) from exc


def _as_experience_error(exc: ServerError) -> ExperienceError | DataserverError:
    try:
        body: Any = exc.response.json()
    except ValueError:
        body = None
    code = body.get("code") if isinstance(body, dict) else None
    if code == "invalid" or (code is None and exc.status_code == 422):
        field, _, message = exc.detail.partition(": ")
        return ExperienceInputError(field, message) if message else ExperienceInputError("body", exc.detail)
    cls = error_class(code) if isinstance(code, str) else None
    return cls(exc.detail) if cls is not None else exc
