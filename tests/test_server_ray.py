"""The stack's Ray cluster, live on loopback (marker `server`; `make test-server` runs it).

`infra/stack.sh up` (the `stack` fixture of tests/test_server.py) starts a head and a worker node of 1 CPU each on
127.0.0.2 and 127.0.0.3, with token authentication (RAY_AUTH_MODE=token, the token in a file of mode 600 under
the stack's state folder). Here:

1. whoever lacks the token is refused at every door: a driver joining the GCS with no token or a wrong one, a
   Ray Client (ray://), the dashboard's Jobs API (401 without a token, 403 with a wrong one, and a job posted
   without one is not created); with the token, a driver joins and sees both nodes;
2. the pipeline, deployed with `prefect deploy --all` from a fresh git + DVC repo and run from its deployment on
   the stack's worker with `--profile cpu-ray`, runs every model stage as a 2-rank Ray Train worker group, one rank
   on each node, its files through the stack's S3 (s3://rlhf-ray/runs): every stage's metrics say num_processes 2,
   the registry holds the new model version, and the shared storage is left empty;
3. no process's command line holds a secret of the stack, and the Ray token appears in no log (the stack's,
   Ray's own, Prefect's), MLflow param or tag, or report.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import (  # noqa: F401  (stack: the module-scoped fixture, infra/stack.sh up ... down)
    BIN,
    _flow_run,
    _prefect,
    make_repo,
    sh,
    stack,
)

pytestmark = pytest.mark.server

MODEL_STAGES = ("sft", "reward-model", "inspect", "train", "evaluate")
PIPELINE_S = 2400  # the whole pipeline, five model stages on Ray: 6 to 11 min measured on 2 busy cores

# A driver joining the cluster: prints RESULT and the live nodes' addresses, or RESULT and why it could not join.
# Run as its own process: Ray's token loader is per process and reads the environment once.
JOIN = """
import json, os
import ray

address = os.environ["PROBE_ADDRESS"]
try:
    if address.startswith("ray://"):
        ray.init(address, logging_level="ERROR")
    else:
        ray.init(address=address, _node_ip_address=os.environ["PROBE_NODE_IP"], logging_level="ERROR",
                 log_to_driver=False)
    nodes = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    print("RESULT " + json.dumps({"joined": True, "nodes": nodes}), flush=True)
except Exception as err:
    print("RESULT " + json.dumps({"joined": False, "error": f"{type(err).__name__}: {err}"}), flush=True)
"""

# Where the ranks of the cluster's Ray Train worker groups ran, from the state API (through the dashboard, with
# the token): the address of the node of every RayTrainWorker actor, dead or alive.
RANKS = """
import json, os
from ray.util.state import list_actors, list_nodes

url = os.environ["PROBE_DASHBOARD"]
nodes = {n.node_id: n.node_ip for n in list_nodes(address=url, detail=True)}
workers = list_actors(address=url, filters=[("class_name", "=", "RayTrainWorker")], detail=True, limit=10000,
                      raise_on_missing_output=False)
print("RESULT " + json.dumps(sorted(nodes.get(a.node_id, "?") for a in workers)), flush=True)
"""


def _python(code: str, env: dict, timeout: float = 180) -> tuple[dict | list, str]:
    """Run `code` in a fresh interpreter; its RESULT line's value, and everything it printed."""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{out[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULT ")), out


def _without_ray(env: dict, home: Path) -> dict:
    """`env` with no Ray setting and a home without ~/.ray/auth_token (which Ray would otherwise pick up)."""
    return {**{k: v for k, v in env.items() if not k.startswith("RAY_")}, "HOME": str(home)}


@pytest.fixture(scope="module")
def ray_stack(stack):  # noqa: F811 (the fixture's value)
    """The stack, its Ray settings and its token (read here only to look for it where it must not be)."""
    client = stack["client"]
    token_file = Path(client["RAY_AUTH_TOKEN_PATH"])
    assert token_file.parent == stack["state"] and token_file.stat().st_mode & 0o777 == 0o600, token_file
    dashboard = f"http://127.0.0.1:{stack['env']['RLHF_RAY_DASHBOARD_PORT']}"
    assert f"dashboard {dashboard}" in stack["up"], stack["up"]
    return {**stack, "token": token_file.read_text().strip(), "dashboard": dashboard,
            "head": client["RAY_NODE_IP_ADDRESS"], "worker": "127.0.0.3"}  # the defaults (asserted below)


