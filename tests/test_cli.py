"""The command line as a shell user meets it."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import doc_pages

from sere_fx import Similarity
from sere_fx.cli import main


def cli(capsys, *argv):
    """``sere-fx ARGV`` in this process: (exit status, stdout, stderr). The one subprocess test
    below covers what only a real process shows (a closed pipe)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors and --help
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_top_level_help_reads_as_prose(capsys):
    rc, out, _ = cli(capsys, "--help")
    assert rc == 0 and "``" not in out
    assert "Batch-aware expert re-routing (SERE)" in out


def test_inspect_into_a_closed_pipe_stops_quietly(tmp_path):
    path = tmp_path / "sim.safetensors"
    g = torch.Generator().manual_seed(0)
    Similarity({i: torch.rand(16, 16, generator=g) for i in range(40)}).save(path)
    proc = subprocess.run(f"{sys.executable} -m sere_fx.cli inspect {path} | head -1", shell=True,
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert len(proc.stdout.splitlines()) == 1
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_inspect_refuses_what_it_cannot_summarise(tmp_path, capsys):
    nan = tmp_path / "nan.safetensors"
    m = torch.rand(4, 4)
    m[1, 2] = float("nan")
    Similarity({0: torch.rand(4, 4), 3: m}).save(nan)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\xff" * 64)
    good = tmp_path / "good.safetensors"
    Similarity({0: torch.rand(4, 4)}).save(good)
    cases = [
        ((nan,), "sere-fx inspect: error: sim: layer 3 has 1 non-finite entries (expected finite similarities), "
                 "e.g. nan at [1, 2]"),
        ((broken,), f"sere-fx inspect: error: sim: cannot read '{broken}' as a similarity file ("),
        ((tmp_path / "missing.safetensors",), "sere-fx inspect: error: sim: no file at"),
        ((good, "--rho", "nan"), "sere-fx inspect: error: argument --rho: expected a finite float, got 'nan'"),
    ]
    for args, message in cases:
        rc, out, err = cli(capsys, "inspect", *args)
        assert rc == 2 and out == "", (args, out, err)
        lines = [line for line in err.splitlines() if line.startswith("sere-fx")]
        assert len(lines) == 1 and lines[0].startswith(message), err
    assert cli(capsys, "inspect", good, "--rho", "0.3")[0] == 0


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    # The model path does not exist either: the --out error proves nothing was loaded first.
    out = tmp_path / "missing" / "x"
    for argv in (["calibrate", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "no.txt"),
                  "--out", f"{out}.safetensors"],
                 ["export", "--model", str(tmp_path / "no-model"), "--format", "pt2", "--out", f"{out}.pt2"]):
        rc, _, err = cli(capsys, *argv)
        assert rc == 2, err
        suffix = argv[-1].rsplit(".", 1)[1]
        assert err.strip() == (f"sere-fx {argv[0]}: error: --out: expected a path in an existing directory, "
                                       f"got '{out}.{suffix}' ('{out.parent}' does not exist)")
    assert not (tmp_path / "missing").exists()


def test_eval_and_demo_refuse_partial_batches(tmp_path, capsys):
    for argv, message in (
        (["eval", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "no.txt"), "--num-seqs", "8",
          "--batch-size", "32"],
         "sere-fx eval: error: --batch-size: expected at most --num-seqs (8), got 32: every decode step must carry "
         "a full batch"),
        (["demo", "--num-seqs", "8"],
         "sere-fx demo: error: --num-seqs: expected at least 32 (the demo decodes batches of 32), got 8"),
    ):
        rc, _, err = cli(capsys, *argv)
        assert rc == 2 and err.strip() == message, err


def test_eval_names_a_bad_policy_spec_before_loading(tmp_path, capsys):
    argv = ["eval", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "no.txt"), "--policies",
            "baseline", "sere:S=2,rho=abc"]
    rc, _, err = cli(capsys, *argv)
    assert rc == 2
    assert err.strip().startswith("sere-fx eval: error: --policies: policy: expected rho=a float or "
                                          "q<quantile in [0, 1]>, got 'rho=abc' in 'sere:S=2,rho=abc'"), err


