"""The layers, read from the source: cli -> flows -> tasks -> rlhf_core, no import upward (also none inside a
function), the stages as one folder, and the libraries each layer may use."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from tasks.dag.stage_modules import STAGES

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("rlhf_core", "tasks", "flows", "cli")  # bottom to top: a package may import its own layer and below
ONLY_IN = {  # third-party packages and the only layers that may import them
    "prefect": {"flows"},
    "mlflow": {"tasks", "flows", "cli"},
    "dvc": {"tasks", "flows"},
    "great_expectations": {"tasks"},
    "ray": {"tasks"},  # tasks/execution/ray_launch.py alone (test_only_the_ray_launcher_imports_ray)
}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth: module level, functions, branches."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def violations(root: Path) -> list[str]:
    """Every upward import, stage-to-stage import and banned library import under `root`'s layers."""
    out = []
    for rank, layer in enumerate(LAYERS):
        for path in sorted((root / layer).rglob("*.py")):
            where = path.relative_to(root)
            for line, module in imports(path):
                top = module.split(".")[0]
                if top in LAYERS and LAYERS.index(top) > rank:
                    out.append(f"{where}:{line} imports {module}: {layer} sits below {top}")
                if top in ONLY_IN and layer not in ONLY_IN[top]:
                    out.append(f"{where}:{line} imports {module}: only {sorted(ONLY_IN[top])} may")
                in_stage = where.parts[:2] == ("tasks", "stages") and path.name != "__init__.py"
                if in_stage and module.startswith("tasks.stages.") and module != f"tasks.stages.{path.stem}":
                    out.append(f"{where}:{line} imports {module}: a stage never imports another stage")
                in_room = layer == "tasks" and where.parts[1] not in ("stages", "runner.py")
                if in_room and (module.startswith("tasks.stages.") or module == "tasks.runner"):
                    out.append(f"{where}:{line} imports {module}: a room of tasks/ sits below the stages")
    return out


def room_imports(root: Path) -> dict[str, set[str]]:
    """tasks/'s rooms (its packages but the stages) -> the other rooms they import."""
    rooms = {p.parent.name for p in (root / "tasks").glob("*/__init__.py")} - {"stages"}
    graph: dict[str, set[str]] = {room: set() for room in rooms}
    for room in rooms:
        for path in (root / "tasks" / room).rglob("*.py"):
            for _, module in imports(path):
                parts = module.split(".")
                if parts[0] == "tasks" and len(parts) > 1 and parts[1] in rooms and parts[1] != room:
                    graph[room].add(parts[1])
    return graph


def test_no_upward_import_anywhere():
    assert violations(ROOT) == []


def test_the_rooms_of_tasks_form_no_circle():
    """Each room can be read and changed on top of the ones it imports: no two rooms import each other, even
    through a third (graphlib raises CycleError naming the circle)."""
    graph = room_imports(ROOT)
    assert {"parameters", "execution", "tracking", "dag"} <= set(graph)
    order = list(graphlib.TopologicalSorter(graph).static_order())
    assert order.index("parameters") < order.index("tracking")


def test_the_circle_check_sees_a_circle(tmp_path):
    for room, other in (("one", "two"), ("two", "three"), ("three", "one")):
        (tmp_path / "tasks" / room).mkdir(parents=True)
        (tmp_path / "tasks" / room / "__init__.py").write_text("")
        (tmp_path / "tasks" / room / "a.py").write_text(f"def f():\n    from tasks.{other}.a import f\n")
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(room_imports(tmp_path)).static_order())


def test_the_checker_sees_an_import_hidden_in_a_function(tmp_path):
    for layer in LAYERS:
        (tmp_path / layer).mkdir()
    (tmp_path / "tasks" / "sneaky.py").write_text("def f():\n    from flows.pipeline import rlhf_pipeline\n")
    (tmp_path / "rlhf_core" / "logs.py").write_text("if True:\n    import mlflow\n")
    (tmp_path / "tasks" / "stages").mkdir()
    (tmp_path / "tasks" / "stages" / "evaluate.py").write_text("from tasks.stages.train import build_trainer\n")
    (tmp_path / "tasks" / "tracking").mkdir()
    (tmp_path / "tasks" / "tracking" / "runs.py").write_text("from tasks.stages.train import build_trainer\n")
    found = violations(tmp_path)
    assert any("tasks/sneaky.py:2 imports flows.pipeline" in v for v in found), found
    assert any("rlhf_core/logs.py:2 imports mlflow" in v for v in found), found
    assert any("a stage never imports another stage" in v for v in found), found
    assert any("tasks/tracking/runs.py:1 imports tasks.stages.train: a room" in v for v in found), found


def test_every_dvc_stage_is_one_module_of_the_stages_folder_named_as_it():
    import yaml

    stages = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert list(STAGES) == stages, "tasks.dag.stage_modules.STAGES lists dvc.yaml's stages in its order"
    modules = {p.stem for p in (ROOT / "tasks" / "stages").glob("*.py")} - {"__init__"}
    assert modules == {name.replace("-", "_") for name in stages}
    for name, module in STAGES.items():
        assert module == f"tasks.stages.{name.replace('-', '_')}"
        tree = ast.parse((ROOT / "tasks" / "stages" / f"{name.replace('-', '_')}.py").read_text())
        run = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"), None)
        assert run is not None and [a.arg for a in run.args.args] == ["params", "paths"], f"{module}.run(params, paths)"


@pytest.mark.parametrize("module", ["rlhf_core", "tasks.stages.train", "tasks.runner"])
def test_importing_the_library_and_the_stages_never_loads_the_orchestration(module):
    """A stage process loads neither Prefect nor the CLI, nor Ray unless its runtime asks for it (checked at run
    time, in a fresh interpreter)."""
    import subprocess
    import sys

    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'flows', 'cli', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_only_the_ray_launcher_imports_ray():
    """Ray is an optional extra: one module imports it, and only a stage whose runtime asks for Ray imports that."""
    importers = sorted(str(path.relative_to(ROOT)) for layer in LAYERS for path in (ROOT / layer).rglob("*.py")
                       if any(module.split(".")[0] == "ray" for _, module in imports(path)))
    assert importers == ["tasks/execution/ray_launch.py"]
    tree = ast.parse((ROOT / "tasks" / "execution" / "ray_launch.py").read_text())
    assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                and any((a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0] == "ray"
                        for a in n.names)], "ray is imported inside the functions that use it"
