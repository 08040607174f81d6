"""Settings from PROCTOR_* variables; a bad value names its variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proctor.server.settings import Settings, SettingsError, load_settings
from proctor.server.shipped import builtin_path


def test_defaults() -> None:
    s = load_settings()
    assert s.curriculum == builtin_path("arithmetic")
    assert (s.host, s.port, s.max_batch_size) == ("127.0.0.1", 8000, 4096)
    # Each curriculum (name and content hash) is a run of its own, with its state file under .proctor/runs.
    assert s.state_path("arithmetic", "12e5") == ".proctor/runs/arithmetic-12e5.db"
    assert s.run_name("arithmetic", "12e5") == "arithmetic-12e5"
    assert s.api_key is None
    assert s.grader_workers >= 1


def test_environment_variables(monkeypatch: pytest.MonkeyPatch, curriculum_file: Path) -> None:
    monkeypatch.setenv("PROCTOR_CURRICULUM", str(curriculum_file))
    monkeypatch.setenv("PROCTOR_PORT", "9001")
    monkeypatch.setenv("PROCTOR_API_KEY", "hunter2")
    monkeypatch.setenv("PROCTOR_MAX_BATCH_SIZE", "64")
    s = load_settings()
    assert (s.curriculum, s.port, s.max_batch_size) == (curriculum_file, 9001, 64)
    assert s.api_key is not None and s.api_key.get_secret_value() == "hunter2"
    assert "hunter2" not in repr(s)


def test_a_run_name_or_a_state_file_places_the_state(tmp_path: Path) -> None:
    named = load_settings(run="ablation-3", state_dir=tmp_path)
    assert named.run_name("arithmetic", "12e5") == "ablation-3"
    assert named.state_path("arithmetic", "12e5") == str(tmp_path / "ablation-3.db")
    explicit = load_settings(run="ablation-3", database_url=str(tmp_path / "mine.db"))
    assert explicit.state_path("arithmetic", "12e5") == str(tmp_path / "mine.db")
    assert load_settings(database_url=":memory:").state_path("arithmetic", "12e5") == ":memory:"


@pytest.mark.parametrize(
    ("url", "state"),
    [
        ("runs/mine.db", "runs/mine.db"),
        ("sqlite:///runs/mine.db", "runs/mine.db"),
        ("sqlite:////srv/runs/mine.db", "/srv/runs/mine.db"),
        ("sqlite://", ":memory:"),
        ("sqlite:///:memory:", ":memory:"),
        ("postgresql://proctor:secret@db:5432/run42", "postgresql://proctor:secret@db:5432/run42"),
    ],
)
def test_the_database_url_names_a_sqlite_file_or_a_postgresql_database(url: str, state: str) -> None:
    assert load_settings(database_url=url).state_path("arithmetic", "12e5") == state


def test_a_database_of_another_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROCTOR_DATABASE_URL", "mysql://db/run42")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert (
        "PROCTOR_DATABASE_URL (database_url): Value error, mysql:// is not a database proctor keeps state in; give a "
        "SQLite file (a path, or sqlite:///path) or a PostgreSQL database (postgresql://user:password@host:port/database)"
    ) in str(info.value)


def test_a_run_name_must_be_a_plain_file_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROCTOR_RUN", "../../etc/passwd")
    with pytest.raises(SettingsError, match=r"PROCTOR_RUN \(run\): String should match pattern"):
        load_settings()


def test_explicit_overrides_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROCTOR_PORT", "9001")
    assert load_settings(port=9002).port == 9002
    assert load_settings(port=None).port == 9001


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PROCTOR_PORT", "eighty", "PROCTOR_PORT (port): Input should be a valid integer"),
        ("PROCTOR_PORT", "70000", "PROCTOR_PORT (port): Input should be less than or equal to 65535"),
        (
            "PROCTOR_MAX_BATCH_SIZE",
            "0",
            "PROCTOR_MAX_BATCH_SIZE (max_batch_size): Input should be greater than or equal to 1",
        ),
        ("PROCTOR_STATE_SYNC", "sometimes", "PROCTOR_STATE_SYNC (state_sync): Input should be 'normal' or 'full'"),
        ("PROCTOR_CURRICULUM", "/no/such.yaml", "PROCTOR_CURRICULUM (curriculum): Value error, no curriculum file at"),
        (
            "PROCTOR_GRADER_TIMEOUT_S",
            "-1",
            "PROCTOR_GRADER_TIMEOUT_S (grader_timeout_s): Input should be greater than 0",
        ),
    ],
    ids=["port-text", "port-range", "batch-zero", "sync-enum", "curriculum-missing", "timeout-negative"],
)
def test_an_invalid_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match="invalid configuration") as info:
        load_settings()
    assert message in str(info.value)
    assert repr(value) in str(info.value)


def test_the_docs_list_every_setting() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    table = page.split("## Configuration", 1)[1].split("## Command line", 1)[0]
    listed = set(re.findall(r"^\| `PROCTOR_([A-Z_]+)` \|", table, flags=re.MULTILINE))
    assert listed == {name.upper() for name in Settings.model_fields}


def test_a_setting_under_its_former_name_is_refused_with_the_name_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROCTOR_DOCK_KEEP_ITERATIONS", "100")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value) == (
        "invalid configuration:\n  PROCTOR_DOCK_KEEP_ITERATIONS is now PROCTOR_EXPERIENCE_KEEP_ITERATIONS: set that instead"
    )


def test_the_state_variable_is_refused_with_the_database_url_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ignored, it would serve a fresh run from <state_dir> instead of the database the operator named.
    monkeypatch.setenv("PROCTOR_STATE", "/srv/runs/mine.db")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value) == "invalid configuration:\n  PROCTOR_STATE is now PROCTOR_DATABASE_URL: set that instead"
