"""The memory planner (ptm_planner): per-tier bytes equal the engine's own accounting; verdicts, --largest and
outputs; the sizes table needs only the standard library; tools/plan_memory.py runs from anywhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ptm_planner.cli import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_FITS, main, request_from_args
from ptm_planner.plan import GiB, Option, Planner, StagePlan, account_states, with_layers
from ptm_planner.sizes import SIZES, table
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import TINY_GPT

# TINY_GPT's model as planner flags (its NullTokenizer --vocab-size 100 has 101 ids, padded to 128).
TINY_PLAN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--vocab-size", "101", "--make-vocab-size-divisible-by", "64",
             "--micro-batch-size", "2", "--nproc-per-node", "2", "--device", "cpu"]
ROOT = Path(__file__).resolve().parents[2]
# A CPU node like this one, given explicitly so the verdicts do not depend on the machine running the test.
BOX = ["--device", "cpu", "--nproc-per-node", "2", "--host-memory-gib", "24", "--nvme-free-gib", "70"]


def _tiny_planner(nvme: str, host_gib: float = 16.0) -> Planner:
    request, _ = request_from_args(TINY_PLAN + ["--host-memory-gib", str(host_gib), "--nvme-free-gib", "16",
                                                "--nvme-path", nvme])
    return Planner(request)


def _spilling_planner(nvme: str, option: Option) -> Planner:
    """Host memory chosen so that the planner's host budget holds 75% of the host-tier states."""
    roomy = _tiny_planner(nvme)
    ev = roomy.evaluate(option)
    host_states = ev.stages[0].states.by_tier["host"]
    not_host_states = ev.capacity["ram"] - ev.budgets["host"]  # non-state memory and device-tier states
    host_gib = (0.75 * host_states + not_host_states) * 2 / 0.9 / GiB
    return _tiny_planner(nvme, host_gib)


def _train_and_report(rank, world, config_paths):
    from pretrain_gpt import main as pretrain

    reports = []
    for path in config_paths:
        result = pretrain(TINY_GPT + ["--train-iters", "2", "--lr-warmup-iters", "1", "--deepspeed",
                                      "--deepspeed_config", path])
        reports.append(result.backend.model.memory_report())
        result.backend.model.close()
    return reports


