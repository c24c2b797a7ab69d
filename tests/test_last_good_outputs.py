"""A stage that crashes or is stopped mid-run leaves its outputs as they were before the run (#41 item 2).

DVC deletes a stage's outputs before it runs the stage. Through flows/dvc_repro.py (what every Prefect run of a
stage goes through) a stage that does not succeed gets its last good outputs back: the cached ones from DVC's
cache (`dvc checkout`), the `cache: false` (metrics) and `persist` ones from a copy. Here a real DVC stage in a
fresh git + DVC repo writes a cached directory, a git-tracked metrics file and a persisted file it appends to; it first succeeds, then reruns for a new param and
is stopped half-way through writing: by a crash, by Ctrl-C (stop_stages: SIGINT to the stage's process group, what
the flow does on Ctrl-C and on a Prefect UI cancel) or by SIGTERM to the group.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from test_flow import git_dvc_repo, sh

from flows import dvc_repro
from flows.dvc_repro import repro_stage, stage_env

STAGE = """import json, sys, time
from pathlib import Path
import yaml

params = yaml.safe_load(open("params.yaml"))["base"]
with open("ledger.txt", "a") as ledger:  # a persisted output (as register.json): DVC leaves it to the stage
    ledger.write(f"seed {params['seed']} started\\n")
Path("model").mkdir(exist_ok=True)
Path("model/weights.txt").write_text(f"half-written by seed {params['seed']}")  # the run's first writes...
Path("metrics").mkdir(exist_ok=True)
Path("metrics/make.json").write_text(json.dumps({"partial": True}))
if params["mode"] == "crash":
    raise RuntimeError("the stage crashed half-way")
if params["mode"] == "hang":
    print("stage half-way", flush=True)
    time.sleep(600)
Path("model/weights.txt").write_text(f"good, seed {params['seed']}")  # ...and its last ones
Path("model/config.txt").write_text("config")
Path("metrics/make.json").write_text(json.dumps({"seed": params["seed"]}))
with open("ledger.txt", "a") as ledger:
    ledger.write(f"seed {params['seed']} done\\n")
"""


@pytest.fixture
def stage_repo(tmp_path):
    stages = {"make": {"cmd": "python make.py", "deps": ["make.py"], "params": ["base.seed", "base.mode"],
                       "outs": ["model", {"ledger.txt": {"persist": True}}], "metrics": [{"metrics/make.json": {"cache": False}}]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (tmp_path / "params.yaml").write_text("base:\n  seed: 0\n  mode: ok\n")
    (tmp_path / "make.py").write_text(STAGE)
    (tmp_path / ".gitignore").write_text("logs/\n")  # the relayed logs of the stage
    return git_dvc_repo(tmp_path)


def _outputs(root: Path) -> dict[str, str]:
    files = [*sorted((root / "model").rglob("*")), root / "metrics" / "make.json", root / "ledger.txt"]
    return {str(p.relative_to(root)): p.read_text() for p in files if p.is_file()}


def _set(root: Path, seed: int, mode: str) -> None:
    (root / "params.yaml").write_text(f"base:\n  seed: {seed}\n  mode: {mode}\n")


def _stop_when_half_way(root: Path, how: str) -> threading.Thread:
    """Once the stage has written its first outputs: Ctrl-C as the flow relays it, or SIGTERM to the group."""
    def stop():
        log, give_up = root / "logs" / "make.log", time.monotonic() + 120
        while not (log.is_file() and "stage half-way" in log.read_text()):
            assert time.monotonic() < give_up, "the stage never got half-way"
            time.sleep(0.05)
        if how == "ctrl-c":
            dvc_repro.stop_stages()  # SIGINT to the stage's group, SIGTERM and SIGKILL after its grace
        else:
            for proc in list(dvc_repro.RUNNING):
                os.killpg(proc.pid, signal.SIGTERM)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["crash", "ctrl-c", "sigterm"])
def test_a_stage_that_does_not_finish_leaves_its_last_good_outputs(stage_repo, how):
    root, env = stage_repo, stage_env({}, terminal=False)
    first = repro_stage(root, "make", root / "logs" / "make.log", env)
    assert first.returncode == 0, first.log.read_text()
    sh("git", "add", "-A", cwd=root)
    sh("git", "commit", "-qm", "a good run", cwd=root)
    good = _outputs(root)
    assert good == {"model/config.txt": "config", "model/weights.txt": "good, seed 0",
                    "metrics/make.json": json.dumps({"seed": 0}), "ledger.txt": "seed 0 started\nseed 0 done\n"}

    _set(root, 1, "crash" if how == "crash" else "hang")
    stopper = None if how == "crash" else _stop_when_half_way(root, how)
    failed = repro_stage(root, "make", root / "logs" / "make.log", env)
    if stopper is not None:
        stopper.join()
    log = failed.log.read_text()
    assert failed.returncode != 0, log
    assert "half-way" in log, log  # stopped where it should have been
    assert _outputs(root) == good, "the workspace's outputs are the last good run's, not half-written or gone"
    assert "outputs of the last good run (dvc.lock) are back" in log, log
    assert not sh("git", "status", "--porcelain", cwd=root).replace(" M params.yaml\n", ""), "git sees no change"

    _set(root, 0, "ok")  # back to the params of the good run: nothing to do, the workspace is what dvc.lock says
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=root)
