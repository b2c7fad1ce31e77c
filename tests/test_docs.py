"""The documentation: its code blocks run, and every public name has an API reference entry.

Nothing is built here; CI builds the site with `.venv/bin/mkdocs build --strict` (.ci/run).
Code blocks fenced as `python` run, each on its own, from the repository root; blocks fenced as
`python {.fragment}` are shown on the site but not run (docs/architecture.md, "The documentation").
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

grab_code_blocks = pytest.importorskip(
    "mktestdocs", reason="the docs tools are in the dev extra"
).grab_code_blocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [*sorted(DOCS.rglob("*.md")), README]
# Each of these pages must hold at least one block that runs.
GUIDES = [DOCS / "getting-started.md", *sorted((DOCS / "guides").glob("*.md"))]
PUBLIC_MODULES = [
    "pergrad",
    "pergrad.norms",
    "pergrad.outliers",
    "pergrad.dp",
    "pergrad.influence",
    "pergrad.testing",
    "pergrad.plotting",
]
# The extras a block may need; without one, its blocks are skipped rather than failed.
OPTIONAL = {"jax", "torch", "optax", "matplotlib", "dp_accounting", "scipy"}
README_COMMANDS = [
    "bash scripts/dev.sh quickstart",
    "bash scripts/dev.sh test",
]


def runnable_blocks(page: Path) -> list[str]:
    return grab_code_blocks(page.read_text(encoding="utf-8"), lang="python")


def block_params() -> list[Any]:
    return [
        pytest.param(page, index, source, id=f"{page.relative_to(ROOT)}:{index}")
        for page in PAGES
        for index, source in enumerate(runnable_blocks(page))
    ]


@pytest.mark.parametrize(("page", "index", "source"), block_params())
def test_code_block_runs(page: Path, index: int, source: str, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    code = compile(source, f"{page.relative_to(ROOT)} (python block {index})", "exec")
    try:
        exec(code, {"__name__": "__main__"})
    except ModuleNotFoundError as err:
        if err.name not in OPTIONAL:
            raise
        pytest.skip(f"the block needs {err.name}, not installed")


@pytest.mark.parametrize("page", GUIDES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_guide_has_a_runnable_example(page: Path):
    assert runnable_blocks(page), (
        f"{page.relative_to(ROOT)} has no runnable code block: add a small self-contained "
        "example fenced as `python` (fragments are fenced as `python {.fragment}`)."
    )


def reference_entries() -> list[tuple[str, str]]:
    """(page, identifier) of every `::: identifier` line of the API reference pages."""
    return [
        (page.name, match.group(1))
        for page in sorted((DOCS / "reference").glob("*.md"))
        for match in re.finditer(r"^::: (\S+)", page.read_text(encoding="utf-8"), re.MULTILINE)
    ]


def resolve(identifier: str) -> Any:
    """The object a dotted identifier names: the longest importable module, then attributes."""
    parts = identifier.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(f"no module in {identifier!r} can be imported")


def public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    # A module without __all__: the names it defines itself, without a leading underscore.
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


@pytest.mark.parametrize(("page", "identifier"), reference_entries())
def test_reference_entry_names_an_object(page: str, identifier: str):
    pytest.importorskip("jax", reason="entries of pergrad.dp are defined in JAX modules")
    pytest.importorskip("torch", reason="entries of pergrad and pergrad.dp need torch")
    resolve(identifier)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_has_a_reference_entry(module_name: str):
    pytest.importorskip("jax", reason="lazily exported names of pergrad.dp need JAX")
    pytest.importorskip("torch", reason="module_loss and DPOptimizer need torch")
    module = importlib.import_module(module_name)
    documented = [resolve(identifier) for _, identifier in reference_entries()]
    missing = [
        name
        for name in public_names(module)
        if not any(getattr(module, name) is entry for entry in documented)
    ]
    page = "pergrad.md" if module_name == "pergrad" else module_name.split(".")[-1] + ".md"
    assert not missing, (
        f"{module_name} exports {missing} but docs/reference/{page} has no entry for them: add "
        f"a line '::: {module_name}.{missing[0]}' (a name exported through a module __getattr__ "
        "is documented from where it is defined, with 'heading:' set to its public name)."
    )


def test_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text) < 8000, f"README.md has {len(text)} characters; the guides go in docs/."
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    for command in README_COMMANDS:
        assert command in lines, f"README.md lost the command {command!r} (CI and newcomers use it)"


def test_readme_links_point_at_files():
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).is_file(), f"README.md links to {target}, which is not a file"
