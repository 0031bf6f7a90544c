from pathlib import Path

from setuptools import find_packages, setup

# The trainer, the engine, the launcher and the memory planner; tools/ holds scripts run from a checkout.
PACKAGES = ("megatron", "zero_cache", "ptm_launch", "ptm_planner")

setup(
    name="zero-cache-ptm",
    version="0.1.0",
    description="GPT pre-training with 3D parallelism and the ZeRO-Cache memory engine",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8")
    if Path(__file__).with_name("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=[name for top in PACKAGES for name in (top, f"{top}.*")]),
    package_data={"zero_cache": ["storage_pointer.cpp"]},  # compiled at run time on torch < 2.13
    py_modules=["pretrain_gpt"],
    install_requires=[line.strip() for line in Path(__file__).with_name("requirements.txt").read_text().splitlines()
                      if line.strip() and not line.startswith("#")],
    entry_points={"console_scripts": [
        "ptm-launch=ptm_launch.runner:main",
        "ptm-preprocess=megatron.data.preprocess.cli:main",
        "ptm-consolidate=zero_cache.checkpoint.consolidate:main",
        "ptm-plan=ptm_planner.cli:main",
    ]},
)
