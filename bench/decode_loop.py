"""The rollout's decode loop (rlhf_core.decode) against the `generate` path it replaced (bench/generate_path.py),
side by side in one process, at bench/vs_trl.py's shapes: bench-tiny by default (the policy of `rlhf bench`,
GPT-NeoX hidden 128, 4 layers, vocab 2048; 48-token prompts, 24 sampled tokens), pythia-1b on CUDA (128 + 53
tokens, bf16). 64 rows at temperature 0.7, stopping at EOS:

  ppo   64 distinct prompts
  rloo  32 prompts x k=2 (rows sharing a prompt prefill it once)

Paths: `generate`, the eager `decode` loop and, on CUDA (or with --graphs on), `decode_graphs` (the one-token step
compiled over a static KV cache: CUDA graphs on CUDA). Each runs once to warm up (graphs: compile and capture),
then `--repeats` times, alternating; all draw from the same keys. Prints one JSON object (and writes it to
--json): per case, the median, min and first wall time of each path in ms, generate's median over each decode
path's (> 1: the loop is faster), and how each path agrees with the others. Nothing here fails on a numerical
difference; it records it:

  same_arithmetic   where the loop and generate do the same sums, the ppo case (generate prefills prompt[:-1] and
                    then feeds the last token only where rows share a prompt; the loop prefills whole prompts):
                    whether every row's tokens and log-probs are identical, in every dtype. In the rloo case
                    the fp32 pass shows the split's rounding alone (same_history)
  same_history      the log-prob difference at the steps before each row's first differing token, both paths
                    on the same tokens so far: rounding alone (an inverse-CDF draw over a near-flat 50k-way
                    distribution flips on one bf16 step of a logit, and one flip changes the rest of its row)
  teacher_forced    each path's kept per-step log-probs against one full forward over its own tokens: largest
                    and mean |difference| through each row's stop, within TOLERANCE of the dtype or not

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
from rlhf_core.rollout import response_logits, stop_mask  # noqa: E402

ROWS, TEMPERATURE, STOP = 64, 0.7, 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}
"""Largest |log-prob difference| (nats) of an incremental decode against a full forward over the same tokens:
fp32 rounding, and in bf16 one rounding step of logits of order 1 (2^-8 relative) through the log-softmax, with
room for the different summation orders of one-token and whole-sequence attention."""


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


def paths_for(policy, shapes: dict, graphs: bool) -> dict:
    common = dict(response_length=shapes["response_length"], pad_token_id=0, stop_token_id=STOP, keep_logprobs=True)
    choice = TokenChoice(temperature=TEMPERATURE)
    paths = {
        "generate": lambda q, m, k: generate_responses(policy, q, m, temperature=TEMPERATURE, noise_keys=k, **common),
        "decode": lambda q, m, k: decode(policy, q, m, choice=choice, noise_keys=k, **common),
    }
    if graphs:
        paths["decode_graphs"] = lambda q, m, k: decode(policy, q, m, choice=choice, noise_keys=k, graphs=True,
                                                        **common)
    return paths


@torch.no_grad()
def agreement(policy, inputs: tuple, outputs: dict[str, tuple], dtype: str, exact_expected: bool) -> dict:
    """How each path's draws agree with generate's and with a full forward over its own tokens (module doc)."""
    queries, query_mask, _ = inputs
    ref_tokens, ref_logprobs = outputs["generate"]
    out = {}
    for path, (tokens, logprobs) in outputs.items():
        response_mask, _ = stop_mask(tokens, STOP)  # (B, R) through each row's stop
        logits = response_logits(policy, (queries, query_mask, tokens, response_mask), TEMPERATURE)  # (B, R, V)
        forced = ops.selective_log_softmax(logits, tokens)
        gap = (forced - logprobs).abs()[response_mask]
        row = {"teacher_forced_max": gap.max().item(), "teacher_forced_mean": gap.mean().item(),
               "tolerance": TOLERANCE[dtype]}
        row["within_tolerance"] = row["teacher_forced_max"] <= TOLERANCE[dtype]
        if path != "generate":
            differs = tokens != ref_tokens
            before = torch.arange(tokens.shape[1], device=tokens.device) < ops.first_true_indices(differs)[:, None]
            both = before & response_mask
            row["rows_identical"] = (~differs.any(1)).float().mean().item()
            row["same_history_max"] = (logprobs - ref_logprobs).abs()[both].max().item() if both.any() else None
            if exact_expected:
                row["same_arithmetic_identical"] = row["rows_identical"] == 1.0 and row["same_history_max"] == 0.0
        out[path] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                        help="default: bench-tiny on cpu, pythia-1b on cuda")
    parser.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                        help="the compiled static-cache path (auto: on CUDA only; on a CPU inductor compiles it)")
    parser.add_argument("--agreement-dtypes", nargs="*", choices=sorted(DTYPES), default=None,
                        help="dtypes of one more untimed agreement pass each (default: float32 on cuda, "
                             "bfloat16 on cpu, the one not timed)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    name = args.shapes or ("pythia-1b" if cuda else "bench-tiny")
    shapes = SHAPES[name]
    timed_dtype = "bfloat16" if cuda else "float32"
    extra = args.agreement_dtypes if args.agreement_dtypes is not None else ["float32" if cuda else "bfloat16"]
    with torch.device(args.device):  # a 1B model's random init on the GPU: seconds, not minutes
        fp32 = init_causal_lm(tiny_gpt_neox_config(**shapes["model"]), seed=0).eval()
    policy = fp32.to(DTYPES[timed_dtype]) if timed_dtype != "float32" else fp32  # in place: one copy of the weights
    paths = paths_for(policy, shapes, graphs=args.graphs == "on" or (args.graphs == "auto" and cuda))
    report = {"device": args.device, "threads": torch.get_num_threads(), "repeats": args.repeats, "shapes": name,
              "rows": ROWS, "prompt_length": shapes["prompt_length"], "response_length": shapes["response_length"],
              "dtype": timed_dtype, "paths": list(paths)}
    all_cases = cases(shapes, args.device)
    for case, inputs in all_cases.items():
        times: dict[str, list[float]] = {path: [] for path in paths}
        warmup = {path: timed(fn, *inputs) for path, fn in paths.items()}
        for _ in range(args.repeats):
            for path, fn in paths.items():
                times[path].append(timed(fn, *inputs)[0])
        medians = {path: statistics.median(t) for path, t in times.items()}
        report[case] = {**{f"{path}_median_ms": round(m, 2) for path, m in medians.items()},
                        **{f"{path}_min_ms": round(min(t), 2) for path, t in times.items()},
                        **{f"{path}_first_ms": round(warmup[path][0], 1) for path in paths},
                        **{f"speedup_{path}": round(medians["generate"] / medians[path], 3)
                           for path in paths if path != "generate"},
                        "agreement": {timed_dtype: agreement(policy, inputs, {p: w[1] for p, w in warmup.items()},
                                                             timed_dtype, case == "ppo")}}
        print(f"{case}: " + json.dumps(report[case]), file=sys.stderr, flush=True)
        if args.json:  # every finished case, so a run cut short keeps what it measured
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    for dtype in (d for d in extra if d != timed_dtype):  # untimed: the eager paths once each in another dtype
        model = policy.to(DTYPES[dtype])  # in place
        eager = {p: fn for p, fn in paths_for(model, shapes, graphs=False).items()}
        for case, inputs in all_cases.items():
            outputs = {path: fn(*inputs) for path, fn in eager.items()}
            report[case]["agreement"][dtype] = agreement(model, inputs, outputs, dtype, case == "ppo")
        policy.to(DTYPES[timed_dtype])
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
