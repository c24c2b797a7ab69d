"""The pipeline on the shared-server stack, live on loopback (marker `server`; `make test-server` runs it).

Set up exactly as docs/scaling-out.md says (tests/test_infra.py checks these commands are the guide's):
`infra/stack.sh up`, its `env`, `prefect deploy --all` from a fresh git + DVC repo of the pipeline (the TINY world),
a DVC remote on the stack's S3. Then, on the real servers:

1. a run triggered through the Prefect API (with overrides) is killed with its worker mid-training: the server
   marks it Crashed (heartbeats stop); the worker comes back;
2. the next run skips the finished stages and resumes train from its checkpoint; while it trains, the MLflow
   server is down for a minute (stopped, then restarted): the train run's outage record (tag
   rlhf.tracking_outages) shows its sends failing and the backlog sent once it was back, and every train update's
   metrics (steps 1..N, once each, values as in metrics/train_history.json, some logged during the outage) are on
   the server;
3. runs, metrics, artifacts (really in the S3 bucket) and the registered model version are on MLflow;
   unauthenticated requests are refused by both servers;
4. `dvc push`, a fresh clone, `dvc pull`: every output and metric restored byte for byte (metrics/register.json,
   git-ignored, from the remote); `dvc status` in the clone is clean;
5. no secret of the stack appears in params, MLflow params/tags/artifacts, Prefect parameters/logs or any log;
6. Postgres stops under the MLflow server while a stage logs, and starts again: nothing lost, the run FINISHED;
   kept down: the stage fails naming the database, the server holds no part of a write, the rerun sends it all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STACK = REPO / "infra" / "stack.sh"
# the TINY world (tests/test_pipeline.py) in params.yaml, with a train stage long enough to interrupt
TINY = [
    "prepare.world.sft_train=128", "prepare.world.sft_eval=16", "prepare.world.prefs_train=128",
    "prepare.world.prefs_eval=32", "prepare.world.prompts_train=64", "prepare.world.prompts_eval=8",
    "prepare.tokenizer_vocab_size=512", "sft.epochs=1", "reward_model.epochs=1",
    "sft.tiny.hidden_size=32", "sft.tiny.num_layers=1", "sft.tiny.intermediate_size=64", "sft.eval_max_new_tokens=8",
    "train.response_length=8", "train.checkpoint_every=1", "evaluate.num_prompts=8", "evaluate.response_length=8",
]
UPDATES = 60  # 1.7-2.6 s each here: the resumed run trains for 1.5-2.5 min, through a minute's outage
OVERRIDES = [f"train.total_episodes={UPDATES * 64}", "train.kl_coef=0.07"]  # what the runs are triggered with
ZOMBIE_AFTER_S = 60
OUTAGE_S = 60  # the MLflow server is down this long (plus its restart) while train runs
# The stage processes' MLflow client (inherited from the worker): its own HTTP retries bounded to seconds, so the
# outage reaches the tracker's buffer (by default MLflow retries a dead server for ~4 minutes inside each call);
# the tracker waits at the stage's end for longer than the outage, and no longer than that.
OUTAGE_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "RLHF_MLFLOW_RETRY_S": "300"}
WAIT_S = 900


def sh(*cmd, cwd=None, env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def free_ports(n: int) -> list[int]:
    """`n` different free ports: every socket stays bound until all are picked (ports picked one at a time can
    come back twice, and the stack then started MLflow on moto's port)."""
    import socket
    from contextlib import ExitStack

    with ExitStack() as sockets:
        bound = [sockets.enter_context(socket.socket()) for _ in range(n)]
        for sock in bound:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in bound]


