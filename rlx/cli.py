"""The `rlx` command line: train, sft, doctor, status, scale, models, export, convert-run, eval, plot, compare,
timeline, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rlx.config import load_config
from rlx.errors import ConfigError, UserError


def _train(args: argparse.Namespace) -> int:
    from rlx.obs.timeline import SPANS

    SPANS.launch_is_this_run()
    config = load_config(args.config, args.overrides)
    if config.train.mode == "async":
        from rlx.orchestration.async_run import run_async as run
    else:
        from rlx.orchestration.colocate import run_colocate as run
    run_dir = run(config, resume=args.resume, overwrite=args.overwrite)
    print(f"done: {run_dir} (metrics.jsonl, training.png, checkpoints/)")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """Print the validated config (stdout, YAML), then on stderr what `auto` settings resolved to and
    the warnings about allowed but doubtful choices."""
    from rlx.config import auto_correction, config_warnings, lost_actor_cost, resolve_routing_replay

    config = load_config(args.config, args.overrides)
    print(config.to_yaml(), end="")
    correction, why = auto_correction(config)
    print(f"# algorithm.behavior_correction={config.algorithm.behavior_correction} -> {correction} ({why})",
          file=sys.stderr)
    replay, why = resolve_routing_replay(config)
    print(f"# algorithm.routing_replay={config.algorithm.routing_replay} -> {replay} ({why})", file=sys.stderr)
    if config.train.mode == "async" and config.train.checkpoint_every:  # without checkpoints: a warning below
        print(f"# recovery: {lost_actor_cost(config)}", file=sys.stderr)
    from rlx.agents.sandbox import sandbox_report

    print(f"# sandbox: {sandbox_report()}", file=sys.stderr)
    for warning in config_warnings(config):
        print(f"# warning: {warning}", file=sys.stderr)
    print("# config OK", file=sys.stderr)
    return 0


def _api(run_dir: str, method: str, route: str, timeout_s: float, **body: object) -> tuple[bool, object]:
    """Call a live run's API, found from the files it wrote into its run directory: (whether it
    answered 2xx, its JSON). Never through a proxy (the token would pass through it); a run that
    has ended, or an API that does not answer, is a UserError that says so."""
    import requests

    where = Path(run_dir)
    try:
        url = json.loads((where / "api.json").read_text())["url"]
        token = (where / "api_token").read_text().strip()
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{run_dir} has no readable api.json and api_token: is it an async run that is still "
                        "going?") from None
    with requests.Session() as session:
        session.trust_env = False
        try:
            response = session.request(method, f"{url}{route}", json=body or None, timeout=timeout_s,
                                       headers={"Authorization": f"Bearer {token}"})
        except requests.RequestException as error:
            raise UserError(f"the run's API at {url} does not answer ({type(error).__name__}): has the run "
                            "ended?") from None
    try:
        return response.ok, response.json()
    except ValueError:
        return False, {"detail": f"HTTP {response.status_code}: {response.text[:300]}"}


def _status(args: argparse.Namespace) -> int:
    ok, reply = _api(args.run_dir, "GET", "/v1/status", 30)
    print(json.dumps(reply, indent=2))
    return 0 if ok else 1


def _scale(args: argparse.Namespace) -> int:
    ok, reply = _api(args.run_dir, "POST", "/v1/rollout/scale", 600, replicas=args.replicas)
    print(json.dumps(reply))
    return 0 if ok else 1


def _models(args: argparse.Namespace) -> int:
    from rlx.models import list_models

    for row in list_models():
        print(f"{row['name']:<24} {row['status']:<10} {row['description']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    """Only the allowlisted model files (`rlx.checkpoints.EXPORT_PATTERNS`): never optimizer state,
    run state, prompts or responses."""
    from rlx.checkpoint_shards import is_sharded
    from rlx.checkpoints import export_checkpoint
    from rlx.orchestration.run_dir import latest_checkpoint

    source = Path(args.checkpoint)
    if not source.is_dir():
        raise UserError(f"{source} does not exist or is not a folder: give a checkpoint folder or a run directory")
    if not any(source.glob("model*.safetensors")) and not is_sharded(source):
        source = latest_checkpoint(source) or source
    names = export_checkpoint(source, Path(args.out))
    print(f"exported {source} -> {args.out}: {', '.join(names)}")
    return 0


def _convert_run(args: argparse.Namespace) -> int:
    from rlx.orchestration.run_dir import convert_run

    converted = convert_run(Path(args.run_dir))
    print(f"converted {len(converted)} checkpoint(s) of {args.run_dir} to checkpoint format 2"
          + "".join(f"\n  {path}" for path in converted))
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Greedy held-out evaluation of a run's latest checkpoint (or its initial model with --initial)."""
    import json
    import tempfile

    from rlx.checkpoint_shards import is_sharded
    from rlx.checkpoints import export_checkpoint
    from rlx.data import load_splits
    from rlx.models import resolve_model_path
    from rlx.orchestration.builder import build_reward_role, build_rollout, prompt_encoder, sampling_params
    from rlx.orchestration.evaluation import evaluate
    from rlx.orchestration.run_dir import latest_checkpoint

    run_dir = Path(args.run_dir)
    config = load_config(run_dir / "config.yaml", args.overrides)
    checkpoint = None if args.initial else latest_checkpoint(run_dir)
    if checkpoint is None and not args.initial:
        raise ConfigError(f"{run_dir} has no checkpoint to evaluate")
    path = Path(checkpoint or resolve_model_path(config.model.path))
    with tempfile.TemporaryDirectory(prefix="rlx-eval-") as joined:
        folder = path
        if is_sharded(path):  # a rank group's slices, joined into a model folder first
            folder = Path(joined)
            export_checkpoint(path, folder)
        rollout = build_rollout(config, folder)
        rows = load_splits(config.data)[1]
        metrics = evaluate(rollout, build_reward_role(config), rows, prompt_encoder(config, rollout),
                           sampling_params(config, seed=0, greedy=True))
    print(json.dumps({"model": str(path), "eval_size": len(rows), **metrics}, indent=2))
    return 0


