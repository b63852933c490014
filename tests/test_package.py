"""Package layout: calibration/ and exporters/ are reachable as sere_fx.* from an install or a checkout."""

import os

import sere_fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sere_fx.__file__)))


def test_source_tree_finder_maps_only_the_two_folders():
    finder = sere_fx._SourceTreeFinder()
    spec = finder.find_spec("sere_fx.calibration")
    assert spec.origin == os.path.join(ROOT, "calibration", "__init__.py")
    assert spec.submodule_search_locations == [os.path.join(ROOT, "calibration")]
    assert finder.find_spec("sere_fx.exporters.export").origin == os.path.join(ROOT, "exporters", "export.py")
    assert finder.find_spec("sere_fx.passes") is None and finder.find_spec("calibration") is None
    assert finder.find_spec("sere_fx.calibration.nothing_here") is None


def test_subpackages_import_under_sere_fx():
    import sere_fx.calibration as calibration
    import sere_fx.exporters as exporters

    assert calibration.calibrate.__module__ == "sere_fx.calibration.calibrate"
    assert exporters.export.__module__ == "sere_fx.exporters.export"


def test_pyproject_installs_no_top_level_calibration_or_exporters():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    packages = text.split("packages = [", 1)[1].split("]", 1)[0]
    names = [p.strip().strip('"') for p in packages.split(",") if p.strip()]
    assert all(n == "sere_fx" or n.startswith("sere_fx.") for n in names), names
    assert '"sere_fx.calibration" = "calibration"' in text and '"sere_fx.exporters" = "exporters"' in text


def test_subpackages_are_attributes_without_an_explicit_import():
    import subprocess
    import sys

    code = "import sere_fx; print(sere_fx.calibration.METHODS, sere_fx.exporters.FORMATS)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "frobenius" in out and "onnx" in out
