"""A stage's progress as a person reads it while the stage runs: in its log with output redirected
(tasks/tracking/progress.py, flows/dvc_repro.py), and in the Prefect UI's progress artifact (flows/progress.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60  # a deadline for a line to appear, not a timing assertion
# A stage's SFT bar (epochs, fractional) that moves a quarter, then waits for the file `go` before it ends.
HELD_BAR = """import pathlib, time
from tasks.tracking.progress import progress_bar

with progress_bar("sft", total=4) as update:
    update(1.0, "epoch 1.00/4  loss 2.5")
    while not pathlib.Path("go").exists():
        time.sleep(0.1)
    update(4.0, "epoch 4.00/4  loss 1.5")
"""


def _wait_for(path: Path, words: str, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + WAIT_S
    while True:
        seen = path.read_text() if path.is_file() else ""
        if words in seen:
            return seen
        assert proc.poll() is None, f"ended before writing {words!r}:\n{seen}"
        assert time.monotonic() < deadline, f"no {words!r} in {path.name} after {WAIT_S} s while the bar runs:\n{seen!r}"
        time.sleep(0.2)


def test_a_bar_without_a_terminal_writes_each_line_as_it_happens(tmp_path):
    """With stderr redirected to a file, the bar's first move is in the file while the stage still runs (at
    2a5c0fd rich printed the bar once, when it ended: a 16-minute SFT stage's log stayed empty until then)."""
    (tmp_path / "bar.py").write_text(HELD_BAR)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RLHF_PROGRESS_FILE", None)
    with (tmp_path / "stderr.log").open("w") as err:
        proc = subprocess.Popen([sys.executable, "bar.py"], cwd=tmp_path, env=env, stderr=err)
    try:
        first = _wait_for(tmp_path / "stderr.log", "sft: epoch 1.00/4  loss 2.5  (25%", proc)
        assert first.count("\n") == 1, first
        (tmp_path / "go").touch()
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        proc.kill()
        proc.wait()
    lines = (tmp_path / "stderr.log").read_text().splitlines()
    assert lines[0].startswith("sft: epoch 1.00/4  loss 2.5  (25%, eta 0:") and \
        lines[1] == "sft: epoch 4.00/4  loss 1.5  (100%, eta 0:00:00)", lines


def test_a_long_bar_without_a_terminal_says_something_every_half_minute(monkeypatch, capsys):
    """Between tenths of a long bar (a 16-minute SFT: a tenth is 1.6 min), a line each LINE_EVERY_S; moves that
    come quicker and smaller than a tenth wait for the next one."""
    import tasks.tracking.progress as progress

    monkeypatch.delenv("RLHF_PROGRESS_FILE", raising=False)
    with progress.progress_bar("sft", total=100) as update:
        update(1, "step 1")  # the first move
        update(2, "step 2")  # neither a tenth nor half a minute later
        monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
        update(3, "step 3")  # half a minute later
        monkeypatch.setattr(progress, "LINE_EVERY_S", 30.0)
        update(13, "step 13")  # a tenth later
        update(100, "step 100")  # the last
    steps = [line.split("  ")[0] for line in capsys.readouterr().err.splitlines()]
    assert steps == ["sft: step 1", "sft: step 3", "sft: step 13", "sft: step 100"], steps


def test_a_stage_log_fills_while_the_stage_runs(tmp_path):
    """What the flow writes to reports/logs/<stage>.log (flows/dvc_repro.py) is readable at once, not when 8 KiB
    have gathered or the stage ends."""
    from test_flow import git_dvc_repo

    from flows.dvc_repro import repro_stage, stage_env

    (tmp_path / "bar.py").write_text(HELD_BAR)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(
        {"stages": {"sft": {"cmd": f"PYTHONPATH={REPO} {sys.executable} bar.py && echo done > out.txt",
                            "deps": ["bar.py"], "outs": ["out.txt"]}}}))
    git_dvc_repo(tmp_path)
    log = tmp_path / "reports" / "logs" / "sft.log"
    env = stage_env({}, terminal=False)
    env.pop("RLHF_PROGRESS_FILE", None)

    result = {}
    repro = threading.Thread(target=lambda: result.update(r=repro_stage(tmp_path, "sft", log, env)))
    repro.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while "sft: epoch 1.00/4" not in (log.read_text() if log.is_file() else ""):
            assert repro.is_alive(), log.read_text()
            assert time.monotonic() < deadline, f"the log said nothing while the stage ran:\n{log.read_text()!r}"
            time.sleep(0.2)
    finally:
        (tmp_path / "go").touch()
        repro.join(timeout=120)
    assert result["r"].returncode == 0, log.read_text()
    assert "sft: epoch 4.00/4  loss 1.5  (100%, eta 0:00:00)" in log.read_text()


