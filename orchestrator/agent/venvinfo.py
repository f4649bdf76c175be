"""The post-build verification of a venv (standard library only), run by the rebuild script with the NEW
venv's interpreter (`python -I -m orchestrator.agent.venvinfo verify ...`, the bundle is installed in it):
import every top-level module of every installed distribution not verified before (orchestrator.agent.
importcheck, with the verified-wheels record), check that every third-party module the container-side bundle
code imports is installed (orchestrator.agent.bundlescan), then write `dflashctl-fingerprint.json`
(orchestrator.agent.venvfingerprint) and the one-line stamp the script's no-op check reads.
`python -m orchestrator.agent.venvinfo requirements` prints what the bundle imports.
Events go to stdout as JSON lines, in the agent protocol's shape.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator.agent import atomic
from orchestrator.agent.bundlescan import bundle_requirements, missing_modules, top_level_modules
from orchestrator.agent.venvfingerprint import FINGERPRINT, build_fingerprint, normalize_name

# One line, `<lock_hash> <bundle_hash> <python_request>`: what rebuild_venv.sh compares for its no-op path
# (bash reads it without starting a Python). Written last: a venv without it is incomplete.
STAMP = "dflashctl-stamp"
BUNDLE_DIST = "dflashctl-bundle"
EXIT_VERIFY_FAILED = 3


def driver_version() -> str | None:
    """The NVIDIA driver version: the loaded kernel module's, else nvidia-smi's (None without a driver)."""
    from orchestrator.agent import driver

    return driver.kernel_module() or driver.probe(timeout=20).driver


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
        scan = pool.submit(missing_modules)
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
                           freeze_file=Path(a.freeze) if a.freeze else None, torch_info=res, driver=driver_version(),
                           uv_version=a.uv_version)
    # One line: the rebuild script embeds it verbatim in its no-op and rollback results.
    atomic.write_bytes(venv / FINGERPRINT, (json.dumps(fp, sort_keys=True, separators=(",", ":")) + "\n").encode())
    _Out.event("fingerprint", data=fp)
    return 0


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
