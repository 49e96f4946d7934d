"""dflash.cli: the parser every `python -m dflash.X` shares names the closest flag, choice or model in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash import cli, hub
from dflash.core.errors import DFlashError

ROOT = Path(__file__).resolve().parents[1]


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m dflash.x")
    p.add_argument("--prompt")
    p.add_argument("--temperature", type=float)
    p.add_argument("--verify", choices=("chain", "tree", "auto"))
    group = p.add_mutually_exclusive_group()
    group.add_argument("--enable-thinking", action="store_true")
    return p


@pytest.mark.parametrize("argv, line", [
    (["--promt", "x"], "error: unknown flag --promt (did you mean --prompt?); python -m dflash.x --help lists the flags"),
    (["--temprature=0.5"], "error: unknown flag --temprature (did you mean --temperature?);"),
    (["--enable-thinkng"], "error: unknown flag --enable-thinkng (did you mean --enable-thinking?);"),
    (["--verify", "tre"], "(did you mean tree?);"),
    (["--zzz"], "error: unknown flag --zzz; python -m dflash.x --help"),
    (["stray"], "error: unexpected argument stray;"),
])
def test_a_bad_command_line_is_one_line_with_the_closest_name(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert line in err and err.startswith("error: "), err


def test_every_cli_uses_the_shared_parser():
    direct = [str(p.relative_to(ROOT)) for folder in ("dflash", "backends", "converters")
              for p in (ROOT / folder).rglob("*.py")
              if p.name != "cli.py" and re.search(r"\bArgumentParser\(", p.read_text())]
    assert direct == []


def test_a_cli_suggests_through_its_subcommand():
    p = subprocess.run([sys.executable, "-m", "dflash.models", "fetch", "smollm2", "--wheeel", "x"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: unknown flag --wheeel (did you mean --wheel?); python -m dflash.models --help lists the flags"]


@pytest.mark.parametrize("name, guess", [("smollm", "smollm2"), ("SmolLM2", "smollm2"),
                                         ("smollm2-dflsh", "smollm2-dflash")])
def test_a_model_name_suggests_the_closest_known_one(name, guess):
    with pytest.raises(DFlashError, match=re.escape(f"(did you mean {guess}?)")):
        hub.resolve(name)


def test_an_unrelated_name_gets_no_guess():
    with pytest.raises(DFlashError) as e:
        hub.resolve("zzzzzz")
    assert "did you mean" not in str(e.value)
