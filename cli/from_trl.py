"""`rlhf from-trl CONFIG.yaml`: a TRL PPO / RLOO (1.9) or GRPO (1.16) recipe (TrlParser's `--config` file) as a
profile."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class TrlAlgo(str, Enum):
    ppo = "ppo"
    rloo = "rloo"
    grpo = "grpo"


def from_trl(config: Annotated[Path, typer.Argument(help="TRL's YAML config: PPOConfig / RLOOConfig / GRPOConfig, "
                                                          "ModelConfig and ScriptArguments fields, as `--config` "
                                                          "takes it.")],
             out: Annotated[Path | None, typer.Option(help="Write the profile here (e.g. profiles/NAME.yaml; "
                                                           "`rlhf run --profile NAME` reads profiles/). Without it, "
                                                           "the profile is printed.")] = None,
             algo: Annotated[TrlAlgo | None, typer.Option(help="The trainer (default: told by the fields; RLOO "
                                                                "and GRPO share most: say which when only those "
                                                                "are set).")] = None,
             accelerate_config: Annotated[Path | None, typer.Option(help="The accelerate config the recipe was "
                                                                         "launched with (processes, precision, "
                                                                         "DeepSpeed).")] = None,
             num_processes: Annotated[int | None, typer.Option(min=1, help="Processes the recipe ran on (default: "
                                                                          "the accelerate config's, else 1).")] = None,
             train_rows: Annotated[int | None, typer.Option(min=1, help="Rows of the train split, when the config "
                                                                       "sets its length in epochs.")] = None,
             force: Annotated[bool, typer.Option(help="Overwrite --out.")] = False,
             ) -> None:
    """Turn a TRL PPO, RLOO or GRPO recipe into a profile: the same batches, steps and schedule, and each behaviour
    that still differs with the setting that reproduces TRL's.

    Exit status: 0 written (warnings are printed), 2 the config cannot be converted.
    """
    from tasks.from_trl.recipe import (
        Launch,
        RecipeError,
        check_profile,
        convert,
        profile_text,
        read_trl_config,
        report_lines,
    )
    from tasks.parameters.params import ParamsError

    name = re.sub(r"[^A-Za-z0-9_-]+", "-", (out or config).stem).strip("-") or "trl"
    try:
        launch = Launch.from_accelerate_config(accelerate_config, num_processes) if accelerate_config \
            else Launch(num_processes=num_processes or 1)
        conversion = convert(read_trl_config(config), algo=algo and algo.value, launch=launch, train_rows=train_rows,
                             name=name)
        plan = check_profile(conversion)
    except (OSError, RecipeError, ParamsError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    text = profile_text(conversion, str(config), plan)
    if out is None:
        typer.echo(text, nl=False)
        return
    if out.exists() and not force:
        typer.echo(f"error: {out} exists; pass --force to overwrite it", err=True)
        raise typer.Exit(2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    typer.echo("\n".join(report_lines(conversion, plan)))
    where = f"rlhf run --profile {name}" if out.parent.name == "profiles" else f"copy it to profiles/{name}.yaml"
    typer.echo(f"\nwrote {out}: {where}")
