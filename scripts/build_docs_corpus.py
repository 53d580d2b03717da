"""A technical-documentation corpus from what this machine has installed, for `distlm prepare`.

    python scripts/build_docs_corpus.py --out data/docs-text/docs.jsonl [--max-mb 60] [--packages numpy,torch,...]
    distlm prepare data/docs-text/docs.jsonl --out data/docs

Text of another kind than the prose corpus (scripts/build_speedrun_corpus.py): the docstrings of
the Python standard library and of permissively licensed packages installed beside it, with the
signatures they document, and the packages' own descriptions (their README, shipped in their
metadata). One document per module (its docstring, then each documented class, function and
method as `def name(args)` followed by its docstring) and one per package description: API
reference prose with code examples, doctests and reStructuredText/Markdown markup.

Sources are read, never imported or run: the docstrings come from each .py file's syntax tree
(`ast`). Only the standard library (PSF-2.0) and the packages of PACKAGES below are read, each
with the licence its metadata states (all permissive: BSD, MIT, Apache-2.0, PSF, ISC); a
package whose metadata does not name its expected licence is skipped, and said so. Nothing
is vendored: the corpus is built on the machine that uses it, from what that machine has.

The output is deterministic for one set of installed versions: documents are ordered by
source and path, and the versions are written beside it (OUT.sources.json, with each source's
licence, documents and characters). It is written to a temporary file and renamed, so a
failed build leaves nothing. --max-mb stops adding documents once that many megabytes of text
are written (whole documents; sources in the order of PACKAGES, the standard library first).
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator, Optional

# distribution -> (the words its metadata must contain for its licence, the licence as recorded).
# Copyleft (GPL, LGPL, MPL) and unclear licences are left out.
PACKAGES = {
    "numpy": ("BSD", "BSD-3-Clause"),
    "torch": ("BSD", "BSD-3-Clause (with Apache-2.0, MIT, BSL-1.0 parts)"),
    "sympy": ("BSD", "BSD-3-Clause"),
    "networkx": ("BSD", "BSD-3-Clause"),
    "matplotlib": ("Python Software Foundation", "PSF-based matplotlib licence"),
    "mpmath": ("BSD", "BSD-3-Clause"),
    "transformers": ("Apache", "Apache-2.0"),
    "huggingface_hub": ("Apache", "Apache-2.0"),
    "pyarrow": ("Apache", "Apache-2.0"),
    "tensorboard": ("Apache", "Apache-2.0"),
    "pygments": ("BSD", "BSD-2-Clause"),
    "jinja2": ("BSD", "BSD-3-Clause"),
    "markupsafe": ("BSD", "BSD-3-Clause"),
    "click": ("BSD", "BSD-3-Clause"),
    "werkzeug": ("BSD", "BSD-3-Clause"),
    "fsspec": ("BSD", "BSD-3-Clause"),
    "markdown": ("BSD", "BSD-3-Clause"),
    "pydantic": ("MIT", "MIT"),
    "setuptools": ("MIT", "MIT"),
    "pip": ("MIT", "MIT"),
    "pytest": ("MIT", "MIT"),
    "rich": ("MIT", "MIT"),
    "pyparsing": ("MIT", "MIT"),
    "urllib3": ("MIT", "MIT"),
    "fonttools": ("MIT", "MIT"),
    "pyyaml": ("MIT", "MIT"),
    "requests": ("Apache", "Apache-2.0"),
    "packaging": ("BSD", "Apache-2.0 OR BSD-2-Clause"),
    "typing_extensions": ("PSF", "PSF-2.0"),
}
STDLIB_LICENCE = "PSF-2.0"
# Standard-library folders that are tests, vendored third-party code or data, not documentation.
STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "ensurepip", "__pycache__",
               "turtledemo", "tkinter", "idlelib", "pydoc_data"}
MIN_DOC_CHARS = 200  # a module with less documentation than this adds nothing but its name


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        args = ast.unparse(node.args)
    except (ValueError, RecursionError):  # a syntax tree ast cannot print back: the name alone
        args = "..."
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{'async def' if isinstance(node, ast.AsyncFunctionDef) else 'def'} {node.name}({args}){returns}"


def _documented(body: list, prefix: str) -> Iterator[str]:
    """Each documented class, function and method under ``body``, in source order."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name.startswith("_") and not node.name.startswith("__init__"):
                continue  # private functions: their docstrings are notes for maintainers
            doc = ast.get_docstring(node, clean=True)
            if isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                head = f"class {prefix}{node.name}" + (f"({bases})" if bases else "")
            else:
                head = _signature(node).replace(f"def {node.name}(", f"def {prefix}{node.name}(", 1)
            if doc:
                yield f"{head}\n\n{doc.strip()}\n"
            if isinstance(node, ast.ClassDef):
                yield from _documented(node.body, f"{prefix}{node.name}.")


def module_document(path: Path, module: str) -> Optional[str]:
    """The module's documentation as one text, or None when it has too little (or does not
    parse with this interpreter's grammar)."""
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old docstrings
            tree = ast.parse(source, filename=str(path))
    except (SyntaxError, ValueError, OSError, RecursionError):
        return None
    parts = [f"{module}\n{'=' * len(module)}\n"]
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        parts.append(doc.strip() + "\n")
    parts.extend(_documented(tree.body, ""))
    text = "\n".join(parts)
    return text if len(text) - len(parts[0]) >= MIN_DOC_CHARS else None


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def stdlib_documents(root: Path) -> Iterator[tuple[str, str]]:
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if STDLIB_SKIP.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        text = module_document(path, _module_name(rel))
        if text:
            yield f"stdlib:{rel.as_posix()}", text


