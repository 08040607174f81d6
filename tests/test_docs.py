"""The README stays a short front page whose links resolve; the docs site lists every page it has.

``mkdocs build --strict`` (``make docs``) checks the links between the docs pages; it does not build the README.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_the_readme_is_at_most_10_kib() -> None:
    size = len(README.read_bytes())
    assert size <= 10 * 1024, f"README.md is {size} bytes; move detail into a page under docs/"


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub and MkDocs' toc extension make it for these pages' headings."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def test_every_relative_link_in_the_readme_points_at_a_file() -> None:
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    relative = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert relative, "the README links to its docs pages"
    missing = [t for t in relative if not (ROOT / t.split("#", 1)[0]).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    for target in [t for t in relative if "#" in t]:
        path, anchor = target.split("#", 1)
        headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.MULTILINE)
        assert anchor in {slug(h) for h in headings}, f"README.md links to {target}: no such heading"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = {page for entry in config["nav"] for page in entry.values()}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == in_nav


def test_the_deploying_page_shows_the_balancer_configuration_the_tests_run() -> None:
    from bench._balancer import nginx_config

    page = (ROOT / "docs" / "deploying.md").read_text()
    [block] = re.findall(r"```nginx\n(.*?)```", page, flags=re.DOTALL)
    upstreams = re.findall(r"server (\S+) max_fails", block)
    assert block == nginx_config(upstreams, "8000")


def test_the_learning_progress_example_of_the_curricula_page_loads(tmp_path: Path) -> None:
    from proctor.server.curriculum.adaptive import learning_progress_mixes
    from proctor.server.curriculum.loader import load_curriculum

    page = (ROOT / "docs" / "curricula.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", page, flags=re.DOTALL) if "learning_progress" in b]
    path = tmp_path / "ladder.yaml"
    path.write_text(block)
    curriculum = load_curriculum(path)
    [mix] = learning_progress_mixes(curriculum).values()
    assert mix.sources == ("easy", "medium", "hard")
    assert (mix.params.floor, mix.params.temperature, mix.params.window) == (0.05, 0.1, 64)
    assert curriculum.spec.stages[0].sampler.kind == "skip_zero_variance"


def test_the_refill_example_of_the_curricula_page_loads(tmp_path: Path) -> None:
    from proctor.server.curriculum.loader import load_curriculum
    from proctor.server.spec import ZeroVarianceRefillSpec

    page = (ROOT / "docs" / "curricula.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", page, flags=re.DOTALL) if "refill:" in b]
    path = tmp_path / "refilled.yaml"
    path.write_text(block)
    [stage] = load_curriculum(path).stages
    assert stage.refill == ZeroVarianceRefillSpec(kind="zero_variance", max_rounds=4)
