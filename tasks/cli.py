"""The `rlhf` command line. Heavy libraries are imported inside the commands that need them."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated

import typer

app = typer.Typer(help="An orchestrated, reproducible RLHF pipeline (PPO, RLOO) for causal LMs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """An orchestrated, reproducible RLHF pipeline (PPO, RLOO) for causal LMs."""


class Algo(str, Enum):
    ppo = "ppo"
    rloo = "rloo"


@app.command()
def bench(algo: Annotated[Algo, typer.Option(help="Policy-gradient algorithm to time.")] = Algo.ppo,
          updates: Annotated[int, typer.Option(min=1, help="Updates of 64 episodes to time.")] = 5,
          as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line, not a table.")] = False,
          ) -> None:
    """Throughput of the trainer on the fixed bench-tiny world (see rlhf_core/bench.py)."""
    from rlhf_core.bench import run_bench

    result = run_bench(algo.value, updates)
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench-tiny · {algo.value} · {result['updates']} updates")
    for key in ("episodes", "train_s", "episodes_per_s", "peak_rss_mib"):
        table.add_row(key, str(result[key]))
    for key in ("objective/scores", "objective/kl", "time/rollout_s", "time/update_s"):
        table.add_row(key, f"{result['metrics'][key]:.4g}")
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
