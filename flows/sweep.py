"""The Prefect flow `rlhf-sweep` (`rlhf sweep`): the pipeline over a grid of params, and the reward–KL frontier.

`--grid train.kl_coef=0.02,0.05,0.15,0.3 --grid train.algo=ppo,rloo` makes 8 points (the first axis varies
slowest). Each point is one run of the pipeline flow `rlhf-pipeline` with the sweep's overrides plus its own:

- **shared stages once**: prepare, validate, sft, reward-model and inspect do not read `train.*`, so DVC runs
  them for the first point and skips them for the rest (a grid over their params reruns them where it must);
- **a DVC experiment per point**, named `sweep-<key>-<setting>` (`dvc exp show`, `rlhf exps`);
- **MLflow**: one sweep run, the parent of each point's pipeline run, itself the parent of its stage runs;
- **concurrency**: points run one at a time in this workspace; with `point_deployment` set they are runs of
  that deployment (its work pool's workers, e.g. one per GPU, each in its own clone sharing a DVC cache), at
  most `concurrency` at once, the first alone so that it leaves the shared stages in the cache;
- **resume**: the sweep's key is a hash of the code (git HEAD), params.yaml, the profile, the overrides and the
  grid, and reports/sweep/<key>.json records each finished point. Rerunning the same sweep after Ctrl-C or
  kill -9 keeps the finished points and starts at the first unfinished one, whose train resumes from its
  checkpoint;
- **the frontier** (tasks/reports/frontier.py): reports/sweep/frontier.{json,png}, also on the sweep's MLflow
  run: gold and reward-model score against sqrt(KL) per algorithm, the Gao et al. fit of the gold curve and
  the candidate the registry gate would promote (a grid over `base.seed` averages each setting's seeds).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Cancelled, Completed, Failed, State

from flows import interrupt
from flows.overrides import restore_after_killed_run
from flows.pipeline import rlhf_pipeline
from flows.pipeline_run import EXPERIMENT_TAG, open_tracker, run_url
from flows.pipeline_run import _client as pipeline_run_client
from rlhf_core.jsonio import read_json_object, write_json
from rlhf_core.threads import PROCESSES_ENV, processes_sharing
from tasks.parameters.params import PARAMS_FILE, ParamsError, load_params
from tasks.reports.frontier import frontier, plot_frontier
from tasks.reports.frontier_uncertainty import EVAL_SCORES, PER_PROMPT, fit_text, gain_text, verdict_text
from tasks.tracking.mlflow_store import (
    TrackingError,
    experiment_id,
    owner_tags,
    tracking_enabled,
    unique_run_name,
)
from tasks.tracking.mlflow_tracker import MlflowTracker, TrackingUnavailable

SWEEP_DIR = "reports/sweep"
SWEEP_TAG = "rlhf.sweep"


class GridError(ValueError):
    """A --grid item that is not `section.key=v1,v2,...`, a key given twice, or a point the params reject."""


@dataclass(frozen=True)
class Point:
    grid: tuple[str, ...]  # this point's overrides from the grid, e.g. ("train.kl_coef=0.02", "train.algo=ppo")
    experiment: str        # its DVC experiment: sweep-<key>-<setting>
    algo: str
    seed: int

    @property
    def label(self) -> str:
        return ",".join(self.grid)


def _split_values(text: str) -> list[str]:
    """`0.02,0.05` -> ['0.02', '0.05']; a comma inside brackets or quotes belongs to its value ([a,b])."""
    values, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    return [*values, text[start:].strip()]


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """Each `section.key=v1,v2,...` as (key, values), in order; GridError naming the item otherwise."""
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        values = _split_values(text) if sep else []
        if not sep or not re.fullmatch(r"[A-Za-z_][\w.]*", key) or "." not in key or not all(values):
            raise GridError(f"--grid {item!r}: expected section.key=value1,value2,... (e.g. "
                            "train.kl_coef=0.02,0.05,0.15)")
        if key in (k for k, _ in axes):
            raise GridError(f"--grid {key}: given twice; list all its values in one --grid")
        if len(set(values)) != len(values):
            raise GridError(f"--grid {item!r}: a value is listed twice")
        axes.append((key, values))
    if not axes:
        raise GridError("a sweep needs at least one --grid section.key=value1,value2,...")
    return axes


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-").lower()


def plan(root: str | Path, profile: str | None, overrides: list[str], grid: list[str]) -> tuple[str, list[Point]]:
    """The sweep's key and its points, each validated as its run will load it: GridError naming the point and
    the key before anything runs."""
    axes = parse_grid(grid)
    fixed = {item.partition("=")[0].strip() for item in overrides}
    if clash := sorted(fixed & {key for key, _ in axes}):
        raise GridError(f"{', '.join(clash)}: both in --set and --grid; keep one")
    key = sweep_key(root, profile or "demo", overrides, grid)
    points = []
    for combo in itertools.product(*([f"{k}={v}" for v in values] for k, values in axes)):
        try:
            params = load_params(root, profile, [*overrides, *combo])
        except ParamsError as err:
            raise GridError(f"grid point {', '.join(combo)}: {err}") from None
        label = "-".join(f"{item.partition('=')[0].rsplit('.', 1)[-1]}-{item.partition('=')[2]}" for item in combo)
        points.append(Point(tuple(combo), f"sweep-{key}-{_slug(label)}"[:120], params.train.algo,
                            params.base.seed))
    return key, points


def sweep_key(root: str | Path, profile: str, overrides: list[str], grid: list[str]) -> str:
    """8 hex digits of what makes a sweep the same sweep: the code (git HEAD), params.yaml as it is, the profile,
    the overrides and the grid. Rerunning with the same key resumes; any change starts a new sweep (whose
    points DVC still restores from its run cache where their inputs are unchanged)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
    text = json.dumps({"head": head.stdout.strip() if head.returncode == 0 else "",
                       "params": (Path(root) / PARAMS_FILE).read_text(), "profile": profile,
                       "overrides": list(overrides), "grid": list(grid)}, sort_keys=True)
    return hashlib.md5(text.encode()).hexdigest()[:8]


