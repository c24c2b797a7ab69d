"""Reward-model inspection: which token a sequence classifier scores, whether padding or batching moves its
scores, and how it scores real text (distribution, held-out pairwise accuracy, length bias).

Two scoring paths are probed, because both are used on the same checkpoints:
- "forward": the model's own `forward(input_ids, attention_mask, position_ids)`. HF
  `*ForSequenceClassification` pools at the rightmost token that is not `config.pad_token_id`, found by
  searching the ids. The classic trap: with pad == EOS and completions that end with EOS, it scores the token
  BEFORE the EOS and treats every EOS as padding; with a config pad id that differs from the tokenizer's, it
  scores a padding position. A model trained through this forward learned whatever token it pooled.
- "scorer": `rlhf_core.scoring.RewardModelScorer`, what this pipeline's reward training, RL and evaluation
  score with: the last real token taken from the attention mask.

Each completion is encoded the pipeline's way, prompt + completion + EOS (reward_training.encode_pairs), so
the token that must be scored is the EOS. Which position a path scores is found by matching its score to
the score head applied at every position of the backbone's hidden states; the claims are then verified by
perturbation: changing the last real token must change the score, changing padding content or amount, the
padding side or the batch size must not, and two eval-mode passes must agree (dropout off).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from rlhf_core.rollout import Rollout, backbone_hidden, position_ids, score_head
from rlhf_core.scoring import RewardModelScorer

Example = tuple[list[int], list[int]]
"""(prompt ids, completion ids ending with EOS)."""
PATHS = ("forward", "scorer")


class InspectionConfig(BaseModel):
    """What the inspection scores and how strict it is."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    num_probes: int = Field(8, gt=1)
    """Examples the token and padding probes use (the first rows of the pairs or prompts)."""
    num_pairs: int = Field(512, gt=0)
    """Held-out preference pairs scored for accuracy, margin and length bias."""
    num_prompts: int = Field(256, gt=0)
    """Evaluation prompts whose references are scored for the score distribution."""
    batch_size: int = Field(32, gt=0)
    """Sequences per forward."""
    max_length: int = Field(320, gt=0)
    """Tokens of prompt + completion + EOS kept, cut from the prompt's start (as reward training does)."""
    atol: float = Field(1e-4, gt=0.0)
    """Scores closer than atol + rtol * (score scale) count as equal."""
    rtol: float = Field(1e-3, ge=0.0)
    """Relative part of the tolerance; raise both for bf16/fp16 models."""
    min_pair_accuracy: float = Field(0.0, ge=0.0, le=1.0)
    """Fail when held-out pairwise accuracy is below this (0 disables; a worse-than-chance RM is suspect)."""
    length_bias_warning: float = Field(0.5, gt=0.0, le=1.0)
    """Warn when |corr(score, completion length)| exceeds this."""


@dataclass(frozen=True)
class Padded:
    """A padded batch in one of the layouts below; `last_index` is each row's last real token."""

    input_ids: Tensor  # (B, T)
    attention_mask: Tensor  # (B, T) bool
    prompt_width: int  # P: the columns before the completions (rollout layout; the scorer splits here)
    last_index: Tensor  # (B,)


# ----------------------------------------------------------------------------------------- layouts


