"""Dependencies run one way: each package imports only itself and the packages below it, and no module
is part of an import circle, `TYPE_CHECKING` and function-level imports included (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A package may import the ones before it; the ones on one line are peers that import
# neither each other nor anything after them.
LAYERS = (
    ("core",),
    ("text", "ops", "vision"),
    ("models",),
    ("loader",),
    ("kv",),
    ("sched", "sample"),
    ("speculative",),
    ("runner",),
    ("parallel",),
    ("engine",),
    ("turns",),
    ("server",),
    ("tinymlx_ui",),
    ("cli",),
)
LEVEL = {package: level for level, peers in enumerate(LAYERS) for package in peers}
# The wire formats are peers: each translates to the shared turn types, none reaches into another.
WIRE_FORMATS = ("server.openai", "server.responses", "server.anthropic")
# CPU-only code (numpy and numba kernels, the BLAS threads) lives in ops/cpu/; the rest reaches it only through
# the kernels chosen at load (ops/kernels.py).
CPU_ONLY = "tinymlx.ops.cpu"
CPU_ONLY_IMPORTERS = ("tinymlx.ops.kernels",)


def module_files() -> dict[str, Path]:
    files = {}
    for folder, name in ((ROOT / "tinymlx", "tinymlx"), (ROOT / "ui", "tinymlx_ui")):
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*package, base] if base else package)
            # `from package import submodule` runs the submodule; any other name comes from `base` itself
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    found.discard(module)
    return found


def package_of(module: str) -> str:
    """The layer a module belongs to: tinymlx.kv.disk.tier -> kv; tinymlx.cli -> cli."""
    parts = module.split(".")
    if parts[0] == "tinymlx_ui":
        return "tinymlx_ui"
    return parts[1] if len(parts) > 1 else "tinymlx"


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def test_every_package_has_a_layer():
    packages = {package_of(module) for module in graph()} - {"tinymlx"}
    assert packages <= set(LEVEL), f"place these in LAYERS: {sorted(packages - set(LEVEL))}"


def test_no_package_imports_a_later_one():
    upward = []
    for module, imported in graph().items():
        package = package_of(module)
        if package == "tinymlx":  # the top-level __init__ re-exports the public API
            continue
        for target in imported:
            target_package = package_of(target)
            if target_package == "tinymlx" or target_package == package:
                continue
            if LEVEL[target_package] >= LEVEL[package]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run upward or sideways:\n" + "\n".join(sorted(upward))


def test_wire_formats_do_not_import_each_other():
    crossing = [f"{module} -> {target}" for module, imported in graph().items() for target in imported
                for own in WIRE_FORMATS for other in WIRE_FORMATS
                if own != other and module.startswith(f"tinymlx.{own}") and target.startswith(f"tinymlx.{other}")]
    assert not crossing, "\n".join(sorted(crossing))


def test_no_import_circle():
    edges = graph()
    circles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join([*trail[trail.index(target):], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_cpu_only_code_is_imported_only_by_the_kernels_chooser():
    outside = [f"{module} -> {target}" for module, imported in graph().items() for target in imported
               if (target == CPU_ONLY or target.startswith(f"{CPU_ONLY}."))
               and not (module == CPU_ONLY or module.startswith(f"{CPU_ONLY}.") or module in CPU_ONLY_IMPORTERS)]
    assert not outside, "CPU-only imports outside ops/cpu/ and ops/kernels.py:\n" + \
        "\n".join(sorted(outside))


# The modules that may name the recurrent kind: where kinds are defined and refused, its manager and its
# pool (each with the factory that says whether a model has it), and the models. Everything else asks the KV
# coordinator or the state pools, never which kinds exist (kv/layer_state.py).
RECURRENT_NAMES = {"Recurrent", "recurrent_layers", "RecurrentStates", "RecurrentStateCache"}
RECURRENT_KIND = {"tinymlx.core.layer_specs", "tinymlx.core.refusals", "tinymlx.kv.recurrent_states",
                  "tinymlx.kv.state_cache", "tinymlx.kv.coordinator", "tinymlx.kv.state_pool"}


def test_only_the_recurrent_kinds_own_modules_and_the_models_name_it():
    naming = []
    for module, path in module_files().items():
        if module in RECURRENT_KIND or module.startswith("tinymlx.models"):
            continue
        names = {alias.asname or alias.name for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ImportFrom) for alias in node.names}
        naming += [f"{module}: {name}" for name in sorted(names & RECURRENT_NAMES)]
    assert not naming, "modules that test for the recurrent kind:\n" + "\n".join(naming)
