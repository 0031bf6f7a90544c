"""Preprocessing end to end (megatron.data.preprocess.cli, run as tools/preprocess_data.py): outputs,
partitions/workers invariance, bad input, sentences, memory."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import cli
from megatron.tokenizer import GPT2BPETokenizer
from tests.data.conftest import MULTILINGUAL, write_jsonl
from tests.memory_utils import PeakRSS
from tests.tmpfs import mounted_tmpfs

pytestmark = pytest.mark.multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def records(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = " ".join(MULTILINGUAL[j] for j in rng.integers(0, len(MULTILINGUAL), size=rng.integers(1, 4)))
        out.append({"text": "" if i % 17 == 5 else text, "title": f"Document {i}", "id": i})
    return out


def gpt2_args(bpe_files, inputs, prefix, *extra):
    return ["--input", *inputs, "--json-keys", "text", "title", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", bpe_files[0], "--merge-file", bpe_files[1], "--append-eod",
            "--output-prefix", str(prefix), *extra]


def read_back(prefix):
    ds = MMapIndexedDataset(prefix)
    return ds, [ds[i].tolist() for i in range(len(ds))]


def test_outputs_match_tokenizer_and_do_not_depend_on_workers_or_partitions(tmp_path, bpe_files, capsys):
    docs = records(300)
    write_jsonl(tmp_path / "all.jsonl", docs)
    cli.main(gpt2_args(bpe_files, [str(tmp_path / "all.jsonl")], tmp_path / "one/out", "--workers", "1"))
    err = capsys.readouterr().err
    assert "docs/s" in err and "MB/s" in err and "ETA" in err
    tok = GPT2BPETokenizer(*bpe_files)
    ds, sequences = read_back(tmp_path / "one/out_text_document")
    expected = [tok.tokenize(d["text"]) + [tok.eod] for d in docs if d["text"]]
    assert sequences == expected and ds.dtype == np.uint16
    # empty documents keep their document-index entry and hold no sequence (Megatron's layout)
    empties = [i for i, d in enumerate(docs) if not d["text"]]
    assert ds.num_documents == 300 and all(ds.doc_idx[i] == ds.doc_idx[i + 1] for i in empties)
    _, titles = read_back(tmp_path / "one/out_title_document")
    assert titles == [tok.tokenize(d["title"]) + [tok.eod] for d in docs]
    # the same documents as three files (two gzipped, found by a glob), 3 workers in 2 partitions
    for name, part in (("a.jsonl.gz", docs[:80]), ("b.jsonl", docs[80:220]), ("c.jsonl.gz", docs[220:])):
        lines = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in part).encode("utf-8")
        opener = gzip.open if name.endswith(".gz") else open
        with opener(tmp_path / name, "wb") as f:
            f.write(lines)
    cli.main(gpt2_args(bpe_files, [str(tmp_path / "[abc].jsonl*")], tmp_path / "many/out",
                                   "--workers", "3", "--partitions", "2"))
    for key in ("text", "title"):
        for ext in ("bin", "idx"):
            one = (tmp_path / f"one/out_{key}_document.{ext}").read_bytes()
            assert (tmp_path / f"many/out_{key}_document.{ext}").read_bytes() == one
    assert sorted(os.listdir(tmp_path / "many")) == [f"out_{k}_document.{e}" for k in ("text", "title")
                                                      for e in ("bin", "idx")]


def test_byte_ranges_split_lines_exactly(tmp_path, bpe_files):
    """Many partitions over one plain file: every line lands in exactly one partition."""
    docs = records(120, seed=1)
    write_jsonl(tmp_path / "in.jsonl", docs)
    cli.main(gpt2_args(bpe_files, [str(tmp_path / "in.jsonl")], tmp_path / "out",
                                   "--workers", "4", "--partitions", "4"))
    tok = GPT2BPETokenizer(*bpe_files)
    _, titles = read_back(tmp_path / "out_title_document")
    assert titles == [tok.tokenize(d["title"]) + [tok.eod] for d in docs]


def _fails_with(argv, capsys, pattern, code=2):
    """cli.main(argv) stops with exit ``code`` and one stderr line matching ``pattern``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == code, err
    error_lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(error_lines) == 1 and "Traceback" not in err, err
    assert re.search(r"^preprocess_data.py: error: " + pattern, error_lines[0]), err