def _sft(args: argparse.Namespace) -> int:
    from rlx.sft import load_sft_config, run_sft

    summary = run_sft(load_sft_config(args.config, args.overrides))
    print(f"done: {summary['output']} ({summary['steps']} steps, loss {summary['losses'][0]:.4f} -> "
          f"{summary['losses'][-1]:.4f}); start RL from it with model.path={summary['output']}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from rlx.obs import plot_run

    print(plot_run(Path(args.run_dir)))
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from rlx.obs.trace import startup_parts, write_timeline

    window = None
    if args.window:
        try:
            window = tuple(float(part) for part in args.window.split(":"))
        except ValueError:
            window = ()
        if len(window) != 2 or window[0] >= window[1]:
            raise UserError(f"--window {args.window}: give START:END in seconds, START < END (e.g. 120:180)")
    json_path, png_path, trace = write_timeline(Path(args.run_dir), window)
    print(f"{json_path} ({len(trace.spans)} spans; open it in Perfetto or chrome://tracing)\n{png_path}")
    parts, first_step_s = startup_parts(trace)
    if first_step_s is not None:
        print(f"start-up: {first_step_s:.1f} s to the first generation; "
              + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from rlx.obs import plot_compare

    print(plot_compare([Path(d) for d in args.run_dirs], Path(args.out)))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from rlx.bench.report import update_section

    if args.what != "trl":
        args.steps, args.eval_size = args.steps or 8, args.eval_size or 1000
    if args.what == "bus":
        from rlx.bench.bus import format_table, run_bus_benchmark

        table = format_table(run_bus_benchmark(repeats=args.repeats))
        command = f"rlx bench bus --repeats {args.repeats}"
    elif args.what == "engines":
        from rlx.bench.engines import format_table, run_engines_benchmark

        table = format_table(run_engines_benchmark())
        command = "rlx bench engines"
    elif args.what == "weights":
        from rlx.bench.weights import format_table, run_weights_benchmark

        table = format_table(run_weights_benchmark(repeats=args.repeats))
        command = f"rlx bench weights --repeats {args.repeats}"
    elif args.what == "algorithms":
        from rlx.bench.algorithms import format_table, run_algorithms_benchmark

        table = format_table(run_algorithms_benchmark(Path(args.work_dir), steps=args.steps, only=args.only))
        command = f"rlx bench algorithms --steps {args.steps} --work-dir {args.work_dir}"
    elif args.what == "agentic":
        from rlx.bench.agentic import format_table, run_agentic_benchmark

        table = format_table(run_agentic_benchmark(Path(args.work_dir), steps=args.steps))
        command = f"rlx bench agentic --steps {args.steps} --work-dir {args.work_dir}"
    elif args.what == "staleness":
        from rlx.bench.staleness import format_table, parse_cells, run_staleness_benchmark
        from rlx.orchestration.async_run import run_async

        results = run_staleness_benchmark(Path(args.work_dir), args.steps, args.eval_size, run_async,
                                          cells=parse_cells(args.cells))
        table = format_table(results)
        command = f"rlx bench staleness --steps {args.steps} --eval-size {args.eval_size} --work-dir {args.work_dir}"
    elif args.what == "shards":
        from rlx.bench.shards import format_table, run_shards_benchmark

        table = format_table(run_shards_benchmark())
        command = "rlx bench shards"
    elif args.what == "mm":
        from rlx.bench.mm import format_table, run_mm_benchmark

        table = format_table(run_mm_benchmark(repeats=args.repeats))
        command = f"rlx bench mm --repeats {args.repeats}"
    elif args.what == "trl":
        from rlx.bench.trl import SYSTEMS, Settings, format_table, run_trl_benchmark

        settings = Settings(steps=args.steps or Settings.steps, eval_size=args.eval_size or Settings.eval_size)
        systems = tuple(args.systems.split(",")) if args.systems else SYSTEMS
        table = format_table(run_trl_benchmark(Path(args.work_dir) / "trl", settings, systems))
        command = f"rlx bench trl --steps {settings.steps} --eval-size {settings.eval_size} --systems {','.join(systems)}"
    elif args.what == "r3":
        from rlx.bench.r3 import format_table, run_r3_benchmark

        table = format_table(run_r3_benchmark(Path(args.work_dir), repeats=args.repeats))
        command = f"rlx bench r3 --repeats {args.repeats}"
    elif args.what == "parity":
        from rlx.bench.parity import format_table, run_parity_benchmark

        table = format_table(run_parity_benchmark())
        command = "rlx bench parity"
    else:
        from rlx.bench.pipeline import format_table, run_pipeline_benchmark

        table = format_table(run_pipeline_benchmark(Path(args.work_dir), steps=args.steps))
        command = f"rlx bench pipeline --steps {args.steps}"
    print(table)
    out = Path(args.out or ("docs/algorithms.md" if args.what in ("algorithms", "staleness", "parity")
                            else "docs/benchmarks.md"))
    update_section(out, args.what, command, table)
    print(f"written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlx", description="Asynchronous RL post-training for language models")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run training from a YAML config plus key=value overrides")
    train.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6 rollout.n=8")
    train.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="replace an existing run directory (only one rlx created: it holds a .rlx-run file)")
    train.set_defaults(func=_train)

    doctor = sub.add_parser("doctor", help="validate a config and print it resolved")
    doctor.add_argument("config", nargs="?")
    doctor.add_argument("overrides", nargs="*")
    doctor.set_defaults(func=_doctor)

    status = sub.add_parser("status", help="status of a live async run (its management API)")
    status.add_argument("run_dir")
    status.set_defaults(func=_status)

    scale = sub.add_parser("scale", help="scale a live async run's rollout replicas")
    scale.add_argument("run_dir")
    scale.add_argument("replicas", type=int)
    scale.set_defaults(func=_scale)

    models = sub.add_parser("models", help="models available offline")
    models.add_argument("action", choices=["list"])
    models.set_defaults(func=_models)

    export = sub.add_parser("export", help="export a checkpoint (or a run's latest) as a Hugging Face folder: "
                            "weights, config, tokenizer and chat template only")
    export.add_argument("checkpoint")
    export.add_argument("out")
    export.set_defaults(func=_export)

    convert = sub.add_parser(
        "convert-run", help="convert a run directory's old-format checkpoints (pickle run state) in place",
        description="Converts every old-format checkpoint of RUN_DIR in place: run_state.pkl becomes "
                    "run_state.json + run_state.safetensors, optimizer files are re-saved to load with "
                    "weights_only=True, and each gets its completion marker. This LOADS THE OLD PICKLES ONCE, "
                    "TRUSTING THEM: a pickle can run code, so convert only run directories you wrote yourself.")
    convert.add_argument("run_dir")
    convert.set_defaults(func=_convert_run)

    bench = sub.add_parser("bench", help="benchmarks measured side by side; results go to docs/benchmarks.md")
    bench.add_argument("what", choices=["pipeline", "bus", "weights", "engines", "algorithms", "staleness", "agentic",
                                          "r3", "shards", "mm", "trl", "parity"])
    bench.add_argument("--steps", type=int, help="training steps per mode (pipeline, agentic) or per run "
                       "(algorithms, staleness, trl: the same sample budget for every run); 8, or 30 for trl")
    bench.add_argument("--systems", help="trl: comma-separated systems to run, from trl, rlx, trl-bf16, rlx-bf16, "
                       "rlx-vllm (default: all of them)")
    bench.add_argument("--repeats", type=int, default=10, help="rounds per workload (bus, weights, r3, mm)")
    bench.add_argument("--work-dir", default="runs/bench", help="scratch folder for runs and models")
    bench.add_argument("--only", action="append", help="algorithms: run just this one (repeatable); the table "
                       "keeps earlier results found in --work-dir")
    bench.add_argument("--eval-size", type=int, help="staleness, trl: held-out problems per evaluation (1000, "
                       "or 500 for trl)")
    bench.add_argument("--cells", help="staleness: run only these max_staleness:correction pairs "
                       "(every seed, or one named after them), e.g. 0:none,4:tis:0; finished cells found in --work-dir stay in the table")
    bench.add_argument("--out", help="default docs/benchmarks.md (algorithms, staleness, parity: "
                       "docs/algorithms.md)")
    bench.set_defaults(func=_bench)

    evaluate = sub.add_parser("eval", help="greedy held-out accuracy of a run's latest checkpoint")
    evaluate.add_argument("run_dir")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides of the run's config")
    evaluate.add_argument("--initial", action="store_true", help="evaluate the starting model instead")
    evaluate.set_defaults(func=_eval)

    sft = sub.add_parser("sft", help="supervised fine-tuning on JSONL conversations, the loss on assistant "
                         "tokens only (docs/sft.md)")
    sft.add_argument("config", nargs="?", help="YAML of SFT settings (keys: rlx.sft.SFTConfig)")
    sft.add_argument("overrides", nargs="*", help="key=value, e.g. data=chats.jsonl output=runs/sft epochs=2")
    sft.set_defaults(func=_sft)
    plot = sub.add_parser("plot", help="plot reward and eval accuracy of a run to PNG")
    plot.add_argument("run_dir")
    plot.set_defaults(func=_plot)
    timeline = sub.add_parser("timeline", help="every role's spans of a run as RUN_DIR/timeline.json (Chrome trace, "
                              "Perfetto) and RUN_DIR/timeline.png (Gantt chart)")
    timeline.add_argument("run_dir")
    timeline.add_argument("--window", help="draw only START:END, in seconds since the run's first span (the JSON "
                          "always holds everything)")
    timeline.set_defaults(func=_timeline)
    compare = sub.add_parser("compare", help="several runs in one PNG: reward and eval accuracy against "
                             "trained samples and wall time")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument("--out", default="compare.png", help="the PNG to write (default compare.png)")
    compare.set_defaults(func=_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if os.getcwd() not in sys.path:  # `reward.name=my_module:fn` resolves from where rlx runs; last, so a
        sys.path.append(os.getcwd())  # file there never shadows an installed module
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file load/save bars drown the training log
    # `rlx train a=b` (no YAML): argparse puts the first override in `config`
    if getattr(args, "config", None) and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
        return args.func(args)
    except (UserError, FileNotFoundError) as exc:
        print(f"rlx: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
