"""The sample corpus's tokenizer training (examples/prepare_sample_data.sh step 2) as start.sh shows it: through a
pipe, its output is its two result lines, without the blank lines a progress bar leaves off a terminal."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def test_tokenizer_training_through_a_pipe_prints_no_blank_lines(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"sample text number {i}, with some words"}) + "\n"
                              for i in range(200)))
    proc = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(corpus), "--vocab-size", "300",
                           "--output-dir", str(tmp_path / "tok")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["wrote", "use"], proc.stdout
