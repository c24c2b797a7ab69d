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

from tasks.execution.errors import StageFailed

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


def check_lora_settings(params, root: str | os.PathLike = ".", *, planned: bool = False) -> None:
    """With train.use_peft, the LoRA settings fit the policy's architecture, read from its config alone (no
    weights): ParamsError naming the key. The policy is models/sft (what train loads), or with `planned` (a run
    about to start, before the sft stage makes it) the model the sft section names. A config that cannot be read
    here (a hub id offline, no models/sft yet) is left to the train stage, which checks again."""
    if not params.train.use_peft:
        return
    from rlhf_core.lora import LoraSettingError, check_lora
    from tasks.parameters.params import ParamsError

    config = _planned_policy_config(params) if planned else _config_of(Path(root) / "models" / "sft")
    if config is None:
        return
    try:
        check_lora(config, params.peft_options())
    except LoraSettingError as err:
        raise ParamsError(f"train.{err}") from None


def _config_of(source: str | os.PathLike):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source), trust_remote_code=False)
    except (OSError, ValueError):
        return None


def _planned_policy_config(params):
    """The architecture the sft stage will save: its pretrained or base model's, else the demo's tiny GPT-NeoX."""
    source = params.sft.pretrained or params.sft.base_model
    if source:
        return _config_of(source)
    from rlhf_core.models import tiny_gpt_neox_config

    tiny = params.sft.tiny
    return tiny_gpt_neox_config(vocab_size=params.prepare.tokenizer_vocab_size, hidden_size=tiny.hidden_size,
                                num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                                intermediate_size=tiny.intermediate_size, max_positions=tiny.max_positions)