def test_every_mistake_is_one_line_naming_the_argument(tmp_path, capsys):
    from sere_fx.resources import testbed_model, testbed_text

    model, text = testbed_model(), testbed_text()
    (tmp_path / "no-config").mkdir()
    real = tmp_path / "sim.safetensors"
    Similarity({i: torch.rand(64, 64) for i in range(4)}).save(real)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(real.read_bytes()[:100])
    nan = tmp_path / "nan.safetensors"
    Similarity({0: torch.full((64, 64), float("nan"))}).save(nan)
    out = tmp_path / "out"
    cases = [
        (["eval", "--model", tmp_path / "nowhere", "--data", text],
         f"sere-fx eval: error: --model: expected a local transformers model directory, got '{tmp_path / 'nowhere'}' "
         "(no such directory)"),
        (["export", "--model", tmp_path / "no-config", "--format", "pt2", "--out", out],
         f"sere-fx export: error: --model: expected a transformers model directory with a config.json, got "
         f"'{tmp_path / 'no-config'}' (no config.json in it)"),
        (["eval", "--model", model, "--data", text, "--sim", truncated],
         f"sere-fx eval: error: --sim: cannot read '{truncated}' as a similarity file ("),
        (["tune", "--model", model, "--data", text, "--sim", tmp_path / "none.safetensors", "--out", out],
         f"sere-fx tune: error: --sim: no file at '{tmp_path / 'none.safetensors'}'"),
        (["export", "--model", model, "--sim", nan, "--format", "onnx", "--out", out],
         "sere-fx export: error: --sim: layer 0 has 4096 non-finite entries (expected finite similarities), e.g. nan"),
        (["calibrate", "--model", model, "--data", tmp_path / "none.txt", "--out", out],
         f"sere-fx calibrate: error: --data: expected a text file (.txt, .jsonl or .parquet), got "
         f"'{tmp_path / 'none.txt'}' (no such file)"),
        (["export", "--model", model, "--format", "pt2", "--out", out, "--max-tokens", "0"],
         "sere-fx export: error: argument --max-tokens: expected a positive integer or 'none', got '0'"),
        (["export", "--model", model, "--policy", "topk", "--format", "pt2", "--out", out],
         "sere-fx export: error: --max-tokens: policy 'topk' (layers [0, 1, 2, 3]) changes the number of routed slots"),
        (["export", "--model", model, "--policy", "weigh", "--format", "pt2", "--out", out],
         "sere-fx export: error: --policy: expected one of sere, least_similar, random, topk, oea, weight, output, prior, got 'weigh'"),
        (["export", "--model", model, "--policy", "weight", "--format", "pt2", "--out", out],
         "sere-fx export: error: --N: policy 'weight' needs N (experts per call), rho (an importance threshold) or both"),
        (["export", "--model", model, "--S", "1", "--format", "pt2", "--out", out],
         "sere-fx export: error: --sim: policy 'sere' needs a similarity file (without one the model is exported "
         "untransformed, and the routing options would be ignored), got none"),
    ]
    if not torch.cuda.is_available():  # the accelerator options on a machine without one
        cases += [
            ([command, "--model", model, *extra, "--device", "cuda"],
             f"sere-fx {command}: error: --device: expected 'cpu' on this machine (no CUDA device), got 'cuda'")
            for command, extra in [("calibrate", ["--data", text, "--out", out]), ("eval", ["--data", text]),
                                   ("tune", ["--data", text, "--sim", real, "--out", out]),
                                   ("export", ["--format", "pt2", "--out", out])]]
    cases += [
        (["calibrate", "--model", model, "--data", text, "--out", out, "--tensor-parallel-size", "2"],
         "sere-fx calibrate: error: --tensor-parallel-size: a vLLM option, only used with --engine vllm, got 2 with "
         "--engine transformers"),
        (["calibrate", "--model", model, "--data", text, "--out", out, "--engine-arg", "swap_space=4"],
         "sere-fx calibrate: error: --engine-arg: a vLLM option, only used with --engine vllm, got 'swap_space=4'"),
        (["calibrate", "--model", model, "--data", text, "--out", out, "--engine", "vllm", "--device-map", "auto"],
         "sere-fx calibrate: error: --device-map: vLLM places the model on its own platform"),
        (["calibrate", "--model", model, "--data", text, "--out", out, "--engine", "vllm", "--batch-size", "8"],
         "sere-fx calibrate: error: --batch-size: vLLM schedules the windows itself (--max-num-batched-tokens); "
         "expected none with --engine vllm, got 8"),
        (["calibrate", "--model", model, "--data", text, "--out", out, "--engine", "vllm", "--engine-arg", "4"],
         "sere-fx calibrate: error: --engine-arg: expected KEY=VALUE with KEY an LLM(...) argument, got '4'"),
        (["calibrate", "--model", model, "--data", text, "--out", out, "--engine", "vllm", "--engine-arg",
          "enforce_eager=false"],
         "sere-fx calibrate: error: --engine-arg: 'enforce_eager' is set by its own option or by calibration"),
        (["calibrate", "--model", model, "--data", text, "--out", out, "--device", "tpu"],
         "sere-fx calibrate: error: --device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        (["eval", "--model", model, "--data", text, "--device", "cpu", "--device-map", "auto"],
         "sere-fx eval: error: --device-map: places the model itself; expected no --device beside it, got --device cpu"),
    ]
    for argv, message in cases:
        rc, stdout, err = cli(capsys, *argv)
        lines = [line for line in err.splitlines() if line.startswith("sere-fx")]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1 and lines[0].startswith(message), (argv, err)
        assert not out.exists(), argv  # nothing partial written
    # export traces one device: no device map
    rc, _, err = cli(capsys, "export", "--model", model, "--format", "pt2", "--out", out, "--device-map", "auto")
    assert rc == 2 and err.strip() == ("sere-fx export: error: --device-map: an artifact is traced on one device; "
                                       "expected --device instead, got 'auto'") and not out.exists()
    # the topk export works once told to re-route every call
    rc, stdout, err = cli(capsys, "export", "--model", model, "--policy", "topk", "--format", "pt2", "--out", out,
                          "--max-tokens", "none")
    assert rc == 0 and "'max_tokens': None" in stdout, err