@pytest.fixture
def local_prefect(tmp_path, monkeypatch):
    """Prefect's temporary server, as `rlhf run` starts it, with its state under tmp_path."""
    from flows.prefect_env import temporary_server_if_needed

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with temporary_server_if_needed() as api:
        yield api


def test_the_progress_artifact_names_the_stage_once(local_prefect, monkeypatch):
    """The artifact read "train: train (update 2/4 ...)" at 2a5c0fd; now "train: update 2/4 ...", as its log line
    reads (reward-model's bar is "reward model": the same name)."""
    from prefect import flow, get_client, task
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.progress import forwarded_progress
    from tasks.tracking.progress import progress_bar

    lines = []

    class Logger:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    @task
    def stage(name: str, bar: str, moves: list[tuple[float, str]]) -> None:
        with forwarded_progress(name, Logger()) as env:
            monkeypatch.setenv("RLHF_PROGRESS_FILE", env["RLHF_PROGRESS_FILE"])
            with progress_bar(bar, total=4) as update:
                for done, info in moves:
                    update(done, info)

    @flow
    def pipeline() -> None:
        stage("train", "train", [(1, "update 1/4  reward 0.1"), (2, "update 2/4  reward 0.5")])
        stage("reward-model", "reward model", [(2.0, "epoch 2.00/4  loss 0.7")])
        stage("evaluate", "evaluate", [(3, "")])

    pipeline()
    with get_client(sync_client=True) as client:
        keys = ["rlhf-progress-train", "rlhf-progress-reward-model", "rlhf-progress-evaluate"]
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    assert {a.key: a.description for a in artifacts} == {
        "rlhf-progress-train": "train: update 2/4  reward 0.5",
        "rlhf-progress-reward-model": "reward-model: epoch 2.00/4  loss 0.7",
        "rlhf-progress-evaluate": "evaluate: 3/4"}
    # no terminal here: the stage wrote its progress lines itself, so the flow forwarded none of them again
    assert lines == [], lines


# A stage whose bar moves two fifths of the way, then waits for the file `go` before it goes on; at its end it prints
# its result as `rlhf stage` does (an indented JSON object).
HELD_STAGE = """import json, pathlib, time
from tasks.tracking.progress import progress_bar

with progress_bar("ok", total=5) as update:
    for i in range(1, 6):
        update(i, f"update {i}/5  reward {i / 10}")
        while i == 2 and not pathlib.Path("go").exists():
            time.sleep(0.1)
print(json.dumps({"episode": 64, "objective/kl": 0.02, "time": {"update_s": 1.5}}, indent=2, sort_keys=True))
"""


