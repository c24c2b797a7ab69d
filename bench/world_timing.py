"""Time SFT and reward-model training on the default demo world; print one JSON line.

    .venv/bin/python bench/world_timing.py [--layers 2]

Builds `build_world(seed=0)`, trains the tokenizer on all its texts, trains a tiny GPT-NeoX policy with
`SFTConfig()` and a reward model of the same shape with `RewardConfig()`, and reports wall-clock seconds
with the held-out metrics: greedy SFT completions on `prompts_eval` (EOS rate, mean gold reward; the
references score 1.0) and the reward model's pairwise accuracy on `prefs_eval` against the dataset's labels
and against the gold reward.

Two layers, not four: the reward model needs two epochs over the 4096 pairs to pass 0.85 gold accuracy
and a four-layer one takes two minutes for them on two CPU cores. The reward model starts from a fresh
init rather than the SFT policy: on this world the policy's weights measured no better, and a fresh model
lets the two stages run independently.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rlhf_core.config import RewardConfig, SFTConfig
from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config
from rlhf_core.reward_trainer import train_reward_model
from rlhf_core.sft_trainer import evaluate_sft, train_sft
from rlhf_core.world.generator import build_world
from rlhf_core.world.gold import gold_reward
from rlhf_core.world.tokenizer import train_tokenizer

RESPONSE_LENGTH = 24  # RLConfig.response_length: the budget a policy has to emit EOS in RL


def timed(fn, *args, **kwargs):
    """(fn's result, wall-clock seconds)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, round(time.perf_counter() - start, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="GPT-NeoX layers of both models")
    args = parser.parse_args()

    world, world_s = timed(build_world, seed=0)
    texts = (text for rows in world.values() for row in rows for text in row.values())
    tokenizer, tokenizer_s = timed(train_tokenizer, texts)
    model_config = tiny_gpt_neox_config(vocab_size=len(tokenizer), num_layers=args.layers)

    sft_cfg = SFTConfig()
    sft, sft_s = timed(train_sft, sft_cfg, init_causal_lm(model_config, seed=0), tokenizer,
                       world["sft_train"], world["sft_eval"])
    prompts = world["prompts_eval"]
    sft_eval, sft_eval_s = timed(evaluate_sft, sft.model, tokenizer, prompts, RESPONSE_LENGTH, 64,
                                 gold=gold_reward, cfg=sft_cfg)
    reference_gold = sum(gold_reward(r["prompt"], r["reference"]) for r in prompts) / len(prompts)

    # train_reward_model evaluates on prefs_eval after each epoch; its metrics are the last evaluation's
    rm, rm_s = timed(train_reward_model, RewardConfig(), init_sequence_scorer(model_config, seed=1),
                     tokenizer, world["prefs_train"], world["prefs_eval"], gold=gold_reward)

    print(json.dumps({
        "threads": torch.get_num_threads(),
        "model": {"hidden": model_config.hidden_size, "layers": model_config.num_hidden_layers,
                  "heads": model_config.num_attention_heads, "intermediate": model_config.intermediate_size,
                  "vocab": model_config.vocab_size},
        "time_s": {"world": world_s, "tokenizer": tokenizer_s, "sft_train": sft_s, "sft_eval": sft_eval_s,
                   "rm_train": rm_s},
        "sft": {"eval_loss": sft.metrics["eval/loss"], "eos_rate": sft_eval["eval/eos_rate"],
                "gold_reward": sft_eval["eval/gold_reward"], "reference_gold_reward": reference_gold,
                "response_words": sft_eval["eval/response_words"], "max_new_tokens": RESPONSE_LENGTH},
        "rm": {"gold_accuracy": rm.metrics["eval/gold_accuracy"],
               "label_accuracy": rm.metrics["eval/accuracy"], "margin": rm.metrics["eval/margin"],
               "eval_loss": rm.metrics["eval/loss"]},
    }))


if __name__ == "__main__":
    main()
