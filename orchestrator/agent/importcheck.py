"""The import check of a new venv, at the cost it must have. Standard library only.

Run by the new venv's interpreter (rebuild_venv.sh -> venvinfo verify):
- Each top-level module is imported in one of a few worker processes (this file run by the same
  interpreter with the same sys.path; modules handed out one at a time as workers finish), so a slow
  import does not hold up the rest and an import that kills its interpreter is named, not fatal.
- A distribution whose exact installed wheel was verified before under the same Python in this workdir is
  not imported again: the record (`<workdir>/venvs/.verified-wheels.json`) keys each verified distribution
  by its name, version, the sha256 of the files it installed (its RECORD, minus the lines that differ from
  venv to venv) and, recursively, the same key of every installed distribution it requires. So
  `transformers` is imported again when `torch` changed under it, never when nothing did.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import selectors
import subprocess
import sys
import time
from pathlib import Path

RECORD_VERSION = 1
MAX_ENTRIES = 5000
# RECORD lines that differ between two venvs holding the same wheel: scripts outside site-packages carry
# the venv's path in their shebang; INSTALLER/REQUESTED/direct_url.json describe the install, not the wheel.
_VOLATILE = re.compile(r"^\.\./|\.dist-info/(INSTALLER|REQUESTED|direct_url\.json|RECORD),")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize_name(name: str) -> str:
    # The one rule, imported late: a worker runs this file as a script, without the bundle on its path.
    from orchestrator.agent.venvfingerprint import normalize_name as rule

    return rule(name)


def python_key() -> str:
    """The interpreter a verification holds for: implementation, exact version, platform, base binary."""
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return f"{sys.implementation.name}-{platform.python_version()}-{sys.platform}-{platform.machine()}-{base}"


def _files_digest(dist) -> str | None:
    text = dist.read_text("RECORD")
    if not text:
        return None
    lines = sorted(ln for ln in text.splitlines() if ln.strip() and not _VOLATILE.search(ln))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def requirements(dists) -> tuple[dict, dict[str, list[str]]]:
    """({normalized name: dist}, {name: [installed names it requires]}) of the visible distributions.

    Every installed requirement counts, whatever its marker or extra: a stricter key, never a laxer one.
    """
    by_name = {}
    for d in dists:
        name = normalize_name(d.metadata.get("Name") or "")
        if name and name not in by_name:
            by_name[name] = d
    deps = {}
    for n, d in by_name.items():
        names = {normalize_name(m.group(1)) for r in (d.requires or []) if (m := _REQ_NAME.match(r))}
        deps[n] = sorted(x for x in names if x in by_name and x != n)
    return by_name, deps


def closures(deps: dict[str, list[str]]) -> dict[str, frozenset]:
    """{name: every installed distribution it requires, transitively}."""
    out: dict[str, frozenset] = {}
    for n in deps:
        seen, stack = set(), list(deps[n])
        while stack:
            x = stack.pop()
            if x not in seen:
                seen.add(x)
                stack.extend(deps.get(x, ()))
        out[n] = frozenset(seen - {n})
    return out


def dist_keys(by_name: dict, deps: dict[str, list[str]]) -> dict[str, str]:
    """`{normalized name: key}` for every distribution that has a RECORD (see the module docstring)."""
    own = {n: _files_digest(d) for n, d in by_name.items()}
    keys: dict[str, str] = {}
    py = python_key()

    def key(n: str, stack: frozenset) -> str | None:
        if n in keys:
            return keys[n]
        if own[n] is None:
            return None
        parts = [py, n, by_name[n].version, own[n]]
        for dep in deps[n]:
            if dep in stack:  # a requirement cycle: the member's own files stand for it
                parts.append(f"{dep}:{own[dep]}")
                continue
            k = key(dep, stack | {n})
            if k is None:
                return None
            parts.append(k)
        keys[n] = hashlib.sha256("\0".join(parts).encode()).hexdigest()
        return keys[n]

    for n in by_name:
        key(n, frozenset())
    return {n: k for n, k in keys.items() if k}


def load_record(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != RECORD_VERSION or not isinstance(data.get("verified"), dict):
        return {}
    return data["verified"]


def save_record(path: Path, verified: dict, added: dict[str, dict]) -> None:
    """Add `added` ({key: {dist, version, ...}}) to the record, atomically; the oldest entries go past MAX."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    merged = dict(verified)
    for k, v in added.items():
        merged[k] = {**v, "at": now}
    if len(merged) > MAX_ENTRIES:
        merged = dict(sorted(merged.items(), key=lambda kv: kv[1].get("at", ""))[-MAX_ENTRIES:])
    from orchestrator.agent import atomic  # here, not at the top: a worker (this file run by path) never writes

    atomic.write_bytes(path, (json.dumps({"version": RECORD_VERSION, "verified": merged}, sort_keys=True) + "\n").encode())


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


