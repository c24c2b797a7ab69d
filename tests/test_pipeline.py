"""The pipeline end to end through the real `rlhf` entry point, on a shrunken demo world."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from tasks.dag.stage_modules import STAGES
from tasks.parameters.params import ParamsError, load_params
from tasks.tracking.mlflow_store import experiment_id, get_client

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "prepare.world.sft_train=128", "prepare.world.sft_eval=16", "prepare.world.prefs_train=128",
    "prepare.world.prefs_eval=32", "prepare.world.prompts_train=64", "prepare.world.prompts_eval=8",
    "prepare.tokenizer_vocab_size=512", "sft.epochs=1", "reward_model.epochs=1",
    "sft.tiny.hidden_size=32", "sft.tiny.num_layers=1", "sft.tiny.intermediate_size=64", "sft.eval_max_new_tokens=8",
    "train.total_episodes=64", "train.response_length=8", "train.checkpoint_every=1",
    "evaluate.num_prompts=8", "evaluate.response_length=8",
]


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def run_all_stages(*args: str) -> None:
    """Every stage in process, in order: the pipeline without Prefect or DVC (`rlhf run`, the Prefect flow
    over DVC, is tested in tests/test_flow.py)."""
    for name in STAGES:
        invoke("stage", name, *args)


def test_run_writes_every_stage_output(workspace):
    run_all_stages(*[x for item in TINY for x in ("--set", item)])
    # register points MLflow's globals at its run only while it logs the model: left exported, every later
    # subprocess of this process (a `dvc repro`) tracked into this workspace's store
    assert not {"MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID"} & set(os.environ)
    for split in ("sft_train", "sft_eval", "prefs_train", "prefs_eval", "prompts_train", "prompts_eval"):
        assert (workspace / "data" / f"{split}.jsonl").stat().st_size > 0
    for model in ("tokenizer", "sft", "reward", "policy"):
        assert any((workspace / "models" / model).iterdir()), model
    assert list((workspace / "models" / "policy").glob("*.safetensors"))
    reward = json.loads((workspace / "metrics" / "reward.json").read_text())
    assert {"eval/gold_accuracy", "eval/misstated_accuracy"} <= set(reward), "the world's gold and probe"
    evaluation = json.loads((workspace / "metrics" / "eval.json").read_text())
    for key in ("win_rate_rm", "win_rate_gold", "mean_score_rm", "mean_score_gold", "mean_kl", "eos_rate",
                "mean_length", "ref_mean_score_rm", "ref_mean_score_gold", "ref_eos_rate", "ref_mean_length"):
        assert key in evaluation, key
    rows = [json.loads(line) for line in (workspace / "reports" / "eval" / "completions.jsonl").open()]
    assert len(rows) == 8 and {"prompt", "completion", "ref_completion", "score_gold"} <= set(rows[0])
    for plot in ("reward_over_updates.png", "reward_vs_kl.png", "response_lengths.png"):
        assert (workspace / "reports" / "eval" / plot).read_bytes()[:4] == b"\x89PNG"
    assert not list(workspace.rglob("*.tmp")), "no temp outputs are left behind"
    client = get_client(workspace)  # every stage is an MLflow run; the policy is registered
    runs = client.search_runs([experiment_id(client, workspace)])
    assert {r.data.tags["rlhf.stage"] for r in runs} == set(STAGES)
    assert {r.info.run_name.split(" · ")[0] for r in runs} == set(STAGES), "named by stage, then by run"
    train_run = next(r for r in runs if r.data.tags["rlhf.stage"] == "train")
    assert client.get_metric_history(train_run.info.run_id, "objective/kl"), "per-update metrics"
    assert json.loads((workspace / "metrics" / "register.json").read_text())["version"] == 1

    # a rerun with the same inputs resumes from the final checkpoint: no update is redone
    trained = json.loads((workspace / "metrics" / "train.json").read_text())
    assert -1.0 <= trained["monitor/gold"] <= 1.0, "the world's gold reward is monitored during training"

    def resumed_from() -> int:  # an execution figure: in reports/execution/, not in DVC's metrics
        return json.loads((workspace / "reports" / "execution" / "train.json").read_text())["resumed_from_update"]

    overrides = [x for item in TINY for x in ("--set", item)]
    invoke("stage", "train", *overrides)
    again = json.loads((workspace / "metrics" / "train.json").read_text())
    assert resumed_from() == 1 and again == trained, "the same results, byte for byte"
    # new inputs invalidate the checkpoints: training starts over
    prompts = workspace / "data" / "prompts_train.jsonl"
    prompts.write_text(prompts.read_text().replace("TL;DR:", "TL;DR: "))
    invoke("stage", "train", *overrides)
    assert resumed_from() == 0
    assert len(json.loads((workspace / "metrics" / "train_history.json").read_text())) == 1


def test_params_errors_name_the_key(workspace):
    with pytest.raises(ParamsError, match=r"train.kl_coeff: unknown key \(did you mean 'train.kl_coef'\?\); allowed: "):
        load_params(workspace, overrides=["train.kl_coeff=0.1"])
    with pytest.raises(ParamsError, match=r"train.rloo.rloo_kk: unknown key \(did you mean 'train.rloo.rloo_k'\?\)"):
        load_params(workspace, overrides=["train.rloo.rloo_kk=3"])
    with pytest.raises(ParamsError, match="train.seed is not a parameter"):
        load_params(workspace, overrides=["train.seed=3"])
    assert load_params(workspace, overrides=["train.kl_coef=0.1"]).rl_config().kl_coef == 0.1


def test_params_errors_name_where_the_bad_value_came_from(workspace):
    """A typo in `--set` is the run's overrides' fault, not params.yaml's, which the user did not edit; a profile's
    is its file's; params.yaml's its own."""
    with pytest.raises(ParamsError) as err:
        load_params(workspace, overrides=["train.kl_cof=0.1"])
    assert str(err.value).startswith("the run's overrides: invalid parameters\n  train.kl_cof: unknown key")
    with pytest.raises(ParamsError, match="^the run's overrides: train.seed is not a parameter"):
        load_params(workspace, overrides=["train.seed=3"])
    profile = workspace / "profiles" / "typo.yaml"
    profile.parent.mkdir(exist_ok=True)
    profile.write_text("train: {kl_coef: lots}\n")
    with pytest.raises(ParamsError) as err:
        load_params(workspace, "typo")
    assert str(err.value).startswith(f"{profile}: invalid parameters\n  train.kl_coef: "), err.value
    with pytest.raises(ParamsError) as err:  # the override outranks the profile's bad value: blamed for its own
        load_params(workspace, "typo", ["train.kl_coef=nope"])
    assert str(err.value).startswith("the run's overrides: invalid parameters"), err.value
    (workspace / "params.yaml").write_text((workspace / "params.yaml").read_text() + "\nevaluate: {bogus: 1}\n")
    with pytest.raises(ParamsError) as err:
        load_params(workspace, "typo", ["train.kl_coef=nope"])
    assert str(err.value).startswith(f"the run's overrides and {workspace / 'params.yaml'}: invalid parameters")


def test_real_profile_runs_on_local_copies(workspace, make_policy, make_scorer_model, tokenizer):
    """tldr-pythia-1b with its hub ids replaced by local copies saved the way the hub stores them."""
    shutil.copytree(REPO / "profiles", workspace / "profiles")
    for name, model in (("sft_model", make_policy()), ("reward_model", make_scorer_model())):
        model.save_pretrained(workspace / name)
        tokenizer.save_pretrained(workspace / name)
    words = [f"w{i}" for i in range(2, 16)]
    sft_rows = [{"prompt": f"POST: {words[i % 14]} {words[i // 14]}\nTL;DR:", "completion": f" {words[i % 14]}"}
                for i in range(60)]
    pref_rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": " w7 w7"} for r in sft_rows]
    for name, rows in (("sft.jsonl", sft_rows + sft_rows[:3]), ("prefs.jsonl", pref_rows)):
        (workspace / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = ["prepare.sft=sft.jsonl", "prepare.preferences=prefs.jsonl", "prepare.tokenizer=sft_model",
             "prepare.eval_fraction=0.3", "sft.pretrained=sft_model", "reward_model.pretrained=reward_model",
             "train.total_episodes=16", "train.per_device_train_batch_size=8", "train.gradient_accumulation_steps=2",
             "train.local_rollout_forward_batch_size=16", "train.response_length=4", "evaluate.num_prompts=4",
             "evaluate.response_length=4", "sft.eval_max_new_tokens=4"]
    params = load_params(workspace, "tldr-pythia-1b", local)
    assert params.train.learning_rate == 3e-6 and params.train.kl_coef == 0.05 and params.train.num_epochs == 4
    run_all_stages("--profile", "tldr-pythia-1b", *[x for item in local for x in ("--set", item)])
    prepared = json.loads((workspace / "metrics" / "prepare.json").read_text())
    assert prepared["sft_train"]["duplicates"] + prepared["sft_eval"]["duplicates"] == 3
    train_prompts = {json.loads(line)["prompt"] for line in (workspace / "data" / "prompts_train.jsonl").open()}
    eval_prompts = {json.loads(line)["prompt"] for line in (workspace / "data" / "prompts_eval.jsonl").open()}
    assert eval_prompts and not train_prompts & eval_prompts, "eval prompts are held out of training"
    evaluation = json.loads((workspace / "metrics" / "eval.json").read_text())
    assert "win_rate_rm" in evaluation and "win_rate_gold" not in evaluation, "real data has no gold reward"
