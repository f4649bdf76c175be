"""The Proxmox host of one container, as `doctor` asks it and as the fixes it prints name it: the host-side pct
verbs (`pct status`, `pct config`, `pct start`...) run through the host's transport, and each as the line a
user pastes on the workstation (`ssh ... pct start 200`). PctTransport only runs commands inside the container;
this is everything around it."""

from __future__ import annotations

import re
from collections.abc import Sequence

from orchestrator.errors import PctError
from orchestrator.quoting import render
from orchestrator.transport.base import Result, Transport
from orchestrator.transport.pct import check_ctid, classify, pct_argv, pct_prefix


class PveHost:
    """Container `ctid`'s host, reached through `parent` (SSHTransport, or LocalTransport on the host itself).

    Args:
        parent: the transport that reaches the Proxmox host.
        ctid: the container's VMID.
        pct: the pct program on the host ("pct", or a full path).
        sudo: prefix pct with `sudo -n`.
    """

    def __init__(self, parent: Transport, ctid: int, *, pct: str = "pct", sudo: bool = False):
        self.parent = parent
        self.ctid = check_ctid(ctid)
        self.pct = pct
        self.sudo = sudo
        self.label = getattr(parent, "label", None) or parent.name

    # ---- the host-side verbs

    def pct_command(self, verb: str, *args: str, timeout: float | None = 120) -> Result:
        """Run `pct VERB CTID args...` on the host (status/start/stop/config/set).

        Raises:
            The typed PctError when classified; PctError for any other failure of pct.
        """
        res = self.parent.run(pct_argv(self.ctid, verb, *args, pct=self.pct, sudo=self.sudo), timeout=timeout)
        res.where = self.parent.name
        err = classify(res, self.ctid, self.label, self.pct, self.sudo, self.parent.command_line)
        if err is not None:
            raise err
        if res.exit_code != 0:
            # pct's own words (its exit code is a Perl die's 255 whatever went wrong)
            said = (res.stderr or res.stderr_tail).decode("utf-8", errors="replace").strip()
            said = "; ".join(line.strip() for line in said.splitlines()[-3:] if line.strip())
            raise PctError(f"`{self.pct} {verb} {self.ctid}` failed on {self.label}: {said or 'no message'} "
                           f"(exit {res.exit_code})", result=res)
        return res

    def status(self) -> str:
        """`running`, `stopped` (or whatever pct reports) from `pct status CTID`.

        Raises:
            ConnectError / HostKeyError: the host cannot be reached; ContainerMissing and the other PctErrors.
        """
        text = self.pct_command("status").stdout.decode("utf-8", errors="replace")
        m = re.search(r"(?m)^status:\s*(\S+)", text)
        if not m:
            raise PctError(f"unexpected `pct status {self.ctid}` output on {self.label}: {text.strip()[:200]!r}")
        return m.group(1)

    def config_text(self) -> str:
        """The text of `pct config CTID` (readable while the container is stopped too).

        Raises:
            PctError: pct failed.
        """
        return self.pct_command("config").stdout.decode("utf-8", errors="replace")

    def config(self) -> dict[str, str]:
        """`pct config CTID` as a dict (raw `lxc.*` keys keep their last value)."""
        out = {}
        for line in self.config_text().splitlines():
            key, sep, value = line.partition(":")
            if sep:
                out[key.strip()] = value.strip()
        return out

    # ---- the same, as a fix prints them

    def line(self, verb: str, *args: str) -> str:
        """`pct VERB CTID args` on the host as the user pastes it (`ssh ... pct ...`)."""
        return self.parent.command_line(pct_argv(self.ctid, verb, *args, pct=self.pct, sudo=self.sudo))

    def words(self, verb: str) -> str:
        """`pct VERB CTID` as it runs on the host (no ssh): what a check reports as answered."""
        return render(pct_argv(self.ctid, verb, pct=self.pct, sudo=self.sudo))

    def list_line(self) -> str:
        """`pct list` on the host as the user pastes it (it lists the containers)."""
        return self.parent.command_line([*pct_prefix(self.pct, self.sudo), "list"])

    def host_line(self, argv: Sequence[str]) -> str:
        """A host argv as the user pastes it: ssh with the inventory's settings."""
        return self.parent.command_line(argv)
