"""A bounded load test of the server stack, live on loopback (marker `server`; `make test-server` runs it).

The stack as tests/test_server.py brings it up (`infra/stack.sh up`: Prefect server and worker, MLflow server on
Postgres and S3), the pipeline in a fresh git + DVC repo on the TINY world (tests/test_pipeline.py), deployed with
`prefect deploy --all`, and run once so that every stage is done (later runs skip them all through DVC). Then:

1. 20 runs of `rlhf-pipeline/manual` queued at once, the work pool `rlhf-local` limited to 2 runs at a time (the
   deployment's own limit of 1 is lifted for this test, so that the pool's limit is the one that binds; the two
   runs of one workspace then meet at the workspace lock, which orders them): all 20 end Completed, none lost or
   duplicated (20 flow runs, 20 run records under reports/runs/, one MLflow pipeline run each), and no more than
   2 ran at once (from the flow runs' start and end times);
2. two copies of that workspace run `rlhf run` at the same time, with different overrides, into the one MLflow
   server: each run's parent and stage runs are complete and its own (root, params, metrics, registered version);
3. a second `rlhf run` in a busy workspace says whom it waits for, refuses after its wait and leaves the first
   run alone (Completed, params.yaml byte for byte, dvc.lock with the first run's params, `dvc status` clean);
4. the load's throughput (runs/min, first start to last end) and the peak memory of the Prefect server, the
   MLflow server and Postgres during it, sampled from /proc: printed and written to reports/load/load.json of
   the load's workspace. Speed is reported, never asserted; time limits only bound the waits.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from test_pipeline import TINY
from test_server import (
    BIN,
    _flow_run,
    _prefect,
    make_repo,
    sh,
    stack,  # noqa: F401  (the module-scoped fixture: infra/stack.sh up ... down)
)

pytestmark = pytest.mark.server

RUNS = 20  # queued at once
POOL, POOL_LIMIT = "rlhf-local", 2
WAIT_S = 1800  # a bound on waiting for the 20 runs (6 min 15 s on 2 busy cores), not a timing assertion
RUN_S = 900  # a bound on one pipeline run
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def copy_workspace(source: Path, dest: Path) -> Path:
    """A second workspace of the same pipeline: the git repo with its outputs and DVC cache (stages done)."""
    shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def client_env(stack: dict) -> dict:  # noqa: F811 (the fixture's value)
    return {**stack["client"], **OFFLINE}


def flow_runs(client_env: dict, ids) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with _prefect(client_env), get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(ids))), limit=200)


def deployment_runs(client_env: dict, deployment_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with _prefect(client_env), get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                     limit=200)


def max_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals (start, end) open at one instant; one that ends as another starts does not overlap it."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])  # -1 first on ties
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def records(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((root / "reports" / "runs").glob("*.json"))]


def mlflow_client(client_env: dict, monkeypatch):
    from mlflow import MlflowClient

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, client_env[name])
    return MlflowClient(client_env["MLFLOW_TRACKING_URI"])


def pipeline_runs(mlflow, root: Path, since_ms: int) -> list:
    """The MLflow pipeline (parent) runs of the workspace `root` started at or after `since_ms`."""
    exp = mlflow.get_experiment_by_name("rlhf-pipeline").experiment_id
    return mlflow.search_runs([exp], f"tags.`rlhf.kind` = 'pipeline' and tags.`rlhf.root` = '{root.resolve()}' "
                                     f"and attributes.start_time >= {since_ms}", max_results=1000)


class PeakMemory:
    """Samples the resident memory (RSS) and proportional memory (PSS: shared pages split between the processes
    that map them; Postgres's backends share its buffers) of each server's process tree from /proc, in a thread.
    MLflow's tree is its app (uvicorn) and its job runner with the runner's consumers; Prefect's is one process."""

    def __init__(self, roots: dict[str, int], every_s: float = 1.0):
        self.roots, self.every_s = roots, every_s
        self.peak = {name: {"rss_mib": 0.0, "pss_mib": 0.0, "processes": 0, "largest_process_rss_mib": 0.0}
                     for name in roots}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import psutil

        for name, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            rss = pss = largest = 0
            for proc in procs:
                try:
                    info = proc.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
                largest = max(largest, info.rss)
            peak = self.peak[name]
            peak["largest_process_rss_mib"] = max(peak["largest_process_rss_mib"], round(largest / 2**20, 1))
            peak["rss_mib"] = max(peak["rss_mib"], round(rss / 2**20, 1))
            peak["pss_mib"] = max(peak["pss_mib"], round(pss / 2**20, 1))
            peak["processes"] = max(peak["processes"], len(procs))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)