def state_path(root: str | Path, key: str) -> Path:
    return Path(root) / SWEEP_DIR / f"{key}.json"


# --------------------------------------------------------------------------------------------- MLflow


@dataclass
class SweepRun:
    """The sweep's MLflow run: its id ('' without tracking), its write queue, and the time its figures carry."""

    run_id: str
    tracker: MlflowTracker | None = None
    figures_ms: int = 0  # the same on every close of this run: figures sent again land once


def _open_sweep_run(root: Path, key: str, profile: str, overrides: list[str], grid: list[str], n: int,
                    resume_id: str | None) -> SweepRun:
    """The sweep's MLflow run: reopened when resuming (its owner now this process), else created; on a server
    every call retried through an outage and the creation made once. Its params are queued (open_tracker)."""
    if not tracking_enabled():
        return SweepRun("")
    from flows.servers import ServerUnreachable, check_mlflow

    try:
        check_mlflow()
    except ServerUnreachable as err:
        raise TrackingError(str(err)) from None
    client = pipeline_run_client(root)
    found = None
    if resume_id:
        try:
            found = client.get_run(resume_id)
        except TrackingUnavailable:
            raise
        except Exception:  # deleted since: a new one
            found = None
    if found is not None:
        tracker = open_tracker(root, resume_id)
        for tag, value in owner_tags().items():
            tracker.write(f"tag {tag}", client.set_tag, resume_id, tag, value)
        tracker.write("the run's status (RUNNING)", client.update_run, resume_id, status="RUNNING")
        return SweepRun(resume_id, tracker, found.info.start_time)
    exp = experiment_id(client, root)
    tags = {"rlhf.kind": "sweep", SWEEP_TAG: key, "rlhf.root": str(root), **owner_tags()}
    run = client.create_run(exp, run_name=unique_run_name(client, exp, f"{profile}-sweep-{key}"), tags=tags)
    tracker = open_tracker(root, run.info.run_id)
    tracker.log_params({"profile": profile, "overrides": json.dumps(overrides), "grid": json.dumps(grid), "points": n})
    return SweepRun(run.info.run_id, tracker, run.info.start_time)


