"""The train stage on a 2-node Ray cluster against the same 2-process torchrun launch: wall time and peak memory.

    python bench/ray_vs_torchrun.py                    # 2 pairs, 1024 episodes (32 updates) of profiles/cpu-ray.yaml
    python bench/ray_vs_torchrun.py --episodes 4096 --pairs 3

One workspace is made once (prepare .. inspect of the cpu-ray profile, in process); then each pair runs
`rlhf stage train --profile cpu-ray` twice on copies of it, alternating which goes first: with
`runtime.launcher=local` (torchrun, 2 gloo ranks on this machine) and with the Ray launcher on a 2-node Ray
cluster of this machine (bench/ray_cluster.py: 1 CPU per node, one rank per node). Both write the same bytes (checked
here, as tests/test_ray.py does). Reported per side, as medians over the pairs: the stage's wall time (from the
command's start to its exit: the driver's cluster join, the inputs' and outputs' trips through the shared storage
and the ranks' start are Ray's cost), the train loop's episodes/s (steady state, from the train log), the peak RSS
of each rank and of the stage process. Prints JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))
from ray_cluster import LocalRayCluster  # noqa: E402

SETUP_STAGES = ("prepare", "validate", "sft", "reward-model", "inspect")
OUTPUTS = ("models/policy", "metrics/train.json", "metrics/train_history.json")


def make_workspace(root: Path) -> Path:
    root.mkdir(parents=True)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    shutil.copytree(REPO / "profiles", root / "profiles")
    env = {**os.environ, "RLHF_TRACKING": "off"}
    for stage in SETUP_STAGES:  # one process each: the stages' own launch, on this machine
        subprocess.run([BIN / "rlhf", "stage", stage, "--profile", "cpu-ray", "--set", "runtime.launcher=local"],
                       cwd=root, env=env, check=True, capture_output=True)
    return root


class PeakRss:
    """Samples the RSS of the processes `select` returns every 0.2 s; keeps each one's peak (MiB) by name."""

    def __init__(self, select):
        self.select, self.peaks, self._stop = select, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            for name, proc in self.select():
                try:
                    rss = proc.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                self.peaks[name] = max(self.peaks.get(name, 0.0), rss)
            time.sleep(0.2)


def run_side(side: str, workspace: Path, cluster: LocalRayCluster, episodes: int) -> dict:
    env = {**os.environ, "RLHF_TRACKING": "off", "OMP_NUM_THREADS": "1", **cluster.env}
    args = [BIN / "rlhf", "stage", "train", "--profile", "cpu-ray", "--set", f"train.total_episodes={episodes}",
            "--set", f"runtime.launcher={'ray' if side == 'ray' else 'local'}"]
    start = time.perf_counter()
    proc = subprocess.Popen(args, cwd=workspace, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ranks():
        try:
            stage = psutil.Process(proc.pid)
            found = [("stage", stage)]
            if side == "ray":
                workers = [p for p in cluster.ray_processes() if "RayTrainWorker" in p.name() + " ".join(p.cmdline()[:1])]
            else:
                workers = [p for p in stage.children(recursive=True) if "rlhf" in " ".join(p.cmdline()[1:3])]
            return found + [(f"rank{i}", p) for i, p in enumerate(sorted(workers, key=lambda p: p.pid))]
        except psutil.Error:
            return []

    with PeakRss(ranks) as memory:
        output, _ = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{side}: exit {proc.returncode}\n{output[-4000:]}")
    log = [json.loads(line) for line in (workspace / "reports" / "execution" / "train_log.jsonl").read_text().splitlines()]
    steady = log[1:] or log
    return {"wall_s": wall, "episodes_per_s": statistics.median(row["eps"] for row in steady),
            "peak_rss_mib": {k: round(v, 1) for k, v in sorted(memory.peaks.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1024, help="train.total_episodes (32 per update)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given (default: a temp folder)")
    args = parser.parse_args()
    base = args.workdir or Path(tempfile.mkdtemp(prefix="ray-vs-torchrun-"))
    template = base / "workspace"
    if not (template / "models" / "reward").is_dir():
        make_workspace(template)
    cluster = LocalRayCluster(base / "cluster").start()
    results = {"ray": [], "torchrun": []}
    try:
        for pair in range(args.pairs):
            order = ("torchrun", "ray") if pair % 2 == 0 else ("ray", "torchrun")
            copies = {}
            for side in order:
                copies[side] = base / f"pair{pair}-{side}"
                shutil.rmtree(copies[side], ignore_errors=True)
                shutil.copytree(template, copies[side])
                results[side].append(run_side(side, copies[side], cluster, args.episodes))
                print(side, json.dumps(results[side][-1]), file=sys.stderr, flush=True)
            for relative in OUTPUTS:  # the same bytes, as tests/test_ray.py checks
                a, b = copies["ray"] / relative, copies["torchrun"] / relative
                files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file()) if a.is_dir() else [Path()]
                assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files), f"{relative} differs"
    finally:
        cluster.stop()
    report = {"episodes": args.episodes, "pairs": args.pairs, "commit": _commit()}
    for side, runs in results.items():
        report[side] = {"wall_s": statistics.median(r["wall_s"] for r in runs),
                        "wall_s_runs": [round(r["wall_s"], 1) for r in runs],
                        "episodes_per_s": statistics.median(r["episodes_per_s"] for r in runs),
                        "peak_rss_mib": {k: max(r["peak_rss_mib"].get(k, 0) for r in runs)
                                         for k in runs[0]["peak_rss_mib"]}}
    report["ray_wall_x_torchrun"] = report["ray"]["wall_s"] / report["torchrun"]["wall_s"]
    report["ray_start_cost_s"] = report["ray"]["wall_s"] - report["torchrun"]["wall_s"] * (
        report["torchrun"]["episodes_per_s"] / report["ray"]["episodes_per_s"])
    print(json.dumps(report, indent=2))
    print("\n| side | wall s (runs) | train ep/s | peak RSS MiB (stage, rank0, rank1) |\n|---|---|---|---|")
    for side in ("torchrun", "ray"):
        r = report[side]
        rss = ", ".join(f"{r['peak_rss_mib'].get(k, 0):.0f}" for k in ("stage", "rank0", "rank1"))
        print(f"| {side} | {r['wall_s']:.1f} ({', '.join(map(str, r['wall_s_runs']))}) | {r['episodes_per_s']:.1f} | {rss} |")
    print(f"\nRay x torchrun (wall): {report['ray_wall_x_torchrun']:.2f}; Ray's start cost ~{report['ray_start_cost_s']:.0f} s")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
