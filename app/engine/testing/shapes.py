"""Real models' shapes for benchmarks that build random-weight models of them."""

# Qwen/Qwen3-30B-A3B's config.json: the fields mlx-lm reads (48 layers; benchmarks may use fewer)
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "norm_topk_prob": True,
}