def _close_sweep_run(sweep: SweepRun, root: Path, status: str, report: dict | None) -> None:
    """The frontier (artifacts, fit metrics, the gate's pick) and the run's end, waited for: TrackingUnavailable
    naming what a server never took, TrackingRefused what it refused."""
    if not sweep.run_id:
        return
    tracker, run_id = sweep.tracker, sweep.run_id
    if report is not None:
        for name in ("frontier.json", "frontier.png"):
            if (root / SWEEP_DIR / name).is_file():
                tracker.log_artifact(root / SWEEP_DIR / name, "frontier")
        figures = {}
        for algo, fit in report["gao_fit"].items():
            figures.update({f"frontier/{algo}/alpha": fit["alpha"], f"frontier/{algo}/beta": fit["beta"]})
            if fit["r2"] is not None:
                figures[f"frontier/{algo}/r2"] = fit["r2"]
            if fit["peak_kl"] is not None:
                figures[f"frontier/{algo}/peak_kl"] = fit["peak_kl"]
        figures.update({f"gate_pick/{k}": v for k, v in (report["gate_pick_figures"] or {}).items()})
        tracker.log_metrics(figures, 0, timestamp_ms=sweep.figures_ms)
        if report["gate_pick"]:
            tracker.write("the gate's pick", tracker.client.set_tag, run_id, "rlhf.gate_pick", report["gate_pick"])
    tracker.end(status)
    tracker.close()


def _figures_from_mlflow(root: Path, parent: str, experiment: str) -> dict | None:
    """A point run elsewhere (a deployment's worker): its evaluation as its pipeline run recorded it. On a server
    each read is retried through an outage, as the writes are; TrackingUnavailable when it stays down."""
    client = pipeline_run_client(root)
    found = client.search_runs([client.get_run(parent).info.experiment_id],
                               f"tags.mlflow.parentRunId = '{parent}' and tags.`{EXPERIMENT_TAG}` = '{experiment}' "
                               "and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                               max_results=1)
    if not found:
        return None
    figures = {k.removeprefix("eval/"): v for k, v in found[0].data.metrics.items() if k.startswith("eval/")}
    scores = _scores_from_mlflow(client, found[0].info.experiment_id, found[0].info.run_id)
    return {**figures, PER_PROMPT: scores} if scores else figures


def _scores_from_mlflow(client, experiment: str, pipeline_run: str) -> dict | None:
    """The point's per-prompt scores (reports/eval/scores.json), an artifact of its evaluate stage run; None
    where that stage did not run in this point (DVC restored it: no stage run) or predates the file."""
    import tempfile

    from mlflow.exceptions import MlflowException

    found = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{pipeline_run}' and "
                               "tags.`rlhf.stage` = 'evaluate' and attributes.status = 'FINISHED'",
                               order_by=["attributes.start_time DESC"], max_results=1)
    if not found:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return read_json_object(client.download_artifacts(found[0].info.run_id, EVAL_SCORES, tmp))
        except (MlflowException, OSError):
            return None


def _end_after_crash(sweep: SweepRun, root: Path, logger) -> None:
    """The sweep run's end (FAILED) when the flow crashes; the crash is the story, an MLflow failure is said beside."""
    try:
        _close_sweep_run(sweep, root, "FAILED", None)
    except Exception as lost:
        logger.error("the sweep's MLflow run %s could not be ended: %s", sweep.run_id, lost)


# --------------------------------------------------------------------------------------------- points


def _point_parameters(profile: str, overrides: list[str], point: Point, parent: str, wait_s: float) -> dict:
    return {"profile": profile, "overrides": [*overrides, *point.grid], "wait_for_lock_s": wait_s,
            "mlflow_parent": parent, "experiment": point.experiment}