def server_pids(state: Path) -> dict[str, int]:
    """The stack's servers: the pids infra/stack.sh recorded, and Postgres's postmaster."""
    pids = {name: int((state / "run" / f"{name}.pid").read_text()) for name in ("prefect", "mlflow")}
    pids["postgres"] = int((state / "postgres" / "postmaster.pid").read_text().split()[0])
    return pids


@pytest.fixture(scope="module")
def deployed(stack, tmp_path_factory):  # noqa: F811
    """The TINY pipeline deployed with `prefect deploy --all`, the pool limited to POOL_LIMIT runs at a time, the
    deployment's own limit lifted, and one run done through the worker (every stage run once)."""
    env = client_env(stack)
    repo = make_repo(tmp_path_factory.mktemp("load") / "repo", TINY)
    sh(BIN / "prefect", "--no-prompt", "deploy", "--all", cwd=repo, env=env, timeout=300)
    sh(BIN / "prefect", "--no-prompt", "work-pool", "set-concurrency-limit", POOL, str(POOL_LIMIT), cwd=repo, env=env)
    from prefect import get_client

    with _prefect(env), get_client(sync_client=True) as prefect:
        deployment = prefect.read_deployment_by_name("rlhf-pipeline/manual")
        assert deployment.global_concurrency_limit.limit == 1, deployment  # prefect.yaml's
        assert prefect.read_work_pool(POOL).concurrency_limit == POOL_LIMIT
    user, password = env["PREFECT_API_AUTH_STRING"].split(":", 1)
    lifted = httpx.patch(f"{env['PREFECT_API_URL']}/deployments/{deployment.id}", json={"concurrency_limit": None},
                         auth=(user, password), timeout=30)
    assert lifted.status_code == 204, lifted.text
    with _prefect(env), get_client(sync_client=True) as prefect:
        assert prefect.read_deployment(deployment.id).global_concurrency_limit is None
    from prefect.deployments import run_deployment

    with _prefect(env):
        first = run_deployment("rlhf-pipeline/manual", timeout=0)
    log = stack["state"] / "logs" / "worker.log"
    deadline = time.monotonic() + RUN_S
    while not (run := _flow_run(env, first.id)).state.is_final():
        assert time.monotonic() < deadline, f"the first run is not done after {RUN_S} s\n{log.read_text()[-4000:]}"
        time.sleep(2)
    assert run.state.is_completed(), f"{run.state}\n{log.read_text()[-6000:]}"
    [record] = records(repo)
    assert record["status"] == "FINISHED" and all(s["ran"] for s in record["stages"]), record
    return {"repo": repo, "deployment": deployment, "first": first.id}


