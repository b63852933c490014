"""Engine start: what the calling process checks, and how any mistake ends as the last line.

- ``check_model``: vLLM knows the served model's Hugging Face config (architecture, layers,
  expert counts, top-k) in the calling process, when the engine config is created. The same
  config built as a transformers model on the meta device (no weights, no memory, well under a
  second) gives its MoE layers through ``sere_fx.discovery``, the project's one way of finding
  them, and the settings are resolved against those layers exactly as each worker resolves them
  against the engine's: S against each top-k, the similarity file's layers, shapes, architecture
  and predictors, ``ep_ranks`` against the expert counts. A config transformers cannot build is
  left to the workers (logged once).
- What only a worker can tell (the MoE kernel, the router class) still fails in the worker,
  where vLLM would bury the message under its own "Engine core initialization failed". So the
  worker writes its message to a file the calling process named (``record``), and the calling
  process raises it again once engine start failed (``relaying``, around vLLM's engine-core
  client factories).
- ``fail``: in vLLM's OpenAI server the message is printed as one line and the process exits with
  status 2, as the server exits on a bad argument; elsewhere (``LLM(...)``) it is raised, so it
  is the traceback's last line.
"""

from __future__ import annotations

import os
import sys
import tempfile

from sere_fx.vllm.log import logger as _logger
from sere_fx.vllm.settings import WHERE, EngineLayer, EngineSettings, SettingsError, resolve_layers

# the file a worker writes its settings error to (set by the calling process, inherited by the
# engine core and worker processes it starts)
ERROR_FILE_ENV = "SERE_FX_START_ERROR_FILE"


def model_layers(hf_config) -> list[EngineLayer] | None:
    """The served model's MoE layers, from its config alone, or None where transformers cannot
    build that config or find its routers."""
    import torch
    from transformers import AutoModelForCausalLM

    from sere_fx.discovery import find_moe_layers

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        layers = find_moe_layers(model, allow_meta=True)
    except Exception as exc:  # noqa: BLE001 - an architecture transformers lacks: the workers check
        _logger().info("sere-fx: the model's settings are checked in the workers (transformers cannot build %s on "
                       "the meta device: %s)", getattr(hf_config, "architectures", None), exc)
        return None
    return [EngineLayer(layer.index, f"{layer.name}.experts", layer.num_experts, layer.top_k) for layer in layers]


def check_model(vllm_config, settings: EngineSettings) -> None:
    """Resolve ``settings`` against the MoE layers of the served model's config (raises ``SettingsError``)."""
    from sere_fx.errors import ArgumentError
    from sere_fx.placement import Placement, check_layers

    hf_config = vllm_config.model_config.hf_config
    layers = model_layers(hf_config)
    if layers is None:
        return
    if not layers:
        raise SettingsError(f"{WHERE}: the served model ({_architecture(hf_config)}) has no MoE layer to re-route")
    pipeline = vllm_config.parallel_config.pipeline_parallel_size > 1
    resolve_layers(settings, layers, _architecture(hf_config), subset=pipeline)
    if settings.ep_ranks is not None:
        try:
            check_layers(Placement(settings.ep_ranks, settings.ep_placement), layers)
        except ArgumentError as exc:
            raise SettingsError(exc.said_as(f'{WHERE}["ep_ranks"]')) from None


def _architecture(hf_config) -> str | None:
    return (getattr(hf_config, "architectures", None) or [None])[0]


def name_error_file() -> None:
    """Calling process, before any worker starts: a fresh file for the workers' message."""
    fd, path = tempfile.mkstemp(prefix="sere-fx-start-", suffix=".txt")
    os.close(fd)
    os.environ[ERROR_FILE_ENV] = path


def record(exc: SettingsError) -> None:
    """Worker: leave the message where the calling process will read it."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(str(exc))
        except OSError:
            pass


def take_recorded() -> str | None:
    """Calling process, once engine start ended: the message a worker recorded (the file is removed)."""
    path = os.environ.pop(ERROR_FILE_ENV, None)
    if not path:
        return None
    try:
        with open(path) as f:
            message = f.read().strip()
        os.remove(path)
    except OSError:
        return None
    return message or None


def relaying(make):
    """``make`` (a factory that starts the engine core) such that a settings error a worker
    recorded ends engine start as ``fail`` ends it, instead of vLLM's generic start-up error."""
    import functools

    @functools.wraps(make)
    def make_and_relay(*args, **kwargs):
        try:
            client = make(*args, **kwargs)
        except SettingsError as exc:  # an in-process engine core: the worker's own error
            take_recorded()
            fail(exc)
        except Exception:
            message = take_recorded()
            if message is None:
                raise
            fail(SettingsError(message))
        take_recorded()
        return client

    return make_and_relay


def _serving_cli() -> bool:
    """Whether this process is one of vLLM's command-line servers (``python -m vllm.entrypoints...``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return bool(spec is not None and spec.name.startswith("vllm.entrypoints"))


def fail(exc: SettingsError):
    """End engine start on ``exc``: one line and exit status 2 in vLLM's server, else raise it."""
    if _serving_cli():
        sys.stdout.flush()
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    raise exc
