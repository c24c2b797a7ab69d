"""What a person sees in the Prefect UI, the MLflow UI and DVC's plots page, in headless Chromium (`make test-ui`).

One workspace for the module, set up as a user would: a clone of this repository on the shrunken demo world, a
Prefect server with its UI, `mlflow ui` on the workspace's store and `rlhf serve`, each on a free loopback port.
First a plain `rlhf run` from the terminal, then a custom run of the `manual` deployment submitted through the
Prefect UI's form with `train.kl_coef=0.3`. That gives two registered versions which differ in that parameter.
The tests then open the pages and check what is rendered (texts, table rows, drawn charts), waiting for each with
a deadline. Each page's screenshot goes to reports/ui/ (a failed test's is saved as NAME-FAILED.png). Waiting for
a run to end or for a log record to arrive is done through the API (the browser is not kept open on a page while
the pipeline runs on the same 2 cores); every assertion is on the page. The cancel test comes last: a cancelled
stage leaves train's outputs removed, as any interrupted DVC stage does.

The browser reaches loopback only: every other host goes through a proxy that does not exist. The plots page is
opened with the network switched off altogether.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from test_dvc import sh
from test_flow import BIN, REPO, STARTUP_S, base_env, free_port, prefect_server, wait_for_deployment
from test_pipeline import TINY

from tasks.parameters.params import deep_merge, parse_override

try:  # the `ui` extra (make test-ui installs it); `make test` deselects this module
    from selenium import webdriver
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        StaleElementReferenceException,
        TimeoutException,
    )
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    webdriver = None

pytestmark = pytest.mark.ui

SHOTS = REPO / "reports" / "ui"
WAIT_S = 60  # a deadline for a page or an element to appear, not a timing assertion
RUN_S = 900  # a deadline for a pipeline run to get somewhere
MODEL = "rlhf-policy"
BASE_KL, CUSTOM_KL = "0.3", "0.15"  # params.yaml's train.kl_coef, and the custom run's override
# The demo world shrunk as tests/test_pipeline.py shrinks it, with 4 RL updates so that the charts draw lines. The
# tiny policy barely moves from SFT (win rate 0.5), so the gate's floor is lowered for a champion to exist.
WORLD = [*TINY, "train.gradient_accumulation_steps=1", "register.min_primary=0.0"]
CACHED = ["prepare", "validate", "sft", "reward-model", "inspect"]  # unchanged by a kl_coef override
RAN = ["train", "evaluate", "register"]
CHARTS = {"Reward over updates", "Response length over updates", "KL over updates"}  # dvc.yaml's Vega plots


@dataclass(frozen=True)
class World:
    root: Path  # the workspace: a clone of this repository
    prefect: str  # the Prefect UI, http://127.0.0.1:<port>
    api: str  # its API, what PREFECT_API_URL says
    mlflow: str  # `mlflow ui` on the workspace's store
    runs_link: str  # the experiment link `rlhf run` printed at its end

    def mlflow_client(self):
        from mlflow import MlflowClient

        uri = f"sqlite:///{self.root / 'mlflow.db'}"
        return MlflowClient(uri, registry_uri=uri)


# ----------------------------------------------------------------------------------------------- servers


def _wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1)


@contextmanager
def _process(command: list, cwd: Path, env: dict, log: Path) -> Iterator[subprocess.Popen]:
    """A server in its own process group, stopped with the group (its workers too) at the end."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@contextmanager
def prefect_client(api: str):
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        yield client


def _workspace(root: Path, mlflow_db_template: Path) -> Path:
    """A clone of this repository with the shrunken world committed as its params.yaml (what the nightly
    deployment would run), and an MLflow store ready (git-ignored; saves its ~10 s of migrations)."""
    ws = root / "workspace"
    sh("git", "clone", "-q", str(REPO), str(ws), cwd=root)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    for item in WORLD:
        params = deep_merge(params, parse_override(item))
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh("git", "commit", "-qam", "the shrunken demo world", cwd=ws)
    shutil.copy(mlflow_db_template, ws / "mlflow.db")
    return ws


