"""One module per agent verb, each exposing `run(request: dict, emit: Emitter) -> dict`."""
