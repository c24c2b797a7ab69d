"""The warm stage server (cli/stage_server.py, started and called by tasks/execution/stage_server.py): a stage it
runs writes the same bytes and ends with the same status and output as a plain `rlhf stage`; the caller's signals
reach the stage, and a caller killed with -9 takes its stage down; a caller that finds no server runs the stage
itself, and a server whose code changed on disk refuses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_pipeline import TINY

from cli.stage_server import _changed
from tasks.execution.stage_server import SERVER_ENV, serving_stages

RLHF = str(Path(sys.executable).parent / "rlhf")
REPO = Path(__file__).resolve().parent.parent
SETS = [x for item in TINY for x in ("--set", item)]


def wait_until(condition, what: str, bound_s: float = 300) -> None:
    """A bound on waiting for `condition`, not a timing assertion."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "stage_server.log"
    with serving_stages(log) as path:
        wait_until(lambda: os.path.exists(path), "the server to import everything")
        yield path, log


def workspace(root: Path) -> Path:
    root.mkdir()
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    return root


def stage(root: Path, name: str, *args: str, server: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLHF_TRACKING": "off", SERVER_ENV: server or ""}  # none: a plain process
    return subprocess.run([RLHF, "stage", name, *SETS, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)


def ran_in_server(log: Path, root: Path, name: str) -> list[str]:
    """The server's notes of `rlhf stage NAME` run in `root`: its start and its exit."""
    lines = log.read_text().splitlines()
    pids = [line.rsplit("pid ", 1)[1] for line in lines if f"rlhf stage {name} " in line and f"in {root}:" in line]
    return [line for line in lines if any(line.endswith(f"pid {pid}") or f"pid {pid} exited" in line for pid in pids)]


def test_a_stage_in_the_server_writes_the_same_bytes_and_says_the_same(server, tmp_path):
    path, log = server
    plain, warm = workspace(tmp_path / "plain"), workspace(tmp_path / "warm")
    for name in ("prepare", "sft"):
        alone, served = stage(plain, name), stage(warm, name, server=path)
        assert alone.returncode == served.returncode == 0, alone.stderr[-2000:] + served.stderr[-2000:]
        outputs = (json.loads(p.stdout[p.stdout.index("{"):]) for p in (alone, served))  # through the passed stdout
        assert [sorted(o) for o in outputs] == [sorted(json.loads(alone.stdout[alone.stdout.index("{"):]))] * 2
        assert [line.split(": ", 1)[1] for line in ran_in_server(log, warm, name)][-1].endswith("exited 0")
    for relative in ("data/sft_train.jsonl", "data/prompts_eval.jsonl", "models/sft/model.safetensors"):
        assert (plain / relative).read_bytes() == (warm / relative).read_bytes(), relative


@pytest.mark.slow
def test_a_launched_stages_ranks_run_in_the_server_too(server, tmp_path):
    """`rlhf stage sft --profile cpu-ddp`: the server runs the stage, its torchrun starts 2 ranks, and each rank's
    `rlhf stage` hands itself to the server in turn (no rank imports torch again); the model is the bytes of the
    same launch without a server."""
    path, log = server
    plain, warm = workspace(tmp_path / "plain"), workspace(tmp_path / "warm")
    for root in (plain, warm):
        shutil.copytree(REPO / "profiles", root / "profiles")
        assert stage(root, "prepare").returncode == 0
    alone, served = (stage(plain, "sft", "--profile", "cpu-ddp"),
                     stage(warm, "sft", "--profile", "cpu-ddp", server=path))
    assert alone.returncode == served.returncode == 0, alone.stderr[-2000:] + served.stderr[-2000:]
    started = [line.split(": ", 1)[1] for line in log.read_text().splitlines() if f" in {warm}: pid " in line]
    ranks = sorted(note.split(" in ")[0].rsplit(" ", 2)[-2:][1] for note in started if " rank " in note)
    assert ranks == ["0", "1"] and len(started) == 3, started  # the stage, then its two ranks
    metrics = json.loads(served.stdout[served.stdout.index("{"):])
    assert metrics["num_processes"] == 2, metrics
    model = "models/sft/model.safetensors"
    assert (plain / model).read_bytes() == (warm / model).read_bytes()


def test_the_exit_status_and_the_message_come_back(server, tmp_path):
    path, log = server
    root = workspace(tmp_path / "ws")
    bad = stage(root, "prepare", "--set", "prepare.bogus=1", server=path)
    assert bad.returncode == 2 and "prepare.bogus: unknown key" in bad.stderr, bad.stderr
    assert ran_in_server(log, root, "prepare")[-1].endswith("exited 2")


@pytest.mark.parametrize("how", ["sigint", "sigterm", "kill-9"])
def test_the_callers_signal_or_death_stops_the_stage(server, tmp_path, how):
    """The signals the flow stops a stage with (SIGINT, then SIGTERM) reach the stage as they reach a plain one:
    SIGINT stops it as interrupted (exit 130), SIGTERM ends it (143); a caller killed with -9 leaves no stage
    running."""
    path, log = server
    root = workspace(tmp_path / "ws")
    assert stage(root, "prepare").returncode == 0
    env = {**os.environ, "RLHF_TRACKING": "off", SERVER_ENV: path}
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        caller = subprocess.Popen([RLHF, "stage", "sft", *SETS, "--set", "sft.epochs=500"], cwd=root, env=env,
                                  stdout=stdout, stderr=stderr)
    # its first epochs' progress, written by the stage through the streams the caller passed
    wait_until(lambda: "sft: epoch" in out.read_text() + err.read_text() or caller.poll() is not None,
               "sft to train in the server")
    [started, *_] = ran_in_server(log, root, "sft")
    pid = int(started.rsplit("pid ", 1)[1])
    caller.send_signal({"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "kill-9": signal.SIGKILL}[how])
    caller.wait(timeout=120)
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z",
               "the stage to stop", bound_s=120)
    stderr = err.read_text()
    if how == "sigint":
        assert caller.returncode == 130 and "stage sft: interrupted" in stderr, stderr[-2000:]
    elif how == "sigterm":
        assert caller.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert not (root / "models" / "sft" / "model.safetensors").exists(), "stopped before its end"


def test_without_a_server_the_caller_runs_the_stage_itself(tmp_path):
    root = workspace(tmp_path / "ws")
    proc = stage(root, "prepare", server=str(tmp_path / "no-such-socket"))
    assert proc.returncode == 0 and (root / "data" / "sft_train.jsonl").is_file(), proc.stderr[-2000:]


@pytest.mark.slow
def test_a_stage_called_while_the_server_imports_waits_for_it(tmp_path):
    """The first stages of a run are called while the server still imports (~5 s quiet, ~40 s on busy cores): each
    waits and is served, rather than import the same libraries again on the same cores as a plain process."""
    root = workspace(tmp_path / "early")
    with serving_stages(tmp_path / "stage_server.log") as path:
        assert not os.path.exists(path), "the server is still importing"
        proc = stage(root, "prepare", server=path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert ran_in_server(tmp_path / "stage_server.log", root, "prepare"), (tmp_path / "stage_server.log").read_text()


def test_a_server_that_died_while_importing_is_not_waited_for(tmp_path):
    """A server gone before it was ready (here killed; it stays a zombie until the flow reaps it at the run's end):
    the caller runs the stage itself at once."""
    root = workspace(tmp_path / "orphan")
    with serving_stages(tmp_path / "stage_server.log") as path:
        os.killpg(int(Path(path).with_name("server.pid").read_text()), signal.SIGKILL)
        env = {**os.environ, "RLHF_TRACKING": "off", SERVER_ENV: path}
        # the bound is below how long a caller waits for a live server: a caller waiting on the dead one fails it
        proc = subprocess.run([RLHF, "stage", "prepare", *SETS], cwd=root, env=env, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 0 and (root / "data" / "sft_train.jsonl").is_file(), proc.stderr[-2000:]
    assert not ran_in_server(tmp_path / "stage_server.log", root, "prepare")


def test_a_server_whose_code_changed_refuses(tmp_path):
    """A stage must run the code DVC hashed: one edited source file and the server runs nothing more."""
    source = tmp_path / "module.py"
    source.write_text("x = 1\n")
    imported = {str(source): source.stat().st_mtime}
    assert not _changed(imported)
    os.utime(source, (source.stat().st_atime, source.stat().st_mtime + 1))
    assert _changed(imported)
    source.unlink()
    assert _changed(imported), "a file gone is a change"


def test_a_caller_hands_its_stage_over_before_importing_the_heavy_libraries(server, tmp_path):
    """What `rlhf stage` costs when a server runs it: the caller hands itself over having imported neither torch,
    transformers nor MLflow (the command line's own modules only: ~0.2 s of CPU where importing transformers
    alone took 0.5 s)."""
    path, log = server
    root = workspace(tmp_path / "handed")
    env = {**os.environ, "RLHF_TRACKING": "off", SERVER_ENV: path}
    proc = subprocess.run([sys.executable, "-X", "importtime", RLHF, "stage", "prepare", *SETS], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ran_in_server(log, root, "prepare"), log.read_text()[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "cli.main" in imported, "the caller's own imports are listed"
    assert not {"torch", "transformers", "mlflow"} & imported, sorted(imported & {"torch", "transformers", "mlflow"})
