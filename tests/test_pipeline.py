"""The pipeline end to end through the real `rlhf` entry point, on a shrunken demo world."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tasks.cli import app
from tasks.params import ParamsError, load_params

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "prepare.world.sft_train=128", "prepare.world.sft_eval=16", "prepare.world.prefs_train=128",
    "prepare.world.prefs_eval=32", "prepare.world.prompts_train=64", "prepare.world.prompts_eval=8",
    "prepare.tokenizer_vocab_size=512", "sft.epochs=1", "reward_model.epochs=1",
    "sft.tiny.hidden_size=32", "sft.tiny.num_layers=1", "sft.tiny.intermediate_size=64", "sft.eval_max_new_tokens=8",
    "train.total_episodes=64", "train.response_length=8", "train.checkpoint_every=1",
    "evaluate.num_prompts=8", "evaluate.response_length=8",
]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_run_writes_every_stage_output(workspace):
    invoke("run", *[x for item in TINY for x in ("--set", item)])
    for split in ("sft_train", "sft_eval", "prefs_train", "prefs_eval", "prompts_train", "prompts_eval"):
        assert (workspace / "data" / f"{split}.jsonl").stat().st_size > 0
    for model in ("tokenizer", "sft", "reward", "policy"):
        assert any((workspace / "models" / model).iterdir()), model
    assert list((workspace / "models" / "policy").glob("*.safetensors"))
    evaluation = json.loads((workspace / "metrics" / "eval.json").read_text())
    for key in ("win_rate_rm", "win_rate_gold", "mean_score_rm", "mean_score_gold", "mean_kl", "eos_rate",
                "mean_length", "ref_mean_score_rm", "ref_mean_score_gold", "ref_eos_rate", "ref_mean_length"):
        assert key in evaluation, key
    rows = [json.loads(line) for line in (workspace / "reports" / "eval" / "completions.jsonl").open()]
    assert len(rows) == 8 and {"prompt", "completion", "ref_completion", "score_gold"} <= set(rows[0])
    for plot in ("reward_over_updates.png", "reward_vs_kl.png", "response_lengths.png"):
        assert (workspace / "reports" / "eval" / plot).read_bytes()[:4] == b"\x89PNG"
    assert not list(workspace.rglob("*.tmp")), "no temp outputs are left behind"


def test_params_errors_name_the_key(workspace):
    with pytest.raises(ParamsError, match="train.kl_coeff: unknown key; allowed: .*kl_coef"):
        load_params(workspace, overrides=["train.kl_coeff=0.1"])
    with pytest.raises(ParamsError, match="train.seed is not a parameter"):
        load_params(workspace, overrides=["train.seed=3"])
    assert load_params(workspace, overrides=["train.kl_coef=0.1"]).rl_config().kl_coef == 0.1
