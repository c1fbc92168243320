"""The CLI answers what it can without torch, says its defaults, and spells a row's reproducing command
with its own options (issue 37, items 6 and 7). Each test here runs in well under a second or two."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli.options import build_parser, check_command

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sub
                out.update({f"{name} {k}": v for k, v in _subparsers(sub).items()})
    return out


def test_every_option_of_every_command_says_what_it_is() -> None:
    missing = [f"{name} {'/'.join(a.option_strings)}" for name, sub in _subparsers(build_parser()).items()
               for a in sub._actions if a.option_strings and a.help in (None, "") and a.dest != "help"]
    assert not missing, missing


@pytest.mark.parametrize(("command", "option", "default"), [
    ("check", "--timeout", "300"), ("check", "--load-timeout", "900"), ("check", "--mem-cap-mb", "8192"),
    ("check", "--compile-timeout", "600"), ("check", "--seed", "0"), ("check", "--oracle-max-params", "20e9"),
    ("diff", "--drift-factor", "2.0"), ("matrix", "--db", "results/portharness.db"),
    ("report", "--out", "reports/site"), ("groups", "--db", "results/portharness.db"), ("zoo", "--timeout", "120"),
    ("collectives", "--world-size", "2"), ("collectives", "--repeats", "10"),
])
def test_defaults_are_in_the_help(command: str, option: str, default: str) -> None:
    action = next(a for a in _subparsers(build_parser())[command]._actions if option in a.option_strings)
    assert f"default {default}" in " ".join(action.help.split()), action.help


def test_version_names_torch_and_transformers() -> None:
    r = subprocess.run([sys.executable, "-m", "harness.cli", "--version"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and r.stdout.startswith("portharness 0.") and "torch 2." in r.stdout


def test_an_unknown_model_is_answered_before_torch_is_imported() -> None:
    code = ("import sys; from harness.cli import main; rc = main(['check', 'tiny/bert/bsae']); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert r.stdout.split() == ["2", "False", "False"], r.stdout + r.stderr
    assert "unknown tiny model 'tiny/bert/bsae'" in r.stderr and "tiny/bert/base" in r.stderr  # close matches


def test_the_reproducing_command_parses_back_to_the_row_settings() -> None:
    settings = {"precision": "highest", "ops": "full", "mode": "generate", "cache": "static",
                "numerics": "cache-off-by-one", "compile": "inductor", "dynamic": True, "op_check": "sampled"}
    cmd = check_command("tiny/t5/seq2seq-lm", "sim", settings)
    assert cmd.startswith("portharness check tiny/t5/seq2seq-lm --target sim ")
    args = build_parser().parse_args(cmd.split()[1:])
    assert args.model == "tiny/t5/seq2seq-lm" and args.target == "sim"
    assert {k: getattr(args, k) for k in settings} == settings
    assert check_command("org/name with space", "cuda", {"precision": "default"}) == \
        "portharness check 'org/name with space' --target cuda"  # defaults left out, quoted for a shell
