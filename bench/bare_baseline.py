"""The bare baseline of the rollout path: what a simple dataserver does, keeping nothing.

A minimal FastAPI app on one uvicorn worker (httptools, uvloop) that holds a JSONL file's rows in memory.
``/sample`` draws ``batch_size`` of them at random; ``/grade`` parses the request with one pydantic model and
grades its completions in this process with proctor's own ``math`` grader, one after the other. No
curriculum, no persistence, no idempotency, no grader processes.

    python -m bench.bare_baseline ROWS.jsonl --port 8001
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from proctor.server.grading import builtin
from proctor.server.grading.base import GradeInput

__all__ = ["create_app", "main"]

TIMEOUT_S = 5.0


class SampleRequest(BaseModel):
    iteration: int
    batch_size: int


class GradeItem(BaseModel):
    sample_id: str
    slot: int | None = None
    completion: str
    completion_index: int | None = None
    completion_tokens: int | None = None


class GradeRequest(BaseModel):
    iteration: int | None = None
    items: list[GradeItem]


def create_app(rows: Sequence[dict[str, str]]) -> FastAPI:
    """``rows``: ``{"question", "answer"}`` records; record ``k`` is served as sample id ``rows:k``."""
    app = FastAPI()
    rng = random.Random(0)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/sample")
    async def sample(req: SampleRequest) -> dict[str, object]:
        keys = [rng.randrange(len(rows)) for _ in range(req.batch_size)]
        return {
            "samples": [
                {"sample_id": f"rows:{k}", "dataset_id": "rows", "prompt": rows[k]["question"], "metadata": {}}
                for k in keys
            ],
            "iteration": req.iteration,
        }

    @app.post("/grade")
    async def grade(req: GradeRequest) -> dict[str, object]:
        results = []
        for n, item in enumerate(req.items):
            answer = rows[int(item.sample_id.rsplit(":", 1)[1])]["answer"]
            reward = builtin.math(GradeInput(prompt="", completion=item.completion, answer=answer), timeout_s=TIMEOUT_S)
            index = item.completion_index if item.completion_index is not None else n
            results.append({"sample_id": item.sample_id, "completion_index": index, "reward": reward})
        return {"results": results}

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=Path, help="a JSONL file of {question, answer} records")
    parser.add_argument("--port", type=int, default=8001, help="port on 127.0.0.1 (default 8001)")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    uvicorn.run(
        create_app(rows),
        host="127.0.0.1",
        port=args.port,
        workers=1,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
