"""Shared fixtures: a tiny word-level world where learning is fast and measurable."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rlhf_core.bench import word_tokenizer  # noqa: E402
from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config  # noqa: E402
from rlhf_core.threads import fit_threads, share_cores_with  # noqa: E402


def pytest_configure(config):
    """Each pytest-xdist worker, and every stage process its tests start, takes its share of the cores: two
    workers at torch's default thread count ran together at x0.57 of one (rlhf_core/threads.py)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and os.environ.get("PYTEST_XDIST_WORKER"):
        share_cores_with(int(workers))
    else:
        fit_threads()


@pytest.hookimpl(trylast=True)  # after `-m` deselected: each tier weighs a file by its own tests
def pytest_collection_modifyitems(config, items):
    """The slowest files first (tests/durations.json, tests/file_durations.py): `make test` hands each worker
    whole files in this order (`--dist loadfile --no-loadscope-reorder`), so the last files to start are short
    ones and both workers finish near together. The order within a file stays as written."""
    from file_durations import file_seconds, load

    seconds = file_seconds((item.nodeid for item in items), load())
    items.sort(key=lambda item: -seconds[item.nodeid.split("::")[0]])


TINY_VOCAB = 16
TARGET_WORD = "w7"


@pytest.fixture
def ctrl_c_reaches_children():
    """A shell's background job (`make test &`) starts with SIGINT ignored, and its children inherit that: a test
    that sends Ctrl-C to the processes it starts needs them to see it as a terminal's foreground job does (a
    handled signal is reset to its default in a child; an ignored one stays ignored)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        yield
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    """accelerate keeps one state per process (precision, device): each test starts without one, so a bf16
    stage run in process never leaks its precision into the next test's trainer."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def tokenizer():
    return word_tokenizer(TINY_VOCAB)


@pytest.fixture(scope="session")
def tiny_config():
    return tiny_gpt_neox_config(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2, num_heads=2,
                                intermediate_size=64, max_positions=64)


@pytest.fixture
def make_policy(tiny_config):
    return lambda seed=0: init_causal_lm(tiny_config, seed=seed)


@pytest.fixture
def make_scorer_model(tiny_config):
    return lambda seed=1: init_sequence_scorer(tiny_config, seed=seed)


@pytest.fixture(scope="session")
def prompts():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 7, (64,), generator=generator).tolist()
    return [torch.randint(2, TINY_VOCAB, (n,), generator=generator).tolist() for n in lengths]


def world_tokenizer(world: dict[str, list[dict]]):
    """A tokenizer trained on every text of a built world (what `prepare` trains, on all splits)."""
    from rlhf_core.world.tokenizer import train_tokenizer

    return train_tokenizer(text for rows in world.values() for row in rows for text in row.values())


def target_fraction(prompts: list[str], completions: list[str]) -> list[float]:
    """A learnable reward: the fraction of the completion's words that are the target word."""
    return [c.split().count(TARGET_WORD) / max(len(c.split()), 1) for c in completions]


@pytest.fixture(scope="session", autouse=True)
def _warm_stage_server(tmp_path_factory):
    """Every `rlhf stage` a test starts as a process runs in this worker's warm stage server, as a flow's stages
    do (tasks/execution/stage_server.py): ~5 s of imports saved per stage process, ~100 of them in `make test`.
    The worker itself is marked as the served process, so a stage it runs in process (CliRunner) stays here.
    Tests of the plain process (kill -9, process groups) take `plain_stages`; a stage started before the server
    is ready runs plain. A pytest that a test starts (the GPU check's dry run) uses its caller's server."""
    from contextlib import nullcontext

    from tasks.execution.stage_server import SERVED_ENV, SERVER_ENV, serving_stages

    inherited = os.environ.get(SERVER_ENV, "")
    warm = nullcontext(inherited) if os.path.exists(inherited) else serving_stages(
        tmp_path_factory.mktemp("stage-server") / "stage_server.log")
    with warm as path:
        mp = pytest.MonkeyPatch()
        if path:
            mp.setenv(SERVER_ENV, path)
            mp.setenv(SERVED_ENV, str(os.getpid()))
        yield path
        mp.undo()


@pytest.fixture
def plain_stages(monkeypatch):
    """`rlhf stage` processes of this test run themselves, not in the warm stage server."""
    from tasks.execution.stage_server import SERVER_ENV

    monkeypatch.delenv(SERVER_ENV, raising=False)


@pytest.fixture(scope="session")
def mlflow_db_template(tmp_path_factory):
    """An empty MLflow sqlite store, created once: its migrations take ~10 s, a copy takes none."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_root(tmp_path, monkeypatch, mlflow_db_template):
    """A workspace with its own local MLflow store (a copy of the template), tracking on."""
    import shutil

    shutil.copy(mlflow_db_template, tmp_path / "mlflow.db")
    for var in ("MLFLOW_TRACKING_URI", "RLHF_TRACKING", "RLHF_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return tmp_path


@pytest.fixture
def workspace(mlflow_root, monkeypatch):
    """A pipeline workspace (the repo's params.yaml) as the working directory, tracking into its own store."""
    import shutil
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    shutil.copy(repo / "params.yaml", mlflow_root / "params.yaml")
    # the accelerate configs, as in a checkout: a run's overrides name them inside the workspace (trust.roots)
    shutil.copytree(repo / "infra" / "accelerate", mlflow_root / "infra" / "accelerate")
    monkeypatch.chdir(mlflow_root)
    return mlflow_root
