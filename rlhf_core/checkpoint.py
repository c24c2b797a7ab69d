"""What an RL run writes to disk: checkpoints to resume from, and the trained models.

A checkpoint is a directory `update-NNNNNN` holding accelerate's state (model, optimizer, scheduler, RNG states),
`trainer_state.json` (the run's position and config) and, with `sync_ref_model`, the moved reference. It is written
to `<name>.tmp` and renamed, so a directory without the suffix is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch import nn

from rlhf_core.config import RLConfig
from rlhf_core.data import PromptSampler
from rlhf_core.hub import save_tokenizer
from rlhf_core.jsonio import atomic_path, read_json
from rlhf_core.runtime import modifiable

REFERENCE_FILE = "reference.safetensors"
"""In a checkpoint of a run with sync_ref_model: the reference as it has followed the policy."""
STATE_FILE = "trainer_state.json"
RESUME_KEYS = ("algo", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
               "total_episodes", "seed")
"""Settings a run must share with the checkpoint it resumes from: they fix the batches and the schedule."""


@dataclass
class TrainerState:
    """Where a run stands; saved with every checkpoint."""

    update: int = 0
    """Updates completed."""
    episode: int = 0
    """Episodes (completions) consumed across all processes."""
    sampler: dict = field(default_factory=dict)
    """The prompt sampler's position."""


class CheckpointNotSaved(RuntimeError):
    """A checkpoint could not be written (a full disk): which, where, the space left, and which one is kept."""


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first (temp dirs of interrupted saves excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("update-*") if p.is_dir() and not p.name.endswith(".tmp"))


def checkpoint_due(update: int, num_updates: int, every: int) -> bool:
    """After every `every`-th update (0: never) and after the last."""
    return update == num_updates or (every > 0 and update % every == 0)


def save_checkpoint(directory: Path, accelerator: Accelerator, state: TrainerState, cfg: RLConfig,
                    sampler: PromptSampler, ref_policy: nn.Module | None) -> Path:
    """Atomically save everything needed to resume, keeping the newest `cfg.keep_checkpoints`. A save that fails (a
    full disk) leaves the previous checkpoint as it was, removes its own partial copy, and raises CheckpointNotSaved
    naming both. Every process calls it."""
    final = directory / f"update-{state.update:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
        tmp.mkdir(parents=True)  # before any rank writes its shard into it (DeepSpeed saves on every rank)
    accelerator.wait_for_everyone()
    # a rank whose directory is its node's own (Ray workers on other machines) writes its shards to its own copy
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        _write_checkpoint(tmp, accelerator, state, cfg, sampler, ref_policy)
    except Exception as err:  # a full disk is an OSError from Python's writes, a RuntimeError from torch.save's
        free_mib = shutil.disk_usage(directory).free / 2**20
        shutil.rmtree(tmp, ignore_errors=True)  # its space back; a partial save is never resumed from
        kept = list_checkpoints(directory)
        first_line = (str(err).splitlines() or [""])[0]
        raise CheckpointNotSaved(f"checkpoint {final.name} not saved in {directory} "
                                 f"({type(err).__name__}: {first_line}; {free_mib:.1f} MiB were free on its disk); "
                                 f"{f'the previous one, {kept[-1].name}, is kept' if kept else 'none kept yet'}: "
                                 "free space and run again to resume from it") from err
    if accelerator.is_main_process:
        _keep(tmp, final, directory, cfg.keep_checkpoints)
    accelerator.wait_for_everyone()
    if tmp.exists():  # this rank's own copy (node-local): the main process renamed a shared one already
        _keep(tmp, final, directory, cfg.keep_checkpoints)
    return final


def _keep(tmp: Path, final: Path, directory: Path, keep: int) -> None:
    """Move a complete save into place and drop all but the newest `keep` checkpoints."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old)


def _write_checkpoint(tmp: Path, accelerator: Accelerator, state: TrainerState, cfg: RLConfig,
                      sampler: PromptSampler, ref_policy: nn.Module | None) -> None:
    accelerator.save_state(str(tmp), safe_serialization=True)  # model, optimizer, scheduler, RNG states
    accelerator.wait_for_everyone()  # every rank's shard is written before the main process renames the directory
    if cfg.sync_ref_model:  # the reference has moved: resuming from the initial one would differ
        with modifiable(ref_policy):  # ZeRO-3: whole on every rank (every rank joins), rank 0 writes it
            if accelerator.is_main_process:
                save_file({k: v.contiguous() for k, v in ref_policy.state_dict().items()}, tmp / REFERENCE_FILE)
    if accelerator.is_main_process:
        state.sampler = sampler.state_dict()
        meta = {"trainer": asdict(state), "config": cfg.model_dump(mode="json")}
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2))


def load_checkpoint(path: str | Path, accelerator: Accelerator, cfg: RLConfig, sampler: PromptSampler,
                    ref_policy: nn.Module | None) -> TrainerState:
    """Restore a checkpoint written by `save_checkpoint` into the prepared model, optimizer, scheduler, RNGs, the
    reference and `sampler`; returns where the run stood. Refuses one made with other `RESUME_KEYS`."""
    path = Path(path)
    meta_file = path / STATE_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint: {meta_file.name} is missing")
    meta = read_json(meta_file)
    saved = RLConfig.model_validate(meta["config"])
    for key in RESUME_KEYS:
        if getattr(saved, key) != getattr(cfg, key):
            raise ValueError(f"checkpoint {path} was made with {key}={getattr(saved, key)!r}, "
                             f"this run has {key}={getattr(cfg, key)!r}")
    accelerator.load_state(str(path))
    if cfg.sync_ref_model:
        with modifiable(ref_policy):
            ref_policy.load_state_dict(load_file(path / REFERENCE_FILE, device=str(accelerator.device)))
    state = TrainerState(**meta["trainer"])
    sampler.load_state_dict(state.sampler)
    return state


def save_pretrained(accelerator: Accelerator, engine: nn.Module, model: nn.Module, policy_dir: str | Path,
                    tokenizer=None, value_dir: str | Path | None = None) -> None:
    """Save `model`'s policy (with `tokenizer`; and its value model) as safetensors, atomically. `engine` is `model`
    as accelerate prepared it. Every process must call it: the full state dict is gathered first (ZeRO-3 shards it
    across ranks), then the main process writes."""
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(engine)  # {"policy.*", "value.*"}: PolicyAndValue's parameters
    if not accelerator.is_main_process:
        return
    for part, target, extra in (("policy", policy_dir, tokenizer), ("value", value_dir, None)):
        module = getattr(model, part)
        if target is None or module is None:
            continue
        own = {k.removeprefix(f"{part}."): v for k, v in state.items() if k.startswith(f"{part}.")}
        with atomic_path(target, directory=True) as tmp:
            module.save_pretrained(tmp, state_dict=own, safe_serialization=True)
            if extra is not None:
                save_tokenizer(extra, tmp)
