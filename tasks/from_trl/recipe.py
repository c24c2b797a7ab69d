"""`rlhf from-trl`: a TRL 1.9 PPO or RLOO, or TRL 1.16 GRPO, script config turned into a profile, with what still
behaves differently.

A TRL script reads one YAML (`--config`, TRL's `TrlParser`): its top-level keys are the fields of the script's
dataclasses, the trainer's config (`trl.experimental.ppo.PPOConfig` or `trl.RLOOConfig`, both
`transformers.TrainingArguments`; TRL 1.16's `trl.GRPOConfig` for GRPO), `ModelConfig` and `ScriptArguments`, plus an
optional `env` mapping. Every key ends in exactly one of: mapped onto a key of ours, bookkeeping (no effect on the
trained policy here), changes training with no equivalent here (a warning), or unknown to that TRL (a warning). A
GRPO option that changes the objective and is not implemented here (a `loss_type` such as sapo, the entropy bonus,
`multi_objective_aggregation`, ... set away from TRL's default) is an error naming the key, as in params.yaml: the
profile would train another loss. A field the file leaves out takes TRL's default; every mapped key is written into
the profile, so params.yaml's demo values never leak in.

The batch arithmetic, per update, with P = per_device_train_batch_size, G = gradient_accumulation_steps and
W processes (ours: batch = per_device * GA * num_mini_batches * W, rlhf_core/config.py):

- TRL PPO (experimental/ppo/ppo_trainer.py): batch = P*G*W episodes, documented as split into num_mini_batches M
  mini-batches of P*G*W/M. Its loop takes micro-batches of P from each mini-batch inside
  `accelerator.accumulate(model)` and calls `optimizer.step()` after each; accelerate steps the optimizer only
  every G micro-batches, counting across mini-batch boundaries. So the optimizer steps every G micro-batches,
  whatever M (with M dividing G: once per epoch over the whole batch). We reproduce the steps as run.
- TRL 1.9 RLOO (trainer/rloo_trainer.py, GRPO's loop): one generation of B = P*W*S completions
  (S = steps_per_generation, default G; or generation_batch_size B), num_generations k per prompt, used for
  num_iterations passes of S micro-batches; the Trainer steps the optimizer every G micro-batches. Ours: one
  rollout batch = one generation, num_mini_batches = S / G, num_epochs = num_iterations, rloo_k = k.
- TRL 1.16 GRPO (trainer/grpo_trainer.py): the same generation, sampler and optimizer steps as RLOO's, with
  grpo.num_generations = k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhf_core.config import TRL_GRPO_UNSUPPORTED, BatchPlan, GRPOOptions
from tasks.from_trl.fields import (
    BOOKKEEPING,
    GRPO_FIELDS,
    GRPO_TRAINER_ARGS,
    GRPO_TRL_VERSION,
    MODEL_CONFIG,
    PPO_FIELDS,
    RLOO_FIELDS,
    SCRIPT_ARGS,
    TRAINING_ARGS,
    TRL_VERSION,
    UNSUPPORTED_WHY,
)
from tasks.parameters.params import PARAMS_FILE, Params, ParamsError, deep_merge

PPO_ONLY = set(PPO_FIELDS) - set(RLOO_FIELDS) - set(GRPO_FIELDS) - {"temperature"}
RLOO_ONLY = set(RLOO_FIELDS) - set(PPO_FIELDS) - set(GRPO_FIELDS)  # normalize_advantages, reward_clip_range
GRPO_ONLY = set(GRPO_FIELDS) - set(PPO_FIELDS) - set(RLOO_FIELDS)  # loss_type, scale_rewards, delta, ...
RLOO_OR_GRPO = (set(RLOO_FIELDS) & set(GRPO_FIELDS)) - set(PPO_FIELDS)  # num_generations, beta, epsilon, ...
TRAINER_FIELDS = {"ppo": PPO_FIELDS, "rloo": RLOO_FIELDS, "grpo": GRPO_FIELDS}
K_KEY = {"rloo": "train.rloo.rloo_k", "grpo": "train.grpo.num_generations"}
GRPO_LOSS_TYPES = GRPOOptions.model_fields["loss_type"].annotation.__args__  # the ones implemented here
RL_SCHEDULERS = ("linear", "constant", "cosine")  # RLConfig.lr_scheduler


class RecipeError(ValueError):
    """A TRL config that cannot be turned into a profile; the message names the keys."""


@dataclass(frozen=True)
class Difference:
    """A behaviour that differs from TRL's, and the setting that reproduces TRL's (None: no key does)."""

    what: str
    trl: str
    ours: str
    setting: str | None


@dataclass
class Conversion:
    algo: str
    profile: dict
    mapped: list[tuple[str, str, Any]] = field(default_factory=list)  # (TRL key, our dotted key, value)
    differences: list[Difference] = field(default_factory=list)
    bookkeeping: list[str] = field(default_factory=list)  # TRL keys with no effect on the policy here
    unsupported: list[str] = field(default_factory=list)  # "key=value: why", changes training
    unknown: list[str] = field(default_factory=list)  # keys that TRL (1.9; GRPO: 1.16) does not know
    todo: list[str] = field(default_factory=list)  # what the user still sets before `rlhf run`
    derived: dict[str, Any] = field(default_factory=dict)  # TRL's derived sizes and ours, for the report


@dataclass(frozen=True)
class Launch:
    """How the recipe was launched: processes, precision, and whether DeepSpeed ran it (from an accelerate config)."""

    num_processes: int = 1
    mixed_precision: str | None = None  # None: a plain launch (fp32)
    deepspeed: bool = False
    gradient_clipping: float | None = None  # DeepSpeed's, from its config; accelerate fills 'auto' with 1.0
    config_file: str | None = None

    @classmethod
    def from_accelerate_config(cls, path: str | Path, num_processes: int | None = None) -> Launch:
        data = yaml.safe_load(Path(path).read_text()) or {}
        deepspeed = data.get("distributed_type") == "DEEPSPEED"
        clipping = (data.get("deepspeed_config") or {}).get("gradient_clipping", "auto")
        precision = str(data.get("mixed_precision") or "no")
        return cls(num_processes=num_processes or int(data.get("num_processes") or 1),
                   mixed_precision=None if precision == "no" else precision, deepspeed=deepspeed,
                   gradient_clipping=(1.0 if clipping in (None, "auto") else float(clipping)) if deepspeed else None,
                   config_file=str(path))


def read_trl_config(path: str | Path) -> dict:
    """The mapping TrlParser reads from `--config`."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise RecipeError(f"{path}: cannot read the TRL config ({err})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of TRL fields (as `--config` takes), got {type(data).__name__}")
    return data