def test_malformed_input_names_file_and_line(tmp_path, bpe_files, capsys):
    lines = [json.dumps(d) for d in records(40, seed=2)]
    lines[24] = '{"text": "unterminated'
    lines[31] = json.dumps({"body": "no text key", "title": "t"})
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    args = gpt2_args(bpe_files, [path], tmp_path / "out/bad", "--workers", "2", "--partitions", "2")
    _fails_with(args, capsys, r".*bad.jsonl:25: invalid JSON .*--skip-bad-lines")
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []  # nothing left behind
    lines[24] = json.dumps(records(1)[0])
    write_jsonl(path, lines)
    _fails_with(args, capsys, r".*bad.jsonl:32: key 'text' missing \(keys present: 'body', 'title'\)")
    lines[5] = "[1, 2]"
    lines[9] = '{"text": "lone surrogate \\ud800", "title": "t"}'
    write_jsonl(path, lines)
    cli.main(args + ["--skip-bad-lines"])
    out = capsys.readouterr().out
    assert "skipped 3 bad line(s)" in out and "bad.jsonl:6: expected a JSON object" in out and "bad.jsonl:32" in out
    assert "bad.jsonl:10: cannot tokenize 'text'" in out
    ds, _ = read_back(tmp_path / "out/bad_title_document")
    assert ds.num_documents == 37
    _fails_with(gpt2_args(bpe_files, [str(tmp_path / "missing*.jsonl")], tmp_path / "x"), capsys, ".*no such file")
    _fails_with(["--input", path, "--tokenizer-type", "GPT2BPETokenizer", "--output-prefix", "x"], capsys,
                ".*--vocab-file")


def test_empty_input_is_refused_and_writes_nothing(tmp_path, bpe_files, capsys):
    """A 0-document dataset used to be written (exit 0) and then crashed the trainer."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    for path in (empty, blank):
        _fails_with(gpt2_args(bpe_files, [str(path)], tmp_path / "out/e", "--workers", "2", "--partitions", "2"),
                    capsys, rf"--input {path}: no documents \(the input is empty or every line or row was blank or "
                            r"skipped\); give JSONL with one \{\"text\": ...\} object per line, or Parquet or Arrow "
                            r"with a 'text' column$")
        assert os.listdir(tmp_path / "out") == []
    untitled = write_jsonl(tmp_path / "untitled.jsonl", [{"text": "some words", "title": ""}] * 3)
    _fails_with(["--input", untitled, "--json-keys", "title", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                 bpe_files[0], "--merge-file", bpe_files[1], "--output-prefix", str(tmp_path / "out/t")],
                capsys, rf"--input {untitled}: 3 documents but no tokens under the key 'title'")
    assert os.listdir(tmp_path / "out") == []


def test_output_prefix_that_cannot_be_written_is_one_line(tmp_path, bpe_files, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", records(5))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    _fails_with(gpt2_args(bpe_files, [path], blocker / "sub/out"), capsys,
                rf"--output-prefix {blocker}/sub/out: cannot create {blocker}/sub \(Not a directory\); choose an "
                r"--output-prefix in a writable directory$")
    _fails_with(gpt2_args(bpe_files, [path], blocker / "out"), capsys,
                rf"--output-prefix {blocker}/out: {blocker} exists and is not a directory;")
    with mounted_tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        _fails_with(gpt2_args(bpe_files, [path], ro / "sub/out"), capsys,
                    rf"--output-prefix {ro}/sub/out: cannot create {ro}/sub \(Read-only file system\);")
        _fails_with(gpt2_args(bpe_files, [path], ro / "out"), capsys,
                    rf"--output-prefix {ro}/out: cannot write to {ro} \(it is on a read-only filesystem\);")


def test_split_sentences_trains_punkt_on_the_input(tmp_path, capsys):
    pytest.importorskip("nltk", reason="--split-sentences needs nltk (optional; not on every GPU image)")
    text = ("Dr. Smith went to Washington. He arrived at 5 p.m. on Monday! Did he stay? "
            "Yes.\nThe end of the story.\n")
    docs = [{"text": text * (1 + i % 3)} for i in range(60)] + [{"text": ""}]
    path = write_jsonl(tmp_path / "s.jsonl", docs)
    base = ["--input", path, "--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(_hf_tokenizer(tmp_path)),
            "--split-sentences", "--workers", "2"]
    cli.main(base + ["--output-prefix", str(tmp_path / "s")])
    assert "trained Punkt on the first" in capsys.readouterr().err
    hf = Tokenizer.from_file(str(_hf_tokenizer(tmp_path)))
    ds, sequences = read_back(tmp_path / "s_text_sentence")
    assert ds.num_documents == 61 and list(np.diff(ds.doc_idx[:4])) == [5, 9, 13]
    # Punkt learned the abbreviations (Dr., p.m.) from the input itself
    assert [hf.decode(s) for s in sequences[:5]] == [
        "Dr. Smith went to Washington.", "He arrived at 5 p.m. on Monday!", "Did he stay?", "Yes.",
        "The end of the story."]
    cli.main(base + ["--keep-newlines", "--output-prefix", str(tmp_path / "k")])
    _, kept = read_back(tmp_path / "k_text_sentence")
    assert [hf.decode(s) for s in kept[2:5]] == ["Did he stay? ", "Yes.\n", "The end of the story."]


def test_without_nltk_only_split_sentences_is_refused_in_one_line(tmp_path):
    # An image without nltk: a package on PYTHONPATH that fails to import as a missing nltk does.
    hide = tmp_path / "no_nltk" / "nltk"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'nltk'\", name='nltk')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide.parent), REPO])}
    path = write_jsonl(tmp_path / "s.jsonl", [{"text": "One sentence. Another one."}] * 3)
    base = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", path, "--tokenizer-type",
            "HFTokenizer", "--tokenizer-model", str(_hf_tokenizer(tmp_path)), "--workers", "2"]
    run = subprocess.run(base + ["--split-sentences", "--output-prefix", str(tmp_path / "out/s")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "preprocess_data.py: error: --split-sentences needs nltk, which is not installed: pip install nltk (or "
        "run without --split-sentences)"], run.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written
    # Without --split-sentences nothing imports nltk, in the job or in its worker processes.
    run = subprocess.run(base + ["--output-prefix", str(tmp_path / "d")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    _, sequences = read_back(tmp_path / "d_text_document")
    assert len(sequences) == 3 and all(sequences)


def _hf_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    if not path.exists():
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(MULTILINGUAL * 5, vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
        tok.save(str(path))
    return path


def _generate_jsonl(path, megabytes):
    """~1 KB lines: 30 NullTokenizer ids to tokenize plus an untokenized filler field."""
    rng = np.random.default_rng(0)
    block = "".join(json.dumps({"text": " ".join(map(str, rng.integers(0, 50_000, size=30))),
                                "meta": "x" * 800, "n": i}) + "\n" for i in range(2000))
    copies = max(1, int(megabytes * 1e6) // len(block))
    with open(path, "w") as f:
        for _ in range(copies):
            f.write(block)
    return os.path.getsize(path), copies * 2000


def _peak_rss(argv):
    """Run a command; return (peak summed RSS of it and its children, returncode, stderr)."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with PeakRSS(proc.pid, children=True, interval=0.02) as rss:
        err = proc.stderr.read().decode()
        proc.wait()
    return rss.peak, proc.returncode, err


