"""The one object between the trainers and the hardware: device, mixed precision, frozen-model dtype,
gradient checkpointing and attention kernel, from `RuntimeConfig`, checked before any model loads.

Trainers receive its Accelerator and never choose a device or a precision themselves, so the CPU, one GPU
and several share one code path; frozen models go through `frozen`, trained ones through `trainable`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch import nn

from rlhf_core.allocator import keep_freed_memory
from rlhf_core.config import RuntimeConfig
from rlhf_core.models import disable_dropout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIXED = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RuntimeSettingError(ValueError):
    """A runtime setting this machine cannot honour; the message names the key and the fix."""


def device_of(cfg: RuntimeConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def check(cfg: RuntimeConfig) -> None:
    """Reject what this machine cannot run, before any model loads (RuntimeSettingError naming the key)."""
    device = device_of(cfg)
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeSettingError("runtime.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if cfg.mixed_precision == "fp16" and device != "cuda":
        raise RuntimeSettingError("runtime.mixed_precision fp16 needs a CUDA device; on the CPU use bf16")
    if cfg.mixed_precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise RuntimeSettingError("runtime.mixed_precision bf16: this GPU has no bf16 (pre-Ampere); use fp16")
    if cfg.attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise RuntimeSettingError("runtime.attn_implementation flash_attention_2 needs the flash-attn package "
                                "(pip install flash-attn --no-build-isolation); 'sdpa' needs nothing")
        if device != "cuda":
            raise RuntimeSettingError("runtime.attn_implementation flash_attention_2 runs on CUDA only; use 'sdpa'")
    if cfg.accelerate_config is not None:
        if not Path(cfg.accelerate_config).is_file():
            raise RuntimeSettingError(f"runtime.accelerate_config {cfg.accelerate_config}: no such file; the "
                                      "configs shipped are infra/accelerate/*.yaml")
        check_fp16_loss_scaling(cfg)


def check_fp16_loss_scaling(cfg: RuntimeConfig) -> None:
    """fp16 under DeepSpeed ZeRO-3 trains only with loss scaling (fp16 gradients underflow without it):
    refuse a DeepSpeed JSON that disables fp16 or fixes the loss scale at 1 while the launch asks for fp16.
    Without a JSON accelerate configures dynamic loss scaling itself."""
    import json

    import yaml

    path = Path(cfg.accelerate_config)
    try:
        launch = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise RuntimeSettingError(f"runtime.accelerate_config {path}: not valid YAML ({error})") from None
    deepspeed = launch.get("deepspeed_config") or {}
    precision = launch.get("mixed_precision") or cfg.mixed_precision
    ds_file = deepspeed.get("deepspeed_config_file")
    if launch.get("distributed_type") != "DEEPSPEED" or precision != "fp16" or not ds_file:
        return
    ds_path = (path.parent / ds_file) if not Path(ds_file).is_absolute() else Path(ds_file)
    if not ds_path.is_file():
        raise RuntimeSettingError(f"{path}: deepspeed_config_file {ds_file}: no such file")
    ds = json.loads(ds_path.read_text())
    stage = (ds.get("zero_optimization") or {}).get("stage", deepspeed.get("zero_stage"))
    fp16 = ds.get("fp16") or {}
    if stage == 3 and (not fp16.get("enabled", False) or fp16.get("loss_scale", 0) == 1):
        raise RuntimeSettingError(f"{ds_path}: fp16 under ZeRO-3 without loss scaling (fp16.enabled "
                                  f"{fp16.get('enabled')}, loss_scale {fp16.get('loss_scale')}); set "
                                  '"fp16": {"enabled": true, "loss_scale": 0} (dynamic) or use bf16')


def adamw(model: nn.Module, accelerator: Accelerator, *, lr: float, weight_decay: float = 0.0,
          eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters, made before `accelerator.prepare`. One fused kernel steps every
    tensor at once on a CPU or a GPU (torch's default steps each tensor with ~10 small ops: 1.8 ms against 0.4 ms
    per step for the demo's 28-tensor SFT model); DeepSpeed steps its own flattened partitions, so it gets the
    plain one."""
    deepspeed = accelerator.state.deepspeed_plugin is not None
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, eps=eps,
                             weight_decay=weight_decay, fused=None if deepspeed else True)