def detect_algo(config: dict) -> str:
    """The trainer the fields belong to. RLOOConfig and GRPOConfig share most fields (num_generations, beta, ...) but
    not their defaults (k 2 and 8, beta 0.05 and 0): a config with only shared fields is not guessed."""
    only = {algo: sorted(fields & config.keys())
            for algo, fields in (("ppo", PPO_ONLY), ("rloo", RLOO_ONLY), ("grpo", GRPO_ONLY))}
    found = [algo for algo, keys in only.items() if keys]
    if len(found) > 1:
        named = "; ".join(f"{algo.upper()}Config-only: {', '.join(only[algo])}" for algo in found)
        raise RecipeError(f"the config has fields of more than one trainer ({named}); pass --algo "
                          + " or --algo ".join(found))
    if found:
        return found[0]
    shared = sorted(RLOO_OR_GRPO & config.keys())
    if shared:
        raise RecipeError(f"the config's trainer fields ({', '.join(shared)}) are both RLOOConfig's and "
                          "GRPOConfig's, whose defaults differ; pass --algo rloo or --algo grpo (the script it ran: "
                          "trl rloo or trl grpo)")
    raise RecipeError("the config has no PPOConfig-, RLOOConfig- or GRPOConfig-only field to tell the trainer by; "
                      "pass --algo")


def convert(config: dict, *, algo: str | None = None, launch: Launch = Launch(), train_rows: int | None = None,
            name: str = "trl") -> Conversion:
    """The profile (sections of params.yaml) reproducing `config`, and what could not be reproduced."""
    algo = algo or detect_algo(config)
    trainer = TRAINER_FIELDS[algo]
    known = {**TRAINING_ARGS, **MODEL_CONFIG, **SCRIPT_ARGS, **trainer, **(GRPO_TRAINER_ARGS if algo == "grpo" else {})}
    trl = {**known, **{k: v for k, v in config.items() if k in known}}  # TRL's view: its defaults, then the file
    b = _Builder(Conversion(algo=algo, profile={"base": {"profile": name}}), frozenset(config))
    _map_batches(b, trl, launch, train_rows)
    _map_objective(b, trl)
    _map_tools(b, trl)
    _map_optimizer(b, trl, launch)
    _map_models_and_data(b, trl)
    _map_lora(b, trl)
    _sort_leftovers(b, config, known)
    return b.conv


