"""The rollout's decode loop (rlhf_core.decode) against the `generate` path it replaced (bench/generate_path.py),
side by side in one process, at bench/vs_trl.py's shapes: bench-tiny by default (the policy of `rlhf bench`,
GPT-NeoX hidden 128, 4 layers, vocab 2048; 48-token prompts, 24 sampled tokens), pythia-1b on CUDA (128 + 53
tokens, bf16). 64 rows at temperature 0.7, stopping at EOS:

  ppo   64 distinct prompts
  rloo  32 prompts x k=2 (rows sharing a prompt prefill it once)

The paths alternate, `--repeats` times each, after one warm-up call of each (on CUDA the warm-up of `graphs`
compiles and captures its graph); all draw from the same keys, so they decode the same tokens (checked).
On CUDA a third path runs: the decode loop with `graphs` (CUDA graphs over a static cache). Prints one JSON object
(and writes it to --json): per case, the median and min wall time of each path in ms and the ratio of generate's
median to each decode path's (> 1: the decode loop is faster).

    python bench/decode_loop.py [--repeats 15] [--device cpu|cuda] [--shapes bench-tiny] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_path import generate_responses  # noqa: E402
from vs_trl import SHAPES  # noqa: E402

from rlhf_core import ops  # noqa: E402
from rlhf_core.decode import TokenChoice, decode  # noqa: E402
from rlhf_core.models import init_causal_lm, tiny_gpt_neox_config  # noqa: E402

ROWS, TEMPERATURE = 64, 0.7


def cases(shapes: dict, device: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """name -> (queries, query_mask, keys)"""
    generator = torch.Generator().manual_seed(0)
    distinct = torch.randint(2, shapes["model"]["vocab_size"], (ROWS, shapes["prompt_length"]), generator=generator)
    shared = distinct[:ROWS // 2].repeat_interleave(2, dim=0)
    keys = ops.episode_keys(0, 0, torch.arange(ROWS), torch.zeros(ROWS, dtype=torch.long))
    mask = torch.ones(ROWS, shapes["prompt_length"], dtype=torch.bool)
    return {name: (q.to(device), mask.to(device), keys.to(device)) for name, q in (("ppo", distinct), ("rloo", shared))}


def timed(fn, *args) -> tuple[float, tuple]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                        help="default: bench-tiny on cpu, pythia-1b on cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    name = args.shapes or ("pythia-1b" if cuda else "bench-tiny")
    shapes = SHAPES[name]
    with torch.device(args.device):  # a 1B model's random init on the GPU: seconds, not minutes
        policy = init_causal_lm(tiny_gpt_neox_config(**shapes["model"]), seed=0).eval()
    if cuda:
        policy = policy.to(torch.bfloat16)
    common = dict(response_length=shapes["response_length"], pad_token_id=0, stop_token_id=1, keep_logprobs=True)
    choice = TokenChoice(temperature=TEMPERATURE)
    paths = {
        "generate": lambda q, m, k: generate_responses(policy, q, m, temperature=TEMPERATURE, noise_keys=k, **common),
        "decode": lambda q, m, k: decode(policy, q, m, choice=choice, noise_keys=k, **common),
    }
    if cuda:
        paths["decode_graphs"] = lambda q, m, k: decode(policy, q, m, choice=choice, noise_keys=k, graphs=True, **common)
    report = {"device": args.device, "threads": torch.get_num_threads(), "repeats": args.repeats, "shapes": name,
              "rows": ROWS, "prompt_length": shapes["prompt_length"], "response_length": shapes["response_length"]}
    for case, inputs in cases(shapes, args.device).items():
        times: dict[str, list[float]] = {path: [] for path in paths}
        warmup = {path: timed(fn, *inputs) for path, fn in paths.items()}
        for path, (_, (tokens, _)) in warmup.items():
            # bf16: a draw at a near-tie of two cumulative probabilities may differ with the rounding of the logits
            agree = (tokens == warmup["generate"][1][0]).float().mean().item()
            assert agree == 1.0 or (cuda and agree > 0.9), f"{case}: {path} drew other tokens than generate"
        for _ in range(args.repeats):
            for path, fn in paths.items():
                times[path].append(timed(fn, *inputs)[0])
        medians = {path: statistics.median(t) for path, t in times.items()}
        report[case] = {**{f"{path}_median_ms": round(m, 2) for path, m in medians.items()},
                        **{f"{path}_min_ms": round(min(t), 2) for path, t in times.items()},
                        **{f"{path}_first_ms": round(warmup[path][0], 1) for path in paths},
                        **{f"speedup_{path}": round(medians["generate"] / medians[path], 3)
                           for path in paths if path != "generate"}}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
