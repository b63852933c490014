"""Tiny random MoE models of every supported family, built from transformers configs."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def _config(family: str):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON, head_dim=8, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=True
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **COMMON,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
        )
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, head_dim=8, num_local_experts=8, num_experts_per_tok=2)
    if family == "olmoe":
        return transformers.OlmoeConfig(**COMMON, num_experts=16, num_experts_per_tok=4)
    if family in ("deepseek_v2", "deepseek_v2_group"):
        group = family.endswith("group")
        return transformers.DeepseekV2Config(
            **{**COMMON, "num_key_value_heads": 4},
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            moe_intermediate_size=16,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            topk_method="group_limited_greedy" if group else "greedy",
            n_group=4 if group else 1,
            topk_group=2 if group else 1,
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            moe_intermediate_size=16,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
        )
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            **COMMON, head_dim=8, num_local_experts=16, num_experts_per_tok=4, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise KeyError(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v2_group", "deepseek_v3", "gpt_oss"]


def tiny_model(family: str, seed: int = 0, experts_implementation: str = "eager"):
    config = _config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves some routers at zero; give every router a real spread of scores.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] > 1:
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    model.set_experts_implementation(experts_implementation)
    return model.eval()


def random_similarity(model_layers, seed: int = 0, quantize: int | None = None):
    """A symmetric random similarity per MoE layer (diag 1); ``quantize`` makes ties likely."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in model_layers:
        e = layer.num_experts
        m = torch.rand(e, e, generator=g)
        m = (m + m.T) / 2
        if quantize:
            m = torch.round(m * quantize) / quantize
        m.fill_diagonal_(1.0)
        out[layer.index] = m
    return out


def random_predictors(model_layers, seed: int = 0, scale: float = 1.0):
    """A random output-size predictor ``[E + 1, E]`` per MoE layer: sizes that differ between experts
    by a factor of a few and depend on the token, so ``output`` and ``weight`` choose differently."""
    g = torch.Generator().manual_seed(seed)
    return {layer.index: torch.randn(layer.num_experts + 1, layer.num_experts, generator=g) * scale
            for layer in model_layers}


def calibration_file(model_layers, seed: int = 0):
    """A ``Similarity`` with random matrices and random output-size predictors for these layers."""
    from sere_fx import Similarity

    return Similarity(random_similarity(model_layers, seed), {}, random_predictors(model_layers, seed))
