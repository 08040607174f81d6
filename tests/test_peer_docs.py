"""The other trainers' pages (docs/openrlhf.md, slime.md, verl.md): each page's Python example, run as printed
against a real server, writes the dataset file that trainer reads, with the fields it reads, and each row's
label is a sample id the server served, in the order it served them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from proctor.client import ProctorClient
from proctor.wire.dataserver import Sample
from proctor.wire.peers import ScoreItem
from tests.conftest import QA_ROWS

pytestmark = pytest.mark.e2e

DOCS = Path(__file__).resolve().parents[1] / "docs"
ANSWERS = {row["q"]: row["a"] for row in QA_ROWS}

Row = tuple[list[dict[str, Any]], str]
"""What a trainer reads from one row: the prompt's chat messages and the label it sends the reward server."""


def example(page: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.DOTALL)
    assert blocks, f"docs/{page} has no Python example"
    return "\n".join(blocks)


def render(chat: list[dict[str, Any]], *, tokenize: bool, add_generation_prompt: bool) -> str:
    """A chat template, as a tokenizer's ``apply_chat_template`` is called by OpenRLHF."""
    assert not tokenize and add_generation_prompt
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat) + "<|im_start|>assistant\n"


def openrlhf_rows(path: Path) -> list[Row]:
    # --data.input_key input --data.label_key label --data.apply_chat_template, read by openrlhf 0.11.2's own code.
    from openrlhf.datasets.prompts_dataset import preprocess_data

    rows = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        prompt, label = preprocess_data(data, None, "input", "label", render)
        assert prompt == render(data["input"], tokenize=False, add_generation_prompt=True)
        rows.append((data["input"], label))
    return rows


def slime_rows(path: Path) -> list[Row]:
    # --input-key input --label-key label --apply-chat-template: slime/utils/data.py's Dataset reads a JSONL row's
    # input (chat messages for the chat template) and data[label_key] (THUDM/slime 624b824a; slime needs Megatron).
    rows = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        assert isinstance(data["input"], list)
        rows.append((data["input"], data["label"]))
    return rows


def verl_rows(path: Path) -> list[Row]:
    # verl/utils/dataset/rl_dataset.py loads parquet with datasets; the reward managers read data_source,
    # reward_model.ground_truth and extra_info, and proctor.client.verl names the record by extra_info.sample_id.
    import datasets

    frame = datasets.load_dataset("parquet", data_files=str(path), cache_dir=str(path.parent / "hf-cache"))["train"]
    rows = []
    for n, data in enumerate(frame):
        assert data["reward_model"]["ground_truth"] == data["extra_info"]["sample_id"]
        assert data["extra_info"]["index"] == n
        assert data["data_source"] == data["extra_info"]["sample_id"].split(":")[0]
        rows.append((data["prompt"], data["extra_info"]["sample_id"]))
    return rows


READERS: dict[str, Callable[[Path], list[Row]]] = {
    "openrlhf.md": openrlhf_rows,
    "slime.md": slime_rows,
    "verl.md": verl_rows,
}


@pytest.fixture
def served(live_server: Callable[..., AbstractContextManager[str]]) -> Iterator[str]:
    """A real server of the tiny curriculum, with no default source: every label must name a record."""
    with live_server() as url:
        yield url


@pytest.mark.parametrize("page", sorted(READERS))
def test_the_pages_example_writes_the_dataset_its_trainer_reads(
    page: str, served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROCTOR_URL", served)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(example(page), f"docs/{page}", "exec"), namespace)
    output = Path(namespace["OUTPUT"])
    assert not output.is_absolute(), "the example writes to the path its OUTPUT names"
    rows = READERS[page](tmp_path / output)

    with ProctorClient(served) as client:
        # /sample answers the same batch for the same request: these are the samples the example was served.
        steps = range(client.meta().total_iterations)
        samples: list[Sample] = [s for i in steps for s in client.sample(i, namespace["BATCH_SIZE"]).samples]
        assert [label for _, label in rows] == [s.sample_id for s in samples]
        for (messages, _), sample in zip(rows, samples, strict=True):
            assert messages == [
                {"role": "system", "content": sample.system_prompt},
                {"role": "user", "content": sample.prompt},
            ]
        # The tiny curriculum serves `qa` from step 10: grade one of its rows, right, by its label.
        messages, label = next((m, label) for m, label in rows if label.startswith("qa:"))
        [result] = client.score([ScoreItem(response=ANSWERS[messages[-1]["content"]], label=label)]).results
    assert (result.sample_id, result.reward, result.error) == (label, 1.0, None)

    if page == "verl.md":
        # And as verl calls the reward function the page configures, on a row of the file.
        from proctor.client import verl

        try:
            score = verl.compute_score(
                data_source="qa",
                solution_str="no",
                ground_truth=label,
                extra_info={"sample_id": label, "index": 0},
                proctor_url=served,
            )
        finally:
            verl.close()
        assert score == {"score": 0.0, "grading_error": 0.0}
