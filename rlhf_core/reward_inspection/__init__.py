"""Reward-model inspection (checks.py, report.py): which token a sequence classifier scores, whether padding or batching moves its
scores, and how it scores real text (distribution, held-out pairwise accuracy, length bias).

Two scoring paths are probed, because both are used on the same checkpoints:
- "forward": the model's own `forward(input_ids, attention_mask, position_ids)`. HF
  `*ForSequenceClassification` pools at the rightmost token that is not `config.pad_token_id`, found by
  searching the ids. The classic trap: with pad == EOS and completions that end with EOS, it scores the token
  BEFORE the EOS and treats every EOS as padding; with a config pad id that differs from the tokenizer's, it
  scores a padding position. A model trained through this forward learned whatever token it pooled.
- "scorer": `rlhf_core.scoring.RewardModelScorer`, what this pipeline's reward training, RL and evaluation
  score with: the last real token taken from the attention mask.

Each completion is encoded the pipeline's way, prompt + completion + EOS (rlhf_core.batching.encode_examples), so
the token that must be scored is the EOS. Which position a path scores is found by matching its score to
the score head applied at every position of the backbone's hidden states; the claims are then verified by
perturbation: changing the last real token must change the score, changing padding content or amount, the
padding side or the batch size must not, and two eval-mode passes must agree (dropout off).

layouts.py pads the probes the way each path is used; checks.py scores them through both paths and holds each
claim to a perturbation; report.py runs everything on a model and its tokenizer and adds the quality figures.
"""
