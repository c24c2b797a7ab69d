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


# ------------------------------------------------------------------------------------------- multi-turn (tests/test_tools.py)
# Entry: python -c "import sys; sys.path.insert(0, 'tests'); import trl116_side; trl116_side.main_tools(IN, OUT)"

def main_tools(cases_path: str, out_path: str) -> None:
    """TRL 1.16.0's side of tests/test_tools.py: each case one GRPO update with tools through TRL's own tool loop."""
    assert trl.__version__ == "1.16.0", trl.__version__
    torch.save([run_tool_case(case) for case in torch.load(cases_path, weights_only=True)], out_path)


def run_tool_case(case: dict) -> dict:
    """One GRPO generation + update with `tools` (and an `environment_factory`) where the model's turns are forced:
    TRL's `_generate_single_turn` (called for the first turn and after every tool round) replaced by one returning
    the case's turns, so TRL's own `_tool_call_loop` parses them, runs the tools (imported from the case's file),
    builds the suffix ids and the tool mask, rolls back and truncates. Returns what `_generate` made (prompt ids,
    completion ids, tool mask), the tool metrics, TRL's inputs to the loss, the loss, every gradient, and the
    weights after one AdamW step (no weight decay, no clipping)."""
    import importlib.util

    torch.manual_seed(0)
    spec = importlib.util.spec_from_file_location(case["tools_module"], case["tools_file"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[case["tools_module"]] = module
    spec.loader.exec_module(module)
    tokenizer = AutoTokenizer.from_pretrained(case["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=torch.float32)
    model.load_state_dict(case["policy_state"])
    rewards, turns = case["rewards"], case["turns"]

    def reward(completions, episode, **kwargs):
        return [float(rewards[i]) for i in episode]

    rows = [{"prompt": prompt, "episode": i} for i, prompt in enumerate(case["prompts"])]
    environment = getattr(module, case["environment"]) if case.get("environment") else None
    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=len(rows), gradient_accumulation_steps=1,
                              use_cpu=True, bf16=False, report_to=[], disable_dropout=True, seed=0, **case["config"])
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_list(rows),
                                  tools=[getattr(module, name) for name in case["tools"]],
                                  environment_factory=environment)
        first, calls, made = [], [0] * len(rows), {}

        def forced_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            out = []
            for ids in prompt_ids:
                if len(first) < len(rows):  # the first call: every episode's prompt, in order
                    episode = len(first)
                    first.append(list(ids))
                else:  # after a tool round: the episode whose prompt and first turn the context starts with
                    [episode] = [i for i in range(len(rows)) if list(ids[:len(first[i]) + len(turns[i][0])])
                                 == first[i] + turns[i][0]]
                out.append(turns[episode][calls[episode]])
                calls[episode] += 1
            return out, None

        generate = trainer._generate

        def capturing_generate(prompts):
            result = generate(prompts)
            made.update(prompt_ids=result[0], completion_ids=result[1], tool_mask_list=result[2])
            return result

        trainer._generate_single_turn = forced_single_turn
        trainer._generate = capturing_generate
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        inputs = trainer._generate_and_score_completions(rows)
        inputs["old_per_token_logps"] = case["old_logprobs"]  # the rollout's, as tests/test_grpo.py forces them
        metrics = {name: trainer._metrics["train"][name][-1] for name in ("tools/call_frequency",
                                                                          "tools/failure_frequency")}
        keep = ("advantages", "completion_mask", "tool_mask", "ref_per_token_logps", "num_items_in_batch")
        kept = {k: v.detach() for k, v in inputs.items() if k in keep and isinstance(v, torch.Tensor)}
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
        step = case["step"]
        optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=step["lr"], eps=step["eps"], weight_decay=0.0)
        optimizer.step()
        weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return {**made, **kept, "metrics": metrics, "turns_used": calls, "loss": loss.detach(), "grads": grads,
            "weights": weights}
