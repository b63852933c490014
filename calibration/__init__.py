"""Calibration: expert-similarity matrices for a model (installed as ``sere_fx.calibration``).

    sim = sere_fx.calibration.calibrate(model, batches, method="frobenius")
    sim.save("sim.safetensors")
    sim = sere_fx.calibration.calibrate_engine(llm, windows)     # inside a vLLM engine
"""

from sere_fx.calibration.calibrate import calibrate
from sere_fx.calibration.data import batched, read_documents, token_windows
from sere_fx.calibration.engine import calibrate_engine
from sere_fx.calibration.methods import DEFAULT_CKA_SAMPLE, METHODS

__all__ = [
    "calibrate",
    "calibrate_engine",
    "read_documents",
    "token_windows",
    "batched",
    "METHODS",
    "DEFAULT_CKA_SAMPLE",
]
