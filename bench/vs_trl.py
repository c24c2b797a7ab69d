"""Ours against TRL on exactly the same work, side by side: PPO, RLOO and GRPO episodes/s and peak memory; PPO against
TRL 1.9.0 (the last TRL with PPO), RLOO against 1.9.0 and 1.16.0, GRPO against 1.16.0 (`--algos grpo`); ours with `train.decode_graphs` off and, on CUDA,
auto (CUDA graphs in the rollout).

    python bench/vs_trl.py --device cpu                       # bench-tiny, fp32, on this machine
    python bench/vs_trl.py --device cuda --shapes pythia-1b   # Pythia-1B shapes, bf16, on one GPU

One workload is written once (model shapes and initial weights, tokenizer, prompts, spec.json) and both sides
load it: same weights, prompts, response length, batch split (16 x 4), epochs, temperature, EOS handling,
KL coefficient and precision. Each side runs in its own process under `accelerate launch` with the same
flags (ours runs all its `--decode-graphs` modes of one algorithm in one process, on the models loaded once; on
CUDA all its algorithms too, each loading only the models it needs, its peak allocation reset per run);
TRL runs in its own environment (created on first use under bench/.trl-venv with trl==1.9.0 and this
environment's torch, transformers and accelerate versions, or `--trl-python` / `--trl-pythonpath` for a
machine without internet). TRL 1.16.0 needs nothing that environment lacks (its requirements: accelerate
>= 1.10.1, transformers >= 4.56.2, datasets >= 4.7), so its environment is the same interpreter with trl 1.16.0
alone installed first on PYTHONPATH (bench/.trl116, `pip install --no-deps --target`, or `--trl116-pythonpath`):
the mechanism the GPU machine uses for its carried wheels. By default our side runs in that same environment too (`--ours-env shared`, the
repository on PYTHONPATH: `rlhf_core` needs nothing TRL's environment lacks), so both sides import the same
packages: transformers imports some optional packages whenever they are installed (scipy.optimize, +36 MiB of
RSS, comes with MLflow into the project's environment), which would otherwise be counted against one side.
`--ours-env project` runs ours in this interpreter's environment instead. Pairs alternate which side goes
first so machine drift cancels; the report is the median over pairs of steady-state episodes/s (the first
update, kernel warm-up, is left out), peak memory (RSS on CPU, peak CUDA allocation on GPU) and our per-phase
seconds. Prints JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from rlhf_core.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_VERSION = "1.9.0"
TRL116_VERSION = "1.16.0"
PEERS = {"trl": TRL_VERSION, "trl116": TRL116_VERSION}
"""Side name -> TRL version; 1.16.0 has no PPO (it left for trl.experimental, then TRL), 1.9.0 no GRPO we compare."""


def peers_of(algo: str, rloo_peers: list[str]) -> list[str]:
    """The TRL sides that run `algo`: PPO on 1.9.0, GRPO on 1.16.0, RLOO on those chosen with --rloo-peers."""
    return {"ppo": ["trl"], "grpo": ["trl116"]}.get(algo, rloo_peers)

# GPT-NeoX shapes: bench-tiny is `rlhf bench`'s world; pythia-1b is EleutherAI/pythia-1b's architecture.
SHAPES = {
    "bench-tiny": dict(model=dict(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512,
                                  max_positions=256), prompt_length=48, response_length=24),
    # bench/gpu_check.sh --cpu-dry-run: every path of the GPU check at shapes two CPU cores run in seconds
    "dry-run": dict(model=dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
                               max_positions=128), prompt_length=16, response_length=8),
    "pythia-1b": dict(model=dict(vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=8,
                                 intermediate_size=8192, max_positions=2048), prompt_length=128, response_length=53),
}


def workload_spec(shapes: str, updates: int, gradient_checkpointing: bool) -> dict:
    return {"shapes": shapes, **SHAPES[shapes], "prompts": 512, "seed": 0, "updates": updates, "warmup_updates": 1,
            "episodes_per_update": 64, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 4,
            "local_rollout_forward_batch_size": 64, "ppo_epochs": 4, "rloo_k": 2, "grpo_generations": 8,
            "temperature": 0.7,
            "kl_coef": 0.05, "learning_rate": 1e-5, "missing_eos_penalty": 1.0, "pad_token_id": 0,
            "eos_token_id": 1, "gradient_checkpointing": gradient_checkpointing}


def write_workload(spec: dict, target: Path, weights_from: Path | None = None) -> None:
    """Initial weights (policy; reward model = value model init), tokenizer and prompts, saved once for both.
    `weights_from`: a workload of the same shapes written before, linked instead (a 1B model's save: 5-9 s)."""
    target.mkdir(parents=True, exist_ok=True)
    (target / "spec.json").write_text(json.dumps(spec, indent=2))
    if weights_from is not None:
        for name in ("policy", "scorer", "prompts.json"):
            (target / name).symlink_to((weights_from / name).resolve())
        return
    import torch

    from rlhf_core.bench import word_tokenizer
    from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config

    config = tiny_gpt_neox_config(**spec["model"])
    tokenizer = word_tokenizer(spec["model"]["vocab_size"])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of a 1B model: ~10 s on the CPU
    for name, init, seed in (("policy", init_causal_lm, 0), ("scorer", init_sequence_scorer, 1)):
        with torch.device(device):
            model = init(config, seed=seed)
        model.save_pretrained(target / name, safe_serialization=True)
        tokenizer.save_pretrained(target / name)
        del model
    generator = torch.Generator().manual_seed(spec["seed"])
    prompts = torch.randint(2, spec["model"]["vocab_size"], (spec["prompts"], spec["prompt_length"]),
                            generator=generator)
    (target / "prompts.json").write_text(json.dumps(prompts.tolist()))


def trl_python(venv: Path) -> str:
    """TRL's environment: a venv beside ours with trl==1.9.0 and our torch/transformers/accelerate versions."""
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pins = [f"torch=={version('torch').split('+')[0]}", f"transformers=={version('transformers')}",
                f"accelerate=={version('accelerate')}"]
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", pins[0]], check=True)  # CPU torch first
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"trl=={TRL_VERSION}", *pins,
                        "requests"], check=True)
        (venv / ".installed").touch()
    return str(python)


