"""`rlhf models list | compare | promote`: the MLflow model registry of trained policies.

Reads the store of this workspace (`sqlite:///./mlflow.db`) or `MLFLOW_TRACKING_URI`. On a tracking server every
read and write is retried through an outage as the stages' are (RLHF_MLFLOW_RETRY_S); `promote` writes the record
of why before it moves the alias (tasks/stages/register.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import typer

app = typer.Typer(help="The MLflow model registry: list, compare and promote policy versions.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")

Name = Annotated[str | None, typer.Option("--name", help="Registered model [default: params.yaml register.model_name]")]
HEADLINE = ("win_rate_rm", "win_rate_gold", "mean_kl", "mean_score_rm", "mean_score_gold", "eos_rate", "mean_length")


def _model_name(name: str | None) -> str:
    if name:
        return name
    from tasks.parameters.params import load_params

    return load_params(".").register.model_name


def _versions(client, name: str) -> list:
    """All versions of `name`, newest first; exits with a message when there are none."""
    from mlflow.exceptions import MlflowException

    from tasks.tracking.mlflow_store import TrackingError

    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except (MlflowException, TrackingError) as err:
        typer.echo(f"error: {getattr(err, 'message', err)}", err=True)
        raise typer.Exit(2) from None
    if not versions:
        typer.echo(f"error: no versions of {name!r} in {_uri()}; run the pipeline (it registers the policy) first",
                   err=True)
        raise typer.Exit(1)
    return sorted(versions, key=lambda v: int(v.version), reverse=True)


def _uri() -> str:
    from tasks.tracking.mlflow_store import tracking_uri

    return tracking_uri(".")


def _client():
    """The store's client; on a server each call retried through an outage (mlflow_tracker.retrying_client)."""
    from tasks.tracking.mlflow_store import TrackingError
    from tasks.tracking.mlflow_tracker import retrying_client

    try:
        return retrying_client(".")
    except TrackingError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def _aliases(client, name: str) -> dict[str, list[str]]:
    """version -> its aliases (read from the registered model: versions found by search may omit them)."""
    out: dict[str, list[str]] = {}
    for alias, version in client.get_registered_model(name).aliases.items():
        out.setdefault(str(version), []).append(alias)
    return out


def _fmt(value: str | None) -> str:
    if value is None:
        return "-"
    try:
        return f"{float(value):.4g}"
    except ValueError:
        return value


def _overrides(version) -> str:
    """The `--set` overrides of the run that registered the version ('-' for none or unknown)."""
    import json

    items = json.loads(version.tags.get("rlhf.overrides", "[]") or "[]")
    return " ".join(items) or "-"


def _gate(version) -> str:
    """The gate's decision at registration, and the last promotion by hand (the aliases say what holds now)."""
    from tasks.tracking.registry import DECISION_TAG, last_promotion, tag

    decision = tag(version, DECISION_TAG, "-")
    last = last_promotion(version)
    if last and last.get("by") != "register stage":
        return f"{decision}; promoted by {last['by']}" + (" (forced)" if last.get("overrides") else "")
    return decision


def _champion_before(version) -> str:
    from tasks.tracking.registry import BEFORE_TAG

    if BEFORE_TAG in version.tags:
        return version.tags[BEFORE_TAG]
    before = version.tags.get("champion_before")  # a version registered before the gate.* tags
    if before in (None, "none"):
        return "-" if before is None else "none"
    return (f"v{before} ({_fmt(version.tags.get('champion_primary'))} at KL "
            f"{_fmt(version.tags.get('champion_mean_kl'))})")


def _console():
    """A console as wide as the terminal (COLUMNS where set; 80 when the output is not a terminal)."""
    from rich.console import Console

    return Console()