def test_unexpected_errors_are_one_line_unless_debugging(tmp_path, capsys, monkeypatch):
    import pytest

    import sere_fx.cli.export

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(sere_fx.cli.export, "_load_model", broken)
    argv = ["export", "--model", tmp_path, "--format", "pt2", "--out", tmp_path / "m.pt2"]
    rc, _, err = cli(capsys, *argv)
    assert rc == 2 and err.strip() == "sere-fx export: error: RuntimeError: disk on fire (--debug shows the traceback)"
    with pytest.raises(RuntimeError, match="disk on fire"):
        main([str(a) for a in argv] + ["--debug"])


def test_eval_checks_every_spec_and_option_before_any_decoding(tmp_path, capsys, monkeypatch):
    """Mistakes a decode pass would only reveal minutes later fail first, one line each."""
    import sere_fx.evaluate as ev
    from sere_fx.resources import testbed_model, testbed_text

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before every argument was checked")

    monkeypatch.setattr(ev, "decode_scores", no_decoding)
    model, text = testbed_model(), testbed_text()
    nowhere = tmp_path / "nowhere"  # a model that is never reached: these fail before it loads
    (tmp_path / "file").write_text("x")
    bare = tmp_path / "bare.safetensors"  # similarity matrices, no output-size predictors
    Similarity({i: torch.eye(64) for i in range(4)}).save(bare)
    cases = [
        (["eval", "--model", model, "--data", text, "--policies", "output:S=1,N=0.5"],
         "--sim: policy 'output:S=1,N=0.5' needs the output-size predictors of a similarity file (sere-fx calibrate "
         "writes them), got None"),
        (["eval", "--model", model, "--data", text, "--num-seqs", "4", "--batch-size", "4", "--sim", bare,
          "--policies", "output:S=1,N=0.5"],
         "--sim: policy 'output' needs an output-size predictor for layer 0; this similarity file has none"),
        (["eval", "--model", nowhere, "--data", text, "--policies", "plan:missing.json"],
         "--policies: policy: 'plan:missing.json': plan: no plan file at 'missing.json'"),
        (["eval", "--model", nowhere, "--data", text, "--policies", "weight:S=1"],
         "--policies: policy: 'weight:S=1': N: policy 'weight' needs N (experts per call), rho (an importance "
         "threshold) or both; got neither"),
        (["eval", "--model", model, "--data", text, "--policies", "oea:S=2", "sere:S=2"],
         "--sim: policy 'sere:S=2' needs expert-similarity matrices, got None"),
        (["eval", "--model", nowhere, "--data", text, "--policies", "oea:S=2", "--compare", "baseline", "oea:S=1"],
         "--compare: expected labels among --policies ['baseline', 'oea:S=2'], got 'oea:S=1'"),
        (["eval", "--model", nowhere, "--data", text, "--policies", "weight:S=1,Nrank=0.5"],
         "--policies: policy: 'weight:S=1,Nrank=0.5': rank_budget: a per-rank budget needs a placement (--ep-ranks), "
         "got none"),
        (["eval", "--model", nowhere, "--data", text, "--ep-placement", "round_robin"],
         "--ep-placement: only used with --ep-ranks, got 'round_robin' without it"),
        (["eval", "--model", nowhere, "--data", text, "--token-range", "9:3"],
         "--token-range: expected 0 <= START < END, got '9:3'"),
        (["eval", "--model", nowhere, "--data", text, "--out-dir", tmp_path / "file"],
         f"--out-dir: expected a folder for the results, got '{tmp_path / 'file'}' (a file)"),
        (["tune", "--model", nowhere, "--sim", "x", "--data", text, "--token-range", "a:b", "--out", tmp_path / "p.json"],
         "--token-range: expected 'START:END' (either may be empty), got 'a:b'"),
        (["tune", "--model", nowhere, "--sim", "x", "--data", text, "--num-seqs", "32", "--batch-size", "16",
          "--probe-sequences", "8", "--out", tmp_path / "p.json"],
         "--probe-sequences: expected an int in [--batch-size, --num-seqs] = [16, 32], got 8"),
        (["generate", "--model", model, "--artifact", tmp_path / "file", "--prompt", "x"],
         f"--artifact: '{tmp_path / 'file'}' is not a sere-fx artifact"),
        # S against each layer's top-k needs the model: it loads, and the baseline pass never starts
        (["eval", "--model", model, "--data", text, "--num-seqs", "4", "--batch-size", "4", "--policies", "oea:S=2",
          "oea:S=9"],
         "--policies: policy: 'oea:S=9': S: expected an integer in [1, 8] (top-k of model.layers.0.mlp), got 9"),
        # EP ranks against each layer's experts: a rank with no expert is not a placement
        (["eval", "--model", model, "--data", text, "--num-seqs", "4", "--batch-size", "4", "--policies", "oea:S=2",
          "--ep-ranks", "100"],
         "--ep-ranks: expected at most 64 EP ranks (layer 0's experts: each rank holds one or more), got 100"),
        (["tune", "--model", model, "--sim", bare, "--data", text, "--num-seqs", "4", "--batch-size", "4",
          "--ep-ranks", "65", "--out", tmp_path / "p.json"],
         "--ep-ranks: expected at most 64 EP ranks (layer 0's experts: each rank holds one or more), got 65"),
    ]
    for argv, message in cases:
        rc, _, err = cli(capsys, *argv)
        lines = [line for line in err.splitlines() if line.startswith("sere-fx")]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"sere-fx {argv[0]}: error: {message}"), (argv, err)
    assert not (tmp_path / "p.json").exists()


