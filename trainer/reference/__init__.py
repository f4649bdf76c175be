"""Files shipped with exported drafters (copied, never imported by the trainer): `dflash.py`, the
self-contained remote-code module that `AutoModel.from_pretrained(dir, trust_remote_code=True)` loads."""
