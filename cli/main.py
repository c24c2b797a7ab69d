"""The `rlhf` command line. Heavy libraries are imported inside the commands that need them."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from typer.core import TyperGroup

from cli.committed_results import say_rewritten_results, unchanged_results
from cli.exps import exps
from cli.from_trl import from_trl
from cli.models import app as models_app
from cli.params import app as params_app
from cli.preflight import check_servers_or_exit, ready_the_run, say_local_edits
from cli.sweep import sweep


@contextmanager
def _usage_errors_said_as_ours() -> Iterator[None]:
    """Click's own errors (an unknown option or command, a bad value, a missing argument) said as the commands say
    theirs: `error: ...` on stderr, then the usage, exit status 2. Typer drew them in a box titled "Error", beside
    the commands' `error:` lines: two voices in one program."""
    try:
        yield
    except typer.TyperException as err:  # click's ClickException and its usage errors, as typer vendors them
        if type(err).__name__ == "NoArgsIsHelpError":  # `rlhf` alone: its help is printed already
            raise
        message = err.format_message().strip().replace("Value error, ", "")  # typer's validation says it of a choice
        if len(message) > 1 and message[0].isupper() and message[1].islower():  # "No such option" -> "no such ..."
            message = message[0].lower() + message[1:]
        typer.echo(f"error: {message.removesuffix('.')}", err=True)
        ctx = getattr(err, "ctx", None)
        if ctx is not None:
            usage = ctx.get_usage().removeprefix("Usage: ")
            typer.echo(f"usage: {usage}  ({ctx.command_path} {ctx.help_option_names[0]} for more)", err=True)
        raise typer.Exit(getattr(err, "exit_code", 1)) from None