def parse_exports(text: str) -> dict[str, str]:
    """`export NAME=value` lines (what `eval "$(infra/stack.sh env)"` sets), quotes removed."""
    found = dict(re.findall(r"^export (\w+)=(.*)$", text, re.M))
    return {k: v.strip().strip("'\"") for k, v in found.items()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """infra/stack.sh up on free ports with its own state folder; down at the end (no process left). The Ray nodes
    keep their default loopback addresses (127.0.0.2, 127.0.0.3): a cluster is told apart by its ports."""
    import tempfile

    # outside pytest's tmp folders (mode 700): as root, Postgres runs as `postgres` and must reach its data dir
    state = Path(tempfile.mkdtemp(prefix="rlhf-stack-"))
    os.chmod(state, 0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RLHF_", "AWS_", "RAY_"))}
    names = ("RLHF_PG_PORT", "RLHF_S3_PORT", "RLHF_PREFECT_PORT", "RLHF_MLFLOW_PORT", "RLHF_RAY_PORT",
             "RLHF_RAY_CLIENT_PORT", "RLHF_RAY_DASHBOARD_PORT")
    ports = dict(zip(names, map(str, free_ports(len(names))), strict=True))
    env = {**base, "RLHF_STACK_DIR": str(state), **ports,
           "RLHF_ZOMBIE_AFTER_S": str(ZOMBIE_AFTER_S), **OUTAGE_ENV}
    try:
        up = sh(STACK, "up", env=env, timeout=900)
        again = sh(STACK, "up", env=env, timeout=300)  # idempotent: everything is already running
        assert again.stdout.count("already running") == 7, again.stdout
        client = parse_exports(sh(STACK, "env", env=env).stdout)
        yield {"env": env, "client": {**base, **client, "DVC_NO_ANALYTICS": "1", "PATH": f"{BIN}:{base['PATH']}"},
               "state": state, "up": up.stdout}
    finally:
        pids = [int(p.read_text()) for p in (state / "run").glob("*.pid")] if (state / "run").exists() else []
        sh(STACK, "down", env=env, timeout=300, check=False)
        sh(STACK, "down", env=env, timeout=300)  # idempotent
        time.sleep(1)
        import psutil

        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes left after down: {left}"
        # nor any process of their sessions (the Ray nodes' workers have process groups of their own)
        left = [p.pid for p in psutil.process_iter(["status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
                and _session(p.pid) in pids]
        assert not left, f"processes of the stack's sessions left after down: {left}"
        status = sh(STACK, "status", env=env).stdout
        shutil.rmtree(state, ignore_errors=True)
        assert "running" not in status, status


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone meanwhile
        return None


def make_repo(path: Path, tiny: list[str], extra: tuple[str, ...] = ()) -> Path:
    """The pipeline in a fresh git + DVC repo (as a clone would be), the `tiny` overrides in params.yaml; `extra`:
    more files of the repo to commit with it."""
    from tasks.parameters.params import deep_merge, parse_override

    path.mkdir(parents=True, exist_ok=True)
    for item in ("dvc.yaml", ".gitignore", "prefect.yaml", "pyproject.toml", *extra):
        (path / item).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / item, path / item)
    for package in ("rlhf_core", "tasks", "flows", "cli", "infra/accelerate", "infra/work-pools"):
        shutil.copytree(REPO / package, path / package, ignore=shutil.ignore_patterns("__pycache__", ".state"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for item in tiny:
        params = deep_merge(params, parse_override(item))
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@example.com"], ["git", "config", "user.name", "t"],
                [BIN / "dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        sh(*cmd, cwd=path)
    return path


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("repo"), TINY, ("infra/prefect-gpu.yaml",))


def _flow_run(client_env: dict, flow_run_id):
    from prefect import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: client_env["PREFECT_API_URL"],
                             PREFECT_API_AUTH_STRING: client_env["PREFECT_API_AUTH_STRING"]}):
        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id)


def _prefect(client_env: dict):
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: client_env["PREFECT_API_URL"],
                               PREFECT_API_AUTH_STRING: client_env["PREFECT_API_AUTH_STRING"]})


def _trigger(client_env: dict, overrides: list[str]):
    from prefect.deployments import run_deployment

    with _prefect(client_env):
        return run_deployment("rlhf-pipeline/manual", parameters={"overrides": overrides}, timeout=0)


