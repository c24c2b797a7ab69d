"""Typed configuration of every trainer of the library, validated once and frozen: the RL trainer
(`RLConfig`), supervised fine-tuning (`SFTConfig`), reward-model training (`RewardConfig`) and the reward-model
inspection (`InspectionConfig`). Importing it costs pydantic only, so the pipeline's params can extend them.

The RL batch hierarchy (after summarize_from_feedback_details / TRL), per update:

    rollout batch   `batch_size` episodes (completions) generated across all processes
      └ mini-batch  `batch_size / num_mini_batches` episodes: one optimizer step
          └ micro-batch  `per_device_train_batch_size` episodes per process: one forward/backward;
                         `gradient_accumulation_steps` of them per process make a mini-batch

so `batch_size = per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches *
num_processes`. For RLOO and GRPO an episode is one of the k completions of a prompt (`rloo.rloo_k`,
`grpo.num_generations`), so each update draws `batch_size / k` prompts. Derived sizes are computed in one place, `BatchPlan.derive`,
with exact divisions that fail loudly naming the fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from rlhf_core.reward_functions import split_import_path


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


# Other names of one setting, resolved once when a config is validated: the rest of the code sees only ours.
# Keys are the names users bring; values our dotted field, relative to the config that takes the alias.
TRL_ALIASES: dict[str, str] = {
    "beta": "kl_coef",                          # TRL's RLOOConfig / GRPOConfig
    "epsilon": "cliprange",                     # TRL's RLOOConfig / GRPOConfig
    "num_generations": "rloo.rloo_k",           # TRL's RLOOConfig: completions per prompt
    "max_completion_length": "response_length", # TRL's RLOOConfig / GRPOConfig
}
PEFT_ALIASES: dict[str, str] = {  # PEFT's LoraConfig names of TRL's ModelConfig LoRA fields (ours)
    "r": "lora_r",
    "target_modules": "lora_target_modules",
    "modules_to_save": "lora_modules_to_save",
    "task_type": "lora_task_type",
}


def resolve_aliases(model: type[BaseModel], data, aliases: Mapping[str, str], source: str):
    """`data` (a config's raw mapping) with each alias in `aliases` renamed to our field. The value is checked
    here against our field's type and bounds, so a bad value is reported under the name the user wrote; both
    names of one setting is an error naming both."""
    if not isinstance(data, Mapping) or not aliases.keys() & data.keys():
        return data
    data = dict(data)
    for alias, name in aliases.items():
        if alias not in data:
            continue
        value = data.pop(alias)
        section, _, field = name.rpartition(".")
        owner, target = model, data
        if section:  # a nested options model (rloo.rloo_k): write into its mapping
            owner = model.model_fields[section].annotation
            nested = data.get(section)
            nested = nested.model_dump(exclude_unset=True) if isinstance(nested, BaseModel) else dict(nested or {})
            target = data[section] = nested
        if field in target:
            raise ValueError(f"{alias} and {name} are one setting ({source}'s {alias} is our {name}); give one "
                             "of them")
        info = owner.model_fields[field]
        try:
            value = TypeAdapter(Annotated[info.annotation, info]).validate_python(value)
        except ValidationError as err:
            reason = "; ".join(e["msg"] for e in err.errors())
            raise ValueError(f"{alias}={value!r}: {reason} ({source}'s {alias} is our {name})") from None
        target[field] = value
    return data


class PPOOptions(_Frozen):
    """What only PPO uses: the value model, GAE and the clipped value loss."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount. 1.0 as in the TL;DR recipes: the episode is short and the score comes at the end."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda."""
    cliprange_value: float = Field(0.2, gt=0.0)
    """Clip range of the value prediction around its rollout-time value."""
    vf_coef: float = Field(0.1, ge=0.0)
    """Weight of the value loss in the joint policy+value loss (one optimizer for both)."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (scale only) before GAE."""


class RLOOOptions(_Frozen):
    """What only RLOO uses: k samples per prompt and the leave-one-out baseline."""

    rloo_k: int = Field(2, ge=2)
    """Completions sampled per prompt; each is baselined by the mean reward of the other k-1."""
    kl_level: Literal["sequence", "token"] = "sequence"
    """'sequence': the summed KL joins the reward before the baseline and the ratio is per sequence
    (TRL's RLOO). 'token': per-token KL as reward-to-go, per-token advantages and ratios."""
    normalize_reward: bool = False
    """Standardize the rlhf reward across the rollout batch, then clip to +-reward_clip_range."""
    reward_clip_range: float = Field(10.0, gt=0.0)
    """Clip range applied after reward normalization."""
    normalize_advantage: bool = False
    """Standardize the advantages across the rollout batch."""


class GRPOOptions(_Frozen):
    """What only GRPO uses, under TRL 1.16's GRPOConfig names and defaults (each also accepted unprefixed, as TRL
    writes them: `train.loss_type` is `train.grpo.loss_type`)."""

    num_generations: int = Field(8, ge=2)
    """Completions sampled per prompt: the group whose reward statistics make each one's advantage."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] = "dapo"
    """How per-token losses are reduced (rlhf_core/grpo.py): 'grpo' mean of sequence means; 'bnpo' the
    micro-batch's token mean; 'dr_grpo' token sum / (sequences * response_length); 'dapo' (TRL's default) the
    token mean over the optimizer step; 'cispo' dapo's reduction of the clipped-weight REINFORCE loss (MiniMax-M1;
    set epsilon_high, ~5)."""
    scale_rewards: Annotated[Literal["group", "batch", "none"],
                             BeforeValidator(lambda v: {True: "group", False: "none"}.get(v, v))] = "group"
    """Divide the group-centered reward by the std of its group, of the whole batch, or not at all (Dr. GRPO);
    TRL's true and false are group and none."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """One importance ratio per token, or per sequence (GSPO: exp of the mean token log-ratio)."""
    delta: float | None = Field(None, gt=1.0)
    """Two-sided clipping (INTELLECT-2): the unclipped ratio is also capped at delta (> 1 + epsilon_high)."""
    top_entropy_quantile: float = Field(1.0, ge=0.0, le=1.0)
    """Train only on the top quantile of a micro-batch's tokens by entropy (0.2 in "Beyond the 80/20 rule");
    1.0 keeps all."""
    use_bias_correction_kl: bool = True
    """Weight the KL term of each token by its importance ratio (TRL 1.16's default): an unbiased estimate of the
    current policy's KL from completions sampled by the old one."""


