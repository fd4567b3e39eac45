"""What the wheel ships: every folder of hsgd/ with Python in it must be a package that setuptools
finds, or ``pip install .`` leaves it out while a run from the source tree still imports it (hsgd/_core
once had no __init__.py: every installed ``python -m hsgd.train`` died on import). CI builds and
installs the wheel itself (.ci/wheel.sh); this catches the cause in a second."""
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_folder_of_hsgd_is_a_package_the_wheel_includes():
    with_python = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "hsgd").rglob("*.py")
    }
    found = set(find_packages(str(ROOT), include=["hsgd", "hsgd.*"]))
    assert with_python - found == set(), "add an __init__.py to these folders"


def test_the_package_ships_its_type_marker():
    assert (ROOT / "hsgd" / "py.typed").is_file()
    assert "py.typed" in (ROOT / "setup.cfg").read_text()


def _pins(path):
    """``name==version`` lines of a constraints file, as {name: version}."""
    lines = (ROOT / path).read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


def _floors():
    """``name>=version`` lines of setup.cfg's install_requires, as {name: version}."""
    text = (ROOT / "setup.cfg").read_text()
    requires = text.split("install_requires =", 1)[1].split("\n\n", 1)[0]
    return dict(line.strip().split(">=") for line in requires.splitlines() if ">=" in line)


def test_the_torch_and_numpy_floors_are_the_versions_ci_runs():
    """setup.cfg's floors are what constraints-floor.txt pins (CI's floor check runs those); the
    development pin in constraints.txt is at or above them."""
    floors, pins = _floors(), _pins("constraints-floor.txt")
    assert floors["torch"] == pins["torch"] and floors["numpy"] == pins["numpy"], (floors, pins)

    def version(text):
        return tuple(int(part) for part in text.split("+")[0].split("."))
    assert version(_pins("constraints.txt")["torch"]) >= version(floors["torch"])


def _wheel_files():
    """The Python files the wheel holds, as setuptools finds its packages (setup.cfg: hsgd, hsgd.*):
    {path relative to the checkout: lines}."""
    packages = find_packages(str(ROOT), include=["hsgd", "hsgd.*"])
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
            for package in packages for path in sorted((ROOT / package.replace(".", "/")).glob("*.py"))}


def test_the_wheel_holds_the_library_and_a_small_benchmark_not_the_lab():
    """The lab (lab/: the investigations, the cost model's fit, the emulated hosts) stays out of the
    wheel; the benchmarks a user runs on their own cluster (hsgd.bench) are at most 10% of its lines."""
    files = _wheel_files()
    listing = "\n".join(f"{lines:6d} {path}" for path, lines in sorted(files.items()))
    packages = {path.rsplit("/", 1)[0].replace("/", ".") for path in files}
    assert "hsgd.hosts" not in packages and not any(p.startswith("lab") for p in packages), listing
    assert "hsgd.bench" in packages and "hsgd/bench/__main__.py" in files, listing
    bench = sum(lines for path, lines in files.items() if path.startswith("hsgd/bench/"))
    total = sum(files.values())
    assert bench <= 0.10 * total, f"benchmark code is {bench} of {total} lines ({bench / total:.1%}):\n{listing}"


def test_the_package_never_imports_the_lab():
    """hsgd/ imports no ``lab`` module (the lab imports hsgd, never the other way)."""
    import re

    importing = [str(path.relative_to(ROOT)) for path in (ROOT / "hsgd").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+lab\b", path.read_text(), re.MULTILINE)]
    assert importing == []