def _wait_state(client_env: dict, flow_run_id, done, what: str, timeout_s: float = WAIT_S, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while True:
        run = _flow_run(client_env, flow_run_id)
        if done(run.state):
            return run
        tail = log.read_text()[-3000:] if log and log.exists() else ""
        assert time.monotonic() < deadline, f"flow run {flow_run_id} not {what} after {timeout_s} s: {run.state}\n{tail}"
        time.sleep(2)


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once: a machine that dies."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def test_the_prefect_ui_of_the_stack_calls_its_api(stack):
    """The UI at the address `stack.sh up` prints asks its own server for data: `prefect server start --port`
    alone leaves the UI calling Prefect's default, http://127.0.0.1:4200/api ("Can't connect to Server API")."""
    api = stack["client"]["PREFECT_API_URL"]
    ui = api.removesuffix("/api")
    assert f"prefect on {ui} " in stack["up"], stack["up"]
    assert httpx.get(f"{ui}/ui-settings", timeout=30).json()["api_url"] == api


def test_pipeline_on_the_server_stack(stack, repo, monkeypatch):
    env, client_env, state = stack["env"], stack["client"], stack["state"]
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # for the MLflow client of this test
        monkeypatch.setenv(name, client_env[name])
    logs = state / "logs"
    from mlflow import MlflowClient

    # docs/scaling-out.md, step 2: deploy from the checkout (the directory becomes the runs' working directory)
    sh(BIN / "prefect", "--no-prompt", "deploy", "--all", cwd=repo, env=client_env, timeout=300)
    # step 3: the GPU pools and deployments register against the live server (no GPU worker runs here)
    for pool, kind, template in (("rlhf-gpu", "process", "process.json"), ("rlhf-gpu-docker", "docker", "docker-gpu.json"),
                                 ("rlhf-gpu-k8s", "kubernetes", "kubernetes-gpu.json")):
        sh(BIN / "prefect", "--no-prompt", "work-pool", "create", pool, "--type", kind, "--base-job-template",
           f"infra/work-pools/{template}", "--overwrite", cwd=repo, env=client_env)
    sh(BIN / "prefect", "--no-prompt", "deploy", "--prefect-file", "infra/prefect-gpu.yaml", "--all", cwd=repo,
       env=client_env, timeout=300)
    from prefect import get_client

    with _prefect(client_env), get_client(sync_client=True) as prefect:
        gpu = {d: prefect.read_deployment_by_name(f"rlhf-pipeline/{d}") for d in ("gpu-process", "gpu-docker", "gpu-k8s")}
        pools = {p.name: p for p in prefect.read_work_pools()}
    assert gpu["gpu-docker"].job_variables["gpu_count"] == -1 and gpu["gpu-k8s"].job_variables["gpu_count"] == 8
    assert "runtime.accelerate_config=infra/accelerate/deepspeed_zero3.yaml" in gpu["gpu-k8s"].parameters["overrides"]
    k8s_container = pools["rlhf-gpu-k8s"].base_job_template["job_configuration"]["job_manifest"]["spec"]["template"][
        "spec"]["containers"][0]
    assert k8s_container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert pools["rlhf-gpu-docker"].base_job_template["job_configuration"]["container_create_kwargs"][
        "device_requests"][0]["capabilities"] == [["gpu"]]

    # 1. a run killed with its worker mid-training ends Crashed (its heartbeats stop)
    first = _trigger(client_env, OVERRIDES)
    deadline = time.monotonic() + WAIT_S
    checkpoints = repo / "checkpoints" / "train"
    while not (checkpoints.exists() and len([p for p in checkpoints.rglob("*") if p.is_dir()]) >= 2):
        run = _flow_run(client_env, first.id)
        assert not run.state.is_final(), f"{run.state}\n{(logs / 'worker.log').read_text()[-4000:]}"
        assert time.monotonic() < deadline, (logs / "worker.log").read_text()[-4000:]
        time.sleep(0.5)
    _kill_tree(int((state / "run" / "worker.pid").read_text()))
    killed_at = time.monotonic()
    sh(STACK, "start", "worker", env=stack["env"])
    crashed = _wait_state(client_env, first.id, lambda s: s.is_final(), "final", timeout_s=ZOMBIE_AFTER_S + 180)
    assert crashed.state.is_crashed(), crashed.state
    print(f"killed run marked {crashed.state.name} {time.monotonic() - killed_at:.0f} s after the kill")

    # 2. the next run resumes; the MLflow server is down for a minute while it trains
    mlflow = MlflowClient(client_env["MLFLOW_TRACKING_URI"])
    started_ms = int(time.time() * 1000)
    second = _trigger(client_env, OVERRIDES)
    deadline = time.monotonic() + WAIT_S
    while True:  # until train's run has its params and a first batch of metrics on the server: training is under way
        training = mlflow.search_runs(mlflow.get_experiment_by_name("rlhf-pipeline").experiment_id,
                                      f"tags.`rlhf.stage` = 'train' and attributes.start_time >= {started_ms}")
        if training and mlflow.get_metric_history(training[0].info.run_id, "objective/scores"):
            break
        run = _flow_run(client_env, second.id)
        assert not run.state.is_final(), f"{run.state}\n{(logs / 'worker.log').read_text()[-4000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.5)
    train_id = training[0].info.run_id
    sh(STACK, "stop", "mlflow", env=env)
    down_ms = int(time.time() * 1000)
    time.sleep(OUTAGE_S)
    assert not _flow_run(client_env, second.id).state.is_final()
    sh(STACK, "start", "mlflow", env=env, timeout=600)
    up_ms = int(time.time() * 1000)
    print(f"MLflow down {(up_ms - down_ms) / 1000:.0f} s while train ran")
    done = _wait_state(client_env, second.id, lambda s: s.is_final(), "final", log=logs / "worker.log")
    assert done.state.is_completed(), f"{done.state}\n{(logs / 'worker.log').read_text()[-6000:]}"

    record = json.loads(max((repo / "reports" / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    assert record["status"] == "FINISHED" and record["overrides"] == OVERRIDES
    ran = {s["stage"]: s["ran"] for s in record["stages"]}
    assert not any(ran[s] for s in ("prepare", "validate", "sft", "reward-model", "inspect")), ran  # skipped
    assert ran["train"] and ran["evaluate"]
    execution = json.loads((repo / "reports" / "execution" / "train.json").read_text())
    resumed = execution["resumed_from_update"]
    assert resumed and resumed >= 1, execution  # resumed from the killed run's checkpoint
    history = json.loads((repo / "metrics" / "train_history.json").read_text())
    assert [row["update"] for row in history] == list(range(1, UPDATES + 1))
    # the outage reached the tracker's queue (not hidden by MLflow's own HTTP retries): the train run's record of
    # it says sends failed and a backlog of metrics was sent once the server was back; none lost or twice (below)
    outages = json.loads(mlflow.get_run(train_id).data.tags.get("rlhf.tracking_outages", "[]"))
    print(f"train run's outage record: {outages}")
    assert outages and outages[0]["failed_sends"] >= 1 and outages[0]["metrics"] >= 1, outages

    # 3. MLflow on the server: runs, every train metric despite the outage, artifacts in the bucket, the model
    parent = mlflow.get_run(record["mlflow_run_id"])
    assert parent.data.params["overrides"] == json.dumps(OVERRIDES) and parent.data.params["train.kl_coef"] == "0.07"
    stages = {r.data.tags["rlhf.stage"]: r for r in mlflow.search_runs(
        parent.info.experiment_id, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert {"train", "evaluate", "register"} <= set(stages), sorted(stages)
    train = stages["train"]
    assert train.info.run_id == train_id and train.info.status == "FINISHED"
    # the resumed run carries the killed run's logged updates over (train_log.jsonl), then logs its own, some
    # while the server was down: every update's metrics 1..N are there, none lost, with the values of the history
    keys = sorted(k for k, v in history[0].items() if isinstance(v, int | float) and k in train.data.metrics
                  and k not in ("step", "update"))
    assert {"objective/kl", "objective/scores", "objective/rlhf_reward", "loss/policy_avg"} <= set(keys), keys
    for key in keys:
        logged = mlflow.get_metric_history(train_id, key)
        assert sorted(m.step for m in logged) == list(range(1, UPDATES + 1)), (key, sorted(m.step for m in logged))
        assert {m.step: m.value for m in logged} == pytest.approx({row["update"]: float(row[key]) for row in history},
                                                                  nan_ok=True), key
    stamps = [m.timestamp for m in mlflow.get_metric_history(train_id, "objective/scores")]
    during = sum(down_ms < t < up_ms for t in stamps)
    print(f"train updates logged before / during / after the outage: {sum(t <= down_ms for t in stamps)} / {during} / "
          f"{sum(t >= up_ms for t in stamps)}")
    assert during >= 1, "no update was logged while the server was down"
    artifacts = {a.path for a in mlflow.list_artifacts(stages["evaluate"].info.run_id, "reports/eval")}
    assert "reports/eval/completions.jsonl" in artifacts, artifacts
    import boto3

    s3 = boto3.client("s3", endpoint_url=client_env["RLHF_S3_ENDPOINT"], region_name="us-east-1",
                      aws_access_key_id=client_env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=client_env["AWS_SECRET_ACCESS_KEY"])
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="rlhf-mlflow")
            for o in page.get("Contents", [])]
    assert any(k.endswith(f"{stages['evaluate'].info.run_id}/artifacts/reports/eval/completions.jsonl") for k in keys)
    [version] = mlflow.search_model_versions("name = 'rlhf-policy'")
    assert version.run_id and any("model.safetensors" in k or "MLmodel" in k for k in keys), keys[:20]
    assert version.tags.get("rlhf.overrides") == json.dumps(OVERRIDES)
    model_files = [k for k in keys if "MLmodel" in k]
    assert model_files, "the registered model's files are in the bucket"

    # unauthenticated requests are refused (with credentials they pass)
    assert httpx.get(f"{client_env['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/experiments/search",
                     params={"max_results": 1}).status_code == 401
    assert httpx.post(f"{client_env['PREFECT_API_URL']}/flow_runs/filter", json={}).status_code == 401
    user, password = client_env["PREFECT_API_AUTH_STRING"].split(":", 1)
    assert httpx.post(f"{client_env['PREFECT_API_URL']}/flow_runs/filter", json={}, auth=(user, password)).status_code == 200

    # 4. DVC: the guide's commands, then a fresh clone pulls every output back
    from tasks.parameters.params import deep_merge, parse_override

    params = yaml.safe_load((repo / "params.yaml").read_text())
    for item in OVERRIDES:  # adopt the run's parameters, so the commit says what dvc.lock ran
        params = deep_merge(params, parse_override(item))
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc = BIN / "dvc"
    sh(dvc, "remote", "add", "-d", "shared", client_env["RLHF_DVC_REMOTE"], cwd=repo, env=client_env)
    sh(dvc, "remote", "modify", "shared", "endpointurl", client_env["RLHF_S3_ENDPOINT"], cwd=repo, env=client_env)
    sh("git", "add", "params.yaml", "dvc.lock", "metrics", ".dvc/config", cwd=repo)
    sh("git", "commit", "-qm", "a run on the shared servers", cwd=repo)
    sh(dvc, "push", cwd=repo, env=client_env, timeout=600)
    clone = repo.parent / "clone"
    sh("git", "clone", "-q", repo, clone)
    assert not (clone / "metrics" / "register.json").exists()  # git-ignored: only DVC's remote carries it
    sh(dvc, "pull", cwd=clone, env=client_env, timeout=600)
    # every output and metric of every stage (cached ones from the remote, `cache: false` ones from git)
    outs = sorted({next(iter(entry)) if isinstance(entry, dict) else entry
                   for stage in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].values()
                   for entry in stage.get("outs", []) + stage.get("metrics", [])})
    assert {"data", "models/policy", "models/sft", "models/reward", "metrics/register.json"} <= set(outs), outs
    for out in outs:
        original, pulled = repo / out, clone / out
        files = sorted(p.relative_to(original) for p in original.rglob("*") if p.is_file()) if original.is_dir() else [Path()]
        assert files, out
        for rel in files:
            assert (pulled / rel).read_bytes() == (original / rel).read_bytes(), f"{out}/{rel}"
    # dvc status in the clone: clean (nothing missing, nothing changed, every stage up to date)
    assert json.loads(sh(dvc, "status", "--json", cwd=clone, env=client_env).stdout) == {}
    assert "Data and pipelines are up to date" in sh(dvc, "status", cwd=clone, env=client_env).stdout

    # 5. no secret anywhere
    secrets = dict(line.split("=", 1) for line in (state / "secrets.env").read_text().split())
    values = [secrets[k] for k in ("RLHF_PG_PASSWORD", "RLHF_MLFLOW_ADMIN_PASSWORD", "RLHF_MLFLOW_PASSWORD",
                                   "RLHF_S3_SECRET", "RLHF_FLASK_SECRET")] + [secrets["RLHF_PREFECT_AUTH"].split(":", 1)[1]]
    assert all(len(v) >= 20 for v in values)
    texts: dict[str, str] = {}
    for path in [*logs.glob("*.log"), *repo.glob("params.yaml"), *(repo / "reports").rglob("*"), repo / "dvc.lock",
                 *(repo / "metrics").glob("*.json")]:
        if path.is_file():
            texts[str(path)] = path.read_text(errors="replace")
    for run in mlflow.search_runs(parent.info.experiment_id, ""):
        texts[f"mlflow run {run.info.run_id}"] = json.dumps([run.data.params, run.data.tags])
        folder = Path(mlflow.download_artifacts(run.info.run_id, "", dst_path=str(state / "artifacts" / run.info.run_id)))
        for path in folder.rglob("*"):
            if path.is_file():
                texts[str(path)] = path.read_text(errors="replace")
    texts["model version"] = json.dumps(version.tags)
    with _prefect(client_env), get_client(sync_client=True) as prefect:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        for flow_run_id in (first.id, second.id):
            texts[f"prefect parameters {flow_run_id}"] = json.dumps(prefect.read_flow_run(flow_run_id).parameters)
            texts[f"prefect logs {flow_run_id}"] = "\n".join(
                log.message for log in prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))))
    assert len(texts) > 50 and any("prefect logs" in k and texts[k] for k in texts)
    leaks = [(where, value[:4] + "...") for where, text in texts.items() for value in values if value in text]
    assert not leaks, leaks