def test_eval_reports_the_busiest_expert_parallel_rank(tmp_path, capsys):
    import json

    from sere_fx.resources import testbed_model, testbed_text

    out = tmp_path / "ep"
    rc, stdout, err = cli(capsys, "eval", "--model", testbed_model(), "--data", testbed_text(), "--num-seqs", "8",
                          "--batch-size", "8", "--steps", "3", "--ep-ranks", "4", "--policies", "weight:S=1,N=0.6",
                          "weight:S=1,Nrank=0.5", "--out-dir", out)
    assert rc == 0, err
    assert "max-rank experts" in stdout and "the most loaded of 4 EP ranks (linear placement)" in stdout
    results = {r["label"]: r for r in json.load(open(out / "eval.json"))["results"]}
    for r in results.values():  # the busiest of 4 ranks holds at least a quarter, at most all
        assert r["distinct"] / 4 - 1e-9 <= r["max_rank_distinct"] <= r["distinct"]
    # 16 experts per rank; half of what a rank's share picked: at most 8 on any rank, every step
    assert results["weight:S=1,Nrank=0.5"]["max_rank_distinct"] <= 8
    assert results["baseline"]["max_rank_distinct"] > 8  # batch 8 x top-8: the cap binds
    assert (out / "pareto_ep.png").read_bytes()[:4] == b"\x89PNG"


