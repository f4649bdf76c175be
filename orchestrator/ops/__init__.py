"""Operations: one module per verb. Plain functions over a Target and typed inventory models that return
data and raise typed errors (orchestrator.errors). No printing, no typer, no rich here."""