def test_the_cluster_refuses_whoever_lacks_the_token(ray_stack, tmp_path):
    client, head = ray_stack["client"], ray_stack["head"]
    assert client["RAY_AUTH_MODE"] == "token" and client["RAY_ADDRESS"].startswith(f"{head}:")
    assert (head, ray_stack["worker"]) == ("127.0.0.2", "127.0.0.3")  # on loopback by default
    probe = {"PROBE_ADDRESS": client["RAY_ADDRESS"], "PROBE_NODE_IP": head}
    bare = {**_without_ray(client, tmp_path), **probe}

    # a driver: no token, then a wrong one
    for name, env in (("no token", bare),
                      ("a wrong token", {**bare, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})):
        result, out = _python(JOIN, env)
        assert not result["joined"], f"joined with {name}: {result}"
        assert "Authentication token is missing or incorrect" in out, f"{name}:\n{out[-2000:]}"
    # a Ray Client, no token: the server never lets it in (the client gives up after its 30 s)
    client_port = ray_stack["env"]["RLHF_RAY_CLIENT_PORT"]
    result, out = _python(JOIN, {**bare, "PROBE_ADDRESS": f"ray://{head}:{client_port}"})
    assert not result["joined"], result
    # the dashboard's Jobs API: listing and submitting refused without the token, and with a wrong one
    jobs = f"{ray_stack['dashboard']}/api/jobs/"
    job = {"entrypoint": f"touch {tmp_path / 'pwned'}"}
    assert httpx.get(jobs, timeout=30).status_code == 401
    assert httpx.get(jobs, headers={"Authorization": f"Bearer {secrets.token_hex(32)}"}, timeout=30).status_code == 403
    assert httpx.post(jobs, json=job, timeout=30).status_code == 401
    listed = httpx.get(jobs, headers={"Authorization": f"Bearer {ray_stack['token']}"}, timeout=30)
    assert listed.status_code == 200 and not [j for j in listed.json() if j.get("entrypoint") == job["entrypoint"]]
    assert not (tmp_path / "pwned").exists()

    # with the token (what `infra/stack.sh env` gives a client): a driver and a Ray Client join, both nodes alive
    result, out = _python(JOIN, {**client, **probe})
    assert result == {"joined": True, "nodes": sorted([head, ray_stack["worker"]])}, out[-2000:]
    result, out = _python(JOIN, {**client, **probe, "PROBE_ADDRESS": f"ray://{head}:{client_port}"})
    assert result["joined"] and len(result["nodes"]) == 2, out[-2000:]

    # no secret of the stack on any process's command line (the nodes, their workers, the servers)
    import psutil

    values = _stack_secrets(ray_stack)
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        assert not [v[:4] for v in values if v in line], f"pid {proc.info['pid']} has a secret on its command line"


def _stack_secrets(ray_stack) -> list[str]:
    pairs = dict(line.split("=", 1) for line in (ray_stack["state"] / "secrets.env").read_text().split())
    values = [pairs[k] for k in ("RLHF_PG_PASSWORD", "RLHF_MLFLOW_ADMIN_PASSWORD", "RLHF_MLFLOW_PASSWORD",
                                 "RLHF_S3_SECRET", "RLHF_FLASK_SECRET")]
    values += [pairs["RLHF_PREFECT_AUTH"].split(":", 1)[1], ray_stack["token"]]
    assert all(len(v) >= 20 for v in values)
    return values