def trl116_site(target: Path) -> str:
    """trl==1.16.0 alone in a folder, to put before TRL 1.9.0's environment on PYTHONPATH."""
    if not (target / ".installed").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target",
                        str(target), f"trl=={TRL116_VERSION}"], check=True)
        (target / ".installed").touch()
        (target / ".gitignore").write_text("*\n")  # an install, not the repository's
    return str(target)


def side_commands(ours_env: str, peer: str, trl_pythonpath: str | None, ours_pythonpath: str | None,
                  trl116_pythonpath: str | None = None) -> dict[str, tuple[str, Path, str | None]]:
    """(python, script, PYTHONPATH) of each side. `shared`: ours runs on TRL's interpreter and packages (TRL's
    PYTHONPATH too, where its wheels are unpacked), the repository first; `project`: on this interpreter."""
    if ours_env == "shared":
        python, extra = peer, ours_pythonpath or trl_pythonpath
    else:
        python, extra = sys.executable, ours_pythonpath or os.environ.get("PYTHONPATH")
    sides = {"ours": (python, HERE / "vs_trl_ours.py", os.pathsep.join(filter(None, [str(ROOT), extra]))),
             "trl": (peer, HERE / "vs_trl_peer.py", trl_pythonpath)}
    if trl116_pythonpath:
        sides["trl116"] = (peer, HERE / "vs_trl_peer.py", os.pathsep.join(filter(None, [trl116_pythonpath,
                                                                                         trl_pythonpath])))
    return sides


