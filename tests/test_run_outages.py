"""Nothing lost on the pipeline run and the sweep run either (#41 item 1): their writes go through the same ordered,
retried queue as a stage's. Against MLflow's tracking server app on sqlite (tests/test_server_client.py's
`tracking_server`, stopped and started on its port as a server process that dies and restarts):

- the server goes down as the run ends and comes back: every write arrives, once (metrics counted per key);
- it never comes back: closing the run fails naming the server and each write not sent; the rerun sends them;
- a write whose reply comes after the deadline is confirmed, not reported unsent; one whose reply is lost is sent
  again and lands once.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from test_flow import prefect_api  # noqa: F401 (a fixture)
from test_pipeline import TINY
from test_server_client import fast_client, served_workspace, tracking_server  # noqa: F401 (fixtures)

from flows.pipeline_run import end_pipeline_run, start_pipeline_run
from tasks.execution.transient import transient_cause
from tasks.tracking.mlflow_store import get_client
from tasks.tracking.mlflow_tracker import MlflowTracker, TrackingUnavailable

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"


def _pipeline_outputs(root):
    from rlhf_core.jsonio import write_json

    (root / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    write_json(root / "metrics" / "eval.json", {"win_rate_rm": 0.75, "mean_kl": 1.5})
    write_json(root / "metrics" / "train.json", {"objective/kl": 1.5})


def _each_once(client, run_id: str) -> dict[str, int]:
    """How many values each metric of the run has: 1 each when every write landed once."""
    return {key: len(client.get_metric_history(run_id, key)) for key in client.get_run(run_id).data.metrics}


def _artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, path)}


def test_a_pipeline_run_ending_while_the_server_is_down_loses_nothing(served_workspace, tracking_server,  # noqa: F811
                                                                      monkeypatch):
    root = served_workspace
    _pipeline_outputs(root)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    tracking_server.late[LOG_BATCH] = 1  # the run's params land but their reply is lost: sent again, kept once
    parent = start_pipeline_run(root, None, TINY)
    tracking_server.stop()  # the server dies as the run ends...
    tracking_server.late[LOG_BATCH] = 1  # ...and once back, the first batch it takes has its reply lost
    back = threading.Timer(3.0, tracking_server.start)
    back.start()
    end_pipeline_run(parent, "COMPLETED", root)  # waits until the server has taken everything
    back.join()
    assert tracking_server.late[LOG_BATCH] == 0, "a reply was lost and the write sent again"

    client = get_client(root)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.params["prepare.world.sft_train"] == "128" and run.data.params["sft.epochs"] == "1"
    assert {"dvc.lock", "metrics"} <= _artifacts(client, parent)
    assert _artifacts(client, parent, "metrics") == {"metrics/eval.json", "metrics/train.json"}
    assert _each_once(client, parent) == {"eval/win_rate_rm": 1, "eval/mean_kl": 1}
    outages = json.loads(run.data.tags["rlhf.tracking_outages"])  # the run says what it met, and that it drained
    assert outages and all(o["failed_sends"] >= 1 and o["writes"] >= 1 for o in outages), outages


def test_a_pipeline_run_whose_server_never_comes_back_fails_naming_it_and_the_rerun_sends_it(
        served_workspace, tracking_server, monkeypatch):  # noqa: F811
    root = served_workspace
    _pipeline_outputs(root)
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "3")
    parent = start_pipeline_run(root, None, TINY)
    tracking_server.stop()
    try:
        with pytest.raises(TrackingUnavailable) as lost:
            end_pipeline_run(parent, "COMPLETED", root)
    finally:
        tracking_server.start()
    message = str(lost.value)
    assert f"MLflow at {tracking_server.url} did not take run {parent}'s writes within 3 s" in message
    assert "artifact dvc.lock, artifact metrics/eval.json" in message and "the run's end (FINISHED)" in message
    assert str(transient_cause(lost.value)).startswith("connection refused"), "a retry of the run may fix it"
    client = get_client(root)
    assert client.get_run(parent).info.status == "RUNNING", "not ended FINISHED behind the failure's back"

    rerun = start_pipeline_run(root, None, TINY)  # the rerun (its stages skipped by DVC) sends it all
    end_pipeline_run(rerun, "COMPLETED", root)
    run = client.get_run(rerun)
    assert run.info.status == "FINISHED" and {"dvc.lock", "metrics"} <= _artifacts(client, rerun)
    assert _each_once(client, rerun) == {"eval/win_rate_rm": 1, "eval/mean_kl": 1}


def _report() -> dict:
    fit = {"alpha": 0.4, "beta": 0.3, "r2": 0.9, "peak_kl": 1.4}
    return {"gao_fit": {"ppo": fit}, "gate_pick": "train.kl_coef=0.3", "gate_pick_figures": {"gold_win_rate": 0.8}}


def _sweep_files(root):
    (root / "reports" / "sweep").mkdir(parents=True, exist_ok=True)
    (root / "reports" / "sweep" / "frontier.json").write_text("{}")
    (root / "reports" / "sweep" / "frontier.png").write_bytes(b"\x89PNG")


SWEEP_METRICS = {"frontier/ppo/alpha": 1, "frontier/ppo/beta": 1, "frontier/ppo/r2": 1, "frontier/ppo/peak_kl": 1,
                 "gate_pick/gold_win_rate": 1}


def _assert_sweep_run_whole(client, run_id: str) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"profile": "demo", "overrides": "[]", "grid": '["train.kl_coef=0.1,0.3"]',
                               "points": "2"}
    assert run.data.tags["rlhf.gate_pick"] == "train.kl_coef=0.3"
    assert _artifacts(client, run_id, "frontier") == {"frontier/frontier.json", "frontier/frontier.png"}
    assert _each_once(client, run_id) == SWEEP_METRICS


def test_a_sweep_run_ending_while_the_server_is_down_loses_nothing(served_workspace, tracking_server,  # noqa: F811
                                                                   monkeypatch):
    from flows.sweep import _close_sweep_run, _open_sweep_run

    root = served_workspace
    _sweep_files(root)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    sweep = _open_sweep_run(root, "k1", "demo", [], ["train.kl_coef=0.1,0.3"], 2, None)
    tracking_server.stop()
    tracking_server.late[LOG_BATCH] = 1
    back = threading.Timer(3.0, tracking_server.start)
    back.start()
    _close_sweep_run(sweep, root, "FINISHED", _report())
    back.join()
    assert tracking_server.late[LOG_BATCH] == 0, "a reply was lost and the write sent again"
    _assert_sweep_run_whole(get_client(root), sweep.run_id)


def test_a_sweep_run_whose_server_never_comes_back_fails_naming_it_and_the_rerun_sends_it(
        served_workspace, tracking_server, monkeypatch):  # noqa: F811
    from flows.sweep import _close_sweep_run, _open_sweep_run

    root = served_workspace
    _sweep_files(root)
    sweep = _open_sweep_run(root, "k2", "demo", [], ["train.kl_coef=0.1,0.3"], 2, None)
    sweep.tracker.close()  # its params are on the server (the points ran meanwhile)
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "3")
    tracking_server.stop()
    try:
        with pytest.raises(TrackingUnavailable) as lost:
            _close_sweep_run(sweep, root, "FINISHED", _report())
    finally:
        tracking_server.start()
    message = str(lost.value)
    assert f"did not take run {sweep.run_id}'s writes" in message
    assert ("Not sent: 5 metrics, artifact frontier/frontier.json, artifact frontier/frontier.png, the gate's pick, "
            "the run's end (FINISHED)") in message
    client = get_client(root)
    assert not client.get_run(sweep.run_id).data.metrics

    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "60")
    again = _open_sweep_run(root, "k2", "demo", [], ["train.kl_coef=0.1,0.3"], 2, sweep.run_id)  # the rerun resumes
    assert again.run_id == sweep.run_id
    _close_sweep_run(again, root, "FINISHED", _report())
    _close_sweep_run(_open_sweep_run(root, "k2", "demo", [], ["train.kl_coef=0.1,0.3"], 2, sweep.run_id), root,
                     "FINISHED", _report())  # once more: the figures land once, not twice
    _assert_sweep_run_whole(client, sweep.run_id)


def test_a_write_in_flight_at_the_deadline_is_confirmed_not_reported_unsent(tracking_server, fast_client,  # noqa: F811
                                                                            monkeypatch):
    """The server takes the batch but answers after RLHF_MLFLOW_RETRY_S (inside the HTTP timeout): close() waits
    for that answer instead of reporting the batch unsent (which a rerun would then send a second time)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_server.url)
    run_id = client.create_run(client.create_experiment(f"inflight-{time.monotonic_ns()}")).info.run_id
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    tracking_server.late[LOG_BATCH] = 1  # its answer comes 4 s later, after the 1 s deadline
    tracker = MlflowTracker(client, run_id, background=True, server=tracking_server.url)
    tracker.log_metrics({"objective/kl": 0.5}, 1)
    tracker.close()
    assert tracking_server.late[LOG_BATCH] == 0
    assert tracker.sent[-1] == "1 metrics" and len(client.get_metric_history(run_id, "objective/kl")) == 1