class _Rlhf(TyperGroup):
    """The `rlhf` command group: usage errors in the commands' voice (_usage_errors_said_as_ours), wherever click
    finds them: parsing this group's arguments, or a command's (inside invoke)."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _usage_errors_said_as_ours():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with _usage_errors_said_as_ours():
            return super().invoke(ctx)


app = typer.Typer(help="An orchestrated, reproducible RLHF pipeline (PPO, RLOO, GRPO) for causal LMs.", cls=_Rlhf,
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")  # paragraphs of a docstring reflow to the terminal


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rlhf-pipeline {version('rlhf-pipeline')}")
        raise typer.Exit()


@app.callback()
def _root(_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                 help="Print the version and exit.")] = False) -> None:
    """An orchestrated, reproducible RLHF pipeline (PPO, RLOO, GRPO) for causal LMs."""


class Algo(str, Enum):
    ppo = "ppo"
    rloo = "rloo"
    grpo = "grpo"


@app.command()
def bench(algo: Annotated[Algo, typer.Option(help="Policy-gradient algorithm to time.")] = Algo.ppo,
          updates: Annotated[int, typer.Option(min=1, help="Updates of 64 episodes to time.")] = 5,
          as_json: Annotated[bool, typer.Option("--json", help="Print one JSON line, not a table.")] = False,
          ) -> None:
    """Throughput of the trainer on the fixed bench-tiny world (see rlhf_core/bench.py)."""
    from rlhf_core.bench import run_bench
    from rlhf_core.threads import fit_threads

    fit_threads(adapt=True)  # a speed measurement beside whatever runs now; it writes no result
    result = run_bench(algo.value, updates)
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench-tiny · {algo.value} · {result['updates']} updates")
    for key in ("episodes", "train_s", "episodes_per_s", "peak_rss_mib", "model_gflop_per_s",
                "peak_matmul_gflop_per_s", "mfu"):
        table.add_row(key, str(result[key]))
    for phase, seconds in result["phases_s"].items():
        table.add_row(f"{phase} s/update (median)", f"{seconds:.4g}")
    for key in ("objective/scores", "objective/kl"):
        if key in result["metrics"]:  # GRPO at beta 0 has no reference, so no KL to it
            table.add_row(key, f"{result['metrics'][key]:.4g}")
    Console().print(table)


Overrides = Annotated[list[str] | None, typer.Option("--set", help="Override a parameter: section.key=value.")]
Profile = Annotated[str | None, typer.Option(help="Profile overriding params.yaml (profiles/NAME.yaml).")]


@app.command()
def stage(name: Annotated[str, typer.Argument(help="prepare | validate | sft | reward-model | inspect | train | evaluate | register")],
          profile: Profile = None, overrides: Overrides = None) -> None:
    """Run one pipeline stage in this workspace (what dvc.yaml calls).

    With runtime.num_processes > 1 or runtime.accelerate_config, sft, reward-model and train relaunch
    themselves on that many processes (torchrun on the CPU, accelerate launch on GPUs).
    """
    from tasks.execution.outcome import recorded_outcome
    from tasks.execution.stage_server import run_in_server
    from tasks.runner import end_launched_rank

    # a flow's warm server runs it when there is one, as it runs a launched stage's ranks (stage_server.py)
    status = run_in_server(["stage", name, *_stage_args(profile, overrides)])
    if status is not None:
        raise typer.Exit(status)
    with recorded_outcome():  # for the flow: whether a retry can fix a failure (tasks/execution/transient.py)
        _stage(name, profile, overrides)
    end_launched_rank()  # a rank that finished leaves without the interpreter's teardown


def _stage_args(profile: str | None, overrides: list[str] | None) -> list[str]:
    return [*(["--profile", profile] if profile else []), *(x for item in overrides or [] for x in ("--set", item))]


def _stage(name: str, profile: str | None, overrides: list[str] | None) -> None:
    # light imports only: a stage loads torch and the model code itself when it needs them
    from tasks.checks.model_checks import check_lora_settings
    from tasks.execution.errors import StageFailed
    from tasks.execution.launcher import is_main_process, launch_command, run_launched
    from tasks.parameters.params import ParamsError, load_params
    from tasks.runner import check_stage_name, on_ray, run_stage

    args = _stage_args(profile, overrides)
    try:
        check_stage_name(name)
        params = load_params(".", profile, overrides or [])
        runtime = params.runtime
        if name == "train":  # a batch the processes cannot fill fails now, not after the models load
            from rlhf_core.config import BatchPlan

            BatchPlan.derive(params.rl_config(), runtime.num_processes)
            check_lora_settings(params, ".")  # LoRA settings against the policy's config, before the launch
        command = launch_command(runtime, name, args)
        if on_ray(runtime, name):  # this process will drive the ranks on the cluster: it must answer first
            from tasks.execution.ray_launch import check_cluster

            check_cluster(runtime)
    except (ParamsError, ValueError) as err:  # a RuntimeSettingError is a ValueError
        typer.echo(f"error: {err}", err=True)
        from tasks.execution.put_back import put_back_missing

        put_back_missing(name)  # under plain `dvc repro` its outputs are deleted already: the last good come back
        raise typer.Exit(2) from None
    if command is not None:
        raise typer.Exit(run_launched(command, runtime))
    try:
        metrics = run_stage(name, ".", profile, overrides or [])
    except StageFailed as err:  # a message, not a traceback
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # Ctrl-C, or the flow stopping it: its MLflow run is already marked KILLED
        typer.echo(f"stage {name}: interrupted", err=True)
        raise typer.Exit(130) from None
    if is_main_process():  # one result, whatever the number of ranks
        typer.echo(json.dumps(metrics, indent=2, sort_keys=True))


@app.command()
def run(profile: Profile = None, overrides: Overrides = None,
        wait: Annotated[float, typer.Option(min=0, help="Seconds to wait while another run holds this "
                                                        "workspace, then give up.")] = 600.0) -> None:
    """Run the whole pipeline as the Prefect flow rlhf-pipeline: each dvc.yaml stage through DVC.

    Overrides are in params.yaml for this run only: the file is restored when the run ends. With no
    PREFECT_API_URL the flow runs on a temporary local Prefect server whose state is kept in .prefect/.
    """
    from flows.overrides import check_run_inputs
    from flows.prefect_env import use_local_prefect
    from tasks.parameters.params import ParamsError, load_params
    from tasks.tracking.progress import quiet_libraries

    root = Path.cwd()
    try:  # fail on a bad key, a missing source file or an ignored override at once, before Prefect starts
        params = load_params(root, profile, overrides or [])
        check_run_inputs(params, root, overrides or [])
        profile = params.base.profile
    except ParamsError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    check_servers_or_exit()  # a PREFECT_API_URL or MLFLOW_TRACKING_URI that does not answer fails now, before any stage
    say_local_edits(root)
    unchanged_results_before = unchanged_results(root)
    use_local_prefect(root)
    quiet_libraries()
    from flows import interrupt
    from flows.prefect_env import temporary_server_if_needed
    from tasks.tracking.mlflow_store import tracking_enabled, tracking_uri
    from tasks.tracking.progress import print_run_summary

    started = time.time()
    with temporary_server_if_needed(meanwhile=functools.partial(ready_the_run, root)):
        from flows.pipeline import rlhf_pipeline

        try:
            state = rlhf_pipeline(profile=profile, overrides=overrides or [], wait_for_lock_s=wait, return_state=True)
        except Exception as err:  # the Prefect server stopped answering: the run record says how the run went
            _report_without_prefect(root, err, started)
    if state.is_cancelled():
        signal_name = interrupt.received() or "SIGINT"
        typer.echo(f"interrupted: {state.message}; the run is marked cancelled (reports/runs/, MLflow, Prefect). "
                   "Rerun to resume: finished stages are skipped, train resumes from its last checkpoint.", err=True)
        raise typer.Exit(interrupt.exit_status(signal_name))
    if not state.is_completed():
        typer.echo(f"error: the pipeline run failed: {state.message}", err=True)
        raise typer.Exit(1)
    print_run_summary(root, state.result(), tracking_uri(root) if tracking_enabled() else None, _registry_line(root))
    say_rewritten_results(root, unchanged_results_before)


def _report_without_prefect(root: Path, err: Exception, started: float) -> NoReturn:
    """The flow's engine could not reach the Prefect server (it died, or restarts) to report the run's state:
    the run itself ran on, and its record (reports/runs/) says how it ended. Exit as the run did, saying so."""
    import os

    from flows.servers import redact
    from rlhf_core.jsonio import read_json_object
    from tasks.execution.transient import transient_cause
    from tasks.tracking.mlflow_store import tracking_enabled, tracking_uri
    from tasks.tracking.progress import print_run_summary

    cause = transient_cause(err)
    if cause is None:
        raise err
    records = [p for p in (root / "reports" / "runs").glob("*.json") if p.stat().st_mtime >= started]
    record = read_json_object(max(records, key=lambda p: p.stat().st_mtime)) if records else None
    server = redact(os.environ.get("PREFECT_API_URL", "the Prefect server"))
    where = "the Prefect UI shows the run as it last heard of it (Running) until the server marks it Crashed"
    if record is None:
        typer.echo(f"error: {server} stopped answering ({cause}) before the run started its stages", err=True)
        raise typer.Exit(1)
    typer.echo(f"warning: {server} stopped answering during the run ({cause}); the run went on without it and "
               f"ended {record['status']}: {record.get('failure') or 'every stage done'}. Its record: "
               f"reports/runs/, MLflow run {record.get('mlflow_run_id') or '-'}; {where}.", err=True)
    if record["status"] != "FINISHED":
        raise typer.Exit(1)
    print_run_summary(root, {**record, "record": str(max(records, key=lambda p: p.stat().st_mtime))},
                      tracking_uri(root) if tracking_enabled() else None, _registry_line(root))
    raise typer.Exit(0)


def _registry_line(root) -> str | None:
    """The registered version of this run's policy, as the registry has it now (not as a file once said)."""
    from rlhf_core.jsonio import read_json_object
    from tasks.tracking.registry import registry_verdict

    report = read_json_object(root / "metrics" / "register.json")
    return None if report is None else registry_verdict(root, report)


