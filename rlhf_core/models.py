"""Building and loading the models the trainer needs: policy, value and reward models.

Safe by default: `trust_remote_code` is off and only safetensors weights are loaded.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
    PreTrainedModel,
)

from rlhf_core.hub import resolve_source, save_tokenizer
from rlhf_core.jsonio import atomic_path


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0: rollout and training must see the same function."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def tiny_gpt_neox_config(*, vocab_size: int, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                         intermediate_size: int = 512, max_positions: int = 256, pad_token_id: int = 0,
                         eos_token_id: int = 1) -> GPTNeoXConfig:
    """A small GPT-NeoX (Pythia's architecture family) for CPU worlds, without dropout."""
    return GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_positions, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        bos_token_id=eos_token_id, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
    )


def init_causal_lm(config: GPTNeoXConfig, seed: int) -> GPTNeoXForCausalLM:
    """Randomly initialized causal LM, deterministic in `seed`."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPTNeoXForCausalLM(config)


def init_sequence_scorer(config: GPTNeoXConfig, seed: int) -> GPTNeoXForSequenceClassification:
    """Randomly initialized value / reward model: a sequence classifier with one output."""
    scorer_config = GPTNeoXConfig(**{**config.to_dict(), "num_labels": 1, "id2label": {0: "LABEL_0"},
                                     "label2id": {"LABEL_0": 0}})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPTNeoXForSequenceClassification(scorer_config)


def reward_model_from_policy(policy: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """A sequence classifier (num_labels=1) with the policy's backbone weights and a fresh, seeded head."""
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        scorer = AutoModelForSequenceClassification.from_config(config)
    scorer.base_model.load_state_dict(policy.base_model.state_dict())
    return scorer.to(device=policy.device, dtype=policy.dtype)


def save_model(model, tokenizer, target: str | os.PathLike) -> None:
    """Model (safetensors) + tokenizer, written atomically."""
    with atomic_path(target, directory=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)


def _load(loader, name_or_path, **kwargs) -> PreTrainedModel:
    source = resolve_source(name_or_path)
    try:
        return loader.from_pretrained(source, trust_remote_code=False, use_safetensors=True, **kwargs)
    except OSError as err:
        raise OSError(f"could not load {source!r}: not a local model directory and not reachable on the "
                      f"Hugging Face Hub (offline? set HF_HUB_OFFLINE=1 to fail fast). Cause: {err}") from err


def load_policy(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, **kwargs) -> PreTrainedModel:
    """A causal LM; `kwargs` go to from_pretrained (attn_implementation: see rlhf_core.runtime)."""
    return disable_dropout(_load(AutoModelForCausalLM, name_or_path, dtype=dtype, **kwargs))


def load_scorer_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      **kwargs) -> PreTrainedModel:
    """A reward or value model: `AutoModelForSequenceClassification` with num_labels=1."""
    model = _load(AutoModelForSequenceClassification, name_or_path, dtype=dtype, num_labels=1, **kwargs)
    return disable_dropout(model)
