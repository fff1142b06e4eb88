"""Every command and Python block of docs/guide/*.md goes through what a user's run goes through up to the work:
the command line's parser and settings, the API function's signature and the config it builds (issue 50: the
guide's `cbsae` call was a TypeError in both forms, and nothing read it).

Here nothing runs: each ``conceptdict`` function is replaced by a checker that binds the real signature, builds the
real config from the keywords (so a renamed flag, a renamed or colliding parameter, a setting that no longer exists
or a missing required one fails) and stops; in a Python block it returns a stand-in on which only the returned
class's methods can be called (a renamed method fails). Which guide blocks also run end to end, and why the
others do not, is ``RUNS`` below, one reason per guide."""

from __future__ import annotations

import inspect
import re
import shlex
import typing
import unittest.mock
from pathlib import Path

import pytest
from test_api_signatures import CLASSES, configs_of

import conceptdict
from conceptdict.cli.main import main
from conceptdict.settings import settings_of

pytestmark = pytest.mark.unit

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide"
GUIDES = sorted(GUIDE.glob("*.md"))

RUNS = {
    "README.md": "no commands (the guide's index)",
    "cache.md": "end to end: its cache, store info and store verify commands are the README walkthrough's "
                "(tests/test_readme.py); the rest parse only (an acts.npy the user has)",
    "concepts.md": "end to end: name/show/cbm/export in the README walkthrough, the CB-SAE section in "
                   "tests/test_cbsae_cli.py; `broad` trains on ~60k texts (12 minutes)",
    "diff.md": "parse only: two model directories and two .npy files the guide names as placeholders",
    "distributed.md": "parse only: torchrun over 8 CUDA GPUs, gpt2 and openwebtext from the hub",
    "evaluate.md": "parse only: a sweep's folders and a crosscoder the other guides build (eval runs in the README "
                   "walkthrough)",
    "foreign-dictionaries.md": "parse only: SAELens / Gemma Scope dictionaries from the hub, a push to the hub",
    "interventions.md": "parse only: a store with a my_concept label column the user supplies",
    "replacement-models.md": "parse only: a causal LM store and a model named M (a placeholder)",
    "train.md": "parse only: the README walkthrough runs its first command's train without --kind batchtopk; "
                "an MLP store, 200k live tokens, wandb",
    "troubleshooting.md": "parse only: the README walkthrough's store",
    "vision.md": "parse only: CLIP ViT-B/16 and CIFAR-10 from the hub on CUDA (tests/test_vision_cli.py runs the "
                 "commands on a tiny CLIP)",
}


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(guide file name, block text) of every fenced block in ``lang``."""
    return [(p.name, body) for p in GUIDES for body in re.findall(rf"```{lang}\n(.*?)```", p.read_text(), re.S)]


def guide_commands() -> list[tuple[str, list[str]]]:
    """(guide, argv) of every ``conceptdict`` line of a bash block (``torchrun ... -m conceptdict.cli.main ARGS``
    too), continuation lines joined, comments dropped."""
    out = []
    for guide, body in _blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["conceptdict"]:
                out.append((guide, words[1:]))
            elif "conceptdict.cli.main" in words:
                out.append((guide, words[words.index("conceptdict.cli.main") + 1:]))
    return out


KEPT = {"set_read_policy"}
"""Public functions left real: the command line sets the read policy before its command's one API call."""


class Parsed(BaseException):
    """Raised by a checked API function instead of running it (a BaseException: no ``except Exception`` eats it)."""


def _checker(name: str, stop: bool):
    """``cd.<name>`` that binds the call to the real signature and builds the real configs, then stops (``stop``)
    or returns a mock result for the block's next lines."""
    real = getattr(conceptdict, name)

    def check(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        known = {s.keyword for cls in configs_of(name) for s in settings_of(cls)} | {"overwrite"}
        _build(name, {k: v for k, v in bound.arguments.items() if k in known})
        if stop:
            raise Parsed(name)
        return _result(real, name)

    return check


def _result(real, name: str) -> unittest.mock.MagicMock:
    """A stand-in for what ``cd.<name>`` returns. When that is one class, a method the class lacks is not callable
    on it (issue 51: the guides called ``store.context(0)`` and ``cmp.table()``); any other attribute is a value,
    since what ``__init__`` sets only an instance has."""
    label = f"cd.{name}()"
    returns = typing.get_type_hints(real).get("return")
    if not inspect.isclass(returns):
        return unittest.mock.MagicMock(name=label)

    class Instance(unittest.mock.MagicMock):
        def _get_child_mock(self, **kw):
            attr = kw.get("_new_name") or kw.get("name") or ""
            known = hasattr(returns, attr) or not isinstance(attr, str) or not attr.isidentifier()
            return (unittest.mock.MagicMock if known else unittest.mock.NonCallableMagicMock)(**kw)

    return Instance(name=label)


def _build(name: str, settings: dict) -> None:
    """The configs ``cd.<name>(**settings)`` builds, through the API's own config builders."""
    from conceptdict.diff_api import diff_configs
    from conceptdict.settings import config_from_dict, split_settings
    from conceptdict.train_api import train_configs

    configs = configs_of(name)
    if not configs:
        return
    settings.pop("overwrite", None)  # the --out guard's opt-in (conceptdict.outdir), on every writing command
    if name in ("train", "diff"):
        (train_configs if name == "train" else diff_configs)(**settings)
        return
    for cls, part in zip(configs, split_settings(settings, *configs, where=name)):
        config_from_dict(cls, part, name)


@pytest.fixture
def checked(monkeypatch, tmp_path):
    """Every public function of conceptdict replaced by its checker, in an empty working directory."""
    monkeypatch.chdir(tmp_path)

    def use(stop: bool) -> None:
        for name in conceptdict.__all__:
            if name not in CLASSES and name not in KEPT:
                monkeypatch.setattr(conceptdict, name, _checker(name, stop))

    return use


def test_every_guide_says_whether_it_runs():
    assert sorted(RUNS) == [p.name for p in GUIDES], "a guide was added or removed: say in RUNS how it is tested"
    assert len(guide_commands()) > 40 and len(_blocks("python")) > 25


@pytest.mark.parametrize("guide,argv", guide_commands(), ids=[f"{g}:{' '.join(a)[:60]}" for g, a in guide_commands()])
def test_guide_command_parses_and_builds_its_settings(guide, argv, checked, capsys):
    checked(stop=True)
    elided = "..." in argv  # `train ... --latent-shards 4`: the flags shown must exist; the settings are not whole
    try:
        if elided:
            from conceptdict.cli.main import build_parser

            build_parser(argv[0]).parse_args([a for a in argv if a != "..."])
        else:
            rc = main(argv)
            pytest.fail(f"{guide}: `conceptdict {shlex.join(argv)}` fails (exit {rc}) before it would run: "
                        f"{capsys.readouterr().err}")
    except Parsed:
        return
    except SystemExit as e:
        pytest.fail(f"{guide}: `conceptdict {shlex.join(argv)}` does not parse ({e.code}): {capsys.readouterr().err}")


@pytest.mark.parametrize("guide", sorted({g for g, _ in _blocks("python")}))
def test_guide_python_blocks_bind_and_build_their_settings(guide, checked):
    checked(stop=False)
    scope = {"cd": conceptdict, "__name__": "__guide__"}
    for i, (_, code) in enumerate(b for b in _blocks("python") if b[0] == guide):
        exec(compile(code, f"{guide} (python block {i + 1})", "exec"), scope)
