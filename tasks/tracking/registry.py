"""Reading the MLflow model registry of trained policies: the champion, the version of a given policy, the
figures a version was gated on, and one line on a version as the registry has it now (what a run's summary
shows, rather than a file that may describe an older state of the registry).

A version's tags are few and grouped by prefix (the full story is the version's description):
- `gate.*`: the promotion gate at registration: `gate.decision` (champion / challenger), `gate.reason` (in
  full), `gate.metric`, `gate.primary`, `gate.mean_kl`, `gate.champion_before`, `gate.settings`;
- `rlhf.*`: lineage: `rlhf.profile`, `rlhf.overrides`, `rlhf.policy_md5`, `rlhf.eval_md5`;
- `champion_history`: every promotion to and demotion from champion (JSON list; appended, never overwritten);
- `adapter`: a LoRA policy's adapter artifact.
Every figure of metrics/eval.json is a metric of the version's source run (`eval/<name>`), with every resolved
parameter of the pipeline, so MLflow's version compare shows both. Versions registered before these names
(tags `decision`, `reason`, `eval.<metric>`, `promoted_by`) are still read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.execution.transient import redact
from tasks.tracking.mlflow_store import tracking_uri
from tasks.tracking.mlflow_tracker import TrackingUnavailable, retrying_client

CHAMPION, CHALLENGER = "champion", "challenger"
# md5 of the models/policy directory the version was logged from, and of the metrics/eval.json it was gated on
POLICY_MD5_TAG, EVAL_MD5_TAG = "rlhf.policy_md5", "rlhf.eval_md5"
DECISION_TAG, REASON_TAG, METRIC_TAG = "gate.decision", "gate.reason", "gate.metric"
PRIMARY_TAG, KL_TAG, BEFORE_TAG, SETTINGS_TAG = "gate.primary", "gate.mean_kl", "gate.champion_before", "gate.settings"
HISTORY_TAG = "champion_history"
CHAMPION_MODEL_TAG = "champion"  # on the registered model: the current champion in words (the model list shows it)
EVAL_METRIC = "eval/"  # source-run metrics eval/<name>: metrics/eval.json as the version was gated on it
_LEGACY = {DECISION_TAG: "decision", REASON_TAG: "reason", METRIC_TAG: "primary_metric", PRIMARY_TAG: "primary",
           KL_TAG: "mean_kl"}


@dataclass(frozen=True)
class Candidate:
    """What the gate compares of a version: its primary metric and its eval mean_kl."""

    primary: float
    mean_kl: float

    def finite(self) -> bool:
        return math.isfinite(self.primary) and math.isfinite(self.mean_kl)


def tag(version, key: str, default: str | None = None) -> str | None:
    """A version's tag by its current name, or by the name versions registered before it carried."""
    tags = version.tags
    return tags.get(key, tags.get(_LEGACY.get(key, key), default))


def champion_of(client, name: str):
    """The version holding the champion alias, or None when the model or the alias is not there. Any other
    failure raises: a registry that cannot be read now is not a registry without a champion."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):  # no model; no such alias
            return None
        raise


def version_of_policy(client, name: str, policy_md5: str, eval_md5: str):
    """The oldest version of `name` logged from this policy with this evaluation (md5s), or None."""
    versions = client.search_model_versions(f"name = '{name}' and tags.`{POLICY_MD5_TAG}` = '{policy_md5}' "
                                            f"and tags.`{EVAL_MD5_TAG}` = '{eval_md5}'")
    return min(versions, key=lambda v: int(v.version), default=None)


def eval_figures(client, version) -> dict[str, float]:
    """metrics/eval.json as the version was gated on it: its source run's eval/* metrics (or legacy eval.* tags)."""
    legacy = {k.removeprefix("eval."): float(v) for k, v in version.tags.items() if k.startswith("eval.")}
    if legacy or not version.run_id:
        return legacy
    try:
        metrics = client.get_run(version.run_id).data.metrics
    except Exception:  # the run was deleted: the version's tags still say what the gate saw
        return {}
    return {k.removeprefix(EVAL_METRIC): v for k, v in metrics.items() if k.startswith(EVAL_METRIC)}


def recorded(client, version, metric: str) -> Candidate | None:
    """The version's `metric` and mean_kl as recorded at its registration, or None when it lacks them."""
    if tag(version, METRIC_TAG) == metric and tag(version, PRIMARY_TAG) is not None and tag(version, KL_TAG):
        return Candidate(float(tag(version, PRIMARY_TAG)), float(tag(version, KL_TAG)))
    figures = eval_figures(client, version)  # gated on another metric: the figure of its evaluation
    return Candidate(figures[metric], figures["mean_kl"]) if {metric, "mean_kl"} <= set(figures) else None


def history(version) -> list[dict]:
    """The version's champion history: every promotion to and demotion from champion, oldest first."""
    try:
        events = json.loads(version.tags.get(HISTORY_TAG, "[]"))
    except ValueError:
        events = []
    if not events and version.tags.get("promoted_by"):  # a version registered before the history was kept
        events = [{"event": "promoted", "at": version.tags.get("promoted_at", "?"),
                   "by": version.tags["promoted_by"], "reason": version.tags.get("promotion_reason", "")}]
    return events


def last_promotion(version) -> dict | None:
    return next((e for e in reversed(history(version)) if e.get("event") == "promoted"), None)


def registry_verdict(root: str | Path, report: Mapping[str, Any]) -> str:
    """metrics/register.json's version in one line, as the registry has it now: the gate's decision at its
    registration, and whether it is the champion today."""
    if not report.get("registered"):
        return f"nothing registered ({report.get('reason', 'no reason given')})"
    name, version = report.get("model_name", "rlhf-policy"), str(report.get("version"))
    try:  # on a server, retried through an outage as the writes are
        client = retrying_client(root)
        found = client.get_model_version(name, version)
        champion = client.get_registered_model(name).aliases.get(CHAMPION)
    except TrackingUnavailable as err:
        return f"{name} v{version}: the registry at {redact(tracking_uri(root))} could not be read ({err})"
    except Exception as err:
        return f"{name} v{version}: not found in the registry at {redact(tracking_uri(root))} ({err})"
    now = "the champion" if str(champion) == version else f"challenger; champion is v{champion}" if champion \
        else "challenger; no champion"
    again = "already registered; " if report.get("already_registered") else ""
    return (f"{name} v{version}: {again}now {now} (gate at registration: {tag(found, DECISION_TAG, '-')}, "
            f"{tag(found, REASON_TAG, 'no reason recorded')})")
