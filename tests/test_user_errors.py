"""A user's mistake is one line naming the value and the fix, from Python and from the command line (issue 50):
never a raw IndexError / AttributeError / argparse line from deep inside."""

from __future__ import annotations

import pytest
import torch

import conceptdict as cd
from conceptdict.cli.main import main
from conceptdict.naming.concepts import Concept, ConceptDictionary


def _concepts(n: int = 3) -> ConceptDictionary:
    return ConceptDictionary(tuple(Concept(id=j, name=f"c{j}", score=0.5) for j in range(n)), torch.randn(n, 4))


@pytest.mark.unit
def test_a_latent_id_past_the_end_names_the_range():
    concepts = _concepts()
    with pytest.raises(IndexError, match=r"concepts\[99999\]: no latent 99999; this dictionary has latents 0\.\.2"):
        concepts[99999]
    with pytest.raises(TypeError, match=r"concepts\[1\.5\]: index by a latent id \(an int\) or a concept name"):
        concepts[1.5]
    assert concepts[-1].id == 2 and concepts[torch.tensor(1)].id == 1 and [c.id for c in concepts[:2]] == [0, 1]
    assert [c.id for c in concepts] == [0, 1, 2]


@pytest.fixture(scope="module")
def lm(tiny_lm_dir):
    from conceptdict.saes import SparseCoder

    torch.manual_seed(0)
    return cd.load_model(str(tiny_lm_dir)), SparseCoder(32, 16, 2, kind="topk")


@pytest.mark.integration
@pytest.mark.parametrize("edit,error,says", [
    ({9999: 0.0}, ValueError, r"edit=\{9999: 0\.0\}: latent 9999 is out of range; the dictionary has latents 0\.\.15"),
    ("ablate", TypeError, r"edit='ablate' is not an edit: pass None .*\{latent: value\} to clamp"),
    ({3: "off"}, ValueError, r"edit of latent 3: 'off' is not a value; write \{latent: value\}"),
    ({3: ("mul", 2.0)}, ValueError, r"edit of latent 3: \('mul', 2\.0\) is not a value"),
])  # fmt: skip
def test_a_bad_splice_edit_is_one_line(lm, edit, error, says):
    model, sae = lm
    with pytest.raises(error, match=says):
        cd.splice(model, sae, hookpoint="blocks.0.hook_out", edit=edit)
    with cd.splice(model, sae, hookpoint="blocks.0.hook_out", edit={3: 0.0, 4: ("add", 1.0)}):
        pass  # the forms the docstring gives still splice


@pytest.mark.unit
def test_splice_of_a_model_name_says_to_load_it():
    from conceptdict.saes import SparseCoder

    with pytest.raises(TypeError, match=r"splice\(model='default'\): pass a loaded model, e\.g\. model = "
                                        r"cd\.load_model\('default'\)"):
        cd.splice("default", SparseCoder(8, 16, 2))


@pytest.mark.unit
@pytest.mark.parametrize("argv,says", [
    (["cbm", "c", "--broad", "--out", "o"], "`conceptdict broad` is a command of its own: run it first and pass cbm "
                                            "the directory it writes; --broad is a flag of `conceptdict demo`"),
    (["cbm", "c", "--lable-column", "f", "--out", "o"], "--lable-column: did you mean --label-column?"),
    (["train", "--store", "s", "--concepts", "f"], "--concepts is a flag of `conceptdict cbsae`, not of train"),
])  # fmt: skip
def test_a_flag_of_another_command_is_named_under_the_commands_own_usage(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"usage: conceptdict {argv[0]} "), err
    (line,) = err.splitlines()[-1:]
    assert line.startswith(f"conceptdict {argv[0]}: error: unrecognized arguments: ") and says in line, err
    assert line.endswith(f"`conceptdict {argv[0]} --help` lists its flags")


@pytest.mark.unit
def test_an_unknown_vocabulary_fails_before_the_evidence_pass(monkeypatch):
    from test_naming_fakes import FakeCoder, random_token_store

    from conceptdict.naming import pipeline

    def evidence(*args, **kwargs):
        raise AssertionError("the evidence pass ran before the vocabulary was checked")

    monkeypatch.setattr(pipeline, "collect_evidence", evidence)
    with pytest.raises(ValueError, match="vocabulary spec 'wordfreq:xx:3000': wordfreq has no language 'xx'"):
        pipeline.name_dictionary(FakeCoder(torch.eye(4), k=1), random_token_store(d=4),
                                 pipeline.NameConfig(vocab="wordfreq:xx:3000"))


class Started(Exception):
    """Raised in place of training: what was logged before it is what a user sees before the run starts."""


@pytest.mark.unit
@pytest.mark.parametrize("tokens,says", [
    (1024, "this run will train only 16 steps (1024 tokens in batches of 64): too few to fit a dictionary; cache more "
           "rows (or pass more --tokens), or --batch-size 20 or smaller, for 50 steps or more"),
    (256, "this run will train only 4 steps (256 tokens in batches of 64): too few to fit a dictionary; cache more "
          "rows (or pass more --tokens), for 50 steps or more"),  # batches of 5 rows: below the smallest batch
    (64 * 50, None),
])  # fmt: skip
def test_a_run_of_few_steps_says_so_before_training(planted_store, tmp_path, monkeypatch, caplog, tokens, says):
    from conceptdict import train_run

    def train_sweep(*args, **kwargs):
        raise Started

    monkeypatch.setattr(train_run, "train_sweep", train_sweep)
    with caplog.at_level("WARNING", logger="conceptdict.train_run"), pytest.raises(Started):
        cd.train(store=planted_store, latents=32, k=2, tokens=tokens, batch_size=64, out=tmp_path / "sae")
    assert (says in caplog.text) if says else "will train only" not in caplog.text, caplog.text


@pytest.mark.parametrize("argv", [["name", "SAE_DIR"], ["cbm", "CONCEPTS", "--label-column", "label"],
                                  ["export", "SAE_DIR", "--format", "saelens"], ["plan", "--latents", "1024"]])
def test_a_command_that_is_not_rank_aware_is_refused_under_torchrun(argv, tmp_path, monkeypatch, capsys):
    """Under torchrun (WORLD_SIZE > 1) only cache, train and eval split their work over ranks; every other command
    would run whole on every rank and write the same files, so it stops first, saying so and what to do, and writes
    nothing. In one process the same guard lets everything through."""
    from conceptdict.cli.main import main
    from conceptdict.ranks import RANK_AWARE, refuse_ranks

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"`conceptdict {argv[0]}` runs in one process, and torchrun started 2" in err
    assert "Run it without torchrun" in err and list(tmp_path.iterdir()) == []
    for command in RANK_AWARE:
        refuse_ranks(command)  # no error
    monkeypatch.setenv("WORLD_SIZE", "1")
    refuse_ranks(argv[0])
