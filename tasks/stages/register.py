"""Stage `register`: log the trained policy to MLflow, register it, and promote it if it earns it.

The new version always gets the alias `challenger`. It also becomes `champion` when it passes the gate:
1. its eval `mean_kl` is within `register.max_kl` (a policy far from the SFT reference is over-optimized,
   whatever its scores say);
2. its primary metric (`register.primary_metric`; 'auto' is the gold win rate where the world has a gold
   reward, else the reward model's) beats the champion's by more than `register.tie_margin`, or ties it
   (within the margin) at a lower mean_kl; with no champion yet, it must exceed `register.min_primary`.
The decision, every figure behind it and the run's overrides are tags of the version and in
metrics/register.json.
"""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rlhf_core.jsonio import JsonFileError, read_json, write_json
from tasks.common.errors import StageFailed
from tasks.common.lineage import file_md5
from tasks.common.mlflow_tracker import numeric
from tasks.common.params import Params, RegisterParams
from tasks.common.paths import Paths
from tasks.common.registry import (
    CHALLENGER,
    CHAMPION,
    EVAL_MD5_TAG,
    POLICY_MD5_TAG,
    champion_of,
    version_of_policy,
)
from tasks.common.stage_tracking import OVERRIDES_TAG, MlflowStageRun, current_stage_run

EVAL_TAG = "eval."  # version tags eval.<metric>: the figures of metrics/eval.json the version was gated on


class RegisterError(StageFailed, ValueError):
    """Missing or malformed input of the register stage; the message names the file and key."""


GOLD_WIN_RATE, RM_WIN_RATE = "win_rate_gold", "win_rate_rm"


@dataclass(frozen=True)
class Candidate:
    """What the gate compares of a version: its primary metric and its eval mean_kl."""

    primary: float
    mean_kl: float


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
           champion_version: str | None = None) -> Decision:
    """The promotion gate: the KL budget, then beat the champion (or the minimum when there is none);
    a tie within `tie_margin` goes to the lower KL."""
    if new.mean_kl > cfg.max_kl:
        return Decision(False, f"mean_kl {new.mean_kl:.4g} is over the KL budget register.max_kl={cfg.max_kl:g}")
    if champion_version is None:
        verdict = ">" if new.primary > cfg.min_primary else "<="
        return Decision(verdict == ">", f"no champion yet; {metric} {new.primary:.4g} {verdict} "
                                        f"register.min_primary={cfg.min_primary:g}")
    if champion is None:
        return Decision(False, f"champion v{champion_version} has no recorded {metric} and mean_kl to compare "
                               f"with; promote by hand with `rlhf models promote`")
    ours, theirs = f"{metric} {new.primary:.4g}", f"champion v{champion_version} ({champion.primary:.4g}"
    gap = new.primary - champion.primary
    if gap > cfg.tie_margin:
        return Decision(True, f"{ours} beats {theirs})")
    if gap < -cfg.tie_margin:
        return Decision(False, f"{ours} does not beat {theirs})")
    tie = f"{ours} ties {theirs}, within register.tie_margin={cfg.tie_margin:g})"
    if new.mean_kl < champion.mean_kl:
        return Decision(True, f"{tie} at a lower mean_kl ({new.mean_kl:.4g} < {champion.mean_kl:.4g})")
    return Decision(False, f"{tie}; its mean_kl {new.mean_kl:.4g} is not below the champion's {champion.mean_kl:.4g}")


def read_eval(path: Path, cfg: RegisterParams) -> dict[str, float]:
    if not path.is_file():
        raise RegisterError(f"{path}: not found; run the evaluate stage first")
    try:
        data = read_json(path)
    except JsonFileError as err:
        raise RegisterError(str(err)) from err
    figures = numeric(data) if isinstance(data, dict) else {}
    for key, why in ((gate_metric(cfg, figures), "register.primary_metric"), ("mean_kl", "the KL budget")):
        if key not in figures:
            raise RegisterError(f"{path}: no numeric {key!r} ({why}); keys: {', '.join(sorted(figures))}")
    return figures


