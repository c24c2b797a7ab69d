"""The layers, read from the source: cli -> flows -> tasks -> rlhf_core, no import upward (also none inside a
function, none through importlib), the stages as one folder, the libraries each layer may use, no module that
re-exports another's names and none that nothing runs."""

from __future__ import annotations

import ast
import graphlib
import itertools
import os
import re
from functools import cache
from pathlib import Path

import pytest
import tomllib
import yaml

from tasks.dag.stage_modules import STAGES

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("rlhf_core", "tasks", "flows", "cli")  # bottom to top: a package may import its own layer and below
SCRIPTS = "bench"  # scripts run by path; they and the tests that run them put bench/ on sys.path


def python_files(root: Path, folder: str) -> list[Path]:
    """The .py files under `root/folder`, hidden folders left out: bench/.trl-venv and bench/.trl116 are the
    environments `bench/vs_trl.py` makes, not our code."""
    base = root / folder
    return sorted(p for p in base.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(base).parts))
ONLY_IN = {  # third-party packages and the only layers that may import them
    "prefect": {"flows"},
    "mlflow": {"tasks", "flows", "cli"},
    "dvc": {"tasks", "flows"},
    "great_expectations": {"tasks"},
    "ray": {"tasks"},  # tasks/execution/ray_launch.py alone (test_only_the_ray_launcher_imports_ray)
}
IMPORTERS = {"import_module", "__import__", "find_spec"}  # importlib's: the module's name is the first argument
# the project's loaders: "package.module:name" or "dir/file.py:name" first
LOADERS = {"flow_of", "import_reward_function", "import_tool", "import_environment_factory"}
DATA_NAMED = {  # the only dynamic imports whose module comes from data, and where that data is checked
    "flows/deployments.py": "prefect.yaml's entrypoints: test_prefect_entrypoints_are_flows",
    "rlhf_core/reward_functions.py": "params' reward functions, confined to trust.reward_modules (tests/test_trust.py)",
}


# ------------------------------------------------------------------ every import a module makes, static or dynamic

class Unresolved(Exception):
    """An expression whose value the source alone does not fix."""


def module_path(root: Path, module: str) -> Path | None:
    """The file `module` is imported from under `root` (a package's __init__.py), or None."""
    base = root.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def parsed(path: Path) -> ast.Module:
    return _parse(path.read_text(), str(path))


@cache
def _parse(source: str, filename: str) -> ast.Module:  # each layer's test reads every file again
    return ast.parse(source, filename=filename)


class Scope:
    """What one module's source fixes: its constants (also those it imports from the project), the values a loop
    variable runs over, a dict's values; enough to read `importlib.import_module(m) for m in (*PRELOAD, ...)`."""

    def __init__(self, tree: ast.Module, root: Path):
        self.root = root
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.constants = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                          for t in n.targets if isinstance(t, ast.Name)}
        self.imported = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                         if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module for a in n.names}

    def value(self, node: ast.expr):
        """The one value of a constant expression; Unresolved if it has none fixed in the source."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return tuple(itertools.chain.from_iterable(
                self.value(e.value) if isinstance(e, ast.Starred) else [self.value(e)] for e in node.elts))
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values, strict=True)}
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args
                and node.func.attr in ("keys", "values", "items")):
            return tuple(getattr(self.value(node.func.value), node.func.attr)())
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.value(self.constants[node.id])
        if isinstance(node, ast.Name) and node.id in self.imported:
            module, name = self.imported[node.id]
            if path := module_path(self.root, module):
                return Scope(parsed(path), self.root).value(ast.Name(name))
        raise Unresolved(ast.unparse(node))

    def values(self, node: ast.expr) -> list:
        """Every value the expression can take: a loop variable's over its constant iterable, `d[key]` over d's
        values, a constant prefix + such a name."""
        if isinstance(node, ast.Name) and (loop := self.loop_binding(node)):
            iterable, position = loop
            items = [item for collection in self.values(iterable) for item in collection]
            return [item if position is None else item[position] for item in items]
        if isinstance(node, ast.Subscript):
            collection = self.value(node.value)
            try:
                return [collection[key] for key in self.values(node.slice)]
            except Unresolved:
                return list(collection.values() if isinstance(collection, dict) else collection)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return [a + b for a in self.values(node.left) for b in self.values(node.right)]
        if isinstance(node, ast.JoinedStr):
            parts = [self.values(v.value) if isinstance(v, ast.FormattedValue) else [v.value] for v in node.values]
            return ["".join(map(str, combo)) for combo in itertools.product(*parts)]
        return [self.value(node)]

    def loop_binding(self, name: ast.Name) -> tuple[ast.expr, int | None] | None:
        """(iterable, position in a tuple target) of the innermost for-loop or comprehension binding `name`."""
        node = name
        while node in self.parents:
            node = self.parents[node]
            loops = getattr(node, "generators", [node] if isinstance(node, ast.For) else [])
            for loop in loops:
                if isinstance(loop.target, ast.Name) and loop.target.id == name.id:
                    return loop.iter, None
                targets = loop.target.elts if isinstance(loop.target, ast.Tuple) else []
                for position, target in enumerate(targets):
                    if isinstance(target, ast.Name) and target.id == name.id:
                        return loop.iter, position
        return None


def call_name(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def loaded_module(target: str) -> str:
    """The module of a loader's "package.module:name" or "dir/file.py:name"."""
    module = target.partition(":")[0]
    return module.removesuffix(".py").replace("/", ".") if module.endswith(".py") else module


def absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The module a `from ... import` names, relative ones resolved against the file's package."""
    if not node.level:
        return node.module
    package = path.parent.relative_to(root).parts
    return ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str | None]]:
    return _imports(path, root, path.read_text())  # keyed by the text: the tests below each read every file


@cache
def _imports(path: Path, root: Path, source: str) -> list[tuple[int, str | None]]:
    """(line, module) of every import in the file, at any depth: `import`, `from` (relative, and a submodule
    imported by `from package import name`), importlib and the project's loaders on names the source fixes. A
    dynamic import whose name the source does not fix is (line, None)."""
    tree = _parse(source, str(path))
    scope = None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, path, root)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if module_path(root, f"{base}.{a.name}")]
        elif isinstance(node, ast.Call) and node.args and call_name(node) in IMPORTERS | LOADERS:
            scope = scope or Scope(tree, root)  # built for the few files that import dynamically
            try:
                names = sorted({str(v) for v in scope.values(node.args[0])})
            except Unresolved:  # a loader given data checks it itself: only importlib's own calls are listed
                found += [(node.lineno, None)] if call_name(node) in IMPORTERS else []
                continue
            found += [(node.lineno, loaded_module(n) if call_name(node) in LOADERS else n) for n in names]
    return found


def violations(root: Path) -> list[str]:
    """Every upward import, stage-to-stage import and banned library import under `root`'s layers."""
    out = []
    for rank, layer in enumerate(LAYERS):
        for path in python_files(root, layer):
            where = path.relative_to(root)
            for line, module in imports(path, root):
                if module is None:
                    continue
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
        for path in python_files(root / "tasks", room):
            for _, module in imports(path, root):
                parts = (module or "").split(".")
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
    importers = sorted(str(path.relative_to(ROOT)) for layer in LAYERS for path in python_files(ROOT, layer)
                       if any((module or "").split(".")[0] == "ray" for _, module in imports(path)))
    assert importers == ["tasks/execution/ray_launch.py"]
    tree = ast.parse((ROOT / "tasks" / "execution" / "ray_launch.py").read_text())
    assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                and any((a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0] == "ray"
                        for a in n.names)], "ray is imported inside the functions that use it"


def test_every_dynamic_import_names_its_modules_in_the_source():
    """importlib's calls are checked like imports: each names constants (or a constant list), or is one of the two
    loaders of names from data, which check them where DATA_NAMED says."""
    unread = {str(path.relative_to(ROOT)) for folder in (*LAYERS, SCRIPTS) for path in python_files(ROOT, folder)
              if any(module is None for _, module in imports(path))}
    assert unread == set(DATA_NAMED)


def test_prefect_entrypoints_are_flows():
    """flows/deployments.py imports what prefect.yaml names: only flows' modules, so no layer is skipped."""
    entrypoints = [spec["entrypoint"] for spec in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]]
    assert entrypoints and all(re.fullmatch(r"flows/\w+\.py:\w+", e) for e in entrypoints), entrypoints


