"""Build a deterministic JSONL corpus of real English text from the Python standard library, offline.

    python tools/make_sample_corpus.py --output data/sample_corpus.jsonl

Documents, in a fixed order: the language reference topics that ship with pydoc (``pydoc_data.topics``),
then for every stdlib module (files walked in sorted order; tests and site-packages excluded) one document
of its docstrings (module, classes, functions, in source order) and one of its prose comment blocks.
Sources are parsed, never imported. The same Python version gives byte-identical output (a few MB);
each line is ``{"id": n, "source": ..., "text": ...}``.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import os
import sys
import sysconfig
import tokenize
from pydoc_data.topics import topics
from typing import Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.tool_errors import one_line_errors  # noqa: E402

SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
MIN_COMMENT_BLOCK_CHARS = 80
MIN_PROSE_FRACTION = 0.75  # letters and spaces among the characters of a comment block


def stdlib_sources(root: str) -> Iterator[tuple[str, str]]:
    """(module name, path) of every stdlib .py file, in a stable order."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                yield module.removesuffix(".__init__"), path


def docstrings(tree: ast.Module, module: str) -> list[str]:
    """Docstrings in source order, each class/function one headed by its qualified name."""
    parts = []
    text = ast.get_docstring(tree)
    if text:
        parts.append(text)

    def visit(body: list[ast.stmt], qualname: str) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{qualname}.{node.name}"
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(f"{name}\n{doc}")
                visit(node.body, name)

    visit(tree.body, module)
    return parts


def comment_blocks(source: bytes) -> list[str]:
    """Runs of consecutive comment lines that read as prose."""
    blocks, current, last_line = [], [], -2
    for token in tokenize.tokenize(io.BytesIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        if token.start[0] != last_line + 1 and current:
            blocks.append(" ".join(current))
            current = []
        if text:
            current.append(text)
        last_line = token.start[0]
    if current:
        blocks.append(" ".join(current))
    return [b for b in blocks if len(b) >= MIN_COMMENT_BLOCK_CHARS
            and sum(c.isalpha() or c == " " for c in b) >= MIN_PROSE_FRACTION * len(b)]


def documents() -> Iterator[tuple[str, str]]:
    """(source, text) pairs of the corpus, in order."""
    for name in sorted(topics):
        yield f"pydoc topic {name}", topics[name].strip()
    for module, path in stdlib_sources(sysconfig.get_paths()["stdlib"]):
        with open(path, "rb") as f:
            source = f.read()
        try:
            tree = ast.parse(source, filename=path)
            comments = comment_blocks(source)
        except (SyntaxError, tokenize.TokenError, UnicodeDecodeError):
            continue  # a few stdlib files are deliberately invalid (bad-syntax fixtures)
        parts = docstrings(tree, module)
        if parts:
            yield f"docstrings of {module}", "\n\n".join(parts)
        if comments:
            yield f"comments of {module}", "\n\n".join(comments)


def write_corpus(output: str, max_bytes: int | None = None) -> tuple[int, int]:
    """Write the corpus (its first documents up to ``max_bytes`` of text, if given); returns (docs, bytes)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    count, size = 0, 0
    tmp = f"{output}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for source, text in documents():
                if max_bytes is not None and size >= max_bytes:
                    break
                line = json.dumps({"id": count, "source": source, "text": text}, ensure_ascii=False)
                f.write(line + "\n")
                count += 1
                size += len(line.encode("utf-8")) + 1
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return count, size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=None, help="stop after about this many MB")
    args = parser.parse_args(argv)
    if args.max_mb is not None and not args.max_mb > 0:
        parser.error(f"--max-mb must be > 0, got {args.max_mb}")
    max_bytes = int(args.max_mb * 1e6) if args.max_mb is not None else None
    with one_line_errors("make_sample_corpus.py", "give an --output path in a writable directory"):
        count, size = write_corpus(args.output, max_bytes)
    print(f"wrote {args.output}: {count:,} documents, {size / 1e6:.2f} MB of English text from the "
          f"Python {sys.version.split()[0]} standard library")


if __name__ == "__main__":
    main()
