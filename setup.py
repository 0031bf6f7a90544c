from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="zero-cache-ptm",
    version="0.1.0",
    description="GPT pre-training with 3D parallelism and the ZeRO-Cache memory engine",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8")
    if Path(__file__).with_name("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*", "zero_cache", "zero_cache.*", "tools", "tools.*"]),
    py_modules=["pretrain_gpt"],
    install_requires=[line.strip() for line in Path(__file__).with_name("requirements.txt").read_text().splitlines()
                      if line.strip() and not line.startswith("#")],
    extras_require={"hf": ["transformers==5.24.0"]},  # tools/checkpoint/convert_to_hf.py
    entry_points={"console_scripts": [
        "ptm-launch=zero_cache.launcher.runner:main",
        "ptm-preprocess=tools.preprocess_data:main",
        "ptm-consolidate=zero_cache.checkpoint.consolidate:main",
        "ptm-plan=tools.plan_memory:main",
    ]},
)
