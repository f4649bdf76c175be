"""`python -m trainer train --config FILE`, `python -m trainer tiny [--out DIR]`, `python -m trainer eval ...`,
`python -m trainer regenerate CONFIG [--datasets DIR] [--run-dir DIR]` (the data stage, trainer.regenerate).

Thin: parse flags, make one call into `trainer.loop` (the colocated layout in this process, world size 1;
split layouts run under `python -m trainer.launch`) or `trainer.export_eval`, print the outcome. Exit codes: 0
done, 2 bad config, layout, data or arguments (the message says what to fix), 1 anything else (with the
traceback).
"""

from __future__ import annotations

import argparse
import json
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
    r = sub.add_parser("regenerate", help="the data stage: regenerate the training responses with the target (sharded, resumable)")
    r.add_argument("config", help="TrainConfig as JSON or YAML (its data section chooses the engine)")
    r.add_argument("--datasets", help="datasets root (default: $DFLASH_DATASETS_DIR, else <workdir>/datasets of --run-dir)")
    r.add_argument("--run-dir", help="the run directory: progress records go to its metrics.jsonl")
    e = sub.add_parser(
        "eval", help="τ of an exported drafter against its target: chain and DDTree budgets, greedy and sampled"
    )
    e.add_argument("--export", required=True, help="exported drafter directory (config.json, model.safetensors, dflash.py)")
    e.add_argument("--target", required=True, help="the target's HF model directory (with its tokenizer)")
    e.add_argument("--prompts", action="append", required=True, help="jsonl of held-out conversations; repeatable")
    e.add_argument("--budgets", default="16,32,64,128", help="DDTree node budgets, comma-separated ('' = chain only)")
    e.add_argument("--temperatures", default="0,0.7,1", help="comma-separated; 0 = greedy (default: 0,0.7,1)")
    e.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt (default: 256)")
    e.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    e.add_argument("--seed", type=int, default=0, help="seed of the sampling at T > 0")
    e.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    e.add_argument("--target-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    e.add_argument("--chat-template-kwargs", default="{}", help='JSON, e.g. \'{"enable_thinking": false}\'')
    e.add_argument("--json", dest="json_out", help="also write the full report (per prompt, histograms) here")
    e.add_argument("--engine", default="own", choices=["own", "vllm"],
                   help="own: the project's decode loop (default); vllm: also vLLM's DFlash speculative decoding "
                        "and plain vLLM on the same prompts (greedy; needs vLLM in this interpreter)")
    e.add_argument("--tolerance", type=float, default=None,
                   help="--engine vllm: largest per-prompt |vLLM - project| acceptance length accepted")
    e.add_argument("--reference-export", default=None,
                   help="--engine vllm: the drafter vLLM's numbers must match (default: --export itself; give the "
                        "trainer's own export when vLLM serves a converted copy)")
    e.add_argument("--own-report", default=None,
                   help="--engine vllm: the project's numbers from this evaluation json (a run's eval_after.json, "
                        "the same prompts) instead of running the project's loop again")
    e.add_argument("--metrics", default=None,
                   help="--engine vllm: append the numbers to this metrics.jsonl (a run's, for dflashctl metrics)")
    return p


def _numbers(text: str, kind, flag: str, example: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers, e.g. {flag} {example}") from None


def _eval(args) -> int:
    import torch
    from pydantic import ValidationError

    from trainer.config import EvalConfig
    from trainer.export_eval import evaluate_export

    try:
        kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--chat-template-kwargs is not JSON ({exc}); e.g. '{{\"enable_thinking\": false}}'") from None
    try:
        cfg = EvalConfig(
            budgets=_numbers(args.budgets, int, "--budgets", "16,32,64,128"),
            temperatures=_numbers(args.temperatures, float, "--temperatures", "0,0.7,1"),
            seed=args.seed,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(f"--{err['loc'][0]}: {err['msg'].removeprefix('Value error, ')}") from None
    if args.engine == "vllm":
        return _eval_vllm(args, kwargs)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu":
        from trainer.config import LayoutConfig

        _rank_threads(LayoutConfig().to_layout())  # a CPU rank's threads: decoding a small model is latency-bound
    report = evaluate_export(
        args.export, args.target, args.prompts, cfg, max_new_tokens=args.max_new_tokens, max_prompts=args.max_prompts,
        device=device, target_dtype=getattr(torch, args.target_dtype), chat_template_kwargs=kwargs,
    )
    print(report.table(), flush=True)
    print(f"τ {report.tau:.3f} (greedy chain, {args.export})", flush=True)
    if args.json_out:
        print(f"wrote {report.save(args.json_out)}", flush=True)
    return 0


def _regenerate(args) -> int:
    """The data stage: prints `regen ...` progress lines, then the finished dataset's directory (last line)."""
    from trainer.config import load_config
    from trainer.regenerate import default_root, run_stage
    from trainer.setup import resolve_sources

    cfg = load_config(args.config)
    src = resolve_sources(cfg, lambda line: print(line, flush=True))
    if not src.regenerate:
        raise ValueError(f"{args.config}: data.regenerate is false (or the tiny target's own data is used): nothing to "
                         "regenerate; set data.regenerate: true and list data.train_files")
    root = default_root(args.run_dir, args.datasets)
    path = run_stage(cfg, src.target_dir, src.train_files, root, run_dir=args.run_dir,
                     log=lambda line: print(line, flush=True))
    print(path, flush=True)
    return 0


def _eval_vllm(args, chat_template_kwargs: dict) -> int:
    """`eval --engine vllm`: vLLM's DFlash speculative decoding and plain vLLM beside the project's loop
    (greedy chain), judged: exit 1 on a lossy output or a per-prompt acceptance beyond the tolerance."""
    from trainer.vllm_eval import DEFAULT_TOLERANCE, EngineError, evaluate_in_vllm, judge, own_chain

    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    own = None
    if args.own_report:
        own = own_chain(args.own_report)
        if own is None:
            raise ValueError(f"--own-report {args.own_report}: no greedy chain in it (evaluated without "
                             "temperature 0); drop --own-report to run the project's loop here")
    report = evaluate_in_vllm(
        args.export, args.target, args.prompts, max_new_tokens=args.max_new_tokens, max_prompts=args.max_prompts,
        chat_template_kwargs=chat_template_kwargs, tolerance=tolerance, reference_export=args.reference_export,
        own_per_prompt=own,
    )
    print(report.table(), flush=True)
    if args.json_out:
        print(f"wrote {report.save(args.json_out)}", flush=True)
    if args.metrics:
        from trainer.metrics import MetricsWriter

        with MetricsWriter(args.metrics) as writer:
            writer.write({"kind": "eval_vllm", **report.to_record()})
    try:
        judge(report, args.export)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def _print_export_tau(cfg) -> None:
    """The tiny run's last word: τ of its export (the bf16 file through its remote code), every mode."""
    from pathlib import Path

    from trainer.tiny import evaluate_tiny_export, full_eval_command

    out = Path(cfg.output_dir)
    report = evaluate_tiny_export(cfg, out / "export")
    print(report.table(), flush=True)
    print(f"export τ {report.tau:.3f} (the bf16 file, greedy chain; {out / 'export_eval.json'})", flush=True)
    print(f"every budget and temperature (a few minutes on CPU): {full_eval_command(cfg, out / 'export')}", flush=True)


def _rank_threads(layout) -> None:
    """This process runs as a launched rank of `layout` would: with the intra-op threads `trainer.launch`
    gives a rank (one on CPU unless OMP_NUM_THREADS says otherwise: two threads made a τ evaluation of the
    tiny drafter ~35x slower on a busy 2-core machine, 55 s against 1.5 s)."""
    import os

    import torch

    from trainer.launch import rank_environment

    threads = rank_environment(layout, dict(os.environ)).get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from trainer.config import ConfigError, load_config
    from trainer.data import DataError

    if args.command == "regenerate":
        try:
            return _regenerate(args)
        except (ValueError, RuntimeError) as exc:  # ConfigError, DataError, RegenerateError, EngineError
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
    if args.command == "eval":
        try:
            return _eval(args)
        except ValueError as exc:  # ConfigError and DataError are ValueErrors too
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
    from trainer.distributed import DistributedError, single_world
    from trainer.loop import train
    from trainer.setup import TrainError

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
        layout = cfg.layout.to_layout()
        _rank_threads(layout)
        train(cfg, single_world(layout))
        if args.command == "tiny":
            _print_export_tau(cfg)
    except (ConfigError, DataError, TrainError, DistributedError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
