"""`rlhf models promote` cut off the moment the first of its registry writes has landed (tests/mlflow_gateway.py):
the registry never shows the champion alias on a version without the record of why (its champion history).

- a real `mlflow server` process killed (SIGKILL) there and restarted within RLHF_MLFLOW_RETRY_S: the promotion
  rides through the restart and completes;
- the server out of reach there for longer than that (the network to it cut): the promotion fails naming what was
  written and what was not, and running it again finishes it, recording nothing twice.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable

import pytest
from mlflow_gateway import Gateway, MlflowServerProcess
from typer.testing import CliRunner

from cli.main import app

REGISTRY_WRITE = ("/registered-models/", "/model-versions/")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, mlflow_db_template):
    root = tmp_path_factory.mktemp("mlflow-process")
    shutil.copy(mlflow_db_template, root / "mlflow.db")
    server = MlflowServerProcess(root / "mlflow.db", root / "artifacts", root / "server.log")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def gateway(mlflow_server, monkeypatch):
    """The CLI talks to the server through the gateway, without MLflow's own retries (what is proven is ours)."""
    gateway = Gateway(mlflow_server.url)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", gateway.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    yield gateway
    gateway.close()


def _two_versions(url: str) -> str:
    """A registered model with versions 1 and 2, version 1 the champion (promoted through the CLI)."""
    from mlflow import MlflowClient

    client, name = MlflowClient(url), f"policy-{time.monotonic_ns()}"
    run = client.create_run(client.create_experiment(name)).info.run_id
    client.create_registered_model(name)
    for _ in range(2):
        client.create_model_version(name, f"runs:/{run}/policy", run_id=run)
    assert _promote(name, "1").exit_code == 0
    return name


def _promote(name: str, version: str):
    return CliRunner().invoke(app, ["models", "promote", version, "--name", name, "--reason", "better"])


def _registry(db, name: str) -> tuple[str | None, dict[int, list[str]]]:
    """The store as it is on disk: the champion alias's version, and each version's history as its events."""
    with sqlite3.connect(db) as con:
        alias = con.execute("SELECT version FROM registered_model_aliases WHERE name = ? AND alias = 'champion'",
                            (name,)).fetchone()
        rows = con.execute("SELECT version, value FROM model_version_tags WHERE name = ? AND key = 'champion_history'",
                           (name,)).fetchall()
    return (str(alias[0]) if alias else None), {v: [e["event"] for e in json.loads(h)] for v, h in rows}


def _after_first_registry_write(cut: Callable[[], None], db, name: str, seen: list) -> Callable:
    """The gateway's hook: once the promotion's first registry write is done, `cut()` the server off and record
    the store as the cut left it."""
    def after(method: str, path: str) -> None:
        if not seen and method != "GET" and any(part in path for part in REGISTRY_WRITE):
            cut()
            seen.append(_registry(db, name))
    return after


def _assert_alias_has_its_record(state: tuple[str | None, dict[int, list[str]]]) -> None:
    alias, histories = state
    assert alias is not None and histories.get(int(alias), [])[-1:] == ["promoted"], \
        f"the champion alias is on v{alias} without the record of its promotion: {histories}"


@pytest.mark.slow
def test_a_promotion_killed_between_its_writes_rides_through_the_restart(mlflow_server, gateway):
    name = _two_versions(mlflow_server.url)
    seen: list = []
    gateway.after = _after_first_registry_write(mlflow_server.kill, mlflow_server.db, name, seen)
    restart = threading.Thread(target=lambda: _wait_then_start(mlflow_server, seen))
    restart.start()
    result = _promote(name, "2")
    restart.join()
    assert seen, "the server was killed mid-promotion"
    _assert_alias_has_its_record(seen[0])  # at the kill: the record is there before any alias moved
    assert result.exit_code == 0, result.output
    assert "champion v1 -> v2" in result.output
    alias, histories = _registry(mlflow_server.db, name)
    assert alias == "2" and histories == {1: ["promoted", "demoted"], 2: ["promoted"]}


def _wait_then_start(server: MlflowServerProcess, killed: list) -> None:
    give_up = time.monotonic() + 300
    while not killed and time.monotonic() < give_up:
        time.sleep(0.05)
    server.start()


def test_a_promotion_whose_server_stays_down_says_what_is_left_and_finishes_when_run_again(
        mlflow_server, gateway, monkeypatch):
    name = _two_versions(mlflow_server.url)
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "2")
    seen: list = []
    gateway.after = _after_first_registry_write(lambda: setattr(gateway, "down", True), mlflow_server.db, name, seen)
    result = _promote(name, "2")
    gateway.down = False  # the server is back
    assert seen and result.exit_code == 1, result.output
    _assert_alias_has_its_record(seen[0])
    message = " ".join(result.output.split())
    assert f"error: promoting {name} v2:" in message and "not written (or not in full):" in message, message
    assert "the alias champion -> v2" in message.split("not written")[1], message
    assert "run the same promotion again" in message, message
    alias, _ = _registry(mlflow_server.db, name)
    assert alias == "1", "the alias stays where it was until its record is written"

    gateway.after = None
    again = _promote(name, "2")
    assert again.exit_code == 0, again.output
    alias, histories = _registry(mlflow_server.db, name)
    assert alias == "2" and histories == {1: ["promoted", "demoted"], 2: ["promoted"]}, "nothing recorded twice"
