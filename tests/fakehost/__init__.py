"""The fake Proxmox VE host used by the tests: real sshd, `pct` and `nvidia-smi` stand-ins."""

from .host import FakeContainer, FakePVE

__all__ = ["FakeContainer", "FakePVE"]