@pytest.mark.multiprocess
def test_planned_states_match_the_engines_memory_report(tmp_path):
    nvme = str(tmp_path / "nvme")
    planner = _tiny_planner(nvme)
    page = planner.pages[-1]  # one matrix per chunk: 15 chunks, so sub-groups can split between tiers
    size = planner.sub_group_sizes(page)[-1]
    spill = Option("cpu+nvme", page, 2, False, size)
    cases = {
        "no offload": (planner, Option("none", page, 2, False, size)),
        "cpu offload": (planner, Option("cpu", page, 2, False, size)),
        "host budget spills to nvme": (_spilling_planner(nvme, spill), spill),
        "nvme, rate 0.5": (planner, Option("nvme", page, 2, False, size, rate=0.5)),
    }
    evaluations, paths = {}, []
    for name, (p, option) in cases.items():
        ev = p.evaluate(option)
        assert ev.fits, (name, ev.failures)
        evaluations[name] = ev
        path = tmp_path / f"{len(paths)}.json"
        path.write_text(json.dumps(ev.config))
        paths.append(str(path))
    reports = run_distributed(_train_and_report, 2, paths, timeout=240)

    for (name, ev), rank0, rank1 in zip(evaluations.items(), *reports):
        planned = ev.stages[0].states.by_kind_tier
        for report in (rank0, rank1):
            assert set(k for k, v in report.by_kind_tier.items() if v) == set(k for k, v in planned.items() if v), name
            for key, engine_bytes in report.by_kind_tier.items():
                assert abs(planned.get(key, 0) - engine_bytes) <= 0.1 * engine_bytes, (name, key)
            assert report.budget == ev.config["zero_optimization"]["memory_budget"], name
            # What the engine held at its peak stays within what the planner reserved for it.
            assert report.peak_by_tier.get("host", 0) <= planned_host(ev), name
            assert report.gathered_peak <= ev.stages[0].nonstate.gathered, name
    tiers = {name: ev.stages[0].states.by_tier for name, ev in evaluations.items()}
    assert tiers["no offload"]["host"] == 0 and tiers["no offload"]["nvme"] == 0
    assert tiers["cpu offload"]["host"] > 0 and tiers["cpu offload"]["nvme"] == 0
    spilled = evaluations["host budget spills to nvme"].stages[0].states.by_kind_tier
    assert spilled[("optimizer", "host")] > 0 and spilled[("optimizer", "nvme")] > 0
    rated = evaluations["nvme, rate 0.5"].stages[0].states
    assert rated.by_kind_tier[("optimizer", "device")] > 0 and rated.by_kind_tier[("optimizer", "nvme")] > 0
    assert rated.cached_sub_groups == -(-rated.sub_groups // 2)


def planned_host(ev) -> int:
    st = ev.stages[0].states
    return st.by_tier["host"] + st.staging


def _plan_json(argv, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def test_size_that_cannot_fit_names_the_largest_that_does_and_the_hardware_it_needs(capsys):
    code, plan = _plan_json(["--size", "55"] + BOX, capsys)
    assert code == EXIT_DOES_NOT_FIT and not plan["fits"] and plan["failures"]
    message = plan["message"]  # the table output ends with the same message
    assert message.startswith("does not fit: 55 GPT 55.18B parameters")
    fitting = plan["largest_size"]
    assert f"the largest examples/start.sh size that fits: {fitting}" in message
    assert "the requested model needs (states on SSD)" in message
    # The named size does fit this hardware, and the next larger size of the table does not.
    names = [s.name for s in SIZES]
    assert Planner(request_from_args(["--size", fitting] + BOX)[0]).search().fits
    assert not Planner(request_from_args(["--size", names[names.index(fitting) + 1]] + BOX)[0]).search().fits
    # Given the hardware the message asks for (states on SSD) the requested model fits, with 5% less host
    # memory it does not.
    need = plan["needs"]["states on SSD"]
    assert need["host_memory"] > 24 * GiB and need["nvme_free"] > 70 * GiB
    for host, fits in ((need["host_memory"], True), (0.95 * need["host_memory"], False)):
        request, _ = request_from_args(["--size", "55", "--device", "cpu", "--nproc-per-node", "2",
                                        "--host-memory-gib", str(host / GiB), "--nvme-free-gib",
                                        str(need["nvme_free"] / GiB)])
        assert Planner(request).search().fits == fits


def test_largest_fits_and_one_more_layer_does_not_and_grows_with_memory(capsys):
    family = ["--size", "1.3b", "--device", "cpu", "--nproc-per-node", "2", "--nvme-free-gib", "200"]
    layers = []
    for host in (12, 24):
        hardware = family + ["--host-memory-gib", str(host)]
        code, plan = _plan_json(hardware + ["--largest"], capsys)
        assert code == EXIT_FITS and plan["model"]["num_layers"] == plan["largest_layers"]
        layers.append(plan["largest_layers"])
        request, _ = request_from_args(hardware)
        assert Planner(with_layers(request, layers[-1])).search().fits
        assert not Planner(with_layers(request, layers[-1] + 1)).search().fits
    assert layers[0] < layers[1]


# The max-scale family (benchmarks/max_scale.py) on 2 ranks with states on SSD, as the planner planned it for
# runs that were measured (benchmarks/RESULTS.md, "At the edge of RAM"), with the reuse_freed_host_memory false
# the planner writes: layers, allgather_bucket_size, sub_group_size, prefetch_cache_sub_group_rate and
# memory_budget.host of the config, and the peak RSS one rank reached (GiB).
MAX_SCALE_FAMILY = ["--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "8192",
                    "--seq-length", "256", "--vocab-size", "32001", "--untie-embeddings-and-output-weights",
                    "--micro-batch-size", "1", "--recompute-activations", "--offload", "nvme", "--device", "cpu",
                    "--nproc-per-node", "2", "--host-memory-gib", "24", "--nvme-free-gib", "75"]
MEASURED_RUNS = [(4, 50331648, 32899072, 1.0, 157097984, 4.13),
                 (16, 50331648, 32899072, 0.15, 1997299712, 4.45),
                 (18, 50331648, 32899072, 0.13, 1992572928, 4.21),
                 (106, 16777216, 32899072, 0.13, 1776034406, 10.49)]


@pytest.mark.parametrize("layers,page,sub_group_size,rate,host_budget,peak_rss_gib", MEASURED_RUNS)
def test_cpu_plan_covers_the_peak_rss_measured_with_its_config(layers, page, sub_group_size, rate, host_budget,
                                                              peak_rss_gib):
    """What the planner counts per process for a measured config (the engine's placement of the states under
    its host budget, staging, gathered and reduce buffers, activations with the heap's share, overhead) is
    not below the peak RSS a rank reached with it, and not far above."""
    request, _ = request_from_args(MAX_SCALE_FAMILY + ["--num-layers", str(layers)])
    planner = Planner(request)
    option = Option("nvme", page, 1, True, sub_group_size, rate)
    _, cfg = planner.parse(option, None)
    plans = planner.plans(page)[0]
    states = account_states(plans, planner.sub_groups(page, 0, sub_group_size), cfg, torch.float32,
                            torch.device("cpu"), host_budget)
    nonstate = planner.non_state(planner.stages[0], plans, option)
    need = StagePlan(0, planner.stages[0].numel, states, nonstate).need()
    planned = (need["device"] + need["host"]) / GiB  # on CPU both tiers are host memory
    assert peak_rss_gib <= planned <= peak_rss_gib + 0.75, planned


def test_largest_needs_no_layer_count(capsys):
    """--largest grows --num-layers itself: the shape flags alone give the same answer as the size."""
    shape = ["--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size", "16384"]
    code, by_shape = _plan_json(shape + ["--largest"] + BOX, capsys)
    code_size, by_size = _plan_json(["--size", "6.7b", "--largest"] + BOX, capsys)
    assert code == code_size == EXIT_FITS
    assert by_shape["largest_layers"] == by_size["largest_layers"] == by_shape["model"]["num_layers"] > 0


def test_gpu_node_offloads_only_what_does_not_fit(capsys):
    """The AngelPTM headline node (8 x 40 GB, bf16): 55B does not fit without offload but fits offloaded."""
    node = ["--size", "55", "--device", "cuda", "--device-memory-gib", "40", "--nproc-per-node", "8",
            "--host-memory-gib", "1024", "--nvme-free-gib", "3000", "--bf16", "--seq-length", "1024"]
    code, plan = _plan_json(node, capsys)
    assert code == EXIT_FITS and plan["option"]["offload"] in ("cpu", "cpu+nvme", "nvme")
    stage = plan["stages"][0]
    assert stage["need"]["device"] <= plan["capacity_per_process"]["device"]
    assert 0 < plan["option"]["rate"] < 1 and stage["sub_groups_on_device"] > 0  # the device is used as a cache
    assert main(node + ["--offload", "none"]) == EXIT_DOES_NOT_FIT
    code, small = _plan_json(["--size", "125m"] + node[2:], capsys)
    assert code == EXIT_FITS and small["option"]["offload"] == "none"


def test_gpu_plan_keeps_gathered_parameters_for_the_backward_where_the_device_holds_them(capsys):
    """On an accelerator the arena holds every gathered chunk when device memory allows (no second gather or
    copy per micro-batch); where it does not, two chunks. A CPU machine keeps its memory for the states."""
    node = ["--device", "cuda", "--nproc-per-node", "8", "--host-memory-gib", "1024", "--nvme-free-gib", "3000",
            "--bf16", "--seq-length", "1024"]
    code, roomy = _plan_json(["--size", "1.3b", "--device-memory-gib", "80"] + node, capsys)
    assert code == EXIT_FITS and roomy["option"]["keep_gathered"]
    arena = roomy["ds_config"]["zero_optimization"]["max_contigous_params_size"]
    assert arena >= 0.95 * roomy["model"]["num_parameters"]
    code, tight = _plan_json(["--size", "55", "--device-memory-gib", "40"] + node, capsys)
    assert code == EXIT_FITS and not tight["option"]["keep_gathered"]
    arena = tight["ds_config"]["zero_optimization"]["max_contigous_params_size"]
    assert arena < 0.05 * tight["model"]["num_parameters"]
    code, cpu = _plan_json(["--size", "125m"] + BOX, capsys)
    assert code == EXIT_FITS and not cpu["option"]["keep_gathered"]


GPU = ["--size", "6.7b", "--device", "cuda", "--device-memory-gib", "80", "--nproc-per-node", "8",
       "--host-memory-gib", "1024", "--nvme-free-gib", "3000", "--bf16", "--offload", "cpu"]


def test_gpu_rate_balances_the_device_and_host_optimizer_parts(capsys):
    """Everything would fit on the device; the rate stops where the device's Adam and the host's take equal time."""
    code, fast_device = _plan_json(GPU, capsys)
    assert code == EXIT_FITS and fast_device["option"]["rate"] >= 0.97  # a 50x faster device takes almost all
    same = ["--host-adam-elems-per-s", "5e10", "--device-adam-elems-per-s", "5e10"]  # host as fast as the device
    code, plan = _plan_json(GPU + same, capsys)
    assert code == EXIT_FITS and plan["option"]["rate"] == 0.5
    lanes = plan["step_prediction"]["offload"]
    assert lanes["device_adam_s"] == pytest.approx(lanes["host_adam_s"], rel=0.05)  # they finish together
    assert lanes["optimizer_s"] == max(lanes["device_adam_s"], lanes["host_lane_s"])
    assert plan["step_prediction"]["step"]["optimizer (device Adam beside the host lane)"] == lanes["optimizer_s"]
    assert main(GPU + ["--gradient-accumulation-steps", "2", "--explain"]) == EXIT_FITS
    out = capsys.readouterr().out
    assert "(2 micro-batches + bubble 0.00)" in out and "device Adam" in out and "host lane" in out


def test_cpu_plans_have_no_step_prediction(capsys):
    code, plan = _plan_json(["--size", "125m"] + BOX, capsys)
    assert code == EXIT_FITS and plan["step_prediction"] is None and plan["speeds"] is None


def test_written_config_parses_and_args_are_accepted_by_the_trainer(tmp_path, capsys):
    from megatron.training.arguments import parse_args
    from zero_cache import parse_config

    ds, args = tmp_path / "ds.json", tmp_path / "args.txt"
    code = main(["--size", "2.7b"] + BOX + ["--nvme-path", str(tmp_path / "nvme"), "--write-ds-config", str(ds),
                                           "--write-args", str(args)])
    capsys.readouterr()
    assert code == EXIT_FITS
    cfg = parse_config(str(ds), 2)
    # 2.7b in fp32 needs the SSD here (all of it, or what the host cannot hold)
    assert cfg.zero_optimization.offload_optimizer.nvme_path == str(tmp_path / "nvme")
    assert cfg.zero_optimization.offload_optimizer.device in ("cpu", "nvme")
    assert cfg.zero_optimization.memory_budget.nvme > 0
    words = args.read_text().split("\n")[:-1]
    trainer_only = ["--train-iters", "1", "--lr", "1e-4", "--mock-data", "--deepspeed", "--deepspeed_config", str(ds)]
    parsed = parse_args(words + trainer_only, world_size=2)
    model = parsed.model.transformer_config(50257, parsed.parallel.tensor_model_parallel_size)
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.ffn_hidden_size) == \
        (32, 2560, 32, 10240)
    assert parsed.parallel.micro_batch_size == int(words[words.index("--micro-batch-size") + 1])
    assert parsed.model.recompute_granularity == ("full" if "--recompute-granularity" in words else None)


def test_tensor_and_pipeline_parallel_plan_each_stage(capsys):
    code, plan = _plan_json(["--size", "1.3b", "--nproc-per-node", "8", "--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "4", "--device", "cuda", "--device-memory-gib", "80",
                             "--host-memory-gib", "512", "--nvme-free-gib", "100", "--bf16"], capsys)
    assert code == EXIT_FITS and plan["mesh"]["data_parallel_size"] == 1
    stages = {s["stage"]: s for s in plan["stages"]}
    assert sorted(stages) == [0, 1, 3]
    layer = 12 * 2048 * 2048 // 2 + 4 * 2048  # one layer's matrices over TP 2, plus its replicated norms
    embedding = 50304 * 2048 // 2
    assert stages[1]["parameters"] == pytest.approx(6 * layer, rel=0.01)
    assert stages[0]["parameters"] == pytest.approx(6 * layer + embedding + 256 * 2048, rel=0.01)
    assert stages[3]["parameters"] == pytest.approx(6 * layer + embedding, rel=0.01)  # the tied head's copy


@pytest.mark.parametrize("argv, message", [
    (["--size", "125m", "--device", "cpu", "--device-memory-gib", "8"], "--device-memory-gib is for --device cuda"),
    (["--size", "125m", "--pipeline-model-parallel-size", "5", "--nproc-per-node", "5"], "not divisible"),
    (["--hidden-size", "64"], "give --size NAME"),
    (["--size", "125m", "--micro-batch-size", "0"], "--micro-batch-size must be > 0"),
])
def test_bad_input_is_one_clear_error(argv, message, capsys):
    assert main(argv) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_bad_paths_and_sizes_are_one_clear_error(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["--size", "125m", "--offload", "nvme", "--nvme-path", str(a_file)]) == EXIT_BAD_INPUT
    assert f"--nvme-path {a_file} is a file" in capsys.readouterr().err
    target = tmp_path / "missing_dir" / "ds.json"
    assert main(["--size", "default", *BOX, "--write-ds-config", str(target)]) == EXIT_BAD_INPUT
    assert f"cannot write {target}" in capsys.readouterr().err
    for value in ("inf", "nan"):
        with pytest.raises(SystemExit) as exit_info:  # argparse's one line, exit 2
            main(["--size", "125m", "--host-memory-gib", value])
        assert exit_info.value.code == 2
        assert f"argument --host-memory-gib: '{value}' is not a finite number" in capsys.readouterr().err


def test_default_size_keeps_its_batch_and_needs_no_offload_here(capsys):
    code, plan = _plan_json(["--size", "default"] + BOX, capsys)
    assert code == EXIT_FITS
    opt = Option(**plan["option"])
    assert (opt.offload, opt.micro_batch_size, opt.recompute) == ("none", 4, False)
    z = plan["ds_config"]["zero_optimization"]
    assert z["allgather_bucket_size"] == opt.page and z["stage3_max_live_parameters"] == opt.max_live
    assert z["sub_group_size"] == opt.sub_group_size and "offload_optimizer" not in z
    stage = plan["stages"][0]
    assert stage["states_by_tier"]["host"] == 0 and stage["states_by_tier"]["nvme"] == 0


def test_shipped_maxscale_config_is_the_planners_choice_for_a_node_like_this_one(tmp_path, capsys):
    from zero_cache import parse_config

    written = tmp_path / "ds.json"
    code = main(["--size", "2.7b", "--largest", "--cpus", "2", "--nvme-path", "/tmp/zero_cache_nvme",
                 "--write-ds-config", str(written)] + BOX)
    capsys.readouterr()
    assert code == EXIT_FITS
    shipped = ROOT / "examples" / "ds_config_gpt_zero3_maxscale.json"
    assert json.loads(shipped.read_text()) == json.loads(written.read_text())  # regenerate it with this command
    z = parse_config(str(shipped), 2).zero_optimization
    assert (z.stage, z.offload_optimizer.device, z.offload_param.device) == (3, "nvme", "nvme")
    assert z.pipeline_optimizer and 0 < z.prefetch_cache_sub_group_rate < 1  # memory left over caches sub-groups
    assert min(z.memory_budget.device, z.memory_budget.host, z.memory_budget.nvme) >= 0


def _without_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.multiprocess
def test_sizes_table_runs_on_a_bare_python():
    """start.sh reads the table with the system python3 before the environment exists: no site-packages."""
    def sizes(*args):
        return subprocess.run([sys.executable, "-S", "-m", "ptm_planner.sizes", *args], cwd=ROOT,
                              env=_without_pythonpath(), capture_output=True, text=True, timeout=60)
    listed, row, unknown = sizes("list"), sizes("row", "1.3b"), sizes("row", "bogus")
    assert (listed.returncode, listed.stdout) == (0, table() + "\n"), listed.stderr
    assert (row.returncode, row.stdout) == (0, "24 2048 16 8192 4\n"), row.stderr
    assert unknown.returncode == 2 and "unknown SIZE 'bogus'" in unknown.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["script from elsewhere", "python -m from the repository"])