# ------------------------------------------------------------------------------------------ workers


def _torch_info() -> dict:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    info = {"torch": str(torch.__version__), "cuda": torch.version.cuda, "device_count": None}
    try:
        info["device_count"] = int(torch.cuda.device_count()) if torch.version.cuda else 0
    except Exception:  # noqa: BLE001 - a broken driver is reported elsewhere, not fatal here
        pass
    return info


def import_one(module: str) -> str | None:
    """Import `module`; None on success, else `ExcType: message` (last line of the error)."""
    import importlib

    try:
        importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - a module may raise anything, even SystemExit
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[-1] if text else ''}"[:400]
    return None


def worker(path: list[str]) -> int:
    """Import the module named on each stdin line; answer one JSON line each on stdout."""
    sys.path[:] = path
    out = sys.stdout
    sys.stdout = sys.stderr  # what an imported module prints must not corrupt the answers
    for line in sys.stdin:
        module = line.strip()
        if not module:
            continue
        err = import_one(module)
        ans = {"module": module, "error": err, "loaded": sorted({n.partition(".")[0] for n in list(sys.modules)})}
        if module == "torch" and err is None:
            ans["torch_info"] = _torch_info()
        out.write(json.dumps(ans) + "\n")
        out.flush()
    return 0


class _Worker:
    def __init__(self):
        # This file as a script, by the same interpreter, with the verifier's sys.path (no -m: -I ignores
        # PYTHONPATH, and a worker needs nothing but the standard library to start).
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "worker", json.dumps(sys.path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.buf = b""
        self.module: str | None = None
        self.loaded: set[str] = set()
        """Distributions whose modules this interpreter holds (reported after each import)."""

    def give(self, module: str, dist: str) -> None:
        self.module = module
        self.loaded.add(dist)
        self.proc.stdin.write(module.encode() + b"\n")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Scheduler:
    """Hands a free worker the module that makes it import the least of what another worker already holds
    (a module needing torch goes to the worker that has torch; sympy, which needs no torch, goes elsewhere):
    parallel where imports are independent, never the same heavy import twice when it can be avoided."""

    def __init__(self, modules: list[str], module_dist: dict[str, str], needs: dict[str, frozenset]):
        self.todo = list(modules)
        self.dist = module_dist
        self.needs = needs

    def pick(self, w: _Worker, workers: list[_Worker]) -> str | None:
        """The module for free worker `w`, or None to leave it idle while others are busy."""
        if not self.todo:
            return None
        others = set().union(*(o.loaded for o in workers if o is not w)) - w.loaded
        best, cost = None, None
        for m in self.todo:
            d = self.dist[m]
            c = len(({d} | self.needs.get(d, frozenset())) & others)
            if cost is None or c < cost:
                best, cost = m, c
                if c == 0:
                    break
        if cost and any(o.module is not None for o in workers if o is not w):
            return None  # a busy worker holds what it needs: it will take it when it is free
        self.todo.remove(best)
        return best


def import_all(modules: list[str], module_dist: dict[str, str], needs: dict[str, frozenset], jobs: int,
               on_result) -> None:
    """Import each module in one of `jobs` workers; `on_result(module, error, torch_info)` per module, in
    the order they finish. A worker that dies reports its module as failed and is replaced."""
    sched = _Scheduler(modules, module_dist, needs)
    sel = selectors.DefaultSelector()
    workers: list[_Worker] = []
    name_dist = {m: d for m, d in module_dist.items()}

    def feed() -> None:
        for w in workers:
            if w.module is None and (m := sched.pick(w, workers)) is not None:
                w.give(m, module_dist[m])

    try:
        for _ in range(min(jobs, len(modules))):
            w = _Worker()
            workers.append(w)
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        feed()
        while any(w.module is not None for w in workers):
            for sk, _ in sel.select():
                w = sk.data
                chunk = os.read(sk.fileobj.fileno(), 65536)
                if not chunk:  # the interpreter died while importing w.module
                    sel.unregister(sk.fileobj)
                    workers.remove(w)
                    code = w.proc.wait()
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    on_result(w.module, f"the interpreter died ({how}) while importing it", None)
                    if sched.todo:
                        fresh = _Worker()
                        workers.append(fresh)
                        sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)
                    continue
                w.buf += chunk
                *lines, w.buf = w.buf.split(b"\n")
                for raw in lines:
                    ans = json.loads(raw)
                    w.module = None
                    w.loaded |= {name_dist[n] for n in ans.get("loaded", ()) if n in name_dist}
                    on_result(ans["module"], ans.get("error"), ans.get("torch_info"))
            feed()
    finally:
        for w in workers:
            w.close()
        sel.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(worker(json.loads(sys.argv[2])))
    print("usage: python -I importcheck.py worker SYS_PATH_JSON", file=sys.stderr)
    sys.exit(2)