def _run_here(root: Path, parameters: dict, parent: str) -> tuple[State, dict | None]:
    """One point as a subflow in this workspace; its figures from metrics/eval.json as the run left them, with
    its per-prompt scores (reports/eval/scores.json) where the evaluation kept them."""
    state = rlhf_pipeline(**parameters, return_state=True)
    figures = read_json_object(root / "metrics" / "eval.json") if state.is_completed() else None
    scores = read_json_object(root / EVAL_SCORES) if figures is not None else None
    return state, {**figures, PER_PROMPT: scores} if scores else figures


def _run_on_pool(root: Path, deployment: str, parameters: dict, parent: str,
                 concurrency: int) -> tuple[State, dict | None]:
    """One point as a run of `deployment` (its pool's worker runs it); its figures from its MLflow run. The
    points at once share a machine's cores unless the pool spreads them (then set RLHF_THREADS in its env)."""
    from prefect.deployments import run_deployment

    sharing = {PROCESSES_ENV: str(processes_sharing() * concurrency)}
    run = run_deployment(deployment, parameters=parameters, timeout=None, as_subflow=True,
                         job_variables={"env": sharing})
    state = run.state
    if not state.is_completed():
        return state, None
    try:
        return state, _figures_from_mlflow(root, parent, parameters["experiment"])
    except TrackingError as err:  # MLflow stayed down past its limit: this point fails, the sweep goes on
        return Failed(message=f"point {parameters['experiment']} finished, but its figures could not be read "
                              f"back: {err}"), None


def _record_point(root: Path, saved: dict, point: Point, state: State, figures: dict | None) -> None:
    entry = {"grid": list(point.grid), "experiment": point.experiment, "algo": point.algo, "seed": point.seed}
    if state.is_completed() and figures is not None:  # the per-prompt scores beside the figures (the bootstrap's)
        saved["points"][point.label] = {**entry, "status": "FINISHED",
                                        "figures": {k: v for k, v in figures.items() if k != PER_PROMPT},
                                        **({PER_PROMPT: figures[PER_PROMPT]} if figures.get(PER_PROMPT) else {})}
    else:
        why = state.message or state.name if not state.is_completed() else "finished without metrics/eval.json"
        saved["points"][point.label] = {**entry, "status": state.type.value, "failure": why}
    write_json(state_path(root, saved["key"]), saved)


def _run_points(root: Path, todo: list[Point], saved: dict, run_one, concurrency: int) -> State | None:
    """Run `todo`, recording each as it ends; the first Cancelled state stops the rest (a signal, Cancel in
    the UI). With concurrency > 1 the first point runs alone: it leaves the shared stages in the cache."""
    logger = get_run_logger()
    if not todo:
        return None
    first, rest = todo[0], todo[1:]
    batches = [[first]] + ([rest[i:i + concurrency] for i in range(0, len(rest), concurrency)] if rest else [])
    for batch in batches:
        if interrupt.received():
            return Cancelled(message=f"stopped by {interrupt.received()} before point {batch[0].label}")
        if len(batch) == 1:
            results = [(batch[0], *run_one(batch[0]))]
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(batch)) as pool:
                results = [(p, *f.result()) for p, f in [(p, pool.submit(run_one, p)) for p in batch]]
        for point, state, figures in results:
            _record_point(root, saved, point, state, figures)
            logger.info("point %s: %s", point.label, state.name if not state.is_completed() else "finished")
        cancelled = next((s for _, s, _ in results if s.is_cancelled()), None)
        if cancelled is not None:
            return Cancelled(message=cancelled.message)
    return None


# --------------------------------------------------------------------------------------------- report


