"""What a run's metrics records say beyond the charts, shared by `metrics` and `status` (one rule, two verbs):
the target/drafter balance (orchestrator.balance, from the trainer's `facts` record and its training records)
and the export judged in vLLM (`eval_vllm` records) beside the project's τ; and the one agent call that reads
those records."""

from __future__ import annotations

from orchestrator.agent.requests import MetricsAnswer, MetricsRequest
from orchestrator.errors import AgentError, RunNotFound


def fetch_rows(target, run_id: str | None = None, *, experiment: str | None = None,
               max_rows: int = 2000) -> MetricsAnswer:
    """runs/<run_id>/metrics.jsonl (or the newest run of `experiment`) in the target, downsampled, in ONE agent
    call.

    Raises:
        RunNotFound: no such run in the target.
    """
    try:
        return target.agent("metrics", MetricsRequest(run_id=run_id, experiment=experiment, max_rows=max_rows).to_json(),
                            answer=MetricsAnswer)
    except AgentError as exc:
        if exc.agent_type == "RunNotFound":
            raise RunNotFound(exc.message, fix=exc.fix) from None
        raise


def _number(v) -> float | None:
    return None if isinstance(v, bool) or not isinstance(v, (int, float)) else float(v)


def balance_notes(rows: list[dict]) -> list[str]:
    """Which side of a split layout waits and the split the measured rates suggest, with the arithmetic (a
    colocated run: the share of a step spent on features); empty before a training record with both rates."""
    from orchestrator.balance import from_records

    facts = next((r for r in rows if r.get("kind") == "facts"), {})
    bal = from_records(rows, int(facts.get("target_ranks") or 0), int(facts.get("drafter_ranks") or 0))
    return [] if bal is None else bal.lines()


def vllm_notes(rows: list[dict]) -> list[str]:
    """One line per `eval_vllm` record: vLLM's τ both ways beside the project's (and the end-of-training
    evaluation's τ when the run has one), lossless, tokens/s and the speedup, the prompts beyond the tolerance."""
    after = next((r for r in reversed(rows) if r.get("kind") == "eval" and r.get("when") == "after"), None)
    notes = []
    for rec in (r for r in rows if r.get("kind") == "eval_vllm"):
        nums = {k: _number(rec.get(k)) for k in ("tau_own", "tau_vllm", "tau_vllm_pooled", "tokens_per_s_plain",
                                                  "tokens_per_s_spec", "speedup")}
        if None in nums.values():
            continue
        own = f"the project's {nums['tau_own']:.3f}"
        if after is not None and _number(after.get("tau")) is not None:
            own += f" (end-of-training τ {after['tau']:.3f})"
        line = (f"vLLM: τ {nums['tau_vllm']:.3f} per-prompt mean ({nums['tau_vllm_pooled']:.3f} pooled) against "
                f"{own}; lossless {'yes' if rec.get('lossless') else 'NO'}; {nums['tokens_per_s_plain']:.1f} -> "
                f"{nums['tokens_per_s_spec']:.1f} tokens/s ({nums['speedup']:.2f}x)")
        if rec.get("disagreeing"):
            line += f"; prompts {rec['disagreeing']} beyond the tolerance {rec.get('tolerance')}"
        notes.append(line)
    return notes


def run_notes(rows: list[dict]) -> list[str]:
    """Every note of a run's records: the balance, then vLLM's verdicts."""
    return balance_notes(rows) + vllm_notes(rows)