def test_command_line_prints_what_main_prints(how, tmp_path, capsys):
    argv, cwd = {"script from elsewhere": ([str(ROOT / "tools" / "plan_memory.py")], tmp_path),
                 "python -m from the repository": (["-m", "ptm_planner"], ROOT)}[how]
    for args, code in ((["--size", "default"] + BOX, EXIT_FITS), (["--hidden-size", "64"], EXIT_BAD_INPUT)):
        capsys.readouterr()
        assert main(args) == code
        expected = capsys.readouterr()
        run = subprocess.run([sys.executable, *argv, *args], cwd=cwd, env=_without_pythonpath(),
                             capture_output=True, text=True, timeout=300)
        assert (run.returncode, run.stdout, run.stderr) == (code, expected.out, expected.err)


def test_multi_node_plan_chooses_the_layout_that_keeps_bytes_in_the_node(capsys):
    """Across nodes every layout that fits is a candidate and the fastest predicted wins: on 100 Gb/s Ethernet,
    MiCS shard groups of a node while their states fit on the device, then hpZ secondary shards; on InfiniBand
    with 4 GiB GPUs flat ZeRO-3 (no secondary copy to hold). The plan writes the key that sets the layout, and
    one node is always flat."""
    node = ["--size", "1.3b", "--bf16", "--device", "cuda", "--nproc-per-node", "8", "--nnodes", "4",
            "--host-memory-gib", "1000", "--nvme-free-gib", "1000"]
    chosen = {}
    for profile, gib in (("a100-eth", "16"), ("a100-eth", "5"), ("h100", "4")):
        code, plan = _plan_json(node + ["--profile", profile, "--device-memory-gib", gib], capsys)
        assert code == EXIT_FITS and plan["profile"] == profile
        fastest = plan["step_prediction"]["tokens_per_s"]
        assert plan["runners_up"] and all(fastest >= r["step_prediction"]["tokens_per_s"] for r in plan["runners_up"])
        chosen[gib] = (plan["option"]["layout"], plan["ds_config"]["zero_optimization"])
    assert chosen["16"][0] == "mics" and chosen["16"][1]["mics_shard_size"] == 8
    assert chosen["5"][0] == "hpz" and chosen["5"][1]["zero_hpz_partition_size"] == 8
    assert chosen["4"][0] == "flat" and not {"mics_shard_size", "zero_hpz_partition_size"} & set(chosen["4"][1])
    code, one = _plan_json(node[:-6] + ["--nnodes", "1", "--host-memory-gib", "1000", "--nvme-free-gib", "1000",
                                        "--device-memory-gib", "16"], capsys)
    assert code == EXIT_FITS and one["option"]["layout"] == "flat"


