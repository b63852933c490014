"""Tiny random MoE checkpoints that vLLM can serve on the CPU, plus a similarity file for each.

They reuse the families of ``tiny_models`` at sizes vLLM's CPU kernels accept (head_dim 64,
hidden 128) and the test-bed's tokenizer (vocab 4096), written with ``save_pretrained``.
"""

from __future__ import annotations

import os
import shutil

import torch

from tiny_models import _config

from sere_fx.resources import testbed_model, testbed_text

# The test-bed the package ships (a fresh clone has it; nothing is looked for beside the checkout).
TESTBED_MODEL = testbed_model()
TESTBED_TEXT = testbed_text()

_SIZES = dict(vocab_size=4096, hidden_size=128, intermediate_size=128, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=0, bos_token_id=0)
_PER_FAMILY = {
    "mixtral": dict(head_dim=64),
    "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=128),
    "deepseek_v2_group": dict(moe_intermediate_size=64, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                              kv_lora_rank=256),  # vLLM's MLA takes kv_lora_rank + rope dims of 320, 512 or 576
}


def write_checkpoint(family: str, out_dir: str, seed: int = 0) -> str:
    """Save a tiny random ``family`` model with the test-bed tokenizer into ``out_dir``."""
    import transformers

    base = _config(family).to_dict()
    for derived in ("head_dim", "qk_head_dim"):  # recomputed from the sizes below
        if family.startswith("deepseek"):
            base.pop(derived, None)
    config = type(_config(family))(**{**base, **_SIZES, **_PER_FAMILY.get(family, {})})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # give every router a real spread of scores
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2 and p.shape[0] > 1:
                p.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TESTBED_MODEL, name), out_dir)
    return out_dir


def write_dense_checkpoint(out_dir: str, seed: int = 0) -> str:
    """A tiny random dense Qwen3 with the test-bed's vocabulary and tokenizer (a draft model)."""
    import transformers

    config = transformers.Qwen3Config(**{**_SIZES, "num_hidden_layers": 2, "head_dim": 64, "tie_word_embeddings": True})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TESTBED_MODEL, name), out_dir)
    return out_dir
