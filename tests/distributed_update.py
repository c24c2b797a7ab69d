"""One PPO/RLOO/GRPO update on a fixed rollout, run by 1 process or by `torchrun --nproc_per_node 2`.

Every process builds the same global rollout (same seed), keeps its shard, computes the advantages of its
shard (whitening and normalization must use the global batch's statistics) and optimizes; rank 0 saves the
advantages and the updated parameters. The test compares the 1- and 2-process results.
Usage: python distributed_update.py ALGO OUT.pt [NUM_MINI_BATCHES]
"""

import sys

import torch
from accelerate import Accelerator

from rlhf_core.bench import word_tokenizer
from rlhf_core.config import RLConfig
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.scoring import FunctionScorer

GLOBAL_EPISODES, ACCUMULATION = 32, 2


def main(algo: str, out: str, num_mini_batches: int = 1) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, step_scheduler_with_optimizer=False,
                              cpu=not torch.cuda.is_available())  # cpu=True: a gloo world under torchrun
    world, rank = accelerator.num_processes, accelerator.process_index
    micro = GLOBAL_EPISODES // (world * ACCUMULATION * num_mini_batches)
    cfg = RLConfig(algo=algo, total_episodes=GLOBAL_EPISODES, per_device_train_batch_size=micro,
                   num_mini_batches=num_mini_batches,
                   gradient_accumulation_steps=ACCUMULATION, num_epochs=2, local_rollout_forward_batch_size=GLOBAL_EPISODES,
                   response_length=6, stop_token="eos", temperature=1.0, learning_rate=1e-3, kl_coef=0.05,
                   rloo={"rloo_k": 2, "normalize_reward": True, "normalize_advantage": True},
                   grpo={"num_generations": 4, "scale_rewards": "batch", "loss_type": "dapo"})
    tokenizer = word_tokenizer(16)
    config = tiny_gpt_neox_config(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                  max_positions=64)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 16, (GLOBAL_EPISODES, 5), generator=generator).tolist()
    scorer = FunctionScorer(lambda p, c: [c.split().count("w7") / max(len(c.split()), 1) for c in c], tokenizer)
    trainer = RLTrainer(cfg, init_causal_lm(config, 0), scorer, prompts, pad_token_id=0, stop_token_id=1,
                        value_model=init_sequence_scorer(config, 1) if algo == "ppo" else None,
                        accelerator=accelerator)

    torch.manual_seed(1234)  # the same global rollout on every process
    k = cfg.samples_per_prompt
    batch = trainer.score(trainer.rollout(list(range(GLOBAL_EPISODES // k))))
    shard = len(batch) // world
    batch, _ = trainer.compute_advantages(batch[rank * shard:(rank + 1) * shard])  # each rank its own data
    advantages = accelerator.gather(batch.advantages)  # (B, R) in rank order: the global batch's
    trainer.optimize(batch, MetricAccumulator())
    if accelerator.is_main_process:
        result = {k: v.detach().clone() for k, v in trainer.unwrapped.state_dict().items()}
        torch.save({**result, "advantages": advantages}, out)
    accelerator.wait_for_everyone()
    print(f"rank {rank}/{world}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
