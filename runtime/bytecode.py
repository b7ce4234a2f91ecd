"""Bytecode of the installed packages a run imports, written once into PYTHONPYCACHEPREFIX's folder.

Python compiles a module's source at every import when no bytecode of it is on disk and it may not write any:
PYTHONDONTWRITEBYTECODE, which some images set, with packages installed without bytecode (uv's default). For torch
that is paid by the trainer and by the compile workers' process at every start: 90.7 s against 77.0 s, and 86.2 s
against 80.5 s, of strictly cold starts on two H200 machines (bench/results/README.md, 189bda3). Python still
reads bytecode from PYTHONPYCACHEPREFIX's folder when it may not write, so run.sh points that at a cache folder
and runs `python -m runtime.bytecode`, which fills it the first time. This module imports none of those packages.
"""
import argparse
import importlib.metadata as md
import importlib.util
import os
import py_compile
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

DEPENDENCIES = ("torch", "numpy", "huggingface-hub", "tqdm", "tiktoken")  # pyproject.toml's; a test keeps them equal


def distributions(names, path: list[str] | None = None) -> list[md.Distribution]:
    """The installed distributions `names` and everything they require, extras left out (a requirement that is not
    installed, e.g. for another platform, is skipped)."""
    seen, todo, found = set(), list(names), []
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in seen:
            continue
        seen.add(key)
        dist = next(iter(md.distributions(name=key, path=path if path is not None else sys.path)), None)
        if dist is None:
            continue
        found.append(dist)
        todo += [re.split(r"[\s;\[<>=!~(]", req.strip(), maxsplit=1)[0]
                 for req in dist.requires or [] if "extra ==" not in req]
    return found


def missing_bytecode(dists: list[md.Distribution]) -> list[str]:
    """Their Python sources with no bytecode where this interpreter looks for it (sys.pycache_prefix honoured)."""
    sources = {str(f.locate()) for dist in dists for f in dist.files or [] if f.suffix == ".py"}
    return sorted(s for s in sources if os.path.exists(s) and not os.path.exists(importlib.util.cache_from_source(s)))


def cache_prefix(environ) -> str:
    """The folder run.sh points PYTHONPYCACHEPREFIX at: the user's, or gpt-speedrun's under their cache folder."""
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or "/tmp", ".cache")
    return environ.get("PYTHONPYCACHEPREFIX") or os.path.join(cache, "gpt-speedrun", "pycache")


def bytecode_note(module, dont_write_bytecode: bool) -> str | None:
    """A note when Python compiles `module`'s sources at every start: no bytecode on disk, and none to be written
    (the trainer logs it; bench.run records it)."""
    cached = module.__spec__.cached
    if not dont_write_bytecode or cached is None or os.path.exists(cached):
        return None
    return (f"note: Python compiles {module.__name__}'s sources at every start ({cached} does not exist and "
            f"PYTHONDONTWRITEBYTECODE is set), 6-14 s of a cold start on an H200; bash run.sh writes the bytecode "
            f"once into a cache folder, or run `PYTHONPYCACHEPREFIX=~/.cache/gpt-speedrun/pycache python -m "
            f"runtime.bytecode` and keep PYTHONPYCACHEPREFIX set")


def _compile(source: str) -> bool:
    try:
        py_compile.compile(source, doraise=True)
        return True
    except (py_compile.PyCompileError, OSError):  # e.g. a template or a test file in another Python's syntax
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(DEPENDENCIES), help="distributions (default: ours)")
    args = parser.parse_args(argv)
    todo = missing_bytecode(distributions(args.names))
    t0 = time.perf_counter()
    with ProcessPoolExecutor() as pool:  # a file that is not this Python's source stays missing, unreported
        written = sum(pool.map(_compile, todo, chunksize=64))
    if written:
        where = sys.pycache_prefix or "__pycache__ folders beside the sources"
        print(f"bytecode: {written:,} Python files of the installed packages compiled into {where} in "
              f"{time.perf_counter() - t0:.1f} s, once: later starts read them", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