GRPO_FIELDS = tuple(GRPOOptions.model_fields)

# TRL 1.16 GRPOConfig options that change training and have no equivalent here: refused when set away from TRL's
# default (the value beside each name), naming the key, so that none is silently ignored.
TRL_GRPO_UNSUPPORTED: dict[str, object] = {
    "multi_objective_aggregation": "sum_then_normalize", "sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
    "entropy_coef": 0.0, "use_adaptive_entropy": False, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005, "entropy_target": 0.2, "off_policy_mask_threshold": None,
}


class RLConfig(_Frozen):
    """Everything the trainer needs, for every algorithm."""

    algo: Literal["ppo", "rloo", "grpo"] = "ppo"
    """Which policy-gradient estimator to use."""
    seed: int = 0
    """Seeds sampling, data order and initialization; with it a run is reproducible."""
    total_episodes: int = Field(1024, gt=0)
    """Completions to generate over the whole run; the number of updates is derived from it."""

    # batch hierarchy (see the module docstring)
    per_device_train_batch_size: int = Field(16, gt=0)
    """Micro-batch: episodes per process per forward/backward."""
    gradient_accumulation_steps: int = Field(4, gt=0)
    """Micro-batches accumulated into one mini-batch (one optimizer step)."""
    num_mini_batches: int = Field(1, gt=0)
    """Mini-batches (optimizer steps) per pass over the rollout batch."""
    num_epochs: int = Field(4, gt=0)
    """Passes over each rollout batch (PPO epochs); RLOO's one optimization pass is 1."""
    local_rollout_forward_batch_size: int = Field(64, gt=0)
    """Episodes per process per generation (no grad); bounds rollout memory. The log-prob and value forwards over
    its completions then run `per_device_train_batch_size` rows at a time (the update holds as many anyway)."""

    # sampling
    response_length: int = Field(24, gt=0)
    """Maximum new tokens per completion."""
    temperature: float = Field(0.7, gt=0.0)
    """Sampling temperature; the same scaling divides the logits when log-probs are recomputed."""
    top_k: int = Field(0, ge=0)
    """Sample from the k most likely tokens only; 0 disables. Any truncation (top_k, top_p, min_p,
    repetition_penalty) makes the sampling distribution differ from the policy whose log-probs the loss
    uses: the ratio is then off-policy by the truncation (as in TRL). Pure sampling is the default."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: the smallest set of tokens with this total probability; 1.0 disables."""
    min_p: float | None = Field(None, gt=0.0, lt=1.0)
    """Drop tokens below min_p times the top token's probability; None disables."""
    repetition_penalty: float = Field(1.0, gt=0.0)
    """Divide the logits of tokens already in the sequence by this (CTRL); 1.0 disables."""
    sampling_seed: Literal["process", "episode"] = "process"
    """Where sampling randomness comes from. `process`: each process's seeded random stream (the
    default). `episode`: each token's uniform is keyed by (seed, update, prompt, sample), so an
    episode's completion is the same whatever process or rollout batch generates it: 1 and N processes then train
    the same policy (up to float rounding), at the cost of one hash per row and token."""
    decode_graphs: Literal["auto", "on", "off"] = "off"
    """The rollout's decode steps as one captured CUDA graph each (`rlhf_core.decode`): `auto` wherever it is
    possible (CUDA, a model with a plain static KV cache, no ZeRO-3 partitioning), else eager; `on`: refuse to run
    eagerly; `off` (the default until a GPU has measured it: bench/gpu_check.sh's decode part): always eager.
    The first rollout of each prompt-width bucket compiles its graph (tens of seconds for a 1B model)."""
    stop_token: Literal["eos"] | None = "eos"
    """Truncate completions after this token ('eos') or never (None)."""
    missing_eos_penalty: float | None = Field(1.0, ge=0.0)
    """Subtracted from the score of completions that never emit the stop token; None disables."""

    # multi-turn rollouts with tools (rlhf_core/multi_turn.py), under TRL 1.16 GRPOTrainer's names
    tools: list[str] = Field(default_factory=list)
    """Tools the policy may call, each 'package.module:function' (sync or async, with type hints and a docstring; the
    pipeline imports only from modules trust.tool_modules allows). With tools (or environment_factory) a rollout runs
    the calls the model writes and appends their results as tool messages, which the loss and the KL skip."""
    environment_factory: str | None = None
    """'package.module:Class', one instance per episode (pooled across updates): reset(**row) returns text appended to
    the prompt's last user message, its public methods are tools, its get_reward() (if any) one more reward source."""
    max_tool_calling_iterations: int | None = Field(None, ge=0)
    """Rounds of tool calls an episode may make; None: until it answers without a call or its budget
    (response_length) runs out (TRL's default)."""
    tool_timeout: float | None = Field(30.0, gt=0.0)
    """Seconds a tool call may run before it counts as failed, its result {'error': ...} returned to the model; None:
    no bound (TRL's behaviour: a hung tool hangs the rollout)."""

    # objective
    kl_coef: float = Field(0.05, ge=0.0)
    """Weight beta of the KL(policy || reference) penalty in the reward (GRPO: of the k3 KL in the loss, 0 by
    default as TRL's beta; at 0 no reference model is loaded)."""
    max_update_kl: float | None = Field(None, gt=0.0)
    """Stop training (`TrainingDiverged`) after an update whose mean KL(policy || reference) per completion
    (`objective/kl`) exceeds this, before it is checkpointed; None: no bound. NaN/inf in a loss, reward, gradient
    norm or ratio always stops it."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL estimator (Schulman): k1 = log p - log q, k3 = (r - 1) - log r."""
    cliprange: float = Field(0.2, gt=0.0)
    """Clip range epsilon of the policy ratio: [1 - cliprange, 1 + cliprange] (TRL RLOO: `epsilon`)."""
    epsilon_high: float | None = Field(None, gt=0.0)
    """Upper clip range (clip-higher, DAPO; TRL's name): the ratio is clipped to [1 - cliprange, 1 +
    epsilon_high]; None: cliprange. Logged: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean."""
    mask_truncated_completions: bool = False
    """Leave completions that never emitted the stop token out of the loss (they are still scored and
    count in the baselines and statistics); combines with or replaces missing_eos_penalty."""
    sync_ref_model: bool = False
    """Let the reference follow the policy (TR-DPO): every ref_model_sync_steps optimizer steps,
    reference <- ref_model_mixup_alpha * policy + (1 - alpha) * reference."""
    ref_model_mixup_alpha: float = Field(0.6, gt=0.0, le=1.0)
    """Weight of the policy in the reference update (1.0 copies the policy)."""
    ref_model_sync_steps: int = Field(512, gt=0)
    """Optimizer steps between reference updates."""
    whiten_advantages: bool = True
    """Whiten PPO's per-token advantages over the rollout batch (RLOO: see rloo.normalize_advantage)."""

    # optimization
    learning_rate: float = Field(1e-5, ge=0.0)
    """Peak learning rate of AdamW (policy and value together)."""
    lr_scheduler: Literal["linear", "constant", "cosine"] = "linear"
    """Decay over all optimizer steps of the run (TRL: linear)."""
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of optimizer steps of linear warm-up."""
    adam_eps: float = Field(1e-5, gt=0.0)
    """AdamW epsilon (1e-5 as in the PPO implementation details, not torch's 1e-8)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm of each optimizer step; None disables."""

    # bookkeeping
    checkpoint_every: int = Field(0, ge=0)
    """Save a resumable checkpoint every N updates (0: only at the end when a dir is given)."""
    keep_checkpoints: int = Field(2, gt=0)
    """How many of the newest checkpoints to keep."""

    ppo: PPOOptions = PPOOptions()
    rloo: RLOOOptions = RLOOOptions()
    grpo: GRPOOptions = GRPOOptions()

    @model_validator(mode="before")
    @classmethod
    def _trl_aliases(cls, data):
        """TRL's current names (TRL_ALIASES): beta, epsilon, num_generations, max_completion_length; for GRPO also
        GRPOConfig's own (loss_type, scale_rewards, ...), and its beta default 0. TRL GRPOConfig options we do
        not implement are refused by name."""
        if isinstance(data, Mapping) and data.get("algo") == "grpo":
            data = dict(data)
            for key, default in TRL_GRPO_UNSUPPORTED.items():
                if key in data and data.pop(key) != default:
                    raise ValueError(f"{key}: TRL's GRPOConfig option is not implemented here (only its default "
                                     f"{default!r} is accepted); see docs/trl.md")
            if not {"kl_coef", "beta"} & data.keys():
                data["kl_coef"] = 0.0  # TRL GRPOConfig's beta
            grpo_names = {name: f"grpo.{name}" for name in GRPO_FIELDS}
            return resolve_aliases(cls, data, {**TRL_ALIASES, **grpo_names}, "TRL")
        return resolve_aliases(cls, data, TRL_ALIASES, "TRL")

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, data):
        """TRL's generation-reuse names, mapped onto the batch hierarchy: `num_iterations` (passes over one
        generation) is num_epochs; `steps_per_generation` (micro-steps per generation, TRL counts micro-batches)
        is gradient_accumulation_steps * num_mini_batches."""
        if not isinstance(data, dict) or not {"num_iterations", "steps_per_generation"} & data.keys():
            return data
        data = dict(data)
        if (iterations := data.pop("num_iterations", None)) is not None:
            if data.get("num_epochs", iterations) != iterations:
                raise ValueError(f"num_iterations={iterations} and num_epochs={data['num_epochs']} name the same "
                                 "thing (passes over one generation); set one")
            data["num_epochs"] = iterations
        if (steps := data.pop("steps_per_generation", None)) is not None:
            accumulation = data.get("gradient_accumulation_steps",
                                    cls.model_fields["gradient_accumulation_steps"].default)
            if not isinstance(steps, int) or steps <= 0 or steps % accumulation:
                raise ValueError(f"steps_per_generation={steps!r} must be a positive multiple of "
                                 f"gradient_accumulation_steps={accumulation} (each optimizer step takes that "
                                 "many micro-batches of one generation)")
            mini_batches = steps // accumulation
            if data.get("num_mini_batches", mini_batches) != mini_batches:
                raise ValueError(f"steps_per_generation={steps} means num_mini_batches={mini_batches}, but "
                                 f"num_mini_batches={data['num_mini_batches']} is set; set one")
            data["num_mini_batches"] = mini_batches
        return data

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        self._check_tools()
        if self.algo == "ppo" and self.ppo.whiten_rewards and self.ppo.gamma == 0:
            raise ValueError("ppo.whiten_rewards with ppo.gamma=0 leaves nothing to whiten")
        if self.sync_ref_model and self.kl_coef == 0:
            raise ValueError("sync_ref_model with kl_coef=0: the reference is not used, there is nothing to sync")
        if self.max_update_kl is not None and not self.uses_reference:
            raise ValueError("max_update_kl with algo=grpo and kl_coef (beta) 0: no reference model is loaded, so "
                             "there is no KL to bound; set kl_coef > 0 or max_update_kl null")
        return self

    def _check_tools(self) -> None:
        if not self.uses_tools:
            for key in ("max_tool_calling_iterations", "tool_timeout"):
                if key in self.model_fields_set and getattr(self, key) != RLConfig.model_fields[key].default:
                    raise ValueError(f"{key}: has no effect without tools or environment_factory")
            return
        names = [split_import_path(path, f"tools[{i}]: tool")[1] for i, path in enumerate(self.tools)]
        if self.environment_factory is not None:
            split_import_path(self.environment_factory, "environment_factory:", "class")
        if len(set(names)) != len(names):
            raise ValueError(f"tools: {names} names one tool twice; the model calls a tool by its name")
        key = "tools" if self.tools else "environment_factory"
        if self.algo == "ppo":
            raise ValueError(f"{key}: multi-turn rollouts are implemented for algo grpo and rloo, not ppo (its value "
                             "model and GAE would run over the tool results)")
        if self.stop_token is None:
            raise ValueError(f"{key}: multi-turn rollouts need stop_token eos (a turn ends at EOS)")
        if self.decode_graphs == "on":
            raise ValueError(f"{key}: multi-turn rollouts decode eagerly; set decode_graphs to auto or off")
        if self.algo == "rloo" and self.rloo.kl_level == "token" and self.rloo.normalize_advantage:
            raise ValueError(f"{key}: rloo.normalize_advantage at rloo.kl_level token would whiten over the tool "
                             "results too; use kl_level sequence or no normalize_advantage")

    @property
    def uses_tools(self) -> bool:
        """Whether rollouts are multi-turn: tools or an environment whose methods are tools."""
        return bool(self.tools) or self.environment_factory is not None

    @property
    def uses_reference(self) -> bool:
        """Whether a reference policy is loaded: GRPO's KL is in its loss, and with beta 0 it needs none (as TRL)."""
        return self.algo != "grpo" or self.kl_coef > 0

    @property
    def steps_per_generation(self) -> int:
        """TRL's name: micro-batches per process taken from one generation per pass."""
        return self.gradient_accumulation_steps * self.num_mini_batches

    @property
    def num_iterations(self) -> int:
        """TRL's name for num_epochs."""
        return self.num_epochs

    @property
    def truncated_sampling(self) -> bool:
        """Whether sampling departs from the policy's own distribution (see top_k)."""
        return (self.top_k > 0 or self.top_p < 1.0 or self.min_p is not None
                or self.repetition_penalty != 1.0)

    @property
    def samples_per_prompt(self) -> int:
        return {"rloo": self.rloo.rloo_k, "grpo": self.grpo.num_generations}.get(self.algo, 1)


