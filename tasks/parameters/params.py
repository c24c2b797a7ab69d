"""The pipeline's typed parameters: `params.yaml` + a profile + `--set` overrides, validated once.

Each stage reads only its own section (plus `base`). A section extends the library's config class of
that stage, so `train.kl_coef` is `RLConfig.kl_coef`, documented and validated where it is defined.
"""

from __future__ import annotations

import copy
import difflib
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlhf_core.config import (
    PEFT_ALIASES,
    TRL_ALIASES,
    InspectionConfig,
    PeftOptions,
    RewardConfig,
    RLConfig,
    RuntimeConfig,
    SFTConfig,
)
from rlhf_core.reward_functions import import_reward_function, split_import_path
from rlhf_core.tools import import_environment_factory, import_tool
from rlhf_core.world.config import WorldConfig

PARAMS_FILE = "params.yaml"
# The train section's other names (TRL's RLOOConfig, PEFT's LoraConfig): RLConfig / PeftOptions resolve them when
# the section is validated; here they only keep the layers (params.yaml, profile, --set) from naming one setting twice.
TRAIN_ALIASES = {**TRL_ALIASES, **PEFT_ALIASES}
PROFILES_DIR = "profiles"
CLUSTER_KEYS = ("ray_address", "ray_storage")  # where a stage's code and data go: never a run's choice
# While `rlhf run` has written its profile and overrides into params.yaml: {"original": text, "written": text}
# (flows/overrides.py); lineage reads it to tell the run's own edit from the user's.
RUN_PARAMS_NOTE = ".dvc/tmp/rlhf-params-restore.json"


class ParamsError(ValueError):
    """Invalid parameters; the message names the file, the key and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class TrustParams(_Section):
    """What a run's overrides may reach beyond the committed pipeline (docs/security.md). Set in params.yaml only,
    by whoever commits it: neither a run's overrides nor a profile can set it (`load_params` refuses both; a run may
    pick any committed profile). No stage depends on it in dvc.yaml: it changes what may run, not what a run
    computes."""

    reward_modules: list[str] = Field(default_factory=list)
    """Module prefixes train.reward_funcs[].function may import from, e.g. ['my_rewards'] allows 'my_rewards:f'
    and 'my_rewards.text:f', not 'my_rewards_x:f'. Empty: no Python reward function; checked before any import."""
    tool_modules: list[str] = Field(default_factory=list)
    """Module prefixes train.tools[] and train.environment_factory may import from, by reward_modules' rules. Apart
    from reward_modules: a tool runs with arguments the policy writes. Empty: no tools; checked before any import."""
    roots: list[str] = Field(default_factory=list)
    """Folders, besides the workspace, that a path in a run's overrides may name (a data source, an accelerate
    config, a model): e.g. ['/data/corpora']. Relative entries are under the workspace."""


class BaseParams(_Section):
    profile: str = "demo"
    """Profile whose `profiles/<name>.yaml` overrides sections of params.yaml ('demo': none)."""
    seed: int = 0
    """Seeds every stage; each stage derives its own seed from it."""
    run_overrides: list[str] = Field(default_factory=list)
    """Written by `rlhf run` for one run only: the dotted keys of its `--set` overrides that the profile also sets.
    The stages read params.yaml, then the profile: these keys keep params.yaml's value, so the run's override is
    not silently replaced by the profile's."""


