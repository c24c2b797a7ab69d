"""A run's overrides grant no more than the committed pipeline (docs/security.md): reward functions only from the
modules params.yaml's trust.reward_modules allows, checked before anything is imported; paths only under the
workspace or trust.roots; trust itself out of the overrides' reach; profiles by name only. Whoever may
trigger a run (the Prefect UI or API, `rlhf run --set`) is refused before any stage, with one message naming the key."""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.parameters.params import ParamsError, load_params

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def trusting(tmp_path):
    """A workspace whose params.yaml trusts one reward module and one folder outside it."""
    outside = tmp_path / "corpora"
    outside.mkdir()
    (tmp_path / "ws").mkdir()
    params = {"trust": {"reward_modules": ["test_reward_sources"], "roots": [str(outside)]}}
    (tmp_path / "ws" / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path / "ws", outside


def test_a_reward_function_outside_the_trusted_modules_is_refused_before_any_import(tmp_path):
    """The issue's own case: Python's `this` (it prints the Zen of Python on import) named by an override."""
    code = ("import sys\nfrom tasks.parameters.params import ParamsError, load_params\ntry:\n"
            "    load_params('.', None, ['train.reward_funcs=[{\"function\": \"this:s\"}]'])\n"
            "except ParamsError as err:\n    print('REFUSED', err)\nprint('IMPORTED' if 'this' in sys.modules else 'NOT IMPORTED')\n")
    (tmp_path / "params.yaml").write_text("base: {seed: 0}\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "NOT IMPORTED" in out.stdout, out.stdout + out.stderr
    assert "train.reward_funcs[0].function: module 'this' is not in trust.reward_modules" in out.stdout
    assert "The Zen of Python" not in out.stdout


def test_trusted_modules_are_prefixes_of_whole_package_names(trusting):
    workspace, _ = trusting
    ok = load_params(workspace, None, ['train.reward_funcs=[{"function": "test_reward_sources:words"}]'])
    assert ok.train.reward_funcs[0].label == "words"
    for module in ("test_reward_sources_evil", "os", "subprocess"):
        with pytest.raises(ParamsError, match=f"module {module!r} is not in trust.reward_modules"):
            load_params(workspace, None, [f'train.reward_funcs=[{{"function": "{module}:system"}}]'])


def test_overrides_cannot_widen_the_trust(trusting):
    workspace, _ = trusting
    for override in ('trust.reward_modules=["os"]', "trust.roots=[/]",
                     'trust={"reward_modules": ["os"]}'):
        with pytest.raises(ParamsError, match="trust: a run's overrides cannot set it"):
            load_params(workspace, None, [override])


def test_paths_in_overrides_stay_under_the_workspace_or_trusted_roots(trusting):
    workspace, outside = trusting
    (outside / "sft.jsonl").write_text("{}\n")
    load_params(workspace, None, [f"prepare.sft={outside / 'sft.jsonl'}", "prepare.preferences=data/p.jsonl",
                                  "sft.base_model=EleutherAI/pythia-160m"])  # a hub id is not a path
    refused = {"runtime.accelerate_config=/etc/passwd": "runtime.accelerate_config: /etc/passwd is outside",
               "prepare.sft=../../secrets.jsonl": "prepare.sft: ../../secrets.jsonl is outside",
               "prepare.prompts=~/.ssh/id_rsa": "prepare.prompts: ~/.ssh/id_rsa is outside",
               f"prepare.sft={outside}/../escape.jsonl": "prepare.sft: ",
               'train.reward_funcs=[{"model": "/opt/models/rm"}]': "train.reward_funcs[0].model: /opt/models/rm"}
    for override, message in refused.items():
        with pytest.raises(ParamsError, match="invalid overrides") as err:
            load_params(workspace, None, [override])
        assert message in str(err.value), err.value


def test_a_path_is_checked_as_the_stage_will_use_it_whatever_yaml_made_of_it(trusting):
    """YAML's `!!binary` makes bytes, which the check of strings let through and pydantic then decoded into the path a
    stage opens: the check reads the validated value, so every spelling of /etc/passwd is the same refusal."""
    workspace, outside = trusting
    secret = base64.b64encode(b"/etc/passwd").decode()
    for override in (f"prepare.sft=!!binary {secret}", f"prepare={{sft: !!binary {secret}}}",
                     f'train.reward_funcs=[{{"model": !!binary {secret}}}]', "prepare.sft=!!str /etc/passwd",
                     f"runtime.accelerate_config=!!binary {base64.b64encode(b'file:///etc/passwd').decode()}"):
        with pytest.raises(ParamsError, match="invalid overrides") as err:
            load_params(workspace, None, [override])
        assert "/etc/passwd is outside the workspace" in str(err.value), (override, err.value)
    inside = load_params(workspace, None, [f"prepare.sft=!!binary {base64.b64encode(b'data/sft.jsonl').decode()}"])
    assert inside.prepare.sft == "data/sft.jsonl"


def test_a_dataset_folder_whose_card_leads_out_is_refused_before_the_run(trusting):
    """A local dataset folder passes the path check; the files its card names are checked too, before any stage."""
    from flows.overrides import check_run_inputs

    workspace, outside = trusting
    (outside / "secret.jsonl").write_text('{"prompt": "the secret"}\n')
    folder = workspace / "data" / "cards"
    folder.mkdir(parents=True)
    configs = [{"config_name": "default", "data_files": [{"split": "train", "path": str(outside / "secret.jsonl")}]}]
    (folder / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': configs})}---\n")
    (workspace / "data" / "p.jsonl").write_text("{}\n")
    overrides = ["prepare.source=files", "prepare.sft=data/cards", "prepare.preferences=data/p.jsonl"]
    params = load_params(workspace, None, overrides)  # the folder itself is inside the workspace
    with pytest.raises(ParamsError) as err:
        check_run_inputs(params, workspace, overrides)
    assert (f"prepare.sft: {folder}: its dataset card or saved state names {outside / 'secret.jsonl'}, outside the "
            "dataset") in str(err.value)


def test_a_file_named_tilde_in_the_workspace_is_not_the_home_folder(trusting):
    """`./~` names the workspace's file `~` (Path would normalize it to `~`, the home folder); `~` alone is home."""
    workspace, _ = trusting
    load_params(workspace, None, ["prepare.sft=./~", "prepare.prompts=./~/p.jsonl"])
    with pytest.raises(ParamsError, match="prepare.sft: ~ is outside"):
        load_params(workspace, None, ['prepare.sft="~"'])  # quoted: a bare ~ is YAML's null


def test_a_profile_is_named_not_pathed(trusting):
    workspace, _ = trusting
    for profile in ("../../etc/evil", "/tmp/x", ".hidden"):
        with pytest.raises(ParamsError, match="expected the name of a file in"):
            load_params(workspace, profile)


# ------------------------------------------------------------------ reward functions: defined where they are named


def own_reward(prompts, completions):
    """Defined here, at module level: the one kind of object `test_trust:own_reward` may name."""
    return [0.0 for _ in completions]


alias_reward = own_reward  # an alias: its own name says own_reward
imported_run = subprocess.run  # a name this module imported, under another name


def _reward_funcs(function: str, modules: list[str]):
    from tasks.parameters.params import Params

    return Params.model_validate({"trust": {"reward_modules": modules},
                                  "train": {"reward_funcs": [{"function": function}]}})


def test_a_reward_function_is_one_defined_at_module_level_in_an_allowed_module(trusting):
    """The issue's case: with trust.reward_modules [tasks], `tasks.execution.launcher:subprocess.run` reached the
    subprocess module that launcher imported. Now the object named must be defined, at module level, in the module
    the path names (its own __module__ and __qualname__), so an allowed module lends nothing it imported."""
    from pydantic import ValidationError

    workspace, _ = trusting
    (workspace / "params.yaml").write_text(yaml.safe_dump({"trust": {"reward_modules": ["tasks", "test_trust"]}}))
    for function in ("tasks.execution.launcher:is_main_process", "test_trust:own_reward"):
        [source] = load_params(workspace, None, [f'train.reward_funcs=[{{"function": "{function}"}}]']).train.reward_funcs
        assert source.function == function
    refused = {"tasks.execution.launcher:subprocess.run": "one name after the colon, no attribute path",
               "tasks.execution.launcher:os.system": "one name after the colon, no attribute path",
               "tasks.execution.launcher:Path": "tasks.execution.launcher.Path is pathlib:Path, not a function defined at "
                                            "module level in 'tasks.execution.launcher'",
               "tasks.execution.launcher:subprocess": "'subprocess' is a module, not callable",
               "test_trust:imported_run": "test_trust.imported_run is subprocess:run, not a function defined",
               "test_trust:alias_reward": "test_trust.alias_reward is test_trust:own_reward, not a function defined",
               "test_trust:pytest.main": "no attribute path"}
    for function, says in refused.items():
        with pytest.raises(ParamsError) as err:
            load_params(workspace, None, [f'train.reward_funcs=[{{"function": "{function}"}}]'])
        assert "train.reward_funcs" in str(err.value) and says in str(err.value), (function, str(err.value))
        with pytest.raises(ValidationError, match="train.reward_funcs"):  # the same check where a stage reads params
            _reward_funcs(function, ["tasks", "test_trust"])
    for function in ("tasks.execution.launcher:subprocess.run", "test_trust:imported_run"):
        with pytest.raises(ParamsError, match=r"train.reward_funcs\[0\].function: .*; trust.reward_modules "
                                              r"\(\['tasks', 'test_trust'\]\) allows functions defined at module level"):
            load_params(workspace, None, [f'train.reward_funcs=[{{"function": "{function}"}}]'])


# ------------------------------------------------------------------ paths: resolved, symlinks included


def test_a_relative_path_through_a_symlink_out_of_the_workspace_is_refused(trusting):
    """The issue's case: `data/etc -> /etc` inside the workspace and `prepare.sft=data/etc/passwd`; also a `file:`
    URL of an outside file. A symlink that stays inside, or leads into trust.roots, is followed and accepted."""
    workspace, outside = trusting
    (workspace / "data").mkdir()
    (workspace / "data" / "etc").symlink_to("/etc")
    (workspace / "data" / "corpora").symlink_to(outside)
    (workspace / "data" / "again").symlink_to(workspace / "data")
    (workspace / "data" / "loop").symlink_to("loop")
    refused = {"prepare.sft=data/etc/passwd": "prepare.sft: data/etc/passwd is outside",
               "prepare.sft=data/again/etc/passwd": "it names /etc/passwd;",
               "prepare.sft=data/corpora/../../../etc/passwd": "is outside the workspace",
               "prepare.sft=file:///etc/passwd": "prepare.sft: file:///etc/passwd is outside",
               'train.reward_funcs=[{"model": "data/etc"}]': "train.reward_funcs[0].model: data/etc is outside",
               "prepare.sft=data/loop/x.jsonl": "prepare.sft: 'data/loop/x.jsonl' cannot be resolved to a file"}
    for override, says in refused.items():
        with pytest.raises(ParamsError, match="invalid overrides") as err:
            load_params(workspace, None, [override])
        assert says in str(err.value), (override, str(err.value))
    load_params(workspace, None, ["prepare.sft=data/again/sft.jsonl", "prepare.preferences=data/corpora/p.jsonl",
                                  f"prepare.prompts=file://{outside}/prompts.jsonl"])


# ------------------------------------------------------------------ who sets trust: params.yaml alone


def test_a_run_cannot_choose_the_ray_cluster_or_its_storage(trusting):
    """A Ray cluster runs the stage's code and sends back pickled objects, and its storage receives the stage's data:
    a run may ask for the Ray launcher, not point it at another cluster. params.yaml, a committed profile or the
    environment of whoever runs the stage (RAY_ADDRESS, RLHF_RAY_STORAGE) name them."""
    workspace, _ = trusting
    for override in ("runtime.ray_address=attacker.example:6379", "runtime.ray_address=ray://attacker.example:10001",
                     "runtime.ray_storage=s3://elsewhere/loot", 'runtime={"ray_address": "attacker.example:6379"}'):
        with pytest.raises(ParamsError, match=r"runtime\.ray_(address|storage): a run's overrides cannot set it"):
            load_params(workspace, None, ["runtime.launcher=ray", override])
    assert load_params(workspace, None, ["runtime.launcher=ray"]).runtime.launcher == "ray"
    (workspace / "profiles").mkdir()
    (workspace / "profiles" / "cluster.yaml").write_text(yaml.safe_dump(
        {"runtime": {"launcher": "ray", "ray_address": "head.internal:6379", "ray_storage": "s3://team/ray"}}))
    assert load_params(workspace, "cluster").runtime.ray_address == "head.internal:6379"


def test_a_profile_cannot_set_trust(trusting):
    """A run may pick any committed profile (`--profile`, `--set base.profile=`, the Prefect UI): trust set in one
    would widen every run. Only params.yaml sets it; the error names the profile's file and the key."""
    workspace, _ = trusting
    (workspace / "profiles").mkdir()
    (workspace / "profiles" / "wide.yaml").write_text(yaml.safe_dump({"trust": {"reward_modules": ["os"]}}))
    (workspace / "profiles" / "narrow.yaml").write_text(yaml.safe_dump({"train": {"kl_coef": 0.1}}))
    assert load_params(workspace, "narrow").trust.reward_modules == ["test_reward_sources"]
    for how in ({"profile": "wide"}, {"overrides": ["base.profile=wide"]}):
        with pytest.raises(ParamsError) as err:
            load_params(workspace, how.get("profile"), how.get("overrides", []))
        assert f"{workspace / 'profiles' / 'wide.yaml'}: trust: a profile cannot set it" in str(err.value)
        assert "params.yaml's trust section" in str(err.value)


# ------------------------------------------------------------------ properties: nothing outside is ever accepted


@pytest.fixture(scope="module")
def maze(tmp_path_factory):
    """A workspace and a trusted root outside it, with symlinks in and out of both; an untrusted folder beside them."""
    top = tmp_path_factory.mktemp("maze")
    ws, corpora, secret = top / "ws", top / "corpora", top / "secret"
    for folder in (ws / "data", corpora, secret):
        folder.mkdir(parents=True)
    (ws / "data" / "sft.jsonl").write_text("{}\n")
    (corpora / "a.jsonl").write_text("{}\n")
    (secret / "key").write_text("secret\n")
    links = {ws / "data" / "etc": "/etc", ws / "data" / "up": "..", ws / "data" / "out": "../..",
             ws / "data" / "corp": str(corpora), ws / "data" / "loop": "loop", ws / "data" / "dangling": "/nonexistent-41",
             ws / "data" / "rel": "sft.jsonl", ws / "data" / "sec": "../../secret", corpora / "back": str(ws / "data"),
             corpora / "esc": "/etc", top / "to_ws": str(ws)}
    for link, target in links.items():
        link.symlink_to(target)
    (ws / "params.yaml").write_text(yaml.safe_dump({"trust": {"roots": [str(corpora)]}}))
    return ws, corpora, top


PARTS = ["data", "etc", "passwd", "up", "out", "corp", "loop", "dangling", "rel", "sec", "sft.jsonl", "a.jsonl",
         "corpora", "secret", "key", "back", "esc", "to_ws", "ws", "..", ".", "~", "x"]


def _inside(value: str, roots: list[Path]) -> bool:
    """The oracle, from the operating system's side: the path open() would follow (realpath of what the kernel sees)
    lies under a root; and where it exists, the very file (device, inode) is one found by walking the roots."""
    path = os.path.expanduser(value.removeprefix("file://"))
    real = os.path.realpath(os.path.join(roots[0], path))
    if not any(os.path.commonpath([real, str(root)]) == str(root) for root in roots):
        return False
    return not os.path.exists(real) or _identity(real) in _files_under(tuple(roots))


def _identity(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


@functools.cache
def _files_under(roots: tuple[Path, ...]) -> frozenset[tuple[int, int]]:
    found = set()
    for root in roots:
        for folder, dirs, files in os.walk(root):  # symlinks not followed: only what really lies inside
            found.update(_identity(os.path.join(folder, name)) for name in [".", *dirs, *files]
                         if not os.path.islink(os.path.join(folder, name)))
    return frozenset(found)


# The ways YAML can spell a value that reaches a stage as the same path string: a JSON string, an explicit str tag,
# and bytes (`!!binary`, which pydantic decodes into the str a stage opens)
YAML_FORMS = [json.dumps, lambda value: f"!!str {json.dumps(value)}",
              lambda value: f"!!binary {base64.b64encode(value.encode()).decode()}"]


@st.composite
def paths(draw, top: Path):
    start = draw(st.sampled_from(["", "./", "/", "~/", "~", "~root/", "file:///", f"{top}/", f"{top}/ws/", "/etc/"]))
    return start + "/".join(draw(st.lists(st.sampled_from(PARTS), max_size=6)))


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_no_generated_path_outside_the_workspace_or_the_trusted_roots_is_accepted(maze, data):
    """Paths from absolute, `~`, `file://` and relative starts through `..`, `.` and symlinks that lead in, out, back
    and around: an override is accepted exactly when the file it names lies under the workspace or trust.roots (a
    symlink loop, naming nothing, is refused)."""
    ws, corpora, top = maze
    value = data.draw(paths(top))
    as_yaml = data.draw(st.sampled_from(YAML_FORMS))(value)
    override = data.draw(st.sampled_from([f"prepare.sft={as_yaml}", f"prepare={{sft: {as_yaml}}}",
                                          f"train.reward_funcs=[{{\"model\": {as_yaml}}}]"]))
    roots = [ws.resolve(), corpora.resolve()]
    try:
        load_params(ws, None, [override])
        accepted = True
    except ParamsError as err:
        assert "invalid overrides" in str(err), str(err)
        accepted = False
    if accepted:
        assert _inside(value, roots), f"{value} was accepted but names a file outside {roots}"
    elif "loop" not in value and not (value.startswith("~") and os.path.expanduser(value) == value):
        # refused with reason: a loop names no file; an unknown ~user's home cannot be checked
        assert not _inside(value, roots), f"{value} names a file inside {roots} but was refused"


MODULES = ["tasks", "tasks.execution.launcher", "tasks.parameters.params", "test_trust", "test_reward_sources", "os",
           "subprocess", "this", "tasks_x", "test_trust_x"]


@functools.cache
def _names() -> list[str]:
    import importlib

    names = {"own_reward", "alias_reward", "imported_run", "words", "system", "run", "s"}
    for module in ("tasks.execution.launcher", "tasks.parameters.params", "test_trust", "test_reward_sources"):
        names.update(n for n in dir(importlib.import_module(module)) if not n.startswith("__"))
    return sorted(names)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_no_generated_reward_function_outside_the_trusted_modules_is_accepted(data):
    """'module:name' and 'module:name.name' over the names the trusted modules hold (their own functions and every
    name they imported): accepted only when the object is defined at module level in a trusted module, under the
    name the path gives; a module outside the trust is never imported."""
    from pydantic import ValidationError

    from rlhf_core.reward_functions import import_reward_function

    module = data.draw(st.sampled_from(MODULES))
    name = ".".join(data.draw(st.lists(st.sampled_from(_names()), min_size=1, max_size=2)))
    function = f"{module}:{name}"
    try:
        _reward_funcs(function, ["tasks", "test_trust"])
        accepted = True
    except ValidationError:
        accepted = False
    assert "this" not in sys.modules, "a module outside the trust was imported"
    if accepted:
        fn = import_reward_function(function)
        assert fn.__module__ == module and fn.__module__.split(".")[0] in ("tasks", "test_trust"), function
        assert "." not in fn.__qualname__ and getattr(sys.modules[fn.__module__], fn.__qualname__) is fn, function
        assert name == fn.__qualname__, f"{function} is {fn.__module__}:{fn.__qualname__}"
