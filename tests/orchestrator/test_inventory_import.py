"""Importing orchestrator.inventory builds no validator and imports no trainer config (a command that never
validates an inventory does not pay for them); the first validation builds them, trainer sections included."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_import_defers_the_trainer_config_and_the_validators_to_the_first_load():
    code = textwrap.dedent("""
        import sys
        import orchestrator.inventory as inventory
        print("trainer.config" in sys.modules, inventory.Inventory.__pydantic_complete__,
              inventory.HostSpec.__pydantic_complete__)
        inv = inventory.parse_inventory("targets:\\n  here: {kind: local}\\nexperiments:\\n"
                                        "  t: {kind: dflash, target: here, trainer: {seed: 3}}\\n")
        print("trainer.config" in sys.modules, inventory.Inventory.__pydantic_complete__,
              type(inv.experiments["t"].trainer).__name__, inv.experiments["t"].trainer.seed)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["False False False", "True True TrainConfig 3"]


def test_the_models_complete_themselves_when_used_directly():
    """Constructing or validating a model straight away (no parse_inventory first) builds what it needs."""
    code = textwrap.dedent("""
        from orchestrator.inventory_models import DflashExperiment, Inventory
        print(DflashExperiment(kind="dflash", target="here").trainer.seed)
        inv = Inventory.model_validate({"experiments": {"t": {"kind": "dflash", "target": "here",
                                                               "trainer": {"seed": 5}}}})
        print(inv.experiments["t"].trainer.seed)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["0", "5"]
