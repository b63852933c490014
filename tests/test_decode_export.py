"""Decode artifacts (export(..., cache="static")): the runner's greedy tokens equal the eager model's generate."""

import copy
import os
import subprocess
import sys

import pytest
import torch

import doc_pages

import sere_fx
from sere_fx import exporters
from sere_fx.discovery import find_moe_layers
from tiny_models import random_similarity, tiny_model

NEW_TOKENS = 16


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))


@pytest.fixture(scope="module")
def testbed():
    """The test-bed with SERE S=2 rho=0 (every call re-routed), its untransformed twin, 8 real prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sere_fx.calibration import batched, calibrate, read_documents, token_windows
    from sere_fx.resources import testbed_model, testbed_text

    plain = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(testbed_model())
    text = token_windows(tokenizer, read_documents(testbed_text()), 32, 16, token_range=(0, 4000))
    model = sere_fx.transform(copy.deepcopy(plain), calibrate(plain, batched(text, 8), progress=False), S=2, rho=0.0,
                              max_tokens=None)
    prompts = token_windows(tokenizer, read_documents(testbed_text()), 8, 8, token_range=(40000, None))
    expected, untransformed = _generate(model, prompts), _generate(plain, prompts)
    assert (expected != untransformed).any(), "SERE must change some greedy token, or the test proves nothing"
    return model, plain, prompts, expected, untransformed


@pytest.mark.parametrize("format", ["pt2", "aoti", "onnx"])
def test_testbed_artifact_generates_what_the_model_generates(testbed, format, tmp_path):
    model, _, prompts, expected, _ = testbed
    path = exporters.export(model, prompts, tmp_path / ("m.onnx" if format == "onnx" else "m.pt2"), format=format,
                            cache="static", max_cache_len=32)
    runner = exporters.load(path)
    assert torch.equal(runner.generate(prompts, NEW_TOKENS), expected)
    assert torch.equal(runner.generate(prompts, NEW_TOKENS), expected), "a second generate starts from a clean cache"
    settings = exporters.read_settings(path)
    assert settings["cache"]["batch"] == 8 and settings["layers"]["0"] == {"policy": "sere", "S": 2, "rho": 0.0}
    if format == "aoti":
        # the package decodes in a process that never imports sere_fx
        torch.save(prompts, tmp_path / "ids.pt")
        code = (
            "import sys, torch, transformers.integrations.moe\n"
            f"run = torch._inductor.aoti_load_package({path!r}); ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
            "toks = [ids]; logits = run(input_ids=ids, cache_position=torch.arange(ids.shape[1]))\n"
            f"for p in range(ids.shape[1], ids.shape[1] + {NEW_TOKENS}):\n"
            "    toks.append(logits[:, -1].argmax(-1, keepdim=True))\n"
            "    logits = run(input_ids=toks[-1], cache_position=torch.tensor([p]))\n"
            "assert 'sere_fx' not in sys.modules\n"
            f"torch.save(torch.cat(toks, 1), {str(tmp_path / 'out.pt')!r})\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_untransformed_artifact_generates_what_the_plain_model_generates(testbed, tmp_path):
    _, plain, prompts, _, untransformed = testbed
    path = exporters.export(plain, prompts, tmp_path / "plain.pt2", cache="static", max_cache_len=32)
    assert torch.equal(exporters.load(path).generate(prompts, NEW_TOKENS), untransformed)
    assert exporters.read_settings(path)["sere_fx"] is False


# DeepSeek-V2 as aoti decodes alike (the same program, lowered); left out of the suite for time.
@pytest.mark.parametrize("family, format", [("deepseek_v2", "pt2"), ("mixtral", "onnx")])
def test_other_router_shapes(family, format, tmp_path):
    model = tiny_model(family, experts_implementation="grouped_mm")
    plain = copy.deepcopy(model)
    sere_fx.transform(model, random_similarity(find_moe_layers(model), seed=9), S=1, rho=0.0, max_tokens=None)
    prompts = torch.randint(3, 90, (8, 5), generator=torch.Generator().manual_seed(0))
    expected = _generate(model, prompts)
    assert not torch.equal(expected, _generate(plain, prompts))
    path = exporters.export(model, prompts, tmp_path / ("m.onnx" if format == "onnx" else "m.pt2"), format=format,
                            cache="static", max_cache_len=24)
    assert torch.equal(exporters.load(path).generate(prompts, NEW_TOKENS), expected)


def test_mistakes(testbed, tmp_path):
    model, _, prompts, _, _ = testbed
    path = exporters.export(model, prompts, tmp_path / "m.pt2", cache="static", max_cache_len=20)
    runner = exporters.load(path)
    with pytest.raises(ValueError, match=r"input_ids: .*m\.pt2 decodes batches of exactly 8 sequences \(fixed at "
                                         r"export\), got 4"):
        runner.generate(prompts[:4])
    with pytest.raises(ValueError, match=r"max_new_tokens: a prompt of 8 tokens plus 16 new ones needs 24 cache "
                                         r"positions; .* has 20"):
        runner.generate(prompts, 16)
    with pytest.raises(ValueError, match=r"input_ids: a prompt of 20 tokens leaves no room for new ones in the "
                                         r"20-position cache"):
        runner.generate(torch.cat([prompts] * 3, dim=1)[:, :20], 1)
    with pytest.raises(ValueError, match=r"cache: format 'tensorrt' does not carry a KV cache here"):
        exporters.export(model, prompts, tmp_path / "x.ts", format="tensorrt", cache="static", max_cache_len=20)
    with pytest.raises(FileNotFoundError, match=r"path: no artifact at"):
        exporters.load(tmp_path / "missing.pt2")
    with pytest.raises(ValueError, match=r"max_cache_len: expected an int >= 2 with cache='static', got None"):
        exporters.export(model, prompts, tmp_path / "x.pt2", cache="static")
    with pytest.raises(ValueError, match=r"cache: expected one of \[None, 'static'\], got 'dynamic'"):
        exporters.export(model, prompts, tmp_path / "x.pt2", cache="dynamic")
    with pytest.raises(ValueError, match=r"max_batch: a cache export's batch is fixed"):
        exporters.export(model, prompts, tmp_path / "x.pt2", cache="static", max_cache_len=20, max_batch=4)
    logits_only = exporters.export(model, prompts, tmp_path / "l.pt2")
    with pytest.raises(ValueError, match=r"maps input_ids to logits with no KV cache"):
        exporters.load(logits_only)
    assert not os.path.exists(tmp_path / "x.pt2")


def test_readme_generate_commands(testbed, tmp_path, monkeypatch, capsys):
    """The README's decode-artifact commands, as typed."""
    import re

    from transformers import AutoTokenizer

    from sere_fx.cli import main
    from sere_fx.resources import testbed_model

    block = doc_pages.block("deployment.md", "bash", "--cache static")
    commands = [c.replace("\\\n", " ").replace("DIR", testbed_model()) for c in re.split(r"\n(?=sere-fx)", block.strip())]
    assert [c.split()[1] for c in commands] == ["export", "generate"]
    monkeypatch.chdir(tmp_path)
    plain = testbed[1]
    sere_fx.calibration.calibrate(plain, [testbed[2]], progress=False).save("sim.safetensors")
    import shlex

    assert main(shlex.split(commands[0])[1:]) == 0, capsys.readouterr().err
    capsys.readouterr()
    argv = shlex.split(commands[1])[1:]
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    # the same text from the eager model transformed as the export command says (defaults: S=2, rho=0.5)
    tokenizer = AutoTokenizer.from_pretrained(testbed_model())
    prompt = argv[argv.index("--prompt") + 1]
    new = int(argv[argv.index("--max-new-tokens") + 1]) if "--max-new-tokens" in argv else 16
    eager = sere_fx.transform(copy.deepcopy(plain), "sim.safetensors")
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = eager.generate(ids, max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
    assert printed == tokenizer.decode(out[0], skip_special_tokens=True) + "\n"
