"""TRL recipes move in (#31 item 4): TRL's current names as aliases of ours, and `rlhf from-trl`."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from rlhf_core.config import PeftOptions, RLConfig
from tasks.parameters.params import ParamsError, load_params

REPO = Path(__file__).resolve().parent.parent

# -- aliases ---------------------------------------------------------------------------------------------------------

ALIASES = [  # (TRL's or PEFT's name, ours inside train, a valid value other than params.yaml's)
    ("beta", "kl_coef", 0.07),
    ("epsilon", "cliprange", 0.3),
    ("num_generations", "rloo.rloo_k", 4),
    ("max_completion_length", "response_length", 17),
    ("r", "lora_r", 4),
    ("target_modules", "lora_target_modules", ["query_key_value"]),
    ("modules_to_save", "lora_modules_to_save", ["embed_out"]),
    ("task_type", "lora_task_type", "CAUSAL_LM"),
]


@pytest.fixture
def params_dir(tmp_path):
    """A workspace with the repository's params.yaml (the demo's train section sets kl_coef, rloo.rloo_k...)."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "profiles").mkdir()
    return tmp_path


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


@pytest.mark.parametrize(("alias", "ours", "value"), ALIASES, ids=[a for a, *_ in ALIASES])
def test_an_alias_sets_our_key_from_the_command_line_and_from_a_profile(params_dir, alias, ours, value):
    by_ours = load_params(params_dir, overrides=[f"train.{ours}={_yaml_value(value)}"])
    by_alias = load_params(params_dir, overrides=[f"train.{alias}={_yaml_value(value)}"])
    assert by_alias == by_ours, "the alias over params.yaml's key gives the same params as our key"
    (params_dir / "profiles" / "trl.yaml").write_text(yaml.safe_dump({"train": {alias: value}}))
    assert load_params(params_dir, "trl").train == by_ours.train
    dumped = by_alias.train.model_dump()
    assert alias not in dumped and alias not in by_alias.rl_config().model_dump(), "the rest sees our names only"


def test_the_library_configs_take_the_aliases_directly():
    cfg = RLConfig(algo="rloo", beta=0.1, epsilon=0.25, num_generations=3, max_completion_length=9,
                   per_device_train_batch_size=6)
    assert (cfg.kl_coef, cfg.cliprange, cfg.rloo.rloo_k, cfg.response_length) == (0.1, 0.25, 3, 9)
    peft = PeftOptions(use_peft=True, r=4, target_modules="all-linear", modules_to_save=["embed_out"])
    assert (peft.lora_r, peft.lora_target_modules, peft.lora_modules_to_save) == (4, "all-linear", ["embed_out"])


@pytest.mark.parametrize(("alias", "ours", "value"), ALIASES, ids=[a for a, *_ in ALIASES])
def test_both_names_of_one_setting_are_refused_naming_both(params_dir, alias, ours, value):
    both = [f"train.{alias}={_yaml_value(value)}", f"train.{ours}={_yaml_value(value)}"]
    with pytest.raises(ParamsError) as err:
        load_params(params_dir, overrides=both)
    assert f"{alias} and {ours} are one setting" in str(err.value)
    both_names = {"train": {alias: value, **_nested(ours, value)}}
    (params_dir / "profiles" / "both.yaml").write_text(yaml.safe_dump(both_names))
    with pytest.raises(ParamsError, match=f"{alias} and {ours} are one setting"):
        load_params(params_dir, "both")


def _nested(key: str, value) -> dict:
    *parents, last = key.split(".")
    out = {last: value}
    for part in reversed(parents):
        out = {part: out}
    return out


@pytest.mark.parametrize(("item", "written"), [
    ("train.beta=-0.5", "beta=-0.5: Input should be greater than or equal to 0"),
    ("train.epsilon=wide", "epsilon='wide': Input should be a valid number"),
    ("train.num_generations=1", "num_generations=1: Input should be greater than or equal to 2"),
    ("train.max_completion_length=0", "max_completion_length=0: Input should be greater than 0"),
    ("train.r=0", "r=0: Input should be greater than 0"),
])
def test_a_bad_value_is_reported_under_the_name_written(params_dir, item, written):
    with pytest.raises(ParamsError) as err:
        load_params(params_dir, overrides=[item])
    assert f"train: {written}" in str(err.value), str(err.value)


def test_a_mistyped_alias_is_suggested(params_dir):
    with pytest.raises(ParamsError, match="did you mean 'train.beta'"):
        load_params(params_dir, overrides=["train.betta=0.1"])