@pytest.fixture(scope="module")
def world(tmp_path_factory, mlflow_db_template) -> Iterator[World]:
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    root = tmp_path_factory.mktemp("ui")
    ws = _workspace(root, mlflow_db_template)
    mlflow_port = free_port()
    mlflow = f"http://127.0.0.1:{mlflow_port}"
    with ExitStack() as stack:
        api = stack.enter_context(prefect_server(root, "--no-scheduler", ui=True))
        env = base_env(PREFECT_API_URL=api, PREFECT_HOME=str(ws / ".prefect"), RLHF_MLFLOW_UI=mlflow)
        # the local store's UI, as the docs and the end of `rlhf run` say
        ui = stack.enter_context(_process(
            [BIN / "mlflow", "ui", "--backend-store-uri", f"sqlite:///{ws / 'mlflow.db'}", "--host", "127.0.0.1",
             "--port", str(mlflow_port)], ws, env, root / "mlflow-ui.log"))
        serve = stack.enter_context(_process([BIN / "rlhf", "serve"], ws, env, root / "serve.log"))
        with prefect_client(api):  # wait_for_deployment's client reads the API from the settings
            wait_for_deployment("rlhf-pipeline/manual", serve, root / "serve.log")
            wait_for_deployment("rlhf-pipeline/nightly", serve, root / "serve.log")
        _wait_http(f"{mlflow}/health", ui, root / "mlflow-ui.log")

        # the plain run, from a terminal, reporting to the Prefect server the UI shows
        run = subprocess.run([BIN / "rlhf", "run"], cwd=ws, env={**env, "COLUMNS": "200"}, capture_output=True,
                             text=True, timeout=RUN_S)
        (root / "run1.log").write_text(run.stdout + run.stderr)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        link = re.search(r"^\s*runs:\s+(\S+)$", run.stdout, flags=re.M)
        assert link, f"no experiment link in what `rlhf run` printed:\n{run.stdout[-3000:]}"
        yield World(ws, api.removesuffix("/api"), api, mlflow, link.group(1))


def wait_for_server(what: str, check, seconds: float = RUN_S):
    """Until `check()` is truthy (its value returned): the server has got somewhere (a run ended, a log record
    arrived). Readiness before a page is opened, not an assertion."""
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(2)
    return value


def run_logs(world: World, run_id: str) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with prefect_client(world.api) as client:
        return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))


def run_ended(world: World, run_id: str) -> bool:
    with prefect_client(world.api) as client:
        return client.read_flow_run(run_id).state.is_final()


# ----------------------------------------------------------------------------------------------- the browser


def new_browser(*, offline: bool = False, webgl: bool = True):
    """Headless Chromium as a person's fresh browser: no saved UI choices, English, loopback only. Without
    `webgl`, Prefect's run graph draws on a 2D canvas (it looks the same) instead of keeping a core busy in a
    software GPU while the pipeline runs; MLflow's compare plots need WebGL."""
    assert webdriver is not None, "selenium is not installed: run `make test-ui` (it installs the ui extra)"
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1200",
                "--lang=en-US", *([] if webgl else ["--disable-3d-apis"]),
                "--proxy-server=http://127.0.0.1:9"):  # a closed port: loopback bypasses it, nothing else does
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    if offline:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0})
    return driver


@pytest.fixture
def browser():
    driver = new_browser()
    yield driver
    driver.quit()


@pytest.fixture
def prefect_browser():
    driver = new_browser(webgl=False)
    yield driver
    driver.quit()


def wait(driver, condition, what: str, seconds: float = WAIT_S):
    """Until `condition(driver)` is truthy (its value returned), or fail saying what was awaited."""
    return WebDriverWait(driver, seconds, poll_frequency=0.5).until(condition, message=f"waited {seconds} s for {what}")


def shown(driver, xpath: str, what: str, seconds: float = WAIT_S):
    """The first visible element at `xpath`, once there is one."""
    def find(d):
        return next((e for e in d.find_elements(By.XPATH, xpath) if e.is_displayed()), None)
    return wait(driver, find, what, seconds)


def click(driver, xpath: str, what: str, seconds: float = WAIT_S) -> None:
    """Click the element at `xpath` as a person would, once it is there and nothing covers it. MLflow opens a
    dialog over some pages on a browser's first visit: it is closed, as a person closes it."""
    def attempt(d):
        element = next((e for e in d.find_elements(By.XPATH, xpath) if e.is_displayed()), None)
        if element is None:
            return False
        d.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        try:
            element.click()
            return True
        except StaleElementReferenceException:
            return False
        except ElementClickInterceptedException:
            close_dialogs(d)
            return False
    wait(driver, attempt, what, seconds)


def close_dialogs(driver) -> None:
    """Close the dialogs a page opened on its own (MLflow's 'new model registry UI' news), as a person does."""
    def closed(d):
        buttons = [b for b in d.find_elements(By.XPATH, "//*[@role='dialog']//button[@aria-label='Close']")
                   if b.is_displayed()]
        for button in buttons:
            try:
                button.click()
            except (ElementClickInterceptedException, StaleElementReferenceException):
                pass
        return not buttons
    wait(driver, closed, "the page's dialogs to close")


