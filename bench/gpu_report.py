"""The report of `bench/gpu_check.sh`: one JSON file and a Markdown table from what its parts left in its work folder.

    python bench/gpu_report.py WORK OUT [--dry-run 0|1]   # writes OUT/gpu_check.json and OUT/gpu_check.md
    python bench/gpu_report.py --environment FILE         # the versions and the device, as JSON

Each target of issue 39 ([1/6] of its series) is checked where its figures exist (None where the part did not get that far). Exits 0
only when every part exited 0 and left its figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from vs_trl import sides_of, summarize  # noqa: E402

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "trl", "datasets", "pydantic",
            "great_expectations")
# On one H100 at Pythia-1B shapes (issue 39): PPO against TRL 1.9.0, RLOO against the faster of 1.9.0 and 1.16.0,
# GRPO against 1.16.0 (issue 43's figure on the CPU, the same bar here), our faster decode_graphs mode; a dry run
# checks the arithmetic, not the figures
ALGOS = ("ppo", "rloo", "grpo")
TARGETS = {"ppo_speed_x_trl": 2.5, "rloo_speed_x_trl": 2.5, "grpo_speed_x_trl": 2.5, "memory_x_trl_max": 1.0,
           "zero3_rollout_x_plain_max": 1.5, "approxkl_lr0_bf16_max": 1e-6, "decode_graphs_x_eager": 3.0}


def environment() -> dict:
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "commit": commit(),
           "cuda": torch.version.cuda, "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                                                  else f"cpu, {os.cpu_count()} cores")}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    env["nvidia_smi"] = smi.stdout.strip() if smi else None
    for name in PACKAGES:
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = None
    return env


def commit() -> str | None:
    """The commit checked (the GPU machine gets a working tree without .git: the caller passes it)."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or None


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def junit(path: Path) -> dict | None:
    """Each test's outcome from pytest's junit XML."""
    if not path.is_file():
        return None
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = ("skipped" if case.find("skipped") is not None else
                                      "failed" if failed else "passed")
    return outcomes


def vs_trl_summary(data: dict | None) -> dict | None:
    """Per algorithm: ours and TRL's steady episodes/s and peak memory, and our phases (bench/vs_trl.py)."""
    if not data or not data.get("runs"):
        return None

    return summarize(data["runs"], data["spec"]["warmup_updates"]) or None  # algorithms with ours and a TRL side


def targets(side_by_side: dict | None, tests: list[dict], decode: dict | None = None) -> dict:
    """Each target with its measured value and whether it holds (None: not measured)."""
    out = {}

    def put(name, value, holds):
        out[name] = {"target": TARGETS[name], "value": value, "holds": None if value is None else holds(value)}

    for algo in ALGOS:
        row = (side_by_side or {}).get(algo)
        put(f"{algo}_speed_x_trl", row and round(row["speed_ratio"], 2), lambda v, a=algo: v >= TARGETS[f"{a}_speed_x_trl"])
    memory = [row["memory_ratio"] for row in (side_by_side or {}).values()]
    put("memory_x_trl_max", round(max(memory), 2) if memory else None, lambda v: v <= TARGETS["memory_x_trl_max"])
    plain = {a: row["ours"]["phases_s"]["rollout"] for a, row in (side_by_side or {}).items() if "ours" in row}
    zero3 = {t["algo"]: t["phases_s"]["rollout"] for t in tests if t.get("variant") == "zero3"}
    ratios = [zero3[a] / plain[a] for a in zero3 if a in plain]
    put("zero3_rollout_x_plain_max", round(max(ratios), 2) if ratios else None,
        lambda v: v <= TARGETS["zero3_rollout_x_plain_max"])
    kls = [t["approxkl_max"] for t in tests if t.get("test") == "in_process"]
    put("approxkl_lr0_bf16_max", max(kls) if kls else None, lambda v: v < TARGETS["approxkl_lr0_bf16_max"])
    graphs = [decode[c]["decode_median_ms"] / decode[c]["decode_graphs_median_ms"] for c in ("ppo", "rloo")
              if "decode_graphs_median_ms" in (decode or {}).get(c, {})]  # per rollout, so per step
    put("decode_graphs_x_eager", round(min(graphs), 2) if graphs else None,
        lambda v: v >= TARGETS["decode_graphs_x_eager"])
    return out


