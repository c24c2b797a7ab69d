"""Stage `register`: log the trained policy to MLflow, register it, and promote it if it earns it.

The new version always gets the alias `challenger`. It also becomes `champion` when it passes the gate:
1. its eval `mean_kl` is within `register.max_kl` (a policy far from the SFT reference is over-optimized,
   whatever its scores say);
2. its primary metric (`register.primary_metric`; 'auto' is the gold win rate where the world has a gold
   reward, else the reward model's) beats the champion's by more than `register.tie_margin`, or ties it
   (within the margin) at a lower mean_kl, and is then no more than the margin below the best primary any
   version recorded within the KL budget (so repeated ties cannot ratchet the metric down); with no champion
   yet, it must exceed `register.min_primary`.
A primary metric or mean_kl that is NaN or infinite never passes: the reason names the metric.
The decision and its reason are the version's description and `gate.*` tags (tasks/tracking/registry.py), and in
metrics/register.json; the stage's run (the version's source run) carries every resolved parameter of the
pipeline and the evaluation as `eval/*` metrics, so MLflow's version compare shows what differs.
"""

from __future__ import annotations

import getpass
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rlhf_core.jsonio import JsonFileError, read_json, write_json
from tasks.execution.errors import StageFailed
from tasks.execution.transient import redact
from tasks.parameters.params import Params, RegisterParams
from tasks.parameters.paths import Paths
from tasks.tracking.lineage import file_md5
from tasks.tracking.mlflow_store import TrackingError, is_remote
from tasks.tracking.mlflow_tracker import numeric, retrying
from tasks.tracking.registry import (
    BEFORE_TAG,
    CHALLENGER,
    CHAMPION,
    CHAMPION_MODEL_TAG,
    DECISION_TAG,
    EVAL_MD5_TAG,
    EVAL_METRIC,
    HISTORY_TAG,
    KL_TAG,
    METRIC_TAG,
    POLICY_MD5_TAG,
    PRIMARY_TAG,
    REASON_TAG,
    SETTINGS_TAG,
    Candidate,
    champion_of,
    history,
    last_promotion,
    recorded,
    tag,
    version_of_policy,
)
from tasks.tracking.stage_tracking import OVERRIDES_TAG, MlflowStageRun, current_stage_run

HEADLINE = ("win_rate_gold", "win_rate_rm", "mean_kl", "mean_score_gold", "mean_score_rm", "eos_rate", "mean_length")


class RegisterError(StageFailed, ValueError):
    """Missing or malformed input of the register stage; the message names the file and key."""


GOLD_WIN_RATE, RM_WIN_RATE = "win_rate_gold", "win_rate_rm"


@dataclass(frozen=True)
class Best:
    """The highest primary metric a registered version recorded within the KL budget: the floor of a tie."""

    version: str
    primary: float


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def gate_metric(cfg: RegisterParams, figures: dict[str, float]) -> str:
    """The primary metric: as configured, or for 'auto' the gold win rate where there is one."""
    if cfg.primary_metric != "auto":
        return cfg.primary_metric
    return GOLD_WIN_RATE if GOLD_WIN_RATE in figures else RM_WIN_RATE


def decide(new: Candidate, champion: Candidate | None, cfg: RegisterParams, metric: str,
           champion_version: str | None = None, best: Best | None = None) -> Decision:
    """The promotion gate: finite figures, the KL budget, then beat the champion (or the minimum when there is
    none); a tie within `tie_margin` goes to the lower KL unless it falls more than the margin below `best`."""
    for figure, value in ((metric, new.primary), ("mean_kl", new.mean_kl)):
        if not math.isfinite(value):
            return Decision(False, f"{figure} is {value} in metrics/eval.json: not a number the gate can compare; "
                                   f"not promoted")
    if new.mean_kl > cfg.max_kl:
        return Decision(False, f"mean_kl {new.mean_kl:.4g} is over the KL budget register.max_kl={cfg.max_kl:g}")
    if champion_version is None:
        verdict = ">" if new.primary > cfg.min_primary else "<="
        return Decision(verdict == ">", f"no champion yet; {metric} {new.primary:.4g} {verdict} "
                                        f"register.min_primary={cfg.min_primary:g}")
    if champion is None or not champion.finite():
        return Decision(False, f"champion v{champion_version} has no recorded {metric} and mean_kl to compare "
                               f"with; promote by hand with `rlhf models promote`")
    ours, theirs = f"{metric} {new.primary:.4g}", f"champion v{champion_version} ({champion.primary:.4g}"
    gap = new.primary - champion.primary
    if gap > cfg.tie_margin:
        return Decision(True, f"{ours} beats {theirs})")
    if gap < -cfg.tie_margin:
        return Decision(False, f"{ours} does not beat {theirs})")
    tie = f"{ours} ties {theirs}, within register.tie_margin={cfg.tie_margin:g})"
    if new.mean_kl >= champion.mean_kl:
        return Decision(False, f"{tie}; its mean_kl {new.mean_kl:.4g} is not below the champion's "
                               f"{champion.mean_kl:.4g}")
    lower = f"at a lower mean_kl ({new.mean_kl:.4g} < {champion.mean_kl:.4g})"
    if best is not None and new.primary < best.primary - cfg.tie_margin:
        return Decision(False, f"{tie} {lower}, but is more than the margin below the best {metric} so far "
                               f"(v{best.version}: {best.primary:.4g}); ties must not ratchet it down")
    return Decision(True, f"{tie} {lower}")


