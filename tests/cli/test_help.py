"""Every command's ``--help``: each argument says what it is, and the default it takes when not given."""

from __future__ import annotations

import argparse

import pytest

from proctor.cli.main import build_parser
from proctor.client.training.command import build_parser as train_parser


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {"proctor": build_parser(), "proctor train": train_parser()}
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.update({f"proctor {name}": p for name, p in action.choices.items()})
    return parsers


@pytest.mark.parametrize(("command", "parser"), sorted(_parsers().items()), ids=lambda v: str(v).split(" ")[-1])
def test_every_argument_is_explained_with_its_default(command: str, parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{command} {name} has no help"
        takes_a_default = action.default not in (None, False, argparse.SUPPRESS) or action.nargs == "?"
        if takes_a_default:
            assert "default" in action.help, f"{command} {name}: the help does not say its default ({action.default!r})"


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in ("serve", "validate", "preview", "grade-worker", "export", "train", "demo"):
        assert name in out
