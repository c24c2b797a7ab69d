"""`rlhf sweep`: the pipeline over a grid of params as the Prefect flow rlhf-sweep (flows/sweep.py), then the
reward–KL frontier it draws (reports/sweep/frontier.{json,png})."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from cli.preflight import check_servers_or_exit, ready_the_run, say_local_edits

Grid = Annotated[list[str], typer.Option("--grid", help="A param and its values: section.key=v1,v2,... "
                                                          "(repeat for a grid over several).")]


def sweep(grid: Grid,
          profile: Annotated[str | None, typer.Option(help="Profile for every point (profiles/NAME.yaml).")] = None,
          overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a parameter for every "
                                                                            "point: section.key=value.")] = None,
          concurrency: Annotated[int, typer.Option(min=1, help="Points at once; > 1 needs --deployment (one "
                                                               "workspace runs one point at a time).")] = 1,
          deployment: Annotated[str, typer.Option(help="Run each point as a run of this deployment "
                                                       "(e.g. rlhf-pipeline/point) on its work pool.")] = "",
          wait: Annotated[float, typer.Option(min=0, help="Seconds a point waits while another run holds "
                                                          "this workspace.")] = 600.0) -> None:
    """Run the pipeline for every point of a grid, then draw the reward–KL frontier.

    Each point is a DVC experiment and an MLflow run under one sweep run; the shared stages run once. Rerun
    the same command after an interruption: finished points are kept and the sweep resumes at the first
    unfinished one.
    """
    from flows.prefect_env import temporary_server_if_needed, use_local_prefect
    from flows.sweep import GridError, plan
    from tasks.parameters.params import ParamsError, load_params
    from tasks.tracking.progress import quiet_libraries

    root = Path.cwd()
    if concurrency > 1 and not deployment:
        typer.echo("error: --concurrency > 1 needs --deployment: one workspace runs one point at a time",
                   err=True)
        raise typer.Exit(2)
    try:  # a bad grid or point fails now, naming it, before Prefect starts
        profile = load_params(root, profile, overrides or []).base.profile
        _, points = plan(root, profile, overrides or [], grid)
    except (GridError, ParamsError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"sweep: {len(points)} points ({', '.join(p.label for p in points)})", err=True)
    check_servers_or_exit()
    say_local_edits(root)
    use_local_prefect(root)
    quiet_libraries()
    from flows import interrupt

    with temporary_server_if_needed(meanwhile=functools.partial(ready_the_run, root)):
        from flows.sweep import rlhf_sweep

        state = rlhf_sweep(grid=grid, profile=profile, overrides=overrides or [], concurrency=concurrency,
                           point_deployment=deployment, wait_for_lock_s=wait, return_state=True)
    if state.is_cancelled():
        typer.echo(f"interrupted: {state.message}", err=True)
        raise typer.Exit(interrupt.exit_status(interrupt.received() or "SIGINT"))
    _print_frontier(root)
    if not state.is_completed():
        typer.echo(f"error: the sweep failed: {state.message}", err=True)
        raise typer.Exit(1)
    summary = state.result()
    if summary.get("mlflow_url"):
        typer.echo(f"MLflow: {summary['mlflow_url']}")


def _print_frontier(root: Path) -> None:
    from flows.sweep import SWEEP_DIR, frontier_text
    from rlhf_core.jsonio import read_json_object

    report = read_json_object(root / SWEEP_DIR / "frontier.json")
    if report is not None:
        typer.echo(frontier_text(report))
        typer.echo(f"frontier: {SWEEP_DIR}/frontier.json, {SWEEP_DIR}/frontier.png")
