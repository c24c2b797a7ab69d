"""TRL 1.16.0's side of tests/test_grpo.py's equality checks; runs in .venv-trl116 (`make trl116`), never in ours.

    python tests/trl116_side.py CASES.pt OUT.pt

CASES.pt (written by the test): a list of cases (one process for all: importing TRL takes seconds), each with
the algorithm ("grpo" or "rloo"), the TRL config's keyword arguments, a policy
directory (the reference loads from it, as TRL's does) with the policy's current state dict, the prompt and
completion ids of every episode (prompt-major, k per prompt), each completion's reward, and the old log-probs to
force (the rollout's). The completions go through TRL's own `_generate_and_score_completions` (its `_generate`
replaced by one returning them; the reward function returns the given rewards), then `_compute_loss` and a
backward. OUT.pt: per case, TRL's inputs to the loss (advantages, masks, reference log-probs), the loss and every
gradient.

A case with "steps" ({"micro_batches", "iterations", "lr", "eps"}) runs optimizer steps instead, as TRL's loop
does with gradient_accumulation_steps = steps_per_generation = micro_batches and num_iterations = iterations: the
generation split into that many micro-batches (in order; TRL shuffles first, which the compared cases' losses do
not depend on), each's `_compute_loss` backward, then one AdamW step (no weight decay, no clipping), `iterations`
times over the same micro-batches; OUT.pt then holds the weights after each step.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def main(cases_path: str, out_path: str) -> None:
    assert trl.__version__ == "1.16.0", trl.__version__
    torch.save([run_case(case) for case in torch.load(cases_path, weights_only=True)], out_path)


def run_case(case: dict) -> dict:
    torch.manual_seed(0)
    algo, prompts, completions = case["algo"], case["prompt_ids"], case["completion_ids"]
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=torch.float32)
    model.load_state_dict(case["policy_state"])  # the policy has moved from the reference (saved in model_dir)
    rewards = case["rewards"]

    def reward(completions, index, **kwargs):
        return [float(rewards[i]) for i in index]

    rows = [{"prompt": f"p{i}", "index": i} for i in range(len(prompts))]
    config_cls, trainer_cls = ((trl.GRPOConfig, trl.GRPOTrainer) if algo == "grpo"
                               else (trl.RLOOConfig, trl.RLOOTrainer))
    steps = case.get("steps")
    micro_batches = steps["micro_batches"] if steps else 1
    with tempfile.TemporaryDirectory() as out_dir:
        args = config_cls(output_dir=out_dir, per_device_train_batch_size=len(prompts) // micro_batches,
                          gradient_accumulation_steps=micro_batches, use_cpu=True, bf16=False, report_to=[],
                          disable_dropout=True, seed=0, **case["config"])
        trainer = trainer_cls(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(rows))

        def forced_generate(_prompts):
            text = tokenizer.batch_decode(completions)
            if algo == "rloo":
                return prompts, completions, text
            return prompts, completions, None, text, None, {}, None, None

        trainer._generate = forced_generate
        trainer.current_gradient_accumulation_steps = micro_batches  # what Trainer's loop sets
        trainer.model.train()
        inputs = trainer._generate_and_score_completions(rows)
        old = case.get("old_logprobs")
        if old is not None:  # the rollout's log-probs, forced (TRL recomputes them only when it reuses a generation)
            if algo == "grpo":
                inputs["old_per_token_logps"] = old
            else:
                inputs["old_logps"] = (old * inputs["completion_mask"]).sum(1)
        keep = ("advantages", "completion_mask", "ref_per_token_logps", "old_per_token_logps", "num_items_in_batch")
        kept = {k: v.detach() for k, v in inputs.items() if k in keep and isinstance(v, torch.Tensor)}
        if steps:
            return {**kept, **optimizer_steps(trainer, inputs, steps)}
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, **kept}


def optimizer_steps(trainer, inputs: dict, steps: dict) -> dict:
    """`iterations` AdamW steps, each accumulating `_compute_loss` over the generation's micro-batches."""
    from trl.trainer.utils import split_tensor_dict

    model = trainer.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=steps["lr"], eps=steps["eps"], weight_decay=0.0)
    micro_batches = split_tensor_dict(inputs, steps["micro_batches"])
    weights, losses = [], []
    for _ in range(steps["iterations"]):
        total = 0.0
        for micro_batch in micro_batches:
            loss = trainer._compute_loss(model, micro_batch)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
        losses.append(total)
    return {"weights": weights, "losses": torch.tensor(losses)}


if __name__ == "__main__":
    main(*sys.argv[1:3])