class PrepareParams(_Section):
    source: str = "world"
    """'world' for the built-in synthetic TL;DR world, else a dataset profile's sources below."""
    world: WorldConfig = Field(default_factory=WorldConfig)
    """Used when source is 'world'."""
    sft: str | None = None
    """Real data: SFT rows {prompt, completion} (local .jsonl/.parquet, saved dir, or hub id)."""
    preferences: str | None = None
    """Real data: preference rows {prompt, chosen, rejected}."""
    prompts: str | None = None
    """Real data: RL prompts {prompt} (defaults to the SFT rows' prompts)."""
    eval_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    """Real data: share of prompts held out for evaluation when a source has no eval split."""
    tokenizer: str | None = None
    """A tokenizer to use (dir or hub id); None trains one on the world's text."""
    tokenizer_vocab_size: int = Field(2048, ge=64)
    """Vocabulary of the locally trained tokenizer."""
    max_prompt_tokens: int = Field(256, gt=0)
    """Rows whose prompt is longer are dropped (and counted)."""
    max_completion_tokens: int = Field(64, gt=0)
    """Rows whose completion (or chosen/rejected) is longer are dropped (and counted)."""
    chat_template: str | None = None
    """Conversational data (TRL's format: messages as lists of {role, content}): a Jinja file to set as the
    tokenizer's chat template, for a tokenizer that has none (a chat model's tokenizer has its own)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (TRL's `chat_template_kwargs`, e.g. {enable_thinking: false}); every
    stage renders conversations with them."""


class TinyModelParams(_Section):
    """Architecture of the GPT-NeoX the demo trains from scratch."""

    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_positions: int = Field(512, gt=0)


class SFTParams(SFTConfig):
    base_model: str | None = None
    """Start from this causal LM (dir or hub id); None: a tiny GPT-NeoX from scratch."""
    pretrained: str | None = None
    """An already fine-tuned policy (e.g. the cleanrl TL;DR SFT model): the stage only evaluates it."""
    tiny: TinyModelParams = TinyModelParams()
    """Used when base_model and pretrained are None."""
    eval_max_new_tokens: int = Field(48, gt=0)
    """Greedy completion length when measuring the EOS rate."""


class RewardModelParams(RewardConfig):
    pretrained: str | None = None
    """An already trained reward model (dir or hub id): the stage only evaluates it."""
    init_from_sft: bool = False
    """Start from the SFT policy's backbone (summarize-from-feedback) instead of a fresh tiny model. The demo
    sets it: after 4 SFT epochs it lifts PPO's and RLOO's gold win rates to 0.91 over seeds 0-2 (fresh: 0.84,
    0.87; docs/sweep.md#how-the-demos-defaults-were-set)."""


class InspectParams(InspectionConfig):
    """The reward-model inspection (stage `inspect`); fields documented in rlhf_core/config.py."""


class RuntimeParams(RuntimeConfig):
    """Device, precision and launcher of every stage that runs a model; fields documented in rlhf_core/config.py."""


class RewardSource(_Section):
    """One reward source of `train.reward_funcs` (TRL's reward_funcs): a reward model or a Python function."""

    model: str | None = None
    """A sequence classifier (num_labels=1) by path or hub id, sharing the policy's tokenizer
    (`models/reward` is the pipeline's own)."""
    function: str | None = None
    """'package.module:function', called as fn(prompts, completions) -> floats on decoded text."""
    name: str | None = None
    """Name of its metrics (rewards/<name>/mean, /std); default: the function's or the model folder's name."""

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSource:
        if (self.model is None) == (self.function is None):
            raise ValueError("a reward source names exactly one of 'model' (path or hub id) or 'function' "
                             "('package.module:function')")
        if self.function is not None:  # checked and imported by Params, once trust.reward_modules allows its module
            module, sep, attribute = self.function.partition(":")
            if not sep or not module or not attribute:
                raise ValueError(f"function {self.function!r}: expected 'package.module:function'")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return self.function.rpartition(":")[2] if self.function else Path(self.model).name