@pytest.mark.slow
def test_the_pipeline_flow_fails_naming_what_mlflow_never_took(tracking_server, fast_client, prefect_api,  # noqa: F811
                                                              tmp_path, monkeypatch):
    """Through the flow: its stage done, MLflow goes down for good before the pipeline run's end is sent; the run
    ends Failed (not Completed) with a message naming the server and the writes not sent, as its record says."""
    import yaml
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from test_flow import git_dvc_repo

    from flows.pipeline import rlhf_pipeline

    stage = "python -c \"import time; open('ok.txt', 'w').write('ok'); time.sleep(3)\""
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"ok": {"cmd": stage, "outs": ["ok.txt"]}}}))
    (tmp_path / "params.yaml").write_text("base:\n  profile: demo\n  seed: 0\n")
    root = git_dvc_repo(tmp_path)
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"flow-{time.monotonic_ns()}")
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "3")

    def stop_once_the_stage_wrote():
        give_up = time.monotonic() + 300
        while not (root / "ok.txt").exists() and time.monotonic() < give_up:
            time.sleep(0.05)
        tracking_server.stop()

    stopper = threading.Thread(target=stop_once_the_stage_wrote, daemon=True)
    stopper.start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
            state = rlhf_pipeline(return_state=True)
    finally:
        stopper.join()
        tracking_server.start()
    assert state.is_failed(), state
    assert f"MLflow at {tracking_server.url} did not take run" in state.message, state.message
    assert "artifact dvc.lock" in state.message and "the run's end (FINISHED)" in state.message, state.message
    [record] = [json.loads(p.read_text()) for p in (root / "reports" / "runs").glob("*.json")]
    assert record["status"] == "FAILED" and "Not sent:" in record["failure"]
    assert [s["stage"] for s in record["stages"]] == ["ok"]
