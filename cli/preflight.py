"""What `rlhf run` and `rlhf sweep` do before their flow starts: fail fast on a server that does not answer, say
which local edits of params.yaml the run uses, and ready the flow while the temporary Prefect server starts."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer


def ready_the_run(root: Path) -> None:
    """What `rlhf run` does first anyway, done while the temporary Prefect server starts in its own process
    (~15 s): import the flow (~2.5 s) and open the MLflow store (~3.5 s of imports; in a fresh clone its
    migrations too). A store that cannot be opened is the flow's to report, as it does without this."""
    import flows.pipeline  # noqa: F401
    from tasks.tracking.mlflow_store import TrackingError, get_client, tracking_enabled

    if tracking_enabled():
        with contextlib.suppress(TrackingError):
            get_client(root)  # cached: the flow's pipeline run reuses this client


def check_servers_or_exit(prefect_only: bool = False) -> None:
    """Exit 2 naming the server when PREFECT_API_URL or MLFLOW_TRACKING_URI is set and does not answer."""
    from flows.servers import ServerUnreachable, check_prefect, check_servers

    try:
        check_prefect() if prefect_only else check_servers()
    except ServerUnreachable as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def say_local_edits(root) -> None:
    """Up front: a params.yaml edited since the last commit is what this run uses (not the committed one)."""
    from flows.overrides import describe, local_edits

    edits = local_edits(root)
    if edits:
        typer.echo(f"note: params.yaml differs from the committed one and this run uses it: {describe(edits)} "
                   "(`rlhf params diff`, `rlhf params reset`)", err=True)
