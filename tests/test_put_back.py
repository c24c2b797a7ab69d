"""The put-back (tasks/execution/put_back.py): a stage that does not finish leaves its outputs as its last good run
(dvc.lock) left them, byte for byte, whichever way it was run; a first run leaves nothing half-written; a stop never
cuts a put-back halfway.

A real DVC stage in a fresh git + DVC repo runs through the runner (`tasks.runner.run_stage`, what `rlhf stage`
runs; its stage module is a small one registered beside the pipeline's): a cached directory, a cached file (1 GiB
in the last test), a persisted file it appends to (as register.json) and a git-tracked `cache: false` metrics file.
It first succeeds, then reruns for a new knob and is stopped half-way through its writes: by a crash, Ctrl-C or
SIGTERM, under the flow's wrapper (flows/dvc_repro.py), plain `dvc repro` and `dvc exp run`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from flows import dvc_repro
from flows.dvc_repro import repro_stage, stage_env
from tasks.execution.launcher import stop_group
from tasks.execution.put_back import in_progress

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.usefixtures("ctrl_c_reaches_children")
GIVE_UP_S = 300  # a bound on waiting for the stage to get half-way, not a timing assertion

STAGE = '''"""A stage as the pipeline's are: run(params, paths) -> metrics, its knobs in knobs.yaml."""
import json, os, time
import yaml


def run(params, paths):
    knobs = yaml.safe_load((paths.root / "knobs.yaml").read_text())
    seed, mode, size = knobs["seed"], knobs["mode"], knobs["size"]
    with open(paths.root / "ledger.txt", "a") as ledger:  # a persisted output (as register.json): left to the stage
        ledger.write(f"seed {seed} started\\n")
    (paths.root / "model").mkdir(exist_ok=True)
    (paths.root / "model" / "weights.txt").write_text(f"half-written by seed {seed}")  # the run's first writes...
    (paths.root / "metrics").mkdir(exist_ok=True)
    (paths.root / "metrics" / "make.json").write_text(json.dumps({"partial": True}))
    with open(paths.root / "big.bin", "wb") as big:
        big.write(f"seed {seed}, half-written".encode())
    if mode == "crash":
        raise RuntimeError("the stage crashed half-way")
    if mode == "hang":
        print(f"stage half-way, pid {os.getpid()}", flush=True)
        time.sleep(600)
    with open(paths.root / "big.bin", "wb") as big:  # ...and its last ones
        big.write(f"seed {seed}, good".encode())
        big.truncate(size)  # sparse: quick to write, but a put-back copies every byte
    (paths.root / "model" / "weights.txt").write_text(f"good, seed {seed}")
    (paths.root / "model" / "config.txt").write_text("config")
    (paths.root / "metrics" / "make.json").write_text(json.dumps({"seed": seed}))
    with open(paths.root / "ledger.txt", "a") as ledger:
        ledger.write(f"seed {seed} done\\n")
    return {"seed": seed}