def best_so_far(client, name: str, metric: str, cfg: RegisterParams) -> Best | None:
    """The highest `metric` any version of `name` recorded within the KL budget (finite figures only)."""
    best = None
    for version in client.search_model_versions(f"name = '{name}'"):
        figures = recorded(client, version, metric)
        if figures is not None and figures.finite() and figures.mean_kl <= cfg.max_kl \
                and (best is None or figures.primary > best.primary):
            best = Best(str(version.version), figures.primary)
    return best


def read_eval(path: Path, cfg: RegisterParams) -> dict[str, float]:
    if not path.is_file():
        raise RegisterError(f"{path}: not found; run the evaluate stage first")
    try:
        data = read_json(path)
    except JsonFileError as err:
        raise RegisterError(str(err)) from err
    figures = numeric(data) if isinstance(data, dict) else {}
    # numeric() leaves out infinities (MLflow cannot plot them); the gate must see them to refuse them by name
    figures.update({k: v for k, v in (data.items() if isinstance(data, dict) else ())
                    if isinstance(v, float) and math.isinf(v)})
    for key, why in ((gate_metric(cfg, figures), "register.primary_metric"), ("mean_kl", "the KL budget")):
        if key not in figures:
            raise RegisterError(f"{path}: no numeric {key!r} ({why}); keys: {', '.join(sorted(figures))}")
    return figures


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _record(client, name: str, version, event: dict) -> None:
    """Append `event` to the version's champion history (its tag, then its description): never overwritten. An
    event already last in it (a promotion run again after an outage cut it short) is not added twice, and its line
    is added to the description only where it is not the last line yet."""
    events = history(version)
    if events and _same(events[-1], event):
        event = events[-1]  # recorded by the try that was cut short: its time stands
    else:
        client.set_model_version_tag(name, str(version.version), HISTORY_TAG, json.dumps([*events, event]))
    line = f"- {event['at']}: {event['event']} by {event['by']}: {event['reason']}"
    if event.get("overrides"):
        line += f" (overriding the gate's decision at registration: {event['overrides']})"
    text = (version.description or "").rstrip()
    if text.endswith(line):
        return
    head = "" if "**Champion history**" in text else "\n\n**Champion history**\n"
    client.update_model_version(name, str(version.version), description=f"{text}{head}\n{line}".strip())


def _same(recorded: dict, event: dict) -> bool:
    """The same event apart from when it was made: who, what, why."""
    return {k: v for k, v in recorded.items() if k != "at"} == {k: v for k, v in event.items() if k != "at"}


def promote(client, name: str, version: str, by: str, reason: str, overrides: str | None = None) -> str | None:
    """Move the champion alias to `version`, appending who, when and why to its champion history (and the
    demotion to the former champion's); `overrides`: the gate's rejection a manual promotion overrides.
    Returns the former champion.

    One ordered sequence, the record before the alias: the version's history, the former champion's demotion,
    then the alias, then the model's description. A registry cut off between two writes therefore never shows an
    alias without the record of why. On a server each write is retried through an outage (the client is a
    RetryingClient, RLHF_MLFLOW_RETRY_S); one that still fails stops the sequence (PromotionIncomplete, naming what
    was done and what was not), and the same promotion run again finishes it without recording anything twice."""
    former = champion_of(client, name)
    chosen = client.get_model_version(name, str(version))
    event = {"event": "promoted", "at": _now(), "by": by, "reason": reason}
    if overrides:
        event["overrides"] = overrides
    steps = [(f"v{version}'s champion history", lambda: _record(client, name, chosen, event))]
    former_version = None if former is None else str(former.version)
    if former_version not in (None, str(version)):
        demotion = {"event": "demoted", "at": event["at"], "by": by, "reason": f"v{version} promoted to champion"}
        steps.append((f"v{former_version}'s demotion in its history", lambda: _record(client, name, former, demotion)))
    steps += [(f"the alias {CHAMPION} -> v{version}",
               lambda: client.set_registered_model_alias(name, CHAMPION, str(version))),
              ("the registered model's description", lambda: describe_model(client, name))]
    _in_order(f"promoting {name} v{version}", steps)
    return former_version


