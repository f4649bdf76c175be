"""Venv fingerprints and the post-build verification of a venv. Standard library only.

Two uses:
- in the agent (launch preflight, the `fingerprint` verb): `current_fingerprint(workdir, profile)` reads the
  fingerprint of `<workdir>/venvs/current` (uv profiles) or computes one from the running interpreter
  (`workstation` profile); `fingerprint_diff(actual, expected_lock_hash)` says in words what does not match.
- in the rebuild script, run by the NEW venv's interpreter (`python -I -m orchestrator.agent.venvinfo
  verify ...`, the bundle is installed in it): import every top-level module of every installed
  distribution, check that every third-party module the container-side bundle code imports is installed,
  then write `dflashctl-fingerprint.json` and the one-line stamp the script's no-op check reads.
Events go to stdout as JSON lines, in the agent protocol's shape.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import sys
from pathlib import Path

from orchestrator.agent.venvfingerprint import (  # noqa: F401 - the fingerprint API, read here by its callers
    FINGERPRINT,
    now_utc as _now,
    current_fingerprint,
    installed_packages,
    normalize_name,
    profile_kind,
    system_fingerprint,
    workstation_fingerprint,
)

# One line, `<lock_hash> <bundle_hash> <python_request>`: what rebuild_venv.sh compares for its no-op path
# (bash reads it without starting a Python). Written last: a venv without it is incomplete.
STAMP = "dflashctl-stamp"
BUNDLE_DIST = "dflashctl-bundle"
BUNDLE_PACKAGES = ("orchestrator", "trainer")
# The bundle code that runs inside the target; everything it reaches through imports must be installed.
# (The rest of `orchestrator` is the workstation CLI: typer, paramiko... are not in the target's lock.)
CONTAINER_ROOTS = ("orchestrator.agent", "trainer")
# Imported by the bundle only where it is asked for, in a venv that holds it: vLLM (the data stage's engine in
# its own venv, the data_venv; `python -m trainer eval --engine vllm`). A training venv's lock need not have it.
ON_REQUEST = ("vllm",)
EXIT_VERIFY_FAILED = 3


# ------------------------------------------------------------------------------------ what is installed


def top_level_modules(dist) -> list[str]:
    """The importable top-level names a distribution installs: `top_level.txt`, else derived from RECORD.

    RECORD paths like `yaml/__init__.py`, `typing_extensions.py` or `_cffi.cpython-311-x86_64-linux-gnu.so`
    give `yaml`, `typing_extensions`, `_cffi`; metadata dirs, `.pth` files and files outside
    site-packages (scripts in bin/) are not modules.
    """
    text = dist.read_text("top_level.txt")
    if text:
        names = {n.strip().replace("/", ".") for n in text.splitlines() if n.strip()}
        return sorted(n for n in names if all(p.isidentifier() for p in n.split(".")))
    names: set[str] = set()
    for f in dist.files or ():
        parts = f.parts
        if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".data", ".egg-info")):
            continue
        if parts[0] == "__pycache__":
            continue
        if len(parts) > 1:
            names.add(parts[0])
        elif parts[0].endswith(".py"):
            names.add(parts[0][:-3])
        elif parts[0].endswith(".so"):
            names.add(parts[0].split(".", 1)[0])
    return sorted(n for n in names if n.isidentifier())


def driver_version() -> str | None:
    """The NVIDIA driver version: the loaded kernel module's, else nvidia-smi's (None without a driver)."""
    from orchestrator.agent import driver

    return driver.kernel_module() or driver.probe(timeout=20).driver


# ------------------------------------------------------------------------------ bundle import scanning


def _optional_import(node: ast.AST, parents: dict) -> bool:
    """True when the import sits in a `try:` that catches ImportError (or broader), or under TYPE_CHECKING."""
    child, cur = node, parents.get(node)
    while cur is not None:
        if isinstance(cur, ast.Try) and child in cur.body:
            for h in cur.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if h.type is None or any(
                    isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
                    for n in names
                ):
                    return True
        if isinstance(cur, ast.If) and child in cur.body and "TYPE_CHECKING" in ast.unparse(cur.test):
            return True
        child, cur = cur, parents.get(cur)
    return False


def _module_files(module: str, search: list[str], whole: bool = False) -> list[tuple[str, Path, Path]]:
    """(dotted name, file, search base) of a bundle module; with `whole`, of every module of a package
    (agent verbs are imported by name at run time, so a root package counts as a whole)."""
    rel = Path(*module.split("."))
    for base in map(Path, search):
        pkg = base / rel
        if (pkg / "__init__.py").is_file() and not whole:
            return [(module, pkg / "__init__.py", base)]
        if (pkg / "__init__.py").is_file():
            out = []
            for path in sorted(pkg.rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                parts = path.relative_to(base).with_suffix("").parts
                out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path, base))
            return out
        single = base / rel.with_suffix(".py")
        if single.is_file():
            return [(module, single, base)]
    return []


def _imports(tree: ast.AST, name: str, is_pkg: bool) -> list[tuple[str, list[str], ast.AST]]:
    """(module, [candidate submodules], node) for every import statement in a module's tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                module = ".".join(pkg + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((module, [f"{module}.{a.name}" for a in node.names], node))
    return out