class TrainParams(RLConfig, PeftOptions):
    """The RL trainer's config (RLConfig) and LoRA on the policy (PeftOptions: TRL's ModelConfig names)."""

    value_model_init: Literal["reward", "sft"] = "reward"
    """Initialize PPO's value model from 'reward' (TRL's choice) or 'sft' (backbone + a fresh head)."""
    trace_every: int = Field(20, ge=0)
    """Write the reward-flow trace (reports/trace/) every N updates and at the last one; 0: never."""
    trace_rollouts: int = Field(4, gt=0)
    """Rollouts of the batch (the first ones) each trace breaks down token by token."""
    reward_funcs: list[RewardSource] | None = None
    """Reward sources summed with reward_weights (TRL's names); None: the pipeline's reward model alone."""
    reward_weights: list[float] | None = None
    """One weight per reward source; None: 1.0 each."""

    @model_validator(mode="after")
    def _reward_sources(self) -> TrainParams:
        if self.reward_weights is not None:
            if self.reward_funcs is None:
                raise ValueError("train.reward_weights needs train.reward_funcs (one weight per source)")
            if len(self.reward_weights) != len(self.reward_funcs):
                raise ValueError(f"train.reward_weights has {len(self.reward_weights)} weights for "
                                 f"{len(self.reward_funcs)} reward_funcs; give one per source")
        if self.reward_funcs is not None:
            labels = [source.label for source in self.reward_funcs]
            if not labels or len(set(labels)) != len(labels):
                raise ValueError(f"train.reward_funcs: names must be distinct and at least one, got {labels} "
                                 "(set 'name' on each)")
        return self

    @model_validator(mode="after")
    def _lora_reference(self) -> TrainParams:
        if self.use_peft and self.sync_ref_model:  # the trainer would refuse it too, but only after the models load
            raise ValueError("train.sync_ref_model with train.use_peft: with LoRA the reference is the base model "
                             "with the adapter off, which cannot follow the policy; set one of them to false")
        return self


class EvaluateParams(_Section):
    num_prompts: int = Field(256, gt=0)
    """Held-out prompts to complete (the first N of the eval split)."""
    response_length: int = Field(48, gt=0)
    """Maximum greedy completion length."""
    batch_size: int = Field(64, gt=0)
    """Prompts per generation / scoring forward."""


class RegisterParams(_Section):
    model_name: str = "rlhf-policy"
    """Registered model name in the MLflow model registry."""
    primary_metric: str = "auto"
    """Key of metrics/eval.json (higher is better) a new version must beat the champion on. 'auto':
    win_rate_gold where the evaluation has a gold reward (the demo world), else win_rate_rm. The reward
    model's own win rate rewards over-optimization: it rises while the gold one falls."""
    min_primary: float = 0.5
    """With no champion yet, the primary metric must exceed this: 0.5 means beating the SFT reference."""
    max_kl: float = Field(4.0, ge=0.0)
    """KL budget: a version whose eval mean_kl (nats per completion, vs the SFT reference) exceeds it is
    never promoted. The demo's defaults reach ~3.2; the over-optimized runs of a kl_coef sweep ~4.6."""
    tie_margin: float = Field(0.01, ge=0.0)
    """Primary values within this of the champion's are a tie, which the lower eval mean_kl wins."""


# pydantic warns that the field `register` shadows ABCMeta.register of the model class; instances read the
# field, and nothing registers virtual subclasses of Params.
warnings.filterwarnings("ignore", message='Field name "register" in "Params" shadows', category=UserWarning)


class Params(_Section):
    base: BaseParams = BaseParams()
    trust: TrustParams = TrustParams()
    runtime: RuntimeParams = RuntimeParams()
    prepare: PrepareParams = PrepareParams()
    sft: SFTParams = SFTParams()
    reward_model: RewardModelParams = RewardModelParams()
    inspect: InspectParams = InspectParams()
    train: TrainParams = TrainParams()
    evaluate: EvaluateParams = EvaluateParams()
    register: RegisterParams = RegisterParams()

    @model_validator(mode="after")
    def _trusted_reward_functions(self) -> Params:
        """Each reward function's module must be one trust.reward_modules allows, checked before anything is
        imported; then it is resolved, so a typo fails here, not after the SFT stages."""
        for i, source in enumerate(self.train.reward_funcs or []):
            if source.function is not None:
                _trusted_import(f"train.reward_funcs[{i}].function", source.function, self.trust.reward_modules,
                                "trust.reward_modules", import_reward_function, "reward function", "function")
        return self

    @model_validator(mode="after")
    def _trusted_tools(self) -> Params:
        """Each tool's and the environment factory's module must be one trust.tool_modules allows, by the rules of
        reward functions; then each is resolved (a tool also needs a schema the chat template can render)."""
        for i, path in enumerate(self.train.tools):
            _trusted_import(f"train.tools[{i}]", path, self.trust.tool_modules, "trust.tool_modules", import_tool,
                            "tool", "function")
        if self.train.environment_factory is not None:
            _trusted_import("train.environment_factory", self.train.environment_factory, self.trust.tool_modules,
                            "trust.tool_modules", import_environment_factory, "environment factory", "class")
        return self

    def rl_config(self) -> RLConfig:
        """The trainer's config: the train section without the pipeline-only fields, seeded by base.seed."""
        return RLConfig(**{**self.train.model_dump(include=set(RLConfig.model_fields)), "seed": self.base.seed})

    def peft_options(self) -> PeftOptions:
        """LoRA on the policy: the train section's TRL ModelConfig fields."""
        return PeftOptions(**self.train.model_dump(include=set(PeftOptions.model_fields)))

    def sft_config(self) -> SFTConfig:
        return SFTConfig(**{**self.sft.model_dump(include=set(SFTConfig.model_fields)), "seed": self.base.seed})

    def reward_config(self) -> RewardConfig:
        return RewardConfig(**{**self.reward_model.model_dump(include=set(RewardConfig.model_fields)),
                               "seed": self.base.seed})