class PeftOptions(_Frozen):
    """LoRA on the policy, with the names of TRL's `ModelConfig` (`--use_peft --lora_r 16 ...`). Only the adapter
    trains; the reference is the base model with the adapter off, so no second copy of the policy is kept."""

    use_peft: bool = False
    """Train a LoRA adapter on the policy instead of all its weights (PPO's value model stays a full model)."""
    lora_r: int = Field(16, gt=0)
    """LoRA rank (PEFT's `r`)."""
    lora_alpha: int = Field(32, gt=0)
    """LoRA scaling numerator: the update is scaled by lora_alpha / lora_r (PEFT's `lora_alpha`)."""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Must stay 0 (TRL's default is 0.05): dropout is off in every trained model, since the rollout's and the
    training forward's log-probs must agree (TRL's PPO disables it too)."""
    lora_target_modules: list[str] | str | None = None
    """Module names to adapt (PEFT's `target_modules`: names, a regex, or 'all-linear'); None: PEFT's default
    for the architecture (GPT-NeoX: query_key_value)."""
    lora_modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter (PEFT's `modules_to_save`), e.g. the output head."""
    lora_task_type: Literal["CAUSAL_LM"] = "CAUSAL_LM"
    """PEFT's `task_type`; the policy is a causal LM."""
    use_rslora: bool = False
    """Rank-stabilized LoRA: scale by lora_alpha / sqrt(lora_r) (PEFT's `use_rslora`)."""

    @model_validator(mode="before")
    @classmethod
    def _peft_aliases(cls, data):
        """PEFT's LoraConfig names (PEFT_ALIASES): r, target_modules, modules_to_save, task_type."""
        return resolve_aliases(cls, data, PEFT_ALIASES, "PEFT")

    @model_validator(mode="after")
    def _check_lora(self) -> PeftOptions:
        if self.use_peft and self.lora_dropout > 0:
            raise ValueError(f"lora_dropout={self.lora_dropout}: must be 0; dropout is off in every trained model "
                             "(rollout and training log-probs must agree, as in TRL's PPO)")
        return self


def exact_div(a: int, b: int, what: str) -> int:
    """a / b, raising with `what` (the fields involved) when b does not divide a."""
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


@dataclass(frozen=True)
class BatchPlan:
    """The batch sizes of a run, derived once from the config and the number of processes."""

    num_processes: int
    batch_size: int
    """Episodes per update across all processes."""
    local_batch_size: int
    """Episodes per update on this process."""
    local_mini_batch_size: int
    """Episodes per optimizer step on this process."""
    micro_batch_size: int
    """Episodes per forward/backward on this process."""
    local_prompts: int
    """Prompts drawn per update on this process (episodes / samples_per_prompt)."""
    num_updates: int
    """Rollout-then-optimize iterations of the run."""
    num_optimizer_steps: int
    """Optimizer steps of the run (for the LR schedule)."""

    @classmethod
    def derive(cls, cfg: RLConfig, num_processes: int = 1) -> BatchPlan:
        local_mini = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        local_batch = local_mini * cfg.num_mini_batches
        batch = local_batch * num_processes
        local_prompts = exact_div(
            local_batch, cfg.samples_per_prompt,
            "per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches / "
            + ("grpo.num_generations" if cfg.algo == "grpo" else "rloo.rloo_k"),
        )
        exact_div(local_batch, min(cfg.local_rollout_forward_batch_size, local_batch),
                  "local rollout batch / local_rollout_forward_batch_size")
        if cfg.total_episodes < batch:
            raise ValueError(f"total_episodes {cfg.total_episodes} is less than one rollout batch of {batch} episodes "
                             f"(per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches * "
                             f"{num_processes} processes)")
        num_updates = math.ceil(cfg.total_episodes / batch)
        return cls(
            num_processes=num_processes,
            batch_size=batch,
            local_batch_size=local_batch,
            local_mini_batch_size=local_mini,
            micro_batch_size=cfg.per_device_train_batch_size,
            local_prompts=local_prompts,
            num_updates=num_updates,
            num_optimizer_steps=num_updates * cfg.num_epochs * cfg.num_mini_batches,
        )


# ---------------------------------------------------------------------------------------- supervised

class SupervisedConfig(_Frozen):
    """Optimization settings that SFT and reward-model training share."""

    seed: int = 0
    """Seeds the data order (and dropout, if any); with it a run is reproducible."""
    epochs: int = Field(2, gt=0)
    """Passes over the rows (demo world: the second still helps; the reward model overfits in a third)."""
    per_device_train_batch_size: int = Field(16, gt=0)
    """Micro-batch: rows per process per forward/backward."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches accumulated into one mini-batch (one optimizer step)."""
    learning_rate: float = Field(1e-3, gt=0.0)
    """Peak learning rate of AdamW (for the tiny demo models trained from scratch; ~1e-5 for a 1B model)."""
    lr_scheduler: Literal["linear", "cosine", "constant_with_warmup"] = "cosine"
    """Decay after warm-up over all optimizer steps of the run."""
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0)
    """Fraction of optimizer steps of linear warm-up."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm of each optimizer step; None disables."""
    group_by_length: bool = True
    """Batch rows of similar length together (demo world: padding wastes ~25% of the compute otherwise)."""
    logging_steps: int = Field(10, gt=0)
    """Report the training metrics every this many optimizer steps."""
    eval_batch_size: int = Field(64, gt=0)
    """Rows per forward when evaluating (no grad)."""


