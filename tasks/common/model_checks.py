"""Checks of the models a stage is given, before any is loaded for work: a wrong model fails at once with
what is wrong, instead of training against a reward head that transformers initialized at random.

- The reward model must be a sequence classifier with one output. A causal LM loads as one without an
  error: `AutoModelForSequenceClassification` adds a `score` head at random and only logs a warning.
- Policy and reward model must share a tokenizer: the reward model scores the policy's token ids.
- The tokenizer needs a pad token: rollouts are padded batches.
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.common.errors import StageFailed

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


class ModelInputError(StageFailed, ValueError):
    """A model or tokenizer that cannot do its job in this stage; the message names it and what is wrong."""


def check_reward_model(source: str | os.PathLike, role: str = "reward model") -> None:
    """`source` (a directory or hub id) is a sequence classifier with num_labels == 1."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source), trust_remote_code=False)
    except (OSError, ValueError) as error:  # a missing directory reads as a malformed hub id to transformers
        raise ModelInputError(f"could not load the {role} {str(source)!r}: not a model directory, and not a hub "
                              f"id reachable offline ({error})") from None
    architectures = config.architectures or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ModelInputError(
            f"{source}: the {role} is a {', '.join(architectures)}, not a sequence classifier (e.g. "
            f"GPTNeoXForSequenceClassification); loaded as one, its score head would be random. Train one with "
            "the reward-model stage, or name a reward model in reward_model.pretrained")
    if config.num_labels != 1:
        raise ModelInputError(f"{source}: the {role} has num_labels={config.num_labels} ({config.id2label}); a "
                              "reward model has one output, its score (num_labels=1)")


def check_tokenizers(policy: str | os.PathLike, reward: str | os.PathLike) -> None:
    """The policy's tokenizer has a pad token, and the reward model's (when it has one) is the same."""
    from transformers import AutoTokenizer

    try:
        policy_tok = AutoTokenizer.from_pretrained(str(policy), trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ModelInputError(f"could not load the policy's tokenizer from {str(policy)!r} ({error})") from None
    if policy_tok.pad_token is None:
        raise ModelInputError(f"{policy}: the tokenizer has no pad token; add a distinct one (e.g. '[PAD]', "
                              "tokenizer.add_special_tokens) and resize the embeddings before RL")
    reward_tok = _tokenizer_of(reward)
    if reward_tok is None:  # a reward model saved without a tokenizer: nothing to compare
        return
    ours, theirs = policy_tok.get_vocab(), reward_tok.get_vocab()
    if ours != theirs:
        differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
        raise ModelInputError(
            f"the policy's tokenizer ({policy}, {len(ours)} tokens) and the reward model's ({reward}, {len(theirs)} "
            f"tokens) differ in {len(differ)} tokens (e.g. {differ[:5]}): the reward model would score token ids "
            "that mean something else to it. Use one tokenizer for both")


def _tokenizer_of(source: str | os.PathLike):
    """The tokenizer saved with a model (a directory or hub id), or None when it has none."""
    from transformers import AutoTokenizer

    if Path(source).is_dir() and not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(source), trust_remote_code=False)
    except (OSError, ValueError):  # a hub id without tokenizer files
        return None