def recorded(version, metric: str) -> Candidate | None:
    """The version's figures as recorded at its registration, or None when it lacks them."""
    primary, mean_kl = version.tags.get(EVAL_TAG + metric), version.tags.get(EVAL_TAG + "mean_kl")
    return None if primary is None or mean_kl is None else Candidate(float(primary), float(mean_kl))


def promote(client, name: str, version: str, by: str, reason: str) -> str | None:
    """Move the champion alias to `version`, recording who, when and why; returns the former champion."""
    former = champion_of(client, name)
    client.set_registered_model_alias(name, CHAMPION, str(version))
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for key, value in (("promoted_by", by), ("promoted_at", when), ("promotion_reason", reason)):
        client.set_model_version_tag(name, str(version), key, value)
    former_version = None if former is None else str(former.version)
    if former_version not in (None, str(version)):
        client.set_model_version_tag(name, former_version, "demoted_at", when)
    return former_version


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
    with _mlflow_pointed_at(run):
        info = mlflow.transformers.log_model(
            {"model": model, "tokenizer": load_tokenizer(policy_dir)}, name="policy", task="text-generation",
            pip_requirements=_pip_requirements(adapter.is_file()), registered_model_name=model_name,
            run_id=run.run_id, model_card=ModelCard(card), **extra)  # a card of our own: no hub lookup
    merged_from = policy_dir / ADAPTER_DIR
    if merged_from.is_dir():  # the adapter alone (kilobytes to megabytes), for users who serve base + adapter
        run.client.log_artifacts(run.run_id, str(merged_from), ADAPTER_DIR)
        run.client.set_model_version_tag(model_name, str(info.registered_model_version), "adapter",
                                         f"runs:/{run.run_id}/{ADAPTER_DIR}")
    return str(info.registered_model_version)


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
    """Version tags: the decision and every figure and setting behind it."""
    tags = {"primary_metric": metric, "primary": new.primary, "mean_kl": new.mean_kl, "max_kl": cfg.max_kl,
            "min_primary": cfg.min_primary, "tie_margin": cfg.tie_margin,
            "champion_before": champion.version if champion else "none",
            "decision": CHAMPION if decision.promote else CHALLENGER, "reason": decision.reason}
    if recorded_champion is not None:
        tags.update(champion_primary=recorded_champion.primary, champion_mean_kl=recorded_champion.mean_kl)
    return {key: str(value) for key, value in tags.items()}


def _already_registered(client, name: str, version, figures: dict[str, float]) -> dict:
    """metrics/register.json for a policy the registry already holds: its version, as the registry has it."""
    champion = champion_of(client, name)
    return {"registered": True, "already_registered": True, "model_name": name, "version": int(version.version),
            "promoted": version.tags.get("decision") == CHAMPION, "reason": version.tags.get("reason", ""),
            "primary_metric": version.tags.get("primary_metric"), "mean_kl": figures["mean_kl"],
            "champion": int(champion.version) if champion else None}


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
        report = _already_registered(client, name, existing, figures)
        write_json(paths.metrics_file("register"), report)
        return {"registered": 0, "version": report["version"]}
    champion = champion_of(client, name)  # before this version is added
    version = log_policy(run, paths.policy, name, _card(params, figures))
    champion_figures = None if champion is None else recorded(champion, metric)
    decision = decide(new, champion_figures, cfg, metric, None if champion is None else str(champion.version))
    tags = {**{EVAL_TAG + k: str(v) for k, v in figures.items()},
            **gate_tags(metric, new, champion, champion_figures, cfg, decision),
            "rlhf.profile": params.base.profile, "rlhf.stage_run_id": run.run_id, **lineage,
            OVERRIDES_TAG: json.dumps(run.overrides)}
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    client.set_registered_model_alias(name, CHALLENGER, version)
    if decision.promote:
        promote(client, name, version, by="register stage", reason=decision.reason)
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
