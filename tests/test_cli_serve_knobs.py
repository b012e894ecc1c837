"""`tandem serve` and `tandem demo` flags come from configuration fields (tandem.knob): each flag names its field,
the scheduler's knobs are SchedulerConfig's own, the flags' defaults build the configs' defaults, and a bad value is
a one-line error naming the flag."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from tandem.bench.demo_options import DEMO_MAX_MODEL_LEN, DemoOptions
from tandem.cli import serve_cmd
from tandem.cli.main import build_parser, main
from tandem.core.config import SchedulerConfig
from tandem.engine.config import EngineConfig
from tandem.knob import KNOB
from tandem.runtime.cluster_config import ClusterConfig
from tandem.server.options import ServerOptions
from tandem.server.state import Limits


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint folder as far as `tandem serve`'s checks read it (config.json's architecture)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    return str(tmp_path)


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_every_flag_is_a_config_field(command):
    """Protects the rule that no flag is written by hand: each action but --help was generated from a knob field,
    and its destination is that field's name."""
    for action in _subparser(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        cls, name = action.knob_source
        assert action.dest == name and name in cls.__dataclass_fields__, action.option_strings


def test_scheduler_knobs_are_shared_not_copied():
    """Protects one default per knob: the engine's and the cluster's scheduler knobs are SchedulerConfig's Knob
    objects with its defaults, and the app's limits are ServerOptions'."""
    def knob(cls, name):
        return cls.__dataclass_fields__[name].metadata[KNOB]
    for cls, name in ((EngineConfig, "max_num_seqs"), (EngineConfig, "max_num_batched_tokens"),
                      (EngineConfig, "dllm_chunk"), (EngineConfig, "swap_space"), (EngineConfig, "preemption_mode"),
                      (ClusterConfig, "kv_timeout_s"), (ClusterConfig, "session_ttl_s")):
        assert knob(cls, name) is knob(SchedulerConfig, name), (cls.__name__, name)
        assert cls.__dataclass_fields__[name].default == SchedulerConfig.__dataclass_fields__[name].default
    assert knob(Limits, "max_messages") is knob(ServerOptions, "max_messages")


def test_default_flags_build_the_default_configs(ckpt):
    """Protects the flags' defaults: `serve --model M` builds ClusterConfig(M) (the engines keep every EngineConfig
    default) and ServerOptions(); the flags' values reach their fields."""
    p = build_parser()
    cfg = serve_cmd._cluster_config(p.parse_args(["serve", "--model", ckpt]))
    assert cfg == ClusterConfig(ckpt)
    assert cfg.engine_args == {} and cfg.policy == "ampd"
    assert serve_cmd.server_options(p.parse_args(["serve", "--model", ckpt]))["app"]["max_body_bytes"] == \
        ServerOptions().max_body_bytes
    args = p.parse_args(["serve", "--model", ckpt, "--colocated", "2", "--kv-timeout", "3", "--session-ttl", "9",
                         "--max-worker-restarts", "0", "--max-num-seqs", "8", "--swap-space", "1", "--block-size", "32",
                         "--slo-ttft", "0.5", "--port", "0"])
    cfg = serve_cmd._cluster_config(args)
    assert (cfg.policy, cfg.prefill_workers, cfg.decode_workers, cfg.colocated) == ("vllm", 0, 0, 2)
    assert (cfg.kv_timeout_s, cfg.session_ttl_s, cfg.max_restarts, cfg.slo_ttft_s) == (3, 9, 0, 0.5)
    assert cfg.engine_args == {"max_num_seqs": 8, "swap_space": 1, "block_size": 32}
    assert args.port == 0


def test_demo_flags_keep_the_demo_defaults(ckpt):
    """Protects the demo's own defaults: its context reaches the engines, every DemoOptions default is the flag's."""
    args = build_parser().parse_args(["demo", "--model", ckpt])
    assert {f.name: getattr(args, f.name) for f in dataclasses.fields(DemoOptions)} == \
        dataclasses.asdict(DemoOptions(model=ckpt))
    assert serve_cmd._cluster_config(args).engine_args == {"max_model_len": DEMO_MAX_MODEL_LEN}


@pytest.mark.parametrize("flag,value", [("--kv-timeout", "0"), ("--port", "70000"), ("--max-body-bytes", "0"),
                                        ("--ray-place", "gpu=x"), ("--max-worker-restarts", "-1"),
                                        ("--laps-min-pool", "-1"), ("--shutdown-timeout", "0"),
                                        ("--block-size", "0")])
def test_a_bad_value_is_one_line_naming_the_flag(flag, value, ckpt, capsys):
    """Protects the validation the flags had: a refused value exits 2 with one line that names the flag."""
    assert main(["serve", "--model", ckpt, flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error: ") and flag in err[0], err


@pytest.mark.parametrize("policy, size, why", [
    ("ampd-tiered", "1000000", "--kv-offloading-size 1e+06 GiB on each of 1 worker(s) exceeds the"),
    ("ampd", "1", "--kv-offloading-size: policy ampd keeps no KV in host memory"),
])
def test_a_host_tier_that_cannot_be_served_is_one_line_before_any_worker(policy, size, why, ckpt, capsys):
    """Protects the start-up refusal of --kv-offloading-size: larger than the machine's available memory, or with a
    policy that keeps no host tier: one `tandem: error:` line, exit 2, and no worker process was started."""
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main(["serve", "--model", ckpt, "--policy", policy, "--kv-offloading-size", size]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error: " + why), err
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_the_host_tier_size_is_the_schedulers_knob():
    """--kv-offloading-size on serve is SchedulerConfig's knob (vLLM's meaning: GiB per worker), shared, not copied."""
    knob = EngineConfig.__dataclass_fields__["kv_offloading_size"].metadata[KNOB]
    assert knob is SchedulerConfig.__dataclass_fields__["kv_offloading_size"].metadata[KNOB]
    action = next(a for a in _subparser("serve")._actions if "--kv-offloading-size" in a.option_strings)
    assert action.knob_source == (EngineConfig, "kv_offloading_size")
