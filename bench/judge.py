"""LLM-judge completions graded per second at the judge's cap (``max_concurrency``), through a real ``/grade``.

A real OpenAI-compatible server runs here: ``transformers serve`` with the tiny offline model of
:func:`proctor.client.tiny.build_tiny_model` (it writes noise, so its scores are noise: what is measured is the
plumbing). A counting proxy stands in front of it and records the most requests it saw in flight at once. For each
``--caps`` value a ``proctor serve`` process whose curriculum declares the judge at that cap grades
``--completions`` completions in one ``/grade``: completions per second, the most in flight (never above the cap),
and how many verdicts were scores. ``transformers serve`` generates one answer at a time, so its rate is the model's
whatever the cap. The same is then measured, with ``--loopback-completions`` each, against loopback servers that
answer ``Score: 5``: one after ``--latency-ms`` (a judge that answers several at once, as a batching server does:
the rate follows the cap) and one at once (what the server's side of a judge costs, the model aside).

The pieces are shared with the tests: :class:`LoopbackServer` (a real HTTP server on 127.0.0.1 whose answers a
handler gives, counting requests in flight), :class:`ProxyServer` and :func:`transformers_serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench._results import save
from proctor.cli.launcher import ServerProcess, free_port

__all__ = [
    "LoopbackServer",
    "ProxyServer",
    "Reply",
    "Request",
    "chat_answer",
    "judge_model",
    "main",
    "transformers_serve",
]


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes | dict[str, Any] = b""
    headers: dict[str, str] = field(default_factory=dict)


def chat_answer(text: str) -> Reply:
    """A 200 with an OpenAI chat completion whose answer is ``text``."""
    return Reply(
        body={
            "id": "chatcmpl-loopback",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        }
    )


# A handler's reply to a request; None never answers (the connection hangs until the server closes).
Handler = Callable[[Request], Awaitable[Reply | None]]

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 429: "Too Many Requests", 500: "Internal Server Error"}


class LoopbackServer:
    """A real HTTP/1.1 server on 127.0.0.1 (asyncio streams, keep-alive) whose answers ``handler`` gives; it keeps
    every request, counts those in flight (read, not yet answered) and the most at once, and the connections.

    ``async with server:`` runs it on the running loop; ``with server.in_thread():`` on a loop of its own in a
    thread, for a caller without one (a test that drives a server process)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[Request] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.connections = 0  # opened, in all
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def open_connections(self) -> int:
        return len(self._tasks)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0, limit=4 * 1024 * 1024)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> LoopbackServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[LoopbackServer]:
        loop = asyncio.new_event_loop()
        started = threading.Event()
        stop: asyncio.Future[None] = loop.create_future()

        async def serve() -> None:
            async with self:
                started.set()
                await stop

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), name="loopback", daemon=True)
        thread.start()
        try:
            if not started.wait(30):
                raise RuntimeError("the loopback server did not start")
            yield self
        finally:
            loop.call_soon_threadsafe(stop.set_result, None)
            thread.join(30)
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while request := await _read_request(reader):
                self.requests.append(request)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    reply = await self.handler(request)
                    if reply is None:
                        await asyncio.Event().wait()  # never answers
                        return
                finally:
                    self.in_flight -= 1
                body = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
                headers = {"content-type": "application/json", **reply.headers, "content-length": str(len(body))}
                head = f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}\r\n"
                head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                writer.write(head.encode() + b"\r\n" + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, path, headers, body)


class ProxyServer(LoopbackServer):
    """A :class:`LoopbackServer` that passes every request on to ``upstream`` (``http://host:port``, the path kept)
    and its answer back."""

    def __init__(self, upstream: str) -> None:
        super().__init__(self._forward)
        self.upstream = upstream.rstrip("/")
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> str:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None))
        return await super().start()

    async def close(self) -> None:
        await super().close()
        if self._http is not None:
            await self._http.aclose()

    async def _forward(self, request: Request) -> Reply:
        assert self._http is not None
        headers = {k: v for k, v in request.headers.items() if k not in ("host", "content-length", "connection")}
        answer = await self._http.request(
            request.method, self.upstream + request.path, content=request.body, headers=headers
        )
        return Reply(answer.status_code, answer.content, {"content-type": answer.headers.get("content-type", "")})


def judge_model(folder: Path) -> Path:
    """The tiny offline model, made to sample: ``transformers serve`` applies a request's ``temperature`` only to a
    model whose generation config samples, and the tiny model's greedy answer is blank lines."""
    from proctor.client.tiny import build_tiny_model

    build_tiny_model(folder)
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text())
    if not config.get("do_sample"):
        config_path.write_text(json.dumps({**config, "do_sample": True}, indent=2))
    return folder