def write_frontier(root: Path, saved: dict) -> dict | None:
    """reports/sweep/frontier.{json,png} from the finished points; None when there are none."""
    finished = [p for p in saved["points"].values() if p["status"] == "FINISHED"]
    if not finished:
        return None
    params = load_params(root, saved["profile"], saved["overrides"])
    from tasks.stages.register import gate_metric

    metric = gate_metric(params.register, finished[0]["figures"])
    report = {"sweep": saved["key"], "profile": saved["profile"], "overrides": saved["overrides"],
              "grid": saved["grid"], **frontier(finished, metric, params.register.max_kl, params.register.tie_margin)}
    write_json(root / SWEEP_DIR / "frontier.json", report)
    plot_frontier(report, root / SWEEP_DIR / "frontier.png")
    return report


def frontier_table(report: dict) -> tuple[list[str], list[list[str]]]:
    """The candidates as (header, rows) with their gains' intervals; the gate's pick marked `pick`."""
    metric, level = report["metric"], report.get("level", 0.95)
    header = ["setting", "algo", "seeds", metric, "win_rate_rm", "mean_kl", f"gold gain [{level:.0%}]",
              f"reward-model gain [{level:.0%}]", "gate"]
    rows = []
    for c in report["candidates"]:
        f = c["figures"]
        rows.append([c["setting"], c["algo"], str(c["n"]), f"{f.get(metric, float('nan')):.3f}",
                     f"{f.get('win_rate_rm', float('nan')):.3f}", f"{f.get('mean_kl', float('nan')):.2f}",
                     gain_text(c.get("gold_gain"), c.get("gold_gain_ci")), gain_text(c.get("rm_gain"), c.get("rm_gain_ci")),
                     "pick" if c["setting"] == report["gate_pick"] else ""])
    return header, rows


def _frontier_notes(report: dict) -> list[str]:
    """The fit per algorithm with its intervals, the verdict on over-optimization (or what to run to decide it),
    the gate's pick."""
    lines = []
    for algo in sorted({*report["gao_fit"], *report.get("verdict", {})}):
        lines.append("")
        if algo in report["gao_fit"]:
            lines.append(fit_text(algo, report["gao_fit"][algo]))
        if algo in report.get("verdict", {}):
            lines.extend(["", *verdict_text(algo, report["verdict"][algo])])
    lines.append(f"\nThe gate (highest {report['metric']} within register.max_kl={report['max_kl']:g}) picks: "
                 f"{report['gate_pick'] or 'none within the KL budget'}")
    return lines


def frontier_markdown(report: dict) -> str:
    """The frontier as markdown: the sweep's Prefect artifact."""
    header, rows = frontier_table(report)
    rows = [[f"**{cell}**" if cell == "pick" and i == len(row) - 1 else cell for i, cell in enumerate(row)]
            for row in rows]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
             *("| " + " | ".join(row) + " |" for row in rows)]
    return "\n".join([f"# Sweep {report['sweep']}: reward–KL frontier", "", *table, *_frontier_notes(report)])


def frontier_text(report: dict) -> str:
    """The frontier as `rlhf sweep` prints it: every cell whole, in columns, the rule as wide as the table (a
    terminal wraps a line wider than it; nothing is cut)."""
    header, rows = frontier_table(report)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
             for line in [header, *rows]]
    rule = "─" * max(map(len, lines))
    return "\n".join([f"Sweep {report['sweep']}: reward–KL frontier", "", lines[0], rule, *lines[1:],
                      *_frontier_notes(report)])


# --------------------------------------------------------------------------------------------- the flow


def _sweep_run_name() -> str:
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    axes = "x".join(item.partition("=")[0].rsplit(".", 1)[-1] for item in parameters.get("grid") or [])
    return f"{parameters.get('profile', 'demo')}-sweep-{axes or 'grid'}"


