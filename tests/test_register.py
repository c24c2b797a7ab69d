"""The register stage and `rlhf models` on a real sqlite MLflow registry: the promotion gate, aliases,
manual promotion, and the champion loaded back with mlflow.transformers and generating."""

from __future__ import annotations

import json
import math
import shutil
from functools import partial
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from test_dvc import sh
from typer.testing import CliRunner

from cli.main import app
from rlhf_core.models import load_policy
from tasks.parameters.params import RegisterParams
from tasks.runner import run_stage
from tasks.stages.register import Best, Candidate, RegisterError, current_user, decide, gate_metric, read_eval
from tasks.tracking.mlflow_store import get_client, tracking_uri
from tasks.tracking.registry import eval_figures, history, registry_verdict

NAME = "rlhf-policy"
REPO = Path(__file__).resolve().parent.parent


def register(root, win_rate: float, mean_kl: float, gold: float | None = None, overrides: list[str] = ()) -> dict:
    """metrics/eval.json with these figures (gold: the RM win rate unless given), then the register stage."""
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics" / "eval.json").write_text(json.dumps({"win_rate_rm": win_rate, "mean_kl": mean_kl,
                                                            "win_rate_gold": win_rate if gold is None else gold}))
    run_stage("register", root, overrides=list(overrides))
    return json.loads((root / "metrics" / "register.json").read_text())


@pytest.fixture
def policy_root(mlflow_root, make_policy, tokenizer):
    make_policy().save_pretrained(mlflow_root / "models" / "policy")
    tokenizer.save_pretrained(mlflow_root / "models" / "policy")
    return mlflow_root


def test_gate():
    cfg = RegisterParams(max_kl=10.0, min_primary=0.5, tie_margin=0.01)
    first, m = partial(decide, champion=None, cfg=cfg, metric="win_rate_rm"), "win_rate_rm"
    assert first(Candidate(0.6, 1.0)).promote, "first version above the minimum"
    assert not first(Candidate(0.5, 1.0)).promote, "no better than the reference"
    assert not first(Candidate(0.9, 10.5)).promote, "over the KL budget"
    champion = Candidate(0.7, 2.0)
    assert decide(Candidate(0.8, 1.0), champion, cfg, m, "1").promote
    assert not decide(Candidate(0.6, 1.0), champion, cfg, m, "1").promote
    tie_lower_kl = decide(Candidate(0.695, 1.5), champion, cfg, m, "1")
    assert tie_lower_kl.promote and "ties champion v1" in tie_lower_kl.reason and "lower mean_kl" in tie_lower_kl.reason
    assert not decide(Candidate(0.705, 2.5), champion, cfg, m, "1").promote, "a tie at a higher KL keeps the champion"
    assert not decide(Candidate(0.7, 2.0), champion, cfg, m, "1").promote, "an exact tie keeps the champion"
    assert "no recorded win_rate_rm" in decide(Candidate(0.9, 1.0), None, cfg, m, "1").reason


def test_the_gate_refuses_nan_and_inf_naming_the_metric():
    """#28 item 14: NaN compares false with everything, so `nan > max_kl` let a NaN KL past the budget and a NaN
    primary "tie" the champion at a lower KL."""
    cfg, m = RegisterParams(max_kl=4.0, min_primary=0.5, tie_margin=0.01), "win_rate_gold"
    champion = Candidate(0.7, 1.0)
    for new, named in ((Candidate(0.9, math.nan), "mean_kl is nan"), (Candidate(math.nan, 0.5), "win_rate_gold is nan"),
                       (Candidate(math.inf, 0.5), "win_rate_gold is inf"), (Candidate(0.9, -math.inf), "mean_kl is -inf")):
        for decision in (decide(new, None, cfg, m), decide(new, champion, cfg, m, "1")):
            assert not decision.promote and named in decision.reason, (new, decision)
    assert not decide(Candidate(0.9, 1.0), Candidate(math.nan, 1.0), cfg, m, "1").promote, "a NaN champion"


def test_repeated_ties_cannot_ratchet_the_primary_down():
    """#28 item 14: a tie at a lower KL is measured against the champion and also against the best primary so far:
    each tie may lose up to tie_margin against the champion, but all of them together no more than that."""
    cfg, m = RegisterParams(max_kl=4.0, min_primary=0.5, tie_margin=0.01), "win_rate_gold"
    champion, best = Candidate(0.795, 2.0), Best("1", 0.799)
    assert decide(Candidate(0.792, 1.5), champion, cfg, m, "2", best).promote, "within the margin of both"
    ratchet = decide(Candidate(0.787, 1.5), champion, cfg, m, "2", best)
    assert not ratchet.promote and "best win_rate_gold so far (v1: 0.799)" in ratchet.reason, ratchet.reason
    assert decide(Candidate(0.81, 1.5), champion, cfg, m, "2", best).promote, "beating the champion is no tie"


