"""Writes infra/work-pools/{docker-gpu,kubernetes-gpu}.json: the Docker and Kubernetes workers' default base job
templates (prefect-docker, prefect-kubernetes) plus what a GPU flow run needs. Rerun after upgrading those
packages: `python infra/work-pools/make_templates.py` (tests/test_server.py checks the files are current).

- Docker: `device_requests` with capabilities [["gpu"]] (`docker run --gpus`), a shared-memory size for NCCL
  (its default 64 MB fails multi-GPU runs), and heartbeats.
- Kubernetes: `nvidia.com/gpu` limits, a toleration for GPU taints, /dev/shm as a memory volume, heartbeats;
  `completions` / `parallelism` moved from the pod spec (where Prefect's default has them) to the Job spec.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEARTBEAT = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}  # the server marks a silent run Crashed (infra/automations/)


def _int_var(title: str, default: int, description: str) -> dict:
    return {"title": title, "type": "integer", "default": default, "description": description}


def _str_var(title: str, default: str, description: str) -> dict:
    return {"title": title, "type": "string", "default": default, "description": description}


def docker_gpu() -> dict:
    from prefect_docker.worker import DockerWorker

    template = copy.deepcopy(DockerWorker.get_default_base_job_template())
    props = template["variables"]["properties"]
    props["env"]["default"] = dict(HEARTBEAT)
    props["gpu_count"] = _int_var("GPUs", -1, "GPUs given to the container (-1: all of the host's).")
    props["shm_size"] = _str_var("Shared memory", "16g", "Size of /dev/shm: NCCL needs more than Docker's 64 MB.")
    # docker-py's containers.create(device_requests=[...], shm_size=...), what `docker run --gpus` sends
    template["job_configuration"]["container_create_kwargs"] = {
        "device_requests": [{"driver": "nvidia", "count": "{{ gpu_count }}", "capabilities": [["gpu"]]}],
        "shm_size": "{{ shm_size }}",
    }
    return template


def kubernetes_gpu() -> dict:
    from prefect_kubernetes.worker import KubernetesWorker

    template = copy.deepcopy(KubernetesWorker.get_default_base_job_template())
    props = template["variables"]["properties"]
    props["env"]["default"] = dict(HEARTBEAT)
    props["gpu_count"] = _int_var("GPUs", 1, "nvidia.com/gpu per pod (the NVIDIA device plugin must run on the node).")
    props["shm_size"] = _str_var("Shared memory", "16Gi", "Size of the memory volume on /dev/shm (NCCL).")
    job = template["job_configuration"]["job_manifest"]["spec"]
    pod = job["template"]["spec"]
    # Prefect's default puts these Job fields in the pod spec, where the API server drops them as unknown
    for field in ("completions", "parallelism"):
        if field in pod:
            job[field] = pod.pop(field)
    container = pod["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpu_count }}"
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}}]
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return template


TEMPLATES = {"docker-gpu.json": docker_gpu, "kubernetes-gpu.json": kubernetes_gpu}


def render(name: str) -> str:
    return json.dumps(TEMPLATES[name](), indent=2) + "\n"


if __name__ == "__main__":
    for name in TEMPLATES:
        (HERE / name).write_text(render(name))
        print(f"wrote {HERE / name}", file=sys.stderr)
