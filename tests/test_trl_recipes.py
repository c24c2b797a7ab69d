"""TRL recipes move in (#31 item 4): TRL's current names as aliases of ours, and `rlhf from-trl`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from rlhf_core.config import PeftOptions, RLConfig
from tasks.common.params import ParamsError, load_params

REPO = Path(__file__).resolve().parent.parent

# -- aliases ---------------------------------------------------------------------------------------------------------

ALIASES = [  # (TRL's or PEFT's name, ours inside train, a valid value other than params.yaml's)
    ("beta", "kl_coef", 0.07),
    ("epsilon", "cliprange", 0.3),
    ("num_generations", "rloo.rloo_k", 4),
    ("max_completion_length", "response_length", 17),
    ("r", "lora_r", 4),
    ("target_modules", "lora_target_modules", ["query_key_value"]),
    ("modules_to_save", "lora_modules_to_save", ["embed_out"]),
    ("task_type", "lora_task_type", "CAUSAL_LM"),
]


@pytest.fixture
def params_dir(tmp_path):
    """A workspace with the repository's params.yaml (the demo's train section sets kl_coef, rloo.rloo_k...)."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "profiles").mkdir()
    return tmp_path


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


@pytest.mark.parametrize(("alias", "ours", "value"), ALIASES, ids=[a for a, *_ in ALIASES])
def test_an_alias_sets_our_key_from_the_command_line_and_from_a_profile(params_dir, alias, ours, value):
    by_ours = load_params(params_dir, overrides=[f"train.{ours}={_yaml_value(value)}"])
    by_alias = load_params(params_dir, overrides=[f"train.{alias}={_yaml_value(value)}"])
    assert by_alias == by_ours, "the alias over params.yaml's key gives the same params as our key"
    (params_dir / "profiles" / "trl.yaml").write_text(yaml.safe_dump({"train": {alias: value}}))
    assert load_params(params_dir, "trl").train == by_ours.train
    dumped = by_alias.train.model_dump()
    assert alias not in dumped and alias not in by_alias.rl_config().model_dump(), "the rest sees our names only"


def test_the_library_configs_take_the_aliases_directly():
    cfg = RLConfig(algo="rloo", beta=0.1, epsilon=0.25, num_generations=3, max_completion_length=9,
                   per_device_train_batch_size=6)
    assert (cfg.kl_coef, cfg.cliprange, cfg.rloo.rloo_k, cfg.response_length) == (0.1, 0.25, 3, 9)
    peft = PeftOptions(use_peft=True, r=4, target_modules="all-linear", modules_to_save=["embed_out"])
    assert (peft.lora_r, peft.lora_target_modules, peft.lora_modules_to_save) == (4, "all-linear", ["embed_out"])


@pytest.mark.parametrize(("alias", "ours", "value"), ALIASES, ids=[a for a, *_ in ALIASES])
def test_both_names_of_one_setting_are_refused_naming_both(params_dir, alias, ours, value):
    both = [f"train.{alias}={_yaml_value(value)}", f"train.{ours}={_yaml_value(value)}"]
    with pytest.raises(ParamsError) as err:
        load_params(params_dir, overrides=both)
    assert f"{alias} and {ours} are one setting" in str(err.value)
    (params_dir / "profiles" / "both.yaml").write_text(yaml.safe_dump({"train": {alias: value, **_nested(ours, value)}}))
    with pytest.raises(ParamsError, match=f"{alias} and {ours} are one setting"):
        load_params(params_dir, "both")


def _nested(key: str, value) -> dict:
    *parents, last = key.split(".")
    out = {last: value}
    for part in reversed(parents):
        out = {part: out}
    return out


@pytest.mark.parametrize(("item", "written"), [
    ("train.beta=-0.5", "beta=-0.5: Input should be greater than or equal to 0"),
    ("train.epsilon=wide", "epsilon='wide': Input should be a valid number"),
    ("train.num_generations=1", "num_generations=1: Input should be greater than or equal to 2"),
    ("train.max_completion_length=0", "max_completion_length=0: Input should be greater than 0"),
    ("train.r=0", "r=0: Input should be greater than 0"),
])
def test_a_bad_value_is_reported_under_the_name_written(params_dir, item, written):
    with pytest.raises(ParamsError) as err:
        load_params(params_dir, overrides=[item])
    assert f"train: {written}" in str(err.value), str(err.value)


def test_a_mistyped_alias_is_suggested(params_dir):
    with pytest.raises(ParamsError, match="did you mean 'train.beta'"):
        load_params(params_dir, overrides=["train.betta=0.1"])


@pytest.mark.parametrize("profile", [None, "trl"])
def test_rlhf_run_writes_an_alias_override_onto_our_key_in_params_yaml(params_dir, profile):
    """`rlhf run --set train.beta=0.1` edits params.yaml for the run: the stages then read kl_coef 0.1 (with both
    names in the file, every stage would refuse to start)."""
    from flows.overrides import edited_yaml, planned_changes

    if profile:  # a profile written with TRL's names, under the run's override of another of its keys
        (params_dir / "profiles" / "trl.yaml").write_text(yaml.safe_dump({"train": {"beta": 0.2, "num_generations": 4}}))
    changes = planned_changes(params_dir, profile or "demo", ["train.beta=0.1"])
    assert ("train.kl_coef", 0.15, 0.1) in changes and not [key for key, *_ in changes if "beta" in key]
    original = (params_dir / "params.yaml").read_text()
    (params_dir / "params.yaml").write_text(edited_yaml(original, {key: new for key, _, new in changes}))
    stage_view = load_params(params_dir)  # what a stage reads: params.yaml, then the run's profile
    assert stage_view.train.kl_coef == 0.1
    assert stage_view.train.rloo.rloo_k == (4 if profile else 2)
