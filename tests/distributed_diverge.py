"""Training that diverges on one of 2 ranks (`torchrun --nproc_per_node 2`): rank 1's reward turns NaN at update
BAD_UPDATE, rank 0's stays finite. Every rank writes what it saw to OUT_DIR/rank<r>.json: the error it stopped with,
the update it stopped at; then all meet at one barrier (a rank still training would never reach it).
Usage: python distributed_diverge.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from rlhf_core.bench import word_tokenizer
from rlhf_core.config import RLConfig
from rlhf_core.guards import TrainingDiverged
from rlhf_core.models import init_causal_lm, tiny_gpt_neox_config
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.scoring import FunctionScorer

BAD_UPDATE, UPDATES, BATCH = 3, 5, 8  # BATCH: episodes per update, both ranks together


def main(out: Path) -> None:
    accelerator = Accelerator(step_scheduler_with_optimizer=False, cpu=True)  # a gloo world under torchrun
    rank = accelerator.process_index
    trainer: RLTrainer | None = None

    def reward(prompts: list[str], completions: list[str]) -> list[float]:
        bad = rank == 1 and trainer.state.update + 1 == BAD_UPDATE  # state.update: the updates already done
        return [float("nan") if bad else c.split().count("w7") / max(len(c.split()), 1) for c in completions]

    cfg = RLConfig(algo="rloo", total_episodes=BATCH * UPDATES, per_device_train_batch_size=BATCH // 2,
                   gradient_accumulation_steps=1, local_rollout_forward_batch_size=BATCH, response_length=6,
                   stop_token="eos", learning_rate=1e-3, checkpoint_every=1, keep_checkpoints=UPDATES,
                   rloo={"rloo_k": 2})
    config = tiny_gpt_neox_config(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                  max_positions=64)
    prompts = torch.randint(2, 16, (32, 5), generator=torch.Generator().manual_seed(0)).tolist()
    trainer = RLTrainer(cfg, init_causal_lm(config, 0), FunctionScorer(reward, word_tokenizer(16)), prompts,
                        pad_token_id=0, stop_token_id=1, accelerator=accelerator, checkpoint_dir=out / "checkpoints")
    try:
        trainer.train()
        error = None
    except TrainingDiverged as err:
        error = str(err)
    (out / f"rank{rank}.json").write_text(json.dumps({"error": error, "update": trainer.state.update,
                                                      "num_processes": accelerator.num_processes}))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