class SFTConfig(SupervisedConfig):
    """Supervised fine-tuning of a causal LM on prompt/completion rows."""

    learning_rate: float = Field(3e-3, gt=0.0)
    """Peak learning rate of AdamW; this high, the demo policy learns to copy facts in two epochs."""

    max_prompt_length: int = Field(256, gt=0)
    """Prompt tokens kept (from the end, where the TL;DR: cue is)."""
    max_completion_length: int = Field(64, gt=0)
    """Completion + EOS tokens kept (from the start; a longer completion loses its EOS, as in TRL)."""


class RewardConfig(SupervisedConfig):
    """Pairwise reward-model training; the optimization fields and their defaults are SupervisedConfig's."""

    max_length: int = Field(320, gt=0)
    """Tokens of prompt + completion + EOS kept, from the end, so the scored EOS always survives."""


# ---------------------------------------------------------------------------------------- inspection

class InspectionConfig(_Frozen):
    """What the inspection scores and how strict it is."""

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


# ---------------------------------------------------------------------------------------- runtime

class RuntimeConfig(_Frozen):
    """Where and how a stage's models run: one setting for every stage that runs a model, validated once.

    Rollout, reference, reward and value forwards run in the training forward's precision (the autocast of
    `mixed_precision`), so PPO's ratio is exactly 1 before the first step; frozen models are stored in
    `frozen_dtype`. The demo runs on the CPU in fp32; a GPU profile sets bf16 and gradient checkpointing.
    """

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto': CUDA when present, else the CPU."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast of every forward (training, rollout, reference, scoring); weights being trained stay fp32."""
    frozen_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights of frozen models (reference, reward, evaluation copies); 'auto' follows mixed_precision."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of trained models: less memory, ~30% more compute."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel of every loaded model; flash_attention_2 needs the flash-attn package and a GPU."""
    num_processes: int = Field(1, gt=0)
    """Training processes over all machines (one per GPU); >1 relaunches the stage under the launcher."""
    num_machines: int = Field(1, gt=0)
    """Machines of a multi-node run (each runs the same command; see infra/accelerate/)."""
    accelerate_config: str | None = None
    """An accelerate config file (infra/accelerate/*.yaml: multi-GPU, DeepSpeed ZeRO-2/3); set, the stage
    relaunches itself under `accelerate launch --config_file`."""
    launcher: Literal["local", "ray"] = "local"
    """'local': the ranks run on this machine (torchrun / accelerate launch). 'ray': the stage process is a Ray
    driver and its `num_processes` ranks run as a Ray Train worker group on the cluster at `ray_address`, inputs
    and outputs travelling through `ray_storage` (tasks/execution/ray_launch.py)."""
    ray_address: str | None = None
    """The Ray cluster: 'HOST:PORT' of its GCS (this machine is one of its nodes) or 'ray://HOST:10001' (Ray
    Client); None: the RAY_ADDRESS environment variable."""
    ray_storage: str | None = None
    """Where the cluster's nodes meet the stage's files: a path every node mounts, or s3://BUCKET/PREFIX (S3
    credentials and endpoint from each node's environment). None: RLHF_RAY_STORAGE."""
    ray_cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs each rank reserves on the cluster."""
    ray_gpus_per_worker: float | None = Field(None, ge=0)
    """GPUs each rank reserves; None: 1 when runtime.device is cuda (or auto and the cluster has GPUs), else 0."""
    ray_max_failures: int = Field(1, ge=0)
    """How many times a worker group that lost a rank (or its node) restarts from the last checkpoint before the
    stage fails; each restart resumes, none starts over."""

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false

    @model_validator(mode="after")
    def _check(self) -> RuntimeConfig:
        if self.mixed_precision == "fp16" and self.device == "cpu":
            raise ValueError("mixed_precision fp16 needs a CUDA device (the CPU has bf16 autocast: use bf16)")
        if self.launcher == "ray" and self.num_machines > 1:
            raise ValueError("runtime.num_machines is for the local launcher (one command per machine); on Ray the "
                             "cluster places runtime.num_processes ranks on its nodes: leave num_machines at 1")
        if self.num_machines > self.num_processes:
            raise ValueError(f"num_machines {self.num_machines} > num_processes {self.num_processes}: every "
                             "machine runs at least one process")
        return self

    @property
    def launched(self) -> bool:
        """Whether the stage runs under a launcher (more than one process, an accelerate config, or Ray)."""
        return self.num_processes > 1 or self.accelerate_config is not None or self.launcher == "ray"

    @property
    def checkpoint_layout(self) -> dict:
        """The settings a training checkpoint's format depends on: a checkpoint resumes under any launcher (a
        2-rank DDP checkpoint is the same written through torchrun or Ray), never under another layout."""
        return self.model_dump(mode="json", exclude={"launcher", "ray_address", "ray_storage", "ray_cpus_per_worker",
                                                     "ray_gpus_per_worker", "ray_max_failures"})