def rollout_layout(examples: Sequence[Example], pad_id: int, left_extra: int = 0, right_extra: int = 0) -> Padded:
    """The trainer's layout: prompts left-padded, completions right-padded (+ extra pad columns)."""
    P = max(len(p) for p, _ in examples) + left_extra
    R = max(len(c) for _, c in examples) + right_extra
    ids = torch.full((len(examples), P + R), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(examples):
        ids[row, P - len(prompt):P + len(completion)] = torch.tensor(prompt + completion)
        mask[row, P - len(prompt):P + len(completion)] = True
    last = P + torch.tensor([len(c) for _, c in examples]) - 1
    return Padded(ids, mask, P, last)


def sequence_layout(examples: Sequence[Example], pad_id: int, side: str, extra: int = 0) -> Padded:
    """Whole sequences padded on one side: 'right' as reward training collates, 'left' as generation does."""
    sequences = [p + c for p, c in examples]
    T = max(len(s) for s in sequences) + extra
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        cols = slice(0, len(seq)) if side == "right" else slice(T - len(seq), T)
        ids[row, cols], mask[row, cols] = torch.tensor(seq), True
    last = torch.tensor([len(s) - 1 if side == "right" else T - 1 for s in sequences])
    return Padded(ids, mask, 0, last)


def path_layout(path: str, examples: Sequence[Example], pad_id: int, extra: int = 0) -> Padded:
    """The padded layout each path is used with: right padding (forward) or the rollout layout (scorer)."""
    if path == "forward":
        return sequence_layout(examples, pad_id, "right", extra)
    return rollout_layout(examples, pad_id, extra, extra)


def alone(path: str, example: Example, pad_id: int) -> Padded:
    """One example, no padding at all: the reference every padded score must reproduce."""
    return path_layout(path, [example], pad_id)


# ----------------------------------------------------------------------------------------- scoring


@torch.no_grad()
def forward_scores(model: nn.Module, batch: Padded, batch_size: int) -> Tensor:
    """The model's own forward (its own pooling); position ids from the mask, as the pipeline passes them."""
    device = next(model.parameters()).device
    out = []
    for rows in torch.arange(len(batch.input_ids)).split(batch_size):
        ids, mask = batch.input_ids[rows].to(device), batch.attention_mask[rows].to(device)
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask)).logits
        out.append(logits[:, 0].float().cpu())
    return torch.cat(out)


def as_rollout(batch: Padded, eos_id: int | None) -> Rollout:
    """The rollout layout as the trainer's container (log-probs are not needed to score)."""
    P = batch.prompt_width
    responses, response_mask = batch.input_ids[:, P:], batch.attention_mask[:, P:]
    zeros = torch.zeros(responses.shape)
    contains_stop = (responses == eos_id).any(1) if eos_id is not None else torch.zeros(len(responses), dtype=torch.bool)
    return Rollout(queries=batch.input_ids[:, :P], query_mask=batch.attention_mask[:, :P], responses=responses,
                   response_mask=response_mask, logprobs=zeros, ref_logprobs=zeros, contains_stop=contains_stop)


def scorer_scores(model: nn.Module, batch: Padded, batch_size: int) -> Tensor:
    """Scores through `RewardModelScorer`, the pipeline's path."""
    eos_id = getattr(model.config, "eos_token_id", None)
    return RewardModelScorer(model, batch_size=batch_size)(as_rollout(batch, eos_id)).cpu()


ScoreFn = Callable[[Padded], Tensor]


def score_fn(model: nn.Module, path: str, batch_size: int) -> ScoreFn:
    fn = forward_scores if path == "forward" else scorer_scores
    return lambda batch: fn(model, batch, batch_size)


@torch.no_grad()
def position_scores(model: nn.Module, batch: Padded) -> Tensor:
    """The score head at every position: (B, T). A path's score equals one of these: the token it scores."""
    device = next(model.parameters()).device
    hidden = backbone_hidden(model, batch.input_ids.to(device), batch.attention_mask.to(device))  # (B, T, H)
    return score_head(model)(hidden).squeeze(-1).float().cpu()


def scored_positions(scores: Tensor, per_position: Tensor) -> tuple[Tensor, Tensor]:
    """For each row, the position whose head output matches the row's score, and the mismatch: (B,), (B,)."""
    gap = (per_position - scores[:, None]).abs()  # (B, T)
    mismatch, position = gap.min(1)
    return position, mismatch


# ----------------------------------------------------------------------------------------- perturbations


def other_token(token: int, vocab_size: int, avoid: set[int]) -> int:
    """A deterministic id different from `token` and from the special ids in `avoid`."""
    for step in range(1, vocab_size):
        candidate = (token + step * 7919) % vocab_size  # a stride prime to most vocabularies: not a neighbour
        if candidate != token and candidate not in avoid:
            return candidate
    raise ValueError(f"vocabulary of {vocab_size} ids has no token to substitute")