@pytest.mark.parametrize("profile", [None, "trl"])
def test_rlhf_run_writes_an_alias_override_onto_our_key_in_params_yaml(params_dir, profile):
    """`rlhf run --set train.beta=0.1` edits params.yaml for the run: the stages then read kl_coef 0.1 (with both
    names in the file, every stage would refuse to start)."""
    from flows.overrides import edited_yaml, planned_changes

    if profile:  # a profile written with TRL's names, under the run's override of another of its keys
        trl_profile = {"train": {"beta": 0.2, "num_generations": 4}}
        (params_dir / "profiles" / "trl.yaml").write_text(yaml.safe_dump(trl_profile))
    committed = load_params(params_dir).train.kl_coef
    changes = planned_changes(params_dir, profile or "demo", ["train.beta=0.1"])
    assert ("train.kl_coef", committed, 0.1) in changes and not [key for key, *_ in changes if "beta" in key]
    original = (params_dir / "params.yaml").read_text()
    (params_dir / "params.yaml").write_text(edited_yaml(original, {key: new for key, _, new in changes}))
    stage_view = load_params(params_dir)  # what a stage reads: params.yaml, then the run's profile
    assert stage_view.train.kl_coef == 0.1
    assert stage_view.train.rloo.rloo_k == (4 if profile else 2)


# -- rlhf from-trl -----------------------------------------------------------------------------------------------------
# TRL's values below come from TRL 1.9.0's own formulas, written out here apart from the converter:
# PPO (trl/experimental/ppo/ppo_trainer.py, PPOTrainer.__init__): local_batch_size = P * G; batch_size =
# local_batch_size * world_size; mini_batch_size = batch_size / num_mini_batches; num_total_batches =
# ceil(total_episodes / batch_size); the scheduler is built for num_total_batches steps and stepped once per update.
# RLOO (trl/trainer/rloo_config.py __post_init__, rloo_trainer.py RepeatSampler / _prepare_inputs, and the Trainer):
# steps_per_generation S defaults to G; generation_batch_size = P * world_size * S; one generation serves
# num_iterations * S micro-batches; the optimizer steps every G micro-batches; max_steps = ceil(num_train_epochs *
# (generations per epoch * num_iterations * S // G)) with generations per epoch = rows // (generation_batch_size / k).

RECIPES = Path(__file__).resolve().parent / "trl_recipes"
ZERO2, ZERO3 = REPO / "infra/accelerate/deepspeed_zero2.yaml", REPO / "infra/accelerate/deepspeed_zero3.yaml"


def from_trl(workspace: Path, recipe: Path, *options: str):
    """`rlhf from-trl RECIPE --out profiles/NAME.yaml ...` in `workspace`; (result, params of the profile)."""
    from typer.testing import CliRunner

    from cli.main import app

    out = workspace / "profiles" / f"{recipe.stem}.yaml"
    result = CliRunner().invoke(app, ["from-trl", str(recipe), "--out", str(out), *options])
    assert result.exit_code == 0, result.output
    return result, load_params(workspace, recipe.stem)


def _our_plan(params):
    from rlhf_core.config import BatchPlan

    return BatchPlan.derive(params.rl_config(), params.runtime.num_processes)