def markdown(report: dict) -> str:
    env = report.get("environment") or {}
    lines = [f"### {env.get('date', '')[:10]} · {env.get('device')} · commit {env.get('commit')}"
             f"{' · CPU dry run (tiny shapes)' if report['dry_run'] else ''}", "",
             "Versions: " + ", ".join(f"{k} {env.get(k)}" for k in ("python", *PACKAGES) if k in env), "",
             "| part | exit | seconds (limit) |", "|---|---|---|"]
    lines += [f"| {p['part']} | {p['exit']} | {p['seconds']} ({p['limit_s']}) |" for p in report["parts"]]
    if report.get("vs_trl"):
        lines += ["", "| algo | side | ep/s | peak | our phases (s/update) |", "|---|---|---|---|---|"]
        for algo, row in report["vs_trl"].items():
            for side in sides_of(row):
                key = next(k for k in row[side] if k.startswith("peak"))
                phases = ", ".join(f"{k} {v:.3f}" for k, v in row[side].get("phases_s", {}).items())
                lines.append(f"| {algo} | {side} ({row[side].get('version') or 'ours'}) | "
                             f"{row[side]['episodes_per_s']:.2f} | {row[side][key]:.1f} | {phases} |")
            lines.append(f"| {algo} | {row['compared'][0]} ×{row['compared'][1]} | **{row['speed_ratio']:.2f}** | "
                         f"mem ×{row['memory_ratio']:.2f} | |")
    for failure in report.get("vs_trl_failed") or []:
        lines += ["", f"vs_trl: {failure['side']} {failure['algo']} failed: {failure['error'][-300:]}"]
    decode = report.get("decode")
    if decode:
        paths = [k[:-len("_median_ms")] for k in decode["ppo"] if k.endswith("_median_ms")]
        lines += ["", f"Decode loop ({decode['shapes']}, {decode['rows']} rows, {decode['prompt_length']} + "
                  f"{decode['response_length']} tokens), median ms per rollout (first call):", "",
                  "| case | " + " | ".join(paths) + " | ×generate |", "|---|" + "---|" * (len(paths) + 1)]
        for case in ("ppo", "rloo"):
            row = decode[case]
            speedups = ", ".join(f"{k[len('speedup_'):]} {v:.2f}" for k, v in row.items() if k.startswith("speedup_"))
            lines.append(f"| {case} | " + " | ".join(f"{row[p + '_median_ms']} ({row[p + '_first_ms']})"
                                                      for p in paths) + f" | {speedups} |")
        lines += ["", "Agreement (rows identical to generate; max |Δ log-prob| on the same history; teacher-forced "
                  "max |Δ| against the tolerance):", ""]
        for case in ("ppo", "rloo"):
            for dtype, per_path in decode[case].get("agreement", {}).items():
                lines.append(f"- {case} {dtype}: " + "; ".join(
                    f"{p} " + (f"rows {a['rows_identical']:.2f}, same-history {a['same_history_max']}, " if
                               "rows_identical" in a else "") +
                    f"forced {a['teacher_forced_max']:.2g} ({'within' if a['within_tolerance'] else 'OVER'} "
                    f"{a['tolerance']})" for p, a in per_path.items()))
    if report.get("gpu_tests"):
        lines += ["", "| test | algo | variant | ep/s | peak GiB | approxkl max | clipfrac max | phases (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in report["gpu_tests"]:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in (t.get("phases_s") or {}).items())
            lines.append(f"| {t['test']} | {t['algo']} | {t['variant']} | "
                         f"{t['episodes_per_s']} | {t.get('peak_gib')} | {t.get('approxkl_max', '')} | "
                         f"{t['clipfrac_max']} | {phases} |")
    failed = [name for name, outcome in (report.get("gpu_test_outcomes") or {}).items() if outcome == "failed"]
    if failed:
        lines += ["", "Failed tests: " + ", ".join(failed)]
    pipeline = report.get("pipeline")
    if pipeline:
        stages = ", ".join(f"{k} {v['exit']} ({v['seconds']} s)" for k, v in pipeline["stages"].items())
        train = (pipeline.get("train_execution") or {})
        lines += ["", f"Pipeline ({pipeline['shapes']}, {pipeline['updates']} updates): "
                  f"{'all stages passed' if pipeline['ok'] else 'FAILED'}; {stages}; train {train.get('eps', 0):.2f} "
                  f"ep/s, peak {train.get('gpu/peak_memory_gib', 'n/a')} GiB"]
    lines += ["", "| target | value | holds |", "|---|---|---|"]
    lines += [f"| {name} {t['target']} | {t['value']} | {t['holds']} |" for name, t in report["targets"].items()]
    return "\n".join(lines) + "\n"


def report(work: Path, dry_run: bool) -> dict:
    tests = read_jsonl(work / "gpu_tests.jsonl")
    outcomes = junit(work / "gpu_tests.xml")
    side_by_side = vs_trl_summary(read_json(work / "vs_trl.json"))
    decode = read_json(work / "decode.json")
    return {"dry_run": dry_run, "environment": read_json(work / "environment.json"),
            "parts": read_jsonl(work / "parts.jsonl"), "vs_trl": side_by_side,
            "vs_trl_runs": (read_json(work / "vs_trl.json") or {}).get("runs"),
            "vs_trl_failed": (read_json(work / "vs_trl.json") or {}).get("failed"),
            "decode": decode,
            "gpu_tests": tests, "gpu_test_outcomes": outcomes, "pipeline": read_json(work / "pipeline.json"),
            "targets": targets(side_by_side, tests, decode)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, nargs="?")
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--dry-run", type=int, default=0)
    parser.add_argument("--environment", type=Path, default=None)
    args = parser.parse_args()
    if args.environment:
        env = environment()
        args.environment.write_text(json.dumps(env, indent=2))
        print(json.dumps(env))
        return
    result = report(args.work, bool(args.dry_run))
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    (args.out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    parts = {p["part"]: p["exit"] for p in result["parts"]}  # the parts this call ran (GPU_CHECK_PARTS)
    complete = (all(code == 0 for code in parts.values())
                and ("vs_trl" not in parts or result["vs_trl"]) and ("decode" not in parts or result["decode"])
                and ("gpu_tests" not in parts or result["gpu_tests"])
                and ("pipeline" not in parts or (result["pipeline"] and result["pipeline"]["ok"])))
    sys.exit(0 if complete else 1)


if __name__ == "__main__":
    main()
