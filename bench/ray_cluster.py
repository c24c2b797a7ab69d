"""A Ray cluster of two nodes on this machine, each on its own loopback address, for tests/test_ray.py and
bench/ray_vs_torchrun.py.

`ray start --node-ip-address=127.0.0.1` is silently replaced by the machine's interface address (Ray turns
localhost into a "remotely reachable" address), so the nodes take 127.0.0.2 and 127.0.0.3: other loopback addresses
are kept as given, and no traffic leaves the machine. Each node is a `ray start --block` process in its own session
with 1 CPU and no dashboard; every process Ray starts (GCS, raylets, workers) descends from one of them, which is how
`ray_processes` finds what a run left behind, and how `stop` ends it all without touching another Ray on the machine.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
SYSTEM_PROCESSES = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent",  # a node's own, not a job's
                    "AutoscalingCoordinator")  # detached: the cluster's one for every Ray Train or Data job


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalRayCluster:
    def __init__(self, base: Path, cpus_per_node: int = 1):
        self.base, self.cpus = Path(base), cpus_per_node
        self.port = free_port(HEAD_IP)
        self.address = f"{HEAD_IP}:{self.port}"
        self.storage = self.base / "storage"
        # Ray's sockets live in its temp folder and a Unix socket's path has at most 107 bytes: a short one of its own
        self.temp = Path(tempfile.mkdtemp(prefix="ray-"))
        self.nodes: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """What a driver on this machine needs: the cluster, its node's address, the storage every node shares."""
        return {"RAY_ADDRESS": self.address, "RAY_NODE_IP_ADDRESS": HEAD_IP, "RLHF_RAY_STORAGE": str(self.storage)}

    def start(self, timeout_s: float = 120) -> LocalRayCluster:
        self.storage.mkdir(parents=True, exist_ok=True)
        # with Ray Client's packages installed (ray[default] or [client]) the head serves it: on a free port, not 10001
        client = [f"--ray-client-server-port={free_port(HEAD_IP)}"] if importlib.util.find_spec("grpc") else []
        self._node("head", "--head", f"--node-ip-address={HEAD_IP}", f"--port={self.port}",
                   f"--temp-dir={self.temp}", "--include-dashboard=false", *client)
        self._wait_for("head", timeout_s)
        self._node("worker", f"--address={self.address}", f"--node-ip-address={WORKER_IP}")
        self._wait_for("worker", timeout_s)
        return self

    def _node(self, name: str, *args: str) -> None:
        log = (self.base / f"{name}.log").open("w")
        # RAY_ADDRESS on the nodes: Ray Train's helpers find their own cluster when another one runs on this machine
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": self.address}
        env.pop("RAY_NODE_IP_ADDRESS", None)
        self.nodes[name] = subprocess.Popen(
            [str(BIN / "ray"), "start", *args, f"--num-cpus={self.cpus}",
             "--dashboard-agent-listen-port=0", "--block"],  # two nodes of one machine: never the same port
            cwd=self.base, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_for(self, name: str, timeout_s: float) -> None:
        log, deadline = self.base / f"{name}.log", time.monotonic() + timeout_s
        while "Ray runtime started" not in log.read_text():
            if self.nodes[name].poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Ray {name} node did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def log(self, name: str) -> str:
        return (self.base / f"{name}.log").read_text()

    def ray_processes(self, node: str | None = None) -> list:
        """The job processes (actors, workers) alive on the nodes (or one node), by name: `ray::RayTrainWorker...`."""
        import psutil

        found = []
        for name, proc in self.nodes.items():
            if node not in (None, name):
                continue
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for child in children:
                try:
                    title = child.name() + " " + " ".join(child.cmdline()[:1])
                except psutil.Error:
                    continue
                if "ray::" in title and not any(s in title for s in SYSTEM_PROCESSES):
                    found.append(child)
        return found

    def stop(self) -> None:
        from tasks.execution.launcher import stop_group

        for proc in reversed(list(self.nodes.values())):  # a test cluster: no state to keep
            stop_group(proc, [(signal.SIGTERM, 5), (signal.SIGKILL, 10)])
        for proc in self.nodes.values():  # what a SIGTERM'd `ray start` left in its session (raylet, workers)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)
