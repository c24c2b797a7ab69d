"""The `rlhf` entry point, run in-process through typer's runner."""

from __future__ import annotations

import inspect
import json

import pytest
import typer.main
from typer.testing import CliRunner

from cli.main import app

BENCH_KEYS = {"algo", "updates", "episodes", "train_s", "episodes_per_s", "peak_rss_mib", "mfu", "phases_s", "metrics"}


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_bench_json(algo):
    result = CliRunner().invoke(app, ["bench", "--algo", algo, "--updates", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert BENCH_KEYS <= set(report) and report["algo"] == algo
    assert report["episodes"] == 64 and report["episodes_per_s"] > 0 and report["peak_rss_mib"] > 0
    assert "objective/scores" in report["metrics"] and "time/update_s" in report["metrics"]
    assert set(report["phases_s"]) == {"rollout", "score", "advantages", "update"}
    assert report["phases_s"]["update"] == pytest.approx(report["metrics"]["time/update_s"], abs=1e-4)  # 1 update
    if algo == "ppo":
        assert "loss/value_avg" in report["metrics"]


def test_bench_rejects_unknown_algo():
    result = CliRunner().invoke(app, ["bench", "--algo", "dpo"])
    assert result.exit_code != 0 and "dpo" in result.output


def test_an_unknown_stage_is_named_with_the_closest_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["stage", "trian"])
    assert result.exit_code == 2 and "did you mean 'train'" in result.output, result.output


def test_version_and_a_mistyped_command():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"rlhf-pipeline {version('rlhf-pipeline')}"
    result = CliRunner().invoke(app, ["modles", "list"])
    assert result.exit_code == 2 and "Did you mean 'models'?" in result.output, result.output


def _commands(command, path=()):
    yield list(path), command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_text_reflows_its_docstring_paragraphs():
    """A docstring's paragraphs are wrapped to the terminal, not broken again at the source's line ends (rich's
    default kept those: at 80 columns a sentence ran on after a short line)."""
    for path, command in _commands(typer.main.get_command(app)):
        out = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "400"}).output
        doc = inspect.getdoc(command.callback) if command.callback else command.help
        paragraphs = [" ".join(p.replace("`", "").split()) for p in (doc or "").split("\n\n") if p.strip()]
        lines = {" ".join(line.strip(" │").split()) for line in out.splitlines()}
        assert paragraphs and set(paragraphs) <= lines, (path, [p for p in paragraphs if p not in lines], out)
