"""The whole pipeline on one machine without the hub: `tldr-pythia-1b` with its hub ids replaced by local models of
the same shapes (random weights) and generated TL;DR-style data, every stage run as DVC runs it (`rlhf stage NAME`
in a workspace), a few updates. Part of `bench/gpu_check.sh`; the same script at tiny shapes on the CPU is its
dry run.

    python bench/gpu_pipeline.py WORKSPACE [--shapes pythia-1b|dry-run] [--updates 3] [--json OUT.json]

Prints one line per stage and writes {"stages": {name: {"exit": code, "seconds": s}}, "metrics": {...}} to --json.
Tracking is off (RLHF_TRACKING=off: the GPU machine has no MLflow), so `register` records that nothing was
registered; everything else is the stage code users run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from vs_trl import SHAPES  # noqa: E402

STAGES = ["prepare", "validate", "sft", "reward-model", "inspect", "train", "evaluate", "register"]


def write_inputs(workspace: Path, shapes: dict, rows: int, seed: int = 0) -> None:
    """Random-weight SFT policy and reward model of the profile's shapes with one word-level tokenizer, and SFT and
    preference JSONL rows whose prompts fill the profile's prompt length."""
    from rlhf_core.bench import word_tokenizer
    from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config

    config = tiny_gpt_neox_config(**shapes["model"])
    tokenizer = word_tokenizer(shapes["model"]["vocab_size"])
    for name, model in (("sft_model", init_causal_lm(config, seed=seed)),
                        ("reward_model", init_sequence_scorer(config, seed=seed + 1))):
        model.save_pretrained(workspace / name, safe_serialization=True)
        tokenizer.save_pretrained(workspace / name)
        del model
    words = [f"w{i}" for i in range(2, shapes["model"]["vocab_size"])]
    rng = random.Random(seed)
    post_words = max(shapes["prompt_length"] - 8, 4)  # "POST:", "TL;DR:" and room for the template
    sft, prefs = [], []
    for _ in range(rows):
        prompt = "POST: " + " ".join(rng.choices(words, k=rng.randint(post_words // 2, post_words))) + "\nTL;DR:"
        summary = " " + " ".join(rng.choices(words, k=rng.randint(3, 12)))
        sft.append({"prompt": prompt, "completion": summary})
        prefs.append({"prompt": prompt, "chosen": summary, "rejected": " " + " ".join(rng.choices(words, k=20))})
    for name, data in (("sft.jsonl", sft), ("prefs.jsonl", prefs)):
        (workspace / name).write_text("".join(json.dumps(r) + "\n" for r in data))


def overrides(shapes: dict, updates: int, dry_run: bool) -> list[str]:
    """The profile's hub ids pointed at the local copies; a few updates of the profile's batch (64 episodes)."""
    response = shapes["response_length"]
    return ["prepare.sft=sft.jsonl", "prepare.preferences=prefs.jsonl", "prepare.tokenizer=sft_model",
            "prepare.eval_fraction=0.1", f"prepare.max_prompt_tokens={shapes['prompt_length'] + 8}",
            "sft.pretrained=sft_model", "reward_model.pretrained=reward_model",
            f"sft.eval_max_new_tokens={response}", "inspect.num_pairs=64", "inspect.num_prompts=64",
            f"train.total_episodes={64 * updates}", f"train.response_length={response}",
            f"train.checkpoint_every={updates}", "train.local_rollout_forward_batch_size=64",
            "evaluate.num_prompts=64", f"evaluate.response_length={response}", "evaluate.batch_size=64",
            *(["runtime.mixed_precision=no", "runtime.frozen_dtype=auto"] if dry_run else [])]


def run_stages(workspace: Path, sets: list[str], timeout_s: float) -> dict:
    env = {**os.environ, "RLHF_TRACKING": "off", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    stages = {}
    deadline = time.monotonic() + timeout_s
    for name in STAGES:
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "cli.main", "stage", name, "--profile", "tldr-pythia-1b",
               *[x for item in sets for x in ("--set", item)]]
        try:
            proc = subprocess.run(cmd, cwd=workspace, env=env, capture_output=True, text=True,
                                  timeout=max(deadline - time.monotonic(), 1))
            code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as timeout:
            code, tail = "timeout", str(timeout.stderr or "")[-3000:]
        stages[name] = {"exit": code, "seconds": round(time.perf_counter() - start, 1)}
        print(f"stage {name}: exit {code} in {stages[name]['seconds']} s", flush=True)
        if code != 0:
            stages[name]["log_tail"] = tail
            print(tail, file=sys.stderr, flush=True)
            break
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workspace", type=Path)
    parser.add_argument("--shapes", choices=["pythia-1b", "dry-run"], default="pythia-1b")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--rows", type=int, default=720)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all stages together")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workspace, shapes = args.workspace, SHAPES[args.shapes]
    workspace.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "params.yaml", workspace / "params.yaml")
    shutil.copytree(ROOT / "profiles", workspace / "profiles", dirs_exist_ok=True)
    start = time.perf_counter()
    write_inputs(workspace, shapes, args.rows)
    report = {"shapes": args.shapes, "updates": args.updates, "inputs_seconds": round(time.perf_counter() - start, 1)}
    report["stages"] = run_stages(workspace, overrides(shapes, args.updates, args.shapes == "dry-run"),
                                  args.timeout)
    metrics = {}
    for name in ("train", "eval", "register", "sft", "reward"):
        path = workspace / "metrics" / f"{name}.json"
        if path.is_file():
            metrics[name] = json.loads(path.read_text())
    execution = workspace / "reports" / "execution" / "train.json"
    report["metrics"] = metrics
    report["train_execution"] = json.loads(execution.read_text()) if execution.is_file() else None
    report["ok"] = all(s["exit"] == 0 for s in report["stages"].values()) and len(report["stages"]) == len(STAGES)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: report[k] for k in ("shapes", "ok", "stages")}, default=str))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