def test_twenty_queued_runs_on_a_pool_of_two(stack, deployed, monkeypatch):  # noqa: F811
    env, repo, state = client_env(stack), deployed["repo"], stack["state"]
    log = state / "logs" / "worker.log"
    mlflow = mlflow_client(env, monkeypatch)
    from prefect.deployments import run_deployment

    queued_ms = int(time.time() * 1000)
    with PeakMemory(server_pids(state)) as memory:
        queued_at = time.time()
        with _prefect(env):
            ids = [run_deployment("rlhf-pipeline/manual", timeout=0).id for _ in range(RUNS)]
        queued_s = time.time() - queued_at
        deadline = time.monotonic() + WAIT_S
        while True:
            runs = flow_runs(env, ids)
            if all(r.state.is_final() for r in runs):
                break
            assert time.monotonic() < deadline, (f"not all {RUNS} runs final after {WAIT_S} s: "
                                                 f"{sorted(r.state.name for r in runs)}\n{log.read_text()[-4000:]}")
            time.sleep(3)
    print(f"{RUNS} runs queued in {queued_s:.1f} s")

    # all 20 Completed, none lost or duplicated on the Prefect server
    assert len(ids) == len(set(ids)) == RUNS
    assert sorted(str(r.id) for r in runs) == sorted(map(str, ids))
    not_completed = [(r.name, r.state.name, r.state.message) for r in runs if not r.state.is_completed()]
    assert not not_completed, f"{not_completed}\n{log.read_text()[-6000:]}"
    on_server = deployment_runs(env, deployed["deployment"].id)
    assert sorted(str(r.id) for r in on_server) == sorted(map(str, [deployed["first"], *ids])), \
        "the deployment has other flow runs than the warm-up and the 20 queued"
    # ... in the workspace: one run record each (and the warm-up's), every stage skipped by DVC
    found = [r for r in records(repo) if r["flow_run_id"] != str(deployed["first"])]
    assert len(records(repo)) == RUNS + 1
    assert sorted(r["flow_run_id"] for r in found) == sorted(map(str, ids)), "run records lost or duplicated"
    assert all(r["status"] == "FINISHED" for r in found), [r["status"] for r in found]
    assert all(not s["ran"] for r in found for s in r["stages"]), "a stage ran again: the runs were not cheap"
    # ... in MLflow: exactly one pipeline run per flow run, each closed FINISHED
    parents = pipeline_runs(mlflow, repo, queued_ms)
    assert len(parents) == RUNS, [p.info.run_name for p in parents]
    assert {p.info.run_id for p in parents} == {r["mlflow_run_id"] for r in found}
    assert all(p.info.status == "FINISHED" for p in parents), [p.info.status for p in parents]

    # no more than the pool's limit ran at once
    spans = [(r.start_time.timestamp(), r.end_time.timestamp()) for r in runs]
    at_once = max_at_once(spans)
    assert 1 <= at_once <= POOL_LIMIT, f"{at_once} runs ran at once on a pool limited to {POOL_LIMIT}"

    # 4. throughput and the servers' peak memory (reported, not asserted)
    first_start, last_end = min(s for s, _ in spans), max(e for _, e in spans)
    minutes = (last_end - first_start) / 60
    figures = {
        "runs": RUNS, "pool_limit": POOL_LIMIT, "most_at_once": at_once,
        "runs_per_min": round(RUNS / minutes, 2), "first_start_to_last_end_s": round(last_end - first_start, 1),
        "queued_to_last_end_s": round(last_end - queued_at, 1),
        "run_s": {"min": round(min(e - s for s, e in spans), 1), "max": round(max(e - s for s, e in spans), 1),
                  "mean": round(sum(e - s for s, e in spans) / len(spans), 1)},
        "peak_memory": memory.peak, "memory_samples": memory.samples,
        "cpu_count": __import__("os").cpu_count(),
    }
    out = repo / "reports" / "load" / "load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"load: {json.dumps(figures, indent=2)}\nwritten to {out}")
    assert memory.samples >= 10 and all(p["rss_mib"] > 0 for p in memory.peak.values()), memory.peak