# ------------------------------------------------------------------------------------ Postgres down under MLflow
PG_UPDATES = 40  # a stage's per-update metrics, sent every 10 updates (FLUSH_EVERY)


def _stage_on_the_stack(stack, workspace, monkeypatch, retry_s: int):
    """The workspace tracking into the stack's MLflow server; MLflow's own HTTP retries off, so an outage reaches
    the tracker's queue (what the stage processes of a worker do, with their retries bounded: OUTAGE_ENV)."""
    for name, value in stack["client"].items():
        if name.startswith(("MLFLOW_", "AWS_")):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"postgres-{time.monotonic_ns()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", str(retry_s))


def _updates(first: int, last: int) -> None:
    from tasks.tracking.stage_tracking import stage_tracker

    for step in range(first, last + 1):
        stage_tracker().log_metrics({"objective/kl": step / 100, "objective/scores": step / 10}, step)


def _outage_reached_the_queue() -> None:
    """Until the stage's queue has met the outage (a send failed): structural, not a log line or a clock."""
    from tasks.tracking.stage_tracking import current_stage_run

    sender, give_up = current_stage_run().tracker._sender, time.monotonic() + 300
    while sender._down_since is None:
        assert time.monotonic() < give_up, "no send failed while Postgres was down"
        time.sleep(0.2)


