"""Stage `train`: PPO or RLOO from the SFT policy against the reward model, with checkpoints.

A rerun after a crash resumes from the newest checkpoint made with exactly these parameters;
checkpoints of other parameters are discarded.
"""

from __future__ import annotations

import json
import shutil

from rlhf_core.models import load_policy, load_scorer_model, load_tokenizer
from rlhf_core.reward_training import reward_model_from_policy
from rlhf_core.scoring import RewardModelScorer
from rlhf_core.tracking import JsonlTracker
from rlhf_core.trainer import RLTrainer, list_checkpoints
from tasks.common import save_model
from tasks.io import read_jsonl, write_json
from tasks.params import Params
from tasks.paths import Paths

HISTORY = "train_history.jsonl"


def _resumable(paths: Paths, cfg_json: dict):
    """The newest checkpoint made with this exact config, or None (stale ones are removed)."""
    for checkpoint in reversed(list_checkpoints(paths.checkpoints)):
        saved = json.loads((checkpoint / "trainer_state.json").read_text())["config"]
        if saved == cfg_json:
            return checkpoint
    shutil.rmtree(paths.checkpoints, ignore_errors=True)
    return None


def run(params: Params, paths: Paths, tracker=None) -> dict:
    cfg = params.rl_config()
    tokenizer = load_tokenizer(paths.sft_model)
    policy = load_policy(paths.sft_model)
    reward = load_scorer_model(paths.reward_model)
    value = None
    if cfg.algo == "ppo":
        value = load_scorer_model(paths.reward_model) if params.train.value_model_init == "reward" \
            else reward_model_from_policy(policy, seed=params.base.seed)
    max_prompt = params.prepare.max_prompt_tokens
    prompts = [ids[-max_prompt:] for ids in tokenizer([r["prompt"] for r in read_jsonl(paths.split("prompts_train"))],
                                                      add_special_tokens=False)["input_ids"]]
    checkpoint = _resumable(paths, cfg.model_dump(mode="json"))
    history_file = paths.reports / HISTORY
    if checkpoint is None:
        history_file.unlink(missing_ok=True)
    trainer = RLTrainer(cfg, policy, RewardModelScorer(reward), prompts, pad_token_id=tokenizer.pad_token_id,
                        stop_token_id=tokenizer.eos_token_id, value_model=value,
                        ref_policy=load_policy(paths.sft_model), tracker=tracker or JsonlTracker(history_file),
                        checkpoint_dir=paths.checkpoints)
    if checkpoint is not None:
        trainer.load_checkpoint(checkpoint)
    history = trainer.train()
    save_model(trainer.unwrapped.policy, tokenizer, paths.policy)
    metrics = {k: v for k, v in (history[-1] if history else {}).items() if not k.startswith("time/")}
    metrics["resumed_from_update"] = 0 if checkpoint is None else int(checkpoint.name.split("-")[-1])
    write_json(paths.metrics_file("train"), metrics)
    return metrics
