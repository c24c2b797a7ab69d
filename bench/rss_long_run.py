"""Resident memory over a long `rlhf bench` run: does keeping freed memory (rlhf_core/allocator.py) cost RSS as
updates go on?

    python bench/rss_long_run.py --algos grpo rloo ppo --updates 300 --kept 1 0

Each run is `rlhf bench --algo A --updates N --json` in its own process, with `RLHF_KEEP_FREED_MEMORY` set as
given; its RSS (VmRSS) is sampled every `--every` seconds. Reported per run: the RSS at 10 %, 50 % and 100 % of the
training time (training starts when the RSS first passes the warm-up's, read off the samples: the bench's own
warm-up is short), the peak (VmHWM), the growth from 10 % to the end, and the bench's own episodes/s. Prints JSON
and a Markdown table. RSS, not time, is the figure: it does not depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status_kib(pid: int, field: str) -> int | None:
    """A `/proc/PID/status` field in KiB (VmRSS, VmHWM), None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def run(algo: str, updates: int, kept: str, every: float) -> dict:
    env = {**os.environ, "RLHF_KEEP_FREED_MEMORY": kept}
    cmd = [sys.executable, "-m", "cli.main", "bench", "--algo", algo, "--updates", str(updates), "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    samples, peak = [], 0  # (seconds since start, RSS MiB)
    start = time.monotonic()
    while proc.poll() is None:
        rss, hwm = status_kib(proc.pid, "VmRSS"), status_kib(proc.pid, "VmHWM")
        if rss is not None:
            samples.append((time.monotonic() - start, rss / 1024))
            peak = max(peak, (hwm or 0) / 1024)
        time.sleep(every)
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    bench = json.loads(out.strip().splitlines()[-1])
    end = samples[-1][0]
    train_start = end - bench["train_s"]  # the bench times its training; the samples before it are set-up

    def at(fraction: float) -> float:
        t = train_start + fraction * bench["train_s"]
        return round(min(samples, key=lambda s: abs(s[0] - t))[1], 1)

    rss = {f"rss_{int(f * 100)}pct_mib": at(f) for f in (0.1, 0.5, 1.0)}
    return {"algo": algo, "updates": bench["updates"], "kept": kept, "episodes_per_s": bench["episodes_per_s"],
            **rss, "growth_10pct_to_end_mib": round(rss["rss_100pct_mib"] - rss["rss_10pct_mib"], 1),
            "peak_rss_mib": round(peak, 1), "bench_peak_rss_mib": bench["peak_rss_mib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["grpo", "rloo", "ppo"])
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--kept", nargs="+", default=["1", "0"], help="RLHF_KEEP_FREED_MEMORY values to run")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between RSS samples")
    args = parser.parse_args()
    rows = [run(algo, args.updates, kept, args.every) for algo in args.algos for kept in args.kept]
    print(json.dumps(rows, indent=1))
    print("\n| algo | updates | freed memory kept | ep/s | RSS at 10 % | 50 % | end | growth | peak (VmHWM) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['algo']} | {r['updates']} | {'yes' if r['kept'] == '1' else 'no'} | {r['episodes_per_s']} | "
              f"{r['rss_10pct_mib']} | {r['rss_50pct_mib']} | {r['rss_100pct_mib']} | "
              f"{r['growth_10pct_to_end_mib']:+} | {r['peak_rss_mib']} |")


if __name__ == "__main__":
    main()