def _all_sent() -> None:
    """Until the stage's queue is empty (what it logged is on the server)."""
    from tasks.tracking.stage_tracking import current_stage_run

    sender, give_up = current_stage_run().tracker._sender, time.monotonic() + 300
    while sender._queue or sender._busy:
        assert time.monotonic() < give_up, "the queue did not drain with the server up"
        time.sleep(0.1)


def _evaluate_outputs(root: Path) -> None:
    from rlhf_core.jsonio import write_json, write_jsonl

    write_jsonl(root / "reports" / "eval" / "completions.jsonl", [{"prompt": "p", "completion": "c"}])
    write_json(root / "metrics" / "eval.json", {"win_rate_rm": 0.75})


def test_postgres_down_under_mlflow_while_a_stage_runs(stack, workspace, monkeypatch):
    """Postgres stops under the MLflow server while a stage logs its updates, and starts again: the server answers
    with errors meanwhile, the stage's queue retries them, and every write arrives once; the run ends FINISHED.
    Kept down past RLHF_MLFLOW_RETRY_S: the stage fails naming the database, and the server holds no half of a
    write (each metric batch whole or absent, the run not FINISHED); once it is back the rerun sends everything."""
    from mlflow import MlflowClient

    from tasks.parameters.params import load_params
    from tasks.tracking.mlflow_tracker import TrackingUnavailable
    from tasks.tracking.stage_tracking import current_stage_run, track_stage

    root, env = workspace, stack["env"]
    _stage_on_the_stack(stack, root, monkeypatch, retry_s=600)
    seen = {}

    def stage_through_an_outage() -> dict:
        seen["run"] = current_stage_run().run_id
        _updates(1, 10)
        sh(STACK, "stop", "postgres", env=env)
        try:
            _updates(11, 30)  # training goes on: log_metrics never waits on the server
            _outage_reached_the_queue()
        finally:
            sh(STACK, "start", "postgres", env=env)
        _updates(31, PG_UPDATES)
        _evaluate_outputs(root)
        return {"win_rate_rm": 0.75}

    assert track_stage("evaluate", root, load_params(root), stage_through_an_outage) == {"win_rate_rm": 0.75}
    mlflow = MlflowClient()
    run = mlflow.get_run(seen["run"])
    assert run.info.status == "FINISHED" and run.data.params["base.profile"] == "demo"
    for key in ("objective/kl", "objective/scores"):  # every update once: none lost, none twice
        assert sorted(m.step for m in mlflow.get_metric_history(seen["run"], key)) == list(range(1, PG_UPDATES + 1))
    assert run.data.metrics["win_rate_rm"] == 0.75
    assert {a.path for a in mlflow.list_artifacts(seen["run"], "metrics")} == {"metrics/eval.json"}
    outages = json.loads(run.data.tags["rlhf.tracking_outages"])  # met in the queue, drained once it was back
    assert outages[0]["failed_sends"] >= 1 and outages[0]["metrics"] >= 20, outages

    # kept down past the retry window
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "20")

    def stage_whose_database_stays_down() -> dict:
        seen["failed"] = current_stage_run().run_id
        _updates(1, 20)
        _all_sent()  # these are on the server before Postgres stops
        sh(STACK, "stop", "postgres", env=env)
        _updates(21, PG_UPDATES)
        _evaluate_outputs(root)
        return {"win_rate_rm": 0.75}

    try:
        with pytest.raises(TrackingUnavailable) as lost:
            track_stage("evaluate", root, load_params(root), stage_whose_database_stays_down)
    finally:
        sh(STACK, "start", "postgres", env=env)
    message = str(lost.value)
    print(f"Postgres kept down: {message}")
    assert "the server says: its database does not answer (TEMPORARILY_UNAVAILABLE: " in message, message
    assert "OperationalError" in message and "Not sent: 41 metrics" in message, message
    assert "artifact metrics/eval.json" in message and "the run's end (FINISHED)" in message, message
    failed = mlflow.get_run(seen["failed"])
    assert failed.info.status == "RUNNING", "not ended behind the failure's back"
    for key in ("objective/kl", "objective/scores"):  # what the server took is whole: the batches sent, no part
        assert sorted(m.step for m in mlflow.get_metric_history(seen["failed"], key)) == list(range(1, 21))
    assert not mlflow.list_artifacts(seen["failed"], "metrics")

    def rerun() -> dict:
        seen["rerun"] = current_stage_run().run_id
        _updates(1, PG_UPDATES)
        _evaluate_outputs(root)
        return {"win_rate_rm": 0.75}

    track_stage("evaluate", root, load_params(root), rerun)
    again = mlflow.get_run(seen["rerun"])
    assert again.info.status == "FINISHED" and again.data.metrics["win_rate_rm"] == 0.75
    assert len(mlflow.get_metric_history(seen["rerun"], "objective/kl")) == PG_UPDATES
    assert {a.path for a in mlflow.list_artifacts(seen["rerun"], "metrics")} == {"metrics/eval.json"}
