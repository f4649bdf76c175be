"""The one quoting function. Every remote command line in dflashctl is an argv list until this module
renders it for the single shell that will parse it (the SSH server's login shell on the host).

`pct exec` runs its argv without a shell inside the container (lxc-attach execs it directly), so the
host's shell is the only parser on the whole path: quote exactly once, here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence


def render(argv: Sequence[str]) -> str:
    """Render an argv list as one POSIX shell command line that the shell splits back into `argv`.

    Raises:
        ValueError: as `check_argv`.
    """
    check_argv(argv)
    return shlex.join(argv)


def check_argv(argv: Sequence[str]) -> None:
    """Refuse what no command line can carry, naming the element: every transport calls it (the local one
    too, which never renders), so the refusal reads the same wherever the command was going.

    Raises:
        ValueError: argv is empty, an element is not a str, or an element contains a NUL byte (the kernel's
            argv strings end at NUL, so no shell, ssh or exec can pass one on).
    """
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise ValueError(f"argv elements must be str, got {type(arg).__name__}: {arg!r}")
        if "\x00" in arg:
            raise ValueError(f"argv element {i} contains a NUL byte, which no command line can carry: {arg!r} "
                             "(pass such data on stdin or in a file)")
    if not argv:
        raise ValueError("empty argv")


def render_line(argv: Sequence[str]) -> str:
    """`render`, on ONE line: an argument holding a control character (a newline, a tab, an escape) is
    written in bash's ANSI-C form `$'...'` (`\\n`, `\\t`, `\\xHH`), so bash splits the line back into `argv`
    and a log or a terminal shows it as one line. For lines that are shown (train.log's command line), not
    for the remote shell, which may be a POSIX sh without `$'...'`.

    Raises:
        ValueError: as `render`.
    """
    render(argv)  # the same checks
    return " ".join(_ansi_c(a) if _has_control(a) else shlex.quote(a) for a in argv)


def _has_control(arg: str) -> bool:
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in arg)


_ANSI_C_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _ansi_c(arg: str) -> str:
    out = []
    for c in arg:
        if c in _ANSI_C_ESCAPES:
            out.append(_ANSI_C_ESCAPES[c])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "$'" + "".join(out) + "'"


def with_env(env: Mapping[str, str], argv: Sequence[str], *, clear: bool = True) -> list[str]:
    """Prefix argv with `env [-i] K=V ...` so variables are set inside the command itself.

    `pct exec` resets PATH and (with --keep-env 0) the environment, and sshd often drops
    `AcceptEnv` variables, so the environment travels in argv, never in the channel.
    """
    prefix = ["env", "-i"] if clear else ["env"]
    for key, value in env.items():
        if not key or "=" in key or not (key[0].isalpha() or key[0] == "_") or not all(
            c.isalnum() or c == "_" for c in key
        ):
            raise ValueError(f"bad environment variable name: {key!r}")
        prefix.append(f"{key}={value}")
    return [*prefix, *argv]
