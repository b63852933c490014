"""Calibration: expert-similarity matrices for a model (installed as ``sere_fx.calibration``)."""