@contextlib.contextmanager
def transformers_serve(model: Path, log: Path, *, timeout: float = 180.0) -> Iterator[str]:
    """``transformers serve MODEL`` on a free loopback port, offline, its output in ``log``; yields its address
    (``http://127.0.0.1:PORT``, whose ``/v1`` is the OpenAI API) once ``/health`` answers, and stops it after."""
    port = free_port()
    command = [
        sys.executable,
        "-c",
        "from transformers.cli.transformers import main; main()",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited with {proc.returncode} (it needs the packages of transformers' "
                    f"`serving` extra: fastapi, uvicorn, openai):\n{log.read_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"transformers serve did not answer /health within {timeout:g}s")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_curriculum(folder: Path, name: str, url: str, model: str, cap: int, max_tokens: int) -> Path:
    """Arithmetic prompts graded by one judge at ``url``; its score is the first digit of its answer (noise, from
    the tiny model), on a 0..9 scale."""
    doc = {
        "name": name,
        "sources": {"add": {"kind": "arithmetic", "digits": [1, 3], "graders": ["judge"]}},
        "graders": {
            "judge": {
                "judge": {
                    "url": url,
                    "model": model,
                    "rubric": "Rate the answer to {prompt} from 0 to 9.\nAnswer: {response}\nScore:",
                    "score_pattern": r"(\d)",
                    "scale": [0, 9],
                    "max_concurrency": cap,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "timeout_s": 600,
                    "deadline_s": 3600,
                }
            }
        },
        "stages": [{"name": "only", "until_step": 1000, "mix": [{"source": "add"}]}],
    }
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def grade_once(folder: Path, curriculum: Path, completions: int) -> tuple[float, list[dict[str, Any]]]:
    """One ``/grade`` of ``completions`` completions by a fresh ``proctor serve``: its seconds and its results."""
    name = curriculum.stem
    with (
        ServerProcess(
            [
                str(curriculum),
                "--database-url",
                str(folder / f"{name}.db"),
                "--grader-workers",
                "1",
                "--log-level",
                "warning",
            ],
            log=folder / f"{name}.log",
        ) as server,
        httpx.Client(base_url=server.url, timeout=3600) as http,
    ):
        samples = http.post("/sample", json={"iteration": 0, "batch_size": completions}).json()["samples"]
        items = [
            {"sample_id": s["sample_id"], "slot": s["slot"], "completion": f"It is {n}."} for n, s in enumerate(samples)
        ]
        started = time.perf_counter()
        answer = http.post("/grade", json={"iteration": 0, "items": items})
        took = time.perf_counter() - started
        if answer.status_code != 200:
            raise RuntimeError(f"/grade answered {answer.status_code}: {answer.text[:300]}")
        results: list[dict[str, Any]] = answer.json()["results"]
    return took, results


def _row(
    judge: str, cap: int, completions: int, seconds: float, proxy: LoopbackServer, results: list[dict[str, Any]]
) -> dict[str, Any]:
    scored = sum(1 for r in results if r["error"] is None)
    no_score = sum(1 for r in results if r["error"] is not None and "no score in its answer" in r["error"])
    return {
        "judge": judge,
        "cap": cap,
        "completions": completions,
        "seconds": seconds,
        "per_second": completions / seconds,
        "max_in_flight": proxy.max_in_flight,
        "requests": len(proxy.requests),
        "scored": scored,
        "no_score": no_score,
        "other_failures": len(results) - scored - no_score,
    }


def _answering_after(seconds: float) -> Handler:
    async def answer(request: Request) -> Reply:
        if seconds:
            await asyncio.sleep(seconds)
        return chat_answer("Score: 5")

    return answer


def run(
    caps: Sequence[int], completions: int, max_tokens: int, loopback_completions: int, latency_ms: float
) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="proctor-judge-") as tmp:
        folder = Path(tmp)
        model = judge_model(folder / "tiny")
        with transformers_serve(model, folder / "transformers.log") as upstream:
            for cap in caps:
                with ProxyServer(upstream).in_thread() as proxy:
                    curriculum = write_curriculum(
                        folder, f"model-{cap}", proxy.url + "/v1", str(model), cap, max_tokens
                    )
                    seconds, results = grade_once(folder, curriculum, completions)
                rows.append(_row("transformers serve, tiny model", cap, completions, seconds, proxy, results))
        loopback = [
            (f"loopback judge, {latency_ms:g} ms an answer", latency_ms / 1000),
            ("instant loopback judge", 0.0),
        ]
        for n, (label, latency_s) in enumerate(loopback):
            for cap in caps:
                with LoopbackServer(_answering_after(latency_s)).in_thread() as judge:
                    curriculum = write_curriculum(folder, f"loopback{n}-{cap}", judge.url + "/v1", "m", cap, max_tokens)
                    seconds, results = grade_once(folder, curriculum, loopback_completions)
                rows.append(_row(label, cap, loopback_completions, seconds, judge, results))
    return {
        "rows": rows,
        "max_tokens": max_tokens,
        "latency_ms": latency_ms,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| judge | cap | completions | judged per s | most in flight | scored | no score | other failures |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['judge']} | {r['cap']} | {r['completions']:,} | {r['per_second']:,.1f} | {r['max_in_flight']} "
            f"| {r['scored']:,} | {r['no_score']:,} | {r['other_failures']:,} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench judge", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--caps", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="judge caps (default 1 4 16 64 256)"
    )
    parser.add_argument("--completions", type=int, default=64, help="completions per /grade (default 64)")
    parser.add_argument("--max-tokens", type=int, default=32, help="the judge's max_tokens (default 32)")
    parser.add_argument(
        "--loopback-completions", type=int, default=1024, help="completions per /grade of the loopback judges (1024)"
    )
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the slower loopback judge's latency (50)")
    args = parser.parse_args(list(argv))
    if min(args.completions, *args.caps, args.max_tokens, args.loopback_completions) < 1 or args.latency_ms < 0:
        parser.error("--completions, --caps, --max-tokens and --loopback-completions must be at least 1")
    result = run(args.caps, args.completions, args.max_tokens, args.loopback_completions, args.latency_ms)
    save("judge", result)
    print(
        f"\nLLM-judge completions graded per second at the judge's cap, through /grade ({result['machine']}; the "
        f"tiny model answers up to {result['max_tokens']} tokens)"
    )
    print(table(result))


if __name__ == "__main__":
    main(sys.argv[1:])