def test_dtype_auto_and_device_map_on_the_cpu(tmp_path, capsys):
    """``--dtype auto`` loads the checkpoint's bf16; ``--device-map auto`` (accelerate) places the
    whole model on the CPU here, and computes what the plain load computes."""
    from sere_fx.resources import testbed_model, testbed_text

    common = ["calibrate", "--model", testbed_model(), "--data", testbed_text(), "--num-seqs", "8", "--seq-len", "32",
              "--batch-size", "8"]
    files = {}
    for name, extra in [("plain", []), ("cpu", ["--device", "cpu"]), ("map", ["--device-map", "auto"]),
                        ("auto", ["--dtype", "auto"])]:
        files[name] = tmp_path / f"{name}.safetensors"
        rc, _, err = cli(capsys, *common, *extra, "--out", files[name])
        assert rc == 0, (name, err)
    sims = {name: Similarity.load(path) for name, path in files.items()}
    for layer in range(4):
        plain = sims["plain"][layer]
        assert torch.equal(sims["cpu"][layer], plain) and torch.allclose(sims["map"][layer], plain, atol=1e-6)
        # bf16 expert outputs: close, not equal (each expert's ranking of the others is what routing reads)
        auto = sims["auto"][layer]
        assert not torch.equal(auto, plain) and (auto - plain).abs().max() < 0.02
        ranks = lambda m: m.argsort(dim=1, descending=True)[:, :4]  # noqa: E731
        assert (ranks(auto) == ranks(plain)).float().mean() > 0.8


def test_a_text_shorter_than_num_seqs_is_noted(tmp_path, capsys):
    from sere_fx.resources import testbed_model, testbed_text

    rc, _, err = cli(capsys, "eval", "--model", testbed_model(), "--data", testbed_text(), "--token-range", "0:700",
                     "--num-seqs", "100000", "--steps", "2", "--prefill", "2", "--batch-size", "4", "--policies",
                     "oea:S=2", "--out-dir", tmp_path / "out")
    assert rc == 0, err
    # 700 tokens hold 140 windows of 2 + 2 + 1 tokens; 140 is a whole number of batches of 4
    assert f"note: {testbed_text()} gives 140 windows of 5 tokens (asked for --num-seqs 100000)" in err, err