def test_the_checker_sees_dynamic_and_submodule_imports(tmp_path):
    for package in (*LAYERS, "tasks/stages", "tasks/dag", "tasks/execution"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tasks" / "stages" / "train.py").write_text("")
    (tmp_path / "tasks" / "dag" / "names.py").write_text('STAGES = {"train": "tasks.stages.train"}\n')
    (tmp_path / "tasks" / "stages" / "sft.py").write_text("from tasks.stages import train\n")
    (tmp_path / "tasks" / "execution" / "warm.py").write_text(
        "import importlib\nfrom tasks.dag.names import STAGES\nPRELOAD = ('torch', 'flows.pipeline')\n"
        "def f(name):\n    for m in (*PRELOAD, *STAGES.values()):\n        importlib.import_module(m)\n"
        "    importlib.import_module(STAGES[name])\n"
        "    from ..stages import train\n")
    (tmp_path / "tasks" / "execution" / "load.py").write_text(
        "def f(user):\n    return [__import__(f'cli.{n}') for n in ('main',)], __import__(user)\n")
    (tmp_path / "rlhf_core" / "logs.py").write_text("import importlib.util\nimportlib.util.find_spec('mlflow')\n")
    found = violations(tmp_path)
    for seen in ("tasks/stages/sft.py:1 imports tasks.stages.train: a stage never",
                 "tasks/execution/warm.py:6 imports flows.pipeline: tasks sits below flows",
                 "tasks/execution/warm.py:6 imports tasks.stages.train: a room",
                 "tasks/execution/warm.py:7 imports tasks.stages.train: a room",
                 "tasks/execution/warm.py:8 imports tasks.stages.train: a room",
                 "tasks/execution/load.py:2 imports cli.main: tasks sits below cli",
                 "rlhf_core/logs.py:2 imports mlflow"):
        assert any(v.startswith(seen) for v in found), (seen, found)
    assert (2, None) in imports(tmp_path / "tasks" / "execution" / "load.py", tmp_path)  # `user`: data, not source


# ------------------------------------------------------------------ no re-export shims

def reexports(path: Path) -> list[str]:
    """Names the module imports with `from` and never uses, or lists in __all__: kept for importers elsewhere
    (a `noqa: F401` keeps ruff quiet about them). An importer must import a name from where it lives."""
    tree = parsed(path)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}  # code and (unquoted) annotations
    exported = {e.value for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                for t in n.targets) for e in getattr(n.value, "elts", []) if isinstance(e, ast.Constant)}
    return [f"{path.relative_to(ROOT)}:{n.lineno} re-exports {a.asname or a.name} from {n.module}"
            for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module != "__future__"
            for a in n.names if a.name != "*" and ((a.asname or a.name) in exported or (a.asname or a.name) not in used)]


def test_no_module_re_exports_another_s_names():
    found = [r for folder in (*LAYERS, SCRIPTS) for path in python_files(ROOT, folder) for r in reexports(path)]
    assert found == []


def test_the_shim_check_sees_a_shim(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "scoring.py").write_text("from a import Fn, load  # noqa: F401 (re-exported)\ndef f(x: Fn): ...\n")
    (tmp_path / "api.py").write_text("from a import load\nfrom b import run\n__all__ = ['load']\nrun()\n")
    assert reexports(tmp_path / "scoring.py") == ["scoring.py:1 re-exports load from a"]
    assert reexports(tmp_path / "api.py") == ["api.py:1 re-exports load from a"]


# ------------------------------------------------------------------ no dead modules

DOCS = ("README.md", "docs", "bench/RESULTS.md", "infra")  # documented commands
RUNNERS = ("Makefile", "dvc.yaml", ".ci", "infra", "bench")  # files that run commands (shell, make, dvc)
RUN_LINE = re.compile(r"\bpython[\d.]*\b|\$\{?PY\b|\bBIN\)/python|\bsys\.executable\b")  # a line that runs Python


def module_names(root: Path) -> dict[str, Path]:
    """Every Python file under `root` by the name it is imported as: dotted in the layers, by file name elsewhere
    (bench/ and tests/ are put on sys.path as folders)."""
    files = []
    for folder, dirs, found in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]  # never .venv, .git, __pycache__
        files += [Path(folder, f) for f in found if f.endswith(".py")]
    names = {}
    for path in files:
        parts = path.relative_to(root).with_suffix("").parts
        dotted = parts[0] in LAYERS
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts) if dotted else path.stem] = path
    return names


