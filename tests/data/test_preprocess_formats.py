"""Corpora as they ship: Parquet, .jsonl.zst, saved Hugging Face datasets folders, folders and globs of shards.

The same documents in every format give byte-identical .bin/.idx; a missing or non-text column, a null,
a damaged shard or a missing package is one error line naming the file (and row) and the fix, with
nothing left behind.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron.data.preprocess import cli as preprocess_cli
from megatron.data.preprocess.columnar_reader import ColumnarSegment
from megatron.data.preprocess.inputs import expand_inputs, plan_partitions, read_chunks
from megatron.data.preprocess.jsonl_reader import Segment
from tests.data.conftest import write_jsonl
from tests.data.test_preprocess import REPO, _fails_with, records

# optional pins (requirements.txt): an image without them runs the rest of the suite
pa = pytest.importorskip("pyarrow", reason="Parquet / Arrow input needs pyarrow (an optional pin)")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard", reason=".zst input needs zstandard (an optional pin)")

KEYS = ("text", "parts")  # a string column, and a list-of-strings column (its sentences)


def corpus(n=300):
    docs = records(n, seed=3)
    for d in docs:
        d["parts"] = [d["title"], d["text"]] if d["id"] % 5 else []
    return docs


def jsonl_bytes(docs):
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")


def write_zst(path, data, frames=3):
    """Several independent frames, as pzstd and concatenated downloads make them."""
    step = len(data) // frames + 1
    with open(path, "wb") as f:
        for start in range(0, len(data), step):
            f.write(zstandard.ZstdCompressor(level=3).compress(data[start:start + step]))
    return str(path)


def table(docs):
    return pa.Table.from_pylist(docs)


def save_dataset_with_pyarrow(tab, folder, shards=2, batch_rows=30):
    """What datasets' save_to_disk writes: Arrow IPC stream shards (record batches of ``batch_rows`` rows),
    state.json naming them in order, dataset_info.json with the features."""
    os.makedirs(folder)
    names, bounds = [], [tab.num_rows * k // shards for k in range(shards + 1)]
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with pa.ipc.new_stream(os.path.join(folder, name), tab.schema) as writer:
            for batch in tab.slice(bounds[k], bounds[k + 1] - bounds[k]).to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
        names.append({"filename": name})
    state = {"_data_files": names, "_fingerprint": "0123456789abcdef", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    def feature(kind):
        if pa.types.is_list(kind):
            return {"feature": feature(kind.value_type), "_type": "List"}
        return {"dtype": str(kind), "_type": "Value"}

    features = {field.name: feature(field.type) for field in tab.schema}
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump(state, f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"citation": "", "description": "", "features": features, "homepage": "", "license": ""}, f)
    return str(folder)


def args(bpe_files, inputs, prefix, *extra, keys=KEYS):
    return ["--input", *map(str, inputs), "--json-keys", *keys, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", bpe_files[0], "--merge-file", bpe_files[1], "--append-eod",
            "--output-prefix", str(prefix), *extra]


def outputs(prefix, keys=KEYS):
    return {os.path.basename(path): open(path, "rb").read() for path in outputs_of(prefix, keys)}


def outputs_of(prefix, keys=KEYS):
    return [f"{prefix}_{key}_document.{ext}" for key in keys for ext in ("bin", "idx")]


def nothing_left(folder):
    return not os.path.exists(folder) or os.listdir(folder) == []


@pytest.mark.multiprocess
def test_every_format_gives_the_same_bytes(tmp_path, bpe_files, capsys):
    docs = corpus()
    data = jsonl_bytes(docs)
    (tmp_path / "all.jsonl").write_bytes(data)
    preprocess_cli.main(args(bpe_files, [tmp_path / "all.jsonl"], tmp_path / "ref/out", "--workers", "1"))
    reference = outputs(tmp_path / "ref/out")
    assert len(reference["out_text_document.bin"]) > 1000 and len(reference["out_parts_document.bin"]) > 1000

    with gzip.open(tmp_path / "all.jsonl.gz", "wb") as f:
        f.write(data)
    write_zst(tmp_path / "all.jsonl.zst", data)
    # Parquet: two shard files of several row groups each (one with large_string columns), and a README
    (tmp_path / "pq").mkdir()
    pq.write_table(table(docs[:130]), tmp_path / "pq/part-00000.parquet", row_group_size=25)
    wide = table(docs[130:])
    wide = wide.cast(pa.schema([f.with_type(pa.large_string()) if f.name == "text" else f for f in wide.schema]))
    pq.write_table(wide, tmp_path / "pq/part-00001.parquet", row_group_size=40, compression="zstd")
    (tmp_path / "pq/README.md").write_text("not data")
    saved = save_dataset_with_pyarrow(table(docs), tmp_path / "saved")
    # a folder of mixed shards: sorted by name, sub-folders included, hidden folders and other names skipped
    mixed = tmp_path / "mixed"
    (mixed / "01" / ".cache").mkdir(parents=True)
    write_zst(mixed / "00.jsonl.zst", jsonl_bytes(docs[:70]))
    pq.write_table(table(docs[70:150]), mixed / "01" / "a.parquet", row_group_size=16)
    write_jsonl(mixed / "01" / ".cache" / "junk.jsonl", ["not json"])
    with pa.ipc.new_file(mixed / "02.arrow", table(docs[150:]).schema) as writer:  # the Arrow IPC file format
        writer.write_table(table(docs[150:]), max_chunksize=45)
    (mixed / "03.json").write_text('{"config": true}')
    inputs = {"gz": [tmp_path / "all.jsonl.gz"], "zst": [tmp_path / "all.jsonl.zst"], "parquet": [tmp_path / "pq"],
              "parquet glob": [tmp_path / "pq/*.parquet"], "saved": [saved], "mixed": [mixed]}
    datasets = _datasets_or_none()
    if datasets is not None:  # the real save_to_disk, and datasets reads the folder we wrote as we read it
        datasets.Dataset.from_list(docs).save_to_disk(str(tmp_path / "hf"), num_shards=3)
        inputs["datasets save_to_disk"] = [tmp_path / "hf"]
        assert datasets.load_from_disk(saved)["parts"] == [d["parts"] for d in docs]
    for name, paths in inputs.items():
        prefix = tmp_path / "outputs" / name.replace(" ", "_") / "out"
        preprocess_cli.main(args(bpe_files, paths, prefix, "--workers", "2", "--partitions", "2",
                                 "--log-interval", "100"))
        assert "% of input" in capsys.readouterr().err
        assert outputs(prefix) == reference, name
        assert sorted(os.listdir(prefix.parent)) == sorted(map(os.path.basename, outputs_of(prefix)))


def _datasets_or_none():
    try:
        import datasets
    except ImportError:
        return None
    datasets.disable_progress_bars()
    return datasets


def test_partitions_cut_parquet_at_row_groups_and_arrow_at_batches(tmp_path):
    docs = corpus(100)
    pq.write_table(table(docs), tmp_path / "a.parquet", row_group_size=10)
    save_dataset_with_pyarrow(table(docs), tmp_path / "saved", shards=1, batch_rows=20)
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(docs))
    files = expand_inputs([str(tmp_path / "a.parquet"), str(tmp_path / "saved"), str(tmp_path / "b.jsonl")])
    assert [f.format for f in files] == ["parquet", "arrow", "jsonl"]
    parts = plan_partitions(files, KEYS, 4)
    kinds = [[type(s).__name__ for s in part] for part in parts]
    assert all(part for part in parts) and sum(map(len, kinds)) >= 4, kinds
    columnar = [s for part in parts for s in part if isinstance(s, ColumnarSegment)]
    for path, units in ((str(tmp_path / "a.parquet"), 10), (str(tmp_path / "saved/data-00000-of-00001.arrow"), 5)):
        mine = [s for s in columnar if s.path == path]
        assert [s.first_row for s in mine] == [sum(s.rows for s in mine[:i]) for i in range(len(mine))]
        assert sum(s.rows for s in mine) == 100 and mine[-1].end_unit == units
        assert sum(s.input_bytes for s in mine) == os.path.getsize(path)
    assert sum(s.end - s.start for part in parts for s in part if isinstance(s, Segment)) == len(jsonl_bytes(docs))
    # chunks much smaller than a row group: every row once, in order, with its row number and byte share
    chunks = list(read_chunks([s for part in parts for s in part if isinstance(s, ColumnarSegment)], KEYS, 300))
    parquet = [c for c in chunks if c.path.endswith(".parquet")]
    assert len(parquet) > 10 and [c.first_row for c in parquet] == [sum(c.rows for c in parquet[:i])
                                                                     for i in range(len(parquet))]
    assert [t for c in parquet for t in c.columns["text"]] == [d["text"] for d in docs]
    assert sum(c.input_bytes for c in chunks) == sum(os.path.getsize(s.path) for s in {s.path: s for s in columnar}
                                                     .values())


def test_zst_reader_keeps_every_line_across_frames_and_chunks(tmp_path):
    data = jsonl_bytes(corpus(200))[:-1]  # the last line without its newline
    path = write_zst(tmp_path / "c.jsonl.zst", data, frames=7)
    parts = plan_partitions(expand_inputs([path]), KEYS, 3)
    assert sorted(map(len, parts)) == [0, 0, 1]  # a compressed stream is never cut
    chunks = list(read_chunks([s for part in parts for s in part], KEYS, 500))
    assert b"".join(c.data for c in chunks) == data and len(chunks) > 5
    assert [c.first_line for c in chunks] == [sum(c.data.count(b"\n") for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(c.input_bytes for c in chunks) == os.path.getsize(path)


def test_missing_or_non_text_columns_are_refused_before_anything_is_written(tmp_path, bpe_files, capsys):
    docs = corpus(40)
    bodies = [{"body": d["text"], "id": d["id"]} for d in docs]
    pq.write_table(table(bodies), tmp_path / "body.parquet")
    out = tmp_path / "out"
    _fails_with(args(bpe_files, [tmp_path / "body.parquet"], out / "x", keys=("text",)), capsys,
                rf"{tmp_path}/body.parquet: column 'text' missing \(columns: 'body', 'id'\); choose columns with "
                r"--json-keys$")
    _fails_with(args(bpe_files, [tmp_path / "body.parquet"], out / "x", keys=("body", "id")), capsys,
                rf"{tmp_path}/body.parquet: column 'id' holds int64, not text \(a string or list-of-strings column\); "
                r"choose text columns with --json-keys$")
    saved = save_dataset_with_pyarrow(table(bodies), tmp_path / "saved")
    _fails_with(args(bpe_files, [saved], out / "x", keys=("text",)), capsys,
                rf"{saved}/data-00000-of-00002.arrow: column 'text' missing \(columns: 'body', 'id'\);")
    assert nothing_left(out)


@pytest.mark.multiprocess
def test_null_values_name_the_row(tmp_path, bpe_files, capsys):
    docs = corpus(60)
    docs[37]["text"] = None
    pq.write_table(table(docs), tmp_path / "nulls.parquet", row_group_size=10)
    out = tmp_path / "out"
    argv = args(bpe_files, [tmp_path / "nulls.parquet"], out / "n", "--workers", "2", "--partitions", "2")
    _fails_with(argv, capsys, rf"{tmp_path}/nulls.parquet: row 37: key 'text' holds null, expected a string or a list "
                              r"of strings \(pass --skip-bad-lines to skip such rows\)$")
    assert nothing_left(out)
    preprocess_cli.main(argv + ["--skip-bad-lines"])
    printed = capsys.readouterr().out
    assert "skipped 1 bad line(s) or row(s)" in printed and f"{tmp_path}/nulls.parquet: row 37: key 'text'" in printed
    write_jsonl(tmp_path / "nulls.jsonl", docs)
    _fails_with(args(bpe_files, [tmp_path / "nulls.jsonl"], out / "j"), capsys,
                rf"{tmp_path}/nulls.jsonl:38: key 'text' holds null, expected a string or a list of strings")


@pytest.mark.multiprocess
def test_damaged_shards_are_one_line_and_leave_nothing(tmp_path, bpe_files, capsys):
    docs = corpus(120)
    out = tmp_path / "out"
    fix = "re-download or re-create the file$"
    # a Parquet file cut short: its footer is gone (found while planning)
    pq.write_table(table(docs), tmp_path / "whole.parquet", row_group_size=30)
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
    _fails_with(args(bpe_files, [tmp_path / "cut.parquet"], out / "a"), capsys,
                rf"{tmp_path}/cut.parquet: not a readable Parquet file \(.*\); {fix}")
    # a flipped byte in the third row group's data: its page checksum fails while reading (row named); the
    # other partition's finished temporaries are removed
    pq.write_table(table(docs), tmp_path / "flip.parquet", row_group_size=30, write_page_checksum=True,
                   use_dictionary=False, compression="none")
    column = pq.read_metadata(tmp_path / "flip.parquet").row_group(2).column(0)
    raw = bytearray((tmp_path / "flip.parquet").read_bytes())
    raw[column.data_page_offset + column.total_compressed_size - 3] ^= 0xFF
    (tmp_path / "flip.parquet").write_bytes(bytes(raw))
    (tmp_path / "all.jsonl").write_bytes(jsonl_bytes(docs))
    _fails_with(args(bpe_files, [tmp_path / "all.jsonl", tmp_path / "flip.parquet"], out / "b", "--workers", "2",
                     "--partitions", "2"), capsys,
                rf"{tmp_path}/flip.parquet: corrupt data at row 60 or after \(.*\); {fix}")
    assert nothing_left(out)
    # a saved dataset whose shard was cut short
    saved = save_dataset_with_pyarrow(table(docs), tmp_path / "saved")
    shard = os.path.join(saved, "data-00001-of-00002.arrow")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    _fails_with(args(bpe_files, [saved], out / "c"), capsys, rf"{shard}: not a readable Arrow file \(.*\); {fix}")
    # .jsonl.zst: cut short, or damaged inside
    zst = (tmp_path / "z.jsonl.zst")
    write_zst(zst, jsonl_bytes(docs), frames=1)
    whole = zst.read_bytes()
    zst.write_bytes(whole[:-40])
    _fails_with(args(bpe_files, [zst], out / "d"), capsys,
                rf"{zst}: the zstd stream ends in the middle of a frame, after line \d+ \(a truncated file\?\); "
                r"re-download or re-compress the file$")
    zst.write_bytes(whole[:8] + bytes(64) + whole[72:])
    _fails_with(args(bpe_files, [zst], out / "e"), capsys,
                rf"{zst}: corrupt zstd stream after line \d+: .*; re-download or re-compress the file$")
    assert nothing_left(out)


def test_folders_that_cannot_be_read_are_one_line(tmp_path, bpe_files, capsys):
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty/notes.txt").write_text("x")
    _fails_with(args(bpe_files, [tmp_path / "empty"], out / "a"), capsys,
                rf"--input {tmp_path}/empty: the folder holds no input files \(names ending in .jsonl, .*\); name "
                r"other files directly or with a glob$")
    saved = save_dataset_with_pyarrow(table(corpus(20)), tmp_path / "saved")
    os.remove(os.path.join(saved, "data-00001-of-00002.arrow"))
    _fails_with(args(bpe_files, [saved], out / "b"), capsys,
                rf"{saved}/state.json: its shard {saved}/data-00001-of-00002.arrow is missing; copy the whole folder, "
                r"or re-save the dataset with save_to_disk$")
    (tmp_path / "dict").mkdir()
    shutil.move(saved, tmp_path / "dict" / "train")
    (tmp_path / "dict/dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    _fails_with(args(bpe_files, [tmp_path / "dict"], out / "c"), capsys,
                rf"--input {tmp_path}/dict: a saved DatasetDict \(splits: 'train', 'test'\); give one split's folder, "
                rf"e.g. --input {tmp_path}/dict/train$")
    assert nothing_left(out)


@pytest.mark.multiprocess
def test_pyarrow_and_zstandard_are_needed_only_for_their_formats(tmp_path, bpe_files):
    hidden = tmp_path / "hidden"
    for name in ("pyarrow", "zstandard"):  # an image without them: packages that fail to import as missing ones do
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", "
                                                   f"name='{name}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), REPO])}
    docs = corpus(30)
    pq.write_table(table(docs), tmp_path / "c.parquet")
    write_zst(tmp_path / "c.jsonl.zst", jsonl_bytes(docs))
    write_jsonl(tmp_path / "c.jsonl", docs)
    script = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py")]

    def run(path, prefix):
        return subprocess.run(script + args(bpe_files, [path], prefix, "--workers", "2"), env=env,
                              capture_output=True, text=True, timeout=120)

    for name, package, what in (("c.parquet", "pyarrow", "Parquet or Arrow input"),
                                ("c.jsonl.zst", "zstandard", ".zst input needs the zstandard package")):
        done = run(tmp_path / name, tmp_path / "out" / name)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"preprocess_data.py: error: {tmp_path}/{name}: reading ") and what in \
            done.stderr and done.stderr.rstrip().endswith(f"pip install {package}"), done.stderr
    assert nothing_left(tmp_path / "out")
    done = run(tmp_path / "c.jsonl", tmp_path / "plain/out")  # JSONL needs neither, in the job or its workers
    assert done.returncode == 0, done.stderr
    assert os.path.getsize(tmp_path / "plain/out_text_document.idx") > 0
