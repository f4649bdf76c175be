"""`python -m trainer train --config FILE` and `python -m trainer tiny [--out DIR]`.

Thin: parse flags, make one call into `trainer.train`, print the outcome. Exit codes: 0 done, 2 bad
config or data (the message says what to fix), 1 anything else (with the traceback).
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description="The bundled DFlash drafter trainer.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (or resume) as a config file says")
    t.add_argument("--config", required=True, help="TrainConfig as JSON or YAML")
    t.add_argument("--output-dir", help="override output_dir from the config")
    y = sub.add_parser("tiny", help="the tiny CPU experiment: random target, local tokenizer, τ before/after")
    y.add_argument("--out", default="runs/tiny", help="run directory (default: runs/tiny)")
    y.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    y.add_argument("--seed", type=int, default=0, help="seed for the drafter, data order and anchors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from trainer.config import ConfigError, load_config
    from trainer.data import DataError
    from trainer.train import TrainError, train

    try:
        if args.command == "train":
            cfg = load_config(args.config)
            if args.output_dir:
                cfg = cfg.model_copy(update={"output_dir": args.output_dir})
        else:
            from trainer.tiny import tiny_train_config

            over = {"seed": args.seed}
            if args.max_steps is not None:
                over["max_steps"] = args.max_steps
            cfg = tiny_train_config(args.out, **over)
        result = train(cfg)
    except (ConfigError, DataError, TrainError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    print(
        f"done: {result.steps} steps; τ before {fmt(result.tau_before)} -> after {fmt(result.tau_after)}; "
        f"export {result.export_dir}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