def test_the_pipeline_runs_its_model_stages_on_the_cluster(ray_stack, tmp_path_factory, monkeypatch):
    client, state = ray_stack["client"], ray_stack["state"]
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # for the MLflow client of this test
        monkeypatch.setenv(name, client[name])
    repo = make_repo(tmp_path_factory.mktemp("ray") / "repo", [], ("profiles/cpu-ray.yaml",))
    sh(BIN / "prefect", "--no-prompt", "deploy", "--all", cwd=repo, env=client, timeout=300)
    from prefect.deployments import run_deployment

    started = time.monotonic()
    with _prefect(client):
        run = run_deployment("rlhf-pipeline/manual", parameters={"profile": "cpu-ray"}, timeout=0)
    log = state / "logs" / "worker.log"
    while not (flow_run := _flow_run(client, run.id)).state.is_final():
        assert time.monotonic() - started < PIPELINE_S, f"not done after {PIPELINE_S} s\n{log.read_text()[-6000:]}"
        time.sleep(5)
    print(f"the pipeline on Ray: {flow_run.state.name} in {time.monotonic() - started:.0f} s")
    assert flow_run.state.is_completed(), f"{flow_run.state}\n{log.read_text()[-8000:]}"

    record = json.loads(max((repo / "reports" / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    assert record["status"] == "FINISHED" and record["profile"] == "cpu-ray", record
    assert all(s["ran"] for s in record["stages"]), record["stages"]
    # every model stage's driver said where its ranks went: the stack's cluster and bucket
    said = log.read_text()
    for stage in MODEL_STAGES:
        assert re.search(rf"stage {stage}: .*Ray cluster at {re.escape(client['RAY_ADDRESS'])}.*"
                         rf"{re.escape(client['RLHF_RAY_STORAGE'])}/{stage}-", said), stage

    # MLflow: each model stage ran as 2 processes; the registry has the version this run made
    from mlflow import MlflowClient

    mlflow = MlflowClient(client["MLFLOW_TRACKING_URI"])
    parent = mlflow.get_run(record["mlflow_run_id"])
    stages = {r.data.tags["rlhf.stage"]: r for r in mlflow.search_runs(
        parent.info.experiment_id, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    for stage in MODEL_STAGES:
        assert stages[stage].info.status == "FINISHED", stage
        assert stages[stage].data.params.get("num_processes") == "2", (stage, stages[stage].data.params)
    history = mlflow.get_metric_history(stages["train"].info.run_id, "objective/kl")
    assert sorted(m.step for m in history) == [1, 2], history  # the ranks' per-update figures, replayed
    [version] = mlflow.search_model_versions("name = 'rlhf-policy'")
    assert version.run_id in {r.info.run_id for r in stages.values()} | {parent.info.run_id}, version

    # the ranks of the worker groups ran on both nodes (1 CPU each, 1 CPU per rank: one rank per node)
    ranks, out = _python(RANKS, {**client, "PROBE_DASHBOARD": ray_stack["dashboard"]})
    assert ranks and set(ranks) == {ray_stack["head"], ray_stack["worker"]}, (ranks, out[-2000:])
    # nothing left on the shared storage: each driver removed its stage's folder and Ray Train's
    import boto3

    s3 = boto3.client("s3", endpoint_url=client["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id=client["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=client["AWS_SECRET_ACCESS_KEY"])
    bucket, prefix = client["RLHF_RAY_STORAGE"].removeprefix("s3://").split("/", 1)
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
            if not o["Key"].endswith("/")]  # folder markers pyarrow leaves are empty
    assert not left, left[:20]

    # the token is in no log, param, tag or report
    token = ray_stack["token"]
    texts: dict[str, str] = {}
    ray_logs = Path(client["RAY_AUTH_TOKEN_PATH"]).parent / "ray"  # the state folder's (a short one in tests)
    for path in [*(state / "logs").glob("*.log"), *ray_logs.glob("session_*/logs/**/*"), *(repo / "reports").rglob("*")]:
        if path.is_file():
            texts[str(path)] = path.read_text(errors="replace")
    for mlflow_run in [parent, *stages.values()]:
        texts[f"mlflow run {mlflow_run.info.run_id}"] = json.dumps([mlflow_run.data.params, mlflow_run.data.tags])
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with _prefect(client), get_client(sync_client=True) as prefect:
        texts["prefect logs"] = "\n".join(log.message for log in prefect.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))))
    assert len(texts) > 50 and texts["prefect logs"], sorted(texts)[:10]
    assert not [where for where, text in texts.items() if token in text]