'''

COMMAND = '''import sys
sys.path.insert(0, ".")
from tasks.dag.stage_modules import STAGES
STAGES["make"] = "make_stage"  # beside the pipeline's stages, run as they are
from tasks.runner import run_stage
run_stage("make", ".")
'''

OUTPUTS = ("model/weights.txt", "model/config.txt", "big.bin", "metrics/make.json", "ledger.txt")


def sh(*args: str, cwd: Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env=env or _env(), capture_output=True, text=True)
    assert not check or done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLHF_", "MLFLOW_TRACKING"))}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}", "DVC_NO_ANALYTICS": "1", "RLHF_TRACKING": "off",
            "PYTHONUNBUFFERED": "1"}


def _knobs(root: Path, seed: int, mode: str, size: int = 1 << 10) -> None:
    (root / "knobs.yaml").write_text(f"seed: {seed}\nmode: {mode}\nsize: {size}\n")


def _digests(root: Path) -> dict[str, str]:
    """md5 of each output file there is (a 1 GiB file is not held in memory)."""
    found = {}
    for name in OUTPUTS:
        path = root / name
        if path.is_file():
            digest = hashlib.md5()
            with path.open("rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
            found[name] = digest.hexdigest()
    return found


@pytest.fixture(scope="module")
def fresh_repo(tmp_path_factory) -> Path:
    """A git + DVC repo with the stage, before any run (a template: each test works on a copy)."""
    root = tmp_path_factory.mktemp("fresh")
    shutil.copy(Path(__file__).resolve().parent.parent / "params.yaml", root / "params.yaml")
    stages = {"make": {"cmd": "python make.py", "deps": ["make.py", "make_stage.py"], "params": [{"knobs.yaml": None}],
                       "outs": ["model", "big.bin", {"ledger.txt": {"persist": True}}],
                       "metrics": [{"metrics/make.json": {"cache": False}}]}}
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (root / "make.py").write_text(COMMAND)
    (root / "make_stage.py").write_text(STAGE)
    (root / ".gitignore").write_text("logs/\nreports/\n__pycache__/\n")  # relayed logs, the runner's execution figures
    _knobs(root, 0, "ok")
    sh("git", "init", "-q", cwd=root)
    sh("dvc", "init", "-q", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh("git", "commit", "-qm", "init", cwd=root)
    return root


@pytest.fixture(scope="module")
def good_repo(fresh_repo, tmp_path_factory) -> Path:
    """The template after a good run of seed 0, committed."""
    root = tmp_path_factory.mktemp("good") / "repo"
    shutil.copytree(fresh_repo, root, symlinks=True)
    sh("dvc", "repro", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh("git", "commit", "-qm", "a good run", cwd=root)
    return root


@pytest.fixture
def repo(good_repo, tmp_path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(good_repo, root, symlinks=True)
    return root


def _good(root: Path) -> dict[str, str]:
    """The outputs as dvc.lock records them (the metrics file's md5 included), and the persisted ledger's."""
    lock = {out["path"]: out["md5"] for out in yaml.safe_load((root / "dvc.lock").read_text())["stages"]["make"]["outs"]}
    found = _digests(root)
    assert found["big.bin"] == lock["big.bin"] and found["metrics/make.json"] == lock["metrics/make.json"]
    assert (root / "ledger.txt").read_text() == "seed 0 started\nseed 0 done\n"
    assert (root / "model" / "weights.txt").read_text() == "good, seed 0"
    return found


def _as_before(root: Path, good: dict[str, str], log: str) -> None:
    now = _digests(root)
    changed = {name: (good.get(name), now.get(name)) for name in {*good, *now} if good.get(name) != now.get(name)}
    assert not changed, f"outputs not as the last good run left them (name: (good md5, now md5)): {changed}\n{log}"
    status = sh("git", "status", "--porcelain", cwd=root).stdout.replace(" M knobs.yaml\n", "")
    assert not status, f"git sees changes besides knobs.yaml:\n{status}"
    (root / "knobs.yaml").write_text(sh("git", "show", "HEAD:knobs.yaml", cwd=root).stdout)  # the good run's
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=root).stdout, "dvc.lock and the workspace differ"


def _nothing_half_written(root: Path, log: str) -> None:
    left = sorted(str(p.relative_to(root)) for name in ("model", "big.bin", "ledger.txt", "metrics")
                  for p in [root / name, *(root / name).rglob("*")] if p.exists() and not p.is_dir())
    assert not left, f"a first run that did not finish left outputs behind: {left}\n{log}"
    beside = [p.name for p in root.iterdir() if p.name.startswith((".model.", ".big.bin.", ".ledger.txt."))]
    assert not beside, f"temporary files left beside the outputs: {beside}"


def _when_half_way(output: Path, then) -> threading.Thread:
    """Call then(pid of the stage) once the stage printed that it is half-way (in `output`)."""
    def watch():
        give_up = time.monotonic() + GIVE_UP_S
        while "stage half-way" not in (text := output.read_text() if output.is_file() else ""):
            assert time.monotonic() < give_up, f"the stage never got half-way:\n{text}"
            time.sleep(0.05)
        then(int(text.split("stage half-way, pid ")[1].split()[0]))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _plain(root: Path, *command: str, stop=None) -> tuple[int, str]:
    """`dvc ...` in its own session as a terminal runs it; stop(process) once the stage is half-way."""
    log = root / "logs" / "plain.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(["dvc", *command], cwd=root, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        watcher = _when_half_way(log, lambda pid: stop(proc)) if stop else None
        proc.wait(timeout=GIVE_UP_S)
    if watcher:
        watcher.join()
    return proc.returncode, log.read_text()


# ---------------------------------------------------------------- the flow's wrapper (rlhf run, the Prefect UI)

@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_the_flows_stage_that_does_not_finish_leaves_its_last_good_outputs(repo, how):
    good = _good(repo)
    _knobs(repo, 1, "crash" if how == "crash" else "hang")
    log = repo / "logs" / "make.log"
    stopper = None
    if how == "ctrl-c":  # SIGINT to the stage's group, SIGTERM and SIGKILL after its grace: what Ctrl-C and a cancel do
        stopper = _when_half_way(log, lambda pid: dvc_repro.stop_stages())
    elif how == "sigterm":
        stopper = _when_half_way(log, lambda pid: [os.killpg(p.pid, signal.SIGTERM) for p in list(dvc_repro.RUNNING)])
    failed = repro_stage(repo, "make", log, stage_env({"RLHF_TRACKING": "off"}, terminal=False))
    if stopper:
        stopper.join()
    text = log.read_text()
    assert failed.returncode != 0 and "half-way" in text, text
    assert "put-back: stage make did not finish: its outputs of the last good run (dvc.lock) are back" in text, text
    _as_before(repo, good, text)


def test_a_stage_killed_outright_under_the_flow_is_put_back_by_the_flow(fresh_repo, tmp_path):
    """kill -9 (the OOM killer) of a first run's stage process: it cannot act; the flow's wrapper finishes for it."""
    root = tmp_path / "repo"
    shutil.copytree(fresh_repo, root, symlinks=True)
    _knobs(root, 0, "hang")
    log = root / "logs" / "make.log"
    killer = _when_half_way(log, lambda pid: os.kill(pid, signal.SIGKILL))
    failed = repro_stage(root, "make", log, stage_env({"RLHF_TRACKING": "off"}, terminal=False))
    killer.join()
    text = log.read_text()
    assert failed.returncode != 0, text
    assert "dvc_repro: put back the outputs of make, whose process was killed" in text, text
    _nothing_half_written(root, text)


# ---------------------------------------------------------------- plain `dvc repro` and `dvc exp run`

@pytest.mark.parametrize("how", ["crash", "ctrl-c"])
def test_plain_dvc_repro_that_does_not_finish_leaves_the_last_good_outputs(repo, how):
    good = _good(repo)
    _knobs(repo, 1, "crash" if how == "crash" else "hang")
    # Ctrl-C on a terminal: SIGINT to the foreground group, DVC and the stage (DVC ignores it while its command runs)
    code, log = _plain(repo, "repro", stop=None if how == "crash" else lambda proc: os.killpg(proc.pid, signal.SIGINT))
    assert code != 0 and "half-way" in log, log
    assert "put-back: stage make did not finish: its outputs of the last good run (dvc.lock) are back" in log, log
    _as_before(repo, good, log)


def test_dvc_exp_run_that_fails_leaves_the_last_good_outputs(repo):
    good = _good(repo)
    code, log = _plain(repo, "exp", "run", "-S", "knobs.yaml:seed=1", "-S", "knobs.yaml:mode=crash")
    assert code != 0 and "half-way" in log, log
    assert "its outputs of the last good run (dvc.lock) are back" in log, log
    _as_before(repo, good, log)


def test_a_first_run_that_fails_leaves_nothing_half_written(fresh_repo, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(fresh_repo, root, symlinks=True)
    _knobs(root, 0, "crash")
    code, log = _plain(root, "repro")
    assert code != 0 and "half-way" in log, log
    assert "put-back: stage make did not finish: what it had begun of" in log, log
    _nothing_half_written(root, log)


# ---------------------------------------------------------------- a stop during the put-back of 1 GiB

@pytest.mark.slow
def test_a_stop_waits_for_the_put_back_of_a_1_gib_output(fresh_repo, tmp_path):
    """A good run writes a 1 GiB output (DVC caches it); the next is stopped half-way, and while its put-back copies
    the 1 GiB back, the stopper reaches its SIGKILL step: it waits, and the output comes back whole."""
    root = tmp_path / "repo"
    shutil.copytree(fresh_repo, root, symlinks=True)
    _knobs(root, 0, "ok", size=1 << 30)
    sh("dvc", "repro", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh("git", "commit", "-qm", "a good run of 1 GiB", cwd=root)
    good = _digests(root)
    assert (root / "big.bin").stat().st_size == 1 << 30
    _knobs(root, 1, "hang", size=1 << 30)
    log, timings = root / "logs" / "make.log", {}

    def stop(pid):
        stage = next(iter(dvc_repro.RUNNING))
        os.killpg(stage.pid, signal.SIGINT)  # Ctrl-C: the stage starts putting its outputs back
        give_up = time.monotonic() + GIVE_UP_S
        while not in_progress(root):
            assert time.monotonic() < give_up and stage.poll() is None, "the put-back never started"
            time.sleep(0.01)
        timings["put-back started"] = time.monotonic()
        # stop_stages' last steps while it runs: SIGTERM, then SIGKILL, which must wait for the put-back
        stop_group(stage, [(signal.SIGTERM, 0), (signal.SIGKILL, 5)], busy=lambda: in_progress(root))
        timings["group stopped"] = time.monotonic()

    stopper = _when_half_way(log, stop)
    failed = repro_stage(root, "make", log, stage_env({"RLHF_TRACKING": "off"}, terminal=False))
    stopper.join()
    text = log.read_text()
    assert failed.returncode == 1, f"the stage's wrapper ended by {failed.returncode}, not its own exit 1:\n{text}"
    assert "SIGTERM received; stage make's outputs are being put back, which finishes first" in text, text
    assert "put-back: stage make did not finish: its outputs of the last good run (dvc.lock) are back" in text, text
    assert "whose process was killed" not in text, text
    print(f"\n{text.split('put-back: stage make did not finish: ')[1].splitlines()[0]}; the group exited "
          f"{timings['group stopped'] - timings['put-back started']:.1f} s after the put-back began")
    _as_before(root, good, text)


def test_a_stage_refused_before_it_began_gets_its_deleted_outputs_back(repo):
    """`rlhf stage` refusing its parameters under plain `dvc repro` (which deleted the outputs first) puts back those
    that are gone (`put_back_missing`, called by the CLI on a refusal); one that is there, maybe newer from a run by
    hand, is left alone."""
    from tasks.execution.put_back import put_back_missing

    good = _good(repo)
    shutil.rmtree(repo / "model")
    (repo / "big.bin").unlink()
    (repo / "metrics" / "make.json").write_text('{"by hand": true}')
    assert sorted(put_back_missing("make", repo)) == ["big.bin", "model"]
    assert _digests(repo) == {**good, "metrics/make.json": _digests(repo)["metrics/make.json"]}
    assert (repo / "metrics" / "make.json").read_text() == '{"by hand": true}', "an output that is there is left"
    assert put_back_missing("make", repo) == [] and put_back_missing("no-such-stage", repo) == []