@pytest.mark.multiprocess  # the link between two ranks is measured with two processes
def test_measured_cpu_plan_predicts_its_step_and_chooses_by_it(capsys):
    """--measure: this machine's ranks measured, the step predicted part by part and the fastest candidate chosen;
    every speed says it was measured here."""
    code, plan = _plan_json(["--size", "125m", "--measure"] + BOX, capsys)
    assert code == EXIT_FITS and plan["profile"] == "local"
    pred = plan["step_prediction"]
    assert pred["step_s"] > 0 and pred["micro_batch"]["GEMMs"] > 0
    assert all(pred["tokens_per_s"] >= r["step_prediction"]["tokens_per_s"] for r in plan["runners_up"])
    assert plan["hardware_sources"]["device_tflops"] == "measured here"


def test_search_parallel_takes_the_fastest_split_and_writes_it(capsys):
    """--search-parallel plans every TP x PP split of 4 nodes of 8 at the same global batch: on 100 Gb/s Ethernet
    the pipeline crosses the nodes and the data-parallel group (ZeRO-3's traffic) stays inside one, and the plan
    writes the split it chose. A CPU plan has no speeds to rank by without --measure (one line, exit 2)."""
    node = ["--size", "1.3b", "--bf16", "--profile", "a100-eth", "--device-memory-gib", "16", "--nnodes", "4",
            "--gradient-accumulation-steps", "2", "--search-parallel"]
    code, plan = _plan_json(node, capsys)
    mesh = plan["mesh"]
    assert code == EXIT_FITS and mesh["pp"] > 1 and mesh["tp"] * mesh["data_parallel_size"] <= 8
    args = plan["megatron_args"]
    assert args[args.index("--pipeline-model-parallel-size") + 1] == str(mesh["pp"])
    capsys.readouterr()
    assert main(["--size", "125m", "--search-parallel"] + BOX) == EXIT_BAD_INPUT
    assert "--search-parallel ranks splits by predicted speed" in capsys.readouterr().err


