"""The pipeline on the shared-server stack, live on loopback (marker `server`; `make test-server` runs it).

Set up exactly as README's "Scaling out" says (tests/test_infra.py checks these commands are the guide's):
`infra/stack.sh up`, its `env`, `prefect deploy --all` from a fresh git + DVC repo of the pipeline (the TINY world),
a DVC remote on the stack's S3. Then, on the real servers:

1. a run triggered through the Prefect API (with overrides) is killed with its worker mid-training: the server
   marks it Crashed (heartbeats stop); the worker comes back;
2. the next run skips the finished stages and resumes train from its checkpoint, while the MLflow server is
   stopped and restarted under it; it completes with every train metric on the server;
3. runs, metrics, artifacts (really in the S3 bucket) and the registered model version are on MLflow;
   unauthenticated requests are refused by both servers;
4. `dvc push`, a fresh clone, `dvc pull`: every output restored byte for byte; `dvc status` clean but for the two
   outputs dvc.yaml keeps out of git and the cache (train's checkpoints, metrics/register.json);
5. no secret of the stack appears in params, MLflow params/tags/artifacts, Prefect parameters/logs or any log.
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
OVERRIDES = ["train.total_episodes=1920", "train.kl_coef=0.07"]  # 30 updates; what the runs are triggered with
ZOMBIE_AFTER_S = 60
WAIT_S = 900


def sh(*cmd, cwd=None, env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_exports(text: str) -> dict[str, str]:
    """`export NAME=value` lines (what `eval "$(infra/stack.sh env)"` sets), quotes removed."""
    found = dict(re.findall(r"^export (\w+)=(.*)$", text, re.M))
    return {k: v.strip().strip("'\"") for k, v in found.items()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """infra/stack.sh up on free ports with its own state folder; down at the end (no process left)."""
    import tempfile

    # outside pytest's tmp folders (mode 700): as root, Postgres runs as `postgres` and must reach its data dir
    state = Path(tempfile.mkdtemp(prefix="rlhf-stack-"))
    os.chmod(state, 0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RLHF_", "AWS_"))}
    env = {**base, "RLHF_STACK_DIR": str(state), "RLHF_PG_PORT": str(free_port()), "RLHF_S3_PORT": str(free_port()),
           "RLHF_PREFECT_PORT": str(free_port()), "RLHF_MLFLOW_PORT": str(free_port()),
           "RLHF_ZOMBIE_AFTER_S": str(ZOMBIE_AFTER_S)}
    try:
        up = sh(STACK, "up", env=env, timeout=900)
        again = sh(STACK, "up", env=env, timeout=300)  # idempotent: everything is already running
        assert again.stdout.count("already running") == 5, again.stdout
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
        status = sh(STACK, "status", env=env).stdout
        shutil.rmtree(state, ignore_errors=True)
        assert "running" not in status, status


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The pipeline in a fresh git + DVC repo (as a clone would be), TINY world in params.yaml."""
    from tasks.common.params import deep_merge, parse_override

    path = tmp_path_factory.mktemp("repo")
    for item in ("dvc.yaml", ".gitignore", "prefect.yaml", "pyproject.toml"):
        shutil.copy(REPO / item, path / item)
    for package in ("rlhf_core", "tasks", "flows", "cli", "infra/accelerate", "infra/work-pools"):
        shutil.copytree(REPO / package, path / package, ignore=shutil.ignore_patterns("__pycache__", ".state"))
    shutil.copy(REPO / "infra" / "prefect-gpu.yaml", path / "infra" / "prefect-gpu.yaml")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for item in TINY:
        params = deep_merge(params, parse_override(item))
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@example.com"], ["git", "config", "user.name", "t"],
                [BIN / "dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        sh(*cmd, cwd=path)
    return path


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


def test_pipeline_on_the_server_stack(stack, repo, monkeypatch):
    env, client_env, state = stack["env"], stack["client"], stack["state"]
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # for the MLflow client of this test
        monkeypatch.setenv(name, client_env[name])
    logs = state / "logs"
    from mlflow import MlflowClient

    # README "Scaling out", step 2: deploy from the checkout (the directory becomes the runs' working directory)
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

    # 2. the next run resumes; the MLflow server is stopped and restarted while it trains
    mlflow = MlflowClient(client_env["MLFLOW_TRACKING_URI"])
    started_ms = int(time.time() * 1000)
    second = _trigger(client_env, OVERRIDES)
    deadline = time.monotonic() + WAIT_S
    while True:
        training = mlflow.search_runs(mlflow.get_experiment_by_name("rlhf-pipeline").experiment_id,
                                      f"tags.`rlhf.stage` = 'train' and attributes.start_time >= {started_ms}")
        if training:
            break
        run = _flow_run(client_env, second.id)
        assert not run.state.is_final(), f"{run.state}\n{(logs / 'worker.log').read_text()[-4000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.5)
    sh(STACK, "stop", "mlflow", env=env)
    time.sleep(20)  # down while train logs its updates
    sh(STACK, "start", "mlflow", env=env, timeout=600)
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
    assert len(history) == 30

    # 3. MLflow on the server: runs, every train metric despite the outage, artifacts in the bucket, the model
    parent = mlflow.get_run(record["mlflow_run_id"])
    assert parent.data.params["overrides"] == json.dumps(OVERRIDES) and parent.data.params["train.kl_coef"] == "0.07"
    stages = {r.data.tags["rlhf.stage"]: r for r in mlflow.search_runs(
        parent.info.experiment_id, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert {"train", "evaluate", "register"} <= set(stages), sorted(stages)
    train = stages["train"]
    assert train.info.status == "FINISHED"
    for key in ("objective/kl", "objective/scores"):
        steps = sorted(m.step for m in mlflow.get_metric_history(train.info.run_id, key))
        # the resumed run carries the killed run's logged updates over (train_log.jsonl), then logs its own,
        # some while the server was down: every update 1..30 is there, none lost
        assert steps == list(range(1, 31)), (key, steps)
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

    # 4. DVC: README's commands, then a fresh clone pulls every output back
    from tasks.common.params import deep_merge, parse_override

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
    sh(dvc, "pull", cwd=clone, env=client_env, timeout=600)
    outs = [o for s in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].values()
            for o in s.get("outs", []) if isinstance(o, str)]
    assert {"data", "models/policy", "models/sft", "models/reward"} <= set(outs), outs
    for out in outs:
        original, pulled = repo / out, clone / out
        files = sorted(p.relative_to(original) for p in original.rglob("*") if p.is_file()) if original.is_dir() else [Path()]
        assert files, out
        for rel in files:
            assert (pulled / rel).read_bytes() == (original / rel).read_bytes(), f"{out}/{rel}"
    # dvc status: everything up to date but the outputs dvc.yaml keeps out of both git and the DVC cache
    # (`cache: false` + `persist`: train's checkpoints, machine-local resume state, and metrics/register.json,
    # this machine's registry verdict; dvc.yaml says why). No remote can carry them, so a clone lacks exactly those.
    stages_yaml = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    ignored = set(sh("git", "ls-files", "--others", "--ignored", "--exclude-standard", "--directory", cwd=repo).stdout.split())

    def git_ignored(path: str) -> bool:
        return any(path == i.rstrip("/") or path.startswith(i) for i in ignored if i.endswith("/") or i == path)

    local_only = {name: sorted(path for entry in stage.get("outs", []) + stage.get("metrics", []) if isinstance(entry, dict)
                               for path, opts in entry.items() if opts.get("cache") is False and git_ignored(path))
                  for name, stage in stages_yaml.items()}
    local_only = {k: v for k, v in local_only.items() if v}
    assert local_only == {"train": ["checkpoints/train"], "register": ["metrics/register.json"]}, local_only
    status = json.loads(sh(dvc, "status", "--json", cwd=clone, env=client_env).stdout)
    assert status == {name: [{"changed outs": {path: "deleted" for path in paths}}] for name, paths in local_only.items()}, status

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
