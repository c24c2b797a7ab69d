"""Multi-turn tool rollouts (train.tools) through every launch a train stage has: 2 processes under DDP (torchrun)
and under DeepSpeed ZeRO-3 (accelerate, the GPU config file itself) update as 1 process does, and a kill -9 after a
checkpoint resumes to the uninterrupted run's policy, bit for bit. The real `rlhf stage train` in subprocesses.

The SFT policy is a tiny model taught (in the fixture, a few hundred steps) to look a case file up with the demo
world's `lookup_case` tool and then answer, so that its sampled rollouts call the tool, read its result and go on:
ranks whose episodes take different numbers of turns, tool-result tokens out of the loss, on every layout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config
from rlhf_core.tool_chat import render_ids
from rlhf_core.world.tokenizer import train_tokenizer
from rlhf_core.world.tools import TOOL_PATH, lookup_case, tool_schemas

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("plain_stages")]  # a real kill -9 of the stage process

REPO = Path(__file__).resolve().parents[1]
RLHF = Path(sys.executable).parent / "rlhf"
CASE = "4821"
SUBJECTS = ["cat", "dog", "boss", "friend", "car", "plant", "roommate", "sister"]
# 64 episodes per update (16 prompts x 4 completions), 2 updates, as 1 x (8 x 8) and as 2 x (8 x 4): the same global
# batches; episode-keyed sampling draws each episode's turns alike on any layout
TRAIN = [f'train.tools=["{TOOL_PATH}"]', "train.algo=grpo", "train.num_generations=4", "train.kl_coef=0.05",
         "train.total_episodes=128", "train.per_device_train_batch_size=8", "train.local_rollout_forward_batch_size=32",
         "train.response_length=48", "train.max_tool_calling_iterations=2", "train.learning_rate=1e-3",
         "train.sampling_seed=episode", "train.checkpoint_every=1", "train.trace_every=0"]
LAYOUTS = {1: ["train.gradient_accumulation_steps=8", "runtime.num_processes=1"],
           2: ["train.gradient_accumulation_steps=4", "runtime.num_processes=2"]}
ZERO3 = "runtime.accelerate_config=infra/accelerate/deepspeed_zero3.yaml"
WAIT_S = 600  # a bound on waiting, not a timing assertion


def _conversations(question: str) -> list[list[dict]]:
    """What the policy is taught after `question`: a lookup then one of two answers, or an answer without a call, so
    that its samples differ in their turns and words (GRPO learns nothing from a group of equal completions)."""
    result, user = lookup_case(CASE), {"role": "user", "content": question}
    lookup = [user, {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "lookup_case", "arguments": {"case_id": CASE}}}]},
              {"role": "tool", "name": "lookup_case", "content": result}]
    return [[*lookup, {"role": "assistant", "content": f"it ended:{result}."}],
            [*lookup, {"role": "assistant", "content": f"the file says{result}."}],
            [user, {"role": "assistant", "content": "i do not know."}]]


def _taught_to_call(tokenizer, questions: list[str], config) -> torch.nn.Module:
    """A tiny causal LM fitted to the tool exchanges after each prompt (`_conversations`)."""
    pairs = []
    for conversation in (c for question in questions for c in _conversations(question)):
        prompt = render_ids(tokenizer, conversation[:1], tools=[lookup_case], generation_prompt=True)
        whole = render_ids(tokenizer, conversation, tools=[lookup_case])
        assert whole[:len(prompt)] == prompt, "the template renders the exchange after the prompt"
        pairs.append((prompt, whole))
    width = max(len(whole) for _, whole in pairs)
    ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
    attention, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (prompt, whole) in enumerate(pairs):
        ids[i, :len(whole)], attention[i, :len(whole)] = torch.tensor(whole), 1
        labels[i, len(prompt):len(whole)] = torch.tensor(whole[len(prompt):])
    model = init_causal_lm(config, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


@pytest.fixture(scope="module")
def tool_workspace(tmp_path_factory) -> Path:
    """A train stage's inputs: the repo's params.yaml (trust.tool_modules allows the world's tools), prompts in the
    conversational layout, the taught policy as models/sft and a reward model, with a tokenizer that has the tool
    template."""
    root = tmp_path_factory.mktemp("tool-workspace")
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    shutil.copytree(REPO / "infra" / "accelerate", root / "infra" / "accelerate")
    questions = [f"post {i}: my {subject} left. what happened next is in case file {CASE}."
                 for i, subject in enumerate(SUBJECTS * 2)]
    texts = [json.dumps([tool_schemas(), _conversations(q)]) for q in questions]  # what the template will render
    tokenizer = train_tokenizer(texts * 4, vocab_size=600, tools=True)
    config = tiny_gpt_neox_config(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=2,
                                  intermediate_size=64, max_positions=512)
    policy = _taught_to_call(tokenizer, questions[:8], config)
    for name, model in (("sft", policy), ("reward", init_sequence_scorer(config, seed=1))):
        model.save_pretrained(root / "models" / name)
        tokenizer.save_pretrained(root / "models" / name)
    (root / "data").mkdir()
    (root / "data" / "prompts_train.jsonl").write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in questions))
    return root


def _copy(workspace: Path, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(workspace, copy)
    return copy


def _train(root: Path, overrides: list[str], wait: bool = True):
    env = {**os.environ, "RLHF_TRACKING": "off", "OMP_NUM_THREADS": "1", "RLHF_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    args = [str(RLHF), "stage", "train", *[x for item in [*TRAIN, *overrides] for x in ("--set", item)]]
    proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    if not wait:
        return proc
    output, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, output[-4000:]
    return _results(root)


def _results(root: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    metrics = {**json.loads((root / "metrics" / "train.json").read_text()),
               **json.loads((root / "reports" / "execution" / "train.json").read_text())}
    return metrics, load_file(root / "models" / "policy" / "model.safetensors")


def _assert_same_policy(policy: dict, reference: dict, rtol: float, atol: float, what: str) -> None:
    assert policy.keys() == reference.keys()
    for name, weight in reference.items():
        torch.testing.assert_close(policy[name], weight, rtol=rtol, atol=atol, msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def one_process(tool_workspace, tmp_path_factory) -> tuple[dict, dict]:
    """The reference: the stage on 1 process."""
    return _train(_copy(tool_workspace, tmp_path_factory.mktemp("one"), "one"), LAYOUTS[1])


def test_the_taught_policy_calls_the_tool_and_trains_on_its_own_tokens(one_process, tool_workspace):
    metrics, policy = one_process
    # most episodes look the case file up, some answer at once: ranks' episodes take different numbers of turns
    assert 0.25 < metrics["tools/call_frequency"] < 1, metrics
    assert metrics["update"] == 2 and metrics["distributed_type"] == "NO", metrics
    sft = load_file(tool_workspace / "models" / "sft" / "model.safetensors")
    assert any(not torch.equal(policy[k], sft[k]) for k in sft), "the policy was trained"


@pytest.mark.parametrize("launch", ["ddp", "zero3"])
def test_two_processes_update_with_tool_rollouts_as_one_does(one_process, tool_workspace, tmp_path, launch):
    """torchrun (gloo) and DeepSpeed ZeRO-3 (each rank holds a shard; the policy is gathered once per rollout, and
    each rank then runs its own episodes' turns and tools with no collective) against the 1-process run."""
    metrics, policy = _train(_copy(tool_workspace, tmp_path, launch),
                             [*LAYOUTS[2], *([ZERO3] if launch == "zero3" else [])])
    expected = "DEEPSPEED" if launch == "zero3" else "MULTI_CPU"
    assert (metrics["distributed_type"], metrics["num_processes"]) == (expected, 2), metrics
    assert metrics["tools/call_frequency"] == pytest.approx(one_process[0]["tools/call_frequency"]), \
        "each episode draws the same turns on any layout"
    _assert_same_policy(policy, one_process[1], rtol=1e-4, atol=1e-5, what=launch)


def test_kill_9_after_a_checkpoint_resumes_tool_rollouts_to_the_same_policy(one_process, tool_workspace, tmp_path):
    killed = _copy(tool_workspace, tmp_path, "killed")
    proc = _train(killed, LAYOUTS[1], wait=False)
    deadline = time.monotonic() + WAIT_S
    while not [p for p in (killed / "checkpoints" / "train").glob("update-*") if not p.name.endswith(".tmp")]:
        assert proc.poll() is None, f"the stage ended before its first checkpoint:\n{proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and not (killed / "metrics" / "train.json").exists(), \
        "killed before it finished"
    metrics, policy = _train(killed, LAYOUTS[1])
    assert metrics["resumed_from_update"] == 1 and metrics["update"] == 2, metrics
    # one thread in both runs (RLHF_THREADS=1): torch adds in one order, so the resumed policy is bit-identical
    _assert_same_policy(policy, one_process[1], rtol=0, atol=0, what="resumed")