def choose(driver, current: str, option: str) -> None:
    """Pick `option` in the drop-down whose button reads `current` (e.g. 'Level: All')."""
    click(driver, f"//button[@role='combobox'][starts-with(normalize-space(), {literal(current)})]", current)
    click(driver, f"//*[@role='option'][normalize-space()={literal(option)}]", option)


def text(driver) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def literal(value: str) -> str:
    """`value` as an XPath string literal."""
    return f'"{value}"' if '"' not in value else f"'{value}'"


def exactly(words: str) -> str:
    """XPath of the innermost elements whose whole text (across their children: Vue splits a label into several text
    nodes) is `words`."""
    has = f"normalize-space()={literal(words)}"
    return f"//*[{has}][not(*[{has}])]"


def innermost(words: str) -> str:
    """XPath of the innermost elements whose text (across their children) contains `words`."""
    has = f"contains(normalize-space(), {literal(words)})"
    return f"//*[{has}][not(*[{has}])]"


@contextmanager
def screenshot(driver, name: str, height: int = 1200) -> Iterator[None]:
    """reports/ui/NAME.png of the page as the block's assertions saw it (NAME-FAILED.png when they failed)."""
    driver.set_window_size(1600, height)
    try:
        yield
    except BaseException:
        driver.save_screenshot(str(SHOTS / f"{name}-FAILED.png"))
        raise
    driver.save_screenshot(str(SHOTS / f"{name}.png"))


# ----------------------------------------------------------------------------------------------- Prefect


RUN_TITLE = "//nav[.//a[normalize-space()='Runs']]"  # a flow run page's breadcrumb: Runs > <run name> <tags>


def open_deployments(driver, world: World) -> None:
    """The Prefect UI's home page, then Deployments in its side bar."""
    driver.get(world.prefect)
    click(driver, "//a[normalize-space()='Deployments']", "the Deployments link in the side bar")
    shown(driver, "//tr[.//a[normalize-space()='nightly']]", "the deployments table")


def state_of(driver) -> str | None:
    """The state badge beside the run's name at the top of a flow run's page."""
    titles = [e for e in driver.find_elements(By.XPATH, RUN_TITLE) if e.is_displayed()]
    badges = titles[0].find_elements(By.XPATH, "./following::*[@data-slot='badge']") if titles else []
    return badges[0].text if badges else None


def task_run_states(driver, run_name: str) -> dict[str, str]:
    """{stage: state} from the Task Runs tab's cards ("rlhf-pipeline > <run> > <stage>", then the state)."""
    cards = driver.find_elements(
        By.XPATH, f"//*[@data-slot='card'][.//*[@data-slot='breadcrumb-item'][normalize-space()={literal(run_name)}]]")
    states = {}
    for card in cards:
        lines = card.text.splitlines()
        if len(lines) >= 4 and lines[1] == run_name:
            states[lines[2]] = lines[3]
    return states


def flow_run_ids(world: World) -> set[str]:
    with prefect_client(world.api) as client:
        return {str(run.id) for run in client.read_flow_runs(limit=200)}


def start_custom_run(driver, world: World, override: str, name: str) -> str:
    """Deployments → manual → Run → Custom run, one item added to the form's overrides list, Submit, then the run's
    page (its id from the API: the toast with its 'View run' link is gone after a few seconds, sooner than a loaded
    machine's browser found it). Returns the flow run's id."""
    open_deployments(driver, world)
    click(driver, "//a[normalize-space()='manual']", "the manual deployment")
    click(driver, "//button[normalize-space()='Run']", "the Run button")
    click(driver, "//*[@role='menuitem'][normalize-space()='Custom run']", "Custom run in the Run menu")
    click(driver, "//button[normalize-space()='Add item']", "Add item under overrides")
    field = shown(driver, "//*[normalize-space(text())='overrides (Optional)']/following::textarea[1]",
                  "the new item of the overrides list")
    field.send_keys(override)
    with screenshot(driver, name):
        assert field.get_attribute("value") == override
        # the parameters' help as the flow's docstring gives it, read as text (Markdown's backticks showed as such)
        help_lines = [line for line in text(driver).splitlines() if "profiles/NAME.yaml" in line or "e.g." in line]
        assert help_lines and not any("`" in line for line in help_lines), help_lines
    known = flow_run_ids(world)
    click(driver, "//button[normalize-space()='Submit']", "Submit")
    run_id = wait_for_server("the submitted run", lambda: next(iter(flow_run_ids(world) - known), None), WAIT_S)
    driver.get(run_page(world, run_id))
    return run_id


