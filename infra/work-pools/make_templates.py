"""Writes infra/work-pools/{process,docker-gpu,kubernetes-gpu}.json: the base job templates of the project's work
pools (`prefect work-pool create NAME --type TYPE --base-job-template FILE`). tests/test_infra.py checks the files
are what this script writes. A pool with another image or namespace gets its own files:
`python infra/work-pools/make_templates.py --docker-image IMAGE --k8s-image IMAGE --namespace NS --out DIR`.

Whoever may start a run of a deployment (the UI's Custom run, the API) may give it job variables, and Prefect
3.8.8 lays them over the deployment's and the pool's defaults (pool < deployment < flow run). So a template here:

- lists as variables only what a run may choose: GPUs, shared memory, CPU and memory requests, output streaming;
  each an integer, a boolean or a string with a pattern, so that no value carries a template
  (`{{ prefect.blocks.NAME }}`) for the worker to resolve;
- sets `additionalProperties: false`: the server refuses any other variable (HTTP 422) when a deployment, or a
  flow run of a deployment, is created or updated (prefect.server.api.validation);
- fixes everything else in `job_configuration`, with no placeholder: command, working directory, image, namespace,
  volumes, privileges, network. The worker fills only placeholders from job variables, so such a key never takes
  one, not even from a flow run created through `POST /flow_runs/`, whose job variables the server does not check;
- has no `env` key in `job_configuration`: where that key is a dict, the worker merges a job variable `env` into
  it whatever the schema allows (prefect.workers.base.BaseJobConfiguration.from_template_and_values). A flow run's
  environment is its worker's: every worker hands a flow run the Prefect settings it was started with (start it
  with PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 so the server can mark a silent run Crashed, infra/automations/), a
  process worker its whole environment, and the Kubernetes Job adds the literal `env` list of its container.

Docker: `device_requests` with capabilities [["gpu"]] (`docker run --gpus`) and a shared-memory size for NCCL (its
default 64 MB fails multi-GPU runs). Kubernetes: `nvidia.com/gpu` limits, a toleration for GPU taints, /dev/shm as
a memory volume, `completions` / `parallelism` on the Job spec.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCKER_IMAGE = "rlhf-pipeline:gpu"  # infra/Dockerfile built with a CUDA torch, on the Docker host
K8S_IMAGE = "registry.example.com/rlhf-pipeline:gpu"
K8S_NAMESPACE = "rlhf"
HEARTBEAT_S = "30"  # the server marks a silent run Crashed (infra/automations/)
# Kubernetes resource quantities (`16Gi`, `500m`, `32`) and Docker sizes (`16g`): digits and a unit, nothing else
K8S_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
DOCKER_SIZE = r"^[0-9]+[bkmg]?$"


def _int_var(title: str, default: int, minimum: int, description: str) -> dict:
    return {"title": title, "type": "integer", "default": default, "minimum": minimum, "description": description}


def _size_var(title: str, default: str | None, pattern: str, description: str) -> dict:
    kind = {"type": "string", "pattern": pattern}
    if default is None:  # unset: the key is left out of the manifest
        return {"title": title, "anyOf": [kind, {"type": "null"}], "default": None, "description": description}
    return {"title": title, **kind, "default": default, "description": description}


STREAM_OUTPUT = {"title": "Stream Output", "type": "boolean", "default": True,
                 "description": "Copy the flow run's output to the worker's own output."}


def _variables(description: str, **properties: dict) -> dict:
    """What a deployment or a flow run may set: these properties and nothing else."""
    return {"type": "object", "description": description, "properties": properties, "additionalProperties": False}


def process() -> dict:
    # no command (the worker's engine command), no working_dir (a temporary folder, then the deployment's pull
    # step `set_working_directory`, which `prefect deploy` records), no env (the worker's own)
    return {
        "job_configuration": {"stream_output": "{{ stream_output }}"},
        "variables": _variables(
            "rlhf-pipeline: a flow run is a subprocess of the worker, in its environment, in the deployment's working "
            "directory. Command, environment and working directory are the worker's and the deployment's, never a "
            "run's. On a GPU box start one worker per GPU set, CUDA_VISIBLE_DEVICES in its environment.",
            stream_output=STREAM_OUTPUT),
    }


def docker_gpu(image: str = DOCKER_IMAGE) -> dict:
    return {
        "job_configuration": {
            "image": image,
            "image_pull_policy": "IfNotPresent",
            "volumes": [],
            "networks": [],
            "privileged": False,
            "auto_remove": False,
            "stream_output": "{{ stream_output }}",
            # docker-py's containers.create(device_requests=[...], shm_size=...), what `docker run --gpus` sends
            "container_create_kwargs": {
                "device_requests": [{"driver": "nvidia", "count": "{{ gpu_count }}", "capabilities": [["gpu"]]}],
                "shm_size": "{{ shm_size }}",
            },
        },
        "variables": _variables(
            f"rlhf-pipeline in {image}: image, command, volumes and network are the pool's; the environment is the "
            "worker's Prefect settings. A run chooses its GPUs and shared memory.",
            gpu_count=_int_var("GPUs", -1, -1, "GPUs given to the container (-1: all of the host's)."),
            shm_size=_size_var("Shared memory", "16g", DOCKER_SIZE,
                               "Size of /dev/shm (digits and b, k, m or g): NCCL needs more than Docker's 64 MB."),
            stream_output=STREAM_OUTPUT),
    }


def kubernetes_gpu(image: str = K8S_IMAGE, namespace: str = K8S_NAMESPACE) -> dict:
    container = {
        "name": "prefect-job",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # the worker puts its own Prefect settings and the flow run's ids before these
        "env": [{"name": "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "value": HEARTBEAT_S}],
        "resources": {
            "limits": {"nvidia.com/gpu": "{{ gpu_count }}"},
            "requests": {"cpu": "{{ cpu_request }}", "memory": "{{ memory_request }}"},
        },
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = {
        "containers": [container],
        "restartPolicy": "Never",
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"namespace": namespace},
        "spec": {"backoffLimit": 0, "completions": 1, "parallelism": 1, "template": {"spec": pod}},
    }
    quantity = "a Kubernetes quantity"
    return {
        "job_configuration": {"namespace": namespace, "job_manifest": manifest, "stream_output": "{{ stream_output }}"},
        "variables": _variables(
            f"rlhf-pipeline in {image}, namespace {namespace}: the Job's image, command, environment, service account "
            "and volumes are the pool's. A run chooses its GPUs, shared memory and CPU and memory requests.",
            gpu_count=_int_var("GPUs", 1, 0, "nvidia.com/gpu per pod (the NVIDIA device plugin must run on the node)."),
            shm_size=_size_var("Shared memory", "16Gi", K8S_QUANTITY,
                               f"Size of the memory volume on /dev/shm (NCCL), {quantity}."),
            cpu_request=_size_var("CPU request", None, K8S_QUANTITY, f"CPUs the pod requests, {quantity} (`32`)."),
            memory_request=_size_var("Memory request", None, K8S_QUANTITY,
                                     f"Memory the pod requests, {quantity} (`200Gi`)."),
            stream_output=STREAM_OUTPUT),
    }


TEMPLATES = {"process.json": process, "docker-gpu.json": docker_gpu, "kubernetes-gpu.json": kubernetes_gpu}


def render(name: str, **fixed: str) -> str:
    return json.dumps(TEMPLATES[name](**fixed), indent=2) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docker-image", default=DOCKER_IMAGE)
    parser.add_argument("--k8s-image", default=K8S_IMAGE)
    parser.add_argument("--namespace", default=K8S_NAMESPACE)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    fixed = {"process.json": {}, "docker-gpu.json": {"image": args.docker_image},
             "kubernetes-gpu.json": {"image": args.k8s_image, "namespace": args.namespace}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TEMPLATES:
        (args.out / name).write_text(render(name, **fixed[name]))
        print(f"wrote {args.out / name}", file=sys.stderr)


if __name__ == "__main__":
    main()
