"""infra/ checked without servers (runs in `make test`):

- infra/docker-compose.yml against the Compose Specification's JSON schema (infra/schemas/compose-spec.json, from
  compose-spec/compose-spec), plus `docker compose config` / `docker-compose config` where one is installed;
  every port bound to 127.0.0.1 by default, health checks, named volumes, no secret in the file; the Ray nodes
  and the Prefect worker (their driver) read the token from a Compose secret's file, only the dashboard published;
- the work-pool templates through the workers' own job configurations (prefect, prefect-docker,
  prefect-kubernetes: what a worker does with them), the Kubernetes Job against the Kubernetes API models (every
  field a known field of its type: a dry validation without a cluster), and the Docker GPU request;
- infra/prefect-gpu.yaml's deployments: pools, job variables, and parameters the pipeline accepts;
- the guide docs/scaling-out.md: its commands are the ones infra/stack.sh and tests/test_server.py run.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
INFRA = REPO / "infra"
POOLS = INFRA / "work-pools"


def _compose_env() -> dict[str, str]:
    lines = (INFRA / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$ (enough for this file)."""
    def one(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == ":?":
            raise AssertionError(f"compose needs {name}: {arg}")
        return arg or ""
    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, text).replace("$$", "$")


def test_compose_file_matches_the_compose_spec_schema():
    import jsonschema

    schema = json.loads((INFRA / "schemas" / "compose-spec.json").read_text())
    compose = yaml.safe_load(_interpolate((INFRA / "docker-compose.yml").read_text(), _compose_env()))
    jsonschema.validate(compose, schema)  # raises naming the path on any unknown key or wrong type
    services = compose["services"]
    assert {"postgres", "s3", "prefect-server", "prefect-worker", "mlflow"} <= set(services)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)  # loopback unless BIND_ADDRESS says otherwise
        if name != "buckets":
            assert "healthcheck" in service, name
    assert set(compose["volumes"]) >= {"pgdata", "s3data"}
    mlflow = services["mlflow"]
    assert mlflow["command"][:4] == ["mlflow", "server", "--app-name", "basic-auth"]
    assert "--artifacts-destination" in mlflow["command"]
    assert mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://")
    assert "PREFECT_SERVER_API_AUTH_STRING" in services["prefect-server"]["environment"]
    # the file itself holds no credential: each comes from .env
    raw = (INFRA / "docker-compose.yml").read_text()
    for key, value in _compose_env().items():
        if "PASSWORD" in key or "SECRET" in key or "AUTH" in key:
            assert value not in raw, key


def test_compose_ray_nodes_hold_the_token_as_a_file_and_publish_only_the_dashboard():
    """Every Ray node, and the Prefect worker whose flow runs drive the cluster, run with token auth and read the
    token from the Compose secret's file: never an environment value or an argument (`ps` and `docker inspect`
    show those). Only the dashboard is published; GCS and raylets stay on the Compose network."""
    compose = yaml.safe_load(_interpolate((INFRA / "docker-compose.yml").read_text(), _compose_env()))
    services, token = compose["services"], _compose_env()["RAY_AUTH_TOKEN"]
    assert compose["secrets"]["ray_auth_token"] == {"environment": "RAY_AUTH_TOKEN"}
    for name in ("ray-head", "ray-worker", "prefect-worker"):
        service = services[name]
        env = service["environment"]
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_auth_token", name
        assert "RAY_AUTH_TOKEN" not in env and "ray_auth_token" in service["secrets"], name
        assert env["AWS_ENDPOINT_URL"] == "http://s3:9000" and env["AWS_SECRET_ACCESS_KEY"], name
        assert token not in json.dumps(service), name
    assert services["prefect-worker"]["environment"]["RLHF_RAY_STORAGE"] == "s3://rlhf-ray/runs"
    assert "ray start --address=ray-head:6379 --num-cpus=0" in services["prefect-worker"]["command"][-1]
    assert services["ray-head"]["ports"] == ["127.0.0.1:8265:8265"] and "ports" not in services["ray-worker"]
    assert "rlhf-ray" in services["buckets"]["command"][-1]