def run_page(world: World, run_id: str, tab: str = "Logs") -> str:
    return f"{world.prefect}/v2/runs/flow-run/{run_id}?tab={tab}"


def v1_page(world: World, kind: str, run_id: str) -> str:
    """A run's page in Prefect's V1 UI: where the "View at" link Prefect prints for a run leads (a browser with no
    saved choice gets V2 only at the UI's root), and where `rlhf run`'s summary points."""
    return f"{world.prefect}/runs/{kind}/{run_id}"


def artifact_cards(driver) -> dict[str, str]:
    """{key: description} of the cards on a flow run's Artifacts tab (V2: its grid; each card reads type, key, date,
    "Created", then the description, on one line however long)."""
    cards = {}
    for card in driver.find_elements(By.XPATH, "//*[@data-testid='flow-run-artifacts-grid']/*"):
        lines = card.get_attribute("innerText").splitlines()
        keys = [i for i, line in enumerate(lines) if re.fullmatch(r"rlhf-[a-z-]+", line.strip())]
        if keys:
            rest = [line.strip() for line in lines[keys[0] + 1:] if line.strip() and line.strip() != "Created"]
            cards[lines[keys[0]].strip()] = rest[-1] if len(rest) > 1 else ""
    return cards


def v1_artifacts(driver, world: World, run_id: str, flow_run: set[str], task_runs: set[str] = frozenset()):
    """{"Flow run": keys, "Task runs": keys}, once they include `flow_run` and `task_runs`: the V1 page's Artifacts
    tab, whose two headings part the flow run's own artifacts from its task runs' (listed a moment later)."""
    driver.get(v1_page(world, "flow-run", run_id))
    click(driver, "//li[contains(@class, 'p-tab')][normalize-space()='Artifacts']", "the Artifacts tab")
    keys = "//*[starts-with(normalize-space(), 'rlhf-')][not(*[starts-with(normalize-space(), 'rlhf-')])]"

    def sections(d) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {"Flow run": [], "Task runs": []}
        for key in d.find_elements(By.XPATH, keys):
            below = key.find_elements(By.XPATH, "./preceding::*[normalize-space()='Flow run' or "
                                                "normalize-space()='Task runs'][1]")
            if below and key.is_displayed():
                found[below[0].text.strip()].append(key.text.strip())
        return found

    def listed(d) -> dict[str, list[str]] | None:
        try:
            found = sections(d)
        except StaleElementReferenceException:  # redrawn while read (the run's progress moves): read again
            return None
        return found if flow_run <= set(found["Flow run"]) and task_runs <= set(found["Task runs"]) else None

    try:
        return wait(driver, listed, f"{sorted(flow_run)} under 'Flow run', {sorted(task_runs)} under 'Task runs'")
    except TimeoutException:
        raise AssertionError(f"the V1 page's artifacts: {listed(driver) or sections(driver)}") from None


def text_at(driver, xpath: str) -> str | None:
    """The text of the first visible element at `xpath` now; None when there is none, or it was redrawn meanwhile."""
    try:
        return next((e.text for e in driver.find_elements(By.XPATH, xpath) if e.is_displayed()), None)
    except StaleElementReferenceException:
        return None


