"""requirements.txt names every third-party package the checkpoint tools import, so a fresh set-up runs them."""
import ast
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_requirements", REPO / "scripts" / "check_requirements.py")
check = sys.modules.setdefault("check_requirements", importlib.util.module_from_spec(_spec))  # dataclasses need it
_spec.loader.exec_module(check)


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file, those inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_requirements_list_what_the_checkpoint_tools_import():
    pinned = {_normalized(pin.name) for pin in check.read_pins(str(REPO / "requirements.txt"))}
    # torch is installed by scripts/bootstrap.sh itself; the repository's own packages are not requirements
    ours = {"torch", "__future__"} | {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    distributions = metadata.packages_distributions()
    missing = {}
    for path in sorted((REPO / "tools" / "checkpoint").glob("*.py")):
        for module in _imported_modules(path) - ours - set(sys.stdlib_module_names):
            names = distributions.get(module, [module])
            if not any(_normalized(n) in pinned for n in names):
                missing[module] = path.name
    assert ours >= {"megatron", "tools", "zero_cache"} and not missing, \
        f"imported by tools/checkpoint but not in requirements.txt: {missing}"
