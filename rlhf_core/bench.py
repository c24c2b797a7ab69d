"""bench-tiny: a fixed in-memory world for measuring trainer throughput (`rlhf bench`).

Random-init GPT-NeoX (hidden 128, 4 layers, 4 heads, intermediate 512, vocab 2048, 256 positions),
a word-level tokenizer with [PAD]=0 and [EOS]=1, 512 random prompts of 48 tokens, responses of 24
tokens at temperature 0.7 stopping at EOS, missing-EOS penalty 1.0, fp32, seed 0, lr 1e-5, and
separate value and reward models of the same shape. PPO: 64 episodes per update (16 x 4 gradient
accumulation), 1 mini-batch, 4 epochs. RLOO: 32 prompts x k=2, one optimization pass. kl_coef 0.05. GRPO: TRL 1.16
GRPOConfig's defaults: 8 prompts x num_generations 8, beta 0 (no reference model), loss dapo, one pass.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn
from transformers import PreTrainedTokenizerFast

from rlhf_core.allocator import keep_freed_memory
from rlhf_core.config import RLConfig
from rlhf_core.decode import TokenChoice, decode
from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.rollout import last_layer_mlp
from rlhf_core.rollout_maker import sampling_logprobs_exact
from rlhf_core.scoring import RewardModelScorer

VOCAB_SIZE, PROMPTS, PROMPT_LENGTH, EPISODES_PER_UPDATE = 2048, 512, 48, 64


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the words `w2 .. w{vocab_size-1}`, with [PAD]=0 and [EOS]=1."""
    vocab = {"[PAD]": 0, "[EOS]": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]")


def bench_config(algo: str, updates: int) -> RLConfig:
    common = dict(algo=algo, seed=0, total_episodes=EPISODES_PER_UPDATE * updates, response_length=24,
                  temperature=0.7, stop_token="eos", missing_eos_penalty=1.0, kl_coef=0.05, learning_rate=1e-5,
                  local_rollout_forward_batch_size=64)
    if algo == "ppo":
        return RLConfig(**common, per_device_train_batch_size=16, gradient_accumulation_steps=4,
                        num_mini_batches=1, num_epochs=4)
    if algo == "grpo":
        return RLConfig(**{**common, "kl_coef": 0.0}, per_device_train_batch_size=16, gradient_accumulation_steps=4,
                        num_mini_batches=1, num_epochs=1, grpo={"num_generations": 8})
    return RLConfig(**common, per_device_train_batch_size=16, gradient_accumulation_steps=4, num_mini_batches=1,
                    num_epochs=1, rloo={"rloo_k": 2})


def build_trainer(algo: str, updates: int) -> RLTrainer:
    cfg = bench_config(algo, updates)
    model_config = tiny_gpt_neox_config(vocab_size=VOCAB_SIZE)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, VOCAB_SIZE, (PROMPTS, PROMPT_LENGTH), generator=generator).tolist()
    return RLTrainer(
        cfg, init_causal_lm(model_config, seed=0), RewardModelScorer(init_sequence_scorer(model_config, seed=2)),
        prompts, pad_token_id=0, stop_token_id=1,
        value_model=init_sequence_scorer(model_config, seed=1) if algo == "ppo" else None,
    )