@dataclass
class _Builder:
    """The conversion under way: the profile, and which keys of the file were taken."""

    conv: Conversion
    given: frozenset[str]
    used: set[str] = field(default_factory=set)

    def put(self, key: str, value, *sources: str, why: str = "TRL's behaviour") -> None:
        """Set our dotted `key`, recording the TRL fields it came from (or why, when none)."""
        section, *path = key.split(".")
        node = self.conv.profile.setdefault(section, {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        self.used.update(sources)
        self.conv.mapped.append((", ".join(sources) or f"({why})", key, value))

    def ignore(self, key: str, note: str) -> None:
        """A field TRL itself does not read here: listed as bookkeeping when the file sets it."""
        self.used.add(key)
        if key in self.given:
            self.conv.bookkeeping.append(f"{key} ({note})")


# -- batches -----------------------------------------------------------------------------------------------------

def _map_batches(b: _Builder, trl: dict, launch: Launch, train_rows: int | None) -> None:
    conv, put = b.conv, b.put
    P, G, W = int(trl["per_device_train_batch_size"]), int(trl["gradient_accumulation_steps"]), launch.num_processes
    put("train.algo", conv.algo, why="the trainer")
    put("runtime.num_processes", W, why="the launch")
    if launch.config_file:
        put("runtime.accelerate_config", launch.config_file, why="the launch")
    if conv.algo == "ppo":
        M, epochs = int(trl["num_mini_batches"]), int(trl["num_ppo_epochs"])
        micro, steps_per_epoch, exact = trl_ppo_optimizer_steps(P, G, M)
        per_device, accumulation, mini_batches = micro, G, steps_per_epoch
        if not exact:
            per_device, accumulation, mini_batches = _documented_ppo_split(P, G, M)
            conv.unsupported.append(
                f"per_device_train_batch_size={P}, gradient_accumulation_steps={G}, num_mini_batches={M}: TRL's "
                "optimizer steps straddle mini-batches or epochs here (accelerate steps every G micro-batches); no "
                "split of ours reproduces them, so the documented split is used")
        batch = P * G * W
        conv.derived = {"batch_size": batch, "mini_batch_size (documented)": batch // M,
                        "optimizer steps per update (documented)": epochs * M,
                        "optimizer steps per update (as run)": epochs * steps_per_epoch if exact else None,
                        "optimizer step batch (as run)": micro * G * W if exact else None,
                        "scheduler steps per update": 1}
        if M > 1 and exact and mini_batches != M:
            documented = _documented_ppo_split(P, G, M)
            conv.differences.append(Difference(
                "mini-batches",
                f"documented: {M} mini-batches of {batch // M}; as run, one optimizer step every {G} micro-batches "
                f"of {micro} (accelerate's accumulation counts across mini-batches): {steps_per_epoch} step(s) of "
                f"{micro * G * W} episodes per epoch",
                "num_mini_batches optimizer steps per epoch",
                f"train.num_mini_batches: {mini_batches}, per_device_train_batch_size: {micro} (set: as TRL runs). "
                f"TRL's documented split would be per_device_train_batch_size: {documented[0]}, "
                f"gradient_accumulation_steps: {documented[1]}, num_mini_batches: {M}"))
        total = trl["total_episodes"]
        if total is None:
            total = _rows_times_epochs(trl, train_rows, "total_episodes",
                                       lambda rows: int(float(trl["num_train_epochs"]) * rows))
            b.used.add("num_train_epochs")
        else:
            b.ignore("num_train_epochs", "TRL's PPO reads it only when total_episodes is not set")
        b.ignore("max_steps", "TRL's PPO overwrites it with the number of updates")
        put("train.per_device_train_batch_size", per_device, "per_device_train_batch_size", "num_mini_batches")
        put("train.gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
        put("train.num_mini_batches", mini_batches, "num_mini_batches")
        put("train.num_epochs", epochs, "num_ppo_epochs")
        put("train.total_episodes", int(total), "total_episodes")
        put("train.local_rollout_forward_batch_size",
            _divisor_at_most(per_device * accumulation * mini_batches, int(trl["local_rollout_forward_batch_size"])),
            "local_rollout_forward_batch_size")
        return
    # RLOO and GRPO
    k = int(trl["num_generations"])
    if trl["generation_batch_size"] is not None and trl["steps_per_generation"] is not None:
        raise RecipeError("generation_batch_size and steps_per_generation cannot both be set (TRL refuses it too)")
    if trl["generation_batch_size"] is not None:
        S = _exact(int(trl["generation_batch_size"]), P * W, "generation_batch_size / "
                   "(per_device_train_batch_size * processes)")
    else:
        S = int(trl["steps_per_generation"] or G)
    if S % G:
        raise RecipeError(f"steps_per_generation={S} is not a multiple of gradient_accumulation_steps={G}: TRL's "
                          "optimizer steps would straddle two generations, which no rollout batch of ours reproduces")
    iterations = int(trl["num_iterations"])
    generation = P * W * S
    steps_per_update = iterations * S // G
    conv.derived = {"generation_batch_size": generation, "optimizer step batch": P * W * G,
                    "optimizer steps per generation": steps_per_update}
    max_steps = int(trl["max_steps"])
    if max_steps <= 0:
        max_steps = _rows_times_epochs(trl, train_rows, "max_steps", lambda rows: math.ceil(
            float(trl["num_train_epochs"]) * (rows // (generation // k) * iterations * S // G)))
    conv.derived["max_steps"] = max_steps
    updates = math.ceil(max_steps / steps_per_update)
    if updates * steps_per_update != max_steps:
        conv.unsupported.append(f"max_steps={max_steps}: not a whole number of generations ({steps_per_update} "
                                f"optimizer steps each); TRL stops mid-generation, ours trains {updates} whole ones")
    put("train.per_device_train_batch_size", P, "per_device_train_batch_size")
    put("train.gradient_accumulation_steps", G, "gradient_accumulation_steps")
    put("train.num_mini_batches", S // G, "steps_per_generation", "generation_batch_size")
    put("train.num_epochs", iterations, "num_iterations")
    put(K_KEY[conv.algo], k, "num_generations")
    put("train.total_episodes", updates * generation, "max_steps", "num_train_epochs")
    put("train.local_rollout_forward_batch_size", P * S)  # TRL generates a process's whole share at once


def trl_ppo_optimizer_steps(P: int, G: int, M: int) -> tuple[int, int, bool]:
    """(micro-batch size, optimizer steps per epoch, whether ours can reproduce them) of TRL PPO's update loop, per
    process: each of the M mini-batches of P*G/M episodes is cut into micro-batches of P (the last one shorter),
    and accelerate steps the optimizer every G micro-batches. Reproducible when every micro-batch has one size
    and an epoch is a whole number of optimizer steps."""
    local_mini = _exact(P * G, M, "per_device_train_batch_size * gradient_accumulation_steps / num_mini_batches")
    sizes = [min(P, local_mini - start) for start in range(0, local_mini, P)]
    micro_per_epoch = M * len(sizes)
    return sizes[0], micro_per_epoch // G, len(set(sizes)) == 1 and micro_per_epoch % G == 0


def _documented_ppo_split(P: int, G: int, M: int) -> tuple[int, int, int]:
    """Ours for TRL's documented batches: M optimizer steps per epoch of P*G/M episodes, micro-batches <= P."""
    local_mini = P * G // M
    accumulation = next(a for a in range(math.ceil(local_mini / P), local_mini + 1) if local_mini % a == 0)
    return local_mini // accumulation, accumulation, M


def _rows_times_epochs(trl: dict, train_rows: int | None, what: str, formula) -> int:
    if train_rows is None:
        raise RecipeError(f"the config sets no {what}: TRL derives it from num_train_epochs="
                          f"{trl['num_train_epochs']} and the size of the train split, which this command cannot "
                          "read offline; pass --train-rows N (the rows of the train split after the script's "
                          f"filtering) or set {what} in the config")
    return formula(train_rows)


def _exact(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise RecipeError(f"{what}: {a} is not divisible by {b}")
    return a // b


def _divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of n not above limit (ours needs the rollout forward batch to divide the local batch;
    it bounds memory only)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


# -- objective and sampling --------------------------------------------------------------------------------------

def _map_objective(b: _Builder, trl: dict) -> None:
    conv, put = b.conv, b.put
    put("train.temperature", float(trl["temperature"]), "temperature")
    if conv.algo == "ppo":
        put("train.response_length", int(trl["response_length"]), "response_length")
        put("train.stop_token", trl["stop_token"], "stop_token")
        put("train.missing_eos_penalty", trl["missing_eos_penalty"], "missing_eos_penalty")
        put("train.kl_coef", float(trl["kl_coef"]), "kl_coef")
        put("train.kl_estimator", trl["kl_estimator"], "kl_estimator")
        put("train.cliprange", float(trl["cliprange"]), "cliprange")
        put("train.whiten_advantages", True)  # TRL PPO whitens the advantages (masked_whiten), always
        put("train.ppo.gamma", float(trl["gamma"]), "gamma")
        put("train.ppo.lam", float(trl["lam"]), "lam")
        put("train.ppo.cliprange_value", float(trl["cliprange_value"]), "cliprange_value")
        put("train.ppo.vf_coef", float(trl["vf_coef"]), "vf_coef")
        put("train.ppo.whiten_rewards", bool(trl["whiten_rewards"]), "whiten_rewards")
        conv.differences.append(Difference(
            "where the score lands", "added to the per-token reward one position after the last response token: "
            "the pad after EOS when the response is shorter than response_length (ppo_trainer.py: actual_end = "
            "sequence_lengths_p1)", "on the EOS token (the last token the policy generated)", None))
        conv.differences.append(Difference(
            "loss reduction", "mean of the micro-batches' token means", "the token mean over the mini-batch (the "
            "same when micro-batches hold as many tokens)", None))
        return
    put("train.response_length", int(trl["max_completion_length"]), "max_completion_length")
    put("train.stop_token", "eos")  # TRL's RLOO and GRPO generation stops at the tokenizer's EOS
    put("train.missing_eos_penalty", None)  # TRL's RLOO and GRPO have none
    put("train.kl_coef", float(trl["beta"]), "beta")
    put("train.kl_estimator", "k1")  # RLOO: per-token log ratio, summed per sequence (rloo_trainer.py); GRPO: logged
    put("train.cliprange", float(trl["epsilon"]), "epsilon")
    put("train.epsilon_high", trl["epsilon_high"], "epsilon_high")
    for key in ("top_k", "top_p", "min_p", "repetition_penalty", "mask_truncated_completions", "sync_ref_model",
                "ref_model_mixup_alpha", "ref_model_sync_steps"):
        put(f"train.{key}", trl[key], key)
    if conv.algo == "grpo":
        _map_grpo(b, trl)
    else:
        put("train.rloo.kl_level", "sequence")
        put("train.rloo.normalize_reward", False)  # TRL 1.9's RLOO has no reward normalization
        put("train.rloo.normalize_advantage", bool(trl["normalize_advantages"]), "normalize_advantages")
        conv.differences.append(Difference(
            "RLOO advantage std eps", "(A - mean) / (std + 1e-4) (TRL 1.9)", "(A - mean) / (std + 1e-8)",
            None if trl["normalize_advantages"] else "none needed: normalize_advantages is false, nothing is divided"))
    conv.differences.append(Difference(
        "where the score lands", "the reward model scores the completion decoded without special tokens and "
        f"tokenized again: the last text token, no EOS ({conv.algo}_trainer.py _calculate_rewards)",
        "the reward model scores the EOS token", None))
    if not trl["disable_dropout"]:
        conv.differences.append(Difference(
            "dropout", "kept as the model has it (disable_dropout: false)", "off in every trained model", None))
    if int(trl["num_iterations"]) > 1:
        conv.differences.append(Difference(
            "order within a generation", "one shuffle per generation, reused by every iteration",
            "a fresh shuffle each epoch (num_epochs = num_iterations)", None))


def _map_grpo(b: _Builder, trl: dict) -> None:
    """GRPOConfig's own options (TRL 1.16): those implemented here onto train.grpo, the others refused by name."""
    conv, put = b.conv, b.put
    for key, default in TRL_GRPO_UNSUPPORTED.items():
        if trl[key] != default:
            raise RecipeError(f"{key}={trl[key]!r}: TRL {GRPO_TRL_VERSION} GRPOConfig's option is not implemented "
                              f"here (only its default {default!r}); the profile would train another objective. "
                              "Remove it from the config to convert the rest (docs/trl.md#grpo-trls-grpotrainer)")
        b.ignore(key, "TRL's default: nothing to carry over")
    if trl["loss_type"] not in GRPO_LOSS_TYPES:
        raise RecipeError(f"loss_type={trl['loss_type']!r}: not implemented here (ours: {', '.join(GRPO_LOSS_TYPES)}); "
                          "the profile would train another objective")
    put("train.grpo.loss_type", trl["loss_type"], "loss_type")
    scale = {True: "group", False: "none"}.get(trl["scale_rewards"], trl["scale_rewards"])  # as GRPOConfig reads it
    put("train.grpo.scale_rewards", scale, "scale_rewards")
    for key in ("importance_sampling_level", "delta", "top_entropy_quantile", "use_bias_correction_kl"):
        put(f"train.grpo.{key}", trl[key], key)
    train, runtime = conv.profile["train"], conv.profile["runtime"]
    if trl["loss_type"] in ("dapo", "cispo") and train["num_mini_batches"] > 1:
        conv.differences.append(Difference(
            f"{trl['loss_type']} normaliser", "the generation's loss tokens / optimizer steps per generation "
            "(grpo_trainer.py num_items_in_batch)", "each optimizer step's own loss tokens (equal when "
            "steps_per_generation = gradient_accumulation_steps)", None))
    if trl["top_entropy_quantile"] < 1.0 and runtime["num_processes"] > 1:
        conv.differences.append(Difference(
            "top_entropy_quantile threshold", "the quantile of the micro-batch's tokens gathered over all processes",
            "over each process's micro-batch", None))
    if int(trl["num_iterations"]) == 1:
        conv.differences.append(Difference(
            "old log-probs (num_iterations 1)", "the training forward's own, detached: the ratio is exactly 1",
            "the rollout's, read at sampling (fp32: equal to ~1e-6; under bf16 recomputed)", None))


# -- tools and environments -------------------------------------------------------------------------------------

def _map_tools(b: _Builder, trl: dict) -> None:
    """GRPOTrainer's `tools` and `environment_factory` (TRL 1.16) and GRPOConfig's `max_tool_calling_iterations`
    onto train.*; TRL's RLOO and PPO take no tools, so a recipe of theirs that names some is told what to set."""
    conv, put = b.conv, b.put
    if conv.algo != "grpo":
        for key in sorted(GRPO_TRAINER_ARGS.keys() & b.given):
            b.used.add(key)
            ours = "ours refuses tools with ppo (its value model would run over the tool results)" \
                if conv.algo == "ppo" else f"ours runs them with rloo too: set train.{key} yourself"
            conv.unsupported.append(f"{key}: TRL's {conv.algo.upper()} trainer takes no tools (TRL "
                                    f"{GRPO_TRL_VERSION}'s GRPOTrainer does); {ours}")
        return
    tools = trl["tools"] if isinstance(trl["tools"], list) else [] if trl["tools"] is None else [trl["tools"]]
    tools = [_our_import_path(path, f"tools[{i}]") for i, path in enumerate(tools)]
    factory = trl["environment_factory"] and _our_import_path(trl["environment_factory"], "environment_factory")
    if not tools and not factory:
        b.used.update(GRPO_TRAINER_ARGS)
        b.ignore("max_tool_calling_iterations", "TRL reads it only with tools or an environment_factory")
        return
    put("train.tools", tools, "tools")
    put("train.environment_factory", factory, "environment_factory")
    put("train.max_tool_calling_iterations", trl["max_tool_calling_iterations"], "max_tool_calling_iterations")
    put("train.tool_timeout", None, why="TRL's: a tool call has no time bound")
    modules = sorted({path.partition(":")[0] for path in [*tools, factory] if path})
    conv.todo.append(f"trust.tool_modules: params.yaml must allow {', '.join(modules)} (a profile cannot set trust; "
                     "docs/security.md), else `rlhf run` refuses to import them")
    conv.todo.append("train.tool_timeout: null as TRL's (a tool that hangs, hangs the rollout); set seconds to make "
                     "such a call a failed one, returned to the model")
    conv.differences.append(Difference(
        "a malformed tool call", "one without its type or function name raises KeyError and stops the run "
        "(grpo_trainer.py _tool_call_loop)",
        "a failed call: {'error': ...} returned to the model, counted in tools/failure_frequency", None))
    conv.differences.append(Difference(
        "the chat template", "swapped for TRL's training template where it knows the model (Qwen3, ...)",
        "the tokenizer's own, which must render tools, carry a response_template and be prefix-preserving "
        "(checked when training starts)", None))


def _our_import_path(value, key: str) -> str:
    """'package.module:name' from TRL's dotted path ('package.module.name', as its grpo script names reward_funcs)
    or from ours."""
    module, _, name = value.rpartition(":" if ":" in value else ".") if isinstance(value, str) else ("", "", "")
    if not module or not name.isidentifier():
        raise RecipeError(f"{key}={value!r}: expected an import path, 'package.module.name' (as TRL's grpo script "
                          "names reward_funcs) or 'package.module:name'")
    return f"{module}:{name}"


# -- optimizer, schedule and precision -----------------------------------------------------------------------------

def _map_optimizer(b: _Builder, trl: dict, launch: Launch) -> None:
    conv, put = b.conv, b.put
    put("train.learning_rate", float(trl["learning_rate"]), "learning_rate")
    put("train.weight_decay", float(trl["weight_decay"]), "weight_decay")
    put("train.adam_eps", float(trl["adam_epsilon"]), "adam_epsilon")
    conv.differences.append(Difference("Adam epsilon", f"{trl['adam_epsilon']:g} (adam_epsilon)", "1e-05 by default",
                                       f"train.adam_eps: {trl['adam_epsilon']:g} (set)"))
    if float(trl["weight_decay"]) > 0:
        conv.differences.append(Difference(
            "weight decay", "the Trainer's optimizer leaves biases and LayerNorm weights undecayed",
            "every trained weight is decayed", None))
    scheduler = str(trl["lr_scheduler_type"]).removeprefix("SchedulerType.").lower()
    if scheduler not in RL_SCHEDULERS:
        conv.unsupported.append(f"lr_scheduler_type={scheduler}: ours has {', '.join(RL_SCHEDULERS)}; linear is used")
        scheduler = "linear"
    put("train.lr_scheduler", scheduler, "lr_scheduler_type")
    _map_warmup(b, trl)
    if conv.algo == "ppo":
        b.ignore("max_grad_norm", "TRL's PPO never reads it; see gradient clipping below")
        if launch.deepspeed:
            clip = launch.gradient_clipping
            trl_clip = f"{clip} (a DeepSpeed launch: accelerate fills DeepSpeed's gradient_clipping 'auto' with 1.0)"
        else:
            clip, trl_clip = None, "none: its PPO loop calls optimizer.step() without clipping (max_grad_norm unused)"
        put("train.max_grad_norm", clip, why="the launch")
        conv.differences.append(Difference("gradient clipping", trl_clip, "clip at 1.0 by default",
                                           f"train.max_grad_norm: {_yaml_scalar(clip)} (set)"))
        conv.differences.append(Difference(
            "learning-rate schedule", "steps once per update (num_training_steps = the number of updates): the rate "
            "is constant within an update", "steps once per optimizer step over all of them: equal to TRL's at the "
            f"first step of every update, lower within it{_within_update_drop(conv)}", None))
        precision = launch.mixed_precision or "no"
        put("runtime.mixed_precision", precision, why="the launch")
        for key in ("bf16", "fp16"):
            b.ignore(key, "TRL's PPO ignores it: the launch sets the precision; see precision below")
        conv.differences.append(Difference(
            "precision", "TRL's PPO builds its own Accelerator and ignores bf16/fp16 in its config: the launch decides "
            f"({'the accelerate config: ' + precision if launch.config_file else 'a plain launch: fp32'})",
            "the autocast of runtime.mixed_precision", f"runtime.mixed_precision: {precision} (set)"))
    else:
        clip = float(trl["max_grad_norm"] or 0) or None  # the Trainer clips when max_grad_norm > 0
        put("train.max_grad_norm", clip, "max_grad_norm")
        precision = "fp16" if trl["fp16"] else "bf16" if trl["bf16"] in (None, True) else "no"
        put("runtime.mixed_precision", precision, "bf16", "fp16")
    put("runtime.gradient_checkpointing", bool(trl["gradient_checkpointing"]), "gradient_checkpointing")
    if trl["use_cpu"]:
        put("runtime.device", "cpu", "use_cpu")
    put("base.seed", int(trl["seed"]), "seed")
    if str(trl["optim"]).removeprefix("OptimizerNames.").lower() in ("adamw_torch", "adamw_torch_fused"):
        b.ignore("optim", "torch's AdamW, as ours")


def _within_update_drop(conv: Conversion) -> str:
    """How far our linear schedule falls within one update, as a share of the peak rate."""
    train = conv.profile["train"]
    if train["lr_scheduler"] != "linear":
        return ""
    plan = _our_plan(conv)
    steps = plan.num_optimizer_steps // plan.num_updates
    decay = plan.num_optimizer_steps - int(train["warmup_ratio"] * plan.num_optimizer_steps)
    return f" (by up to {(steps - 1) / decay:.3%} of the peak rate: {steps} steps per update of {decay} decaying)"


def _map_warmup(b: _Builder, trl: dict) -> None:
    """TRL counts warmup in scheduler steps (PPO: updates; RLOO: optimizer steps): warmup_steps >= 1 as is, below 1
    (or transformers 4's warmup_ratio) as ceil(ratio * steps). Ours: int(warmup_ratio * optimizer steps), set here to
    the same share of the run."""
    steps, ratio = float(trl["warmup_steps"] or 0), float(trl["warmup_ratio"] or 0)
    if steps and ratio:
        raise RecipeError("warmup_steps and warmup_ratio are both set; give one (transformers 5 reads a "
                          "warmup_steps below 1 as the ratio)")
    value = 0.0
    if steps or ratio:
        plan = _our_plan(b.conv)
        units = plan.num_updates if b.conv.algo == "ppo" else plan.num_optimizer_steps  # TRL's scheduler steps
        warmup = int(steps) if steps >= 1 else math.ceil(units * (steps or ratio))
        ours = plan.num_optimizer_steps * warmup // units
        value = ours / plan.num_optimizer_steps
        while int(value * plan.num_optimizer_steps) < ours:  # float rounding must not lose the last warmup step
            value = math.nextafter(value, 1.0)
    b.put("train.warmup_ratio", value, "warmup_steps", "warmup_ratio")


def _our_plan(conv: Conversion) -> BatchPlan:
    from rlhf_core.config import RLConfig

    train = conv.profile["train"]
    fields = {k: v for k, v in train.items() if k in ("algo", "total_episodes", "per_device_train_batch_size",
                                                      "gradient_accumulation_steps", "num_mini_batches", "num_epochs",
                                                      "local_rollout_forward_batch_size", "rloo", "grpo")}
    return BatchPlan.derive(RLConfig(**fields), conv.profile["runtime"]["num_processes"])


# -- models, data, LoRA ------------------------------------------------------------------------------------------

def _map_models_and_data(b: _Builder, trl: dict) -> None:
    conv, put = b.conv, b.put
    model = trl["model_name_or_path"]
    if conv.algo == "ppo":  # ppo_tldr.py: tokenizer from model_name_or_path, policy from sft_model_path
        if model:
            put("prepare.tokenizer", model, "model_name_or_path")
        put("sft.pretrained", trl["sft_model_path"], "sft_model_path")
        put("reward_model.pretrained", trl["reward_model_path"], "reward_model_path")
        put("train.value_model_init", "reward")  # ppo_tldr.py loads the value model from reward_model_path
    else:  # trl/scripts/rloo.py and grpo.py: the policy and its tokenizer from model_name_or_path
        if not model:
            raise RecipeError(f"model_name_or_path is not set: TRL's {conv.algo.upper()} script trains that model")
        put("sft.pretrained", model, "model_name_or_path")
        put("prepare.tokenizer", model)
        if trl["reward_model_name_or_path"]:
            put("reward_model.pretrained", trl["reward_model_name_or_path"], "reward_model_name_or_path")
        else:
            conv.todo.append("reward_model.pretrained: the config names no reward_model_name_or_path; the pipeline "
                             "trains a reward model unless you name one")
        if trl["chat_template_kwargs"]:
            put("prepare.chat_template_kwargs", dict(trl["chat_template_kwargs"]), "chat_template_kwargs")
        b.used.add("chat_template_kwargs")
    if trl["dataset_name"]:
        put("prepare.source", "hub")
        put("prepare.prompts", trl["dataset_name"], "dataset_name")
        conv.todo.append(f"prepare.sft and prepare.preferences: the pipeline also validates and inspects on SFT rows "
                         f"and preference pairs (e.g. trl-lib/tldr and trl-lib/tldr-preference for TL;DR); "
                         f"`rlhf run` refuses until both are set (prompts come from {trl['dataset_name']})")
    if trl["attn_implementation"] in ("sdpa", "eager", "flash_attention_2"):
        put("runtime.attn_implementation", trl["attn_implementation"], "attn_implementation")
    elif trl["attn_implementation"] is not None:
        conv.unsupported.append(f"attn_implementation={trl['attn_implementation']}: ours has sdpa, eager, "
                                "flash_attention_2")
    b.used.add("attn_implementation")


def _map_lora(b: _Builder, trl: dict) -> None:
    put = b.put
    lora = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "lora_task_type",
            "use_rslora")
    put("train.use_peft", bool(trl["use_peft"]), "use_peft")
    if not trl["use_peft"]:
        for key in lora:  # get_peft_config returns None: TRL reads none of them
            b.ignore(key, "use_peft is false: TRL reads no LoRA field")
        return
    for key in ("lora_r", "lora_alpha", "lora_target_modules", "lora_modules_to_save", "lora_task_type", "use_rslora"):
        put(f"train.{key}", trl[key], key)
    put("train.lora_dropout", 0.0, "lora_dropout")
    if trl["lora_dropout"]:
        b.conv.differences.append(Difference(
            "LoRA dropout", f"{trl['lora_dropout']} (lora_dropout)", "0: rollout and training log-probs must agree",
            None))


def _sort_leftovers(b: _Builder, config: dict, known: dict) -> None:
    """Every key of the file that no mapping took: bookkeeping, unsupported (changes training) or unknown."""
    conv = b.conv
    for key, value in config.items():
        if key in b.used:
            continue
        if key == "env":
            conv.bookkeeping.append("env (environment variables TrlParser sets: set them in your shell)")
        elif key in BOOKKEEPING:
            conv.bookkeeping.append(key)
        elif key not in known:
            conv.unknown.append(key)
        elif value != known[key]:
            conv.unsupported.append(f"{key}={value!r}: {UNSUPPORTED_WHY.get(key, 'no equivalent here')}")
        else:
            conv.bookkeeping.append(f"{key} (TRL's default)")


# -- output ------------------------------------------------------------------------------------------------------

def check_profile(conv: Conversion, root: str | Path = ".") -> BatchPlan:
    """Validate the profile over `root`'s params.yaml as `rlhf run --profile` will; the batch plan it gives."""
    path = Path(root) / PARAMS_FILE
    base = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    try:
        params = Params.model_validate(deep_merge(base, conv.profile))
        return BatchPlan.derive(params.rl_config(), params.runtime.num_processes)
    except ValueError as err:  # pydantic's ValidationError and BatchPlan's exact divisions
        raise ParamsError(f"the converted profile does not validate: {err}") from err


def report_lines(conv: Conversion, plan: BatchPlan | None = None) -> list[str]:
    version = GRPO_TRL_VERSION if conv.algo == "grpo" else TRL_VERSION
    lines = [f"TRL {version} {conv.algo.upper()} recipe -> profile {conv.profile['base']['profile']!r}", "",
             "mapped (TRL field -> ours):"]
    lines += [f"  {source} -> {key}: {_yaml_scalar(value)}" for source, key, value in conv.mapped]
    if conv.derived or plan:
        lines += ["", "batches per update:"]
        lines += [f"  TRL {key}: {value}" for key, value in conv.derived.items() if value is not None]
        if plan:
            step_batch = plan.local_mini_batch_size * plan.num_processes
            lines += [f"  ours batch_size: {plan.batch_size} episodes, optimizer steps per update: "
                      f"{plan.num_optimizer_steps // plan.num_updates} of {step_batch} episodes, updates: "
                      f"{plan.num_updates}, optimizer steps: {plan.num_optimizer_steps}"]
    lines += ["", "behaves differently (TRL | ours | setting that reproduces TRL's):"]
    lines += [f"  {d.what}: {d.trl} | {d.ours} | {d.setting or 'no key of ours reproduces it'}"
              for d in conv.differences]
    for title, items in (("WARNING: changes training, no equivalent here (not carried over)", conv.unsupported),
                         (f"WARNING: unknown to TRL {version}'s {conv.algo.upper()}Config/ModelConfig/ScriptArguments "
                          "(TrlParser would refuse them; not carried over)", conv.unknown),
                         ("before `rlhf run`", conv.todo),
                         ("not carried over, no effect on the trained policy here", conv.bookkeeping)):
        if items:
            lines += ["", f"{title}:"] + [f"  {item}" for item in items]
    return lines


def profile_text(conv: Conversion, source: str, plan: BatchPlan | None = None) -> str:
    """The profile YAML, headed by the report as comments."""
    header = [f"# Converted by `rlhf from-trl {source}`."]
    header += [f"# {line}".rstrip() for line in report_lines(conv, plan)]
    return "\n".join(header) + "\n" + yaml.safe_dump(conv.profile, sort_keys=False, default_flow_style=False)


def _yaml_scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
