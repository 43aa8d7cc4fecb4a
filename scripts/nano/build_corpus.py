"""Build the nano model's corpus from text that ships with CPython itself (PSF licence), deterministically.

Documents, in a fixed order:
  1. every ``pydoc_data.topics`` entry (the Python reference's help topics: statements, operators, types...);
  2. a "docs view" of every standard-library module: its docstring, then ``class``/``def`` signatures with their
     docstrings (``ast`` parsing, nothing is imported);
  3. the module's source itself, first ``--source-bytes`` bytes (Python code, comments, docstrings).

Split: a module (all its documents) or a topic goes to validation when ``sha1(name) % 20 == 0`` (about 5%).
Tokens are UTF-8 bytes (0-255); every document ends with ``<|endoftext|>`` (256).

Writes ``OUT/{train,val}.bin`` (uint16 token ids), ``OUT/recipe.json`` (Python version, counts, sizes, sha256,
licence) and the demo slice ``qwen_scope/data/nano/corpus_sample.jsonl`` (validation documents only).

Usage: python scripts/nano/build_corpus.py --out .nano/corpus
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np

EOS = 256
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo", "encodings"}
REPO = Path(__file__).resolve().parents[2]


def is_val(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 20 == 0


def topic_docs() -> list[dict]:
    import pydoc_data.topics as topics

    return [{"source": "pydoc_topic", "name": name, "text": f"Help on topic {name}:\n\n{topics.topics[name].strip()}\n"}
            for name in sorted(topics.topics)]


def stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or rel.name.startswith("_") and rel.name != "__init__.py":
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out.append((module, path))
    return out


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){ret}:"


def _doc_block(doc: str, indent: str) -> str:
    body = "\n".join(indent + line if line else "" for line in doc.strip().splitlines())
    return f'{indent}"""{body.lstrip()}\n{indent}"""\n'


def docs_view(module: str, tree: ast.Module) -> str:
    parts = [f"Help on module {module}:\n\n"]
    if doc := ast.get_docstring(tree):
        parts.append(doc.strip() + "\n\n")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (doc := ast.get_docstring(node)):
            parts.append(f"{_signature(node)}\n{_doc_block(doc, '    ')}\n")
        elif isinstance(node, ast.ClassDef):
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            cls_doc = ast.get_docstring(node)
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and ast.get_docstring(m) and not m.name.startswith("_")]
            if not cls_doc and not methods:
                continue
            parts.append(f"class {node.name}({bases}):\n" if bases else f"class {node.name}:\n")
            if cls_doc:
                parts.append(_doc_block(cls_doc, "    "))
            for m in methods:
                parts.append(f"\n    {_signature(m)}\n{_doc_block(ast.get_docstring(m), '        ')}")
            parts.append("\n")
    return "".join(parts)


def module_docs(source_bytes: int) -> list[dict]:
    docs = []
    for module, path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        view = docs_view(module, tree)
        if view.count("\n") > 3:
            docs.append({"source": "docstrings", "name": module, "text": view})
        code = text.encode("utf-8")[:source_bytes].decode("utf-8", errors="ignore")
        docs.append({"source": "source", "name": module, "text": code[: code.rfind("\n") + 1]})
    return docs


def encode(docs: list[dict]) -> np.ndarray:
    ids: list[int] = []
    for d in docs:
        ids.extend(d["text"].encode("utf-8"))
        ids.append(EOS)
    return np.asarray(ids, dtype=np.uint16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".nano/corpus", help="output directory (default .nano/corpus)")
    parser.add_argument("--source-bytes", type=int, default=12_000, help="bytes of each module's source kept")
    parser.add_argument("--sample", default=str(REPO / "qwen_scope/data/nano/corpus_sample.jsonl"),
                        help="where the demo slice (validation documents) goes")
    parser.add_argument("--sample-bytes", type=int, default=400_000, help="size cap of the demo slice")
    args = parser.parse_args(argv)

    docs = topic_docs() + module_docs(args.source_bytes)
    train = [d for d in docs if not is_val(d["name"])]
    val = [d for d in docs if is_val(d["name"])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
              "licence": "PSF-2.0 (Python Software Foundation License): the CPython standard library and its "
                         "pydoc_data topics", "source_bytes_per_module": args.source_bytes, "eos_id": EOS,
              "n_docs": {}, "n_tokens": {}, "sha256": {},
              "by_source": {s: sum(len(d["text"].encode()) for d in docs if d["source"] == s)
                            for s in ("pydoc_topic", "docstrings", "source")}}
    for split, split_docs in (("train", train), ("val", val)):
        ids = encode(split_docs)
        ids.tofile(out / f"{split}.bin")
        recipe["n_docs"][split] = len(split_docs)
        recipe["n_tokens"][split] = int(ids.size)
        recipe["sha256"][split] = hashlib.sha256(ids.tobytes()).hexdigest()
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1))

    sample, size = [], 0
    # Prefer prose-rich validation documents (topics, docs views) for the demo, then source.
    for d in sorted(val, key=lambda d: (d["source"] == "source", d["name"])):
        text = d["text"][:6000]
        if size + len(text) > args.sample_bytes:
            continue
        sample.append({"source": d["source"], "name": d["name"], "text": text})
        size += len(text)
    Path(args.sample).parent.mkdir(parents=True, exist_ok=True)
    with open(args.sample, "w", encoding="utf-8") as f:
        for d in sample:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    print(json.dumps({**recipe, "sample_docs": len(sample), "sample_chars": size}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
