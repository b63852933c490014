"""Engine start below the engine: the model's config checked in the calling process, worker errors
relayed as the last word, and the samples of one request admitted together."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

from sere_fx import Similarity  # noqa: E402
from sere_fx.discovery import find_moe_layers  # noqa: E402
from sere_fx.vllm import siblings, startup  # noqa: E402
from sere_fx.vllm.settings import SettingsError, parse  # noqa: E402
from tiny_models import FAMILIES, _config, random_similarity, tiny_model  # noqa: E402
from vllm_models import TESTBED_MODEL, TESTBED_TEXT  # noqa: E402

KEY = re.escape('additional_config["sere"]')


def served(hf_config, pipeline: int = 1):
    """What ``check_model`` reads of a ``VllmConfig``."""
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=pipeline))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_alone_gives_the_layers_the_model_has(family):
    # the meta-device model of the config has the sites the real model has
    expected = [(layer.index, f"{layer.name}.experts", layer.num_experts, layer.top_k)
                for layer in find_moe_layers(tiny_model(family))]
    got = startup.model_layers(_config(family))
    assert [(layer.index, layer.name, layer.num_experts, layer.top_k) for layer in got] == expected


def test_a_config_transformers_cannot_build_is_left_to_the_workers():
    assert startup.model_layers(SimpleNamespace(architectures=["NoSuchForCausalLM"])) is None
    startup.check_model(served(SimpleNamespace(architectures=["NoSuchForCausalLM"])), parse({"policy": "oea"}))


@pytest.fixture(scope="module")
def testbed():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(TESTBED_MODEL)


@pytest.fixture(scope="module")
def testbed_sim(tmp_path_factory, testbed):
    path = tmp_path_factory.mktemp("startup") / "sim.safetensors"
    layers = [SimpleNamespace(index=i, num_experts=64) for i in range(4)]
    Similarity(random_similarity(layers), {"architecture": "Qwen3MoeForCausalLM"}).save(path)
    return str(path)


def test_what_the_model_decides_fails_in_the_calling_process(testbed, testbed_sim, tmp_path):
    check = lambda raw: startup.check_model(served(testbed), parse(raw))  # noqa: E731
    check({"sim": testbed_sim, "S": 2, "rho": 0.0})  # fits
    with pytest.raises(SettingsError, match=f"^{KEY}\\[\"S\"\\]: expected an integer in \\[1, 8\\] \\(top-k of "
                                            "model.layers.0.mlp.experts\\), got 99$"):
        check({"sim": testbed_sim, "S": 99})
    small = tmp_path / "small.safetensors"  # 32 experts for a 64-expert model
    Similarity({i: torch.rand(32, 32) for i in range(4)}).save(small)
    with pytest.raises(SettingsError, match=f"^{KEY}\\[\"sim\"\\]: sim\\[0\\]: expected shape \\[64, 64\\] \\(experts of "
                                            "model.layers.0.mlp.experts\\), got \\[32, 32\\]$"):
        check({"sim": str(small), "S": 2})
    with pytest.raises(SettingsError, match=f"^{KEY}\\[\"sim\"\\]: cannot read '{re.escape(TESTBED_TEXT)}' as a "
                                            "similarity file"):
        check({"sim": TESTBED_TEXT, "S": 2})
    with pytest.raises(SettingsError, match=f"^{KEY}\\[\"ep_ranks\"\\]: expected at most 64 EP ranks \\(layer 0's "
                                            "experts: each rank holds one or more\\), got 100$"):
        check({"policy": "oea", "stats": True, "ep_ranks": 100})
    check({"policy": "oea", "stats": True, "ep_ranks": 64})
    other = tmp_path / "other.safetensors"  # calibrated on another architecture
    Similarity({i: torch.rand(64, 64) for i in range(4)}, {"architecture": "MixtralForCausalLM"}).save(other)
    with pytest.raises(SettingsError, match=f"^{KEY}\\[\"sim\"\\]: calibrated on a MixtralForCausalLM model"):
        check({"sim": str(other)})


def test_a_worker_error_is_raised_again_as_the_last_word(monkeypatch, tmp_path):
    monkeypatch.delenv(startup.ERROR_FILE_ENV, raising=False)
    startup.name_error_file()
    path = os.environ[startup.ERROR_FILE_ENV]
    assert os.path.isfile(path)

    def engine_start_fails():
        startup.record(SettingsError('additional_config["sere"]: layer 3 runs a monolithic MoE kernel'))
        raise RuntimeError("Engine core initialization failed. See root cause above.")

    with pytest.raises(SettingsError, match=r'^additional_config\["sere"\]: layer 3 runs a monolithic MoE kernel$'):
        startup.relaying(engine_start_fails)()
    assert not os.path.exists(path) and startup.ERROR_FILE_ENV not in os.environ  # read once, removed
    # a failure that is not the settings' stays vLLM's own
    startup.name_error_file()
    with pytest.raises(RuntimeError, match="out of memory"):
        startup.relaying(lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))()
    # a started engine leaves no file behind
    startup.name_error_file()
    path = os.environ[startup.ERROR_FILE_ENV]
    assert startup.relaying(lambda: "client")() == "client" and not os.path.exists(path)


def request(rid: str, n: int | None = None, extra=None):
    args = dict(extra or {})
    if n is not None:
        args[siblings.GROUP_KEY] = n
    return SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace(extra_args=args or None, n=1))


def test_the_samples_of_one_request_are_admitted_together():
    gate = siblings.Gate()
    alone = request("cmpl-1")
    assert gate.admit(alone) == [alone]  # n = 1: at once
    first, second, third = (request(f"{i}_cmpl-2", 3) for i in range(3))
    other = request("0_cmpl-3", 2)
    assert gate.admit(first) == [] and gate.admit(other) == [] and gate.admit(second) == []
    assert gate.admit(third) == [first, second, third]  # the whole group, in arrival order
    assert list(gate.held) == ["cmpl-3"]
    gate.forget(["0_cmpl-3"])  # aborted while held
    assert gate.held == {}
    # an id that only looks like a child, or a stamp of 1, is not held
    assert gate.admit(request("x_cmpl-4", 2)) != [] and gate.admit(request("0_cmpl-5", 1)) != []
    gate.admit(request("0_cmpl-6", 2))
    gate.forget(None)
    assert gate.held == {}


def test_the_calling_process_stamps_requests_with_several_samples():
    params = SimpleNamespace(n=3, extra_args={"sere": False})
    req = SimpleNamespace(sampling_params=params)
    siblings.stamp(req)
    assert params.extra_args == {"sere": False, siblings.GROUP_KEY: 3}
    single = SimpleNamespace(sampling_params=SimpleNamespace(n=1, extra_args=None))
    siblings.stamp(single)
    assert single.sampling_params.extra_args is None
    child = request("2_cmpl-7", 3, {"sere": False})
    assert siblings.group_of(child) == ("cmpl-7", 3)
    # an explicit group (the engine evaluation's batches): any ids, admitted together
    gate = siblings.Gate()
    batch = [request(str(i), extra={siblings.GROUP_KEY: {"group": "eval-0", "size": 3}}) for i in (7, 8, 9)]
    assert gate.admit(batch[0]) == [] and gate.admit(batch[1]) == [] and gate.admit(batch[2]) == batch
    assert siblings.group_of(request("5", extra={siblings.GROUP_KEY: {"group": "g", "size": 1}})) is None


def test_calibration_refuses_engines_whose_prefill_it_cannot_read():
    from sere_fx.calibration import calibrate_engine

    def llm(prefix_caching=False, dp=1):
        config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp),
                                 cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config))

    windows = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^llm: expected an engine started with enable_prefix_caching=False"):
        calibrate_engine(llm(prefix_caching=True), windows)
    with pytest.raises(ValueError, match=r"^llm: expected data_parallel_size 1 .*, got 2$"):
        calibrate_engine(llm(dp=2), windows)
    with pytest.raises(ValueError, match=r"^method: expected one of \['frobenius', 'cosine', 'cka'\], got 'l2'$"):
        calibrate_engine(llm(), windows, "l2")
    with pytest.raises(TypeError, match=r"^windows: expected token ids \[N, L\] with N >= 1, got torch.Size\(\[8\]\)$"):
        calibrate_engine(llm(), windows[0])