def allocator_env(setting: str) -> dict[str, str]:
    """TRL's side's environment for `--trl-allocator`: 'same' gives glibc the thresholds our process sets itself
    (rlhf_core/allocator.py, through the variables glibc reads at start), 'default' leaves glibc's."""
    if setting == "default":
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def launch(python: str, script: Path, workload: Path, algo: str, device: str, precision: str,
           pythonpath: str | None, *extra: str, env_extra: dict[str, str] | None = None) -> list[dict]:
    """One side launched as its users launch it, on one algorithm (ours: its decode_graphs modes, `extra`, in
    turn); returns its RESULT lines."""
    cmd = [python, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", precision, "--dynamo_backend", "no", *(["--cpu", "--num_cpu_threads_per_process", str(os.cpu_count())] if device == "cpu" else []),
           str(script), str(workload), algo, *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           **(env_extra or {})}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    results = [json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{script.name} {algo} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


def ours_jobs(algos: list[str], device: str) -> list[tuple[str, str]]:
    """Our side's processes: ("ours", comma-joined algorithms) each."""
    return [("ours", algo) for algo in algos] if device == "cpu" else [("ours", ",".join(algos))]


def steady_eps(result: dict, warmup: int) -> float:
    ends = result["update_ends"][warmup - 1:]  # from the end of the warm-up to the end of the last update
    return result["episodes_per_update"] * (len(ends) - 1) / (ends[-1] - ends[0])


def summarize(runs: list[dict], warmup: int) -> dict:
    """Median over pairs, per algorithm and side (ours: `ours`, decode graphs off, and `ours_graphs`, auto; TRL:
    `trl` 1.9.0 and `trl116` 1.16.0), and our/TRL ratios: our faster side against TRL's faster one, as the ratio
    of the medians and, since a shared machine drifts by tens of percent within a run, each pair's ratio (its runs
    were side by side) and their median; memory: that side of ours against that TRL's. `runs` lists each
    algorithm's runs pair by pair."""
    out = {}
    for algo in sorted({r["algo"] for r in runs}):
        row, eps = {}, {}
        for side in sorted({r["side"] for r in runs if r["algo"] == algo}, key=lambda x: (x.startswith("trl"), x)):
            mine = [r for r in runs if r["algo"] == algo and r["side"] == side]
            eps[side] = [steady_eps(r, warmup) for r in mine]
            memory_key = "peak_gpu_gib" if "peak_gpu_gib" in mine[0] else "peak_rss_mib"
            row[side] = {"episodes_per_s": statistics.median(eps[side]),
                         memory_key: statistics.median(r[memory_key] for r in mine),
                         "runs": [round(e, 2) for e in eps[side]], "version": mine[0].get("version")}
            if "phases_s" in mine[0]:
                row[side]["phases_s"] = {k: statistics.median(r["phases_s"][k] for r in mine)
                                         for k in mine[0]["phases_s"]}
        ours = [s for s in row if not s.startswith("trl")]
        theirs = [s for s in row if s.startswith("trl")]
        if not ours or not theirs:
            continue
        best = max(ours, key=lambda s: row[s]["episodes_per_s"])
        peer = max(theirs, key=lambda s: row[s]["episodes_per_s"])
        memory_key = next(k for k in row[best] if k.startswith("peak"))
        row["compared"] = [best, peer]
        row["speed_ratio"] = row[best]["episodes_per_s"] / row[peer]["episodes_per_s"]
        pairs = min(len(eps[s]) for s in row["compared"])
        row["speed_ratio_per_pair"] = [max(eps[s][i] for s in ours) / max(eps[s][i] for s in theirs)
                                       for i in range(pairs)]
        row["speed_ratio_median_of_pairs"] = statistics.median(row["speed_ratio_per_pair"])
        row["memory_ratio"] = row[best][memory_key] / row[peer][memory_key]
        out[algo] = row
    return out


def sides_of(row: dict) -> list[str]:
    return [k for k, v in row.items() if isinstance(v, dict) and "episodes_per_s" in v]


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    except ImportError:
        pass
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores"


def markdown(summary: dict, args: argparse.Namespace, spec: dict) -> str:
    lines = [f"### {datetime.date.today()} · {spec['shapes']} · {args.device} · {args.precision} · "
             f"{args.pairs} pairs", "", f"Machine: {machine()}. Our side in the {args.ours_env} environment; TRL's "
             f"allocator: {args.trl_allocator}. "
             f"Command: `python bench/{Path(__file__).name} " + " ".join(sys.argv[1:]) + "`", "",
             "| algo | side | ep/s | peak memory | runs | phases (s/update) |", "|---|---|---|---|---|---|"]
    for algo, row in summary.items():
        for side in sides_of(row):
            key = next(k for k in row[side] if k.startswith("peak"))
            unit = "GiB" if key == "peak_gpu_gib" else "MiB"
            phases = ", ".join(f"{k} {v:.3f}" for k, v in row[side].get("phases_s", {}).items())
            lines.append(f"| {algo} | {side} ({row[side].get('version') or 'ours'}) | {row[side]['episodes_per_s']:.2f} | "
                         f"{row[side][key]:.1f} {unit} | {', '.join(map(str, row[side]['runs']))} | {phases} |")
        lines.append(f"| {algo} | {row['compared'][0]} ×{row['compared'][1]} | **{row['speed_ratio']:.2f}** | "
                     f"mem ×{row['memory_ratio']:.2f} | per pair "
                     f"{', '.join(f'{r:.2f}' for r in row['speed_ratio_per_pair'])} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                        help="default: bench-tiny on cpu, pythia-1b on cuda")
    parser.add_argument("--precision", choices=["no", "bf16", "fp16"], default=None,
                        help="accelerate launch --mixed_precision for both sides (default: no on cpu, bf16 on cuda)")
    parser.add_argument("--algos", nargs="+", choices=["ppo", "rloo", "grpo"], default=["ppo", "rloo"],
                        help="grpo: against TRL 1.16.0's GRPOTrainer at GRPOConfig's defaults (beta 0, dapo)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating ours/TRL pairs per algorithm")
    parser.add_argument("--updates", type=int, default=6, help="updates per run; the first is warm-up")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--trl-python", default=None, help="python of an environment with trl==1.9.0")
    parser.add_argument("--trl-pythonpath", default=None, help="PYTHONPATH for TRL's side (wheels unpacked)")
    parser.add_argument("--rloo-peers", nargs="+", choices=sorted(PEERS), default=["trl", "trl116"],
                        help="TRL sides for RLOO: trl (1.9.0), trl116 (1.16.0); PPO has trl only")
    parser.add_argument("--trl116-pythonpath", default=None,
                        help="a folder with trl 1.16.0 alone (default: bench/.trl116, installed on first use)")
    parser.add_argument("--decode-graphs", nargs="+", choices=["off", "auto"], default=None,
                        help="our train.decode_graphs modes, one process (default: off auto on cuda, off on cpu)")
    parser.add_argument("--workload-dir", type=Path, default=None,
                        help="write the workload here and keep it (default: a temporary folder)")
    parser.add_argument("--weights-from", type=Path, default=None,
                        help="link the weights and prompts of a workload of the same shapes written before")
    parser.add_argument("--ours-env", choices=["shared", "project"], default="shared",
                        help="shared: our side in TRL's environment (same packages); project: in this one")
    parser.add_argument("--ours-pythonpath", default=None, help="PYTHONPATH for our side (default: inherited)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the summary here")
    parser.add_argument("--trl-allocator", choices=["same", "default"], default="same",
                        help="same: TRL's side keeps freed memory as ours does (glibc's thresholds, "
                             "rlhf_core/allocator.py); default: glibc's own")
    args = parser.parse_args()
    shapes = args.shapes or ("pythia-1b" if args.device == "cuda" else "bench-tiny")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "no")
    spec = workload_spec(shapes, args.updates, args.gradient_checkpointing)
    graph_modes = args.decode_graphs or (["off", "auto"] if args.device == "cuda" else ["off"])
    peer = args.trl_python or trl_python(HERE / ".trl-venv")
    trl116 = None
    if "grpo" in args.algos or ("rloo" in args.algos and "trl116" in args.rloo_peers):
        trl116 = args.trl116_pythonpath or trl116_site(HERE / ".trl116")
    runs, failed = [], []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        workload = args.workload_dir or Path(tmp)
        write_workload(spec, workload, args.weights_from)
        sides = side_commands(args.ours_env, peer, args.trl_pythonpath, args.ours_pythonpath, trl116)
        for pair in range(args.pairs):
            # TRL: one process per version and algorithm; ours: the same on the CPU, where a process's peak RSS
            # cannot be reset between runs (one process for PPO then RLOO reported PPO's peak as RLOO's), and one
            # process for all on CUDA, where a 1B model's load dominates and the peak allocation is reset per run
            jobs = ours_jobs(args.algos, args.device) + [
                (peer, algo) for algo in args.algos
                for peer in peers_of(algo, args.rloo_peers) if peer in sides]
            for side, algo in jobs if pair % 2 == 0 else jobs[::-1]:  # alternating which side goes first
                python, script, pythonpath = sides[side]
                extra = [",".join(graph_modes)] if side == "ours" else []
                try:
                    results = launch(python, script, workload, algo, args.device, args.precision, pythonpath, *extra,
                                     env_extra=None if side == "ours" else allocator_env(args.trl_allocator))
                except RuntimeError as error:  # recorded; the other sides still run
                    print(error, file=sys.stderr, flush=True)
                    failed.append({"side": side, "algo": algo, "error": str(error)[-2000:]})
                    results = []
                for result in results:
                    result["side"] = result["side"] if side == "ours" else side
                    runs.append(result)
                    memory = {k: round(v, 1) for k, v in result.items() if k.startswith("peak")}
                    print(f"pair {pair} {result['algo']} {result['side']}: "
                          f"{steady_eps(result, spec['warmup_updates']):.2f} episodes/s {memory} "
                          f"{result.get('phases_s', '')}", file=sys.stderr, flush=True)
                if args.json:  # every finished run, so a run cut short keeps what it measured
                    args.json.write_text(json.dumps({"spec": spec, "runs": runs, "failed": failed}, indent=2))
    summary = summarize(runs, spec["warmup_updates"])
    if args.json:
        args.json.write_text(json.dumps({"spec": spec, "runs": runs, "failed": failed, "summary": summary}, indent=2))
    print(json.dumps(summary, indent=2))
    print(markdown(summary, args, spec))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
