"""dflashctl: train DFlash drafters on Proxmox GPU containers from the workstation."""

__version__ = "0.1.0"
