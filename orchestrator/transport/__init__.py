"""How bytes reach a process: local subprocess, SSH channel, and the pct wrapper."""