@flow(name="rlhf-sweep", flow_run_name=_sweep_run_name, log_prints=False)
def rlhf_sweep(grid: list[str], profile: str = "demo", overrides: list[str] = [],  # noqa: B006
               concurrency: int = 1, point_deployment: str = "", wait_for_lock_s: float = 600.0) -> dict | State:
    """The pipeline over a grid of params, one DVC experiment and MLflow run per point, and its frontier.

    Args:
        grid: section.key=v1,v2,... items, e.g. train.kl_coef=0.02,0.05,0.15,0.3 and train.algo=ppo,rloo.
        profile: demo or a profiles/NAME.yaml, for every point.
        overrides: section.key=value items for every point.
        concurrency: points at once (with point_deployment; in this workspace they run one at a time).
        point_deployment: run each point as a run of this deployment (e.g. rlhf-pipeline/point), on its pool.
        wait_for_lock_s: how long a point waits while another run holds this workspace.
    """
    root, logger = Path.cwd(), get_run_logger()
    if concurrency < 1:
        return Failed(message=f"concurrency must be at least 1, not {concurrency}")
    if concurrency > 1 and not point_deployment:
        logger.warning("concurrency %d needs point_deployment (one workspace runs one point at a time); "
                       "running one at a time here", concurrency)
    restored = restore_after_killed_run(root)  # a point killed with -9 left its overrides in params.yaml
    if restored:
        logger.warning("%s", restored)
    try:
        key, points = plan(root, profile, list(overrides), list(grid))
    except (GridError, ParamsError) as err:
        logger.error("%s", err)
        return Failed(message=str(err))
    saved = read_json_object(state_path(root, key)) or {
        "key": key, "profile": profile, "overrides": list(overrides), "grid": list(grid), "points": {}}
    done = {label for label, p in saved["points"].items() if p["status"] == "FINISHED"}
    todo = [p for p in points if p.label not in done]
    logger.info("sweep %s: %d points; %d finished earlier (kept, not rerun), %d to run", key, len(points),
                len(points) - len(todo), len(todo))
    try:
        sweep = _open_sweep_run(root, key, profile, list(overrides), list(grid), len(points),
                                saved.get("mlflow_run_id"))
    except TrackingError as err:
        logger.error("%s", err)
        return Failed(message=str(err))
    parent = saved["mlflow_run_id"] = sweep.run_id
    write_json(state_path(root, key), saved)

    def run_one(point: Point) -> tuple[State, dict | None]:
        parameters = _point_parameters(profile, list(overrides), point, parent, wait_for_lock_s)
        if point_deployment:
            return _run_on_pool(root, point_deployment, parameters, parent, concurrency)
        return _run_here(root, parameters, parent)

    try:
        with interrupt.stop_on_signals():
            stopped = _run_points(root, todo, saved, run_one, concurrency if point_deployment else 1)
    except BaseException:  # a crash still ends the sweep's MLflow run (FAILED), never leaves it RUNNING
        _end_after_crash(sweep, root, logger)
        raise
    report = write_frontier(root, saved)
    failed = [label for label, p in saved["points"].items() if p["status"] != "FINISHED"]
    status = "KILLED" if stopped is not None else "FAILED" if failed else "FINISHED"
    try:
        _close_sweep_run(sweep, root, status, report)
    except TrackingError as lost:  # the frontier is in reports/sweep/; rerunning the sweep sends it again
        logger.error("%s", lost)
        if stopped is None and not failed:
            return Failed(message=f"{lost} The points are finished: rerun the same sweep to send it.")
    if report is not None:
        create_markdown_artifact(frontier_markdown(report), key="rlhf-sweep-frontier",
                                 description="the sweep's candidates, Gao et al. fit and the gate's pick")
    if stopped is not None:
        return Cancelled(message=f"{stopped.message}; rerun the same sweep to resume at its first unfinished point")
    summary = {"sweep": key, "points": len(points), "finished": len(points) - len(failed), "failed": failed,
               "frontier": str(Path(SWEEP_DIR) / "frontier.json") if report else None,
               "gate_pick": report["gate_pick"] if report else None, "mlflow_run_id": parent,
               "mlflow_url": run_url(parent, root) if parent else None}
    if failed:
        return Failed(message=f"{len(failed)} of {len(points)} points failed: {', '.join(failed)} "
                              f"(reports/sweep/{key}.json); rerun the sweep to retry them", data=summary)
    return Completed(data=summary, message=f"{len(points)} points; the gate picks {summary['gate_pick']}")

