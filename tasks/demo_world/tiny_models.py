"""The demo's tiny GPT-NeoX policy and reward model, sized by params (`sft.tiny`) and seeded by `base.seed`."""

from __future__ import annotations

from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config
from tasks.parameters.params import Params


def _tiny_config(params: Params, tokenizer):
    tiny = params.sft.tiny
    return tiny_gpt_neox_config(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
                                num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                                intermediate_size=tiny.intermediate_size, max_positions=tiny.max_positions,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def tiny_policy(params: Params, tokenizer):
    """A fresh GPT-NeoX causal LM of the demo's size."""
    return init_causal_lm(_tiny_config(params, tokenizer), seed=params.base.seed)


def tiny_reward_model(params: Params, tokenizer):
    """A fresh GPT-NeoX sequence classifier (num_labels=1) of the demo's size."""
    return init_sequence_scorer(_tiny_config(params, tokenizer), seed=params.base.seed + 1)
