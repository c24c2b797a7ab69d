"""TRL's script fields as `rlhf from-trl` reads them (tasks/from_trl/recipe.py): the defaults of the fields it maps
or weighs, the fields with no effect on the trained policy here, and why the rest cannot be carried over.

PPO and RLOO: TRL 1.9.0's dataclasses under transformers 5 (TrainingArguments with TRL's overrides, experimental
PPOConfig, RLOOConfig, ModelConfig, ScriptArguments, RLOO's script arguments, DatasetMixtureConfig). GRPO: TRL
1.16.0's GRPOConfig (the newest TRL; it has no PPO), whose TrainingArguments overrides, ModelConfig, script arguments
and DatasetMixtureConfig equal the tables below. tests/test_trl_recipes.py checks them against the installed TRL 1.9.0
(a dev dependency) and TRL 1.16.0 in its own venv (`make trl116`).
"""

from __future__ import annotations

TRL_VERSION = "1.9.0"
GRPO_TRL_VERSION = "1.16.0"  # GRPO recipes are read as TRL 1.16.0 writes them

TRAINING_ARGS = {
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_train_epochs": 3.0, "max_steps": -1,
    "lr_scheduler_type": "linear", "lr_scheduler_kwargs": None, "warmup_steps": 0, "warmup_ratio": 0.0,
    "optim": "adamw_torch_fused", "optim_args": None, "optim_target_modules": None, "weight_decay": 0.0,
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "bf16": None, "fp16": False,
    "gradient_checkpointing": True, "seed": 42, "label_smoothing_factor": 0.0, "neftune_noise_alpha": None,
    "auto_find_batch_size": False, "average_tokens_across_devices": True, "train_sampling_strategy": "random",
    "deepspeed": None, "fsdp": None, "fsdp_config": None, "use_cpu": False, "full_determinism": False,
    "data_seed": None, "dataloader_drop_last": False,
}
PPO_FIELDS = {
    "learning_rate": 3e-6, "num_mini_batches": 1, "total_episodes": None, "local_rollout_forward_batch_size": 64,
    "response_length": 53, "stop_token": None, "stop_token_id": None, "temperature": 0.7, "missing_eos_penalty": None,
    "sft_model_path": "EleutherAI/pythia-160m", "reward_model_path": "EleutherAI/pythia-160m",
    "model_adapter_name": None, "ref_adapter_name": None, "num_ppo_epochs": 4, "whiten_rewards": False,
    "kl_coef": 0.05, "kl_estimator": "k1", "cliprange": 0.2, "vf_coef": 0.1, "cliprange_value": 0.2, "gamma": 1.0,
    "lam": 0.95,
}
RLOO_FIELDS = {
    "learning_rate": 1e-6, "model_init_kwargs": None, "trust_remote_code": False, "router_aux_loss_coef": 0.001,
    "disable_dropout": False, "num_generations": 2, "max_completion_length": 256, "shuffle_dataset": True,
    "generation_batch_size": None, "steps_per_generation": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "min_p": None, "generation_kwargs": None, "chat_template_kwargs": None, "repetition_penalty": 1.0, "beta": 0.05,
    "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None, "reward_weights": None,
    "normalize_advantages": False, "reward_clip_range": None, "mask_truncated_completions": False,
    "sync_ref_model": False, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512,
}
GRPO_FIELDS = {  # TRL 1.16.0 GRPOConfig's own fields (learning_rate: its override of TrainingArguments')
    "learning_rate": 1e-6, "model_init_kwargs": None, "trust_remote_code": False, "router_aux_loss_coef": None,
    "disable_dropout": False, "cast_lm_head_to_fp32": False, "num_generations": 8, "max_completion_length": 512,
    "shuffle_dataset": True, "generation_batch_size": None, "steps_per_generation": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": 0, "min_p": None, "generation_kwargs": None, "chat_template_kwargs": None,
    "repetition_penalty": 1.0, "beta": 0.0, "num_iterations": 1, "epsilon": 0.2, "delta": None, "epsilon_high": None,
    "sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "importance_sampling_level": "token", "reward_weights": None,
    "multi_objective_aggregation": "sum_then_normalize", "scale_rewards": "group", "loss_type": "dapo",
    "mask_truncated_completions": False, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512, "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2,
    "max_tool_calling_iterations": None, "off_policy_mask_threshold": None, "use_bias_correction_kl": True,
}
# GRPOTrainer's own arguments for multi-turn rollouts (TRL 1.16 grpo_trainer.py: callables, not GRPOConfig fields; TRL's
# grpo script has no flag for them). A recipe of a script that passes them names them as the script names its
# reward_funcs: dotted import paths ('my_lib.tools.lookup'); ours are 'module:name' (rlhf_core/tools.py).
GRPO_TRAINER_ARGS = {"tools": None, "environment_factory": None}
MODEL_CONFIG = {
    "model_name_or_path": None, "model_revision": "main", "dtype": "float32", "attn_implementation": None,
    "use_peft": False, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": None,
    "lora_target_parameters": None, "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM", "use_rslora": False,
    "use_dora": False, "load_in_8bit": False, "load_in_4bit": False, "bnb_4bit_quant_type": "nf4",
    "use_bnb_nested_quant": False, "bnb_4bit_quant_storage": None,
}
SCRIPT_ARGS = {
    "dataset_name": None, "dataset_config": None, "dataset_train_split": "train", "dataset_test_split": "test",
    "dataset_streaming": False, "ignore_bias_buffers": False,
    "reward_model_name_or_path": None, "reward_funcs": None,  # RLOO's script (trl/scripts/rloo.py)
    "datasets": [], "streaming": False, "test_split_size": None,  # DatasetMixtureConfig
}
# Fields with no effect on the trained policy here: logging, saving, the hub, evaluation scheduling, data loading
# workers, the generation engine, and what TRL PPO derives itself at run time (it overwrites them).
BOOKKEEPING = {
    "output_dir", "overwrite_output_dir", "logging_dir", "logging_strategy", "logging_steps", "logging_first_step",
    "logging_nan_inf_filter", "log_level", "log_level_replica", "log_on_each_node", "report_to", "run_name", "project",
    "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "disable_tqdm", "eval_strategy", "eval_steps",
    "eval_delay", "eval_on_start", "per_device_eval_batch_size", "bf16_full_eval", "fp16_full_eval",
    "eval_accumulation_steps", "eval_do_concat_batches",
    "eval_use_gather_object", "prediction_loss_only", "batch_eval_metrics", "include_for_metrics",
    "include_num_input_tokens_seen", "save_strategy", "save_steps", "save_total_limit", "save_only_model",
    "save_on_each_node", "save_safetensors", "enable_jit_checkpoint", "push_to_hub", "hub_token", "hub_private_repo",
    "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "resume_from_checkpoint", "ignore_data_skip",
    "restore_callback_states_from_checkpoint", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
    "dataloader_in_order", "remove_unused_columns", "label_names", "length_column_name", "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "ddp_timeout",
    "skip_memory_metrics", "do_train", "do_eval", "do_predict", "local_rank", "debug", "torch_empty_cache_steps",
    "tf32", "torch_compile", "torch_compile_backend", "torch_compile_mode", "use_liger_kernel", "liger_kernel_config",
    "use_cache", "gradient_checkpointing_kwargs", "activation_checkpointing", "activation_checkpointing_kwargs",
    "accelerator_config", "parallelism_config", "dataset_num_proc", "ds3_gather_for_generation",
    # PPO: sample generations for logging, and the sizes its trainer derives (and overwrites)
    "num_sample_generations", "world_size", "num_total_batches", "micro_batch_size", "local_batch_size",
    "batch_size", "local_mini_batch_size", "mini_batch_size",
    # RLOO: evaluation, logging and the generation engine (vLLM, continuous batching): ours is its decode loop
    "num_generations_eval", "pad_to_multiple_of", "cache_implementation", "use_vllm", "vllm_mode", "vllm_model_impl",
    "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size", "use_transformers_continuous_batching",
    "transformers_continuous_batching_config", "use_transformers_paged", "log_completions", "log_multimodal",
    "num_completions_to_print", "log_unique_prompts",
    # GRPO (TRL 1.16): vLLM's importance-sampling correction (only with use_vllm: ours samples with the trained
    # weights themselves, so there is no engine mismatch to correct), and where completions are logged
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap", "log_completions_hub_repo",
    # scripts: the eval split (ours holds out prepare.eval_fraction of the prompts), streaming, bias buffers
    "dataset_test_split", "dataset_streaming", "streaming", "test_split_size", "ignore_bias_buffers",
}