def task_run_ids(world: World, run_id: str) -> dict[str, str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with prefect_client(world.api) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {run.name: str(run.id) for run in runs}


@pytest.fixture(scope="module")
def custom_run(world) -> str:
    """The manual deployment run from the UI's form with train.kl_coef overridden, once it has ended. Returns
    its flow run id."""
    driver = new_browser(webgl=False)
    try:
        run_id = start_custom_run(driver, world, f"train.kl_coef={CUSTOM_KL}", "prefect-custom-run-form")
    finally:
        driver.quit()
    wait_for_server("the custom run to end", lambda: run_ended(world, run_id))
    return run_id


def test_deployments_page_lists_manual_nightly_and_the_sweep_with_its_schedule(world, prefect_browser):
    browser = prefect_browser
    with screenshot(browser, "prefect-deployments"):
        open_deployments(browser, world)
        rows = {r.find_element(By.XPATH, ".//td[2]").text.splitlines()[0]: r.text
                for r in browser.find_elements(By.XPATH, "//tbody/tr")}
        assert set(rows) == {"manual", "nightly", "point", "frontier"}, rows
        assert "rlhf-pipeline" in rows["manual"] and "rlhf-pipeline" in rows["nightly"], rows
        assert "rlhf-sweep" in rows["frontier"], rows["frontier"]
        # prefect.yaml's cron "0 2 * * *" in words, active; the manual deployment has no schedule
        assert "At 02:00 AM" in rows["nightly"] and "Active" in rows["nightly"], rows["nightly"]
        assert "At " not in rows["manual"], rows["manual"]


def test_a_custom_run_with_an_override_completes_with_its_cached_stages(world, custom_run, prefect_browser):
    browser = prefect_browser
    browser.get(run_page(world, custom_run, "TaskRuns"))
    with screenshot(browser, "prefect-custom-run-task-runs", height=2000):
        title = shown(browser, RUN_TITLE, "the run's name").text
        name = title.splitlines()[1]  # by profile, algorithm, override and start time, not the form's random name
        assert re.fullmatch(rf"demo-ppo-kl_coef={CUSTOM_KL}-\d{{4}}-\d{{6}}", name), title
        wait(browser, lambda d: state_of(d) == "Completed", "Completed at the top of the page")
        summary = shown(browser, innermost("Cached)"), "the task runs' summary").text
        assert summary == f"({len(RAN)} Completed, {len(CACHED)} Cached)", summary
        states = wait(browser, lambda d: task_run_states(d, name), "the task runs' cards")
        assert states == {**dict.fromkeys(CACHED, "Cached"), **dict.fromkeys(RAN, "Completed")}, states
    # the log, newest first: each stage's printed result is one record (it was a record per line, `{` to `}`, then
    # one line of raw JSON), a metric per line
    click(browser, "//*[@role='tab'][normalize-space()='Logs']", "the Logs tab")
    choose(browser, "Oldest to newest", "Newest to oldest")
    with screenshot(browser, "prefect-custom-run-logs"):
        starts = "starts-with(normalize-space(), \"register's result\")"
        shown(browser, f"//*[{starts}][not(*[{starts}])]", "register's result in the log")
        lines = [line.strip() for line in text(browser).splitlines()]
        assert not [line for line in lines if line.startswith(("{", "}"))], lines
    click(browser, "//*[@role='tab'][normalize-space()='Parameters']", "the Parameters tab")
    with screenshot(browser, "prefect-custom-run-parameters"):
        shown(browser, innermost(f"train.kl_coef={CUSTOM_KL}"), "the override in the run's parameters")


RUN_ARTIFACTS = {"rlhf-run-progress", "rlhf-run-parameters", "rlhf-mlflow-run", "rlhf-validation", "rlhf-inspection",
                 "rlhf-evaluation"}  # the flow run's own (flows/pipeline.py), each made as what it shows is there
STAGE_PROGRESS = {"rlhf-progress-train", "rlhf-progress-evaluate"}  # the task runs' of the stages that ran a bar


def cards_with(keys: set[str]):
    """A wait condition: the Artifacts tab's cards, once they include `keys`."""
    return lambda d: (cards := artifact_cards(d)) and keys <= set(cards) and cards


def test_the_runs_artifacts_say_how_it_ended_beside_each_stages_summary(world, custom_run, prefect_browser):
    """After the run, its Artifacts tab: the run's progress saying how it ended, its parameters and MLflow link, each
    stage's summary, and the stages' own progress. On the V1 page (the "View at" link's), the run's own stand under
    "Flow run": the stages' progress, apart under "Task runs", used to be all the progress there was."""
    browser = prefect_browser
    browser.get(run_page(world, custom_run, "Artifacts"))
    with screenshot(browser, "prefect-custom-run-artifacts", height=1800):
        cards = wait(browser, cards_with(RUN_ARTIFACTS | STAGE_PROGRESS), "the run's artifacts")
        assert cards["rlhf-run-progress"] == f"done: {len(CACHED + RAN)} stages, {len(RAN)} ran, {len(CACHED)} " \
                                             "unchanged", cards
    with screenshot(browser, "prefect-v1-custom-run-artifacts", height=1800):
        v1_artifacts(browser, world, custom_run, RUN_ARTIFACTS, STAGE_PROGRESS)


def test_a_stages_task_run_page_says_its_retries_come_30_s_apart(world, custom_run, prefect_browser):
    """Train's task-run page, in the V1 UI (a task of the "View at" link's page) and in V2: 2 retries, "Retry Delay
    30s". With a list of delays, one per retry, V1 read "Retry Delay NaNs" and V2 "None"."""
    browser = prefect_browser
    train = task_run_ids(world, custom_run)["train"]
    for ui, page in (("v1", v1_page(world, "task-run", train)), ("v2", f"{world.prefect}/v2/runs/task-run/{train}")):
        browser.get(page)
        with screenshot(browser, f"prefect-{ui}-train-task-run"):
            shown(browser, exactly("Retry Delay"), "the task's Retry Delay")
            delay = wait(browser, lambda d: re.search(r"^Retry Delay\n(.+)$", text(d), flags=re.M), "its value")
            assert delay.group(1) == "30s", delay.group(0)
            assert re.search(r"^Retries\n2$", text(browser), flags=re.M), text(browser)


# ----------------------------------------------------------------------------------------------- MLflow


def pipeline_runs(world: World) -> dict[str, str]:
    """{run name: MLflow run id} of the finished pipeline runs (the parents of the stage runs), from their
    records in reports/runs/."""
    records = [json.loads(p.read_text()) for p in (world.root / "reports" / "runs").glob("*.json")]
    return {r["flow_run_name"]: r["mlflow_run_id"] for r in records if r["status"] == "FINISHED"}


def test_the_printed_mlflow_link_opens_the_runs_table(world, custom_run, browser):
    """The link `rlhf run` prints, opened in a fresh browser (whose MLflow view is the default, GenAI): the
    experiment's runs table listing the pipeline runs, not the GenAI overview with its empty traces."""
    runs = pipeline_runs(world)
    assert len(runs) == 2, runs
    assert re.fullmatch(rf"{world.mlflow}/#/experiments/\d+/runs\?workflowType=machine_learning", world.runs_link)
    browser.get(world.runs_link)
    with screenshot(browser, "mlflow-runs-table"):
        shown(browser, "//*[normalize-space(text())='Run Name']", "the runs table's header")
        for name, run_id in runs.items():
            link = shown(browser, f"//a[normalize-space()={literal(name)}]", f"the row of {name}")
            assert link.get_attribute("href").split("?")[0].endswith(f"/runs/{run_id}"), link.get_attribute("href")
        assert "/runs" in browser.current_url and "/overview" not in browser.current_url, browser.current_url
        shown(browser, "//a[normalize-space()='Model registry']", "the model-training side bar")
        page = text(browser)
        # not the GenAI side bar ("Observability") and its page title ("Training runs")
        assert "Observability" not in page and "Training runs" not in page, page[:1500]


def versions_by_kl(world: World) -> dict[str, str]:
    """{train.kl_coef: model version} as the registry has them (each version's source run holds every param)."""
    client = world.mlflow_client()
    versions = client.search_model_versions(f"name='{MODEL}'")
    return {client.get_run(v.run_id).data.params["train.kl_coef"]: str(v.version) for v in versions}


def test_version_compare_shows_the_differing_params(world, custom_run, browser):
    versions = versions_by_kl(world)
    assert set(versions) == {BASE_KL, CUSTOM_KL}, versions
    browser.get(f"{world.mlflow}/#/models/{MODEL}")
    for kl in (BASE_KL, CUSTOM_KL):  # the box drawn over each row's checkbox input
        row = f"//*[@role='row'][.//a[normalize-space()='Version {versions[kl]}']]"
        click(browser, f"{row}//input[@type='checkbox']/..", f"the checkbox of version {versions[kl]}")
    click(browser, "//button[normalize-space()='Compare']", "Compare")
    with screenshot(browser, "mlflow-compare-versions", height=1400):
        shown(browser, "//*[normalize-space(text())='Comparing 2 Versions']", "the compare page")
        row = shown(browser, "//tr[th[normalize-space()='train.kl_coef']]", "the train.kl_coef row")
        values = [cell.text for cell in row.find_elements(By.XPATH, "./td")]
        columns = [cell.text for cell in browser.find_elements(By.XPATH, "//tr[th[normalize-space()='Model Version:']]/td")]
        assert dict(zip(columns, values, strict=True)) == {versions[BASE_KL]: BASE_KL, versions[CUSTOM_KL]: CUSTOM_KL}
        assert "Parameters are identical" not in text(browser)


def test_the_registry_shows_the_champion(world, custom_run, browser):
    champion = world.mlflow_client().get_model_version_by_alias(MODEL, "champion").version
    browser.get(f"{world.mlflow}/#/models")
    with screenshot(browser, "mlflow-registered-models"):
        row = shown(browser, f"//*[@role='row' or self::tr][.//a[normalize-space()='{MODEL}']]", "the model's row")
        close_dialogs(browser)
        # the list shows one alias per model; the model's `champion` tag names the champion there
        assert f"champion: v{champion} (" in row.text, row.text
    click(browser, f"//a[normalize-space()='{MODEL}']", "the registered model")
    with screenshot(browser, "mlflow-registry-champion", height=1600):
        shown(browser, "//*[normalize-space(text())='Versions']", "the versions table")
        rows = wait(browser, lambda d: {
            r.find_element(By.XPATH, ".//a[starts-with(normalize-space(), 'Version ')]").text: r.text
            for r in d.find_elements(By.XPATH, "//*[@role='row'][.//a[starts-with(normalize-space(), 'Version ')]]")
        } or None, "the version rows")
        assert sorted(v for v, row in rows.items() if "@ champion" in row) == [f"Version {champion}"], rows
        assert f"Champion: v{champion}" in text(browser)  # the model's description


# ----------------------------------------------------------------------------------------------- DVC


@pytest.fixture(scope="module")
def plots_page(world, custom_run) -> Path:
    """`dvc plots show` in the workspace after both runs: an HTML page (from .dvc/offline-plots.html)."""
    out = world.root.parent / "plots"
    sh("dvc", "plots", "show", "-o", str(out), cwd=world.root)
    return out / "index.html"


CHART = """
const svg = arguments[0].querySelector('svg.marks');  // vega-embed's chart (its menu's icon is another svg)
if (!svg) return null;
const lines = Array.from(svg.querySelectorAll('.mark-line path')).filter(p => (p.getAttribute('d') || '').includes('L'));
return {lines: lines.length, texts: Array.from(svg.querySelectorAll('text')).map(t => t.textContent)};
"""


def test_dvc_plots_render_offline(plots_page):
    """DVC's plots page in a browser with no network: each Vega chart is drawn (its title, its axis, a line of
    at least two points), and each PNG plot is shown. With DVC's own template (Vega from a CDN) there is no chart."""
    charts = re.findall(r"vegaEmbed\('#([^']+)'", plots_page.read_text())
    assert len(charts) == len(CHARTS), charts
    driver = new_browser(offline=True)
    try:
        driver.get(plots_page.as_uri())
        with screenshot(driver, "dvc-plots-offline", height=3600):
            titles = set()
            for chart in charts:
                element = shown(driver, f"//*[@id={literal(chart)}]", f"the chart {chart}")
                drawn = wait(driver, lambda d, e=element: (c := d.execute_script(CHART, e)) and c["lines"] and c,
                             f"a line in {chart}")
                assert "update" in drawn["texts"], drawn  # the x axis' title
                titles |= CHARTS & set(drawn["texts"])
            assert titles == CHARTS
            images = driver.find_elements(By.TAG_NAME, "img")
            assert len(images) == 4 and all(driver.execute_script("return arguments[0].naturalWidth", i) > 0
                                            for i in images), [i.get_attribute("src") for i in images]
    finally:
        driver.quit()


# ----------------------------------------------------------------------------------------------- cancel (last)


def test_cancel_from_the_ui_shows_cancelled_without_an_error(world, custom_run, plots_page, prefect_browser):
    """A long run cancelled from its page's menu while train runs: Cancelled at the top, train's task Cancelled,
    a WARNING saying what was stopped, and with the level filter at "Error and above" no log at all (no "Engine
    execution exited with unexpected exception", no traceback). Runs after everything else reads the workspace."""
    browser = prefect_browser
    run_id = start_custom_run(browser, world, "train.total_episodes=100000", "prefect-cancel-run-form")
    browser.get("about:blank")  # nothing drawn while train gets going
    wait_for_server("train's first update", lambda: any(
        log.message.startswith("train: update ") for log in run_logs(world, run_id)))
    # while train runs, the run's Artifacts tab says where it is (V2 as of the page's load), beside the summaries of
    # the stages that ended; evaluate's comes when evaluate ends
    browser.get(run_page(world, run_id, "Artifacts"))
    with screenshot(browser, "prefect-train-progress-artifacts"):
        cards = wait(browser, cards_with({"rlhf-run-progress", "rlhf-validation", "rlhf-inspection"}), "the artifacts")
        assert re.fullmatch(r"stage 6/8 train: \d+%, eta .+, update \d+/6250\s+reward .+", cards["rlhf-run-progress"])
        assert {"rlhf-run-parameters", "rlhf-mlflow-run"} <= set(cards) and "rlhf-evaluation" not in cards, cards
    # the V1 page ("View at") has it under "Flow run", and moves it as train goes, without a reload
    with screenshot(browser, "prefect-v1-train-progress-artifacts"):
        v1_artifacts(browser, world, run_id, {"rlhf-run-progress"})
        starts = "starts-with(normalize-space(), 'stage 6/8 train: ')"
        progress = f"//*[{starts}][not(*[{starts}])]"
        first = wait(browser, lambda d: text_at(d, progress), "the run's progress")
        wait(browser, lambda d: (now := text_at(d, progress)) not in (None, first) and now, "the run's progress to move")
    browser.get(run_page(world, run_id))
    choose(browser, "Oldest to newest", "Newest to oldest")
    with screenshot(browser, "prefect-train-progress"):  # train's progress reaches the run's log while it runs
        shown(browser, innermost("train: update 1/6250"), "train's first update in the log")
        assert state_of(browser) == "Running"
    click(browser, f"{RUN_TITLE}/following::button[@aria-label='Open menu' or normalize-space()='Open menu'][1]",
          "the run's menu")
    click(browser, "//*[@role='menuitem'][normalize-space()='Cancel']", "Cancel in the menu")
    click(browser, "//*[@role='dialog' or @role='alertdialog']//button[normalize-space()='Cancel Flow Run']",
          "Cancel Flow Run in the dialog")
    wait(browser, lambda d: state_of(d) == "Cancelled", "Cancelled at the top of the page", RUN_S)
    wait_for_server("the run's last log record", lambda: any(
        log.name == "prefect.flow_runs" and log.message.startswith("Finished in state Cancelled")
        for log in run_logs(world, run_id)), WAIT_S)

    browser.get(run_page(world, run_id))
    name = shown(browser, RUN_TITLE, "the run's name").text.splitlines()[1]
    choose(browser, "Level: All", "Warning and above")
    with screenshot(browser, "prefect-cancelled-run-warnings"):
        shown(browser, innermost("run cancelled: stage 'train' stopped by SIGTERM"), "the cancellation's warning")
        page = text(browser)
        assert state_of(browser) == "Cancelled"
        assert not re.search(r"^(ERROR|CRITICAL)$", page, flags=re.M), page  # a level badge is a line of its own
        assert "Engine execution exited with unexpected exception" not in page and "Traceback" not in page, page
    choose(browser, "Level: Warning and above", "Error and above")
    with screenshot(browser, "prefect-cancelled-run-errors"):
        shown(browser, "//*[normalize-space(text())='No logs match your filter criteria']", "an empty list")
    click(browser, "//*[@role='tab'][normalize-space()='Task Runs']", "the Task Runs tab")
    with screenshot(browser, "prefect-cancelled-run-task-runs", height=1600):
        states = wait(browser, lambda d: task_run_states(d, name), "the task runs' cards")
        assert states == {**dict.fromkeys(CACHED, "Cached"), "train": "Cancelled"}, states
    click(browser, "//*[@role='tab'][normalize-space()='Artifacts']", "the Artifacts tab")
    with screenshot(browser, "prefect-cancelled-run-artifacts"):
        cards = wait(browser, cards_with({"rlhf-run-progress"}), "the run's progress")
        assert cards["rlhf-run-progress"] == "cancelled at stage 6/8 train", cards
    logs = run_logs(world, run_id)  # and the API agrees: nothing at ERROR or above
    assert not [log.message for log in logs if log.level >= 40]


# ----------------------------------------------------------------------------------------------- `rlhf run` alone


def test_the_view_at_link_of_a_run_on_the_temporary_server_shows_the_run(tmp_path, prefect_browser):
    """With no PREFECT_API_URL, `rlhf run` and `rlhf sweep` run on a temporary server, and Prefect prints "View at
    http://127.0.0.1:<port>/runs/flow-run/<id>": that link opens the run's page while it runs (at 2a5c0fd the
    server served no UI and the link answered {"detail":"Not Found"}). Needs no pipeline: a held flow run."""
    from test_temporary_server import FLOW_NAME, held_flow_run

    SHOTS.mkdir(parents=True, exist_ok=True)
    with held_flow_run(tmp_path) as link, screenshot(prefect_browser, "temporary-server-run"):
        prefect_browser.get(link)  # the page of the link, as Prefect serves it (its V1 UI at this path)
        shown(prefect_browser, innermost("Beginning flow run"), "the run's log")
        page = text(prefect_browser)
        assert "Running" in page and FLOW_NAME in page and "Not Found" not in page, page
