"""`rlhf exps`: the DVC experiments as a table a person reads: the params that matter beside the metrics.

`dvc exp show` puts every param and metric in a column (over 250 here, each cut to "…"). This view keeps the
profile and algorithm, the params whose values differ between the rows shown, and the headline metrics of
the evaluation, in 100 columns. Every override run of `rlhf run` is a DVC experiment (flows/overrides.py: save_experiment),
so its row pairs the run's params with its results. The workspace row takes its params from dvc.lock, the
params its results were made with, not from params.yaml, which an override run has put back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Annotated

import typer

from tasks.parameters.params import flatten

ALWAYS = ("base.profile", "train.algo")  # params shown in every table
METRICS = {  # column title: (metrics file, key)
    "win_gold": ("metrics/eval.json", "win_rate_gold"),
    "win_rm": ("metrics/eval.json", "win_rate_rm"),
    "eval_kl": ("metrics/eval.json", "mean_kl"),
    "eos": ("metrics/eval.json", "eos_rate"),
    "len": ("metrics/eval.json", "mean_length"),
}
IGNORED = ("base.run_overrides",)  # written by a run for that run only (its overrides that the profile sets)
MAX_PARAMS = 6  # changed params beyond these are named below the table (`--param` shows one as a column)
WIDTH = 100  # the table and its notes fit this many columns
MAX_NAME, MIN_NAME = 36, 20  # an experiment name is cut to MAX_NAME characters, then to MIN_NAME, to fit WIDTH


def _locked_params(root: Path) -> dict:
    """params.yaml's values as dvc.lock records them: what the workspace's results were made with."""
    from ruamel.yaml import YAML

    lock = root / "dvc.lock"
    # read as DVC reads it (YAML 1.2: `no` is a string; PyYAML's YAML 1.1 would say False)
    stages = (YAML(typ="safe", pure=True).load(lock.read_text()) or {}).get("stages", {}) if lock.is_file() else {}
    out = {}
    for stage in stages.values():
        out.update(flatten(stage.get("params", {}).get("params.yaml", {})))
    return out


def _row(entry: dict, name: str) -> dict:
    data = entry.get("data") or {}
    params = flatten((data.get("params") or {}).get("params.yaml", {}).get("data"))
    metrics = {title: ((data.get("metrics") or {}).get(file, {}).get("data") or {}).get(key)
               for title, (file, key) in METRICS.items()}
    return {"name": name, "created": (data.get("timestamp") or "-")[5:16] or "-", "params": params,
            "metrics": metrics}


def collect(root: Path) -> list[dict]:
    """The workspace, each baseline commit and its experiments, from `dvc exp show --json`."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=root, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip()[-1000:])
    rows = []
    for entry in json.loads(proc.stdout or "[]"):
        if entry.get("rev") == "workspace":
            row = _row(entry, "workspace")
            locked = _locked_params(root)
            row["unlocked"] = sorted(k for k in set(locked) & set(row["params"]) if locked[k] != row["params"][k])
            row["params"] = {**row["params"], **locked}  # its results' params, not the restored params.yaml
            rows.append(row)
            continue
        rows.append(_row(entry, entry.get("name") or entry["rev"][:7]))
        for experiment in entry.get("experiments") or []:
            rev = experiment["revs"][0]
            rows.append(_row(rev, f"  {experiment.get('name') or rev.get('name') or rev['rev'][:7]}"))
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[dict], extra: list[str], width: int = WIDTH) -> str:
    """The rows as a fixed-width text table, with the params that differ between them, in `width` columns: the
    middle of long experiment names goes first, then the changed params that do not fit (named below the table;
    the `created` column goes instead if that keeps more of them); the notes wrap."""
    keys = sorted({k for row in rows for k in row["params"]} - set(IGNORED))
    changed = [k for k in keys if len({json.dumps(r["params"].get(k)) for r in rows}) > 1 and k not in ALWAYS]
    fixed = [*ALWAYS, *[k for k in extra if k not in ALWAYS]]
    optional = [k for k in changed if k not in extra][:MAX_PARAMS]
    metric_titles = [t for t in METRICS if any(r["metrics"][t] is not None for r in rows)]
    longest = max(len(r["name"]) for r in [{"name": "experiment"}, *rows])

    def fit(names: int, created: bool) -> tuple[list[str], list[str]]:
        """The changed params that fit beside the others, in order (greedy), and the lines with them."""
        kept = []
        for key in optional:
            if _width(_lines(rows, [*fixed, *kept, key], metric_titles, created, names)) <= width:
                kept.append(key)
        return kept, _lines(rows, [*fixed, *kept], metric_titles, created, names)

    # a sweep's names repeat its params: cut their middle first, then give up `created` if a param column gains
    names = longest if _width(_lines(rows, [*fixed, *optional], metric_titles, True, longest)) <= width \
        else min(longest, MAX_NAME)
    optional, lines = max((fit(names, True), fit(names, False)), key=lambda kept_lines: len(kept_lines[0]))
    while _width(lines) > width and names > MIN_NAME:  # the fixed columns alone are wider: shorter names
        names -= 1
        optional, lines = fit(names, False)
    shown = [*fixed, *optional]
    # the columns always there, apart from those there because the rows differ in them
    notes = [f"columns: {', '.join(fixed)}" + (f"; differing between the rows: {', '.join(optional)}" if optional
                                               else "")]
    if hidden := [k for k in changed if k not in shown]:
        notes.append(f"also differ (--param KEY to show): {', '.join(hidden)}")
    for row in rows:
        if row.get("unlocked"):
            notes.append(f"workspace: its results were made with dvc.lock's params; params.yaml now differs in "
                         f"{', '.join(row['unlocked'])} (a plain run reruns what they feed)")
    wrapped = [textwrap.fill(note, width, subsequent_indent="  ", break_on_hyphens=False) for note in notes]
    return "\n".join([*lines, "", *wrapped])


def _lines(rows: list[dict], shown: list[str], metric_titles: list[str], with_created: bool,
           name_width: int) -> list[str]:
    header = ["experiment", *(["created"] if with_created else []), *[k.rsplit(".", 1)[-1] for k in shown],
              *metric_titles]
    body = [[_cut(r["name"], name_width), *([r["created"]] if with_created else []),
             *[_cell(r["params"].get(k)) for k in shown], *[_cell(r["metrics"][t]) for t in metric_titles]]
            for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
            for line in [header, *body]]


def _width(lines: list[str]) -> int:
    return max(map(len, lines))


def _cut(name: str, width: int) -> str:
    """`demo-ppo-kl_c…1126-150207`: both ends of a name (its settings, its start time) in `width` characters."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return f"{name[:head]}…{name[len(name) - (width - 1 - head):]}"


def exps(param: Annotated[list[str] | None, typer.Option(
        "--param", help="A param (section.key) to show as a column, e.g. train.learning_rate.")] = None) -> None:
    """The DVC experiments (every override run is one) in a readable table: profile, algorithm, the params
    that differ, and the evaluation's win rates, KL, EOS rate and length. `dvc exp show` has every column."""
    try:
        rows = collect(Path.cwd())
    except RuntimeError as err:
        typer.echo(f"error: dvc exp show failed: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(table(rows, list(param or [])))