UNSUPPORTED_WHY = {  # a field that changes training, set away from TRL's default: why it is not carried over
    "stop_token_id": "ours stops on the EOS token only (train.stop_token: eos)",
    "model_adapter_name": "ours trains one adapter", "ref_adapter_name": "ours trains one adapter",
    "reward_clip_range": "ours clips only after normalizing (train.rloo.reward_clip_range, symmetric)",
    "reward_funcs": "TRL's reward functions take TRL's keyword arguments; write train.reward_funcs "
                    "('module:function', called fn(prompts, completions))",
    "reward_weights": "ours weighs train.reward_funcs (set them together)",
    "generation_kwargs": "ours samples with temperature, top_k, top_p, min_p and repetition_penalty only",
    "model_init_kwargs": "ours loads with runtime's settings (frozen_dtype, attn_implementation)",
    "dtype": "ours trains fp32 weights (runtime.mixed_precision sets the autocast)",
    "trust_remote_code": "never: safetensors and library code only",
    "dataset_config": "ours loads a dataset's default configuration",
    "dataset_train_split": "ours reads the split named train",
    "datasets": "ours reads one source per kind (prepare.sft, prepare.preferences, prepare.prompts)",
    "shuffle_dataset": "ours always shuffles the prompts",
    "neftune_noise_alpha": "no NEFTune here", "label_smoothing_factor": "no label smoothing in the RL loss",
    "deepspeed": "pass the launch as an accelerate config: --accelerate-config FILE (runtime.accelerate_config)",
    "fsdp": "FSDP is not a launch path here", "use_dora": "PEFT's DoRA is not supported",
    "lora_target_parameters": "ours adapts modules (lora_target_modules)",
    "adam_beta1": "ours uses torch's AdamW betas (0.9, 0.999)",
    "adam_beta2": "ours uses torch's AdamW betas (0.9, 0.999)",
    "lr_scheduler_kwargs": "ours takes none", "optim": "ours is torch's AdamW",
    "cast_lm_head_to_fp32": "ours computes the output head in runtime.mixed_precision's autocast",
}
