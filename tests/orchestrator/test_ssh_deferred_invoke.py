"""The SSH stack defers paramiko's import of invoke (transport.sshimport.defer_import): the import no longer
loads it, and an ssh_config `Match exec` line, the one thing paramiko uses invoke for, still runs its
command. In a fresh interpreter: pytest's own process may have imported invoke already."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import io, sys
    from orchestrator.transport.sshimport import import_ssh_stack

    import_ssh_stack()
    print("loaded", "invoke.collection" in sys.modules)
    import paramiko

    config = paramiko.SSHConfig()
    config.parse(io.StringIO(
        'Match host pve exec "true"\\n  HostName matched.example\\n'
        'Match host other exec "false"\\n  HostName wrong.example\\n'
    ))
    print("pve", config.lookup("pve").get("hostname"))
    print("other", config.lookup("other").get("hostname"))
    """
)


def test_invoke_is_deferred_and_match_exec_still_runs():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["loaded False", "pve matched.example", "other other"]


def test_an_imported_invoke_is_left_as_it_is():
    code = ("import sys, invoke; from orchestrator.transport.sshimport import defer_import; real = sys.modules['invoke']; "
            "defer_import('invoke'); print(sys.modules['invoke'] is real)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "True", res.stderr


def test_a_scan_of_every_module_does_not_load_it():
    """pydantic reads the inventory models' attribute docstrings through inspect.getmodule, which asks every
    module in sys.modules for its __file__: that must not load invoke (half of paramiko's import, on the
    command's main thread)."""
    code = ("import sys; from orchestrator.transport.sshimport import import_ssh_stack; import_ssh_stack(); "
            "import inspect, orchestrator.inventory; inspect.getmodule(inspect.currentframe()); "
            "print('invoke.collection' in sys.modules, hasattr(sys.modules['invoke'], '__file__'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "False False", res.stderr
