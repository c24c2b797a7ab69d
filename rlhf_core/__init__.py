"""The RL library of the pipeline: PPO and RLOO for causal LMs, SFT, reward-model training and inspection,
greedy evaluation, and the demo world. torch / transformers / accelerate / peft only."""