def _rates(kind: str, warmup: int, total: int, steps: int, lr: float = 1.0) -> list[float]:
    """The learning rate of each of `steps` steps of transformers' scheduler `kind` (TRL's and ours both use it)."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def _our_rates(params) -> list[float]:
    plan, train = _our_plan(params), params.train
    return _rates(train.lr_scheduler, int(train.warmup_ratio * plan.num_optimizer_steps), plan.num_optimizer_steps,
                  plan.num_optimizer_steps)


@pytest.mark.parametrize("warmup", [None, 0.1])
def test_ppo_tldr_keeps_trls_batches_steps_and_schedule(params_dir, warmup):
    recipe = yaml.safe_load((RECIPES / "ppo_tldr.yaml").read_text())
    if warmup:  # transformers 5: a warmup_steps below 1 is the share of the scheduler's steps (TRL PPO: updates)
        recipe["warmup_steps"] = warmup
        (params_dir / "ppo_tldr.yaml").write_text(yaml.safe_dump(recipe))
    path = params_dir / "ppo_tldr.yaml" if warmup else RECIPES / "ppo_tldr.yaml"
    result, params = from_trl(params_dir, path, "--accelerate-config", str(ZERO2))
    world = 8  # deepspeed_zero2.yaml's num_processes (TRL's and ours)
    P, G, M, epochs = recipe["per_device_train_batch_size"], recipe["gradient_accumulation_steps"], 1, 4
    batch_size = P * G * world
    mini_batch_size = batch_size // M
    num_total_batches = math.ceil(recipe["total_episodes"] / batch_size)

    plan = _our_plan(params)
    assert plan.batch_size == batch_size == 512
    assert plan.local_mini_batch_size * plan.num_processes == mini_batch_size
    assert plan.num_updates == num_total_batches == 1954
    assert plan.num_optimizer_steps == num_total_batches * epochs * M, "PPO epochs x mini-batches per update"
    # TRL's schedule steps once per update over num_total_batches; ours once per optimizer step: equal at the first
    # optimizer step of every update, and (linear) lower inside it
    trl_warmup = math.ceil(num_total_batches * warmup) if warmup else 0
    trl = _rates("linear", trl_warmup, num_total_batches, num_total_batches)
    ours = _our_rates(params)
    steps = epochs * M
    assert [ours[u * steps] for u in range(num_total_batches)] == pytest.approx(trl, rel=1e-12, abs=1e-15)
    assert all(ours[u * steps + steps - 1] < trl[u] for u in range(trl_warmup, num_total_batches - 1))
    train = params.train
    assert (train.learning_rate, train.kl_coef, train.response_length, train.temperature) == (3e-6, 0.05, 53, 0.7)
    assert (train.missing_eos_penalty, train.stop_token, train.local_rollout_forward_batch_size) == (1.0, "eos", 16)
    assert (params.sft.pretrained, params.reward_model.pretrained, params.prepare.prompts) == (
        recipe["sft_model_path"], recipe["reward_model_path"], "trl-lib/tldr")
    assert train.adam_eps == 1e-8 and params.runtime.mixed_precision == "bf16"
    assert train.max_grad_norm == 1.0, "under DeepSpeed accelerate fills gradient_clipping 'auto' with 1.0"
    text = " ".join(result.output.split())
    for difference in ("gradient clipping:", "learning-rate schedule:", "Adam epsilon:", "where the score lands:"):
        assert difference in text, difference
    assert "train.adam_eps: 1e-08 (set)" in text and "train.max_grad_norm: 1.0 (set)" in text
    assert "constant within an update | steps once per optimizer step" in text
    assert text.count("no key of ours reproduces it") >= 2  # the schedule, the score's position


def test_ppo_on_a_plain_launch_never_clips(params_dir):
    result, params = from_trl(params_dir, RECIPES / "ppo_tldr.yaml", "--num-processes", "8")
    assert params.train.max_grad_norm is None and params.runtime.mixed_precision == "no"
    assert _our_plan(params).batch_size == 512
    assert "without clipping" in " ".join(result.output.split())


@pytest.mark.parametrize("warmup", [None, 5])
def test_rloo_recipe_keeps_trls_generation_steps_and_schedule(params_dir, warmup):
    recipe = yaml.safe_load((RECIPES / "rloo.yaml").read_text())
    path = RECIPES / "rloo.yaml"
    if warmup:
        recipe["warmup_steps"] = warmup
        path = params_dir / "rloo.yaml"
        path.write_text(yaml.safe_dump(recipe))
    rows, world = 3622, 8  # train[:5%] of NuminaMath-TIR; deepspeed_zero3.yaml's processes
    result, params = from_trl(params_dir, path, "--algo", "rloo", "--accelerate-config", str(ZERO3), "--train-rows",
                              str(rows))
    P, G = 8, recipe["gradient_accumulation_steps"]  # P: TrainingArguments' default
    S, iterations, k, epochs = recipe["steps_per_generation"], 1, 2, 3.0
    generation_batch_size = P * world * S
    step_batch = P * world * G
    generations_per_epoch = rows // (generation_batch_size // k)
    max_steps = math.ceil(epochs * (generations_per_epoch * iterations * S // G))

    plan = _our_plan(params)
    assert plan.batch_size == generation_batch_size == 512, "one rollout batch is one generation"
    assert plan.local_mini_batch_size * plan.num_processes == step_batch == 128
    assert plan.num_optimizer_steps // plan.num_updates == iterations * S // G == 4
    assert plan.num_optimizer_steps == max_steps == 168
    assert params.train.rloo.rloo_k == k and params.train.algo == "rloo" and params.train.num_epochs == iterations
    # the Trainer steps the scheduler per optimizer step over max_steps, as ours does over its optimizer steps
    trl_warmup = warmup or 0
    assert _our_rates(params) == pytest.approx(_rates("linear", trl_warmup, max_steps, max_steps), rel=1e-12,
                                               abs=1e-15)
    train = params.train
    assert (train.learning_rate, train.response_length, train.temperature, train.kl_coef) == (1e-5, 1024, 1.0, 0.05)
    assert (train.missing_eos_penalty, train.max_grad_norm, train.adam_eps) == (None, 1.0, 1e-8)
    assert (train.use_peft, train.lora_r, train.lora_alpha, train.lora_dropout) == (True, 8, 8, 0.0)
    assert params.sft.pretrained == "Qwen/Qwen3-0.6B" and params.runtime.mixed_precision == "bf16"
    text = " ".join(result.output.split())
    assert "RLOO advantage std eps: (A - mean) / (std + 1e-4)" in text and "(std + 1e-8)" in text
    assert "reward_funcs=['think_format_reward', 'accuracy_reward']" in text, "a dropped reward is a warning"
    assert "model_init_kwargs=" in text and "use_vllm" in text


def test_without_out_the_profile_is_printed_with_the_report_as_comments(params_dir, monkeypatch):
    from typer.testing import CliRunner

    from cli.main import app

    monkeypatch.chdir(params_dir)
    printed = CliRunner().invoke(app, ["from-trl", str(RECIPES / "ppo_tldr.yaml"), "--num-processes", "8"])
    assert printed.exit_code == 0, printed.output
    assert all(line.startswith("#") for line in printed.output.splitlines()[:5])
    (params_dir / "profiles" / "ppo_tldr.yaml").write_text(printed.output)
    assert load_params(params_dir, "ppo_tldr").train.total_episodes == 1_000_000
    again = CliRunner().invoke(app, ["from-trl", str(RECIPES / "ppo_tldr.yaml"), "--out", "profiles/ppo_tldr.yaml"])
    assert again.exit_code == 2 and "--force" in again.output, "an existing profile is not overwritten silently"


def test_a_recipe_sized_in_epochs_needs_the_train_rows(params_dir):
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["from-trl", str(RECIPES / "rloo.yaml"), "--algo", "rloo"])
    assert result.exit_code == 2 and "--train-rows" in result.output, result.output


@pytest.mark.parametrize(("P", "G", "M"), [(16, 4, 1), (16, 4, 2), (8, 4, 4), (64, 1, 4), (4, 2, 4), (16, 3, 2)])
def test_trl_ppo_mini_batches_as_accelerate_steps_them(params_dir, P, G, M):
    """TRL PPO's update loop (ppo_trainer.py: for each epoch, each mini-batch of P*G/M, micro-batches of P inside
    `accelerator.accumulate(model)`, `optimizer.step()` after each), run with a real Accelerator: the optimizer steps
    every G micro-batches across mini-batches. The converted profile takes the same steps of the same episodes."""
    import torch
    from accelerate import Accelerator

    from tasks.from_trl.recipe import convert

    epochs, updates = 2, 2
    accelerator = Accelerator(gradient_accumulation_steps=G, cpu=True)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = accelerator.prepare(torch.optim.SGD([weight], lr=1.0))
    local_mini = P * G // M
    steps, pending = [], 0  # episodes per optimizer step
    for _ in range(updates):
        for _ in range(epochs):
            for _ in range(0, P * G, local_mini):
                for start in range(0, local_mini, P):
                    with accelerator.accumulate(weight):
                        before = weight.detach().clone()
                        size = min(P, local_mini - start)
                        accelerator.backward(weight.sum() * size)
                        optimizer.step()
                        optimizer.zero_grad()
                        pending += size
                        if not torch.equal(before, weight.detach()):
                            steps.append(pending)
                            pending = 0
    recipe = {"per_device_train_batch_size": P, "gradient_accumulation_steps": G, "num_mini_batches": M,
              "num_ppo_epochs": epochs, "total_episodes": P * G * updates}
    conversion = convert(recipe, algo="ppo")
    train = conversion.profile["train"]
    ours_step = train["per_device_train_batch_size"] * train["gradient_accumulation_steps"]
    if pending or len(set(steps)) != 1 or len(steps) % (updates * epochs):  # steps straddle epochs: not ours
        assert any("no split of ours reproduces them" in item for item in conversion.unsupported)
        return
    assert not conversion.unsupported
    assert steps == [ours_step] * (updates * epochs * train["num_mini_batches"]), (steps, train)
    assert ours_step * train["num_mini_batches"] == P * G, "the same episodes per update"


def test_every_key_of_the_recipe_is_accounted_for(params_dir):
    from tasks.from_trl.recipe import convert, report_lines

    recipe = {**yaml.safe_load((RECIPES / "ppo_tldr.yaml").read_text()),
              "adam_beta1": 0.8, "stop_token_id": 7, "neftune_noise_alpha": 5.0,  # change training, no equivalent
              "adam_beta2": 0.999,  # TRL's default: nothing changes
              "report_to": "wandb", "num_sample_generations": 3,  # bookkeeping
              "num_generations": 4, "made_up_field": 1,  # RLOO-only in a PPO config, and unknown anywhere
              "use_peft": True, "lora_target_modules": ["query_key_value"]}  # lora_dropout: TRL's 0.05
    conversion = convert(recipe, algo="ppo")
    text = "\n".join(report_lines(conversion))
    for key in recipe:
        assert key in text, f"{key} is reported"
    assert {u.split("=")[0] for u in conversion.unsupported} == {"adam_beta1", "stop_token_id", "neftune_noise_alpha"}
    assert set(conversion.unknown) == {"num_generations", "made_up_field"}
    assert {"report_to", "num_sample_generations", "adam_beta2 (TRL's default)"} <= set(conversion.bookkeeping)
    assert conversion.profile["train"]["lora_dropout"] == 0.0
    assert any(d.what == "LoRA dropout" and "0.05" in d.trl for d in conversion.differences)


def _trl_parse(recipe: Path):
    """The recipe as TRL 1.9.0's own parser reads it (TrlParser `--config`; bf16 off: this CPU has no bf16 GPU)."""
    pytest.importorskip("trl", minversion="1.9.0")  # a dev dependency (bench/vs_trl.py's peer)
    from trl import ModelConfig, ScriptArguments, TrlParser
    from trl.experimental.ppo import PPOConfig
    from trl.scripts.rloo import make_parser

    parser = TrlParser((ScriptArguments, PPOConfig, ModelConfig)) if recipe.stem.startswith("ppo") else make_parser()
    return parser.parse_args_and_config(args=["--config", str(recipe), "--bf16", "false"])


