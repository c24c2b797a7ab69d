"""Supervised fine-tuning (SFT) of a causal LM on {"prompt", "completion"} rows.

Each row trains as  tokens(prompt) + tokens(completion) + [EOS]  with the cross-entropy on the completion
tokens and the EOS only; prompt positions are labelled -100 (TRL SFTTrainer's `completion_only_loss`), so
the policy learns to summarize and to stop, not to write posts. The loop is supervised.py's `fit`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor, nn

from rlhf_core.batching import encode_examples, pad, token_ids
from rlhf_core.config import SFTConfig
from rlhf_core.greedy_eval import decode_responses, greedy_rollout
from rlhf_core.rollout import position_ids
from rlhf_core.scoring import GoldFn
from rlhf_core.supervised import Batch, Progress, Row, TrainResult, fit

IGNORE_INDEX = -100  # torch's cross-entropy skips this label


def encode_sft(tokenizer, rows: Sequence[Row], cfg: SFTConfig) -> list[tuple[list[int], list[int]]]:
    """Rows -> (input_ids, labels): prompt + completion + EOS, the prompt labelled IGNORE_INDEX."""
    examples = encode_examples(tokenizer, [(row["prompt"], row["completion"]) for row in rows],
                               max_prompt_tokens=cfg.max_prompt_length,
                               max_completion_tokens=cfg.max_completion_length)
    return [(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion) for prompt, completion in examples]


def sft_collate(examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> Batch:
    """Right-pad a micro-batch: input_ids, attention_mask (bool) and labels, each (B, T)."""
    input_ids, attention_mask = pad([ids for ids, _ in examples], pad_token_id, "right")  # (B, T)
    labels, _ = pad([labels for _, labels in examples], IGNORE_INDEX, "right")  # (B, T)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def completion_tokens(batch: Batch) -> Tensor:
    """Number of supervised (completion + EOS) tokens in a batch: the units SFT's loss averages over."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def token_losses(model: nn.Module, batch: Batch) -> dict[str, Tensor]:
    """Cross-entropy of each supervised token: {"loss": (U,)}, U = completion_tokens(batch)."""
    mask, labels = batch["attention_mask"], batch["labels"][:, 1:]  # labels (B, T-1): position t predicts token t+1
    supervised = (labels != IGNORE_INDEX).any(0)  # (T-1,)
    first = int(supervised.int().argmax()) if supervised.any() else labels.shape[1]
    # logits from the first supervised position on (+ the last one, which predicts nothing): a prompt position's
    # logits would be a (B, P, V) LM-head matmul and cross-entropy for nothing
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask),
                   logits_to_keep=labels.shape[1] - first + 1).logits  # (B, T-first, V)
    labels = labels[:, first:].flatten()
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels, ignore_index=IGNORE_INDEX,
                          reduction="none")  # (B*(T-1-first),)
    return {"loss": nll[labels != IGNORE_INDEX]}  # (U,)


def train_sft(cfg: SFTConfig, model: nn.Module, tokenizer, train_rows: Sequence[Row],
              eval_rows: Sequence[Row], *, accelerator: Accelerator | None = None,
              progress: Progress | None = None) -> TrainResult:
    """Fine-tune `model` on prompt/completion rows; after each epoch, its held-out loss on `eval_rows`."""
    examples = encode_sft(tokenizer, train_rows, cfg)
    return fit(cfg, model, examples, [len(ids) for ids, _ in examples],
               collate=lambda ex: sft_collate(ex, tokenizer.pad_token_id),
               losses_fn=token_losses, units_fn=completion_tokens,
               evaluate=lambda m: {"eval/loss": sft_loss(m, tokenizer, eval_rows, cfg)},
               accelerator=accelerator, progress=progress)


@torch.no_grad()
def sft_loss(model: nn.Module, tokenizer, rows: Sequence[Row], cfg: SFTConfig) -> float:
    """Mean cross-entropy per completion token (EOS included) over all `rows`."""
    model.eval()
    device = next(model.parameters()).device
    examples = encode_sft(tokenizer, rows, cfg)
    total, count = torch.zeros((), device=device), 0
    for start in range(0, len(examples), cfg.eval_batch_size):
        batch = sft_collate(examples[start:start + cfg.eval_batch_size], tokenizer.pad_token_id)
        nll = token_losses(model, {k: v.to(device) for k, v in batch.items()})["loss"]  # (U,)
        total, count = total + nll.sum(), count + nll.numel()
    return total.item() / max(count, 1)


def greedy_completions(model: nn.Module, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                       batch_size: int, max_prompt_length: int = 256) -> list[tuple[str, bool]]:
    """Greedy completions of `prompts` from left-padded batches: (text without EOS, ended_with_eos)."""
    ids = [p[-max_prompt_length:] for p in token_ids(tokenizer, prompts)]
    batch = greedy_rollout(model, ids, response_length=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                           stop_token_id=tokenizer.eos_token_id, batch_size=batch_size)
    return list(zip(decode_responses(tokenizer, batch), batch.contains_stop.tolist(), strict=True))


def evaluate_sft(model: nn.Module, tokenizer, prompt_rows: Sequence[Row], max_new_tokens: int,
                 batch_size: int, *, eval_rows: Sequence[Row] = (), gold: GoldFn | None = None,
                 cfg: SFTConfig | None = None) -> dict[str, float]:
    """Held-out loss on `eval_rows` (when given) and greedy-decoding metrics on `prompt_rows`.

    eval/eos_rate is the fraction of greedy completions that emit EOS within `max_new_tokens`: a policy
    that cannot stop pays the missing-EOS penalty on every RL episode. eval/gold_reward needs `gold`
    (real datasets have none).
    """
    cfg = cfg or SFTConfig()
    prompts = [row["prompt"] for row in prompt_rows]
    completions = greedy_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                     batch_size=batch_size, max_prompt_length=cfg.max_prompt_length)
    metrics = {"eval/eos_rate": sum(ended for _, ended in completions) / len(completions),
               "eval/response_words": sum(len(text.split()) for text, _ in completions) / len(completions)}
    if eval_rows:
        metrics["eval/loss"] = sft_loss(model, tokenizer, eval_rows, cfg)
    if gold is not None:
        scores = [gold(p, text, ended) for p, (text, ended) in zip(prompts, completions, strict=True)]
        metrics["eval/gold_reward"] = sum(scores) / len(scores)
    return metrics
