"""The `rlhf` entry point, run in-process through typer's runner."""

from __future__ import annotations

import inspect
import json
import subprocess

import pytest
import typer.main
from typer.testing import CliRunner

from cli.main import app

BENCH_KEYS = {"algo", "updates", "episodes", "train_s", "episodes_per_s", "peak_rss_mib", "mfu", "phases_s", "metrics",
              "freed_memory_kept"}


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_bench_json(algo):
    result = CliRunner().invoke(app, ["bench", "--algo", algo, "--updates", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert BENCH_KEYS <= set(report) and report["algo"] == algo
    assert report["episodes"] == 64 and report["episodes_per_s"] > 0 and report["peak_rss_mib"] > 0
    assert "objective/scores" in report["metrics"] and "time/update_s" in report["metrics"]
    assert set(report["phases_s"]) == {"rollout", "score", "advantages", "update"}
    assert report["freed_memory_kept"] is True, "the bench keeps freed memory as every training stage does"
    assert report["phases_s"]["update"] == pytest.approx(report["metrics"]["time/update_s"], abs=1e-4)  # 1 update
    if algo == "ppo":
        assert "loss/value_avg" in report["metrics"]


def test_bench_table_shows_what_the_algorithm_measures():
    """The table (no --json) for GRPO at TRL's defaults: beta 0 loads no reference, so there is no KL to show."""
    result = CliRunner().invoke(app, ["bench", "--algo", "grpo", "--updates", "1"])
    assert result.exit_code == 0, result.output
    assert "episodes_per_s" in result.output and "objective/scores" in result.output
    assert "objective/kl" not in result.output


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


@pytest.mark.parametrize("args, said, command", [
    (["run", "--bogus"], "error: no such option: --bogus", "rlhf run"),
    (["validate", "data.jsonl", "--kind", "nope"], "error: invalid value for '--kind': 'nope' is not one of 'prompts', "
                                                   "'sft', 'preferences'", "rlhf validate"),
    (["validate"], "error: missing argument 'path'", "rlhf validate"),
    (["bench", "--updates", "0"], "error: invalid value for '--updates': Input should be greater than or equal to 1",
     "rlhf bench"),
    (["nosuch"], "error: no such command 'nosuch'", "rlhf"),
    (["models", "compare", "1", "--bogus"], "error: no such option: --bogus", "rlhf models compare"),
], ids=["option", "choice", "argument", "bound", "command", "subcommand"])
def test_usage_errors_speak_as_the_commands_errors_do(args, said, command):
    """A mistyped option, value, argument or command is said as the commands say theirs (`error: ...`, then the
    usage), not in typer's box titled "Error" beside them: one voice for every error of `rlhf`."""
    result = CliRunner().invoke(app, args, prog_name="rlhf")
    lines = result.output.splitlines()
    assert result.exit_code == 2 and lines[0] == said, result.output
    assert lines[1].startswith(f"usage: {command} ") and lines[1].endswith(f"({command} --help for more)"), lines
    assert len(lines) == 2 and "Error" not in result.output and "╭" not in result.output, result.output


def test_the_console_script_says_a_usage_error_in_one_voice():
    """The same through `rlhf` as installed (main()), on stderr, nothing on stdout."""
    import sys
    from pathlib import Path

    out = subprocess.run([Path(sys.executable).parent / "rlhf", "run", "--bogus"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.splitlines() == ["error: no such option: --bogus",
                                       "usage: rlhf run [OPTIONS]  (rlhf run --help for more)"], out.stderr


def test_an_empty_registry_is_said_as_an_error(mlflow_root, monkeypatch):
    """`rlhf models list` with nothing registered exits 1 saying so, in the voice of every other error (the line
    had no `error:` before it)."""
    monkeypatch.chdir(mlflow_root)
    result = CliRunner().invoke(app, ["models", "list", "--name", "rlhf-policy"], prog_name="rlhf")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: no versions of 'rlhf-policy' in sqlite:///"), result.output


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


def test_exps_fits_100_columns_with_a_sweeps_rows():
    """A sweep's experiments (long names, six differing params, every metric) made a 110-column table with a
    133-character footer line at 2a5c0fd; the table cuts the middle of long names, drops the params that do not
    fit into its notes, then its `created` column, and the notes wrap."""
    from cli.exps import table

    def row(name, kl, lr, seed):
        params = {"base.profile": "demo", "train.algo": "ppo", "train.kl_coef": kl, "train.learning_rate": lr,
                  "base.seed": seed, "train.temperature": 0.7 + seed / 10, "train.num_ppo_epochs": 4 + seed,
                  "sft.epochs": 4 + seed, "reward_model.learning_rate": 5e-05 * (1 + seed),
                  "evaluate.max_new_tokens": 24 + seed}
        metrics = {"win_gold": 0.9166666666666666, "win_rm": 0.9375, "eval_kl": 1.4321, "eos": 1.0, "len": 18.25}
        return {"name": name, "created": "11-27T13:17", "params": params, "metrics": metrics}

    rows = [{**row("workspace", 0.3, 3e-05, 0), "unlocked": ["train.kl_coef", "train.learning_rate", "base.seed"]},
            row("main", 0.3, 3e-05, 0),
            *(row(f"  demo-ppo-kl_coef-{kl}-learning_rate-{lr}-seed-{seed}-1127-13{seed}502".replace(".", "-"),
                  kl, lr, seed) for kl, lr, seed in ((0.05, 1e-05, 1), (0.1, 3e-05, 2), (0.3, 1e-04, 3)))]
    view = table(rows, [])
    lines = view.splitlines()
    assert max(map(len, lines)) <= 100, "\n".join(f"{len(line):3} {line}" for line in lines)
    header = lines[0].split()
    assert header[:3] == ["experiment", "profile", "algo"] or header[:4] == ["experiment", "created", "profile",
                                                                           "algo"], header
    assert header[-5:] == ["win_gold", "win_rm", "eval_kl", "eos", "len"], header
    notes = " ".join(line.strip() for line in lines[lines.index("") + 1:])
    always, _, differing = notes.split("columns: ", 1)[1].split(" also differ", 1)[0].partition(
        "; differing between the rows: ")
    # every row's profile is demo: it is a column, never among the params said to differ
    assert always.split(", ") == ["base.profile", "train.algo"], notes
    shown = differing.split(", ")
    hidden = notes.split("also differ (--param KEY to show): ", 1)[1].split(" workspace:", 1)[0].split(", ")
    assert set(shown) | set(hidden) == {"train.kl_coef", "train.learning_rate", "base.seed", "train.temperature",
                                        "train.num_ppo_epochs", "sft.epochs", "reward_model.learning_rate",
                                        "evaluate.max_new_tokens"}, notes
    assert [k.rsplit(".", 1)[-1] for k in shown] == header[header.index("algo") + 1:len(header) - 5], (shown, header)
    assert "params.yaml now differs in train.kl_coef, train.learning_rate, base.seed" in notes, notes
    # each experiment keeps both ends of its name: its settings and its start time
    names = [line.split()[0] for line in lines[3:6]]
    assert all(n.startswith("demo-ppo-kl") and n.endswith(f"-13{seed}502") and "…" in n
               for n, seed in zip(names, (1, 2, 3), strict=True)), names
    assert len(shown) > 0, "a param column or more is left beside the cut names"
    # a narrow table is as it was: every column, whole names
    small = table([row("workspace", 0.3, 3e-05, 0), row("  kl-0-05-131502", 0.05, 3e-05, 0)], [])
    assert small.splitlines()[0].split()[:5] == ["experiment", "created", "profile", "algo", "kl_coef"], small
    assert "  kl-0-05-131502  11-27T13:17" in small


LIVE_RUN = """import pathlib, time
from flows.lock import workspace_lock
from flows.overrides import overrides_applied

with workspace_lock(".", 0, run="flow run point-1 (sweep)"), overrides_applied(".", "demo", ["base.seed=5"]):
    print("holding", flush=True)
    while not pathlib.Path("go").exists():
        time.sleep(0.1)
"""


def test_params_diff_tells_a_live_runs_overrides_from_an_interrupted_ones(tmp_path, monkeypatch):
    """While a run (a sweep's point) holds the workspace lock with its overrides in params.yaml, `rlhf params diff`
    said "an interrupted run left its overrides" and suggested `rlhf params reset` at 2a5c0fd. Now it names the
    run in progress; reset refuses while it runs; once the run is killed (-9), the note is an interrupted one's."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    shutil.copy(repo / "params.yaml", tmp_path / "params.yaml")
    for args in (["init", "-q"], ["add", "params.yaml"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                                                          "params"]):
        subprocess.run(["git", *args], cwd=tmp_path, check=True)
    committed = (tmp_path / "params.yaml").read_text()
    run = subprocess.Popen([sys.executable, "-c", LIVE_RUN], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert run.stdout.readline().strip() == "holding"
        monkeypatch.chdir(tmp_path)
        runner = CliRunner()
        live = runner.invoke(app, ["params", "diff"])
        assert live.exit_code == 0 and "base.seed: 0 -> 5" in live.output, live.output
        assert f"a run in progress (pid {run.pid} on" in live.output and "point-1" in live.output, live.output
        assert "interrupted" not in live.output and "reset" not in live.output, live.output
        refused = runner.invoke(app, ["params", "reset"])
        assert refused.exit_code == 2 and "a run in progress holds this workspace" in refused.output, refused.output
        from flows.overrides import restore_after_killed_run

        assert restore_after_killed_run(tmp_path) is None  # what a sweep does first: the live run's file stays
        assert "seed: 5" in (tmp_path / "params.yaml").read_text()
    finally:
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
    interrupted = CliRunner().invoke(app, ["params", "diff"])
    assert "an interrupted run left its overrides in params.yaml" in interrupted.output, interrupted.output
    assert "base.seed: 0 -> 5" in interrupted.output
    assert CliRunner().invoke(app, ["params", "reset"]).exit_code == 0
    assert (tmp_path / "params.yaml").read_text() == committed


# `rlhf` as its console script runs it, in a fresh interpreter: main() then the command, and what it left behind
MAIN_THEN = """import sys
from cli.main import main
sys.argv = ["rlhf", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
imported = "transformers" in sys.modules
from transformers.utils import logging
print(imported, logging.is_progress_bar_enabled())
"""


@pytest.mark.parametrize("preimported", [False, True], ids=["plain", "imported-before"])
def test_transformers_progress_bars_are_off_without_importing_it_at_start(preimported):
    """Every `rlhf` command keeps transformers' per-file bars out of the pipeline's output, yet a command that never
    needs transformers (`rlhf params --help`; `rlhf stage` handing itself to a warm stage server) does not import it
    (~0.5 s); where it is imported already (the stage server's forks) it is told directly."""
    import os
    import subprocess
    import sys

    script = ("import transformers\n" if preimported else "") + MAIN_THEN
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    out = subprocess.run([sys.executable, "-c", script, "params", "--help"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == f"{preimported} False", out.stdout[-2000:]


def test_a_run_that_rewrites_committed_results_says_why_and_what_to_do(tmp_path, capsys):
    """The first run in a fresh clone on another CPU rewrites dvc.lock and metrics/ in their last digits: the run
    names the files it changed (not those edited before it), says why, and how to keep or drop them."""
    from cli.committed_results import say_rewritten_results, unchanged_results

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "metrics").mkdir()
    for name in ("dvc.lock", "metrics/eval.json", "metrics/sft.json", "params.yaml"):
        (tmp_path / name).write_text("{}\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "results")
    (tmp_path / "metrics" / "sft.json").write_text('{"edited": "by hand"}\n')  # before the run: not the run's doing
    before = unchanged_results(tmp_path)
    assert before == {"dvc.lock", "metrics/eval.json"}
    say_rewritten_results(tmp_path, before)
    assert capsys.readouterr().err == "", "nothing rewritten yet: nothing said"
    (tmp_path / "dvc.lock").write_text("{1}\n")
    (tmp_path / "metrics" / "eval.json").write_text('{"win_rate_gold": 0.92}\n')
    (tmp_path / "params.yaml").write_text("x: 1\n")  # not a result
    say_rewritten_results(tmp_path, before)
    note = capsys.readouterr().err
    assert note.startswith("note: this run rewrote committed results: dvc.lock, metrics/eval.json."), note
    assert "sft.json" not in note and "params.yaml" not in note
    assert "differ in their last digits between CPUs" in note
    assert "git commit -m 'results on this machine' -- dvc.lock metrics" in note
    assert "git checkout -- dvc.lock metrics" in note
    assert unchanged_results(tmp_path / "metrics" / "nowhere") == set(), "outside git: nothing to say"


def test_a_stage_whose_input_is_missing_names_it_and_the_stage_that_makes_it(tmp_path, monkeypatch):
    """`rlhf stage register` with no models/policy (a killed plain `dvc repro` leaves none) ended in a raw
    FileNotFoundError; it names every missing input and the stage that makes it, in one line, before any work."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    for name in ("dvc.yaml", "params.yaml"):
        (tmp_path / name).write_text((repo / name).read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    result = CliRunner().invoke(app, ["stage", "register"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith("error: stage register: its inputs "), errors[0]
    assert "models/policy (made by stage train)" in errors[0] and "metrics/eval.json (made by stage evaluate)" in \
        errors[0], errors[0]
    assert "`dvc repro register` runs what makes them first" in errors[0]
