"""`rlhf models list | compare | promote`: the MLflow model registry of trained policies.

Reads the store of this workspace (`sqlite:///./mlflow.db`) or `MLFLOW_TRACKING_URI`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import typer

app = typer.Typer(help="The MLflow model registry: list, compare and promote policy versions.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

Name = Annotated[str | None, typer.Option("--name", help="Registered model [default: params.yaml register.model_name]")]
HEADLINE = ("win_rate_rm", "win_rate_gold", "mean_kl", "mean_score_rm", "mean_score_gold", "eos_rate", "mean_length")


def _model_name(name: str | None) -> str:
    if name:
        return name
    from tasks.common.params import load_params

    return load_params(".").register.model_name


def _versions(client, name: str) -> list:
    """All versions of `name`, newest first; exits with a message when there are none."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except MlflowException as err:
        typer.echo(f"error: {err.message}", err=True)
        raise typer.Exit(2) from None
    if not versions:
        typer.echo(f"no versions of {name!r} in {_uri()}; run the pipeline (it registers the policy) first", err=True)
        raise typer.Exit(1)
    return sorted(versions, key=lambda v: int(v.version), reverse=True)


def _uri() -> str:
    from tasks.common.mlflow_store import tracking_uri

    return tracking_uri(".")


def _client():
    from tasks.common.mlflow_store import TrackingError, get_client

    try:
        return get_client(".")
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
    """The gate's decision at registration, and a later manual promotion (the aliases say what holds now)."""
    decision = version.tags.get("decision", "-")
    by = version.tags.get("promoted_by")
    return f"{decision}; promoted by {by}" if by and by != "register stage" else decision


def _champion_before(version) -> str:
    before = version.tags.get("champion_before")
    if before in (None, "none"):
        return "-" if before is None else "none"
    return (f"v{before} ({_fmt(version.tags.get('champion_primary'))} at KL "
            f"{_fmt(version.tags.get('champion_mean_kl'))})")


# rows of `compare` after the metrics: the gate's settings and decision, as tags of the version
GATE_ROWS = (("primary metric", "primary_metric"), ("KL budget (max_kl)", "max_kl"),
             ("tie margin", "tie_margin"), ("min primary", "min_primary"))


@app.command("list")
def list_versions(name: Name = None) -> None:
    """Versions, newest first: aliases, the gate's decision and the figures behind it, the overrides, when."""
    from rich.console import Console
    from rich.table import Table

    client, name = _client(), _model_name(name)
    versions, aliases = _versions(client, name), _aliases(client, name)
    table = Table(title=f"{name} · {_uri()}")
    for column in ("version", "aliases", "gate at registration", "primary metric", "value", "mean_kl", "max_kl",
                   "vs champion", "overrides", "created"):
        table.add_column(column)
    for v in versions:
        metric = v.tags.get("primary_metric", "")
        created = datetime.fromtimestamp(v.creation_timestamp / 1000).strftime("%Y-%m-%d %H:%M")
        version = str(v.version)
        table.add_row(version, ", ".join(sorted(aliases.get(version, []))) or "-", _gate(v),
                      metric or "-", _fmt(v.tags.get(f"eval.{metric}")), _fmt(v.tags.get("eval.mean_kl")),
                      _fmt(v.tags.get("max_kl")), _champion_before(v), _overrides(v), created)
    Console(width=200).print(table)


@app.command()
def compare(versions: Annotated[list[str] | None, typer.Argument(help="Versions to compare [default: all]")] = None,
            name: Name = None) -> None:
    """Evaluation metrics, the gate's figures and decision, and the overrides of versions side by side."""
    from rich.console import Console
    from rich.table import Table

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
    metrics = sorted({k.removeprefix("eval.") for v in found for k in v.tags if k.startswith("eval.")},
                     key=lambda k: (k not in HEADLINE, HEADLINE.index(k) if k in HEADLINE else 0, k))
    table = Table(title=f"{name}: evaluation of each version (metrics/eval.json at registration) and its gate")
    table.add_column("metric")
    for v in found:
        table.add_column(f"v{v.version} " + " ".join(f"@{a}" for a in sorted(aliases.get(str(v.version), []))),
                         justify="right")
    for metric in metrics:
        table.add_row(metric, *[_fmt(v.tags.get(f"eval.{metric}")) for v in found])
    table.add_section()
    for label, tag in GATE_ROWS:
        table.add_row(label, *[_fmt(v.tags.get(tag)) for v in found])
    table.add_row("champion before", *[_champion_before(v) for v in found])
    table.add_row("decision", *[_gate(v) for v in found])
    table.add_row("reason", *[v.tags.get("reason", "-") for v in found])
    table.add_row("overrides", *[_overrides(v) for v in found])
    Console(width=200).print(table)


@app.command("promote")
def promote_version(version: Annotated[str, typer.Argument(help="The version to make champion")],
                    name: Name = None,
                    reason: Annotated[str, typer.Option(help="Why, recorded on the version")] = "promoted by hand",
                    ) -> None:
    """Move the champion alias to VERSION, recording who promoted it, when and why."""
    from tasks.stages.register import current_user, promote

    client, name = _client(), _model_name(name)
    known = {str(v.version) for v in _versions(client, name)}
    if version not in known:
        typer.echo(f"error: {name} has no version {version}; versions: {', '.join(sorted(known, key=int))}", err=True)
        raise typer.Exit(2)
    former = promote(client, name, version, by=current_user(), reason=reason)
    typer.echo(f"{name}: champion {'v' + former if former else '(none)'} -> v{version}")