def with_last_token_changed(batch: Padded, vocab_size: int, avoid: set[int]) -> Padded:
    ids = batch.input_ids.clone()
    rows = torch.arange(len(ids))
    ids[rows, batch.last_index] = torch.tensor(
        [other_token(int(t), vocab_size, avoid) for t in ids[rows, batch.last_index]])
    return replace(batch, input_ids=ids)


def with_padding_content_changed(batch: Padded, vocab_size: int, avoid: set[int], seed: int = 0) -> Padded:
    """Every masked-out id replaced by a random ordinary token: padding must be invisible by its mask."""
    ordinary = torch.tensor([t for t in range(vocab_size) if t not in avoid])
    generator = torch.Generator().manual_seed(seed)
    noise = ordinary[torch.randint(len(ordinary), batch.input_ids.shape, generator=generator)]
    return replace(batch, input_ids=torch.where(batch.attention_mask, batch.input_ids, noise))


# ----------------------------------------------------------------------------------------- checks


@dataclass
class Check:
    name: str
    path: str
    passed: bool
    detail: str
    explanation: str = ""
    """Why it failed and how to fix it (empty when it passed)."""
    value: float | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in ("", None)}


@dataclass(frozen=True)
class Probe:
    """What the checks of one path share: the model, its scoring function, the examples and the tokens."""

    model: nn.Module
    path: str
    score: ScoreFn
    examples: list[Example]
    pad_id: int
    eos_id: int | None
    config_pad_id: int | None
    vocab_size: int
    decode: Callable[[int], str]
    cfg: InspectionConfig

    @property
    def specials(self) -> set[int]:
        return {t for t in (self.pad_id, self.eos_id, self.config_pad_id) if t is not None}

    def tolerance(self, scores: Tensor) -> float:
        return self.cfg.atol + self.cfg.rtol * float(scores.abs().max())

    def padded(self, extra: int = 2) -> Padded:
        return path_layout(self.path, self.examples, self.pad_id, extra)


def check_scored_token(probe: Probe) -> Check:
    batch = probe.padded()
    scores = probe.score(batch)
    position, mismatch = scored_positions(scores, position_scores(probe.model, batch))
    wrong = (position != batch.last_index) | (mismatch > probe.tolerance(scores))
    if not wrong.any():
        return Check("scored_token", probe.path, True, f"scores the last real token (the EOS) in all "
                     f"{len(scores)} padded probes", value=0.0)
    row = int(wrong.nonzero()[0])
    what = describe_position(probe, batch, row, int(position[row]), float(mismatch[row]) > probe.tolerance(scores))
    return Check("scored_token", probe.path, False, f"{int(wrong.sum())}/{len(scores)} probes: {what}",
                 explanation=explain_wrong_token(probe, batch, row, int(position[row])),
                 value=float((position - batch.last_index)[row]))


def describe_position(probe: Probe, batch: Padded, row: int, position: int, unmatched: bool) -> str:
    if unmatched:
        return "its score matches the score head at no position (the forward does not pool one token's state)"
    last = int(batch.last_index[row])
    token = probe.decode(int(batch.input_ids[row, position]))
    where = ("a padding position" if not batch.attention_mask[row, position]
             else "the first token" if position == int(batch.attention_mask[row].float().argmax())
             else f"{last - position} token(s) before the last real token")
    return f"scores position {position} ({token!r}, {where}) instead of position {last} (the EOS)"