def test_compose_file_refuses_to_start_without_credentials():
    with pytest.raises(AssertionError, match="set POSTGRES_PASSWORD in infra/.env"):
        _interpolate((INFRA / "docker-compose.yml").read_text(), {"POSTGRES_USER": "x"})


@pytest.mark.skipif(not (shutil.which("docker-compose") or shutil.which("docker")), reason="no docker client")
def test_docker_compose_config_accepts_it(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text((INFRA / ".env.example").read_text())
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if not shutil.which(cmd[0]) or subprocess.run([*cmd, "version"], capture_output=True).returncode != 0:
            continue  # e.g. a docker CLI without the compose plugin
        proc = subprocess.run([*cmd, "--env-file", str(env_file), "-f", str(INFRA / "docker-compose.yml"), "config",
                               "--quiet"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return
    pytest.skip("no docker compose plugin nor docker-compose")


def _template(name: str) -> dict:
    return json.loads((POOLS / name).read_text())


def _defaults(template: dict) -> dict:
    return {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}


def _check_k8s(obj, model: str, path: str = "") -> None:
    """Every key of `obj` is a field of the Kubernetes API type `model` (kubernetes_asyncio's generated models,
    from the API's OpenAPI spec), recursively; values of the right kind."""
    import kubernetes_asyncio.client.models as models

    cls = getattr(models, model)
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    assert isinstance(obj, dict), f"{path or model}: expected an object"
    for key, value in obj.items():
        assert key in by_json, f"{path}.{key}: not a field of {model}"
        kind = cls.openapi_types[by_json[key]]
        where = f"{path}.{key}"
        if value is None:  # null: an optional field left unset (the API server reads it so)
            continue
        if kind.startswith("list["):
            assert isinstance(value, list), f"{where}: expected a list"
            inner = kind[5:-1]
            for i, item in enumerate(value):
                if inner.startswith("V1") or inner.startswith("Core"):
                    _check_k8s(item, inner, f"{where}[{i}]")
        elif kind.startswith("dict("):
            assert isinstance(value, dict), f"{where}: expected a map"
        elif kind.startswith("V1"):
            _check_k8s(value, kind, where)
        elif kind == "int":
            assert isinstance(value, int), f"{where}: expected an integer, got {value!r}"
        elif kind == "str":
            assert isinstance(value, str), f"{where}: expected a string, got {value!r}"


def test_kubernetes_gpu_template_is_a_valid_job_for_the_kubernetes_worker():
    pytest.importorskip("prefect_kubernetes", reason="the server extra (make test-server installs it)")
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = _template("kubernetes-gpu.json")  # what a run may not set: tests/test_work_pools.py
    values = {**_defaults(template), "gpu_count": 8}
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values))
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun

    config.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="gpu-run"))  # what the worker does before submitting
    manifest = config.job_manifest
    _check_k8s(manifest, "V1Job")
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert {"name": "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "value": "30"} in container["env"]
    # a misspelt field is caught: the check can fail
    broken = json.loads(json.dumps(manifest))
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(AssertionError, match="resource: not a field of V1Container"):
        _check_k8s(broken, "V1Job")


def test_docker_gpu_template_requests_gpus_and_shared_memory():
    pytest.importorskip("prefect_docker", reason="the server extra (make test-server installs it)")
    from docker.types import DeviceRequest
    from prefect_docker.worker import DockerWorkerJobConfiguration

    template = _template("docker-gpu.json")  # what a run may not set: tests/test_work_pools.py
    config = asyncio.run(DockerWorkerJobConfiguration.from_template_and_values(
        template, _defaults(template)))
    kwargs = config.container_create_kwargs
    [request] = kwargs["device_requests"]
    assert request["capabilities"] == [["gpu"]] and request["count"] == -1
    assert DeviceRequest(**request)["Capabilities"] == [["gpu"]]  # what docker-py sends (docker run --gpus all)
    assert kwargs["shm_size"] == "16g" and config.image == "rlhf-pipeline:gpu"


def test_process_template_and_generated_templates_are_current():
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.workers.process import ProcessJobConfiguration

    template = _template("process.json")
    try:  # resolving the template asks a Prefect API: with none configured, Prefect starts a temporary server
        config = asyncio.run(ProcessJobConfiguration.from_template_and_values(template, _defaults(template)))
    finally:  # stopped here, not at exit: after two full `make test` runs, one this test had started still ran
        SubprocessASGIServer().stop()
    # the worker's engine command, its environment, a temporary folder until the deployment's pull step
    assert (config.command, config.env, config.working_dir) == (None, {}, None)
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_templates", POOLS / "make_templates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in module.TEMPLATES:  # written by make_templates.py: the same files
        assert module.render(name) == (POOLS / name).read_text(), f"{name} is stale: run infra/work-pools/make_templates.py"


def test_gpu_deployments_name_their_pools_variables_and_valid_parameters():
    from tasks.parameters.params import load_params

    spec = yaml.safe_load((INFRA / "prefect-gpu.yaml").read_text())
    pools = {"rlhf-gpu": "process.json", "rlhf-gpu-docker": "docker-gpu.json", "rlhf-gpu-k8s": "kubernetes-gpu.json"}
    seen = set()
    for deployment in spec["deployments"]:
        pool = deployment["work_pool"]["name"]
        seen.add(pool)
        variables = _template(pools[pool])["variables"]["properties"]
        assert set(deployment["work_pool"]["job_variables"]) <= set(variables), deployment["name"]
        assert deployment["entrypoint"] == "flows/pipeline.py:rlhf_pipeline"
        parameters = deployment["parameters"]
        params = load_params(REPO, parameters["profile"], parameters["overrides"])  # the launcher's config exists
        assert params.runtime.accelerate_config and (REPO / params.runtime.accelerate_config).is_file()
        assert params.runtime.mixed_precision == "bf16"
    assert seen == set(pools)
    top = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert {d["name"] for d in top["deployments"]} == {"manual", "nightly", "point", "frontier"}  # the local ones untouched


def _guide() -> str:
    """The whole of docs/scaling-out.md (the README links to it)."""
    guide = REPO / "docs" / "scaling-out.md"
    assert guide.is_file(), "the scale-out guide docs/scaling-out.md is missing"
    assert "docs/scaling-out.md" in (REPO / "README.md").read_text(), "the README no longer links the guide"
    return guide.read_text()


def test_the_guide_is_what_the_script_and_the_server_test_run():
    guide = _guide()
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", guide, re.S)
                for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    script = (INFRA / "stack.sh").read_text()
    server_test = (REPO / "tests" / "test_server.py").read_text()
    usage = re.findall(r"^#   infra/stack\.sh (\w+)", script, re.M)
    for command in commands:
        if command.startswith("infra/stack.sh"):
            verb = command.split()[1]
            assert verb in usage, f"the guide's `{command}`: stack.sh has no `{verb}`"
    for must in ("infra/stack.sh up", 'eval "$(infra/stack.sh env)"', "prefect deploy --all",
                 "prefect deploy --prefect-file infra/prefect-gpu.yaml --all", "dvc remote add -d shared $RLHF_DVC_REMOTE",
                 "dvc remote modify shared endpointurl $RLHF_S3_ENDPOINT", "dvc push", "dvc pull", "infra/stack.sh down"):
        assert must in commands, f"the guide lost `{must}`"
    # ... and the server test runs each of them (same verbs, same arguments)
    for fragment in ('STACK, "up"', 'STACK, "env"', '"deploy", "--all"', '"--prefect-file", "infra/prefect-gpu.yaml"',
                     '"remote", "add", "-d", "shared", client_env["RLHF_DVC_REMOTE"]',
                     '"remote", "modify", "shared", "endpointurl", client_env["RLHF_S3_ENDPOINT"]',
                     'dvc, "push"', 'dvc, "pull"', 'STACK, "down"'):
        assert fragment in server_test, fragment
    # every variable the guide exports comes from `infra/stack.sh env`
    exported = set(re.findall(r"^export (\w+)=", script, re.M))
    for name in re.findall(r"\$(RLHF_\w+|MLFLOW_\w+|PREFECT_\w+|AWS_\w+)", guide):
        assert name in exported or name.startswith("RLHF_") and f"{name}:-" in script, name
    for template in re.findall(r"infra/work-pools/([\w-]+\.json)", guide):
        assert (POOLS / template).is_file(), template