def _serve_help() -> str:
    from flows.deployments import deployment_names

    try:
        listed = "; ".join(deployment_names())
    except (OSError, ValueError, KeyError):  # no readable prefect.yaml beside the package: say what serve reads
        listed = "those prefect.yaml lists"
    return f"""Serve the deployments in prefect.yaml against a Prefect server: {listed}.

    Start one first (`prefect server start`) and set PREFECT_API_URL (http://127.0.0.1:4200/api). Runs
    triggered from the UI or by a schedule then execute here, one at a time, in this workspace. Ctrl-C or
    SIGTERM stops serving and pauses the deployments' schedules (not when the server is already gone).
    """


@app.command()
def serve() -> None:
    # its docstring is _serve_help(), set below: the deployments as prefect.yaml lists them
    import os

    if not os.environ.get("PREFECT_API_URL"):
        typer.echo("error: PREFECT_API_URL is not set. Start a server with `prefect server start` and "
                   "`export PREFECT_API_URL=http://127.0.0.1:4200/api`, then run `rlhf serve` again.", err=True)
        raise typer.Exit(2)
    check_servers_or_exit(prefect_only=True)
    from flows.deployments import deployment_names, serve_deployments
    from flows.prefect_env import use_local_prefect
    from flows.servers import redact
    from tasks.tracking.progress import quiet_libraries

    use_local_prefect(Path.cwd())
    quiet_libraries()
    typer.echo(f"serving {', '.join(deployment_names(Path.cwd()))} against {redact(os.environ['PREFECT_API_URL'])}; "
               "runs execute here, one at a time. Ctrl-C to stop.")
    serve_deployments(Path.cwd())