def test_auto_gate_prefers_gold_and_a_demo_scale_kl_budget():
    defaults = RegisterParams()
    assert (defaults.primary_metric, defaults.max_kl) == ("auto", 4.0)
    assert gate_metric(defaults, {"win_rate_rm": 0.9, "win_rate_gold": 0.7}) == "win_rate_gold"
    assert gate_metric(defaults, {"win_rate_rm": 0.9}) == "win_rate_rm", "real data has no gold reward"
    # the sweep of the issue: the demo default (gold 0.766 at KL 3.16) against an over-optimized policy whose
    # reward-model win rate is higher (gold 0.717 at KL 4.6)
    champion, over_optimized = Candidate(0.766, 3.16), Candidate(0.717, 4.6)
    assert not decide(over_optimized, champion, defaults, "win_rate_gold", "1").promote
    assert not decide(Candidate(0.8, 4.6), champion, defaults, "win_rate_gold", "1").promote, "over the budget"


def test_register_gates_promotes_and_the_champion_generates(policy_root, monkeypatch):
    root = policy_root
    assert register(root, 0.7, 1.0, gold=0.7)["promoted"]   # v1: no champion yet, gold above the minimum
    second = register(root, 0.95, 3.9, gold=0.6)             # v2: the reward model loves it; gold does not
    assert not second["promoted"] and second["primary_metric"] == "win_rate_gold", second
    third = register(root, 0.9, 5.0, gold=0.9)               # v3: better, but over the KL budget
    assert not third["promoted"] and "KL budget" in third["reason"] and third["champion"] == 1
    fourth = register(root, 0.8, 2.0, gold=0.8, overrides=["train.kl_coef=0.2"])  # v4: beats v1 within it
    assert fourth["promoted"] and fourth["champion_before"] == 1 and fourth["champion_primary"] == 0.7
    assert fourth["overrides"] == ["train.kl_coef=0.2"]

    client = get_client(root)
    assert client.get_registered_model(NAME).aliases == {"champion": 4, "challenger": 4}
    v3 = client.get_model_version(NAME, "3")
    assert eval_figures(client, v3) == {"win_rate_rm": 0.9, "mean_kl": 5.0, "win_rate_gold": 0.9}
    assert v3.tags["gate.decision"] == "challenger" and v3.tags["gate.champion_before"].startswith("v1 ")
    v4 = client.get_model_version(NAME, "4").tags
    assert (v4["gate.metric"], v4["gate.primary"], v4["gate.mean_kl"]) == ("win_rate_gold", "0.8", "2.0")
    assert v4["gate.settings"] == "max_kl=4 min_primary=0.5 tie_margin=0.01"
    assert v4["gate.champion_before"] == "v1 (win_rate_gold 0.7 at mean_kl 1)"
    assert json.loads(v4["rlhf.overrides"]) == ["train.kl_coef=0.2"]

    monkeypatch.chdir(root)
    runner = CliRunner()
    listed = runner.invoke(app, ["models", "list"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and "challenger, champion" in listed.output, listed.output
    assert "train.kl_coef=0.2" in listed.output and "beats champion v1 (0.7)" in listed.output, listed.output
    compared = runner.invoke(app, ["models", "compare", "1", "2", "4"], env={"COLUMNS": "250"})
    assert compared.exit_code == 0 and "v4 @challenger @champion" in compared.output, compared.output
    for row in ("win_rate_gold", "gate settings", "max_kl=4", "reason", "overrides", "train.kl_coef=0.2",
                "does not beat champion v1"):
        assert row in compared.output, (row, compared.output)
    assert runner.invoke(app, ["models", "promote", "9"]).exit_code == 2
    assert runner.invoke(app, ["models", "promote", "1"]).exit_code == 0, "the gate promoted v1 once: no --force"
    promoted = runner.invoke(app, ["models", "promote", "4", "--reason", "back to v4"])
    assert promoted.exit_code == 0 and "champion v1 -> v4" in promoted.output, promoted.output
    assert client.get_registered_model(NAME).aliases["champion"] == 4
    v2 = client.get_model_version(NAME, "2")
    assert v2.tags["gate.decision"] == "challenger" and "champion_history" not in v2.tags
    assert client.get_registered_model(NAME).aliases == {"champion": 4, "challenger": 4}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri(root))
    pipe = mlflow.transformers.load_model(f"models:/{NAME}@champion")
    text = pipe("w3 w4 w5", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("w3 w4 w5") and len(text.split()) > 3
    reference = load_policy(root / "models" / "policy").state_dict()
    for key, value in pipe.model.state_dict().items():
        torch.testing.assert_close(value, reference[key], msg=key)


def test_register_refuses_a_nan_metric_and_ties_below_the_best_so_far(policy_root):
    """#28 item 14 through the stage: a NaN win_rate_gold in metrics/eval.json registers a challenger and leaves the
    champion alias where it was; a chain of ties at lower KL stops at tie_margin below the best version."""
    root, client = policy_root, get_client(policy_root)
    assert register(root, 0.8, 3.0)["promoted"]                        # v1: 0.8
    nan = register(root, 0.9, 1.0, gold=math.nan)                       # v2: gold NaN
    assert not nan["promoted"] and "win_rate_gold is nan" in nan["reason"], nan
    assert client.get_registered_model(NAME).aliases["champion"] == 1
    infinite = register(root, 0.9, math.inf)                            # v3: an infinite KL
    assert not infinite["promoted"] and "mean_kl is inf" in infinite["reason"], infinite
    assert register(root, 0.795, 2.0)["promoted"]                       # v4: a tie with v1 at a lower KL
    ratchet = register(root, 0.789, 1.0)                                # v5: a tie with v4, 0.011 below v1
    assert not ratchet["promoted"] and "best win_rate_gold so far (v1: 0.8)" in ratchet["reason"], ratchet
    assert client.get_registered_model(NAME).aliases["champion"] == 4


def test_a_versions_source_run_holds_the_pipeline_params_and_evaluation(policy_root):
    """#28 item 4: MLflow's version compare shows the params and metrics of each version's source run (the register
    stage's run): it holds every resolved parameter (train.*, sft.*, reward_model.*...), not only register.*."""
    root, client = policy_root, get_client(policy_root)
    register(root, 0.7, 1.0)
    register(root, 0.8, 2.0, overrides=["train.kl_coef=0.2"])
    first, second = (client.get_run(client.get_model_version(NAME, v).run_id).data for v in ("1", "2"))
    assert first.params["train.kl_coef"] != second.params["train.kl_coef"] == "0.2"
    for section in ("prepare.", "sft.", "reward_model.", "train.", "evaluate.", "register.", "base."):
        assert any(k.startswith(section) for k in first.params), (section, sorted(first.params))
    assert (first.metrics["eval/win_rate_gold"], second.metrics["eval/mean_kl"]) == (0.7, 2.0)


def test_the_registry_reads_well_and_a_forced_promotion_keeps_the_history(policy_root, monkeypatch):
    """#28 item 5: a version's description says what it is, its headline figures and the gate's reason in full; it
    has a dozen well-named tags; the registered model names its champion; promoting a version the gate rejected
    takes --force and a reason, says what it overrides, and every promotion is kept in a history."""
    root, client, user = policy_root, get_client(policy_root), current_user()
    register(root, 0.7, 1.0)                                            # v1: champion
    register(root, 0.9, 5.0)                                            # v2: over the KL budget
    v2 = client.get_model_version(NAME, "2")
    assert "mean_kl 5 is over the KL budget register.max_kl=4" in v2.description, v2.description
    assert "| win_rate_gold | 0.9 |" in v2.description and "kept as challenger" in v2.description
    assert len(v2.tags) <= 12 and v2.tags["gate.reason"] in v2.description, sorted(v2.tags)
    model = client.get_registered_model(NAME)
    assert "Champion: v1" in model.description and model.tags["champion"].startswith("v1 "), model

    monkeypatch.chdir(root)
    runner = CliRunner()
    refused = runner.invoke(app, ["models", "promote", "2", "--reason", "gold looks fine"])
    assert refused.exit_code == 2 and "the gate rejected" in refused.output, refused.output
    assert "over the KL budget" in refused.output and "--force" in refused.output, refused.output
    assert runner.invoke(app, ["models", "promote", "2", "--force"]).exit_code == 2, "--force takes a --reason"
    assert client.get_registered_model(NAME).aliases["champion"] == 1
    forced = runner.invoke(app, ["models", "promote", "2", "--force", "--reason", "gold judged by hand"])
    assert forced.exit_code == 0 and "champion v1 -> v2" in forced.output, forced.output
    assert "overriding the gate's decision at registration: challenger: mean_kl 5" in forced.output, forced.output
    assert "Champion: v2" in client.get_registered_model(NAME).description
    assert runner.invoke(app, ["models", "promote", "1", "--reason", "rollback"]).exit_code == 0

    v1, v2 = client.get_model_version(NAME, "1"), client.get_model_version(NAME, "2")
    assert [(e["event"], e["by"]) for e in history(v1)] == [("promoted", "register stage"), ("demoted", user),
                                                             ("promoted", user)]
    assert history(v1)[-1]["reason"] == "rollback" and "no champion yet" in history(v1)[0]["reason"]
    assert history(v2)[0]["overrides"].startswith("challenger: mean_kl 5"), history(v2)
    assert "Champion history" in v1.description and "rollback" in v1.description
    model = client.get_registered_model(NAME)
    assert "Champion: v1" in model.description and "rollback" in model.description
    listed = runner.invoke(app, ["models", "list"], env={"COLUMNS": "250"})
    assert "(forced)" in listed.output and f"promoted by {user}" in listed.output, listed.output


def test_models_tables_fit_the_terminal_and_list_gives_the_reason(policy_root, monkeypatch):
    """#28 item 15: `rlhf models` tables take the terminal's width (they were forced to 200 columns), and `list` has
    the gate's reason."""
    register(policy_root, 0.7, 1.0)
    register(policy_root, 0.9, 5.0)
    monkeypatch.chdir(policy_root)
    runner = CliRunner()
    wide = runner.invoke(app, ["models", "list"], env={"COLUMNS": "250"})
    assert wide.exit_code == 0 and "reason" in wide.output, wide.output
    assert "mean_kl 5 is over the KL budget register.max_kl=4" in wide.output, wide.output
    for command in (["models", "list"], ["models", "compare"]):
        narrow = runner.invoke(app, command, env={"COLUMNS": "100"})
        assert narrow.exit_code == 0 and max(map(len, narrow.output.splitlines())) <= 100, narrow.output
        assert "created" in narrow.output or "overrides" in narrow.output, "the last column is not cropped"


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


def test_a_trained_lora_policy_registers_its_merged_model_and_its_adapter(mlflow_root, make_policy, tokenizer,
                                                                         monkeypatch):
    """The train stage's LoRA layout (models/policy: merged model, models/policy/adapter/: the adapter): MLflow
    registers the merged model, which reloads without peft or the base and generates as base + adapter does; the
    adapter is the version's run artifact `adapter`, named by the version's tag."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from rlhf_core.lora import ADAPTER_DIR, save_lora_policy

    make_policy().save_pretrained(mlflow_root / "models" / "sft")
    config = LoraConfig(r=4, target_modules=["query_key_value"], lora_dropout=0.0, init_lora_weights=False)
    policy = get_peft_model(make_policy(), config)  # a non-zero adapter: differs from its base
    policy.save_pretrained(mlflow_root / "scratch-adapter")
    save_lora_policy(mlflow_root / "scratch-adapter", make_policy(), mlflow_root / "models" / "policy", tokenizer,
                     base_name="models/sft")
    assert register(mlflow_root, 0.7, 1.0)["promoted"]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri(mlflow_root))
    pipe = mlflow.transformers.load_model(f"models:/{NAME}@champion")
    assert not isinstance(pipe.model, PeftModel), "the merged model: no adapter to apply at serving time"
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(pipe.model(ids).logits, policy(ids).logits, rtol=1e-5, atol=1e-5)
    completion = pipe("w3 w4 w5", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert completion.startswith("w3 w4 w5") and len(completion) > len("w3 w4 w5"), completion
    client = get_client(mlflow_root)
    version = client.get_model_version(NAME, "1")
    assert version.tags["adapter"] == f"runs:/{version.run_id}/{ADAPTER_DIR}"
    adapter = Path(mlflow.artifacts.download_artifacts(version.tags["adapter"], dst_path=str(mlflow_root / "dl")))
    reloaded = PeftModel.from_pretrained(make_policy(), adapter)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits)


@pytest.fixture
def register_repo(policy_root):
    """A git + DVC repo whose dvc.yaml is the repo's register stage alone; policy and eval written by hand."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    (policy_root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"register": stages["register"]}}))
    for item in ("params.yaml", ".gitignore"):
        shutil.copy(REPO / item, policy_root / item)
    for package in ("rlhf_core", "tasks"):
        shutil.copytree(REPO / package, policy_root / package, ignore=shutil.ignore_patterns("__pycache__"))
    for command in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        sh(*command, cwd=policy_root)
    return policy_root


def test_register_reruns_for_a_policy_instead_of_replaying_dvcs_run_cache(register_repo, make_policy, tokenizer):
    """A plain run after an overridden one brings back the first policy (train and evaluate from DVC's run
    cache). register must not replay its old register.json ('v1, champion'): it runs, finds the policy
    already registered as v1, registers no duplicate, and reports the registry as it is now (champion v2)."""
    root = register_repo

    def repro_with_policy(seed: int, gold: float) -> tuple[str, dict]:
        shutil.rmtree(root / "models" / "policy", ignore_errors=True)
        make_policy(seed).save_pretrained(root / "models" / "policy")
        tokenizer.save_pretrained(root / "models" / "policy")
        (root / "metrics").mkdir(exist_ok=True)
        (root / "metrics" / "eval.json").write_text(json.dumps({"win_rate_rm": gold, "win_rate_gold": gold,
                                                                "mean_kl": 1.0}))
        out = sh("dvc", "repro", "register", cwd=root)
        return out, json.loads((root / "metrics" / "register.json").read_text())

    assert repro_with_policy(0, 0.7)[1]["version"] == 1
    assert repro_with_policy(1, 0.8)[1]["champion"] == 2
    out, report = repro_with_policy(0, 0.7)
    assert "Running stage 'register'" in out and "run-cache" not in out, out
    assert (report["version"], report["already_registered"], report["champion"]) == (1, True, 2), report
    assert len(get_client(root).search_model_versions(f"name = '{NAME}'")) == 2, "no duplicate version"
    line = registry_verdict(root, report)
    assert "v1" in line and "champion is v2" in line, line
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=root)


def test_promoting_the_champion_again_says_so_and_changes_nothing(mlflow_root, monkeypatch):
    """`rlhf models promote 1` with v1 champion printed "champion v1 -> v1" and appended a second "promoted" to v1's
    champion history at 2a5c0fd."""
    client = get_client(mlflow_root)
    client.create_registered_model(NAME)
    client.create_model_version(NAME, source=str(mlflow_root / "policy"))
    monkeypatch.chdir(mlflow_root)
    runner = CliRunner()
    first = runner.invoke(app, ["models", "promote", "1", "--name", NAME, "--reason", "first"])
    assert first.exit_code == 0 and "champion (none) -> v1" in first.output, first.output
    before = client.get_model_version(NAME, "1")
    model_before = client.get_registered_model(NAME)

    again = runner.invoke(app, ["models", "promote", "1", "--name", NAME, "--reason", "again"])
    assert again.exit_code == 0, again.output
    assert again.output.strip() == f"{NAME} v1 is already the champion: nothing changed", again.output
    after = client.get_model_version(NAME, "1")
    assert [e["reason"] for e in history(after)] == ["first"], history(after)
    assert (after.tags, after.description) == (before.tags, before.description)
    assert client.get_registered_model(NAME).description == model_before.description
    assert client.get_registered_model(NAME).aliases == {"champion": 1}


def test_a_rerun_finishes_a_promotion_an_outage_cut_short(policy_root):
    """The register stage stopped after its gate tags and before the alias moved (its server stayed down past
    RLHF_MLFLOW_RETRY_S; tests/test_registry_outage.py cuts a promotion so): the flow's retry of the stage finds
    the version registered and finishes its promotion, recording it once."""
    root = policy_root
    register(root, 0.7, 1.0, gold=0.7)
    assert register(root, 0.8, 2.0, gold=0.8)["promoted"]
    client = get_client(root)
    # the registry as the cut left it: v2 gated champion, its history not written, the alias still on v1
    client.set_registered_model_alias(NAME, "champion", "1")
    client.delete_model_version_tag(NAME, "2", "champion_history")
    v1 = client.get_model_version(NAME, "1")
    client.set_model_version_tag(NAME, "1", "champion_history", json.dumps(history(v1)[:-1]))

    again = register(root, 0.8, 2.0, gold=0.8)
    assert again["already_registered"] and again["version"] == 2 and again["champion"] == 2, again
    assert client.get_registered_model(NAME).aliases["champion"] == 2
    events = {v: [e["event"] for e in history(client.get_model_version(NAME, v))] for v in ("1", "2")}
    assert events == {"1": ["promoted", "demoted"], "2": ["promoted"]}, events
    assert register(root, 0.8, 2.0, gold=0.8)["champion"] == 2, "a second rerun changes nothing"
    assert [e["event"] for e in history(client.get_model_version(NAME, "2"))] == ["promoted"]
