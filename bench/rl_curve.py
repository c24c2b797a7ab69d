"""Over-optimization curve: train the policy in a workspace and evaluate it every K updates.

    python bench/rl_curve.py WORKSPACE K [--set section.key=value ...]

WORKSPACE holds the outputs of `prepare`, `sft` and `reward-model` (a clone after `dvc repro reward-model`).
Prints one JSON line per evaluation: the train score and KL, and the greedy held-out figures of the
`evaluate` stage (reward-model and gold win rates against the SFT policy, mean KL). Greedy evaluation
draws no random numbers, so the run trains exactly as `rlhf stage train` with the same parameters does.
"""

from __future__ import annotations

import argparse
import json
import time

from rlhf_core.greedy_eval import evaluate
from rlhf_core.jsonio import read_jsonl
from rlhf_core.models import load_policy
from tasks.demo_world.gold_wiring import gold_fn
from tasks.parameters.params import load_params
from tasks.parameters.paths import Paths
from tasks.stages.train import build_trainer

SHOWN = ("win_rate_rm", "win_rate_gold", "mean_kl", "mean_score_gold", "ref_mean_score_gold", "eos_rate",
         "mean_length")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workspace")
    parser.add_argument("every", type=int, help="evaluate every this many updates")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    args = parser.parse_args()
    params, paths = load_params(args.workspace, overrides=args.overrides), Paths.at(args.workspace)
    trainer, tokenizer = build_trainer(params, paths)  # exactly the train stage's trainer
    reference = trainer.ref_policy or load_policy(paths.sft_model)  # a LoRA policy keeps no frozen copy
    eval_prompts = [r["prompt"] for r in read_jsonl(paths.split("prompts_eval"))][:params.evaluate.num_prompts]
    start = time.perf_counter()
    while trainer.state.update < trainer.plan.num_updates:
        history = trainer.train(max_updates=args.every)
        train_s = time.perf_counter() - start
        report = evaluate(trainer.unwrapped.policy, reference, tokenizer, eval_prompts,
                          scorer=trainer.scorer, response_length=params.evaluate.response_length,
                          temperature=trainer.cfg.temperature, gold=gold_fn(params),
                          batch_size=params.evaluate.batch_size)
        trainer.unwrapped.policy.train()
        print(json.dumps({"update": trainer.state.update, "train_s": round(train_s),
                          "score": round(history[-1]["objective/scores"], 3),
                          "kl": round(history[-1]["objective/kl"], 3),
                          **{k: round(report.summary[k], 3) for k in SHOWN if k in report.summary}}), flush=True)


if __name__ == "__main__":
    main()
