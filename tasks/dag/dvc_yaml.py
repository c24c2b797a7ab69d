"""Reading dvc.yaml: the stages in order, and one stage's entry (its deps, outs, metrics and plots)."""

from __future__ import annotations

from pathlib import Path

import yaml

DVC_YAML = "dvc.yaml"
SHIPPED = Path(__file__).resolve().parents[2] / DVC_YAML  # the dvc.yaml that comes with this code
CODE_DIRS = ("rlhf_core", "tasks", "flows", "cli")  # deps that are this project's code, not a stage's inputs


def load_stages(path: str | Path) -> dict[str, dict]:
    """The `stages` mapping of a dvc.yaml, in the order the file lists them."""
    return (yaml.safe_load(Path(path).read_text()) or {}).get("stages", {})


def stage_names(root: str | Path) -> list[str]:
    """The stages of the workspace's dvc.yaml, in order; FileNotFoundError outside a pipeline workspace."""
    path = Path(root) / DVC_YAML
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the pipeline from the repository root")
    return list(load_stages(path))


def stage_entry(root: str | Path, name: str) -> dict:
    """The stage's entry in the workspace's dvc.yaml, else in the dvc.yaml shipped with this code."""
    for path in (Path(root) / DVC_YAML, SHIPPED):
        if path.is_file():
            stages = load_stages(path)
            if name in stages:
                return stages[name]
    return {}


def entry_paths(stage: dict, *keys: str) -> list[str]:
    """Paths listed under `keys` of a stage entry; each item is either 'path' or {'path': {options}}."""
    return [next(iter(item)) if isinstance(item, dict) else item for key in keys for item in stage.get(key, [])]


def missing_inputs(root: str | Path, name: str) -> list[str]:
    """Stage `name`'s inputs (its dvc.yaml deps other than code) that workspace `root` lacks, each as "PATH (made by stage X)";
    empty where the workspace has no dvc.yaml or no such stage. DVC checks its deps before it runs a stage; this
    says the same, naming the stage to run, for `rlhf stage` run by hand."""
    path = Path(root) / DVC_YAML
    stages = load_stages(path) if path.is_file() else {}
    if name not in stages:
        return []
    makers = {Path(out): stage for stage, entry in stages.items() for out in entry_paths(entry, "outs", "metrics", "plots")}
    missing = []
    for dep in entry_paths(stages[name], "deps"):
        if Path(dep).parts[0] in CODE_DIRS or (Path(root) / dep).exists():  # code: shipped as modules to Ray
            continue
        maker = next((stage for out, stage in makers.items() if out == Path(dep) or Path(dep).is_relative_to(out)
                      or out.is_relative_to(dep)), None)
        missing.append(f"{dep} (made by stage {maker})" if maker else f"{dep} (no stage makes it: add it)")
    return missing