def bundle_requirements(roots=CONTAINER_ROOTS, search: list[str] | None = None) -> dict[str, list[str]]:
    """Third-party top-level modules the container-side bundle code imports, with where (`file:line`).

    Starts from `roots` and follows imports into other bundle modules, so `orchestrator.signatures`
    counts when an agent verb imports it and `orchestrator.cli` does not. Imports guarded by
    `try/except ImportError` and `if TYPE_CHECKING:` are optional and not listed; lazy imports inside
    functions are listed (they run in the container too).
    """
    search = search or [p for p in sys.path if p and os.path.isdir(p)]
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    todo = [(r, True) for r in roots]
    seen_modules: set[tuple[str, bool]] = set()
    seen_files: set[Path] = set()
    needed: dict[str, list[str]] = {}
    while todo:
        mod, whole = todo.pop()
        if (mod, whole) in seen_modules:
            continue
        seen_modules.add((mod, whole))
        for name, path, base in _module_files(mod, search, whole):
            if path in seen_files:
                continue
            seen_files.add(path)
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            except (OSError, SyntaxError, ValueError):
                continue
            parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
            for module, subs, node in _imports(tree, name, path.name == "__init__.py"):
                top = module.split(".")[0]
                if not top or top in stdlib or top in ON_REQUEST or _optional_import(node, parents):
                    continue
                if top in BUNDLE_PACKAGES:
                    # `from orchestrator.agent import gpu` imports the submodule `gpu`: follow both.
                    todo.extend((m, False) for m in (module, *subs) if _module_files(m, search))
                else:
                    needed.setdefault(top, []).append(f"{path.relative_to(base).as_posix()}:{node.lineno}")
    return dict(sorted(needed.items()))


# ------------------------------------------------------------------------------------------- verify


class _Out:
    """JSON lines on stdout, in the agent protocol's shape."""

    @staticmethod
    def event(kind: str, **fields) -> None:
        sys.stdout.write(json.dumps({"event": kind, **fields}, default=str) + "\n")
        sys.stdout.flush()


