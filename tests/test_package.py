"""Package layout: calibration/ and exporters/ are reachable as sere_fx.* from an install or a checkout."""

import os

import pytest

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


def _source_packages() -> dict[str, str]:
    """Every package of the source tree (a folder with an __init__.py) by the name it installs as."""
    found = {}
    for top, name in (("sere_fx", "sere_fx"), ("calibration", "sere_fx.calibration"), ("exporters", "sere_fx.exporters")):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                rel = os.path.relpath(folder, os.path.join(ROOT, top))
                found[name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}"] = folder
    return found


def test_pyproject_installs_every_package_and_kernel_source_under_sere_fx():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    config = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    packages = _source_packages()
    assert sorted(config["packages"]) == sorted(packages)  # none left out, no top-level calibration/exporters
    assert config["package-dir"] == {"sere_fx.calibration": "calibration", "sere_fx.exporters": "exporters"}
    # the kernels build from sources that are not Python: each must ship
    kernels = packages["sere_fx.kernels"]
    sources = sorted(f for f in os.listdir(kernels) if f.endswith((".c", ".cpp", ".h")))
    assert sources and sorted(config["package-data"]["sere_fx.kernels"]) == sources


def test_subpackages_are_attributes_without_an_explicit_import():
    import subprocess
    import sys

    code = "import sere_fx; print(sere_fx.calibration.METHODS, sere_fx.exporters.FORMATS)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "frobenius" in out and "onnx" in out


def _imports_between_modules() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports anywhere in its code
    (module level or inside a function: a lazy import still ties the two modules together)."""
    import ast

    modules = {}
    for package, folder in _source_packages().items():
        for file in os.listdir(folder):
            if file.endswith(".py"):
                modules[package if file == "__init__.py" else f"{package}.{file[:-3]}"] = os.path.join(folder, file)
    graph = {}
    for name, path in modules.items():
        seen = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                seen |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                seen |= {a.name for a in node.names}
        graph[name] = {m for m in seen if m in modules and m != name}
    return graph


def test_no_import_cycles_between_modules():
    graph = _imports_between_modules()
    assert graph["sere_fx.vllm.engine"] and graph["sere_fx.config"] is not None  # the walk found the modules

    def cycle_from(start):  # depth-first: a path back to start, or None
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, sorted(graph)) if c is not None]
    assert not cycles, f"import cycles: {[' -> '.join(c) for c in cycles]}"