def test_memory_stays_flat_on_large_input(tmp_path):
    _generate_jsonl(tmp_path / "small.jsonl", 20)
    large_bytes, large_docs = _generate_jsonl(tmp_path / "large.jsonl", 220)
    assert large_bytes > 200e6
    peaks = {}
    for name in ("small", "large"):
        argv = [sys.executable, "-m", "tools.preprocess_data", "--input", str(tmp_path / f"{name}.jsonl"),
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "50000", "--append-eod",
                "--output-prefix", str(tmp_path / name), "--workers", "2", "--log-interval", "100000"]
        peaks[name], rc, err = _peak_rss(argv)
        assert rc == 0, err
    ds = MMapIndexedDataset(tmp_path / "large_text_document")
    assert len(ds) == large_docs and int(ds.sizes[0]) == 31
    # 10x the input (+200 MB) may cost a few MB more, never a share of the input
    assert peaks["large"] - peaks["small"] < 40e6, peaks
    assert peaks["large"] < 600e6, peaks


def test_script_runs_from_any_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: preprocess_data.py") and "--output-prefix" in run.stdout


def test_sample_corpus_is_deterministic(tmp_path):
    runs = [subprocess.Popen([sys.executable, "-m", "tools.make_sample_corpus", "--output",
                              str(tmp_path / f"c{i}.jsonl")], cwd=REPO, stdout=subprocess.PIPE) for i in range(2)]
    assert all(p.wait() == 0 for p in runs)
    first, second = ((tmp_path / f"c{i}.jsonl").read_bytes() for i in range(2))
    assert first == second and len(first) > 3_000_000
    docs = [json.loads(line) for line in first.decode("utf-8").splitlines()]
    assert len(docs) > 1000 and [d["id"] for d in docs] == list(range(len(docs)))
    words = " ".join(d["text"] for d in docs[:200]).split()
    assert sum(w.lower() in {"the", "a", "of", "is", "to", "and"} for w in words) > 0.08 * len(words)
