"""train.reward_funcs / reward_weights (TRL's names): validated once in params, built by the train stage into
one weighted scorer whose sources are each logged."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rlhf_core.config import RuntimeConfig
from rlhf_core.models import init_sequence_scorer, save_model
from rlhf_core.runtime import Runtime
from rlhf_core.scoring import RewardModelScorer, WeightedScorer
from tasks.parameters.params import Params
from tasks.parameters.paths import Paths
from tasks.stages.train import build_scorer, reward_models


def words(prompts, completions):
    return [float(len(c.split())) for c in completions]


TRUSTED = {"reward_modules": ["test_reward_sources"]}  # what a committed params.yaml would allow


def test_reward_sources_are_validated_once_with_clear_errors():
    ok = Params.model_validate({"trust": TRUSTED, "train": {"reward_funcs": [{"model": "models/reward"},
                                                                            {"function": "test_reward_sources:words"}],
                                                           "reward_weights": [1.0, 0.1]}})
    assert [s.label for s in ok.train.reward_funcs] == ["reward", "words"]
    assert "reward_funcs" not in ok.rl_config().model_dump()
    bad = [({"reward_funcs": [{"model": "m"}], "reward_weights": [1.0, 2.0]}, "2 weights for 1 reward_funcs"),
           ({"reward_weights": [1.0]}, "needs train.reward_funcs"),
           ({"reward_funcs": [{"model": "m", "function": "a:b"}]}, "exactly one of 'model'"),
           ({"reward_funcs": [{"function": "test_reward_sources:nope"}]}, "has no 'nope'"),
           ({"reward_funcs": [{"model": "a/rm"}, {"model": "b/rm"}]}, "names must be distinct")]
    for train, message in bad:
        with pytest.raises(ValidationError, match=message):
            Params.model_validate({"trust": TRUSTED, "train": train})


def test_the_stage_builds_one_weighted_scorer_from_the_sources(tmp_path, tokenizer, tiny_config):
    paths, runtime = Paths.at(tmp_path), Runtime(RuntimeConfig(device="cpu"))
    save_model(init_sequence_scorer(tiny_config, seed=1), tokenizer, paths.reward_model)
    default = Params.model_validate({})
    assert isinstance(build_scorer(default, paths, runtime, tokenizer), RewardModelScorer)
    assert reward_models(default, paths) == [str(paths.reward_model)]
    params = Params.model_validate({"trust": TRUSTED, "train": {
        "reward_funcs": [{"model": str(paths.reward_model), "name": "rm"}, {"function": "test_reward_sources:words"}],
        "reward_weights": [1.0, 0.5]}})
    scorer = build_scorer(params, paths, runtime, tokenizer)
    assert isinstance(scorer, WeightedScorer) and scorer.names == ["rm", "words"]
    assert [w for w, _ in scorer.terms] == [1.0, 0.5]
    assert reward_models(params, paths) == [str(paths.reward_model)]
    assert not any(p.requires_grad for p in scorer.terms[0][1].model.parameters())
    assert torch.is_tensor(scorer.terms[0][1].model.score.weight)
