"""The bundled DFlash drafter trainer. Knows nothing of SSH, Proxmox or the orchestrator."""