class PromotionIncomplete(TrackingError):
    """A promotion stopped partway: the message says what was written, what was not, and how to finish it."""


def _in_order(what: str, steps: list[tuple[str, Callable[[], object]]]) -> None:
    """Each step after the one before has landed; the first that fails stops the rest (PromotionIncomplete)."""
    for i, (step, write) in enumerate(steps):
        try:
            write()
        except Exception as err:
            done = ", ".join(s for s, _ in steps[:i]) or "nothing"
            raise PromotionIncomplete(
                f"{what}: {step} failed ({err}). Written in full: {done}; not written (or not in full): "
                f"{', '.join(s for s, _ in steps[i:])}. The alias moves only after the record of why; run the same "
                f"promotion again to finish it (nothing is recorded twice)") from err


def describe_model(client, name: str) -> None:
    """The registered model's description and `champion` tag: the current champion, its figures and why."""
    champion = champion_of(client, name)
    if champion is None:
        words, text = "none", "**Champion: none yet.** No version has passed the promotion gate."
    else:
        metric = tag(champion, METRIC_TAG, "primary")
        figures = f"{metric} {_num(tag(champion, PRIMARY_TAG))}, mean_kl {_num(tag(champion, KL_TAG))}"
        last = last_promotion(champion) or {}
        words = f"v{champion.version} ({figures})"
        text = (f"**Champion: v{champion.version}** ({figures}), promoted {last.get('at', '?')} by "
                f"{last.get('by', '?')}: {last.get('reason', '?')}.\n\n"
                f'Load it with `mlflow.transformers.load_model("models:/{name}@{CHAMPION}")`.')
    client.update_registered_model(name, description=(
        f"RLHF policies trained and registered by rlhf-pipeline. {text}\n\nEach version's description holds its "
        f"headline evaluation, the gate's decision and reason; `rlhf models list` shows them all."))
    client.set_registered_model_tag(name, CHAMPION_MODEL_TAG, words)


def _num(value) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return "-"


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER", "unknown")


def _pip_requirements(peft: bool) -> list[str]:
    """Pinned to what runs here; explicit, because MLflow's inference of them imports torchvision, which the
    CPU install lacks (mlflow.transformers.log_model then fails)."""
    from importlib.metadata import version

    names = ["torch", "transformers", "tokenizers", "safetensors", "accelerate", "mlflow"] + (["peft"] if peft else [])
    return [f"{name}=={version(name).split('+')[0]}" for name in names]


def log_policy(run: MlflowStageRun, policy_dir: Path, model_name: str, card: str) -> str:
    """Log the policy with the transformers flavor into the stage's run, register it; returns the version.

    The train stage's LoRA policy is its merged model (a plain transformers model: it reloads and serves without
    peft or its base); its adapter (models/policy/adapter/) goes beside it as the run's artifact `adapter`. A policy
    dir that is an adapter alone is logged as a PEFT model with `base_model_path`, which mlflow needs to save a PEFT
    model over a local base correctly (mlflow#23761: without it the model reloads with random attention weights
    and no error)."""
    import mlflow
    from huggingface_hub import ModelCard

    from rlhf_core.hub import load_tokenizer
    from rlhf_core.lora import ADAPTER_DIR
    from rlhf_core.models import load_policy

    adapter = policy_dir / "adapter_config.json"
    extra = {}
    if adapter.is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(policy_dir)
        base = read_json(adapter).get("base_model_name_or_path", "")
        if Path(base).is_dir():
            extra["base_model_path"] = str(Path(base).resolve())
    else:
        model = load_policy(policy_dir)
    def log_and_register() -> str:
        return str(mlflow.transformers.log_model(
            {"model": model, "tokenizer": load_tokenizer(policy_dir)}, name="policy", task="text-generation",
            pip_requirements=_pip_requirements(adapter.is_file()), registered_model_name=model_name,
            run_id=run.run_id, model_card=ModelCard(card), **extra).registered_model_version)  # our card: no hub

    with _mlflow_pointed_at(run):  # a server that is restarting: retried until it answers (RLHF_MLFLOW_RETRY_S)
        version = retrying(f"logging and registering the policy as {model_name}", log_and_register,
                           server=redact(run.uri) if is_remote(run.uri) else "",
                           landed=lambda: version_of_run(run.client, model_name, run.run_id))
    merged_from = policy_dir / ADAPTER_DIR
    if merged_from.is_dir():  # the adapter alone (kilobytes to megabytes), for users who serve base + adapter
        run.client.log_artifacts(run.run_id, str(merged_from), ADAPTER_DIR)
        run.client.set_model_version_tag(model_name, version, "adapter", f"runs:/{run.run_id}/{ADAPTER_DIR}")
    return version


