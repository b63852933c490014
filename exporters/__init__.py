"""Exporters: deployable artifacts of transformed models (installed as ``sere_fx.exporters``)."""