def test_the_recipes_are_what_trls_parser_reads_and_rloos_derived_sizes_agree(params_dir, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    _, ppo, ppo_model = _trl_parse(RECIPES / "ppo_tldr.yaml")  # TrlParser refuses a field it does not know
    assert (ppo.per_device_train_batch_size, ppo.gradient_accumulation_steps, ppo.num_mini_batches) == (16, 4, 1)
    assert ppo_model.model_name_or_path == "EleutherAI/pythia-1b-deduped"
    _, rloo, _, _ = _trl_parse(RECIPES / "rloo.yaml")
    # RLOOConfig derives its generation batch itself (one process here): the converted profile agrees
    _, params = from_trl(params_dir, RECIPES / "rloo.yaml", "--algo", "rloo", "--num-processes", str(rloo.world_size),
                         "--train-rows", "3622")
    plan = _our_plan(params)
    assert plan.batch_size == rloo.generation_batch_size == 64
    assert params.train.num_mini_batches == rloo.steps_per_generation // rloo.gradient_accumulation_steps
    assert plan.local_mini_batch_size == rloo.per_device_train_batch_size * rloo.gradient_accumulation_steps
    assert params.train.rloo.rloo_k == rloo.num_generations and params.train.num_epochs == rloo.num_iterations
    assert (params.train.kl_coef, params.train.cliprange, params.train.response_length) == (
        rloo.beta, rloo.epsilon, rloo.max_completion_length)


def test_the_default_tables_are_trl_1_9s():
    """Every default the converter assumes is TRL 1.9.0's dataclass default (TRL is a dev dependency)."""
    trl = pytest.importorskip("trl")  # a dev dependency (bench/vs_trl.py's peer)
    if trl.__version__ != "1.9.0":
        pytest.skip(f"TRL {trl.__version__}, not 1.9.0")
    import dataclasses

    from trl import ModelConfig, RLOOConfig
    from trl.experimental.ppo import PPOConfig

    from tasks.from_trl import fields as trl_fields

    def defaults(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    for table, cls in ((trl_fields.PPO_FIELDS, PPOConfig), (trl_fields.RLOO_FIELDS, RLOOConfig),
                       (trl_fields.TRAINING_ARGS, PPOConfig), (trl_fields.MODEL_CONFIG, ModelConfig)):
        real = defaults(cls)
        for key, value in table.items():
            if key in real and key != "learning_rate":  # each trainer overrides TrainingArguments' learning rate
                assert str(real[key]).lower().endswith(str(value).lower()), (cls.__name__, key, real[key], value)
    # every field of the script dataclasses is known: none is reported as unknown to TRL
    from trl import DatasetMixtureConfig
    from trl.scripts.rloo import RLOOScriptArguments

    covered = {*trl_fields.TRAINING_ARGS, *trl_fields.PPO_FIELDS, *trl_fields.RLOO_FIELDS, *trl_fields.MODEL_CONFIG,
               *trl_fields.SCRIPT_ARGS, *trl_fields.BOOKKEEPING}
    for cls in (PPOConfig, RLOOConfig, ModelConfig, RLOOScriptArguments, DatasetMixtureConfig):
        assert not {f.name for f in dataclasses.fields(cls)} - covered, cls.__name__


# -- GRPO: TRL 1.16.0 recipes ----------------------------------------------------------------------------------------
# TRL 1.16.0's GRPO (trl/trainer/grpo_config.py __post_init__, grpo_trainer.py): the generation, sampler and optimizer
# steps are RLOO's above; its own fields (loss_type, scale_rewards, importance_sampling_level, ...) and defaults
# (num_generations 8, beta 0, max_completion_length 512) differ. TRL 1.16 runs in its own venv (`make trl116`).

TRL116_PYTHON = REPO / ".venv-trl116" / "bin" / "python"
GRPO_RECIPES = ("gspo.yaml", "grpo_tldr.yaml")
TRL116_SIDE = '''
import dataclasses, json, sys
from transformers import TrainingArguments
from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
from trl.scripts.grpo import GRPOScriptArguments, make_parser

def defaults(cls):
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

out = {"grpo": defaults(GRPOConfig), "model": defaults(ModelConfig), "script": defaults(GRPOScriptArguments),
       "training_args": sorted(f.name for f in dataclasses.fields(TrainingArguments)),
       "fields": sorted({f.name for cls in (GRPOConfig, ModelConfig, GRPOScriptArguments, DatasetMixtureConfig)
                         for f in dataclasses.fields(cls)}), "parsed": {}}
for recipe in sys.argv[2:]:
    _, args, model, _ = make_parser().parse_args_and_config(args=["--config", recipe, "--bf16", "false"])
    out["parsed"][recipe] = {k: getattr(args, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
        "num_generations", "num_iterations", "beta", "epsilon", "epsilon_high", "max_completion_length", "loss_type",
        "scale_rewards", "importance_sampling_level", "world_size", "learning_rate")}
with open(sys.argv[1], "w") as f:
    json.dump(out, f, default=repr)
'''


@pytest.fixture(scope="module")
def trl116(tmp_path_factory) -> dict:
    """TRL 1.16.0's own view, in its venv (one process, ~10 s of TRL's import): GRPOConfig's, ModelConfig's and the
    grpo script's defaults and field names, and each GRPO recipe as its TrlParser reads it."""
    import json
    import os
    import subprocess

    if not TRL116_PYTHON.exists():
        pytest.fail(f"{TRL116_PYTHON} is missing: `make trl116` builds TRL 1.16.0's venv (make test does)")
    out = tmp_path_factory.mktemp("trl116-recipes") / "out.json"
    done = subprocess.run([str(TRL116_PYTHON), "-c", TRL116_SIDE, str(out),
                           *(str(RECIPES / name) for name in GRPO_RECIPES)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_grpo_default_tables_are_trl_1_16s(trl116):
    from tasks.from_trl import fields as trl_fields

    real = trl116["grpo"]
    for key, value in trl_fields.GRPO_FIELDS.items():
        assert str(real[key]).lower() == str(value).lower(), ("GRPOConfig", key, real[key], value)
    for key, value in trl_fields.TRAINING_ARGS.items():  # GRPOConfig's view of TrainingArguments (transformers 5)
        if key in real and key != "learning_rate":
            assert str(real[key]).lower().endswith(str(value).lower()), ("GRPOConfig", key, real[key], value)
    for key, value in trl_fields.MODEL_CONFIG.items():
        assert str(trl116["model"][key]).lower() == str(value).lower(), ("ModelConfig", key)
    for key in ("reward_model_name_or_path", "reward_funcs", "dataset_name", "dataset_train_split"):
        assert trl116["script"][key] == trl_fields.SCRIPT_ARGS[key], ("GRPOScriptArguments", key)
    covered = {*trl_fields.TRAINING_ARGS, *trl_fields.GRPO_FIELDS, *trl_fields.MODEL_CONFIG, *trl_fields.SCRIPT_ARGS,
               *trl_fields.BOOKKEEPING}
    assert not (set(trl116["fields"]) | set(trl116["training_args"])) - covered, \
        "every field of TRL 1.16's grpo script is known: none would be reported as unknown to TRL"


def test_gspo_recipe_keeps_trls_generation_steps_schedule_and_objective(params_dir, trl116):
    """TRL's GSPO recipe (sequence-level importance sampling, the grpo reduction, beta 0) under ZeRO-3 on 8
    processes: the same generation, optimizer steps and schedule, the GRPO options under train.grpo."""
    rows, world = 3622, 8
    result, params = from_trl(params_dir, RECIPES / "gspo.yaml", "--accelerate-config", str(ZERO3), "--train-rows",
                              str(rows))  # told GRPO by its fields (loss_type, importance_sampling_level)
    trl = trl116["parsed"][str(RECIPES / "gspo.yaml")]  # parsed on one process: scale its generation to 8
    P, G, S, k, iterations = (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"],
                              trl["steps_per_generation"], trl["num_generations"], trl["num_iterations"])
    generation_batch_size = trl["generation_batch_size"] * world
    max_steps = math.ceil(3.0 * (rows // (generation_batch_size // k) * iterations * S // G))
    plan = _our_plan(params)
    assert plan.batch_size == generation_batch_size == 512, "one rollout batch is one generation"
    assert plan.local_mini_batch_size * plan.num_processes == P * world * G == 128
    assert plan.num_optimizer_steps // plan.num_updates == iterations * S // G == 4
    assert plan.num_optimizer_steps == max_steps == 672
    assert _our_rates(params) == pytest.approx(_rates("linear", 0, max_steps, max_steps), rel=1e-12, abs=1e-15)
    train, cfg = params.train, params.rl_config()
    assert (cfg.algo, cfg.grpo.num_generations, cfg.num_epochs) == ("grpo", k, iterations)
    assert (cfg.grpo.importance_sampling_level, cfg.grpo.loss_type, cfg.grpo.scale_rewards) == (
        trl["importance_sampling_level"], trl["loss_type"], trl["scale_rewards"]) == ("sequence", "grpo", "group")
    assert (cfg.cliprange, cfg.epsilon_high, cfg.kl_coef, cfg.response_length) == (
        trl["epsilon"], trl["epsilon_high"], trl["beta"], trl["max_completion_length"])
    assert not cfg.uses_reference, "beta 0: no reference model, as TRL"
    assert (train.learning_rate, train.missing_eos_penalty, train.max_grad_norm, train.adam_eps) == (
        1e-5, None, 1.0, 1e-8)
    assert (train.use_peft, train.lora_target_modules, train.lora_dropout) == (True, ["q_proj", "v_proj"], 0.0)
    text = " ".join(result.output.split())
    assert "TRL 1.16.0 GRPO recipe" in text
    assert "reward_funcs=['think_format_reward', 'accuracy_reward']" in text and "dtype='bfloat16'" in text
    assert "old log-probs (num_iterations 1)" in text and "LoRA dropout: 0.05" in text


def test_dr_grpo_recipe_maps_scale_rewards_false_and_its_kl(params_dir, trl116):
    """Dr. GRPO on TL;DR: TRL's scale_rewards false is 'none'; beta is the k3 KL in the loss (a reference loaded);
    on 4 processes with steps_per_generation 4 = gradient_accumulation_steps: one optimizer step per generation."""
    result, params = from_trl(params_dir, RECIPES / "grpo_tldr.yaml", "--num-processes", "4")
    trl = trl116["parsed"][str(RECIPES / "grpo_tldr.yaml")]
    cfg, plan = params.rl_config(), _our_plan(params)
    assert (cfg.grpo.loss_type, cfg.grpo.scale_rewards, cfg.kl_coef) == (trl["loss_type"], trl["scale_rewards"],
                                                                         trl["beta"]) == ("dr_grpo", "none", 0.04)
    assert cfg.uses_reference and cfg.grpo.num_generations == 4 and cfg.response_length == 53
    assert plan.batch_size == trl["generation_batch_size"] * 4 == 256
    assert plan.num_optimizer_steps == plan.num_updates == 1000, "max_steps: one optimizer step per generation"
    assert (params.sft.pretrained, params.reward_model.pretrained) == (
        "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr", "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr")
    assert (params.base.seed, params.runtime.mixed_precision, cfg.temperature) == (1, "bf16", 0.7)
    assert "normaliser" not in result.output, "dr_grpo divides by a constant: no per-step token count differs"


@pytest.mark.parametrize(("key", "value"), [
    ("loss_type", "sapo"), ("loss_type", "vespo"), ("entropy_coef", 0.01), ("use_adaptive_entropy", True),
    ("multi_objective_aggregation", "normalize_then_sum"), ("off_policy_mask_threshold", 0.5),
    ("sapo_temperature_pos", 2.0),
])
def test_a_grpo_option_we_do_not_implement_fails_naming_the_key(params_dir, key, value):
    from typer.testing import CliRunner

    from cli.main import app

    recipe = {**yaml.safe_load((RECIPES / "grpo_tldr.yaml").read_text()), key: value}
    path = params_dir / "grpo_tldr.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = params_dir / "profiles" / "grpo_tldr.yaml"
    result = CliRunner().invoke(app, ["from-trl", str(path), "--out", str(out)])
    assert result.exit_code == 2 and f"{key}={value!r}" in result.output, result.output
    assert not out.exists(), "no profile training another objective is written"


def test_grpo_options_at_trls_defaults_are_accounted_for(params_dir):
    from tasks.from_trl.recipe import convert, report_lines

    recipe = {**yaml.safe_load((RECIPES / "grpo_tldr.yaml").read_text()), "entropy_coef": 0.0,
              "multi_objective_aggregation": "sum_then_normalize", "vllm_importance_sampling_correction": True,
              "cast_lm_head_to_fp32": True, "max_prompt_length": 512}  # the last: TRL 1.16 has no such field
    conversion = convert(recipe)
    text = "\n".join(report_lines(conversion))
    for key in recipe:
        assert key in text, f"{key} is reported"
    assert {"entropy_coef (TRL's default: nothing to carry over)", "vllm_importance_sampling_correction"} <= \
        set(conversion.bookkeeping)
    assert [u.split("=")[0] for u in conversion.unsupported] == ["cast_lm_head_to_fp32"]
    assert conversion.unknown == ["max_prompt_length"] and "unknown to TRL 1.16.0's GRPOConfig" in text


@pytest.mark.parametrize("algo", [None, "rloo", "grpo"])
def test_fields_rloo_and_grpo_share_need_the_trainer_named(algo):
    """RLOOConfig and GRPOConfig share num_generations, beta, ... with other defaults: never guessed."""
    from tasks.from_trl.recipe import RecipeError, convert

    recipe = {"model_name_or_path": "m", "num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 10}
    if algo is None:
        with pytest.raises(RecipeError, match="pass --algo rloo or --algo grpo"):
            convert(recipe)
        return
    train = convert(recipe, algo=algo).profile["train"]
    k = train["rloo"]["rloo_k"] if algo == "rloo" else train["grpo"]["num_generations"]
    assert (train["algo"], k) == (algo, 4)
    assert (train["kl_coef"], train["response_length"]) == ((0.05, 256) if algo == "rloo" else (0.0, 512)), \
        "each trainer's own defaults (TRL 1.9 RLOOConfig, TRL 1.16 GRPOConfig)"


# -- GRPO with tools (#54): GRPOTrainer's tools / environment_factory, GRPOConfig's max_tool_calling_iterations ------

RECIPE_TOOLS = "trl_recipe_tools"  # a module of real tools, importable while these tests run
RECIPE_TOOLS_SOURCE = '''
def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    return key.upper()


class Counter:
    def reset(self, **row):
        self.count = 0

    def bump(self, by: int) -> int:
        """Add to the count.

        Args:
            by: how much
        """
        self.count += by
        return self.count
'''


@pytest.fixture
def tools_workspace(params_dir, monkeypatch):
    """params_dir whose params.yaml trusts RECIPE_TOOLS (a profile cannot), with the module importable."""
    (params_dir / f"{RECIPE_TOOLS}.py").write_text(RECIPE_TOOLS_SOURCE)
    monkeypatch.syspath_prepend(str(params_dir))
    monkeypatch.chdir(params_dir)  # check_profile validates over the working directory's params.yaml
    yield params_dir
    import sys

    sys.modules.pop(RECIPE_TOOLS, None)


def _trust_tools(workspace: Path) -> None:
    data = yaml.safe_load((workspace / "params.yaml").read_text())
    data.setdefault("trust", {})["tool_modules"] = [RECIPE_TOOLS]
    (workspace / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _recipe_with(workspace: Path, **extra) -> Path:
    recipe = {**yaml.safe_load((RECIPES / "grpo_tldr.yaml").read_text()), **extra}
    path = workspace / "grpo_tools.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_grpo_recipe_with_tools_maps_them_onto_our_keys(tools_workspace):
    """TRL's dotted paths (as its grpo script names reward_funcs) become ours; the iteration cap is carried over, the
    tool timeout is TRL's (none), and the report says what params.yaml must trust."""
    _trust_tools(tools_workspace)
    recipe = _recipe_with(tools_workspace, tools=[f"{RECIPE_TOOLS}.lookup"],
                          environment_factory=f"{RECIPE_TOOLS}.Counter", max_tool_calling_iterations=2)
    result, params = from_trl(tools_workspace, recipe)
    cfg = params.rl_config()
    assert (cfg.tools, cfg.environment_factory) == ([f"{RECIPE_TOOLS}:lookup"], f"{RECIPE_TOOLS}:Counter")
    assert (cfg.max_tool_calling_iterations, cfg.tool_timeout, cfg.uses_tools) == (2, None, True)
    text = " ".join(result.output.split())
    assert f"tools -> train.tools: ['{RECIPE_TOOLS}:lookup']" in text
    assert f"trust.tool_modules: params.yaml must allow {RECIPE_TOOLS}" in text
    assert "a malformed tool call" in text and "train.tool_timeout: null as TRL's" in text


def test_a_recipe_naming_untrusted_tools_is_refused_naming_the_key(tools_workspace):
    from typer.testing import CliRunner

    from cli.main import app

    recipe = _recipe_with(tools_workspace, tools=[f"{RECIPE_TOOLS}.lookup"])
    out = tools_workspace / "profiles" / "grpo_tools.yaml"
    result = CliRunner().invoke(app, ["from-trl", str(recipe), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert f"train.tools[0]: module '{RECIPE_TOOLS}' is not in trust.tool_modules" in " ".join(result.output.split())
    assert not out.exists()


@pytest.mark.parametrize(("extra", "says"), [
    ({"tools": ["lookup"]}, "tools[0]='lookup': expected an import path"),
    ({"environment_factory": 3}, "environment_factory=3: expected an import path"),
])
def test_a_tool_that_is_not_an_import_path_is_refused(extra, says):
    from tasks.from_trl.recipe import RecipeError, convert

    with pytest.raises(RecipeError, match=re.escape(says)):
        convert({**yaml.safe_load((RECIPES / "grpo_tldr.yaml").read_text()), **extra})


def test_tool_options_without_tools_or_outside_grpo_are_reported():
    """max_tool_calling_iterations alone changes nothing in TRL; RLOO and PPO recipes naming tools are warned."""
    from tasks.from_trl.recipe import convert

    grpo = convert({**yaml.safe_load((RECIPES / "grpo_tldr.yaml").read_text()), "max_tool_calling_iterations": 3})
    assert "tools" not in grpo.profile["train"] and "max_tool_calling_iterations" not in grpo.profile["train"]
    assert any(item.startswith("max_tool_calling_iterations (TRL reads it only with tools") for item in grpo.bookkeeping)
    for recipe, algo in (("rloo.yaml", "rloo"), ("ppo_tldr.yaml", "ppo")):
        conversion = convert({**yaml.safe_load((RECIPES / recipe).read_text()), "tools": ["my_lib.tools.lookup"]},
                             algo=algo, train_rows=1024)
        assert "tools" not in conversion.profile["train"] and not conversion.unknown
        assert [u for u in conversion.unsupported if u.startswith(f"tools: TRL's {algo.upper()} trainer takes no")]
