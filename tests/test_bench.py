"""The benchmark: its FLOP count (the dense matmul weights a forward multiplies, and how an update adds them up)
and the side-by-side harness against TRL (bench/vs_trl.py): which environment each side runs in, the summary."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rlhf_core.bench import build_trainer, matmul_params, peak_matmul_flops, update_flops
from rlhf_core.models import init_causal_lm, tiny_gpt_neox_config
from rlhf_core.rollout_maker import sampling_logprobs_exact


def test_matmul_params_count_every_linear_and_not_the_input_embedding():
    config = tiny_gpt_neox_config(vocab_size=100, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=64)
    per_layer = 16 * 48 + 16 * 16 + 16 * 64 + 64 * 16  # query_key_value, dense, MLP in and out
    assert matmul_params(init_causal_lm(config, seed=0)) == 2 * per_layer + 100 * 16  # + the LM head


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_update_flops_are_what_torch_counts_in_a_real_update(algo):
    """`update_flops` against torch's own FLOP counter over one real bench-tiny update: every matmul it counts (mm,
    addmm, and bmm, which a frozen model's LM head dispatches to); attention runs as SDPA, which it does not count,
    as `update_flops` leaves attention out."""
    trainer = build_trainer(algo, updates=2)
    trainer.train(max_updates=1)  # the counted update is a steady one
    with FlopCounterMode(display=False) as counter:
        trainer.train(max_updates=1)
    counted = sum(flops for op, flops in counter.get_flop_counts()["Global"].items()
                  if str(op).split(".")[1] in ("mm", "addmm", "bmm"))
    assert sampling_logprobs_exact(trainer.accelerator, trainer.unwrapped.policy), "fp32: the policy's rollout log-probs cost no forward"
    assert update_flops(trainer, 48) == pytest.approx(counted, rel=2e-3)


def _best_matmul_s(n: int, repeats: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best


def test_the_peak_is_what_this_machine_multiplies_per_second():
    """`peak_matmul_flops`, the denominator of the bench's MFU, against this test's own clock: it multiplies n x n
    matrices (torch counts 2 n^3 FLOPs a product), reports at least their mean rate over the whole call (the best of
    a few is no slower than their mean) and at most what the same products ever reach here (a best of 16 timed
    around it, with room for one lucky run): a constant, a clock around nothing or a miscounted product fails."""
    n = 384
    with FlopCounterMode(display=False) as counter:
        peak_matmul_flops(n=n)
    products = counter.get_flop_counts()["Global"]
    assert {str(op) for op in products} == {"aten.mm"} and products[torch.ops.aten.mm] % (2 * n**3) == 0, products
    multiplied = products[torch.ops.aten.mm]
    fastest = _best_matmul_s(n, 16)
    start = time.perf_counter()
    peak = peak_matmul_flops(n=n)
    call_s = time.perf_counter() - start
    fastest = min(fastest, _best_matmul_s(n, 16))
    assert multiplied / call_s <= peak <= 1.5 * 2 * n**3 / fastest, (multiplied / call_s, peak, 2 * n**3 / fastest)


@pytest.fixture(scope="module")
def vs_trl():
    """bench/vs_trl.py, the side-by-side harness (a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vs_trl", Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_our_side_holds_only_the_models_each_run_needs(vs_trl, tmp_path, capsys):
    """A peak counts what is resident: one process running PPO then RLOO reported PPO's peak RSS as RLOO's (its
    value model still loaded, its high-water mark kept). On the CPU each algorithm gets its own process; where one
    process runs several (CUDA), each run holds only its models."""
    assert vs_trl.ours_jobs(["ppo", "rloo"], "cpu") == [("ours", "ppo"), ("ours", "rloo")]
    assert vs_trl.ours_jobs(["ppo", "rloo"], "cuda") == [("ours", "ppo,rloo")]
    import importlib.util

    spec = importlib.util.spec_from_file_location("vs_trl_ours", Path(vs_trl.__file__).with_name("vs_trl_ours.py"))
    ours = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ours)
    workload = tmp_path / "workload"
    vs_trl.write_workload({**vs_trl.workload_spec("dry-run", updates=2, gradient_checkpointing=False), "prompts": 64},
                          workload)
    ours.main(workload, ["rloo", "grpo"], ["off"])  # GRPO first (beta 0: no reference), then RLOO from the loaded weights
    results = [json.loads(line.removeprefix("RESULT ")) for line in capsys.readouterr().out.splitlines()
               if line.startswith("RESULT ")]
    assert [(r["algo"], r["models_held"]) for r in results] == [("grpo", ["policy", "reward"]),
                                                               ("rloo", ["policy", "reference", "reward"])]
    assert all(len(r["update_ends"]) == 2 for r in results)
    spec = json.loads((workload / "spec.json").read_text())
    assert ours.models_needed(ours.rl_config(spec, "ppo")) == {"policy", "reference", "reward", "value"}


def test_side_by_side_runs_ours_in_the_peers_environment_unless_told(vs_trl, monkeypatch):
    """Both sides on TRL's interpreter and packages by default (transformers imports optional packages when
    they are installed: the environments, not the trainers, would differ in RSS); the repository first on ours."""
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    root = str(Path(__file__).resolve().parents[1])
    shared = vs_trl.side_commands("shared", "/trl/bin/python", "/trl/wheels", None)
    assert shared["ours"][0] == shared["trl"][0] == "/trl/bin/python"
    assert shared["ours"][1].name == "vs_trl_ours.py" and shared["trl"][1].name == "vs_trl_peer.py"
    assert shared["ours"][2].split(os.pathsep) == [root, "/trl/wheels"] and shared["trl"][2] == "/trl/wheels"
    project = vs_trl.side_commands("project", "/trl/bin/python", None, None)
    assert project["ours"][0] == sys.executable and project["trl"][0] == "/trl/bin/python"
    assert project["ours"][2].split(os.pathsep) == [root, "/inherited"] and project["trl"][2] is None


def test_side_by_side_summary_pairs_each_run_with_its_neighbour(vs_trl):
    """bench/vs_trl.py: medians per side, their ratio, and each pair's own ratio (a drifting machine moves both
    runs of a pair together, so the pairs' ratios are steadier than the ratio of medians)."""
    summarize = vs_trl.summarize

    def run(side, episodes_per_s, rss):
        seconds = 64 / episodes_per_s
        ends = [10.0 + seconds * i for i in range(4)]  # the warm-up ends at 10 s, then 3 updates
        return {"algo": "ppo", "side": side, "episodes_per_update": 64, "update_ends": ends, "peak_rss_mib": rss,
                **({"phases_s": {"update": seconds}} if side == "ours" else {})}

    # the machine drifts: each pair's two runs move together; pair 1 runs TRL first
    runs = [run("ours", 60, 600), run("trl", 40, 700), run("trl", 25, 700), run("ours", 30, 610),
            run("ours", 15, 620), run("trl", 5, 700)]
    row = summarize(runs, warmup=1)["ppo"]
    assert row["ours"]["runs"] == [60.0, 30.0, 15.0] and row["trl"]["runs"] == [40.0, 25.0, 5.0]
    assert row["speed_ratio"] == pytest.approx(30 / 25)  # the ratio of the medians
    assert row["speed_ratio_per_pair"] == pytest.approx([1.5, 1.2, 3.0])
    assert row["speed_ratio_median_of_pairs"] == pytest.approx(1.5)
    assert row["memory_ratio"] == pytest.approx(610 / 700)
    assert row["ours"]["phases_s"] == {"update": pytest.approx(64 / 30)}
