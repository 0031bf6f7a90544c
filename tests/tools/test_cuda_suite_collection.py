"""tests/cuda runs only on a GPU machine, where it gets one try: this shows on any machine that every one of
its tests is collected and would run there, not be skipped, and carries the marks the suite relies on.

``pytest --setup-plan`` runs pytest's own protocol up to each test's setup (the skip marks are evaluated
there) without running a fixture or a test body. The plugin tests/tools/pretend_cuda.py makes
``torch.cuda.is_available()`` answer True, or False, while the modules are collected, which is when their
skip condition is decided (tests/cuda/common.gpu_only); nothing else about CUDA is pretended, so a module
that touches CUDA at import fails to collect here. Without a GPU every test is skipped with the stated
reason, so that skip is the only thing between them and running."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda.common import NO_GPU

ROOT = Path(__file__).resolve().parents[2]
CUDA_TESTS = ROOT / "tests" / "cuda"
# Every test of tests/cuda; a test added there is added here (a test function missing below fails this file).
EXPECTED = {
    "test_cuda_paths.py::test_pinned_host_offload_matches_fp32_reference",
    "test_cuda_paths.py::test_nccl_group_of_one_through_the_engine_comm_path",
    "test_cuda_paths.py::test_ssd_tier_on_cuda_matches_fp32_reference",
    "test_cuda_paths.py::test_param_arena_on_device_matches_fp32_reference",
    "test_cuda_paths.py::test_trainer_deepspeed_on_gpu_matches_megatron_backend[dense]",
    "test_cuda_paths.py::test_trainer_deepspeed_on_gpu_matches_megatron_backend[moe]",
    "test_cuda_moe.py::test_grouped_matmul_runs_in_bf16_on_the_gpu",
    "test_cuda_moe.py::test_moe_layer_on_cuda_equals_the_cpu_layer",
    "test_cuda_context_parallel.py::test_cuda_kernels_equal_math_on_the_gpu[bf16]",
    "test_cuda_context_parallel.py::test_cuda_kernels_equal_math_on_the_gpu[fp32]",
    "test_cuda_context_parallel.py::test_ring_all_to_all_and_all_gather_over_nccl_equal_full_attention",
    "test_cuda_context_parallel.py::test_all_gather_attention_on_one_gpu_equals_full_attention",
    "test_cuda_long_context.py::test_activation_offload_and_selective_recompute_on_gpu_change_nothing[ddp]",
    "test_cuda_long_context.py::test_activation_offload_and_selective_recompute_on_gpu_change_nothing[zero3]",
    "test_cuda_long_context.py::test_sequence_and_context_parallel_over_nccl_match_one_gpu[tp2-sp]",
    "test_cuda_long_context.py::test_sequence_and_context_parallel_over_nccl_match_one_gpu[cp2-p2p]",
    "test_cuda_long_context.py::test_sequence_and_context_parallel_over_nccl_match_one_gpu[cp2-a2a]",
    "test_cuda_long_context.py::test_sequence_and_context_parallel_over_nccl_match_one_gpu[cp2-allgather]",
    "test_cuda_streams.py::test_copies_run_on_their_streams_ordered_by_events",
    "test_cuda_streams.py::test_staging_pool_reuses_a_buffer_only_after_its_copy",
    "test_cuda_streams.py::test_host_offload_on_streams_matches_fp32_reference[0.0-False-False]",
    "test_cuda_streams.py::test_host_offload_on_streams_matches_fp32_reference[0.0-True-True]",
    "test_cuda_streams.py::test_host_offload_on_streams_matches_fp32_reference[0.5-True-False]",
    "test_cuda_streams.py::test_bf16_update_under_the_next_forward_equals_the_waiting_step[cpu]",
    "test_cuda_streams.py::test_bf16_update_under_the_next_forward_equals_the_waiting_step[nvme]",
    "test_cuda_sync_free_step.py::test_sync_counter_sees_every_thread_and_backward_hooks",
    "test_cuda_sync_free_step.py::test_steady_state_step_synchronises_the_host_once",
    "test_cuda_compile.py::test_compiled_layers_on_gpu_train_as_eager",
}
# The tests that start processes (NCCL ranks through run_distributed): they need @pytest.mark.multiprocess.
STARTS_PROCESSES = {
    "test_cuda_compile.py::test_compiled_layers_on_gpu_train_as_eager",
    "test_cuda_paths.py::test_nccl_group_of_one_through_the_engine_comm_path",
    "test_cuda_paths.py::test_trainer_deepspeed_on_gpu_matches_megatron_backend",
    "test_cuda_moe.py::test_moe_layer_on_cuda_equals_the_cpu_layer",
    "test_cuda_context_parallel.py::test_ring_all_to_all_and_all_gather_over_nccl_equal_full_attention",
    "test_cuda_context_parallel.py::test_all_gather_attention_on_one_gpu_equals_full_attention",
    "test_cuda_long_context.py::test_activation_offload_and_selective_recompute_on_gpu_change_nothing",
    "test_cuda_long_context.py::test_sequence_and_context_parallel_over_nccl_match_one_gpu",
}
# Names whose use in a test's body means it starts processes.
PROCESS_STARTERS = {"run_distributed", "subprocess", "Popen", "multiprocessing", "Process"}


def _plan(tmp_path: Path, cuda: str) -> dict:
    """Setup outcomes of tests/cuda with torch.cuda.is_available() answering as ``cuda`` says."""
    report = tmp_path / f"{cuda}.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/cuda", "--setup-plan", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.tools.pretend_cuda", "--pretend-cuda", cuda, "--outcome-report", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})  # this command only
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(report.read_text())
    assert out["errors"] == {}, out["errors"]  # every module imports without a GPU
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {node.removeprefix("tests/cuda/"): entry for node, entry in out["tests"].items()}


def _test_functions() -> dict[str, set[str]]:
    """``file::name`` of every module-level test function in tests/cuda, with the names its body uses."""
    out = {}
    for path in sorted(CUDA_TESTS.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                out[f"{path.name}::{node.name}"] = used
    return out


@pytest.mark.multiprocess
def test_every_cuda_test_would_run_on_a_gpu_and_is_skipped_without_one(tmp_path):
    with_gpu = _plan(tmp_path, "present")
    assert set(with_gpu) == EXPECTED
    for node, entry in with_gpu.items():
        assert entry["setup"] == "passed", (node, entry)  # not skipped
        assert "cuda" in entry["markers"], node
        assert ("multiprocess" in entry["markers"]) == (node.split("[")[0] in STARTS_PROCESSES), node

    without = _plan(tmp_path, "absent")
    assert set(without) == EXPECTED
    for node, entry in without.items():
        assert (entry["setup"], entry["reason"]) == ("skipped", f"Skipped: {NO_GPU}"), node


def test_expected_list_covers_every_test_function_and_process_starter():
    functions = _test_functions()
    assert set(functions) == {node.split("[")[0] for node in EXPECTED}
    starters = {name for name, used in functions.items() if used & PROCESS_STARTERS}
    assert starters == STARTS_PROCESSES
