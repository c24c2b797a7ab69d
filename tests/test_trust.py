"""A run's overrides grant no more than the committed pipeline (docs/security.md): reward functions only from the
modules params.yaml's trust.reward_modules allows, checked before anything is imported; paths only under the
workspace or trust.roots; trust itself out of the overrides' reach; profiles by name only. Whoever may
trigger a run (the Prefect UI or API, `rlhf run --set`) is refused before any stage, with one message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.common.params import ParamsError, load_params

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
    code = ("import sys\nfrom tasks.common.params import ParamsError, load_params\ntry:\n"
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


def test_a_profile_is_named_not_pathed(trusting):
    workspace, _ = trusting
    for profile in ("../../etc/evil", "/tmp/x", ".hidden"):
        with pytest.raises(ParamsError, match="expected the name of a file in"):
            load_params(workspace, profile)