def explain_wrong_token(probe: Probe, batch: Padded, row: int, position: int) -> str:
    """What is wrong, most specific cause first, and how to fix it."""
    pad, cfg_pad, eos = probe.pad_id, probe.config_pad_id, probe.eos_id
    fix_pad = ("Give the tokenizer a distinct pad token (tokenizer.add_special_tokens({'pad_token': '[PAD]'}), "
               "model.resize_token_embeddings(len(tokenizer)), model.config.pad_token_id = "
               "tokenizer.pad_token_id) and retrain the reward model, or score only through "
               "rlhf_core.scoring.RewardModelScorer, which takes the last real token from the attention mask.")
    if probe.path == "forward" and cfg_pad is not None and cfg_pad == eos:
        return (f"model.config.pad_token_id ({cfg_pad}) equals the EOS id ({eos}). HF's "
                f"{type(probe.model).__name__}.forward pools at the rightmost token that is not pad_token_id, so "
                "a completion ending with EOS is scored at the token before its EOS, and a model trained through "
                f"this forward (e.g. TRL's RewardTrainer) never learned to read the EOS. {fix_pad}")
    if probe.path == "forward" and cfg_pad != pad:
        return (f"model.config.pad_token_id is {cfg_pad} but the tokenizer pads with id {pad}: the forward does "
                f"not recognise the padding and scores a pad position. Set model.config.pad_token_id = {pad} "
                "(the tokenizer's pad id) and save the model again.")
    if probe.path == "scorer":
        return ("RewardModelScorer applies the score head to the backbone's hidden state at the last real token; "
                f"a different match means {type(probe.model).__name__}'s backbone (`base_model_prefix`) or head "
                "(`score`/`classifier`) is not what its forward uses. Load it as a standard "
                "AutoModelForSequenceClassification with num_labels=1.")
    if not batch.attention_mask[row, position]:
        return ("The model pools a fixed position (e.g. the last column) instead of the last real token, so with "
                "right padding it scores a pad. Pool at attention_mask.sum(-1) - 1 (or the last non-pad token), "
                "or score through rlhf_core.scoring.RewardModelScorer.")
    return ("The model pools a token other than the last real one (e.g. the first), so the completion's end, "
            "where a reward model reads the whole text, is ignored. Pool at the last real token "
            "(attention_mask.sum(-1) - 1 with right padding) or score through "
            "rlhf_core.scoring.RewardModelScorer.")


def check_last_token_matters(probe: Probe) -> Check:
    batch = probe.padded()
    scores = probe.score(batch)
    changed = probe.score(with_last_token_changed(batch, probe.vocab_size, probe.specials))
    moved = (changed - scores).abs() > probe.tolerance(scores)
    ok = bool(moved.all())
    return Check("last_token_changes_score", probe.path, ok,
                 f"changing the last real token moved the score in {int(moved.sum())}/{len(scores)} probes",
                 explanation="" if ok else "The score ignores the last real token, so it cannot be the token "
                 "scored: the model scores an earlier position. See scored_token.",
                 value=float(moved.float().mean()))


def invariance(probe: Probe, name: str, reference: Tensor, other: Tensor, what: str, why: str) -> Check:
    """Passes when `other` reproduces `reference` within the tolerance."""
    gap = float((other - reference).abs().max())
    ok = gap <= probe.tolerance(reference)
    return Check(name, probe.path, ok, f"{what}: max abs score change {gap:.3g}",
                 explanation="" if ok else why, value=gap)


def check_padding_content(probe: Probe) -> Check:
    batch = probe.padded()
    noisy = with_padding_content_changed(batch, probe.vocab_size, probe.specials)
    return invariance(probe, "padding_content_invariance", probe.score(batch), probe.score(noisy),
                      "random ids in the masked-out positions",
                      "The score depends on what the padding contains: the model finds padding by its id, not "
                      "by the attention mask (or it scores a padding position). See scored_token.")


def check_padding_amount(probe: Probe) -> Check:
    return invariance(probe, "padding_amount_invariance", probe.score(probe.padded(0)),
                      probe.score(probe.padded(5)), "5 more pad columns",
                      "Adding padding changes the score: the model scores a position counted from the padded "
                      "end, or attends to padding.")


def check_padding_side(probe: Probe) -> Check:
    singles = torch.cat([probe.score(alone(probe.path, ex, probe.pad_id)) for ex in probe.examples])
    if probe.path == "forward":
        batches = [sequence_layout(probe.examples, probe.pad_id, side, 2) for side in ("left", "right")]
        what = "left- and right-padded batches against each sequence alone, unpadded"
    else:
        batches = [probe.padded()]
        what = "left-padded prompts + right-padded completions against each example alone, unpadded"
    padded = torch.stack([probe.score(b) for b in batches])  # (layouts, B)
    worst = padded[(padded - singles).abs().amax(1).argmax()]
    return invariance(probe, "padding_side_invariance", singles, worst, what,
                      "Left and right padding give different scores: position ids or pooling depend on where "
                      "the padding is. Pass position_ids = attention_mask.cumsum(-1) - 1 and pool at the last "
                      "real token.")


