"""The code each stage runs, found from its imports: the code deps that dvc.yaml lists for it.

`rlhf stage NAME` runs tasks/runner.py and the stage's module, and through them every module of this
project they import, at module level or inside a function, and the packages around them. Listed by hand,
these deps went stale (a stage that imported a module dvc.yaml did not name kept its old metrics after that
module changed), so they are generated from the source and checked by a test:

    python -m tasks.dag.code_deps           # exit status 1 and the differences when dvc.yaml is stale
    python -m tasks.dag.code_deps --write   # rewrite the code deps of every stage (`make dvc-deps`)

Code deps are the .py files under the project's packages; data and model deps are left as written.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

from rlhf_core.jsonio import atomic_path
from tasks.dag.stage_modules import STAGES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "tasks")  # what a stage may import of this project (flows and cli sit above it)
RUNNER = "tasks.runner"  # what `rlhf stage NAME` runs around the stage's module


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The source file of project module `name` (a module or a package's __init__.py), else None."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path, name: str, root: Path = ROOT) -> set[str]:
    """Project modules that the source of module `name` imports anywhere in it (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: resolve against this module's package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if module_file(m, root) is not None}


def with_parents(name: str) -> list[str]:
    """'a.b.c' -> ['a', 'a.b', 'a.b.c']: importing a module runs its packages' __init__.py first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def closure(modules: Iterable[str], root: Path = ROOT) -> set[str]:
    """The modules (and their packages) reachable by imports from `modules`."""
    seen: set[str] = set()
    todo = [p for m in modules for p in with_parents(m)]
    while todo:
        name = todo.pop()
        path = module_file(name, root)
        if name in seen or path is None:
            continue
        seen.add(name)
        todo += [p for m in imported_modules(path, name, root) for p in with_parents(m)]
    return seen


def stage_code_deps(stage: str, root: Path = ROOT) -> list[str]:
    """dvc.yaml paths of every source file `rlhf stage <stage>` can run, sorted."""
    files = {module_file(m, root) for m in closure([RUNNER, STAGES[stage]], root)}
    return sorted(path.relative_to(root).as_posix() for path in files)


def is_code_dep(dep: str) -> bool:
    return dep.split("/")[0] in PACKAGES


def stale(dvc_yaml: Path = ROOT / "dvc.yaml") -> dict[str, tuple[list[str], list[str]]]:
    """Stages whose code deps in dvc.yaml differ from their imports: stage -> (missing, extra)."""
    from tasks.dag.dvc_yaml import entry_paths, load_stages

    out = {}
    for name, stage in load_stages(dvc_yaml).items():
        listed = {d for d in entry_paths(stage, "deps") if is_code_dep(d)}
        wanted = set(stage_code_deps(name, dvc_yaml.parent))
        if listed != wanted:
            out[name] = (sorted(wanted - listed), sorted(listed - wanted))
    return out


def write(dvc_yaml: Path = ROOT / "dvc.yaml") -> list[str]:
    """Rewrite each stage's code deps (after its data deps), keeping comments and layout; the changed stages."""
    from ruamel.yaml import YAML  # a round trip: comments and layout stay (DVC's own YAML library)

    yaml = YAML()
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 4096
    changed = sorted(stale(dvc_yaml))
    data = yaml.load(dvc_yaml)
    for name in changed:
        deps = data["stages"][name].setdefault("deps", [])
        first = next((i for i, d in enumerate(deps) if isinstance(d, str) and is_code_dep(d)), len(deps))
        if not all(isinstance(d, str) and is_code_dep(d) for d in deps[first:]):
            raise ValueError(f"{dvc_yaml}: stage {name}: list data deps before code deps to regenerate them")
        del deps[first:]
        comments = getattr(deps, "ca", None)  # ruamel keeps end-of-line comments by item index
        for index in [i for i in comments.items if i >= first] if comments is not None else []:
            del comments.items[index]
        deps.extend(stage_code_deps(name, dvc_yaml.parent))
    with atomic_path(dvc_yaml) as tmp:
        yaml.dump(data, tmp)
    return changed


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        changed = write()
        print(f"dvc.yaml: code deps rewritten for {', '.join(changed)}" if changed else "dvc.yaml: up to date")
        return 0
    problems = stale()
    for name, (missing, extra) in problems.items():
        print(f"stage {name}: missing {missing or '-'}; not imported {extra or '-'}")
    if problems:
        print("dvc.yaml code deps are stale: run `make dvc-deps` (python -m tasks.dag.code_deps --write)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