def _trusted_import(key: str, path: str, allowed: list[str], trust_key: str, resolve, kind: str, noun: str) -> None:
    """ValueError naming `key` unless `path`'s module is under a prefix in `allowed` (checked before anything is
    imported) and `resolve(path)` finds a `noun` defined at module level there (not a name it imported, not an
    alias)."""
    only = f"{trust_key} ({allowed or 'empty'}) allows {noun}s defined at module level in those modules only"
    try:  # one name after the colon: no attribute path through what an allowed module imported
        module = split_import_path(path, kind, noun)[0]
    except ValueError as err:
        raise ValueError(f"{key}: {err}; {only}") from None
    if not any(module == prefix or module.startswith(f"{prefix}.") for prefix in allowed):
        raise ValueError(f"{key}: module {module!r} is not in {trust_key} ({allowed or 'empty'}); not imported. To "
                         f"allow it, add its package to {trust_key} in params.yaml (a run's overrides cannot)")
    try:
        resolve(path)
    except ValueError as err:
        raise ValueError(f"{key}: {err}; {only}") from None


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`, section by section. A train setting that `override` names, by our name or its TRL
    alias, replaces every name of it in `base`: `--set train.beta=0.1` over params.yaml's `kl_coef: 0.3` leaves
    `beta` alone, not both names (which validation refuses)."""
    out = copy.deepcopy(base)
    if isinstance(out.get("train"), dict) and isinstance(override.get("train"), dict):
        for key in {canonical_key(k) for k in flatten({"train": override["train"]})} & _NAMES.keys():
            for name in _NAMES[key]:
                _pop_dotted(out["train"], name)
    return _merge(out, override)


def _merge(out: dict, override: dict) -> dict:
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def canonical_key(key: str) -> str:
    """A dotted key with a train alias as our name: 'train.beta' -> 'train.kl_coef'; any other key unchanged."""
    section, _, rest = key.partition(".")
    return f"train.{TRAIN_ALIASES[rest]}" if section == "train" and rest in TRAIN_ALIASES else key


_NAMES = {f"train.{name}": [name, *(alias for alias, ours in TRAIN_ALIASES.items() if ours == name)]
          for name in TRAIN_ALIASES.values()}  # our dotted key -> every name of it inside the train section


def _pop_dotted(data: dict, key: str) -> None:
    *parents, last = key.split(".")
    for part in parents:
        data = data.get(part)
        if not isinstance(data, dict):
            return
    data.pop(last, None)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'rloo': {'rloo_k': 2}}} -> {'train.rloo.rloo_k': 2}: the dotted keys of overrides and MLflow.
    A train alias comes out as our key ('train.beta' -> 'train.kl_coef'), so an override or profile written with
    TRL's names lands on the params.yaml key it replaces (flows/overrides.py writes these keys)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[canonical_key(f"{prefix}{key}")] = value
    return out


# a float as YAML 1.2 reads it: PyYAML (YAML 1.1) wants a dot and a signed exponent, so reads 1e-5 as a string
_YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def parse_override(item: str) -> dict:
    """'section.key=value' -> {'section': {'key': value}}, the value parsed as YAML (1e-5, true, null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ParamsError(f"override {item!r}: expected section.key=value")
    value: Any = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str) and _YAML12_FLOAT.fullmatch(raw.strip()):
        value = float(raw)  # 1e-4 a number, as DVC (YAML 1.2) reads it back from params.yaml
    return nested(key, value)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def dotted(data: dict, key: str) -> Any:
    """data['a']['b'] for key 'a.b'; None where a part is missing."""
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def nested(key: str, value: Any) -> dict:
    """'a.b', v -> {'a': {'b': v}}."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_params(root: str | Path = ".", profile: str | None = None, overrides: list[str] = ()) -> Params:
    """params.yaml, then profiles/<profile>.yaml, then overrides; validated once, frozen."""
    root = Path(root)
    path = root / PARAMS_FILE
    raw = _read_yaml(path) if path.is_file() else {}
    params_yaml = copy.deepcopy(raw)
    override = {}
    for item in overrides:  # one layer: both names of a setting in it stay, and validation refuses them
        override = _merge(override, parse_override(item))
    if "trust" in override:
        raise ParamsError(f"trust: a run's overrides cannot set it (it says what they may reach); edit {path}'s "
                          f"trust section instead")
    cluster = [key for key in CLUSTER_KEYS if key in (override.get("runtime") or {})]
    if cluster:
        raise ParamsError(f"runtime.{cluster[0]}: a run's overrides cannot set it (a Ray cluster runs the stage's code "
                          "and answers with pickled objects; its storage receives the stage's data); set it in "
                          f"{path}, a profile, or the environment of whoever runs the stage (RAY_ADDRESS, RLHF_RAY_STORAGE)")
    profile = profile or override.get("base", {}).get("profile") or raw.get("base", {}).get("profile", "demo")
    if not isinstance(profile, str) or Path(profile).name != profile or profile.startswith("."):
        raise ParamsError(f"profile {profile!r}: expected the name of a file in {root / PROFILES_DIR}, not a path")
    if profile != "demo":
        profile_path = root / PROFILES_DIR / f"{profile}.yaml"
        if not profile_path.is_file():
            known = sorted(p.stem for p in (root / PROFILES_DIR).glob("*.yaml"))
            raise ParamsError(f"unknown profile {profile!r}: {profile_path} does not exist; known: {['demo', *known]}")
        profile_data = _read_yaml(profile_path)
        if "trust" in profile_data:
            raise ParamsError(f"{profile_path}: trust: a profile cannot set it (a run may pick any committed profile, "
                              f"so trust in one would widen every run); set it in {path}'s trust section")
        raw = deep_merge(raw, profile_data)
        for key in raw.get("base", {}).get("run_overrides") or []:  # a run's overrides outrank its profile
            raw = deep_merge(raw, nested(key, dotted(params_yaml, key)))
    raw = deep_merge(raw, override)
    raw.setdefault("base", {})["profile"] = profile
    layers = {"the run's overrides": flatten(override),
              **({str(profile_path): flatten(profile_data)} if profile != "demo" else {})}
    for section in ("sft", "reward_model", "train"):
        if isinstance(raw.get(section), dict) and "seed" in raw[section]:
            raise ParamsError(f"{_origin(f'{section}.seed', path, layers)}: {section}.seed is not a parameter; every "
                              "stage is seeded by base.seed")
    try:
        params = Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(_explain(err, path, layers)) from err
    _check_override_paths(root, params, override)
    return params


def _check_override_paths(root: Path, params: Params, override: dict) -> None:
    """Every string the stages will use where an override set a value, read as the file it would name in the
    workspace (`_resolved_path`: symlinks followed), must lie under the workspace or a trust.roots folder: a run's
    overrides read no file the committed pipeline does not. A word or a hub id names a path inside the workspace,
    so it passes unless a symlink there of that name leads out.

    The values checked are the validated ones, not the override's text or its YAML: YAML makes bytes (`!!binary`),
    numbers, dates and nested lists, and pydantic turns some of them into the strings a stage opens (bytes into
    str), so only the value after both is the one a stage will use."""
    roots = params.trust.roots
    workspace = root.resolve()
    try:
        allowed = [workspace, *(_resolved_path(workspace, r) for r in roots)]
    except (OSError, RuntimeError, ValueError) as err:
        raise ParamsError(f"trust.roots: {roots} cannot be resolved ({err})") from None
    errors = []
    for key, value in _overridden_values(params, override):
        if not isinstance(value, str):
            continue
        try:
            target = _resolved_path(workspace, value)
        except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, an unknown ~user, a NUL byte
            errors.append(f"{key}: {value!r} cannot be resolved to a file ({err}); a run's overrides may name "
                          f"files under the workspace ({workspace}) and trust.roots ({roots or 'empty'}) only")
            continue
        if not any(target.is_relative_to(folder) for folder in allowed):
            names = "" if str(target) == value else f": it names {target}"
            errors.append(f"{key}: {value} is outside the workspace ({workspace}) and trust.roots "
                          f"({roots or 'empty'}){names}; a run's overrides may name files there only")
    if errors:
        raise ParamsError("invalid overrides:\n  " + "\n  ".join(errors))


def _resolved_path(workspace: Path, value: str) -> Path:
    """The file `value` names for a stage running in `workspace`: a `file:` URL's path, `~` expanded, relative to
    the workspace, every symlink on the way followed (`data/etc/passwd` with `data/etc -> /etc` is /etc/passwd)."""
    if value[:5].lower() == "file:":
        value = urlsplit(value).path
    path = Path(value)
    if value.startswith("~"):  # not Path's test: Path("./~") is Path("~"), yet "./~" names a file in the workspace
        path = path.expanduser()
    return (workspace / path).resolve()


def _overridden_values(params: Params, override: dict) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of the validated `params` at or under a key `override` sets, as the stages
    will read it (JSON mode: every path-like value a plain string)."""
    overridden = set(flatten(override))  # dotted keys, TRL's names mapped to ours; a list is one key

    def set_by_override(key: str) -> bool:
        return any(key == k or key.startswith((f"{k}.", f"{k}[")) for k in overridden)

    return [(key, value) for key, value in _leaves(params.model_dump(mode="json")) if set_by_override(key)]


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf, list items as key[i]: train.reward_funcs[0].model."""
    if isinstance(data, dict):
        return [leaf for k, v in data.items() for leaf in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(data, list):
        return [leaf for i, v in enumerate(data) for leaf in _leaves(v, f"{prefix}[{i}]")]
    return [(prefix, data)]


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys the section containing `loc` accepts."""
    model: type[BaseModel] = Params
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return sorted([*model.model_fields, *(TRAIN_ALIASES if model is TrainParams else ())])


def _origin(key: str, path: Path, layers: Mapping[str, Mapping[str, Any]]) -> str:
    """Which layer set dotted `key` (or a section above it): the run's overrides, the profile, else params.yaml."""
    for origin, keys in layers.items():  # overrides first: they win over the profile
        if any(k == key or k.startswith(f"{key}.") or key.startswith(f"{k}.") for k in keys):
            return origin
    return str(path)


def _explain(err: ValidationError, path: Path, layers: Mapping[str, Mapping[str, Any]]) -> str:
    """The refusal, headed by where the bad values came from (the run's overrides, the profile or params.yaml: the
    file a user would look in is the one named)."""
    origins = dict.fromkeys(_origin(".".join(map(str, e["loc"])), path, layers) for e in err.errors()) or [str(path)]
    lines = [f"{' and '.join(origins)}: invalid parameters"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(e["loc"])
            close = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=1)
            hint = f" (did you mean {'.'.join([*map(str, e['loc'][:-1]), close[0]])!r}?)" if close else ""
            lines.append(f"  {key}: unknown key{hint}; allowed: {', '.join(allowed)}")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a whole section's check
            message = e["msg"].removeprefix("Value error, ")
            lines.append(f"  {key}: {message}" if key else f"  {message}")  # the whole params: it names its key
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)
