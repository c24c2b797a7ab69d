"""`rlhf params diff | reset`: see or drop the local edits of params.yaml (against the committed file)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="params.yaml against the committed one: diff, reset.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")


def _edits() -> list:
    from flows.overrides import local_edits

    return local_edits(Path.cwd())


def _print(edits: list) -> None:
    for key, committed, now in edits:
        typer.echo(f"{key}: {committed!r} -> {now!r}")


@app.command()
def diff() -> None:
    """Values of params.yaml that differ from the committed file (git HEAD); a plain run uses them."""
    from flows.lock import held_by_another
    from flows.overrides import RESTORE_NOTE

    if (Path.cwd() / RESTORE_NOTE).is_file():
        if live := held_by_another(Path.cwd()):
            typer.echo(f"a run in progress ({live}) has its overrides in params.yaml for its stages; they go when "
                       "it ends")
        else:
            typer.echo(f"an interrupted run left its overrides in params.yaml ({RESTORE_NOTE}); the next run, or "
                       "`rlhf params reset`, restores it")
    edits = _edits()
    if not edits:
        typer.echo("params.yaml is as committed")
        return
    _print(edits)


@app.command()
def reset() -> None:
    """Put params.yaml back as committed (git HEAD), dropping local edits and an interrupted run's overrides."""
    import subprocess

    from flows.lock import held_by_another
    from flows.overrides import RESTORE_NOTE
    from tasks.parameters.params import PARAMS_FILE

    if live := held_by_another(Path.cwd()):
        typer.echo(f"error: a run in progress holds this workspace ({live}); its stages read params.yaml, which "
                   "it puts back itself when it ends. Reset after it, or run in a separate clone.", err=True)
        raise typer.Exit(2)
    edits = _edits()
    committed = subprocess.run(["git", "show", f"HEAD:{PARAMS_FILE}"], capture_output=True, text=True)
    if committed.returncode != 0:
        typer.echo(f"error: no committed {PARAMS_FILE} here: {committed.stderr.strip()}", err=True)
        raise typer.Exit(2)
    Path(PARAMS_FILE).write_text(committed.stdout)
    (Path.cwd() / RESTORE_NOTE).unlink(missing_ok=True)
    if edits:
        typer.echo(f"{PARAMS_FILE} reset to the committed file; dropped:")
        _print(edits)
    else:
        typer.echo(f"{PARAMS_FILE} was already as committed")