def test_demo_as_the_readme_runs_it(tmp_path, capsys, monkeypatch):
    import re

    from sere_fx.demo import speedup_verdict

    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(capsys, "demo")  # the README's first line, defaults included
    assert rc == 0, err
    files = sorted(p.name for p in (tmp_path / "sere-demo").iterdir())
    assert files == ["eval.json", "pareto.png", "sim.safetensors", "similarity"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if re.match(r"(baseline|sere|oea|weight)\S* +0\.", line)}
    assert list(rows) == ["baseline", "sere:S=2,rho=0.5", "sere:S=2,rho=0", "oea:S=2", "weight:S=1,N=0.6"]
    base, sere = float(rows["baseline"][-2]), float(rows["sere:S=2,rho=0"][-2])
    assert sere < base, "S=2 rho=0 reads fewer experts"
    # each step reads at most 0.6 of what its tokens picked (and they pick about what the baseline's do)
    assert float(rows["weight:S=1,N=0.6"][-2]) <= 0.6 * base * 1.02
    line = next(line for line in out.splitlines() if line.startswith("speed-up"))
    speed, lo, hi = map(float, re.match(r"speed-up ([\d.]+)x \[([\d.]+), ([\d.]+)\] \(per-pair ratios\); ", line).groups())
    assert re.search(r"\(median \[p10, p90\] of 9, interleaved\)", out), "every repeat gives one pair"
    assert lo < hi and speed > 0
    # the line after it says which figure to read, and whether the spread resolves a difference
    reading = out.splitlines()[out.splitlines().index(line) + 1]
    assert reading.startswith("  read the speed-up line: the median of the 9 per-pair ratios baseline / SERE; "), reading
    assert ("includes 1x: no difference resolved" in reading) == (lo <= 1.0 <= hi)
    # the speed-up is always read against the limit the distinct experts allow
    limit = float(re.search(r"limit (?:from experts read is|of) ([\d.]+)x", line).group(1))
    assert abs(limit - base / sere) < 0.01
    assert speedup_verdict(speed, limit) in line
    assert speedup_verdict(2.0, 1.5).startswith("above the limit of 1.50x: timing noise")
    assert speedup_verdict(1.2, 1.5) == "the limit from experts read is 1.50x on the MoE layers alone"


def test_the_reading_judges_the_interval_as_printed():
    from types import SimpleNamespace as NS

    from sere_fx.demo import speedup_reading

    def reading(p10, p90):
        return speedup_reading(NS(speedup=NS(p10_s=p10, p90_s=p90, repeats=9), baseline=NS(median_s=1.1),
                                  policy=NS(median_s=1.0)))

    assert "no difference resolved" in reading(1.003, 1.19)  # printed [1.00, 1.19]: includes 1x
    assert "no difference resolved" in reading(0.8, 0.996)  # printed [0.80, 1.00]
    assert "no difference resolved" not in reading(1.006, 1.19)  # printed [1.01, 1.19]
    assert "no difference resolved" not in reading(0.8, 0.994)  # printed [0.80, 0.99]