def matmul_params(model: nn.Module) -> int:
    """Weights that multiply activations (every nn.Linear: attention, MLP, LM and score heads); the input
    embedding is a lookup and costs no FLOPs."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def update_flops(trainer: RLTrainer, prompt_length: int) -> float:
    """Model FLOPs one update runs, the dense-matmul count (2 per weight per token forward, 6 forward + backward;
    attention scores left out, small at these lengths), forward by forward as this trainer runs them:

        rollout   the decode loop (a prefill of the prompts read at their last position, then R - 1 one-token
                  steps: the last drawn token is never fed back), the policy's forward unless its log-probs
                  come from the sampling logits (plain fp32), the reference's forward, PPO's value forward
        score     the reward model's forward
        update    num_epochs x (forward + backward) of the policy (and PPO's value model)

    A forward over B prompts of P and responses of R tokens runs B·(P + R) tokens, the last layer's MLP on the R + 1
    last positions only (`rollout.reading_last`) and the LM head on the R that predict a response token. With RLOO's
    k samples per prompt, each of the n = B / k distinct prompts runs once and is read at its last position, then the
    R - 1 response tokens a log-prob needs (R for a reward score) run on its copied KV cache
    (`rollout.shared_prompt_forward`). tests/test_bench.py checks the sum against torch's own FLOP counter over a
    real update.
    """
    cfg, model = trainer.cfg, trainer.unwrapped
    policy, value = model.policy, model.value
    head = policy.get_output_embeddings().weight.numel()
    B, P, R, k = trainer.plan.batch_size, prompt_length, cfg.response_length, cfg.samples_per_prompt
    n = B // k  # distinct prompts

    def forward(model: nn.Module, tokens: int, read: int, logits: int = 0) -> int:
        """`tokens` through the body, the last layer's MLP on the `read` positions only, the LM head on `logits`."""
        body = matmul_params(model) - (head if logits else 0)
        last_mlp = last_layer_mlp(model)
        cut = 0 if last_mlp is None else matmul_params(last_mlp) * (tokens - read)
        return 2 * (body * tokens - cut + head * logits)

    def logprob_forward(shared: bool) -> int:
        if shared:
            return forward(policy, n * P + B * (R - 1), n + B * (R - 1), logits=n + B * (R - 1))
        return forward(policy, B * (P + R), B * (R + 1), logits=B * R)

    generation = forward(policy, n * P + B * (R - 1), n + B * (R - 1), logits=n + B * (R - 1))  # n = B when k is 1
    policy_forward = logprob_forward(trainer.share_prompts)
    rollout_policy = 0 if sampling_logprobs_exact(trainer.accelerator, policy) else policy_forward
    reference_forward = logprob_forward(k > 1) if cfg.uses_reference else 0  # shares prompts that are shared
    value_forward = 0 if value is None else forward(value, B * (P + R), B * (R + 1))
    reward = getattr(trainer.scorer, "model", None)
    reward_forward = 0 if reward is None else (forward(reward, n * P + B * R, B * R) if k > 1
                                               else forward(reward, B * (P + R), B * R))
    update = cfg.num_epochs * 3 * (policy_forward + value_forward)
    return float(generation + rollout_policy + reference_forward + value_forward + reward_forward + update)


def median_phases(history: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per update of each phase of `RLTrainer.train` (rollout, score, advantages, update)."""
    return {phase: statistics.median(h[f"time/{phase}_s"] for h in history)
            for phase in ("rollout", "score", "advantages", "update")}


def peak_matmul_flops(dtype: torch.dtype = torch.float32, device: str = "cpu", n: int = 1024) -> float:
    """The best of a few square matmuls on this machine (FLOP/s): the measured peak MFU is taken against."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(8):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def warm_up() -> None:
    """Pay the process's one-time kernel initialization (seconds on CPU) before the clock starts."""
    model = init_causal_lm(tiny_gpt_neox_config(vocab_size=VOCAB_SIZE), seed=0)
    ids = torch.randint(2, VOCAB_SIZE, (4, PROMPT_LENGTH))
    decode(model, ids, torch.ones_like(ids, dtype=torch.bool), response_length=4, pad_token_id=0, stop_token_id=1,
           choice=TokenChoice())
    model(input_ids=ids).logits.mean().backward()


def run_bench(algo: str, updates: int = 5) -> dict:
    """Train `updates` updates on bench-tiny; returns throughput, peak memory and the last metrics. The process
    keeps the memory its steps free, as every training stage does (`Runtime`; rlhf_core/allocator.py)."""
    kept = keep_freed_memory()
    warm_up()
    trainer = build_trainer(algo, updates)
    start = time.perf_counter()
    history = trainer.train()
    train_s = time.perf_counter() - start
    episodes = trainer.state.episode
    achieved = update_flops(trainer, PROMPT_LENGTH) * len(history) / train_s
    peak = peak_matmul_flops()
    return {"algo": algo, "updates": len(history), "episodes": episodes, "train_s": round(train_s, 3),
            "episodes_per_s": round(episodes / train_s, 2), "peak_rss_mib": round(peak_rss_mib(), 1),
            "model_gflop_per_s": round(achieved / 1e9, 2), "peak_matmul_gflop_per_s": round(peak / 1e9, 1),
            "mfu": round(achieved / peak, 4), "threads": torch.get_num_threads(),  # at the end: it adapts
            "freed_memory_kept": kept,
            "phases_s": {phase: round(seconds, 4) for phase, seconds in median_phases(history).items()},
            "metrics": history[-1]}
