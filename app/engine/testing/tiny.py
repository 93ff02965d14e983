"""Tiny configs for the MoE architectures that `random_models.TINY_CONFIGS` lacks, built the
same way (`make_random_model(config, folder)`): vocab 1000, hidden 128, 8 experts."""

from __future__ import annotations

from .random_models import TINY_VOCAB

_COMMON = {"vocab_size": TINY_VOCAB, "hidden_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
           "tie_word_embeddings": False}

EXTRA_TINY_CONFIGS: dict[str, dict] = {
    "mixtral": {**_COMMON, "model_type": "mixtral", "num_hidden_layers": 2,
                "intermediate_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
                "rope_theta": 1e6},
    # MLA attention, a dense first layer, 8 routed + 1 shared expert, sigmoid routing
    "deepseek_v3": {**_COMMON, "model_type": "deepseek_v3", "num_hidden_layers": 3,
                    "num_key_value_heads": 4, "intermediate_size": 256,
                    "moe_intermediate_size": 64, "n_routed_experts": 8, "n_shared_experts": 1,
                    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 64,
                    "q_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
                    "v_head_dim": 32, "routed_scaling_factor": 2.5, "n_group": 1,
                    "topk_group": 1, "rope_theta": 10000.0},
    # Gated DeltaNet (linear attention) layers + one full-attention layer, shared expert
    "qwen3_next": {**_COMMON, "model_type": "qwen3_next", "num_hidden_layers": 4,
                   "intermediate_size": 256, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                   "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 8,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 64, "mlp_only_layers": [],
                   "moe_intermediate_size": 64, "rope_theta": 1e6,
                   "partial_rotary_factor": 0.25, "head_dim": 64, "norm_topk_prob": True,
                   "full_attention_interval": 4},
    # Nemotron 3 Super's LatentMoE: routed experts run in a 64-d latent between two dense
    # projections (fc1_latent_proj / fc2_latent_proj)
    "nemotron_h_latent": {"model_type": "nemotron_h", "vocab_size": TINY_VOCAB,
                          "hidden_size": 128, "intermediate_size": 128,
                          "max_position_embeddings": 4096, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 64, "attention_bias": False,
                          "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_proj_bias": False,
                          "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2,
                          "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
                          "use_conv_bias": True, "hybrid_override_pattern": "ME*E",
                          "moe_intermediate_size": 64, "moe_latent_size": 64,
                          "moe_shared_expert_intermediate_size": 128, "n_group": 1,
                          "n_routed_experts": 8, "n_shared_experts": 1, "topk_group": 1,
                          "num_experts_per_tok": 2, "norm_topk_prob": True,
                          "routed_scaling_factor": 5.0, "mlp_hidden_act": "relu2",
                          "time_step_limit": [0.0, 1e9], "tie_word_embeddings": False},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **_COMMON, "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4,
        "intermediate_size": 256, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 64, "moe_intermediate_size": 64,
        "full_attention_interval": 4,
        "rope_parameters": {"type": "default", "mrope_section": [11, 11, 10],
                            "rope_theta": 100000, "partial_rotary_factor": 0.25}}},
}