def check_batch_size(probe: Probe) -> Check:
    batch = probe.padded()
    one_by_one = torch.cat([probe.score(replace(batch, input_ids=batch.input_ids[i:i + 1],
                                                attention_mask=batch.attention_mask[i:i + 1],
                                                last_index=batch.last_index[i:i + 1])) for i in range(len(batch.input_ids))])
    return invariance(probe, "batch_size_invariance", one_by_one, probe.score(batch),
                      f"a batch of {len(one_by_one)} against one row at a time",
                      "Scores change with the batch they are computed in (batch-dependent normalization or "
                      "pooling): scores of one completion would depend on its neighbours.")


def check_deterministic(probe: Probe) -> Check:
    probe.model.eval()
    batch = probe.padded()
    return invariance(probe, "dropout_off", probe.score(batch), probe.score(batch), "two eval-mode passes",
                      "Two passes in eval mode disagree: something stochastic (dropout outside nn.Dropout, "
                      "sampling) is active at inference. Disable it before scoring.")


CHECKS = (check_scored_token, check_last_token_matters, check_padding_content, check_padding_amount,
          check_padding_side, check_batch_size, check_deterministic)
MASK_ONLY = {check_padding_content}
"""Checks that need padding to be defined by the attention mask alone: HF's forward finds padding by its id,
so random ids in pad positions are not padding to it (its contract is pad ids); only the scorer is held to it."""


def run_checks(probe: Probe) -> list[Check]:
    checks = []
    for check in CHECKS:
        if probe.path == "forward" and check in MASK_ONLY:
            continue
        try:
            checks.append(check(probe))
        except Exception as err:  # a model that cannot even be scored this way fails, with the reason
            name = check.__name__.removeprefix("check_")
            checks.append(Check(name, probe.path, False, f"scoring raised {type(err).__name__}: {err}",
                                explanation=explain_error(probe, err)))
    return checks


def explain_error(probe: Probe, err: Exception) -> str:
    if probe.path == "forward" and probe.config_pad_id is None:
        return ("model.config.pad_token_id is None: HF's forward cannot find the last real token of a padded "
                f"batch. Set model.config.pad_token_id = {probe.pad_id} (the tokenizer's pad id) and save again.")
    return f"The {probe.path} path cannot score this model: {err}"


# ----------------------------------------------------------------------------------------- the report


