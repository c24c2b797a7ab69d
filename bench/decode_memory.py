"""What one rollout's decode adds to a process's peak memory (`rlhf_core.decode`, shared-prompt attention on), at
shapes where the prompts' KV cache is what counts: n prompts, k completions each, on a randomly initialized
GPT-NeoX in fp32 on the CPU. Run it in a fresh process per measurement (a peak RSS cannot be reset):

    python bench/decode_memory.py --prompts 64 --k 2 --prompt-length 384 --hidden 512 --layers 8

Prints JSON: the peak RSS before and after the decode, what the decode added, and the size of the prompts' keys
and values (n x layers x 2 x P x hidden x 4 bytes), which the prefill makes and the decode's cache then holds.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlhf_core.allocator import keep_freed_memory  # noqa: E402
from rlhf_core.decode import TokenChoice, decode  # noqa: E402
from rlhf_core.models import init_causal_lm, tiny_gpt_neox_config  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--k", type=int, default=2, help="completions per prompt")
    parser.add_argument("--prompt-length", type=int, default=384)
    parser.add_argument("--response-length", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    keep_freed_memory()  # as every training process does
    vocab = 2048
    config = tiny_gpt_neox_config(vocab_size=vocab, hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=max(args.hidden // 64, 1), intermediate_size=2 * args.hidden,
                                  max_positions=args.prompt_length + args.response_length)
    model = init_causal_lm(config, seed=0).eval()
    generator = torch.Generator().manual_seed(0)
    queries = torch.randint(2, vocab, (args.prompts, args.prompt_length), generator=generator)
    queries = queries.repeat_interleave(args.k, dim=0)  # each prompt's k completions side by side, as a rollout
    mask = torch.ones_like(queries)
    kwargs = dict(pad_token_id=0, stop_token_id=None, choice=TokenChoice(temperature=1.0))
    with torch.no_grad():
        decode(model, queries[:2 * args.k], mask[:2 * args.k], response_length=2, **kwargs)  # kernels warmed
        before = peak_rss_mib()
        decode(model, queries, mask, response_length=args.response_length, **kwargs)
    after = peak_rss_mib()
    prompt_kv = args.prompts * args.layers * 2 * args.prompt_length * args.hidden * 4 / 2**20
    print(json.dumps({**vars(args), "peak_rss_before_mib": round(before, 1), "peak_rss_after_mib": round(after, 1),
                      "decode_added_mib": round(after - before, 1), "prompt_keys_values_mib": round(prompt_kv, 1)}))


if __name__ == "__main__":
    main()
