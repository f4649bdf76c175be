"""The agent: runs INSIDE the target as `python -m orchestrator.agent VERB`.

Protocol: one JSON object (the request) on stdin; newline-delimited JSON events on stdout:
  {"event": "progress", "step": "...", "message": "...", ...}
  run, data, metrics, truncated, heartbeat      (the tail verb's stream; orchestrator.agent.events)
  {"event": "result", "data": {...}}              exactly one, last, on success (exit 0)
  {"event": "error", "type": "...", "message": "...", "fix": "..."}   last, on failure (exit 1)
Standard library only at import time (it runs with the container's bare python3 before a venv exists);
a verb may import torch lazily when it needs it (tmux is driven through its CLI: agent/tmuxctl.py).
"""