def version_of_run(client, model_name: str, run_id: str) -> str | None:
    """The version of `model_name` that the stage run `run_id` registered, if any: a register stage's run
    registers one, so a retry that finds it knows its lost try made it."""
    found = [v for v in client.search_model_versions(f"run_id='{run_id}'") if v.name == model_name]
    return str(found[0].version) if found else None


MLFLOW_EXPORTS = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID")


@contextmanager
def _mlflow_pointed_at(run: MlflowStageRun) -> Iterator[None]:
    """log_model resolves the store, the registry and the experiment from MLflow's process globals: point them at
    this stage's run, then put them back. Setting them also exports MLFLOW_TRACKING_URI, MLFLOW_REGISTRY_URI and
    MLFLOW_EXPERIMENT_ID to this process's environment; left there, every later subprocess (a `dvc repro` run
    from the same process) tracked into this run's store."""
    import mlflow

    saved = {name: os.environ.get(name) for name in MLFLOW_EXPORTS}
    mlflow.set_tracking_uri(run.uri)
    mlflow.set_registry_uri(run.uri)
    mlflow.set_experiment(experiment_id=run.experiment_id)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])  # None: back to the default resolution
        mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"])
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _card(params: Params, figures: dict[str, float]) -> str:
    lines = [f"- {k}: {v:.4g}" for k, v in sorted(figures.items())]
    return (f"---\ntags: [rlhf, {params.train.algo}]\n---\n# {params.register.model_name}\n\n"
            f"A {params.train.algo.upper()} policy trained by rlhf-pipeline (profile "
            f"{params.base.profile}). Evaluation against the SFT reference:\n\n" + "\n".join(lines) + "\n")


def gate_tags(metric: str, new: Candidate, champion, recorded_champion: Candidate | None,
              cfg: RegisterParams, decision: Decision) -> dict[str, str]:
    """The version's `gate.*` tags: the decision, its reason in full, and the figures and settings behind it."""
    before = "none" if champion is None else f"v{champion.version}" + (
        "" if recorded_champion is None else
        f" ({metric} {recorded_champion.primary:.4g} at mean_kl {recorded_champion.mean_kl:.4g})")
    return {DECISION_TAG: CHAMPION if decision.promote else CHALLENGER, REASON_TAG: decision.reason,
            METRIC_TAG: metric, PRIMARY_TAG: str(new.primary), KL_TAG: str(new.mean_kl), BEFORE_TAG: before,
            SETTINGS_TAG: f"max_kl={cfg.max_kl:g} min_primary={cfg.min_primary:g} tie_margin={cfg.tie_margin:g}"}


def describe_version(params: Params, figures: dict[str, float], tags: dict[str, str], overrides: list[str]) -> str:
    """The version's description (Markdown): what it is, its headline evaluation, the gate's decision in full."""
    headline = [k for k in HEADLINE if k in figures]
    rows = "\n".join(f"| {k} | {figures[k]:.4g} |" for k in headline)
    verdict = "promoted to champion" if tags[DECISION_TAG] == CHAMPION else "kept as challenger (not promoted)"
    return (f"A {params.train.algo.upper()} policy trained by rlhf-pipeline: profile `{params.base.profile}`, "
            f"overrides {' '.join(f'`{o}`' for o in overrides) or 'none'}. Its source run (the `register` stage) "
            f"holds every resolved parameter of the pipeline and the whole evaluation (`eval/*` metrics).\n\n"
            f"| metric (vs the SFT reference) | value |\n|---|---|\n{rows}\n\n"
            f"**Gate: {verdict}.** {tags[REASON_TAG]}.\n\n"
            f"Compared with: champion {tags[BEFORE_TAG]}; gate settings: primary metric {tags[METRIC_TAG]}, "
            f"{tags[SETTINGS_TAG]}.")


