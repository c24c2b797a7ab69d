"""Stage `register`: log the trained policy to MLflow, register it, and promote it if it earns it.

The new version always gets the alias `challenger`. It also becomes `champion` when it passes the gate:
its eval `mean_kl` is within `register.max_kl`, and its primary metric (`register.primary_metric` of
metrics/eval.json, higher is better) beats the champion's, or, with no champion yet, `register.min_primary`.
Both figures and the decision are recorded as version tags and in metrics/register.json.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rlhf_core.jsonio import JsonFileError, read_json, write_json
from tasks.common.mlflow_tracker import numeric
from tasks.common.params import Params, RegisterParams
from tasks.common.paths import Paths
from tasks.common.stage_tracking import MlflowStageRun, current_stage_run

CHAMPION, CHALLENGER = "champion", "challenger"
EVAL_TAG = "eval."  # version tags eval.<metric>: the figures of metrics/eval.json the version was gated on


class RegisterError(ValueError):
    """Missing or malformed input of the register stage; the message names the file and key."""


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def decide(primary: float, mean_kl: float, champion_primary: float | None, cfg: RegisterParams,
           champion: str | None = None) -> Decision:
    """The promotion gate: a KL budget, then beat the champion (or the minimum when there is none)."""
    metric = cfg.primary_metric
    if mean_kl > cfg.max_kl:
        return Decision(False, f"mean_kl {mean_kl:.4g} is over the KL budget register.max_kl={cfg.max_kl:g}")
    if champion is None:
        if primary > cfg.min_primary:
            return Decision(True, f"no champion yet; {metric} {primary:.4g} > register.min_primary={cfg.min_primary:g}")
        return Decision(False, f"no champion yet, but {metric} {primary:.4g} <= register.min_primary={cfg.min_primary:g}")
    if champion_primary is None:
        return Decision(False, f"champion v{champion} has no recorded {metric} to compare with; "
                               f"promote by hand with `rlhf models promote`")
    if primary > champion_primary:
        return Decision(True, f"{metric} {primary:.4g} beats champion v{champion} ({champion_primary:.4g})")
    return Decision(False, f"{metric} {primary:.4g} does not beat champion v{champion} ({champion_primary:.4g})")


def read_eval(path: Path, cfg: RegisterParams) -> dict[str, float]:
    if not path.is_file():
        raise RegisterError(f"{path}: not found; run the evaluate stage first")
    try:
        data = read_json(path)
    except JsonFileError as err:
        raise RegisterError(str(err)) from err
    figures = numeric(data) if isinstance(data, dict) else {}
    for key in (cfg.primary_metric, "mean_kl"):
        if key not in figures:
            raise RegisterError(f"{path}: no numeric {key!r} (register.primary_metric / KL budget); "
                                f"keys: {', '.join(sorted(figures))}")
    return figures


def champion_of(client, name: str):
    """The version holding the champion alias, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def recorded(version, metric: str) -> float | None:
    value = version.tags.get(EVAL_TAG + metric)
    return None if value is None else float(value)


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
    """Pinned to what runs here; explicit, because inference of them imports torchvision (STACK.md)."""
    from importlib.metadata import version

    names = ["torch", "transformers", "tokenizers", "safetensors", "accelerate", "mlflow"] + (["peft"] if peft else [])
    return [f"{name}=={version(name).split('+')[0]}" for name in names]


def log_policy(run: MlflowStageRun, policy_dir: Path, model_name: str, card: str) -> str:
    """Log the policy with the transformers flavor into the stage's run, register it; returns the version.

    A LoRA policy (an adapter dir) is logged as a PEFT model with `base_model_path`, which mlflow needs to
    save a PEFT model over a local base correctly (mlflow#23761, STACK.md)."""
    import mlflow
    from huggingface_hub import ModelCard

    from rlhf_core.models import load_policy, load_tokenizer

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
    # log_model resolves the store and experiment globally: point both at this stage's run
    mlflow.set_tracking_uri(run.uri)
    mlflow.set_registry_uri(run.uri)
    mlflow.set_experiment(experiment_id=run.experiment_id)
    info = mlflow.transformers.log_model(
        {"model": model, "tokenizer": load_tokenizer(policy_dir)}, name="policy", task="text-generation",
        pip_requirements=_pip_requirements(adapter.is_file()), registered_model_name=model_name,
        run_id=run.run_id, model_card=ModelCard(card), **extra)  # a card of our own: no hub lookup
    return str(info.registered_model_version)


def _card(params: Params, figures: dict[str, float]) -> str:
    lines = [f"- {k}: {v:.4g}" for k, v in sorted(figures.items())]
    return (f"---\ntags: [rlhf, {params.train.algo}]\n---\n# {params.register.model_name}\n\n"
            f"A {params.train.algo.upper()} policy trained by rlhf-pipeline (profile "
            f"{params.base.profile}). Evaluation against the SFT reference:\n\n" + "\n".join(lines) + "\n")


def run(params: Params, paths: Paths) -> dict:
    cfg = params.register
    figures = read_eval(paths.metrics_file("eval"), cfg)
    primary, mean_kl = figures[cfg.primary_metric], figures["mean_kl"]
    run = current_stage_run()
    if run is None:
        report = {"registered": False, "reason": "tracking is off (RLHF_TRACKING=off): nothing registered",
                  "primary_metric": cfg.primary_metric, "primary": primary, "mean_kl": mean_kl}
        write_json(paths.metrics_file("register"), report)
        return {"registered": 0}
    client, name = run.client, cfg.model_name
    champion = champion_of(client, name)  # before this version is added
    version = log_policy(run, paths.policy, name, _card(params, figures))
    champion_primary = None if champion is None else recorded(champion, cfg.primary_metric)
    decision = decide(primary, mean_kl, champion_primary, cfg, None if champion is None else str(champion.version))
    tags = {**{EVAL_TAG + k: str(v) for k, v in figures.items()}, "primary_metric": cfg.primary_metric,
            "max_kl": str(cfg.max_kl), "champion_before": str(champion.version) if champion else "none",
            "decision": CHAMPION if decision.promote else CHALLENGER, "reason": decision.reason,
            "rlhf.profile": params.base.profile, "rlhf.stage_run_id": run.run_id}
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    client.set_registered_model_alias(name, CHALLENGER, version)
    if decision.promote:
        promote(client, name, version, by="register stage", reason=decision.reason)
    before = int(champion.version) if champion else None
    report = {"registered": True, "model_name": name, "version": int(version), "promoted": decision.promote,
              "reason": decision.reason, "primary_metric": cfg.primary_metric, "primary": primary,
              "mean_kl": mean_kl, "max_kl": cfg.max_kl, "champion_before": before,
              "champion_primary": champion_primary, "champion": int(version) if decision.promote else before}
    write_json(paths.metrics_file("register"), report)
    return {"registered": 1, "version": int(version), "promoted": int(decision.promote), "primary": primary,
            "mean_kl": mean_kl}