def text_files(root: Path, places: tuple[str, ...]) -> list[Path]:
    return [p for place in places for p in ([root / place] if (root / place).is_file() else (root / place).rglob("*"))
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
            and not any(part.startswith(".") for part in p.relative_to(root / place).parts[:-1])]


def entry_points(root: Path) -> set[str]:
    """Modules run as programs: the console scripts, prefect.yaml's flows, dvc.yaml's stages, `python -m X` and
    `python path/to/x.py` in the Makefile, dvc.yaml, .ci/, infra/, bench's scripts and the docs."""
    found = set()
    if (pyproject := root / "pyproject.toml").is_file():
        scripts = tomllib.loads(pyproject.read_text()).get("project", {}).get("scripts", {})
        found |= {loaded_module(target) for target in scripts.values()}
    if (prefect := root / "prefect.yaml").is_file():
        found |= {loaded_module(d["entrypoint"]) for d in yaml.safe_load(prefect.read_text()).get("deployments", [])}
    if (dvc := root / "dvc.yaml").is_file():
        found |= {STAGES[m] for m in re.findall(r"\brlhf stage ([\w-]+)", dvc.read_text()) if m in STAGES}
    for path in text_files(root, (*DOCS, *RUNNERS)):
        for line in path.read_text(errors="replace").splitlines():
            found |= set(re.findall(r"(?:^|\s)-m\s+([A-Za-z_][\w.]*)", line))
            if RUN_LINE.search(line):
                found |= {Path(script).stem for script in re.findall(rf"\b{SCRIPTS}/(\w+)\.py\b", line)}
    return found


def script_paths(path: Path) -> set[str]:
    """Scripts a test or script runs or loads by path: "x.py" constants (also parts of `ROOT / "bench" / "x.py"`)."""
    return {Path(n.value).stem for n in ast.walk(parsed(path))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"[\w./-]+\.py", n.value)}


def dead_modules(root: Path) -> list[str]:
    """Modules of the layers and bench/ that no entry point, test or documented command reaches through imports."""
    names = module_names(root)
    checked = {n for n, p in names.items() if p.relative_to(root).parts[0] in (*LAYERS, SCRIPTS)}
    edges = {n: {m for _, m in imports(p, root) if m} | script_paths(p) for n, p in names.items()}
    todo = [n for n in names if n not in checked] + sorted(entry_points(root))
    reached = set()
    while todo:
        name = todo.pop()
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)]  # importing runs them
        for module in (m for m in parents if m in names and m not in reached):
            reached.add(module)
            todo += edges[module]
    return sorted(str(names[n].relative_to(root)) for n in checked - reached)


def test_every_module_is_imported_or_run():
    assert dead_modules(ROOT) == []


def test_the_dead_module_check_sees_a_dead_module(tmp_path):
    for package in ("rlhf_core", "tasks", "cli"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\nrlhf = "cli.main:main"\n')
    (tmp_path / "cli" / "main.py").write_text("from tasks import runner\n")
    (tmp_path / "tasks" / "runner.py").write_text("import rlhf_core\n")
    (tmp_path / "tasks" / "orphan.py").write_text("import rlhf_core.only_from_the_orphan\n")  # dead: so is what only it imports
    (tmp_path / "rlhf_core" / "only_from_the_orphan.py").write_text("")
    (tmp_path / "bench" / "timing.py").write_text("import rlhf_core\n")
    (tmp_path / "bench" / "curve.py").write_text("")
    (tmp_path / "bench" / "documented.py").write_text("")
    (tmp_path / "README.md").write_text("bench/timing.py times things (prose, not a command)\n"
                                        "    .venv/bin/python bench/documented.py --json\n")
    (tmp_path / "tests" / "test_curve.py").write_text("from pathlib import Path\nPath('.') / 'bench' / 'curve.py'\n")
    assert dead_modules(tmp_path) == ["bench/timing.py", "rlhf_core/only_from_the_orphan.py", "tasks/orphan.py"]
