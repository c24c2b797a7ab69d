"""A PPO rollout and update with the frozen reference and reward model sharded by DeepSpeed ZeRO-3, run by
tests/test_deepspeed.py on 2 ranks (`accelerate launch` with infra/accelerate/deepspeed_zero3.yaml) and, plain, on
one process.

1. Collectives: the collective calls of each rank during two rollouts, of 3 and of 9 response tokens (no stop token:
   every row decodes to the end), after a first one, written to OUT.<rank>.json; the policy is gathered once per rollout, so they must not grow
   with the length.
2. One update on 8 episodes where prompts 0 and 1 are the same text: rank 0's rollout chunk (prompts 0-3) takes the
   shared-prompt path, rank 1's (4-7) would take the plain one, and the sharded engines need as many forwards on
   every rank. Episode-keyed sampling draws the same completions on any layout; the updated policy and value go to
   OUT.pt, for the test to compare with the 1-process run. The reference follows the policy (sync_ref_model), so
   that reference is compared too.
3. The decode loop on the gathered policy (the gather-once path): its tokens and log-probs equal transformers'
   `generate` with the same keyed draws (bench/generate_path.py), written to OUT.<rank>.json.
Usage: python zero3_rollout.py OUT (writes OUT.pt and, on 2 ranks, OUT.json)
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "barrier", "reduce", "gather",
               "scatter", "all_to_all_single", "all_gather_object", "broadcast_object_list")
calls: Counter = Counter()


def _counted(name: str, fn):
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper


# before DeepSpeed's comm backend starts: it keeps references to the torch.distributed functions it calls
for _name in COLLECTIVES:
    if hasattr(dist, _name):
        setattr(dist, _name, _counted(_name, getattr(dist, _name)))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from generate_path import generate_responses  # noqa: E402

from rlhf_core import ops  # noqa: E402
from rlhf_core.batching import pad  # noqa: E402
from rlhf_core.config import RLConfig, RuntimeConfig  # noqa: E402
from rlhf_core.decode import TokenChoice, decode  # noqa: E402
from rlhf_core.metrics import MetricAccumulator  # noqa: E402
from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config  # noqa: E402
from rlhf_core.rl_trainer import RLTrainer  # noqa: E402
from rlhf_core.runtime import Runtime, modifiable, whole_weights  # noqa: E402
from rlhf_core.scoring import RewardModelScorer  # noqa: E402

EPISODES, RESPONSE = 8, 6


def main(out: str) -> None:
    runtime = Runtime(RuntimeConfig(device="cpu"), gradient_accumulation_steps=2)
    acc = runtime.accelerator
    world, rank = acc.num_processes, acc.process_index
    cfg = RLConfig(algo="ppo", total_episodes=EPISODES, per_device_train_batch_size=EPISODES // (2 * world),
                   gradient_accumulation_steps=2, num_epochs=1, local_rollout_forward_batch_size=4,
                   response_length=RESPONSE, temperature=1.0, learning_rate=1e-2, kl_coef=0.05,
                   sampling_seed="episode", sync_ref_model=True, ref_model_sync_steps=1)
    config = tiny_gpt_neox_config(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                  max_positions=64)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 16, (EPISODES, 5), generator=generator).tolist()
    prompts[1] = list(prompts[0])  # rank 0's chunk shares a prompt; rank 1's (prompts 4-7) does not
    trainer = RLTrainer(cfg, init_causal_lm(config, 0), RewardModelScorer(runtime.frozen(init_sequence_scorer(config, 2))),
                        prompts, pad_token_id=0, stop_token_id=None, value_model=init_sequence_scorer(config, 1),
                        ref_policy=runtime.frozen(init_causal_lm(config, 0)), accelerator=acc)
    mine = list(range(rank * EPISODES // world, (rank + 1) * EPISODES // world))

    counts = {}
    for length in (3, 3, 9):  # the first rollout also makes the engines' one-time collectives: not counted
        trainer.cfg = cfg.model_copy(update={"response_length": length})
        before = sum(calls.values())
        trainer.rollout(mine)
        counts[length] = sum(calls.values()) - before
    trainer.cfg = cfg
    decode_equals_generate = decoded_as_generate(trainer, [prompts[i] for i in mine])

    batch, _ = trainer.compute_advantages(trainer.score(trainer.rollout(mine)))
    trainer.optimize(batch, MetricAccumulator())
    state = acc.get_state_dict(trainer.model)  # every rank joins: ZeRO-3 gathers the shards
    with modifiable(trainer.ref_policy):  # the reference, moved by sync_ref_model, whole on every rank
        reference = {f"ref.{k}": v.detach().clone() for k, v in trainer.ref_policy.state_dict().items()}
    if acc.is_main_process:
        torch.save({**{k: v.float() for k, v in state.items()}, **reference}, f"{out}.pt")
    if world > 1:
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump({"distributed_type": str(acc.distributed_type.value), "collectives": counts,
                       "decode_equals_generate": decode_equals_generate}, f)
    acc.wait_for_everyone()
    if dist.is_initialized():  # before exit: gloo's threads outliving the interpreter can abort a finished rank
        dist.destroy_process_group()


def decoded_as_generate(trainer: RLTrainer, prompts: list[list[int]]) -> bool:
    """Whether the decode loop and `generate` draw the same tokens with the same log-probs from the policy
    gathered once (`whole_weights`), as the rollout samples."""
    queries, query_mask = pad(prompts, 0, "left")
    keys = torch.arange(len(prompts)) + 11
    with whole_weights(trainer.accelerator, trainer.model):
        policy = trainer.unwrapped.policy
        ours, our_logprobs = decode(policy, queries, query_mask, response_length=RESPONSE, pad_token_id=0,
                                    stop_token_id=1, choice=TokenChoice(temperature=1.0), noise_keys=keys,
                                    keep_logprobs=True)
        theirs, their_logprobs = generate_responses(policy, queries, query_mask, response_length=RESPONSE,
                                                    temperature=1.0, pad_token_id=0, stop_token_id=1, noise_keys=keys,
                                                    keep_logprobs=True)
    mask = ops.truncate_after_stop(theirs, 1, -1) != -1  # through each row's stop token
    return torch.equal(ours, theirs) and torch.allclose(our_logprobs[mask], their_logprobs[mask], atol=1e-5)


if __name__ == "__main__":
    main(sys.argv[1])
    # every output is written and the group is gone: leave as a launched stage does (tasks/runner.py
    # end_launched_rank), without the interpreter's teardown, where gloo's and DeepSpeed's C++ objects freed in no
    # set order still aborted a finished rank now and then ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
