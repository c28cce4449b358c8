"""The ``shapegate`` command as a user meets it: --version, and help for every option."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from importlib import metadata

import pytest

from gateway.tools.cli import build_parser, main


def parsers(
    parser: argparse.ArgumentParser, name: str = "shapegate"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"shapegate {metadata.version('shapegate')}"


def test_every_option_has_help_and_shows_its_default() -> None:
    missing = []
    commands = list(parsers(build_parser()))
    assert len(commands) > 10
    for name, parser in commands:
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            shown = parser._get_formatter()._get_help_string(action) or ""  # what --help prints
            if not action.help:
                missing.append(label)
            elif action.default not in (None, False, [], (), argparse.SUPPRESS) and (
                "default" not in shown
            ):
                missing.append(f"{label} (default not shown)")
    assert not missing, "\n".join(missing)
