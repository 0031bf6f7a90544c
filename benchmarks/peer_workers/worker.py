"""One rank of one system's benchmark job; launched under torchrun by ``benchmarks.zero3_vs_peers``,
``benchmarks.moe_vs_peers``, ``benchmarks.max_scale`` and ``benchmarks.max_scale_moe``:

    torchrun --nnodes 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1 --nproc-per-node 2 \
        -m benchmarks.peer_workers.worker --impl ours --offload --spec spec.json --out-dir DIR

Writes ``DIR/result_rank{r}.json``, or ``DIR/error_rank{r}.txt`` (the exception, one line) before failing.
"""
from __future__ import annotations

import argparse
import importlib
import os

from .harness import BenchSpec, PeakRss, build_model, run, write_error

# --impl -> (module, trainer class); modules are imported lazily: DeepSpeed exists only in the peers' venv.
IMPLS = {
    "ours": ("ours", "ZeroCacheTrainer"),
    "deepspeed": ("deepspeed_zero3", "DeepSpeedTrainer"),
    "deepspeed-moe": ("deepspeed_moe", "DeepSpeedMoETrainer"),
    "fsdp2": ("fsdp2", "Fsdp2Trainer"),
    "ddp": ("ddp", "DdpTrainer"),
}


def main() -> None:
    rss = PeakRss()  # first, so the peak covers imports, model build and engine set-up too
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=sorted(IMPLS), required=True)
    p.add_argument("--offload", action="store_true", help="offload optimizer states and parameters to CPU")
    p.add_argument("--system", required=True, help="row name in the table (for the log lines)")
    p.add_argument("--spec", required=True, help="BenchSpec JSON written by the driver")
    p.add_argument("--out-dir", required=True)
    a = p.parse_args()
    rank = os.environ.get("RANK", "0")
    try:
        module, cls = IMPLS[a.impl]
        trainer_cls = getattr(importlib.import_module(f"{__package__}.{module}"), cls)
        # A system that shards the model while it is built (ours, DeepSpeed's zero.Init) builds it itself.
        build = getattr(trainer_cls, "build_model", None)
        run(BenchSpec.load(a.spec), a.system, lambda model, spec, gas: trainer_cls(model, spec, gas, a.offload),
            a.out_dir, rss, build=(lambda spec: build(spec, a.offload)) if build else build_model)
    except BaseException as e:
        write_error(a.out_dir, rank, e)
        raise


if __name__ == "__main__":
    main()
