"""Operators dispatched per decode step (rlhf_core.decode): every aten call of one step's forward and of its token
choice, counted by a TorchDispatchMode, for the eager loop (growing cache) and the static-cache step that `graphs`
compiles (run eagerly here: the count is what a capture records, or what eager launches one by one).

    python bench/decode_ops.py [--json OUT]

Shapes: bench-tiny's layers (4) and Pythia-1B's (16 layers, 8 heads) at a narrow width (the count depends on the
layers and the code path, not on the width), 8 rows of 16-token prompts, one left-padded, temperature 0.7.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlhf_core.decode import Forwards, TokenChoice, _choose  # noqa: E402
from rlhf_core.models import init_causal_lm, tiny_gpt_neox_config  # noqa: E402

VIEWS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "split", "expand",
         "alias", "detach", "as_strided"}
"""Metadata-only operators: no kernel on a GPU."""
LAYERS = {"bench-tiny": (4, 4), "pythia-1b": (16, 8)}  # (layers, heads)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def count(layers: int, heads: int, static: bool) -> dict:
    config = tiny_gpt_neox_config(vocab_size=512, hidden_size=64, num_layers=layers, num_heads=heads,
                                  intermediate_size=256, max_positions=256)
    model = init_causal_lm(config, seed=0).eval()
    B, P, R = 8, 16, 8
    queries = torch.randint(2, 512, (B, P), generator=torch.Generator().manual_seed(0))
    query_mask = torch.ones(B, P, dtype=torch.bool)
    query_mask[0, :3] = False
    forwards = Forwards(model, queries, query_mask, response_length=R, graphs=static)
    forwards.forward = model  # the step the graph would hold, run eagerly
    choice, keys = TokenChoice(temperature=0.7), torch.arange(B)
    processors, seen = choice.processors(), torch.cat([queries, queries.new_zeros(B, R)], dim=1)
    logits = forwards.prefill()
    tokens, _ = _choose(logits, choice, processors, seen[:, :P], keys, 0, True)
    logits = forwards.step(tokens, 0)  # step 1 is counted: nothing lazy left
    with OpCounter() as forward:
        logits = forwards.step(tokens, 1)
    with OpCounter() as choose:
        _choose(logits, choice, processors, seen[:, :P + 2], keys, 2, True)
    both = forward.ops + choose.ops
    return {"forward": sum(forward.ops.values()), "choose": sum(choose.ops.values()), "per_step": sum(both.values()),
            "per_step_not_views": sum(n for op, n in both.items() if op not in VIEWS),
            "forward_ops": dict(forward.ops.most_common()), "choose_ops": dict(choose.ops.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = {f"{name} {'static' if static else 'growing'}": count(layers, heads, static)
              for name, (layers, heads) in LAYERS.items() for static in (False, True)}
    for name, row in report.items():
        print(f"{name}: {row['per_step']} ops per step (forward {row['forward']}, token choice "
              f"{row['choose']}; {row['per_step_not_views']} not views)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
