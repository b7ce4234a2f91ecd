"""Bytecode of the installed packages a run imports, written once into PYTHONPYCACHEPREFIX's folder.

With PYTHONDONTWRITEBYTECODE set and packages installed without bytecode (uv's default), Python compiles torch's
sources at every start, in the trainer and the compile workers. It still reads PYTHONPYCACHEPREFIX's folder, so run.sh
points that at a cache and runs this module, which fills it once. It imports none of those packages.
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

DEPENDENCIES = ("torch", "numpy", "huggingface-hub", "tqdm", "tiktoken")  # pyproject.toml's (a test checks)


def distributions(names, path: list[str] | None = None) -> list[md.Distribution]:
    """The installed distributions `names` and all they require, without extras; uninstalled ones are skipped."""
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
    """Their Python sources with no bytecode where this interpreter looks (sys.pycache_prefix honoured)."""
    sources = {str(f.locate()) for dist in dists for f in dist.files or [] if f.suffix == ".py"}
    return sorted(s for s in sources if os.path.exists(s) and not os.path.exists(importlib.util.cache_from_source(s)))


def cache_prefix(environ) -> str:
    """The folder run.sh points PYTHONPYCACHEPREFIX at: the user's, or gpt-speedrun's under their cache folder."""
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or "/tmp", ".cache")
    return environ.get("PYTHONPYCACHEPREFIX") or os.path.join(cache, "gpt-speedrun", "pycache")


def bytecode_note(module, dont_write_bytecode: bool) -> str | None:
    """A note when Python compiles `module`'s sources at every start: no bytecode, and none may be written."""
    cached = module.__spec__.cached
    if not dont_write_bytecode or cached is None or os.path.exists(cached):
        return None
    return (f"note: Python compiles {module.__name__}'s sources at every start ({cached} does not exist and "
            f"PYTHONDONTWRITEBYTECODE is set), seconds of every cold start; bash run.sh writes the bytecode "
            f"once into a cache folder, or run `PYTHONPYCACHEPREFIX=~/.cache/gpt-speedrun/pycache python -m "
            f"runtime.bytecode` and keep PYTHONPYCACHEPREFIX set")


def _compile(source: str) -> bool:
    try:
        py_compile.compile(source, doraise=True)
        return True
    except (py_compile.PyCompileError, OSError):  # e.g. a template in another Python's syntax
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(DEPENDENCIES), help="distributions (default: ours)")
    args = parser.parse_args(argv)
    todo = missing_bytecode(distributions(args.names))
    t0 = time.perf_counter()
    with ProcessPoolExecutor() as pool:  # files that do not compile stay missing, unreported
        written = sum(pool.map(_compile, todo, chunksize=64))
    if written:
        where = sys.pycache_prefix or "__pycache__ folders beside the sources"
        print(f"bytecode: {written:,} Python files of the installed packages compiled into {where} in "
              f"{time.perf_counter() - t0:.1f} s, once: later starts read them", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