serve.__doc__ = _serve_help()


class Kind(str, Enum):
    prompts = "prompts"
    sft = "sft"
    preferences = "preferences"


@app.command()
def validate(path: Annotated[str, typer.Argument(help="A dataset file: .jsonl, .json or .parquet.")],
             kind: Annotated[Kind, typer.Option(help="Which suite: prompts {prompt}, sft {prompt, completion} or "
                                                     "TRL's {messages}, preferences {prompt, chosen, rejected} or "
                                                     "TRL's implicit prompt {chosen, rejected}; also query/post, "
                                                     "summary/response, reference_response.")],
             tokenizer: Annotated[str | None, typer.Option(help="Policy tokenizer for the token-length bounds "
                                                               "(default: params.yaml prepare.tokenizer, else "
                                                               "models/tokenizer).")] = None,
             skip_token_lengths: Annotated[bool, typer.Option(help="Do not check token lengths (the report "
                                                                    "says so).")] = False,
             max_prompt_tokens: Annotated[int | None, typer.Option(min=1, help="(default: params.yaml "
                                                                       "prepare.max_prompt_tokens)")] = None,
             max_completion_tokens: Annotated[int | None, typer.Option(min=1, help="(default: params.yaml "
                                                                           "prepare.max_completion_tokens)")] = None,
             as_json: Annotated[bool, typer.Option("--json", help="Print the JSON report, not the summary.")] = False,
             ) -> None:
    """Validate a dataset file with the Great Expectations suite of its kind, in the layout `prepare` reads it.

    Exit status: 0 passed, 1 some expectation failed, 2 the file (or tokenizer) could not be read.
    """
    from tasks.stages.validate import ValidateError, check_file, summary_markdown

    try:
        report = check_file(path, kind.value, tokenizer, max_prompt_tokens, max_completion_tokens, skip_token_lengths)
    except ValidateError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(summary_markdown(report)))
    raise typer.Exit(0 if report["success"] else 1)


@app.command("inspect-rm")
def inspect_rm(model: Annotated[str, typer.Argument(help="A reward model: a save_pretrained directory or a hub id.")],
               pairs: Annotated[str | None, typer.Option(help="Held-out pairs, JSONL {prompt, chosen, rejected}: "
                                                             "accuracy, margin, length bias.")] = None,
               prompts: Annotated[str | None, typer.Option(help="Prompts with references, JSONL {prompt, "
                                                               "reference}: the score distribution.")] = None,
               out: Annotated[str | None, typer.Option(help="Also write report.json, summary.md and scores.png "
                                                           "into this directory.")] = None,
               as_json: Annotated[bool, typer.Option("--json", help="Print the JSON report, not the summary.")] = False,
               ) -> None:
    """Inspect a reward model: which token it scores, padding and batch invariance, scores, length bias.

    Exit status: 0 passed, 1 a check failed, 2 the model or a file could not be read.
    """
    from rlhf_core.config import InspectionConfig, RuntimeConfig
    from rlhf_core.runtime import Runtime
    from tasks.stages.inspect import inspect_model, summary_markdown, write_report

    try:
        report = inspect_model(model, InspectionConfig(), Runtime(RuntimeConfig()), pairs=pairs and Path(pairs),
                               prompts=prompts and Path(prompts))
    except (OSError, ValueError) as err:  # an unreadable model or file, a missing column
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if out:
        write_report(report, Path(out))
    if as_json:
        report.pop("samples", None)
        typer.echo(json.dumps(report, indent=2))
    else:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(summary_markdown(report)))
    raise typer.Exit(0 if report["passed"] else 1)


app.add_typer(models_app, name="models")  # rlhf models list | compare | promote (the MLflow registry)
app.add_typer(params_app, name="params")  # rlhf params diff | reset (params.yaml against the committed one)
app.command("exps")(exps)  # rlhf exps: the DVC experiments (every override run is one), readable
app.command("from-trl")(from_trl)  # rlhf from-trl CONFIG.yaml: a TRL PPO / RLOO / GRPO recipe as a profile
app.command()(sweep)  # rlhf sweep --grid train.kl_coef=...: the pipeline over a grid and its reward–KL frontier


def main() -> None:
    from tasks.tracking.progress import quiet_libraries

    quiet_libraries()
    # per-file "Loading weights" bars drown the pipeline's own output. Said through the environment, which
    # transformers reads when it is imported: importing it here cost every command ~0.5 s, `rlhf stage` handing
    # itself to a warm stage server too. Where it is imported already (in that server), said to it directly.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    app()


if __name__ == "__main__":
    main()
