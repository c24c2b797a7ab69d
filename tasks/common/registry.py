"""Reading the MLflow model registry of trained policies: the champion, the version of a given policy, and
one line on a version as the registry has it now (what a run's summary shows, rather than a file that may
describe an older state of the registry)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.common.mlflow_store import get_client, tracking_uri

CHAMPION, CHALLENGER = "champion", "challenger"
# md5 of the models/policy directory the version was logged from, and of the metrics/eval.json it was gated on
POLICY_MD5_TAG, EVAL_MD5_TAG = "rlhf.policy_md5", "rlhf.eval_md5"


def champion_of(client, name: str):
    """The version holding the champion alias, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def version_of_policy(client, name: str, policy_md5: str, eval_md5: str):
    """The oldest version of `name` logged from this policy with this evaluation (md5s), or None."""
    versions = client.search_model_versions(f"name = '{name}' and tags.`{POLICY_MD5_TAG}` = '{policy_md5}' "
                                            f"and tags.`{EVAL_MD5_TAG}` = '{eval_md5}'")
    return min(versions, key=lambda v: int(v.version), default=None)


def registry_verdict(root: str | Path, report: Mapping[str, Any]) -> str:
    """metrics/register.json's version in one line, as the registry has it now: the gate's decision at its
    registration, and whether it is the champion today."""
    if not report.get("registered"):
        return f"nothing registered ({report.get('reason', 'no reason given')})"
    name, version = report.get("model_name", "rlhf-policy"), str(report.get("version"))
    try:
        client = get_client(root)
        tags = client.get_model_version(name, version).tags
        champion = client.get_registered_model(name).aliases.get(CHAMPION)
    except Exception as err:
        return f"{name} v{version}: not found in the registry at {tracking_uri(root)} ({err})"
    now = "the champion" if str(champion) == version else f"challenger; champion is v{champion}" if champion \
        else "challenger; no champion"
    again = "already registered; " if report.get("already_registered") else ""
    return (f"{name} v{version}: {again}now {now} (gate at registration: {tags.get('decision', '-')}, "
            f"{tags.get('reason', 'no reason recorded')})")