def _artifacts(api: str, key: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def _logs(api: str, flow_run_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    APILogWorker.drain_all(timeout=10)
    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def test_the_flow_run_shows_where_the_run_is_while_a_stage_runs_and_how_it_ended(local_prefect, tmp_path,
                                                                                 monkeypatch):
    """The flow run's own progress artifact (rlhf-run-progress): while a stage runs, that stage and its bar; at the
    end, how the run ended. Before it, the only progress artifact was the stage's, made inside its task run: the flow
    run's Artifacts tab (Prefect's V1 UI, which the "View at" link opens) listed it apart, under "Task runs". And the
    stage's printed result is one record of its log."""
    from test_flow import git_dvc_repo

    from flows.pipeline import rlhf_pipeline

    repo = tmp_path / "repo"
    repo.mkdir()
    stages = {"ok": {"cmd": "python bar.py && echo ok > ok.txt", "deps": ["bar.py"], "outs": ["ok.txt"]},
              "after": {"cmd": "cp ok.txt after.txt", "deps": ["ok.txt"], "outs": ["after.txt"]}}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (repo / "params.yaml").write_text("base:\n  profile: demo\n  seed: 0\n")
    (repo / "bar.py").write_text(HELD_STAGE)
    git_dvc_repo(repo)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("RLHF_TRACKING", "off")

    during = []

    def watch() -> None:  # what the UI shows while `ok` holds at 2/5, then let it go on
        deadline = time.monotonic() + WAIT_S
        try:
            while not during and time.monotonic() < deadline:
                during.extend(a for a in _artifacts(local_prefect, "rlhf-run-progress")
                              if a.description.startswith("stage 1/2 ok: 40%"))
                time.sleep(0.5)
        finally:
            (repo / "go").touch()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        state = rlhf_pipeline(return_state=True)
    finally:
        (repo / "go").touch()
        watcher.join()
    assert state.is_completed(), state
    run_id = state.state_details.flow_run_id
    [now] = [a for a in _artifacts(local_prefect, "rlhf-run-progress") if a.flow_run_id == run_id]
    assert during, f"while `ok` ran the flow run showed no progress of it; now: {now.description!r}"
    [seen] = during
    # the flow run's, not a task run's: its page lists it with the run's own artifacts
    assert seen.id == now.id and seen.flow_run_id == run_id and seen.task_run_id is None
    assert re.fullmatch(r"stage 1/2 ok: 40%, eta 0:\d\d:\d\d, update 2/5  reward 0\.2", seen.description), seen
    assert seen.type == "progress" and seen.data == 20.0  # two fifths of the first of two stages
    assert now.description == "done: 2 stages, 2 ran" and now.data == 100, now
    [stage] = [a for a in _artifacts(local_prefect, "rlhf-progress-ok") if a.flow_run_id == run_id]
    assert stage.task_run_id is not None and stage.data == 100  # the stage's own, on its task run, as before
    # the stage's result, printed as an indented object, is one record of its log (it was one per line: `{`, ...),
    # a metric per line as a person reads it (it was one line of raw JSON)
    messages = [log.message for log in _logs(local_prefect, run_id)]
    assert ("ok's result (to 4 digits; its log has every digit):\n"
            "  episode        64\n"
            "  objective/kl   0.02\n"
            "  time/update_s  1.5") in messages, messages
    assert not [m for m in messages if m.strip().startswith(("{", "}"))], messages

    # a failed stage: where the run stopped (ok is unchanged: DVC skips it)
    stages["after"]["cmd"] = "python -c \"import sys; sys.exit(3)\""
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    state = rlhf_pipeline(return_state=True)
    assert state.is_failed(), state
    [failed] = [a for a in _artifacts(local_prefect, "rlhf-run-progress")
                if a.flow_run_id == state.state_details.flow_run_id]
    assert failed.description == "failed at stage 2/2 after" and failed.data == 50, failed


def test_the_run_summary_keeps_its_links_whole_and_says_whose_outputs_the_workspace_holds(tmp_path, capsys,
                                                                                         monkeypatch):
    """Without a terminal (80 columns) the summary wrapped the Prefect link across lines; after an override run it
    said params.yaml is back but not that the workspace's outputs are the run's."""
    from tasks.tracking.progress import print_run_summary

    for name in ("COLUMNS", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "a-workspace-with-a-long-name" / ".prefect"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    run_id = "0c4f5a1e-7b2d-4e8a-9f31-5d6c7b8a9e0f"
    result = {"stages": [{"stage": "train", "ran": True, "seconds": 12.0}], "flow_run_id": run_id,
              "params_changed": [["train.kl_coef", 0.05, 0.07]], "dvc_experiment": "demo-ppo-kl-0-07"}
    print_run_summary(tmp_path, result, None, None)
    lines = capsys.readouterr().out.splitlines()
    assert f"  Prefect: PREFECT_HOME={home} prefect server start, then http://127.0.0.1:4200/runs/flow-run/{run_id}" \
        in lines, "\n".join(lines)
    said = " ".join(line.strip() for line in lines)
    assert "params.yaml is back as it was" in said and "the workspace's outputs (models/, metrics/, dvc.lock) are " \
        "this run's" in said and "the DVC experiment demo-ppo-kl-0-07" in said, said
