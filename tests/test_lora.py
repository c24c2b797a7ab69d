"""LoRA policies: only the adapter trains, and the reference is the base model (adapter disabled)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from conftest import target_fraction
from rlhf_core.config import RLConfig
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.scoring import FunctionScorer


def test_lora_policy_trains_adapter_only(tokenizer, prompts, make_policy):
    base = make_policy()
    frozen_copy = {k: v.clone() for k, v in base.state_dict().items()}
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value", "dense_h_to_4h"],
                                             lora_dropout=0.0))
    cfg = RLConfig(algo="rloo", total_episodes=96, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                   num_epochs=1, local_rollout_forward_batch_size=32, response_length=6, stop_token=None,
                   missing_eos_penalty=None, learning_rate=1e-2, rloo={"rloo_k": 4})
    trainer = RLTrainer(cfg, policy, FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                        stop_token_id=1)
    assert trainer.ref_policy is None, "a PEFT policy's reference is its own base model"
    history = trainer.train()
    assert history[-1]["objective/kl"] != 0.0, "the adapter moved the policy away from the base model"

    lora = {k: v for k, v in policy.state_dict().items() if "lora_B" in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values()), "lora_B starts at 0 and must train"
    merged_names = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                    for k, v in policy.state_dict().items() if "lora_" not in k}
    for name, value in frozen_copy.items():
        torch.testing.assert_close(merged_names[name], value, rtol=0, atol=0, msg=name)
