"""One agent call whose refusals are the user's situation, not a bug: shared by `launch` and `warmup`, which
refuse the same preflight failures the same way."""

from __future__ import annotations

from orchestrator.errors import AgentError, PreflightError
from orchestrator.ops.tmuxfix import launch_tmux_fix


def agent_or_refuse(target, verb: str, request: dict, refusals: set[str], what: str, *, on_event=None,
                    timeout: float | None = None, answer: type | None = None):
    """One agent call (returning its typed `answer`); an error event whose type is in `refusals` becomes a
    PreflightError ("<what> refused: ...") carrying the agent's type and data, anything else propagates as the
    AgentError it is."""
    try:
        return target.agent(verb, request, on_event=on_event, timeout=timeout, answer=answer)
    except AgentError as exc:
        if exc.agent_type == "TmuxMissing":  # the agent cannot know how the user reaches its container
            exc.fix = launch_tmux_fix(target)
            if exc.fix.startswith("dflashctl rebuild-venv"):
                exc.message += (" (rebuild-venv installs it: with apt-get there, or with Debian's packages brought "
                                "from this workstation when the container cannot reach a mirror)")
        if exc.agent_type in refusals:
            err = PreflightError(f"{what} refused: {exc.message}", fix=exc.fix)
            err.agent_type, err.data = exc.agent_type, exc.data  # type: ignore[attr-defined]
            raise err from None
        raise