def test_search_parallel_also_plans_the_interleaved_schedule():
    """With PP > 1 and no chunk size or schedule asked for, 2 and 4 model chunks per stage are candidates where the
    layers and the micro-batches (a multiple of PP) allow; a requested schedule pins one chunk per stage."""
    from ptm_planner.cli import request_from_args
    from ptm_planner.mesh_search import splits

    node = ["--size", "1.3b", "--bf16", "--profile", "a100-eth", "--nnodes", "4", "--gradient-accumulation-steps", "2",
            "--search-parallel"]
    request, args = request_from_args(node)
    chunks = {(r.mesh.tp, r.mesh.pp, r.layout.layers_per_virtual_stage) for r in splits(request, args.vocab_size)}
    assert {(1, 4, None), (1, 4, 3), (1, 2, 6), (1, 2, 3)} <= chunks  # 24 layers: 6 or 12 per stage
    assert (1, 8, 1) not in chunks  # 16 micro-batches per step on TP 1 x PP 8 x DP 4, but 3 layers per stage
    assert all(n is None or r_pp > 1 for _, r_pp, n in chunks)
    request, args = request_from_args(node + ["--pipeline-schedule", "zb-h1"])
    assert {r.layout.layers_per_virtual_stage for r in splits(request, args.vocab_size)} == {None}
