"""LoRA on the policy with PEFT: the adapter from TRL's names (`PeftOptions`), a check that reads no weights, and
the saved layout, the merged model with its adapter beside it.

peft is imported inside the functions (~3.5 s): a run without LoRA never pays for it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from rlhf_core.config import PeftOptions
from rlhf_core.hub import save_tokenizer
from rlhf_core.jsonio import atomic_path

ADAPTER_DIR = "adapter"
"""A LoRA policy's folder holds the merged model (what evaluation and serving load, no peft needed) and, in this
subfolder, the adapter alone (adapter_config.json + adapter_model.safetensors)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class LoraSettingError(ValueError):
    """LoRA settings this model cannot take; the message starts with the key (TRL's name) and says what would."""


def lora_config(options: PeftOptions):
    """PEFT's LoraConfig from TRL's ModelConfig names (TRL's `get_peft_config` does the same mapping)."""
    from peft import LoraConfig

    return LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                      target_modules=options.lora_target_modules, modules_to_save=options.lora_modules_to_save,
                      task_type=options.lora_task_type, use_rslora=options.use_rslora)


def with_lora(model: PreTrainedModel, options: PeftOptions, seed: int) -> nn.Module:
    """`model` wrapped in a LoRA adapter: only the adapter (and lora_modules_to_save) requires grad. lora_A's random
    init is seeded: every rank and every launch layout starts from the same adapter (lora_B starts at 0)."""
    from peft import get_peft_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(model, lora_config(options))


def check_lora(config: PretrainedConfig, options: PeftOptions) -> None:
    """Wrap a weightless copy of the architecture (built on the meta device: no weights read or allocated), so
    PEFT's own matching and module-type checks run before any model loads. LoraSettingError naming the key."""
    from peft import get_peft_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = _adaptable_layers(model)
    for name in options.lora_modules_to_save or []:
        if not any(n == name or n.endswith(f".{name}") for n, _ in model.named_modules()):
            raise LoraSettingError(f"lora_modules_to_save: {name!r} is not a module of this {config.model_type} "
                                   f"model; its layers: {', '.join(layers)}")
    try:
        get_peft_model(model, lora_config(options), low_cpu_mem_usage=True)
    except ValueError as err:  # peft's NoMatchingPeftModuleError is one
        absent = "not found in" in str(err)
        why = "not in this model" if absent else f"PEFT cannot wrap this model so ({str(err).split('. ')[0]})"
        hint = (" (a string is a regex over whole module names; a list matches their last parts)"
                if isinstance(options.lora_target_modules, str) else "")
        raise LoraSettingError(f"lora_target_modules {options.lora_target_modules!r}: {why}; name some of the "
                               f"{config.model_type} model's layers{hint}: {', '.join(layers)}") from None


def _adaptable_layers(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear and embedding layers: what lora_target_modules can name."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, Conv1D)
    return sorted({name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, kinds)})


def save_lora_policy(adapter_dir: str | os.PathLike, base: PreTrainedModel, target: str | os.PathLike,
                     tokenizer, base_name: str) -> None:
    """`target`: `base` (a fresh copy: it is merged into) with the adapter merged in (safetensors) + tokenizer,
    and the adapter alone in `target/adapter/`, recording `base_name` as its base (a path relative to where it
    is loaded from, so the saved bytes do not depend on the machine). Written atomically; the merge is PEFT's
    (`merge_and_unload`), from the adapter as saved, so what is written is what reloads."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    with atomic_path(target, directory=True) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)
        (tmp / ADAPTER_DIR).mkdir()
        for name in ADAPTER_FILES:
            shutil.copy(Path(adapter_dir) / name, tmp / ADAPTER_DIR / name)
        config_file = tmp / ADAPTER_DIR / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config["base_model_name_or_path"] = base_name
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
