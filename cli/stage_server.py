"""The warm stage server: a process that runs `rlhf stage` commands with torch, transformers, MLflow and the
stages imported (`python -m cli.stage_server SOCKET`, started by tasks/execution/stage_server.py's
`serving_stages`, which also holds the caller's side and the protocol).

It imports the runner, every stage and the `rlhf` command once, then per request forks a supervisor, which forks
the stage: the stage takes the caller's cwd, environment and streams and runs the `rlhf` command with them, and
its exit status goes back to the caller. It runs `rlhf` commands, so it sits with the command line, above
everything it imports.

The caller's signals are forwarded to the stage, and if the caller dies (kill -9) the supervisor stops the stage
(SIGTERM, then SIGKILL after a grace). Forking is safe because the server only imports: it refuses to fork once a
thread runs or its code changed on disk (a stage must run the code DVC hashed), and the caller then runs the
stage itself.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

from tasks.execution.stage_server import ACCEPTED, HEADER, SERVED_ENV

# and the stages (tasks.dag.stage_modules); MLflow's SQL store is imported only when a run opens a sqlite/SQL tracking
# URI, i.e. in every tracked stage of a local run: 1.5-4 s of CPU each (SQLAlchemy, alembic) when left to them
PRELOAD = ("torch", "transformers", "mlflow", "mlflow.store.tracking.sqlalchemy_store", "peft", "tasks.runner")
GRACE_S = 30  # after the caller died: how long the stage gets to stop on SIGTERM before SIGKILL


def serve(path: str) -> None:
    """Import everything a stage needs, then fork a supervised stage per request until the starter exits."""
    starter, start = os.getppid(), time.monotonic()
    sources = _preload()
    _note(f"ready in {time.monotonic() - start:.1f} s: {len(sources)} source files of this project imported")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    os.rename(path + ".binding", path)  # the path appears once the server is ready
    listener.listen(16)
    listener.settimeout(0.5)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    while os.getppid() == starter:
        _reap()
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.setblocking(True)
        why = "a thread runs" if threading.active_count() > 1 else "its code changed on disk" if _changed(sources) else ""
        if why:
            _note(f"refused a stage ({why}): its caller runs it")
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            _supervise(conn)
        conn.close()


def _preload() -> dict[str, float]:
    """Import the stages and what they use; the project's source files imported, with their mtimes."""
    from tasks.dag.stage_modules import STAGES

    for module in (*PRELOAD, *STAGES.values()):
        importlib.import_module(module)
    _rlhf_command()
    roots = [Path(importlib.import_module(p).__file__).parent for p in ("rlhf_core", "tasks", "cli")]
    files = {Path(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    return {str(f): f.stat().st_mtime for f in files if any(r in f.parents for r in roots)}


def _note(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} stage server {os.getpid()}: {line}", file=sys.stderr, flush=True)


def _changed(sources: dict[str, float]) -> bool:
    try:
        return any(os.stat(f).st_mtime != mtime for f, mtime in sources.items())
    except OSError:
        return True


def _reap() -> None:
    """Collect exited supervisors (the server never waits on one)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _rlhf_command():
    """The `rlhf` console script's function: what the caller would have run."""
    [script] = [e for e in entry_points(group="console_scripts") if e.name == "rlhf"]
    return script.load()


def _supervise(conn: socket.socket) -> None:
    """In a fork of the server: start the stage, relay the caller's signals, report its exit status. Never
    returns."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        request, fds = _receive(conn)
        stage = os.fork()
        if stage == 0:
            conn.close()
            _run(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(ACCEPTED)
        argv = request["argv"]
        command = " ".join(["rlhf", *argv[:2]]) + (f" (+{len(argv) - 2} arguments)" if len(argv) > 2 else "")
        if "RANK" in request["env"]:  # a launched stage's rank
            command += f" rank {request['env']['RANK']}"
        _note(f"{command} in {request['cwd']}: pid {stage}")
        status = _wait(conn, stage)
        _note(f"{command}: pid {stage} exited {status}")
        conn.sendall(json.dumps({"exit": status}).encode())
    finally:
        os._exit(0)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    (length,) = HEADER.unpack(data[:HEADER.size])
    data = data[HEADER.size:]
    while len(data) < length:
        chunk = conn.recv(length - len(data))
        if not chunk:
            raise ConnectionError("the caller left before its request was complete")
        data += chunk
    return json.loads(data), fds


def _wait(conn: socket.socket, stage: int) -> int:
    """The stage's exit status as a shell reports it (128 + N for signal N); signals from the caller passed on,
    and the stage stopped if the caller dies."""
    caller_gone_at = None
    while True:
        pid, status = os.waitpid(stage, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code
        if caller_gone_at is None and select.select([conn], [], [], 0.2)[0]:
            signals = conn.recv(64)
            if not signals:  # the caller died (kill -9): stop what it started
                caller_gone_at = time.monotonic()
                signals = bytes([signal.SIGTERM])
            for signum in signals:
                _kill(stage, signum)
        elif caller_gone_at is not None:
            if time.monotonic() - caller_gone_at > GRACE_S:
                _kill(stage, signal.SIGKILL)
            time.sleep(0.2)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _run(request: dict, fds: list[int]) -> None:
    """In the stage's fork: become the caller (streams, cwd, environment, arguments) and run its command."""
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[SERVED_ENV] = str(os.getpid())  # `rlhf stage` here runs it (its launched ranks hand on again)
    sys.argv = ["rlhf", *request["argv"]]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    sys.stdin, sys.stdout, sys.stderr = (_text_stream(0, "r"), _text_stream(1, "w"), _text_stream(2, "w"))
    code = 0
    try:
        _rlhf_command()()  # reads sys.argv, as the script does
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # what the interpreter would print before exiting 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
    os._exit(code)


def _text_stream(fd: int, mode: str) -> io.TextIOWrapper:
    """A standard stream over `fd` as the interpreter makes one (line-buffered on a terminal, unbuffered with
    PYTHONUNBUFFERED)."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors="strict")
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", line_buffering=os.isatty(fd),
                            write_through=unbuffered, errors="backslashreplace" if fd == 2 else "strict")


if __name__ == "__main__":
    serve(sys.argv[1])