def _licence_text(dist: md.Distribution) -> str:
    m = dist.metadata
    return " ".join([m.get("License-Expression") or "", (m.get("License") or "")[:2000],
                     *(c for c in (m.get_all("Classifier") or []) if c.startswith("License"))])


def package_documents(dist: md.Distribution, name: str) -> Iterator[tuple[str, str]]:
    description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
    if isinstance(description, str) and len(description.strip()) >= MIN_DOC_CHARS:
        yield f"{name}:DESCRIPTION", f"{dist.metadata['Name']} {dist.version}\n\n{description.strip()}\n"
    files = sorted((f for f in (dist.files or []) if f.suffix == ".py"), key=lambda f: f.as_posix())
    for f in files:
        parts = Path(f.as_posix()).parts
        if any(p in ("test", "tests", "testing", "_vendor", "vendored", "_vendored") for p in parts[:-1]) \
                or parts[-1].startswith("test_") or parts[0].endswith((".dist-info", ".data")) or ".." in parts:
            continue
        text = module_document(Path(dist.locate_file(f)), _module_name(Path(f.as_posix())))
        if text:
            yield f"{name}:{f.as_posix()}", text


def find_distribution(name: str, path: Optional[list[str]]) -> Optional[md.Distribution]:
    found = [d for d in (md.distributions(path=path) if path else md.distributions())
             if (d.metadata["Name"] or "").lower().replace("-", "_") == name.lower().replace("-", "_")]
    return sorted(found, key=lambda d: d.version)[-1] if found else None


def build(out: Path, max_mb: float, packages: list[str], stdlib: Optional[Path], site: Optional[list[str]],
          say=print) -> dict:
    """Write OUT (JSONL, {"text", "source", "licence"} per line) and OUT.sources.json; return the summary."""
    sources, limit, written = [], max_mb * 1e6, 0
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            groups: list[tuple[str, str, str, Iterator[tuple[str, str]]]] = []
            if stdlib is not None:
                groups.append(("python-stdlib", sys.version.split()[0], STDLIB_LICENCE, stdlib_documents(stdlib)))
            for name in packages:
                dist = find_distribution(name, site)
                if dist is None:
                    say(f"{name}: not installed here; skipped")
                    continue
                words, licence = PACKAGES[name]
                if words.lower() not in _licence_text(dist).lower():
                    say(f"{name} {dist.version}: its metadata does not state {words}; skipped")
                    continue
                groups.append((name, dist.version, licence, package_documents(dist, name)))
            for name, version, licence, docs in groups:
                if written >= limit:
                    break
                n = chars = 0
                for source, text in docs:
                    if written >= limit:
                        break
                    line = json.dumps({"text": text, "source": source, "licence": licence}, ensure_ascii=False)
                    fh.write(line + "\n")
                    n, chars, written = n + 1, chars + len(text), written + len(text.encode())
                sources.append({"source": name, "version": version, "licence": licence, "documents": n,
                                "characters": chars})
        summary = {"python": sys.version.split()[0], "max_mb": max_mb, "bytes": written, "sources": sources}
        side = out.with_name(out.name + ".sources.json")
        side_tmp = side.with_name(side.name + ".tmp")
        side_tmp.write_text(json.dumps(summary, indent=1) + "\n")
        os.replace(tmp, out)
        os.replace(side_tmp, side)
    finally:
        tmp.unlink(missing_ok=True)
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="build_docs_corpus.py", description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", required=True, help="the JSONL file to write: what `distlm prepare` reads (give it "
                                                "the file: the list of sources beside it is not text to train on)")
    p.add_argument("--max-mb", type=float, default=60.0, help="megabytes of text at most (default 60: ~15M tokens)")
    p.add_argument("--packages", default=",".join(PACKAGES),
                   help=f"distributions to read, in order, from: {', '.join(PACKAGES)}")
    p.add_argument("--no-stdlib", action="store_true", help="leave the standard library out")
    p.add_argument("--site", action="append", help="read distributions from this folder (default: this Python's)")
    args = p.parse_args(argv)
    packages = [x for x in args.packages.split(",") if x]
    unknown = [x for x in packages if x not in PACKAGES]
    if unknown:
        print(f"error: --packages: {', '.join(unknown)} not in the licence-checked list "
              f"({', '.join(PACKAGES)})", file=sys.stderr)
        return 2
    if args.max_mb <= 0:
        print(f"error: --max-mb: {args.max_mb:g}; must be positive", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.is_dir():
        print(f"error: {out}: is a folder; give the JSONL file to write", file=sys.stderr)
        return 2
    stdlib = None if args.no_stdlib else Path(sysconfig.get_paths()["stdlib"])
    summary = build(out, args.max_mb, packages, stdlib, args.site)
    docs = sum(s["documents"] for s in summary["sources"])
    print(f"wrote {out}: {docs} documents, {summary['bytes'] / 1e6:.1f} MB from {len(summary['sources'])} sources "
          f"(licences in {out.name}.sources.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