def _already_registered(client, name: str, version, figures: dict[str, float]) -> dict:
    """metrics/register.json for a policy the registry already holds: its version, as the registry has it."""
    champion = champion_of(client, name)
    return {"registered": True, "already_registered": True, "model_name": name, "version": int(version.version),
            "promoted": tag(version, DECISION_TAG) == CHAMPION, "reason": tag(version, REASON_TAG, ""),
            "primary_metric": tag(version, METRIC_TAG), "mean_kl": figures["mean_kl"],
            "champion": int(champion.version) if champion else None}


def _promotion_cut_short(client, name: str, version) -> bool:
    """Whether the gate promoted `version` at its registration but the alias never got there (an outage or a kill
    stopped the stage between its writes): the champion is still the one the gate compared it with, and the
    version was never demoted since."""
    if tag(version, DECISION_TAG) != CHAMPION or any(e.get("event") == "demoted" for e in history(version)):
        return False
    champion = champion_of(client, name)
    if champion is not None and str(champion.version) == str(version.version):
        return False
    beaten = (tag(version, BEFORE_TAG) or "none").split(" ")[0]
    return beaten == ("none" if champion is None else f"v{champion.version}")


def pipeline_params(params: Params) -> dict:
    """The sections of the resolved params that the stage run does not log already (it logs base, runtime and
    register): with them, the version's source run says how its policy was made (sft, reward_model, train...)."""
    return {k: v for k, v in params.model_dump(mode="json").items() if k not in ("base", "runtime", "register")}


def run(params: Params, paths: Paths) -> dict:
    cfg = params.register
    figures = read_eval(paths.metrics_file("eval"), cfg)
    metric = gate_metric(cfg, figures)
    new = Candidate(figures[metric], figures["mean_kl"])
    run = current_stage_run()
    if run is None:
        report = {"registered": False, "reason": "tracking is off (RLHF_TRACKING=off): nothing registered",
                  "primary_metric": metric, "primary": new.primary, "mean_kl": new.mean_kl}
        write_json(paths.metrics_file("register"), report)
        return {"registered": 0}
    client, name = run.client, cfg.model_name
    lineage = {POLICY_MD5_TAG: file_md5(paths.policy), EVAL_MD5_TAG: file_md5(paths.metrics_file("eval"))}
    existing = version_of_policy(client, name, *lineage.values())
    if existing is not None:  # e.g. a plain run after an overridden one: train and evaluate came from DVC's run cache
        if _promotion_cut_short(client, name, existing):  # the flow's retry of a run an outage stopped
            promote(client, name, str(existing.version), by="register stage", reason=tag(existing, REASON_TAG, ""))
        report = _already_registered(client, name, existing, figures)
        write_json(paths.metrics_file("register"), report)
        return {"registered": 0, "version": report["version"]}
    # the version's source run is this one: MLflow's version compare shows its params and metrics
    run.tracker.log_params(pipeline_params(params))
    run.tracker.log_metrics({EVAL_METRIC + k: v for k, v in figures.items()}, step=0)
    champion = champion_of(client, name)  # before this version is added
    version = log_policy(run, paths.policy, name, _card(params, figures))
    champion_figures = None if champion is None else recorded(client, champion, metric)
    decision = decide(new, champion_figures, cfg, metric, None if champion is None else str(champion.version),
                      best_so_far(client, name, metric, cfg))
    gate = gate_tags(metric, new, champion, champion_figures, cfg, decision)
    tags = {**gate, "rlhf.profile": params.base.profile, **lineage, OVERRIDES_TAG: json.dumps(run.overrides)}
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    client.update_model_version(name, version, description=describe_version(params, figures, gate, run.overrides))
    client.set_registered_model_alias(name, CHALLENGER, version)
    if decision.promote:
        promote(client, name, version, by="register stage", reason=decision.reason)
    elif champion is None:
        describe_model(client, name)  # a first version that failed the gate: the model says there is no champion
    before = int(champion.version) if champion else None
    report = {"registered": True, "already_registered": False, "model_name": name, "version": int(version),
              "promoted": decision.promote, "reason": decision.reason, "primary_metric": metric,
              "primary": new.primary, "mean_kl": new.mean_kl, "max_kl": cfg.max_kl, "tie_margin": cfg.tie_margin,
              "champion_before": before, "overrides": run.overrides,
              "champion_primary": champion_figures and champion_figures.primary,
              "champion_mean_kl": champion_figures and champion_figures.mean_kl,
              "champion": int(version) if decision.promote else before}
    write_json(paths.metrics_file("register"), report)
    return {"registered": 1, "version": int(version), "promoted": int(decision.promote), "primary": new.primary,
            "mean_kl": new.mean_kl}