def describe_model(model: nn.Module) -> dict:
    config = model.config
    head_name, head = next(((n, getattr(model, n)) for n in ("score", "classifier")
                            if isinstance(getattr(model, n, None), nn.Module)), (None, None))
    weight = getattr(head, "weight", None)
    dropouts = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    return {
        "class": type(model).__name__,
        "architectures": list(getattr(config, "architectures", None) or []),
        "model_type": getattr(config, "model_type", None),
        "num_labels": getattr(config, "num_labels", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "score_head": None if head is None else {
            "module": head_name, "type": type(head).__name__,
            "weight_shape": None if weight is None else list(weight.shape),
            "bias": getattr(head, "bias", None) is not None},
        "dropout_modules": len(dropouts),
        "dropout_modules_active": sum(p > 0 for p in dropouts),
    }


def describe_tokens(model: nn.Module, tokenizer) -> dict:
    config = model.config
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    appended = tokenizer("a", add_special_tokens=True)["input_ids"]
    return {
        "tokenizer_pad_token_id": pad, "tokenizer_eos_token_id": eos,
        "pad_token": tokenizer.pad_token, "eos_token": tokenizer.eos_token,
        "config_pad_token_id": getattr(config, "pad_token_id", None),
        "config_eos_token_id": getattr(config, "eos_token_id", None),
        "pad_is_eos": pad == eos,
        "tokenizer_appends_eos": bool(appended) and appended[-1] == eos,
        "padding_side": tokenizer.padding_side,
        "eos_handling": "completions are scored as prompt + completion + EOS (appended by the pipeline, as "
                        "in reward training); the EOS is the token that must be scored",
    }


def encode(tokenizer, prompt: str, completion: str, max_length: int) -> Example:
    """prompt + completion + EOS, the prompt cut from its start when the whole exceeds max_length."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"][:max_length - 1]
    completion_ids = completion_ids + [tokenizer.eos_token_id]
    keep = max(max_length - len(completion_ids), 1)
    return prompt_ids[-keep:], completion_ids


def synthetic_examples(vocab_size: int, avoid: set[int], eos_id: int, n: int, seed: int = 0) -> list[Example]:
    """Random ordinary tokens + EOS, of varied lengths: probes for a model given without data."""
    ordinary = torch.tensor([t for t in range(vocab_size) if t not in avoid])
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = ordinary[torch.randint(len(ordinary), (6 + 3 * (i % 5),), generator=generator)].tolist()
        out.append((ids[:4], ids[4:] + [eos_id]))
    return out


def pearson(x: Tensor, y: Tensor) -> float | None:
    x, y = x.double(), y.double()
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return None
    return float(((x - x.mean()) * (y - y.mean())).mean() / (x.std(correction=0) * y.std(correction=0)))


def distribution(scores: Tensor) -> dict:
    q = torch.quantile(scores.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.double)).tolist()
    return {"n": len(scores), "mean": float(scores.mean()), "std": float(scores.std()) if len(scores) > 1 else 0.0,
            "min": float(scores.min()), "p05": q[0], "median": q[1], "p95": q[2], "max": float(scores.max())}


def score_examples(model: nn.Module, examples: Sequence[Example], pad_id: int, cfg: InspectionConfig) -> Tensor:
    """Pipeline scores (the scorer path), chunked so each chunk is padded only to its own longest row."""
    scorer = score_fn(model, "scorer", cfg.batch_size)
    return torch.cat([scorer(rollout_layout(examples[i:i + cfg.batch_size], pad_id))
                      for i in range(0, len(examples), cfg.batch_size)])


def score_texts(model: nn.Module, tokenizer, pairs: Sequence[dict], prompts: Sequence[dict],
                cfg: InspectionConfig) -> dict:
    """Scores of references, chosen and rejected completions, with their lengths in tokens."""
    sets = {"reference": [(r["prompt"], r["reference"]) for r in prompts if r.get("reference")],
            "chosen": [(r["prompt"], r["chosen"]) for r in pairs],
            "rejected": [(r["prompt"], r["rejected"]) for r in pairs]}
    out = {}
    for name, texts in sets.items():
        if texts:
            examples = [encode(tokenizer, p, c, cfg.max_length) for p, c in texts]
            out[name] = {"scores": score_examples(model, examples, tokenizer.pad_token_id, cfg),
                         "lengths": torch.tensor([len(c) - 1 for _, c in examples])}
    return out


def pair_metrics(scored: dict) -> dict:
    chosen, rejected = scored["chosen"], scored["rejected"]
    margin = chosen["scores"] - rejected["scores"]
    longer_chosen = chosen["lengths"] > rejected["lengths"]
    unequal = chosen["lengths"] != rejected["lengths"]
    rm_prefers_longer = (margin > 0) == longer_chosen
    return {"n": len(margin), "accuracy": float((margin > 0).float().mean()), "margin_mean": float(margin.mean()),
            "margin_std": float(margin.std()) if len(margin) > 1 else 0.0,
            "rm_prefers_longer": float(rm_prefers_longer[unequal].float().mean()) if unequal.any() else None,
            "labels_prefer_longer": float(longer_chosen[unequal].float().mean()) if unequal.any() else None}


def length_bias(scored: dict) -> dict:
    scores = torch.cat([s["scores"] for s in scored.values()])
    lengths = torch.cat([s["lengths"] for s in scored.values()])
    per_set = {name: pearson(s["scores"], s["lengths"].float()) for name, s in scored.items()}
    return {"correlation": pearson(scores, lengths.float()), "per_set": per_set, "n": len(scores)}


def inspect_reward_model(model: nn.Module, tokenizer, *, pairs: Sequence[dict] = (), prompts: Sequence[dict] = (),
                         cfg: InspectionConfig | None = None) -> dict:
    """The whole inspection as a JSON-ready report; `report["passed"]` is False when any check fails.

    pairs: held-out {prompt, chosen, rejected} rows; prompts: {prompt, reference} rows. Without either, the
    token and padding probes use random token sequences ending with EOS.
    """
    cfg = cfg or InspectionConfig()
    model.eval()
    pairs, prompts = list(pairs)[:cfg.num_pairs], list(prompts)[:cfg.num_prompts]
    report = {"model": describe_model(model), "tokens": describe_tokens(model, tokenizer)}
    failures: list[str] = []
    if report["model"]["num_labels"] != 1:
        failures.append(f"num_labels is {report['model']['num_labels']}; a reward model has exactly one output "
                        "(AutoModelForSequenceClassification with num_labels=1)")
    checks = [] if failures else run_all_checks(model, tokenizer, pairs, prompts, cfg)
    report["checks"] = [c.as_dict() for c in checks]
    failures += [f"[{c.path}] {c.name}: {c.detail}. {c.explanation}" for c in checks if not c.passed]
    warnings: list[str] = []
    scorer_ok = checks and all(c.passed for c in checks if c.path == "scorer")
    if scorer_ok and (pairs or prompts):  # the pipeline's scores mean something even when the forward fails
        report.update(quality_report(model, tokenizer, pairs, prompts, cfg, failures, warnings))
    report.update(passed=not failures, failures=failures, warnings=warnings)
    return report


def run_all_checks(model: nn.Module, tokenizer, pairs: Sequence[dict], prompts: Sequence[dict],
                   cfg: InspectionConfig) -> list[Check]:
    vocab_size = model.get_input_embeddings().num_embeddings
    config_pad = getattr(model.config, "pad_token_id", None)
    texts = [(r["prompt"], r["chosen"]) for r in pairs] + [(r["prompt"], r["reference"]) for r in prompts
                                                          if r.get("reference")]
    specials = {t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, config_pad) if t is not None}
    examples = [encode(tokenizer, p, c, cfg.max_length) for p, c in texts[:cfg.num_probes]] or \
        synthetic_examples(vocab_size, specials, tokenizer.eos_token_id, cfg.num_probes)
    decode = lambda t: tokenizer.decode([t])  # noqa: E731
    checks = []
    for path in PATHS:
        probe = Probe(model, path, score_fn(model, path, cfg.batch_size), examples, tokenizer.pad_token_id,
                      tokenizer.eos_token_id, config_pad, vocab_size, decode, cfg)
        checks += run_checks(probe)
    return checks


def quality_report(model: nn.Module, tokenizer, pairs: Sequence[dict], prompts: Sequence[dict],
                   cfg: InspectionConfig, failures: list[str], warnings: list[str]) -> dict:
    """Score distribution, pairwise accuracy and length bias (through the pipeline's scorer)."""
    scored = score_texts(model, tokenizer, pairs, prompts, cfg)
    if not all(torch.isfinite(s["scores"]).all() for s in scored.values()):
        failures.append("the reward model returns NaN or infinite scores on real text")
    out = {"scores": {name: distribution(s["scores"]) for name, s in scored.items()},
           "length_bias": length_bias(scored),
           "samples": {name: {"scores": s["scores"].tolist(), "lengths": s["lengths"].tolist()}
                       for name, s in scored.items()}}
    if "chosen" in scored:
        out["pairs"] = pair = pair_metrics(scored)
        if pair["accuracy"] < cfg.min_pair_accuracy:
            failures.append(f"held-out pairwise accuracy {pair['accuracy']:.3f} is below min_pair_accuracy "
                            f"{cfg.min_pair_accuracy}: the reward model does not rank held-out pairs like the "
                            "labels (a flipped sign, the wrong scored token, or too little training)")
        elif pair["accuracy"] < 0.5:
            warnings.append(f"held-out pairwise accuracy {pair['accuracy']:.3f} is below chance")
    corr = out["length_bias"]["correlation"]
    if corr is not None and abs(corr) > cfg.length_bias_warning:
        warnings.append(f"score and completion length correlate strongly (r = {corr:.2f}): the policy can gain "
                        "reward by changing its length alone (length bias)")
    return out

