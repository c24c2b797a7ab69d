"""The register stage and `rlhf models` on a real sqlite MLflow registry: the promotion gate, aliases,
manual promotion, and the champion loaded back with mlflow.transformers and generating."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from rlhf_core.models import load_policy
from tasks.common.mlflow_store import get_client, tracking_uri
from tasks.common.params import RegisterParams
from tasks.common.runner import run_stage
from tasks.stages.register import RegisterError, current_user, decide, read_eval

NAME = "rlhf-policy"


def register(root, win_rate: float, mean_kl: float) -> dict:
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics" / "eval.json").write_text(json.dumps({"win_rate_rm": win_rate, "mean_kl": mean_kl,
                                                            "win_rate_gold": 0.4}))
    run_stage("register", root)
    return json.loads((root / "metrics" / "register.json").read_text())


@pytest.fixture
def policy_root(mlflow_root, make_policy, tokenizer):
    make_policy().save_pretrained(mlflow_root / "models" / "policy")
    tokenizer.save_pretrained(mlflow_root / "models" / "policy")
    return mlflow_root


def test_gate():
    cfg = RegisterParams(max_kl=10.0, min_primary=0.5)
    assert decide(0.6, 1.0, None, cfg).promote, "first version above the minimum"
    assert not decide(0.5, 1.0, None, cfg).promote, "no better than the reference"
    assert not decide(0.9, 10.5, None, cfg).promote, "over the KL budget"
    assert decide(0.8, 1.0, 0.7, cfg, champion="1").promote
    assert not decide(0.7, 1.0, 0.7, cfg, champion="1").promote, "a tie keeps the champion"
    assert "no recorded win_rate_rm" in decide(0.9, 1.0, None, cfg, champion="1").reason


def test_register_gates_promotes_and_the_champion_generates(policy_root, monkeypatch):
    root = policy_root
    assert register(root, 0.7, 1.0)["promoted"]            # v1: no champion yet, above the minimum
    assert not register(root, 0.6, 1.0)["promoted"]        # v2: worse than v1
    third = register(root, 0.9, 50.0)                      # v3: better, but over the KL budget
    assert not third["promoted"] and "KL budget" in third["reason"] and third["champion"] == 1
    fourth = register(root, 0.8, 2.0)                      # v4: beats v1 within the budget
    assert fourth["promoted"] and fourth["champion_before"] == 1 and fourth["champion_primary"] == 0.7

    client = get_client(root)
    assert client.get_registered_model(NAME).aliases == {"champion": 4, "challenger": 4}
    v3 = client.get_model_version(NAME, "3")
    assert v3.tags["eval.win_rate_rm"] == "0.9" and v3.tags["eval.mean_kl"] == "50.0"
    assert v3.tags["decision"] == "challenger" and v3.tags["champion_before"] == "1"

    monkeypatch.chdir(root)
    runner = CliRunner()
    listed = runner.invoke(app, ["models", "list"])
    assert listed.exit_code == 0 and "challenger, champion" in listed.output, listed.output
    compared = runner.invoke(app, ["models", "compare", "1", "4"])
    assert compared.exit_code == 0 and "v4 @challenger @champion" in compared.output, compared.output
    assert runner.invoke(app, ["models", "promote", "9"]).exit_code == 2
    promoted = runner.invoke(app, ["models", "promote", "2", "--reason", "gold win rate"])
    assert promoted.exit_code == 0 and "champion v4 -> v2" in promoted.output, promoted.output
    v2 = client.get_model_version(NAME, "2")
    assert v2.tags["promoted_by"] == current_user() and v2.tags["promotion_reason"] == "gold win rate"
    assert client.get_model_version(NAME, "4").tags["demoted_at"]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri(root))
    pipe = mlflow.transformers.load_model(f"models:/{NAME}@champion")
    text = pipe("w3 w4 w5", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("w3 w4 w5") and len(text.split()) > 3
    reference = load_policy(root / "models" / "policy").state_dict()
    for key, value in pipe.model.state_dict().items():
        torch.testing.assert_close(value, reference[key], msg=key)


def test_register_with_tracking_off_registers_nothing(policy_root, monkeypatch):
    monkeypatch.setenv("RLHF_TRACKING", "off")
    report = register(policy_root, 0.9, 1.0)
    assert report["registered"] is False and "tracking is off" in report["reason"]


def test_missing_eval_metric_names_file_and_key(tmp_path):
    path = tmp_path / "eval.json"
    with pytest.raises(RegisterError, match="eval.json: not found"):
        read_eval(path, RegisterParams())
    path.write_text(json.dumps({"mean_kl": 1.0}))
    with pytest.raises(RegisterError, match="eval.json: no numeric 'win_rate_rm'"):
        read_eval(path, RegisterParams())


def test_lora_policy_is_logged_over_its_local_base(mlflow_root, make_policy, tokenizer, monkeypatch):
    """A PEFT policy over a local base must come back with its trained weights (mlflow#23761)."""
    from peft import LoraConfig, get_peft_model

    make_policy().save_pretrained(mlflow_root / "base")
    config = LoraConfig(r=4, target_modules=["query_key_value"], lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(load_policy(mlflow_root / "base"), config)  # a non-zero adapter: differs from base
    policy.save_pretrained(mlflow_root / "models" / "policy")
    tokenizer.save_pretrained(mlflow_root / "models" / "policy")
    assert register(mlflow_root, 0.7, 1.0)["promoted"]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri(mlflow_root))
    pipe = mlflow.transformers.load_model(f"models:/{NAME}@champion")
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(pipe.model(ids).logits, policy(ids).logits)
