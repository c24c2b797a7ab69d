"""The caller's side of the warm stage server: a flow starts one per run, `rlhf stage` hands its command to it.

A stage process spent ~5 s importing before its first line of work (torch and transformers' model code ~3 s,
MLflow ~2 s): on the demo world as long as the work of most stages. A flow starts a server for its run
(`serving_stages`; the server itself is cli/stage_server.py, an entry point above the stages it imports) and
names its socket in RLHF_STAGE_SERVER. `rlhf stage`, started by DVC as before, hands its command line, working
directory, environment and standard streams to the server (`run_in_server`) and waits. The server forks a
supervisor, which forks the stage: it takes the caller's cwd, environment and streams and runs the `rlhf` command
with them. Its exit status goes back to the caller, which exits with it.

A stage launched on several processes is served twice over: the server runs the stage, whose launcher
(torchrun, accelerate) starts the ranks, and each rank's `rlhf stage` hands itself to the server in turn, so a
rank too starts with everything imported instead of importing it again (~5 s per rank).

The caller stays the process DVC, the flow and a launcher see: a signal it receives is forwarded to the stage, and if the
caller dies (kill -9) the supervisor stops the stage. The server refuses a stage when forking would be unsafe or
its code changed on disk, and the caller then runs the stage itself, as it does whenever the server cannot be
reached: the server only ever saves time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tasks.execution.launcher import stop_group

SERVER_ENV = "RLHF_STAGE_SERVER"  # the socket of the server that runs this run's stages
SERVED_ENV = "RLHF_SERVED_PID"  # set in a served stage: the process the server runs (its ranks hand on again)
SERVER_MODULE = "cli.stage_server"  # run with `python -m`: the server imports the stages and cli, so sits above them
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GPU_DRIVERS = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and ROCm's: no server where either is
STARTING_S = 180  # the longest a caller waits for a starting server (its imports: ~5 s quiet, 40 s on busy cores)
HEADER = struct.Struct("!I")  # the length of the request's JSON
ACCEPTED = b"+"  # the server's answer once the stage is started; anything else (or nothing) and the caller runs it


# ------------------------------------------------------------------ the flow's side: one server per run

@contextmanager
def serving_stages(log: Path) -> Iterator[str]:
    """Start a stage server for the stages run inside the block and yield its socket (for RLHF_STAGE_SERVER);
    stopped on the way out. It takes stages once it has imported everything (~5 s; a stage called meanwhile waits
    for it rather than import the same libraries again on the same cores); all of them run as plain processes if
    it cannot start. It notes in `log` what it ran and what it refused.
    Where forking a process that imported torch is unsafe it yields "" and every stage runs as a plain process:
    on macOS, and beside a GPU driver (a library that touched the driver before the fork breaks CUDA in the
    fork; a GPU stage's imports are small beside its work anyway)."""
    if not sys.platform.startswith("linux") or any(os.path.exists(d) for d in GPU_DRIVERS):
        yield ""
        return
    folder = tempfile.mkdtemp(prefix="rlhf-stages-")
    path = os.path.join(folder, "socket")
    log.parent.mkdir(parents=True, exist_ok=True)
    # started outside the workspace: the project's code resolves as it does for the `rlhf` command
    with log.open("w") as out:  # this run's, as the stages' logs beside it
        server = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, path], cwd=folder,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    _pid_file(path).write_text(str(server.pid))  # a caller waits while this process lives and the path is not there
    try:
        yield path
    finally:
        stop_group(server, [(signal.SIGTERM, 10), (signal.SIGKILL, 5)])  # its own session: it and any fork left
        for made in (Path(path), _pid_file(path)):
            made.unlink(missing_ok=True)
        os.rmdir(folder)


def _pid_file(path: str) -> Path:
    return Path(path).with_name("server.pid")


# ------------------------------------------------------------------ the caller's side: `rlhf stage`

def run_in_server(argv: Sequence[str]) -> int | None:
    """Run `rlhf <argv>` in the server RLHF_STAGE_SERVER names, with this process's cwd, environment and
    streams; its exit status, or None when there is no server to take it (the caller runs it itself)."""
    path = os.environ.get(SERVER_ENV)
    if not path or os.environ.get(SERVED_ENV) == str(os.getpid()):  # no server, or this is the served process
        return None
    _wait_while_starting(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        request = json.dumps({"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        socket.send_fds(conn, [HEADER.pack(len(request)) + request], [0, 1, 2])
        accepted = conn.recv(1)
    except OSError:
        accepted = b""
    if accepted != ACCEPTED:  # refused (a thread, changed code) or gone: nothing ran
        conn.close()
        return None
    previous = {sig: signal.signal(sig, lambda signum, frame: conn.sendall(bytes([signum]))) for sig in FORWARDED}
    try:
        reply = b""
        while chunk := conn.recv(64):
            reply += chunk
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        conn.close()
    return int(json.loads(reply)["exit"]) if reply else 1  # no reply: the supervisor died with the server


def _wait_while_starting(path: str) -> None:
    """Wait while the server is still importing (its socket not there yet, its process alive): a stage run beside
    it as a plain process spends ~5-8 s of CPU importing the same libraries on the same cores, and the server is
    ready about as soon. Returns at once where no server is starting (none started, or it died)."""
    deadline = time.monotonic() + STARTING_S
    while not os.path.exists(path) and time.monotonic() < deadline and _starting(_pid_file(path)):
        time.sleep(0.1)


def _starting(pid_file: Path) -> bool:
    """Whether the server process `pid_file` names lives (Linux, where a flow starts one): a server that died while
    importing stays a zombie until the flow reaps it at the run's end."""
    try:
        return Path(f"/proc/{int(pid_file.read_text())}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, ValueError):
        return False
