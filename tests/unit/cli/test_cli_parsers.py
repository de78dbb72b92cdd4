"""Every command line matches flags by their full name only and never echoes an unknown flag's
value (issue 24 item 8: ``--api-key sk-...`` was taken as ``--api-key-file`` and the key printed)."""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynamod.console.app import build_parser as console_parser
from dynamod.console.ctl.main import build_parser as ctl_parser
from dynamod.daemon.cli import ROLES, SUBCOMMANDS
from dynamod.shared.cli_parser import ArgumentParser, unrecognized_message

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("shared", "daemon", "console", "bench", "scripts")


def _with_subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _with_subparsers(sub)


def test_every_argument_parser_in_the_sources_turns_abbreviations_off() -> None:
    """A source scan, so a parser added tomorrow is held to it too: each construction is our
    ``ArgumentParser`` (abbreviations off by default) or passes ``allow_abbrev=False``."""
    offenders = []
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for match in re.finditer(r"argparse\.ArgumentParser\(", text):
                call = text[match.end(): match.end() + 400]
                if "allow_abbrev=False" not in call.split("\n)")[0]:
                    offenders.append(f"{path.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}")
    assert offenders == []


@pytest.mark.parametrize("build", [ctl_parser, console_parser], ids=["dynamoctl", "dynamo-console"])
def test_the_console_commands_and_every_subcommand_refuse_abbreviations(build) -> None:
    parsers = list(_with_subparsers(build()))
    assert parsers and all(not p.allow_abbrev for p in parsers)


@pytest.mark.parametrize("name", sorted({**ROLES, **SUBCOMMANDS}))
def test_each_role_parser_refuses_an_abbreviated_flag(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module({**ROLES, **SUBCOMMANDS}[name])
    parser = ArgumentParser(prog=f"dynamod {name}")
    module.add_args(parser)
    for action in parser._actions:
        action.required = False  # a required flag's error would come first (replay's --trace)
    full = next(a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--")
                and len(a.option_strings[0]) > 6 and a.nargs != 0 and a.option_strings[0] != "--help")
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([full[:-2], "sk-secret-value"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {full[:-2]} (and 1 value, not shown)" in err and "sk-secret-value" not in err


def test_the_unrecognized_message_names_flags_and_counts_values() -> None:
    assert unrecognized_message(["--api-key", "sk-x"]) == "unrecognized arguments: --api-key (and 1 value, not shown)"
    assert unrecognized_message(["--api-key=sk-x"]) == "unrecognized arguments: --api-key (and 1 value, not shown)"
    assert unrecognized_message(["--dry-run"]) == "unrecognized arguments: --dry-run"
    assert unrecognized_message(["a", "b"]) == "unrecognized arguments: 2 values, not shown"


def test_a_key_given_where_a_file_was_expected_is_not_printed(tmp_path: Path) -> None:
    """``--api-key-file sk-...`` or ``--cluster-token-file TOKEN``: the error names the flag's
    file as not readable without printing a value that does not look like a path."""
    from dynamod.daemon.frontend.http.auth import ApiKeys
    from dynamod.shared.errors import ConfigError
    from dynamod.shared.security.secrets import read_secret_file

    secret = "sk-" + "s3cr3t" * 4
    with pytest.raises(ConfigError) as keys:
        ApiKeys(file=secret)
    with pytest.raises(ConfigError) as token:
        read_secret_file(secret, "cluster token")
    for exc in (keys.value, token.value):
        assert secret not in str(exc) and "not shown" in str(exc) and "No such file or directory" in str(exc)
    with pytest.raises(ConfigError, match=rf"cannot read API keys file '{tmp_path}/keys': No such file"):
        ApiKeys(file=str(tmp_path / "keys"))
