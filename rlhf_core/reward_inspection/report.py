"""The inspection report: the model and its tokens described, every check of both paths, and, through the
pipeline's scorer, the score distribution, held-out pairwise accuracy and length bias."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlhf_core.batching import Example, encode_examples
from rlhf_core.config import InspectionConfig
from rlhf_core.reward_inspection.checks import PATHS, Check, Probe, run_checks, score_fn
from rlhf_core.reward_inspection.layouts import rollout_layout, synthetic_examples

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
            examples = encode_examples(tokenizer, texts, max_tokens=cfg.max_length)
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
    examples = encode_examples(tokenizer, texts[:cfg.num_probes], max_tokens=cfg.max_length) or \
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

