"""What the vLLM benchmarks share: the models (the test-bed, or a Qwen3-30B-A3B-shaped model
written locally), their similarity files, and each setting's engine run in its own child
process (so engines' memory and plugin state stay apart).

A benchmark script ``S`` parses its arguments with ``parse_common`` and calls
``run_settings(S, settings, spec)``; for each setting it writes
``{**spec, "sere": ..., "out": ...}`` to a file and runs ``python S --child FILE``, whose
``one_engine(spec)`` result the child writes to ``spec["out"]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from sere_fx.resources import testbed_dir

HERE = os.path.dirname(os.path.abspath(__file__))
TESTBED = testbed_dir()  # the test-bed the package ships
TESTBED_MODEL = os.path.join(TESTBED, "model")


def testbed_similarity(path: str | None = None) -> str:
    """``path``, or a Frobenius similarity calibrated on 64 x 64 tokens of the public text (made once)."""
    if path is not None:
        return path
    path = os.path.join(HERE, "results", ".testbed.sim.safetensors")
    if not os.path.isfile(path):
        subprocess.run([sys.executable, "-m", "sere_fx.cli", "calibrate", "--model", TESTBED_MODEL, "--data",
                        os.path.join(TESTBED, "eval_public.txt"), "--num-seqs", "64", "--seq-len", "64",
                        "--out", path], check=True)
    return path


def build_qwen3_30b_shape(out_dir: str, layers: int) -> str:
    """A Qwen3-MoE with Qwen3-30B-A3B's MoE and attention sizes (128 experts, top-8, hidden 2048,
    expert 768, 32 x 128 query heads, 4 KV heads), ``layers`` decoder layers and the test-bed's
    4k vocabulary and tokenizer; random bf16 weights, written once to ``out_dir``."""
    import shutil

    import torch
    import transformers

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    print(f"writing a {layers}-layer Qwen3-30B-A3B-shaped model to {out_dir} ...", flush=True)
    config = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TESTBED_MODEL, name), out_dir)
    return out_dir


def random_similarity(model_dir: str, out: str) -> str:
    """A random symmetric similarity per layer (at rho = 0 the distinct-expert count does not
    depend on it; quality is not measured on random weights)."""
    if os.path.isfile(out):
        return out
    import torch

    from sere_fx import Similarity

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    g = torch.Generator().manual_seed(0)
    e = cfg.get("num_experts") or cfg["num_local_experts"]
    mats = {}
    for i in range(cfg["num_hidden_layers"]):
        m = torch.rand(e, e, generator=g)
        mats[i] = ((m + m.T) / 2).fill_diagonal_(1.0)
    Similarity(mats, {"architecture": cfg["architectures"][0], "method": "random"}).save(out)
    return out


MODELS = ("testbed", "qwen3-30b-a3b-shape")
# The benchmarks' routing settings by name (the plugin's ``additional_config["sere"]``; None: plain
# vLLM). SERE's similarity file is added per model.
POLICIES = {"plain": None, "sere": {"S": 2, "rho": 0.0}, "oea": {"policy": "oea", "S": 2},
            "weight": {"policy": "weight", "S": 1, "N": 0.6},
            # the same SERE with every slot computed (vLLM's kernel as before slot merging)
            "sere_unmerged": {"S": 2, "rho": 0.0, "merge_slots": False},
            "weight50": {"policy": "weight", "S": 1, "N": 0.5}, "output50": {"policy": "output", "S": 1, "N": 0.5}}


def policy_settings(name: str, sim: str, **extra) -> dict | None:
    """``POLICIES[name]`` as the plugin's settings, with ``sim`` for the policies that read a
    similarity file and ``extra`` added (None: plain vLLM)."""
    if POLICIES[name] is None:
        return None
    settings = {**POLICIES[name], **extra}
    if settings.get("policy", "sere") == "sere":
        settings["sim"] = sim
    return settings


def plan_settings(plan: str, sim: str) -> dict:
    """The plugin's settings for a tuned plan file: with the similarity file when a layer's policy reads one."""
    from sere_fx.config import load_plan, needs_similarity

    return {"plan": plan, "sim": sim} if needs_similarity(load_plan(plan)) else {"plan": plan}


def check_plan(parser, args) -> None:
    """Refuse policy 'plan' without a plan file at ``--plan`` (the parser's one-line error)."""
    if "plan" in args.policies and not (args.plan and os.path.isfile(args.plan)):
        parser.error(f"--plan: expected a plan file for policy 'plan', got {args.plan!r} (no such file)")


def model_and_similarity(name: str, cache: str, layers: int = 2, sim: str | None = None) -> tuple[str, str]:
    """``(model dir, similarity file)`` for a benchmark model name (``MODELS``)."""
    if name == "testbed":
        return TESTBED_MODEL, testbed_similarity(sim)
    os.makedirs(cache, exist_ok=True)
    model = build_qwen3_30b_shape(os.path.join(cache, f"qwen3_30b_a3b_shape_{layers}l"), layers)
    return model, sim or random_similarity(model, model + ".sim.safetensors")


def run_settings(script: str, settings: dict, spec: dict, env: dict | None = None) -> dict:
    """``{name: one_engine result}`` for ``settings`` (``{name: additional_config["sere"] or None}``)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    tag = os.path.splitext(os.path.basename(script))[0]
    results = {}
    for name, sere in settings.items():
        spec_path = os.path.join(HERE, "results", f".{tag}_{name}.json")
        out_path = spec_path.replace(".json", ".out.json")
        json.dump({**spec, "sere": sere, "out": out_path}, open(spec_path, "w"))
        print(f"{name}: starting an engine ...", flush=True)
        subprocess.run([sys.executable, script, "--child", spec_path], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[name] = json.load(open(out_path))
        os.remove(spec_path)
        os.remove(out_path)
    return results


def parse_common(parser, one_engine, argv=None):
    """Add ``--sim``, ``--out`` and the hidden ``--child`` that ``run_settings`` passes, and parse.
    In a child process (``--child``) run ``one_engine`` on its spec and return None; else the args."""
    parser.add_argument("--sim", default=None, help="similarity file (default: calibrated here on the public text)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(one_engine, args.child)
        return None
    return args


def config_of(args) -> dict:
    """The run's settings for its results file (without the internal ``--child``)."""
    return {k: v for k, v in vars(args).items() if k != "child"}


def write_results(path: str | None, results: dict) -> dict:
    """Write ``results`` as JSON to ``path`` (``--out``), if given; returns them."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results


def child(one_engine, spec_path: str) -> None:
    """In the child process: run ``one_engine`` on the spec and write its result."""
    spec = json.load(open(spec_path))
    json.dump(one_engine(spec), open(spec["out"], "w"))