def verify(out=_Out, skip: tuple[str, ...] = (), record: Path | None = None, jobs: int | None = None) -> dict:
    """Import every top-level module of every installed distribution not verified before (in parallel
    worker processes; see importcheck), then check the bundle's imports; on success, add what was imported
    to the verified-wheels `record`.

    Returns:
        {"modules": n imported, "skipped": [dists verified before], "failed": [{module, dist, error}],
         "missing": {module: [where...]}, "torch": version|None, "cuda": version|None, "device_count": int|None}
    """
    from importlib import metadata

    from orchestrator.agent import importcheck

    by_name, deps = importcheck.requirements(metadata.distributions())
    dists = list(by_name.values())
    keys = importcheck.dist_keys(by_name, deps)
    verified = importcheck.load_record(record)
    plan: dict[str, str] = {}
    todo: dict[str, dict] = {}
    skipped: list[str] = []
    for dist in dists:
        dname = normalize_name(dist.metadata.get("Name") or "?")
        key = keys.get(dname)
        if dname != BUNDLE_DIST and key in verified:
            skipped.append(dname)
            continue
        if key and dname != BUNDLE_DIST:
            todo[key] = {"dist": dname, "version": dist.version}
        for mod in top_level_modules(dist):
            if mod not in skip:
                plan.setdefault(mod, dname)
    # torch first: most of the others import it anyway, and its failure is the one that matters most.
    order = sorted(plan, key=lambda m: (m != "torch", plan[m] == BUNDLE_DIST, m))
    failed: list[dict] = []
    info = _skipped_torch_info(verified, keys)
    done = 0

    def on_result(mod: str, err: str | None, torch_info: dict | None) -> None:
        nonlocal done
        done += 1
        out.event("progress", step="verify", message=f"import {mod}", module=mod, dist=plan[mod], i=done, n=len(order))
        if err:
            failed.append({"module": mod, "dist": plan[mod], "error": err})
        if torch_info:
            info.update(torch_info)

    # The bundle scan (parsing its sources) runs while the workers import.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        scan = pool.submit(_missing_bundle_modules)
        importcheck.import_all(order, plan, importcheck.closures(deps), jobs or importcheck.default_jobs(), on_result)
        missing = scan.result()
    if record is not None and not failed and not missing:
        if info.get("torch") and keys.get("torch") in todo:
            todo[keys["torch"]].update(torch=info["torch"], cuda=info.get("cuda"))
        importcheck.save_record(record, verified, todo)
    return {"modules": len(order), "skipped": sorted(skipped), "failed": failed, "missing": missing,
            "torch": info.get("torch"), "cuda": info.get("cuda"), "device_count": info.get("device_count")}


def _skipped_torch_info(verified: dict, keys: dict[str, str]) -> dict:
    """torch's version and CUDA build from the record when torch is not imported again (a property of the
    wheel); the GPU count is the machine's, so it stays unknown until torch is imported."""
    entry = verified.get(keys.get("torch") or "") or {}
    return {"torch": entry.get("torch"), "cuda": entry.get("cuda"), "device_count": None}


