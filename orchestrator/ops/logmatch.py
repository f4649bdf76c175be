"""Crash signatures for a follow: the matcher over the shipped catalogue plus the inventory's own entries, a
match explained with its signature's texts, and a run killed by a signal named from its exit.json."""

from __future__ import annotations

from typing import Any

from orchestrator.ops.followoutcome import FollowOutcome, FoundMatch, match_dict, signature_id
from orchestrator.sigmatch import Matcher, match_exit
from orchestrator.signatures import load_catalogue


def build_matcher(inv) -> Matcher:
    """The signature matcher over the shipped catalogue plus the inventory's `signatures:`."""
    return Matcher(load_catalogue(inv.signatures or None))


def explain(matcher: Matcher, match: FoundMatch) -> dict[str, Any]:
    """A match as a dict with its signature's title, diagnosis, fix and not_this filled in."""
    out = match_dict(match)
    sig_id = signature_id(match)
    if sig_id in matcher.catalogue.by_id:
        groups = match.get("groups") if isinstance(match, dict) else match.groups
        out.update(matcher.catalogue.get(sig_id).render(groups or {}))
    return out


def exit_match(matcher: Matcher, outcome: FollowOutcome) -> None:
    """A run killed by a signal prints no traceback: name it from exit.json (137 -> host OOM kill)."""
    if outcome.state != "failed" or outcome.crash_matches or not outcome.exit:
        return
    m = match_exit(matcher.catalogue, outcome.exit.get("exit_code"), outcome.exit.get("signal"))
    if m is not None:
        outcome.matches.append(m)
