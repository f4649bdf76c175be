"""The fake Proxmox VE host used by the tests: real sshd, `pct` and `nvidia-smi` stand-ins."""

from .host import STOCK, STOCK_TMUX, FakeContainer, FakePVE

__all__ = ["STOCK", "STOCK_TMUX", "FakeContainer", "FakePVE"]
