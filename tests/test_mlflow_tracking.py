"""MLflow tracking on a real sqlite store in tmp_path: nested stage runs, batched metric history, tables,
lineage tags, and logging errors that never fail a stage."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from test_pipeline import TINY

from flows.pipeline_run import end_pipeline_run, iter_runs, run_name, run_url, start_pipeline_run
from rlhf_core.jsonio import write_json, write_jsonl
from tasks.parameters.params import load_params
from tasks.runner import run_stage
from tasks.tracking.lineage import file_md5
from tasks.tracking.mlflow_store import TrackingError, experiment_id, experiment_url, get_client, tracking_uri
from tasks.tracking.mlflow_tracker import MlflowTracker
from tasks.tracking.progress import mlflow_ui_hint
from tasks.tracking.stage_tracking import stage_tracker, track_stage


def artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, path)}


def test_pipeline_run_groups_nested_stage_runs(mlflow_root, monkeypatch):
    root = mlflow_root
    (root / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    parent = start_pipeline_run(root, None, TINY)
    monkeypatch.setenv("RLHF_PARENT_RUN_ID", parent)
    run_stage("prepare", root, None, TINY)
    with pytest.raises(OSError, match="models/policy"):  # no trained policy yet: the stage fails
        run_stage("evaluate", root, None, TINY)
    end_pipeline_run(parent, "COMPLETED", root)

    client = get_client(root)
    run = client.get_run(parent)
    # named by what it is: profile, algorithm, overrides (cut, with a count of the rest), start time
    assert run.info.status == "FINISHED"
    assert re.fullmatch(r"demo-ppo-sft_train=128,sft_eval=16\+16-\d{4}-\d{6}", run.info.run_name)
    assert run_name(load_params(root, None, ["train.kl_coef=0.3"]), ["train.kl_coef=0.3"]).startswith(
        "demo-ppo-kl_coef=0.3-")
    again = start_pipeline_run(root, None, TINY)  # the same params (maybe in the same second): another name
    assert client.get_run(again).info.run_name != run.info.run_name
    assert client.get_run(again).data.tags["rlhf.params_hash"] == run.data.tags["rlhf.params_hash"]
    end_pipeline_run(again, "COMPLETED", root)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development", "not MLflow's GenAI views"
    assert run.data.params["train.kl_coef"] == "0.05" and run.data.params["prepare.world.sft_train"] == "128"
    assert json.loads(run.data.params["overrides"]) == TINY, "overrides are recorded verbatim"
    assert run.data.tags["rlhf.profile"] == "demo" and run.data.tags["rlhf.git_commit"] == "unknown"
    description = run.data.tags["mlflow.note.content"]  # the run page's Description says what the run is
    assert description.startswith("RLHF pipeline run: profile `demo`, algorithm `ppo`, overrides `prepare.world")
    assert "Each stage is a nested run below it" in description
    assert run.data.tags["rlhf.dvc_lock_md5"] == file_md5(root / "dvc.lock")
    assert {"dvc.lock", "metrics"} <= artifacts(client, parent)
    assert run_url(parent, root).endswith(f"/runs/{parent}?workflowType=machine_learning")

    prepare, evaluate = iter_runs(root, parent)
    assert (prepare.info.run_name, prepare.info.status) == (f"prepare · {run.info.run_name}", "FINISHED")
    assert prepare.data.params["prepare.world.sft_train"] == "128" and "base.seed" in prepare.data.params
    assert not any(k.startswith("train.") for k in prepare.data.params), "a stage logs only its own section"
    assert prepare.data.metrics["sft_train.rows"] > 0 and prepare.data.metrics["stage_seconds"] > 0
    assert {"metrics/prepare.json", "dvc.lock"} <= artifacts(client, prepare.info.run_id) | \
        artifacts(client, prepare.info.run_id, "metrics")
    assert (evaluate.info.run_name, evaluate.info.status) == (f"evaluate · {run.info.run_name}", "FAILED")
    assert "error.txt" in artifacts(client, evaluate.info.run_id)
    data_tag = "rlhf.data.data/prompts_eval.jsonl"  # lineage: md5 of the stage's data inputs
    assert evaluate.data.tags[data_tag] == file_md5(root / "data" / "prompts_eval.jsonl")

    monkeypatch.delenv("RLHF_PARENT_RUN_ID")
    metrics = track_stage("prepare", root, load_params(root, None, TINY), lambda: {"kept": 1})
    standalone = client.search_runs([run.info.experiment_id], "tags.`rlhf.stage` = 'prepare'",
                                    order_by=["attributes.start_time DESC"])[0]
    assert metrics == {"kept": 1} and "mlflow.parentRunId" not in standalone.data.tags
    assert re.fullmatch(r"prepare · demo-ppo-\d{4}-\d{6}", standalone.info.run_name)


def test_the_next_run_ends_the_runs_of_a_process_killed_with_sigkill(workspace):
    """`kill -9` leaves a pipeline run and its stage run RUNNING; the next stage run, or pipeline run, marks
    them KILLED and says which run found them. A run of a live process or of another host is left alone; a
    run whose pid now belongs to a later process (another start time) is not mistaken for a live one."""
    import signal
    import subprocess
    import sys

    from tasks.tracking.mlflow_store import FOUND_DEAD_TAG, OWNER_HOST, OWNER_PID, OWNER_STARTED, owner_tags

    root = workspace
    child = ("import os, sys, time\n"
             "from flows.pipeline_run import start_pipeline_run\n"
             "from tasks.parameters.params import load_params\n"
             "from tasks.tracking.stage_tracking import current_stage_run, track_stage\n"
             "os.environ['RLHF_PARENT_RUN_ID'] = parent = start_pipeline_run('.', None, [])\n"
             "def work():\n"
             "    print(parent, current_stage_run().run_id, flush=True)\n"
             "    time.sleep(600)\n"
             "track_stage('prepare', '.', load_params('.'), work)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    try:
        killed = proc.stdout.readline().split()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(killed) == 2, "the child opened its pipeline run and stage run"
    client = get_client(root)
    exp = experiment_id(client, root)
    assert {client.get_run(r).info.status for r in killed} == {"RUNNING"}, "what kill -9 leaves"
    alive = client.create_run(exp, tags=owner_tags()).info.run_id  # this process's: alive
    elsewhere = client.create_run(exp, tags={**owner_tags(), OWNER_HOST: "another-host"}).info.run_id

    track_stage("prepare", root, load_params(root), lambda: {})  # the next run: a stage run
    finder = client.search_runs([exp], "attributes.status = 'FINISHED'")[0]
    for run_id in killed:
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and run.info.end_time is not None
        assert f"when run {finder.info.run_name} ({finder.info.run_id}) started" in run.data.tags[FOUND_DEAD_TAG]
    assert {client.get_run(r).info.status for r in (alive, elsewhere)} == {"RUNNING"}

    # this pid, but not this process: it started at another time (the pid was reused)
    reused = client.create_run(exp, tags={**owner_tags(), OWNER_STARTED: "1000.00"}).info.run_id
    assert client.get_run(reused).data.tags[OWNER_PID] == str(os.getpid())
    pipeline = start_pipeline_run(root, None, [])  # the next run: a pipeline run
    assert client.get_run(reused).info.status == "KILLED"
    assert f"({pipeline}) started" in client.get_run(reused).data.tags[FOUND_DEAD_TAG]
    assert {client.get_run(r).info.status for r in (alive, elsewhere, pipeline)} == {"RUNNING"}
    end_pipeline_run(pipeline, "COMPLETED", root)


def test_an_experiment_made_without_the_kind_tag_gets_it(mlflow_root):
    client = get_client(mlflow_root)
    made = client.create_experiment("rlhf-pipeline")  # by hand, or by an older version of the pipeline
    assert experiment_id(client, mlflow_root) == made
    assert client.get_experiment(made).tags["mlflow.experimentKind"] == "custom_model_development"


def test_tracker_sends_metrics_in_batches(mlflow_root):
    client = get_client(mlflow_root)
    run_id = client.create_run(experiment_id(client, mlflow_root)).info.run_id
    tracker = MlflowTracker(client, run_id, flush_every=4)
    for step in range(1, 11):
        tracker.log_metrics({"objective/kl": 0.1 * step, "policy/clipfrac_avg": 0.0}, step)
        if step == 9:
            assert len(client.get_metric_history(run_id, "objective/kl")) == 8, "flushed every 4 updates"
    tracker.close()
    history = client.get_metric_history(run_id, "objective/kl")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(1, 11))
    assert max(history, key=lambda m: m.step).value == pytest.approx(1.0)


def test_stage_history_is_not_repeated_by_its_result(mlflow_root):
    def train() -> dict:  # stands in for the train stage: per-update metrics, then the last ones as result
        for step in (1, 2, 3):
            stage_tracker().log_metrics({"objective/kl": 0.1 * step}, step)
        return {"objective/kl": 0.3, "resumed_from_update": 0}

    track_stage("train", mlflow_root, load_params(mlflow_root), train)
    client = get_client(mlflow_root)
    run = client.search_runs([experiment_id(client, mlflow_root)], "tags.`rlhf.stage` = 'train'")[0]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "objective/kl")) == [1, 2, 3]
    assert run.data.metrics["resumed_from_update"] == 0


def test_stage_reports_become_artifacts_and_tables(mlflow_root):
    root = mlflow_root
    rows = [{"prompt": f"p{i}", "completion": f"c{i}", "score_rm": float(i)} for i in range(3)]

    def evaluate() -> dict:  # stands in for the evaluate stage: its outputs as dvc.yaml declares them
        write_jsonl(root / "reports" / "eval" / "completions.jsonl", rows)
        (root / "reports" / "eval" / "plot.png").write_bytes(b"\x89PNG fake")
        write_json(root / "metrics" / "eval.json", {"win_rate_rm": 0.75})
        return {"win_rate_rm": 0.75, "note": "text is not a metric"}

    track_stage("evaluate", root, load_params(root), evaluate)
    client = get_client(root)
    run = client.search_runs([experiment_id(client, root)], "tags.`rlhf.stage` = 'evaluate'")[0]
    assert run.data.metrics == {"win_rate_rm": 0.75}
    assert {"reports/eval/completions.jsonl", "reports/eval/plot.png"} <= artifacts(client, run.info.run_id,
                                                                                     "reports/eval")
    table = Path(client.download_artifacts(run.info.run_id, "tables/reports/eval/completions.json", str(root)))
    logged = json.loads(table.read_text())
    assert logged["columns"] == ["prompt", "completion", "score_rm"] and len(logged["data"]) == 3


def test_refused_writes_fail_the_close_naming_them_and_a_bad_parent_fails_first(mlflow_root, monkeypatch, caplog):
    """A write the store refuses for good is never swallowed: the stage goes on (training is not stopped by its
    logging), the writes after it still go, and the close fails naming each refused write."""
    from tasks.tracking.mlflow_tracker import TrackingRefused

    client = get_client(mlflow_root)
    tracker = MlflowTracker(client, "f" * 32, flush_every=1)  # a run that does not exist
    tracker.log_metrics({"objective/kl": 1.0}, 1)
    tracker.log_artifact(mlflow_root / "mlflow.db")
    with pytest.raises(TrackingRefused, match=r"refused writes of run f{32}: 1 metrics \(.*\); artifact mlflow.db"):
        tracker.close()

    run_id = client.create_run(experiment_id(client, mlflow_root)).info.run_id
    tracker = MlflowTracker(client, run_id)
    tracker.log_params({"a": 1})
    tracker.log_params({"a": 2})  # MLflow refuses to change a param
    tracker.log_metrics({"kept": 1.0}, 1)
    tracker.end("FINISHED")
    with pytest.raises(TrackingRefused, match=r"1 params \(.*Changing param values is not allowed"):
        tracker.close()
    run = client.get_run(run_id)
    assert run.data.metrics == {"kept": 1.0}, "the writes after a refused one still go"
    assert run.info.status == "FAILED", "a run with a refused write does not end FINISHED"

    monkeypatch.setenv("RLHF_PARENT_RUN_ID", "0" * 32)
    ran = []
    with pytest.raises(TrackingError, match="RLHF_PARENT_RUN_ID"):
        track_stage("prepare", mlflow_root, load_params(mlflow_root), lambda: ran.append(1) or {})
    assert not ran, "a misconfiguration fails before the stage does any work"

    monkeypatch.delenv("RLHF_PARENT_RUN_ID")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # a server that is not there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "1")  # a server down at the start is waited for this long
    with pytest.raises(TrackingError, match="127.0.0.1:9.*connection refused.*RLHF_TRACKING=off"):
        track_stage("prepare", mlflow_root, load_params(mlflow_root), lambda: ran.append(1) or {})
    assert not ran

    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the default local store, broken: the stage runs untracked
    broken = mlflow_root / "broken"
    (broken / "mlflow.db").mkdir(parents=True)
    assert track_stage("prepare", broken, load_params(mlflow_root), lambda: {"a": 1}) == {"a": 1}
    assert "runs untracked" in caplog.text


REPO = Path(__file__).resolve().parent.parent
ML_VIEW = "?workflowType=machine_learning"


def test_every_mlflow_link_opens_the_runs_table_not_the_genai_overview(mlflow_root, monkeypatch):
    """#28 item 2: MLflow 3.17 opens an experiment in its GenAI overview whatever the experiment's tags say; a link
    naming `workflowType=machine_learning` opens the runs table in any browser. Every link we print (the end-of-run
    summary, the Prefect artifact's run link) and document (README, docs/*.md, infra/README.md) names it."""
    root = mlflow_root
    parent = start_pipeline_run(root, None, TINY)
    exp = get_client(root).get_run(parent).info.experiment_id
    assert experiment_url(exp, root) == f"http://127.0.0.1:5000/#/experiments/{exp}/runs{ML_VIEW}"
    assert run_url(parent, root) == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{parent}{ML_VIEW}"
    serve, runs, run = mlflow_ui_hint(root, tracking_uri(root), parent)  # the summary at the end of `rlhf run`
    assert serve.startswith("mlflow ui --backend-store-uri sqlite:///"), serve
    assert runs.endswith(experiment_url(exp, root)) and run.endswith(run_url(parent, root))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.org/")
    assert experiment_url("7") == f"https://mlflow.example.org/#/experiments/7/runs{ML_VIEW}"
    docs = [REPO / "README.md", REPO / "infra" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    documented = [link for doc in docs for link in re.findall(r"#/experiments/[^\s)`'\"]*", doc.read_text())]
    assert documented and all(link.endswith(ML_VIEW) for link in documented), documented


def test_tracking_off_touches_no_store(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_TRACKING", "off")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert track_stage("prepare", tmp_path, load_params(tmp_path), lambda: {"a": 1}) == {"a": 1}
    assert start_pipeline_run(tmp_path, None, []) == "" and run_url("", tmp_path) is None
    assert not (tmp_path / "mlflow.db").exists()


def test_a_gpu_machine_logs_system_metrics_through_the_queue_stopped_before_the_runs_end(mlflow_root, monkeypatch,
                                                                                        tmp_path):
    """Where nvidia-smi exists (here a stand-in: NVML then finds no GPU, and MLflow's CPU, memory and disk samplers
    remain), the stage run gets system metrics, sampled by our thread and written through the run's queue (MLflow's
    own monitor, which writes beside it, never runs); on a failed stage the sampler is stopped and its last sample
    queued before the run's end. Without nvidia-smi no sampler exists at all."""
    import threading
    import time

    from tasks.tracking.stage_tracking import current_stage_run

    def samplers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(("rlhf-system-metrics",
                                                                           "SystemMetricsMonitor"))]

    params, client = load_params(mlflow_root), get_client(mlflow_root)
    seen = {}

    def laptop() -> dict:
        seen["laptop"] = samplers()
        return {"a": 1}

    track_stage("evaluate", mlflow_root, params, laptop)
    assert seen["laptop"] == [], "no nvidia-smi: no sampler"

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")

    def gpu_stage_that_fails() -> dict:  # runs until a sample is in MLflow (a deadline, not a timing), then fails
        run = seen["run"] = current_stage_run()
        seen["gpu"], give_up = samplers(), time.monotonic() + 120
        while not any(k.startswith("system/") for k in client.get_run(run.run_id).data.metrics):
            assert time.monotonic() < give_up, "no system metric within 120 s"
            time.sleep(0.05)
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        track_stage("evaluate", mlflow_root, params, gpu_stage_that_fails)
    run = client.get_run(seen["run"].run_id)
    assert seen["gpu"] == [f"rlhf-system-metrics-{run.info.run_id[:8]}"], "ours alone, not MLflow's monitor"
    assert "system/cpu_utilization_percentage" in run.data.metrics and run.info.status == "FAILED"
    assert samplers() == [], "stopped with the stage"
    sent = list(seen["run"].tracker.sent)
    assert sent[-1] == "the run's end (FAILED)", sent  # nothing after the end: the last sample came before it


def test_a_write_the_store_refuses_fails_the_stage_naming_it(mlflow_root):
    """A stage whose run gets a write the store refuses for good (here a param changed mid-run) does its work, then
    fails naming that write; its run ends FAILED, not FINISHED, with what was sent after the refusal."""
    from tasks.tracking.mlflow_tracker import TrackingRefused
    from tasks.tracking.stage_tracking import current_stage_run

    seen = {}

    def stage() -> dict:
        run = seen["run"] = current_stage_run()
        run.tracker.log_params({"base": {"seed": 12345}})  # MLflow refuses to change a logged param
        return {"win_rate_rm": 0.5}

    with pytest.raises(TrackingRefused, match=r"1 params \(.*Changing param values is not allowed"):
        track_stage("evaluate", mlflow_root, load_params(mlflow_root), stage)
    run = get_client(mlflow_root).get_run(seen["run"].run_id)
    assert run.info.status == "FAILED" and run.data.metrics["win_rate_rm"] == 0.5
