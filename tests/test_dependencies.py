"""Every package ddtree imports at run time is a declared runtime dependency, so the README's install
(``pip install torch==2.13.0 .``, no extras) runs every command. CI also runs that install for real
(``.ci/run``); this test names the missing package without installing anything."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def imported_top_level_modules(package: Path) -> dict[str, str]:
    """{top-level module: a file importing it} for every import statement in the package, function-level
    ones included (a lazy import still runs when its command does)."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def declared(extra: str | None = None) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {Requirement(r).name.lower().replace("_", "-") for r in requirements}


def test_every_third_party_import_is_a_runtime_dependency():
    distributions = packages_distributions()  # module -> the installed distributions that provide it
    runtime = declared()
    missing = []
    for module, where in imported_top_level_modules(ROOT / "ddtree").items():
        if module in sys.stdlib_module_names or module in ("ddtree", "__future__"):
            continue
        provided_by = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        assert provided_by, f"{where} imports {module!r}, which no installed distribution provides"
        if not provided_by & runtime:
            missing.append(f"{module} (imported by {where}; from {', '.join(sorted(provided_by))})")
    assert not missing, "not in [project] dependencies: " + "; ".join(missing)


def test_the_test_extra_holds_only_what_tests_need():
    # A runtime package listed only under [test] is how httpx went missing from a plain install.
    assert not declared("test") & declared(), declared("test") & declared()


@pytest.mark.parametrize("module", ["httpx", "jinja2"])
def test_the_check_sees_lazy_and_command_only_imports(module):
    assert module in imported_top_level_modules(ROOT / "ddtree")


def test_torch_is_a_tested_range_and_only_the_install_commands_pin_it():
    """``pip install ddtree`` must keep a user's own CUDA build of torch when it is in the tested range
    (2.11, the lent H200 image's, through 2.13); the README's commands and CI pin the version the suite
    runs on."""
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    assert not any(s.operator == "==" for s in torch.specifier), torch
    assert all(Version(v) in torch.specifier for v in ("2.11.0", "2.12.1", "2.13.0"))
    assert Version("2.10.0") not in torch.specifier and Version("2.14.0") not in torch.specifier
    for path in ("README.md", ".ci/run"):
        assert "torch==2.13.0" in (ROOT / path).read_text(), path