@app.command("list")
def list_versions(name: Name = None) -> None:
    """Versions, newest first: aliases, the gate's decision, its figures and reason, the overrides, when."""
    from rich import box
    from rich.table import Table

    from tasks.tracking.registry import KL_TAG, METRIC_TAG, PRIMARY_TAG, REASON_TAG, tag

    client, name = _client(), _model_name(name)
    versions, aliases = _versions(client, name), _aliases(client, name)
    metrics = {tag(v, METRIC_TAG) or "-" for v in versions}
    one_metric = metrics.pop() if len(metrics) == 1 else None  # else each value names its metric
    table = Table(title=f"{name} · {_uri()}" + (f" · primary metric: {one_metric}" if one_metric else ""),
                  box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    # cells wrap to the terminal's width (nothing is cut off); the figures keep one line, and the columns beside
    # the reason are capped so that the reason gets the room
    for column, cap in (("version", None), ("aliases", 20), ("gate", 30), ("primary", None), ("mean_kl", None),
                        ("reason", None), ("overrides", 24), ("created", None)):
        table.add_column(column, overflow="fold", max_width=cap,
                         no_wrap=column in ("version", "primary", "mean_kl", "created"))
    for v in versions:
        created = datetime.fromtimestamp(v.creation_timestamp / 1000).strftime("%m-%d %H:%M")
        version, primary = str(v.version), _fmt(tag(v, PRIMARY_TAG))
        table.add_row(version, ", ".join(sorted(aliases.get(version, []))) or "-", _gate(v),
                      primary if one_metric else f"{tag(v, METRIC_TAG) or '-'} {primary}", _fmt(tag(v, KL_TAG)),
                      tag(v, REASON_TAG) or "-", _overrides(v), created)
    _console().print(table)


@app.command()
def compare(versions: Annotated[list[str] | None, typer.Argument(help="Versions to compare [default: all]")] = None,
            name: Name = None) -> None:
    """Evaluation metrics, the gate's figures and decision, and the overrides of versions side by side."""
    from rich.table import Table

    from tasks.tracking.registry import METRIC_TAG, REASON_TAG, eval_figures, tag

    client, name = _client(), _model_name(name)
    found, aliases = _versions(client, name), _aliases(client, name)
    if versions:
        unknown = sorted(set(versions) - {str(v.version) for v in found})
        if unknown:
            typer.echo(f"error: {name} has no version {', '.join(unknown)}; versions: "
                       f"{', '.join(str(v.version) for v in found)}", err=True)
            raise typer.Exit(2)
        found = [v for v in found if str(v.version) in versions]
    found = sorted(found, key=lambda v: int(v.version))
    figures = [eval_figures(client, v) for v in found]
    metrics = sorted({k for f in figures for k in f},
                     key=lambda k: (k not in HEADLINE, HEADLINE.index(k) if k in HEADLINE else 0, k))
    table = Table(title=f"{name}: evaluation of each version (metrics/eval.json at registration) and its gate")
    table.add_column("metric")
    for v in found:
        table.add_column(f"v{v.version} " + " ".join(f"@{a}" for a in sorted(aliases.get(str(v.version), []))),
                         justify="right")
    for metric in metrics:
        table.add_row(metric, *[_fmt(None if metric not in f else str(f[metric])) for f in figures])
    table.add_section()
    table.add_row("primary metric", *[tag(v, METRIC_TAG) or "-" for v in found])
    table.add_row("gate settings", *[_settings(v) for v in found])
    table.add_row("champion before", *[_champion_before(v) for v in found])
    table.add_row("decision", *[_gate(v) for v in found])
    table.add_row("reason", *[tag(v, REASON_TAG) or "-" for v in found])
    table.add_row("overrides", *[_overrides(v) for v in found])
    _console().print(table)


def _settings(version) -> str:
    from tasks.tracking.registry import SETTINGS_TAG

    if SETTINGS_TAG in version.tags:
        return version.tags[SETTINGS_TAG]
    return " ".join(f"{k}={_fmt(version.tags[k])}" for k in ("max_kl", "min_primary", "tie_margin")
                    if k in version.tags) or "-"


@app.command("promote")
def promote_version(version: Annotated[str, typer.Argument(help="The version to make champion")],
                    name: Name = None,
                    reason: Annotated[str | None, typer.Option(help="Why, recorded in the version's champion "
                                                                    "history (required with --force)")] = None,
                    force: Annotated[bool, typer.Option("--force", help="Promote a version the gate rejected at "
                                                                        "registration (needs --reason)")] = False,
                    ) -> None:
    """Move the champion alias to VERSION, recording who promoted it, when and why (the history is kept).

    A version the gate rejected at registration is promoted only with --force and a --reason."""
    from tasks.stages.register import current_user, promote
    from tasks.tracking.mlflow_store import TrackingError
    from tasks.tracking.registry import CHAMPION, DECISION_TAG, REASON_TAG, champion_of, tag

    client, name = _client(), _model_name(name)
    found = {str(v.version): v for v in _versions(client, name)}
    if version not in found:
        typer.echo(f"error: {name} has no version {version}; versions: {', '.join(sorted(found, key=int))}", err=True)
        raise typer.Exit(2)
    chosen = found[version]
    champion = champion_of(client, name)
    if champion is not None and str(champion.version) == version:  # no second "promoted" in its history
        typer.echo(f"{name} v{version} is already the champion: nothing changed")
        return
    decision = tag(chosen, DECISION_TAG)
    overrides = None
    if decision not in (None, CHAMPION):
        overrides = f"{decision}: {tag(chosen, REASON_TAG, 'no reason recorded')}"
        if not force or not reason:
            typer.echo(f"error: the gate rejected {name} v{version} at registration ({overrides}). To promote it "
                       f"anyway, pass --force with a --reason saying why", err=True)
            raise typer.Exit(2)
        typer.echo(f"overriding the gate's decision at registration: {overrides}")
    try:
        former = promote(client, name, version, by=current_user(), reason=reason or "promoted by hand",
                         overrides=overrides)
    except TrackingError as err:  # an outage past RLHF_MLFLOW_RETRY_S, or a write refused: what was done, what not
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{name}: champion {'v' + former if former else '(none)'} -> v{version}")