def test_readme_tune_and_eval_commands(tmp_path, capsys, monkeypatch):
    """The README's `sere-fx tune` and `sere-fx eval` lines on the test-bed, as typed except for
    their size: 32 sequences of 3 scored steps instead of the defaults (minutes of decoding).
    Distinct experts: a re-routed model's tokens pick slightly different experts than the
    baseline's, hence the 2% margins."""
    import json
    import re

    from sere_fx.resources import testbed_model, testbed_text

    block = doc_pages.block("evaluation.md", "bash", "sere-fx tune --model DIR ")
    commands = [" ".join(part.strip() for part in line.split("\\\n")) for line in re.split(r"\n(?=sere-fx )", block)]
    assert [c.split()[1] for c in commands] == ["tune", "eval"]
    monkeypatch.chdir(tmp_path)
    model, text = testbed_model(), testbed_text()
    rc, _, err = cli(capsys, "calibrate", "--model", model, "--data", text, "--token-range", "0:40000", "--num-seqs", "32",
                     "--seq-len", "32", "--out", "sim.safetensors")
    assert rc == 0, err
    for command in commands:
        argv = command.replace("DIR", model).replace("text.txt", text).split()[1:]
        argv += ["--num-seqs", "32", "--steps", "3"]
        rc, out, err = cli(capsys, *argv)
        assert rc == 0, (command, err)
    plan = json.load(open("plan.json"))
    tuned = plan["tuned"]
    assert tuned["max_experts"] == 0.6 and tuned["distinct"] <= 0.6 * tuned["baseline_distinct"] + 1e-9
    report = json.load(open("eval/eval.json"))
    labels = ["baseline", "sere:S=2,rho=0", "oea:S=2", "weight:S=1,N=0.6", "plan:plan.json"]
    assert [r["label"] for r in report["results"]] == labels
    base, weight = report["results"][0], report["results"][3]
    for layer, distinct in weight["distinct_per_layer"].items():  # 40% fewer than the batch picked, every step
        assert distinct <= 0.6 * base["distinct_per_layer"][layer] * 1.02
    assert weight["settings"]["layers"]["0"] == {"policy": "weight", "S": 1, "rho": None, "N": 0.6}
    assert re.search(r"^weight:S=1,N=0.6 vs oea:S=2: accuracy ratio .* \(paired bootstrap, 95%\)$", out, re.M), out
    assert re.search(r"^plan:plan.json vs oea:S=2: accuracy ratio ", out, re.M), out


def test_bench_writes_a_bare_out_file_name(tmp_path, capsys, monkeypatch):
    # `--out r.json` has no directory part; it used to fail on os.makedirs('') after the whole grid
    from sere_fx import layer_bench

    monkeypatch.chdir(tmp_path)
    ran = []
    monkeypatch.setattr(layer_bench, "run", lambda args: ran.append(args.out) or {"rows": []})
    monkeypatch.setattr(layer_bench, "plot", lambda result, path: open(path, "w").close())
    assert main(["bench", "--quick", "--out", "r.json"]) == 0
    assert ran == ["r.json"]
    assert (tmp_path / "r.json").read_text().strip().startswith("{") and (tmp_path / "r.png").exists()


def test_readme_quickstart_calibrate_and_inspect_as_typed(tmp_path, capsys, monkeypatch):
    """The Quickstart's two commands with every value as typed, on the test-bed (its public text as
    the README's corpus.jsonl)."""
    import json
    import shlex

    from sere_fx.resources import testbed_model, testbed_text

    block = doc_pages.block("README.md", "bash", "sere-fx calibrate --model DIR ")
    commands = [shlex.split(c) for c in block.replace("\\\n", " ").strip().splitlines()]
    assert [c[:2] for c in commands] == [["sere-fx", "calibrate"], ["sere-fx", "inspect"]]
    monkeypatch.chdir(tmp_path)
    docs = [d for d in open(testbed_text()).read().split("<|endoftext|>") if d.strip()]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    rc, out, err = cli(capsys, *[testbed_model() if a == "DIR" else a for a in commands[0][1:]])
    assert rc == 0, err
    sim = Similarity.load(tmp_path / "sim.safetensors")
    assert sim.metadata["num_seqs"] <= 400 and sim.metadata["seq_len"] == 128 and sim.metadata["method"] == "frobenius"
    assert sim.metadata["tokens"] == 128 * sim.metadata["num_seqs"] and sorted(sim) == [0, 1, 2, 3]
    rc, out, err = cli(capsys, *commands[1][1:])
    assert rc == 0, err
    assert "critical@0.5" in out and sorted(os.listdir(tmp_path / "report"))[-1] == "overview.png"
