"""Every command of ``conceptdict`` and every step of ``conceptdict demo`` imports and is wired up: a missing
module or function is an error here, never a command or demo step silently left out."""

from __future__ import annotations

import importlib

import pytest

from conceptdict import demo_api as demo
from conceptdict.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("command", sorted(main.COMMANDS))
def test_every_command_imports_and_has_help_arguments_and_run(command):
    module = importlib.import_module(f"conceptdict.cli.{main.COMMANDS[command]}")
    assert isinstance(module.HELP, str) and module.HELP
    assert callable(module.add_arguments) and callable(module.run)


@pytest.mark.parametrize("command", sorted(main.COMMANDS))
def test_the_parser_knows_every_command(command, capsys):
    with pytest.raises(SystemExit) as done:
        main.build_parser().parse_args([command, "--help"])
    assert done.value.code == 0 and f"conceptdict {command}" in capsys.readouterr().out


@pytest.mark.parametrize("name,step", demo.STEPS)
def test_every_demo_step_is_a_function(name, step):
    assert callable(step), f"demo step {name}: {step!r} is not a function"