def _missing_bundle_modules() -> dict[str, list[str]]:
    import importlib.util

    missing = {}
    for mod, where in bundle_requirements().items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing[mod] = where[:5]
    return missing


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_fingerprint(venv: Path, *, lock_hash: str | None, bundle_hash: str | None, python_request: str | None,
                      freeze_file: Path | None, torch_info: dict, uv_version: str | None = None) -> dict:
    """The fingerprint of the running interpreter's environment (see contracts: venv layout)."""
    freeze = []
    if freeze_file and freeze_file.is_file():
        freeze = [ln.strip() for ln in freeze_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return {
        "kind": "uv",
        "venv": venv.name,
        "lock_hash": lock_hash,
        "bundle_hash": bundle_hash,
        "python": platform.python_version(),
        "python_request": python_request,
        "executable": sys.executable,
        "platform": f"{sys.platform}-{platform.machine()}",
        "packages": installed_packages(),
        "freeze": freeze,
        "torch": torch_info.get("torch"),
        "cuda": torch_info.get("cuda"),
        "device_count": torch_info.get("device_count"),
        "driver": driver_version(),
        "uv": uv_version,
        "created": _now(),
    }


def _main_verify(args: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m orchestrator.agent.venvinfo verify")
    p.add_argument("--venv", required=True)
    p.add_argument("--lock-hash", required=True)
    p.add_argument("--bundle-hash", required=True)
    p.add_argument("--python-request", required=True)
    p.add_argument("--freeze")
    p.add_argument("--uv-version")
    p.add_argument("--record", help="the verified-wheels record of this workdir (read, and extended on success)")
    p.add_argument("--jobs", type=int, default=None, help="import worker processes (default: CPUs, at most 8)")
    a = p.parse_args(args)
    venv = Path(a.venv)
    res = verify(record=Path(a.record) if a.record else None, jobs=a.jobs)
    if res["failed"]:
        first = res["failed"][0]
        more = f" (and {len(res['failed']) - 1} more)" if len(res["failed"]) > 1 else ""
        _Out.event("error", type="ImportFailed", step="verify",
                   message=f"module {first['module']!r} (from {first['dist']}) does not import in the new venv: "
                   f"{first['error']}{more}",
                   fix="fix the lock (a missing dependency or a wheel for another platform) and run `dflashctl lock`",
                   data={"failed": res["failed"]})
        return EXIT_VERIFY_FAILED
    if res["missing"]:
        names = ", ".join(f"{m} ({w[0]})" for m, w in res["missing"].items())
        _Out.event("error", type="LockMissesModule", step="verify",
                   message=f"the lock lacks modules the bundle imports: {names}",
                   fix="add the distributions that provide them to the lock's .in file and run `dflashctl lock PROFILE`",
                   data={"missing": res["missing"]})
        return EXIT_VERIFY_FAILED
    again = f" ({len(res['skipped'])} distributions verified before, not imported again)" if res["skipped"] else ""
    _Out.event("progress", step="verify", message=f"{res['modules']} modules import{again}; torch {res['torch']}, "
               f"CUDA {res['cuda']}, {res['device_count']} GPU(s)", torch=res["torch"], cuda=res["cuda"],
               device_count=res["device_count"], skipped=res["skipped"])
    fp = build_fingerprint(venv, lock_hash=a.lock_hash, bundle_hash=a.bundle_hash, python_request=a.python_request,
                           freeze_file=Path(a.freeze) if a.freeze else None, torch_info=res, uv_version=a.uv_version)
    # One line: the rebuild script embeds it verbatim in its no-op and rollback results.
    _write_atomic(venv / FINGERPRINT, json.dumps(fp, sort_keys=True, separators=(",", ":")) + "\n")
    _Out.event("fingerprint", data=fp)
    return 0


# ------------------------------------------------------------------------------------ fingerprint API


def fingerprint_diff(actual: dict, expected_lock_hash: str | None, profile: dict | None = None) -> list[str]:
    """Human lines saying why `actual` does not match the expected lock; empty = match.

    A workstation profile (expected_lock_hash None) matches any fingerprint without an error. `profile` (the
    venv profile asked for, with its `name` and `lock`) is named in the text: the current venv may be another
    profile's (one target, one `current`), or its profile's lock may have changed since; both read true.
    """
    if actual.get("error"):
        return [actual["error"]]
    if expected_lock_hash is None:
        return []
    got = actual.get("lock_hash")
    if got != expected_lock_hash:
        profile = profile or {}
        wanted = (f"venv profile {profile['name']!r}" if profile.get("name") else "the venv profile") + (
            f" (lock {profile['lock']})" if profile.get("lock") else "")
        return [f"the current venv {actual.get('venv')} was built from lock {got}; {wanted} needs lock "
                f"{expected_lock_hash} (run `dflashctl rebuild-venv`)"]
    return []


def diff_fingerprints(old: dict, new: dict) -> list[str]:
    """What changed between two fingerprints, one line each (python, torch, CUDA, driver, packages)."""
    lines = []
    for key in ("python", "torch", "cuda", "driver", "lock_hash", "bundle_hash"):
        if old.get(key) != new.get(key):
            lines.append(f"{key}: {old.get(key)} -> {new.get(key)}")
    a, b = old.get("packages") or {}, new.get("packages") or {}
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            lines.append(f"{name}: {a.get(name, '(absent)')} -> {b.get(name, '(absent)')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:
        return _main_verify(argv[1:])
    if argv[:1] == ["requirements"]:
        print(json.dumps(bundle_requirements(), indent=1))
        return 0
    print("usage: python -m orchestrator.agent.venvinfo verify|requirements ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
