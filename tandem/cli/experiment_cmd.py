"""`tandem experiment`: run a preset sweep of workloads x policies x rates (AMPD Fig. 4/5), optionally narrowed,
and write its report."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from tandem.bench.sweep_options import ExperimentOptions, SweepOptions
from tandem.cli.args import add_knobs
from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import CLIError, cost_fields, cost_note, ray_executor
from tandem.sim.config import COST_KNOBS, SimConfig
from tandem.workload.options import WorkloadOptions


def add_parser(sub) -> None:
    """Register `experiment` on the subparsers `sub` of the tandem parser."""
    e = sub.add_parser("experiment", help=COMMAND_HELP["experiment"],
                       description="Run a preset sweep, optionally narrowed, and write results.json, "
                                   "table.md/txt, summary.md and figures to --out.")
    add_knobs(e, ExperimentOptions, exclude=("out",))
    add_knobs(e, WorkloadOptions, ("prefill_basis",))
    add_knobs(e, ExperimentOptions, ("out",))
    add_knobs(e, SimConfig, COST_KNOBS)
    add_knobs(e, SweepOptions)
    e.set_defaults(func=cmd_experiment)


def cmd_experiment(args) -> int:
    """`tandem experiment`: run a preset (optionally narrowed) and print the table and report location."""
    from tandem.bench.experiment import PRESETS, format_cells, preset, run_experiment, summary_text

    if args.preset not in PRESETS:
        raise CLIError(f"unknown preset {args.preset!r} (valid: {', '.join(PRESETS)})")
    spec = preset(args.preset, model=args.model, gpu=args.gpu, workloads=args.workloads,
                  policies=args.policies, rates=args.rates, sessions=args.sessions, seeds=args.seeds,
                  jobs=args.jobs, prefill_basis=args.prefill_basis, deploy_per_rate=args.deploy_per_rate or None)
    if args.model is not None or args.gpu is not None:
        spec = dataclasses.replace(spec, deploys={})  # the preset's fixed deployments are for its model and GPU
    spec = dataclasses.replace(spec, sim={**spec.sim, **cost_fields(args)})
    cost_note(spec.gpu, args)
    if args.gpus is not None:
        gpus = args.gpus if isinstance(args.gpus, dict) else dict.fromkeys(spec.workloads, args.gpus)
        unknown = sorted(set(gpus) - set(spec.workloads))
        if unknown:
            raise CLIError(f"--gpus names workloads not in the experiment: {', '.join(unknown)}")
        spec = dataclasses.replace(spec, gpus={**spec.gpus, **gpus})
    out_dir = Path(args.out or f"reports/{args.preset}")
    if args.ray and args.jobs is not None:
        raise CLIError("--jobs does not apply with --ray (the Ray cluster's CPUs run the simulations)")
    with ray_executor(args) as executor:
        result = run_experiment(spec, out_dir, progress=not args.no_progress and sys.stderr.isatty(),
                                executor=executor)
    print(format_cells(result["cells"]), end="")
    if result["improvement"]:
        print()
        print(summary_text(result["improvement"]), end="")
    print(f"\nreport: {out_dir}/ ({', '.join(Path(f).name for f in result['files'].values())}) "
          f"in {result['wall_s']:.1f} s")
    return 0

