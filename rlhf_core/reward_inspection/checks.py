"""The checks of one scoring path: which token it scores, and whether padding, batching or dropout move its scores.

Two paths are probed (see the package docstring): "forward", the model's own forward, and "scorer",
`rlhf_core.scoring.RewardModelScorer`. Each check returns a `Check`; a failed one explains how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import Tensor, nn

from rlhf_core.batching import Example
from rlhf_core.config import InspectionConfig
from rlhf_core.reward_inspection.layouts import (
    Padded,
    alone,
    path_layout,
    sequence_layout,
    with_last_token_changed,
    with_padding_content_changed,
)
from rlhf_core.rollout import Rollout, backbone_hidden, position_ids, score_head
from rlhf_core.scoring import RewardModelScorer

PATHS = ("forward", "scorer")
LOW_PRECISION_RTOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}  # ~8 and ~4 units in the last place


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
        """Scores this close are equal: cfg's tolerance, widened to the rounding of the model's dtype (a bf16
        model's scores move by ~1-3% of their scale when only the padding or the batch changes), relative to the
        larger of the scores and the head's natural scale: rounding moves the hidden state, so a score the head
        happens to project near 0 moves as much as a large one (a random Pythia-1B-shaped scorer in bf16 on an
        H200 moved by 0.016 with every score under 0.5)."""
        dtype = next(self.model.parameters()).dtype
        rtol = max(self.cfg.rtol, LOW_PRECISION_RTOL.get(dtype, 0.0))
        return self.cfg.atol + rtol * max(float(scores.abs().max()), self.head_scale)

    @cached_property
    def head_scale(self) -> float:
        """|w| * RMS(h): the size of the score head's output for the probes' hidden states at their last real
        token, whatever direction they point in."""
        weight = getattr(score_head(self.model), "weight", None)
        if not isinstance(weight, Tensor):  # a head with layers of its own: the scores' own scale only
            return 0.0
        batch = self.padded()
        device = next(self.model.parameters()).device
        with torch.no_grad():
            hidden = backbone_hidden(self.model, batch.input_ids.to(device), batch.attention_mask.to(device))
        rows = torch.arange(len(batch.last_index), device=device)
        last = hidden[rows, batch.last_index.to(device)].float()  # (B, H)
        return float(weight.detach().float().norm() * last.pow(2).mean().sqrt())  # |w| (1, H) times RMS(h) (B, H)

    def padded(self, extra: int = 2) -> Padded:
        return path_layout(self.path, self.examples, self.pad_id, extra)


def check_scored_token(probe: Probe) -> Check:
    batch = probe.padded()
    scores = probe.score(batch)
    per_position = position_scores(probe.model, batch)  # (B, T)
    position, mismatch = scored_positions(scores, per_position)
    # the last real token's output must match; another position matching as well is a tie within rounding
    at_last = (per_position.gather(1, batch.last_index[:, None]).squeeze(1) - scores).abs()
    wrong = at_last > probe.tolerance(scores)
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
    # a model that reads an earlier token moves no score at all; a random or low-precision one can move a probe
    # by less than rounding when one token changes: most probes must move
    ok = bool(moved.float().mean() > 0.5)
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

