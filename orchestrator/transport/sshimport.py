"""Loading the SSH stack (paramiko, host keys, ssh_config) only when a command reaches a host, and loading less
of it: paramiko's import of invoke is deferred until an ssh_config `Match exec` line needs it."""

from __future__ import annotations


def import_ssh_stack() -> None:
    """Import what opening a connection needs (paramiko, host keys), e.g. on a thread started early.
    Imported here, not with this module: a command that reaches no host never pays for them."""
    import logging

    # paramiko logs handshake failures at ERROR; without a handler Python prints them on stderr next to
    # our own readable message. The exception carries the same text.
    logging.getLogger("paramiko").addHandler(logging.NullHandler())
    defer_import("invoke")
    from orchestrator.transport import hostkeys, sshconn  # noqa: F401 - paramiko with them


def defer_import(name: str) -> None:
    """Make `import NAME` cheap until the module is used: paramiko's config imports invoke (with
    unittest.mock and asyncio, about 40% of paramiko's import time) only to run an ssh_config `Match exec`
    line. NAME is registered as a stand-in module that imports the real one on its first attribute access
    and hands that on, so a `Match exec` still works. (importlib's LazyLoader cannot do this before Python
    3.12: `import NAME` itself reads the module's __spec__, which loads it.) A module already imported, or
    not installed, is left as it is. A dunder name (`__file__`, `__path__`) is not a use: pydantic's docstring
    reader walks sys.modules through inspect.getmodule, which asks every module for its `__file__`."""
    import importlib
    import importlib.util
    import sys
    import types

    if name in sys.modules or importlib.util.find_spec(name) is None:
        return  # not installed: paramiko's own `import` meets the ImportError it expects

    class Deferred(types.ModuleType):
        def __getattr__(self, attr: str):
            if attr.startswith("__"):  # a scan of sys.modules (inspect.getmodule asks each for __file__) is no use
                raise AttributeError(attr)
            if sys.modules.get(name) is self:
                del sys.modules[name]
            return getattr(importlib.import_module(name), attr)

    stand_in = Deferred(name)
    stand_in.__spec__ = None  # what the import system reads of a module it finds in sys.modules
    sys.modules[name] = stand_in