def test_two_workspaces_track_into_one_mlflow_server_at_once(stack, deployed, tmp_path, monkeypatch):  # noqa: F811
    env = client_env(stack)
    mlflow = mlflow_client(env, monkeypatch)
    spaces = {"a": ("train.kl_coef=0.07", "0.07"), "b": ("train.kl_coef=0.13", "0.13")}
    roots = {name: copy_workspace(deployed["repo"], tmp_path / name) for name in spaces}
    versions_before = {v.version for v in mlflow.search_model_versions("name = 'rlhf-policy'")}
    since_ms = int(time.time() * 1000)
    procs = {}
    for name, (override, _) in spaces.items():
        out = (tmp_path / f"{name}.log").open("w")
        procs[name] = subprocess.Popen([BIN / "rlhf", "run", "--set", override], cwd=roots[name], env=env,
                                       stdout=out, stderr=subprocess.STDOUT)
    for proc in procs.values():
        proc.wait(timeout=RUN_S)
    for name, proc in procs.items():
        assert proc.returncode == 0, (tmp_path / f"{name}.log").read_text()[-6000:]

    exp = mlflow.get_experiment_by_name("rlhf-pipeline").experiment_id
    versions = {v.version: v for v in mlflow.search_model_versions("name = 'rlhf-policy'")
                if v.version not in versions_before}
    assert len(versions) == 2, sorted(versions)  # one new version per run, none lost, none twice
    seen_runs: set[str] = set()
    for name, (override, kl) in spaces.items():
        root = roots[name]
        [parent] = pipeline_runs(mlflow, root, since_ms)
        [record] = [r for r in records(root) if r["mlflow_run_id"] == parent.info.run_id]
        assert record["status"] == "FINISHED" and record["overrides"] == [override], record
        assert parent.info.status == "FINISHED"
        assert parent.data.params["train.kl_coef"] == kl and parent.data.params["overrides"] == json.dumps([override])
        evaluation = json.loads((root / "metrics" / "eval.json").read_text())
        assert parent.data.metrics["eval/win_rate_gold"] == pytest.approx(evaluation["win_rate_gold"])
        assert parent.data.metrics["eval/mean_kl"] == pytest.approx(evaluation["mean_kl"])
        stages = mlflow.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        by_stage = {s.data.tags["rlhf.stage"]: s for s in stages}
        assert len(by_stage) == len(stages) and set(by_stage) == {"train", "evaluate", "register"}, \
            sorted(s.data.tags["rlhf.stage"] for s in stages)  # the others were skipped: unchanged
        for stage in stages:
            assert stage.info.status == "FINISHED", (stage.data.tags["rlhf.stage"], stage.info.status)
            assert stage.data.tags["rlhf.overrides"] == json.dumps([override])
            assert stage.info.run_id not in seen_runs
            seen_runs.add(stage.info.run_id)
        train = by_stage["train"]
        assert train.data.params["train.kl_coef"] == kl, train.data.params
        history = json.loads((root / "metrics" / "train_history.json").read_text())
        logged = mlflow.get_metric_history(train.info.run_id, "objective/kl")
        assert {m.step: m.value for m in logged} == pytest.approx(
            {row["update"]: float(row["objective/kl"]) for row in history}), "train metrics mixed or lost"
        [version] = [v for v in versions.values() if v.run_id == by_stage["register"].info.run_id]
        assert version.tags["rlhf.overrides"] == json.dumps([override]), version.tags
        assert version.status == "READY"
        register = json.loads((root / "metrics" / "register.json").read_text())
        assert str(register["version"]) == str(version.version), register


def test_a_second_run_in_a_busy_workspace_refuses_and_leaves_the_first_alone(stack, deployed, tmp_path):  # noqa: F811
    env = client_env(stack)
    root = copy_workspace(deployed["repo"], tmp_path / "busy")
    # the first run has work to do: train (4 updates), evaluate and register rerun on a committed change
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"]["total_episodes"] = 4 * 64
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh("git", "commit", "-qam", "four updates", cwd=root)
    committed = (root / "params.yaml").read_bytes()
    holder = root / ".dvc" / "tmp" / "rlhf-pipeline.lock.json"
    assert not holder.exists()
    records_before = set((root / "reports" / "runs").glob("*.json"))
    first_log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen([BIN / "rlhf", "run"], cwd=root, env=env, stdout=first_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + RUN_S
        while not (holder.exists() and json.loads(holder.read_text() or "{}").get("pid") == first.pid):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-4000:]
            time.sleep(0.2)
        second = sh(BIN / "rlhf", "run", "--wait", "3", "--set", "train.kl_coef=0.5", cwd=root, env=env,
                    timeout=300, check=False)
        assert first.poll() is None, "the first run ended before the second asked for the lock"
        first.wait(timeout=RUN_S)
    finally:
        if first.poll() is None:
            first.kill()
    said = second.stdout + second.stderr
    print(f"the second run said:\n{said[-1500:]}")
    assert second.returncode == 1, said
    assert f"waiting up to 3 s for the workspace lock, held by pid {first.pid} on " in said, said
    assert re.search(rf"workspace {re.escape(str(root.resolve()))} is busy: another pipeline run holds .*pid "
                     rf"{first.pid} .*waited 3 s", said), said
    assert first.returncode == 0, (tmp_path / "first.log").read_text()[-6000:]
    # the first run is whole: its record (the refused run wrote none), params.yaml byte for byte, dvc.lock with
    # its params, dvc status clean
    [record] = [json.loads(p.read_text()) for p in sorted((root / "reports" / "runs").glob("*.json"))
                if p not in records_before]
    assert record["status"] == "FINISHED" and record["overrides"] == [], record
    assert {s["stage"] for s in record["stages"] if s["ran"]} == {"train", "evaluate", "register"}, record
    assert (root / "params.yaml").read_bytes() == committed
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert lock["stages"]["train"]["params"]["params.yaml"]["train"] == params["train"]  # not the second's 0.5
    assert json.loads(sh(BIN / "dvc", "status", "--json", cwd=root, env=env).stdout) == {}
    assert not holder.exists()  # the lock is free
