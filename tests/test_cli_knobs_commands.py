"""The flags of `tandem plan`, `profile`, `bench` and `tiny-model` are generated from configuration fields
(tandem.knob): each has its field, its default is the field's, and the spellings users know still parse."""
from __future__ import annotations

import argparse

import pytest

from tandem.cli.common import CLIError, Parser, positive_int
from tandem.cli.main import build_parser
from tandem.knob import field_default

COMMANDS = ("plan", "profile", "bench", "tiny-model")


def _sub(command: str) -> argparse.ArgumentParser:
    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_comes_from_a_field_with_its_default(command):
    """Protects: no hand-written flag in these commands; the parser's default is the owning field's default."""
    for action in _sub(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        cls, name = action.knob_source
        assert action.dest == name
        f = cls.__dataclass_fields__[name]
        if not action.required:
            assert action.default == field_default(f), (command, action.option_strings)
        if field_default(f) not in (None, True, False):     # a value default is appended to the help, not written
            assert "(default: " not in (f.metadata["tandem.knob"].help or ""), (command, action.option_strings)


def test_known_spellings_parse_to_field_names(tmp_path):
    """Protects: --top, --timeout, --no-return-token-ids and --no-tie-embeddings keep working under the field names."""
    p = build_parser()
    a = p.parse_args(["plan", "--workload", "toolbench", "--gpus", "8", "--top", "5", "--json"])
    assert (a.gpus, a.top_k, a.json, a.format, a.jobs) == (8, 5, True, "table", None)
    a = p.parse_args(["bench", "--url", "http://x", "--workload", "toolbench", "--timeout", "5",
                      "--no-return-token-ids"])
    assert (a.timeout_s, a.return_token_ids, a.sessions, a.scale) == (5.0, False, None, 1.0)
    a = p.parse_args(["tiny-model", "--out", str(tmp_path)])
    assert a.tie_embeddings is None and a.train_block_sizes is None
    assert p.parse_args(["tiny-model", "--out", "x", "--no-tie-embeddings"]).tie_embeddings is False
    assert p.parse_args(["tiny-model", "--out", "x", "--tie-embeddings"]).tie_embeddings is True
    a = p.parse_args(["profile", "--model", "m", "--cuda-graph-sizes", "4,1"])
    assert (a.cuda_graph_sizes, a.max_num_batched_tokens, a.max_num_seqs, a.out) == ((4, 1), 2048, 256, "profile.json")


def test_shared_defaults_are_the_owners():
    """Protects: the profiler's budgets and the bench seed are the scheduler's and workload's knobs, one default."""
    from tandem.bench.bench_options import BenchConfig
    from tandem.core.config import SchedulerConfig
    from tandem.engine.diffusion.train import TrainConfig
    from tandem.engine.profiling.options import ProfileOptions
    from tandem.engine.tiny_options import TRAIN_BLOCK_SIZES, TRAIN_STEPS, TRAIN_THREADS
    from tandem.plan import PlanInputs
    from tandem.plan.options import DEFAULT_TOP_K
    from tandem.workload.options import WorkloadOptions

    opts, sched = ProfileOptions(), SchedulerConfig()
    assert (opts.max_num_batched_tokens, opts.max_num_seqs, opts.block_size) == \
        (sched.max_num_batched_tokens, sched.max_num_seqs, sched.block_size)
    assert BenchConfig(url="http://x").seed == WorkloadOptions().seed
    assert PlanInputs("m", "g", 1, []).top_k == DEFAULT_TOP_K
    cfg = TrainConfig()
    assert (cfg.steps, cfg.threads, cfg.block_sizes) == (TRAIN_STEPS, TRAIN_THREADS, TRAIN_BLOCK_SIZES)


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--workload", "toolbench", "--gpus", "0"], "argument --gpus: must be >= 1, got '0'"),
    (["plan", "--workload", "toolbench"], "the following arguments are required: --gpus"),
    (["bench", "--url", "u", "--workload", "w", "--timeout", "-1"], "argument --timeout: must be > 0, got '-1'"),
    (["tiny-model", "--out", "x", "--eval-examples", "-1"], "argument --eval-examples: must be >= 0, got '-1'"),
    (["profile", "--model", "m", "--heldout", "x"], "argument --heldout: expected an integer, got 'x'"),
])
def test_bad_values_are_one_line_naming_the_flag(argv, needle):
    """Protects: a refused value is one CLIError line naming the flag, as before the flags were generated."""
    with pytest.raises(CLIError) as e:
        build_parser().parse_args(argv)
    assert str(e.value) == needle


def test_common_argument_types_keep_the_knob_message():
    """Protects: cli.common's argparse types (used by the scripts under benchmarks/) say what tandem.knob says."""
    p = Parser(prog="x")
    p.add_argument("--n", type=positive_int)
    with pytest.raises(CLIError, match=r"^argument --n: must be >= 1, got '0'$"):
        p.parse_args(["--n", "0"])
