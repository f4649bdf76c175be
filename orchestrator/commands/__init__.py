"""CLI verbs: one module per verb, each exposing `register(app)`. Thin: parse flags, one call into
orchestrator.ops, render the result (orchestrator.render). Heavy imports stay inside the functions."""