LR_SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def lr_schedule(kind: str, optimizer: torch.optim.Optimizer, *, warmup_steps: int,
                total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' `get_scheduler(kind, optimizer, num_warmup_steps=..., num_training_steps=...)` for the kinds
    our configs name, with its arithmetic as it is ("constant" ignores the warmup, as there), checked rate by rate
    in tests/test_runtime.py. Not imported from there: `transformers.optimization` imports `trainer_utils`, which
    imports peft wherever it is installed: +15 MiB of peak RSS and ~1 s in every training process, LoRA or not."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr_scheduler: expected one of {', '.join(LR_SCHEDULES)}, got {kind!r}")
    rate = partial(_LR_RATES[kind], warmup=warmup_steps, total=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, rate)


def _warmup_rate(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _linear_rate(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup_rate(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine_rate(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup_rate(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def _constant_rate(step: int, *, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup_rate(step: int, *, warmup: int, total: int) -> float:
    return float(step) / float(max(1.0, warmup)) if step < warmup else 1.0


_LR_RATES = {"linear": _linear_rate, "cosine": _cosine_rate, "constant": _constant_rate,
             "constant_with_warmup": _constant_with_warmup_rate}


def configure_deepspeed(accelerator: Accelerator, *, micro_batch_size: int, max_grad_norm: float | None) -> None:
    """Settle the DeepSpeed config before `accelerator.prepare`, from the trainer's config: a no-op without DeepSpeed.

    - `train_micro_batch_size_per_gpu`: accelerate reads it from a prepared dataloader; the trainers prepare none.
    - `gradient_clipping`: DeepSpeed clips inside its step, and accelerate's `clip_grad_norm_` only reads the norm
      there; left "auto", accelerate fills 1.0 whatever the config says. The params are the truth (as for the
      precision): `max_grad_norm`, None meaning none (0).
    - ZeRO-3 gathers the whole weights to save (`get_state_dict`), whatever the accelerate config says.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_clipping"] = 0.0 if max_grad_norm is None else max_grad_norm
    if plugin.zero_stage == 3:
        config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True


def averaged_over(accelerator: Accelerator) -> int:
    """How many backward passes each gradient is averaged over: accelerate divides every loss by the accumulation
    steps, and DDP/DeepSpeed average gradients over the processes. A trainer multiplies its loss by this to undo
    both and take the exact mean over a mini-batch's units itself (transformers' `num_items_in_batch` fix)."""
    return accelerator.gradient_accumulation_steps * accelerator.num_processes


def launch_layout(accelerator: Accelerator) -> dict[str, int | str]:
    """What a stage that ran a model records of the launch it really ran under (metrics and MLflow params)."""
    return {"num_processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type.value)}


def zero_stage(accelerator: Accelerator) -> int:
    """The DeepSpeed ZeRO stage the accelerator runs (0: no DeepSpeed)."""
    plugin = accelerator.state.deepspeed_plugin
    return 0 if plugin is None else int(plugin.zero_stage)


@contextmanager
def whole_weights(accelerator: Accelerator, engine: nn.Module) -> Iterator[None]:
    """Under DeepSpeed ZeRO-3 each rank holds a shard of `engine`'s (a prepared model's) weights: inside the block
    they are whole on every rank, gathered once, and ZeRO-3's module hooks are off, so the model runs forwards
    (generation, evaluation) on one rank or on all without any collective and is saved as it is. Every rank enters
    the block. On whole weights the hooks would fetch nothing, but their bookkeeping on every submodule at every
    token made one H100 rollout 7 s instead of 1 s. A no-op without ZeRO-3."""
    if zero_stage(accelerator) != 3:
        yield
        return
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with deepspeed.zero.GatheredParameters(list(engine.parameters()), modifier_rank=None):
        _remove_zero3_hooks(offload)
        try:
            yield
        finally:
            _restore_zero3_hooks(offload)


def modifiable(model: nn.Module) -> AbstractContextManager:
    """A model whose weights are changed in place inside the block (a reference following the policy, a checkpoint
    loaded into it): under ZeRO-3 (its parameters sharded, `ds_id`) gathered whole on every rank, every rank joining,
    and rank 0's values sharded back at the end. A no-op for a model that is whole."""
    params = list(model.parameters())
    if not params or not hasattr(params[0], "ds_id"):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def _remove_zero3_hooks(offload) -> None:
    """Take ZeRO-3's fetch/release hooks off every submodule (`offload`: the engine's DeepSpeedZeRoOffload)."""
    for param in offload.module.parameters():
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _restore_zero3_hooks(offload) -> None:
    """Put the hooks back; the recorded fetch order is stale after forwards it did not see, so drop it."""
    coordinator = offload.param_coordinator
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _release_other_state(mixed_precision: str | None, cpu: bool) -> None:
    """accelerate keeps one state per process and refuses another precision. A stage builds one Runtime in
    its own process; a notebook or an in-process test that runs several stages may ask for another one:
    then the single-process state is dropped and rebuilt (never under a launcher, whose state is the run's)."""
    state = AcceleratorState._shared_state
    if not state or state.get("distributed_type") != DistributedType.NO:
        return
    if (mixed_precision is not None and state.get("_mixed_precision") != mixed_precision) or state.get("_cpu") != cpu:
        AcceleratorState._reset_state(reset_partial_state=True)


def prefer_this_environments_ninja() -> None:
    """Put this interpreter's folder first on PATH when it has a `ninja`. DeepSpeed JIT-builds its ops with the
    first `ninja` on PATH into one cache folder; a machine with two (Debian's 1.11 and the `ninja` wheel's 1.13 in
    this environment) keeps build logs in two formats, so each rebuilt an op after the other had run."""
    here = str(Path(sys.executable).parent)
    rest = [folder for folder in os.environ.get("PATH", "").split(os.pathsep) if folder and folder != here]
    if shutil.which("ninja", path=here):
        os.environ["PATH"] = os.pathsep.join([here, *rest])


def skip_deepspeeds_cpu_inference_all_reduce() -> None:
    """DeepSpeed's torch backend JIT-compiles a shared-memory all-reduce on the CPU as it starts (~90 s of both
    cores on 2, ~240 s beside other work, and again whenever the environment's path changes, as in every fresh
    clone). Only `inference_all_reduce` uses it, DeepSpeed-Inference's tensor parallelism, which no stage runs:
    training reduces through torch.distributed (gloo). Marked incompatible, the op is skipped as on a machine
    without a compiler (DeepSpeed keeps the table of compatible ops in its module for such edits)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class Runtime:
    """The Accelerator of this process and the placement of every model a stage uses."""

    def __init__(self, cfg: RuntimeConfig, gradient_accumulation_steps: int = 1):
        check(cfg)
        self.cfg = cfg
        keep_freed_memory()  # each step reuses the pages the last one freed (allocator.py)
        if device_of(cfg) == "cpu":  # DeepSpeed (probed by transformers at load) would warn that it found no GPU
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # under a launcher, accelerate's env (ACCELERATE_MIXED_PRECISION, the DeepSpeed plugin) is the truth
        mixed = None if os.environ.get("ACCELERATE_MIXED_PRECISION") else cfg.mixed_precision
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
        # cpu=True would make accelerate ignore a DeepSpeed launch (DeepSpeed picks its CPU accelerator itself)
        cpu = device_of(cfg) == "cpu" and not deepspeed
        _release_other_state(mixed, cpu=cpu)
        if deepspeed:
            prefer_this_environments_ninja()
        if deepspeed and device_of(cfg) == "cpu":
            skip_deepspeeds_cpu_inference_all_reduce()
            # Without a backend accelerate counts one process on a CPU DeepSpeed launch (it finds no GPU backend)
            # while DeepSpeed's group has them all: name gloo, and both agree on the world.
            PartialState(backend="gloo")
        self._inference_engines: list[nn.Module] = []
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=cpu,
                                       gradient_accumulation_steps=gradient_accumulation_steps,
                                       step_scheduler_with_optimizer=False)

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def zero_stage(self) -> int | None:
        """The DeepSpeed ZeRO stage of this launch (None without DeepSpeed)."""
        plugin = self.accelerator.state.deepspeed_plugin
        return None if plugin is None else plugin.zero_stage

    @property
    def layout(self) -> dict[str, int | str]:
        """num_processes and distributed_type of this launch, as the stage's metrics record them."""
        return launch_layout(self.accelerator)

    def whole_weights(self, engine: nn.Module | None) -> AbstractContextManager:
        """`whole_weights` of a prepared model (None: nothing to gather); every rank enters it."""
        return nullcontext() if engine is None else whole_weights(self.accelerator, engine)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def frozen_dtype(self) -> torch.dtype:
        if self.cfg.frozen_dtype != "auto":
            return DTYPES[self.cfg.frozen_dtype]
        return MIXED[self.accelerator.mixed_precision]

    @property
    def load_kwargs(self) -> dict:
        """Keyword arguments for `from_pretrained` of every model the stage loads."""
        return {"attn_implementation": self.cfg.attn_implementation}

    def autocast(self) -> AbstractContextManager:
        """The training forward's precision, for forwards outside the prepared model (rollout, scoring)."""
        return self.accelerator.autocast()

    def load_frozen(self, loader: Callable[..., nn.Module], source, *, sharded: bool = True, **kwargs) -> nn.Module:
        """`loader(source)` (load_policy, load_scorer_model) as a frozen model (`frozen`), loaded whole on this
        rank: under DeepSpeed ZeRO-3 transformers would partition it at load, and no engine would ever gather it.
        `sharded=False`: kept whole under ZeRO-3 too, for a model the main process alone runs (evaluation)."""
        with self._unpartitioned_loading():
            model = loader(source, **self.load_kwargs, **kwargs)
        return self.frozen(model, sharded=sharded)

    def load_whole(self, loader: Callable[..., nn.Module], source, **kwargs) -> nn.Module:
        """`loader(source)` on this device, whole on this rank and in its own dtype (a pretrained model a stage
        evaluates and saves as it is), whatever the launch."""
        with self._unpartitioned_loading():
            return loader(source, **self.load_kwargs, **kwargs).to(self.device)

    @contextmanager
    def _unpartitioned_loading(self) -> Iterator[None]:
        plugin = self.accelerator.state.deepspeed_plugin
        if plugin is None or plugin.zero_stage != 3:
            yield
            return
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # accelerate registers the ZeRO-3 config with transformers at start
        try:
            yield
        finally:
            plugin.set_deepspeed_weakref()

    def frozen(self, model: nn.Module, *, sharded: bool = True) -> nn.Module:
        """A model that is only evaluated: no dropout, no grad, on this device in the frozen dtype; under
        DeepSpeed ZeRO-3 (unless `sharded` is False) sharded over the ranks like the trained models (an inference
        engine: every rank must then run its forwards)."""
        disable_dropout(model)
        model = model.to(device=self.device, dtype=self.frozen_dtype).eval().requires_grad_(False)
        return self._sharded_for_inference(model) if sharded and self.zero_stage == 3 else model

    def _sharded_for_inference(self, model: nn.Module) -> nn.Module:
        """A ZeRO-3 inference engine (no optimizer): each rank keeps 1/N of the weights and gathers a layer at a
        time in each forward, so the reference and reward model cost no more memory per GPU than the trained
        policy does. Every rank must run the same forwards: the trainer's equal local batches in equal chunks."""
        import deepspeed

        hidden = getattr(model.config, "hidden_size", 1024)
        config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            # small tensors (norms, biases) stay whole on every rank; no prefetch: frozen forwards are few
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10 * hidden,
                                  "stage3_prefetch_bucket_size": 0},
            "bf16": {"enabled": self.frozen_dtype == torch.bfloat16},
            "fp16": {"enabled": self.frozen_dtype == torch.float16},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        self._inference_engines.append(engine)  # alive as long as the runtime: its hooks gather the shards
        # the model itself, its ZeRO-3 hooks installed: the engine's own attributes (config...) would shadow
        # the model's for callers that read them
        return engine.module

    def trainable(self, model: nn.Module) -> nn.Module:
        """A model to train: fp32 weights (autocast does the mixed precision), gradient checkpointing if set."""
        if self.cfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
