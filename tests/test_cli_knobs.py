"""Every `tandem` flag is generated from a configuration field, and a knob's value default lives in one field:
checked by walking the parsers and the config classes (introspection, not text)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from tandem.cli.main import build_parser
from dataclasses import MISSING

from tandem.knob import OVERRIDE, field_default, knob_of


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags() -> list[tuple[str, argparse.Action]]:
    out = []
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            out.append((name, action))
    return out


FLAGS = _flags()


def _config_classes() -> set[type]:
    from tandem.core.config import SchedulerConfig
    from tandem.engine.config import EngineConfig
    from tandem.runtime.cluster import ClusterConfig
    from tandem.sim.config import SimConfig
    classes = {SchedulerConfig, EngineConfig, ClusterConfig, SimConfig}
    classes |= {getattr(a, "knob_source")[0] for _, a in FLAGS if hasattr(a, "knob_source")}
    return classes


def test_every_subcommand_has_flags_to_check():
    commands = {c for c, _ in FLAGS}
    assert {"simulate", "generate", "experiment", "plan", "profile", "serve", "demo", "bench",
            "tiny-model"} <= commands


@pytest.mark.parametrize("command,action", FLAGS, ids=[f"{c}:{a.option_strings[0]}" for c, a in FLAGS])
def test_flag_is_generated_from_a_knob_field(command, action):
    """A hand-written flag would carry its own default and help: every flag must name the field it came from."""
    source = getattr(action, "knob_source", None)
    assert source is not None, f"tandem {command} {action.option_strings[0]} is not generated from a config field"
    cls, name = source
    f = cls.__dataclass_fields__[name]
    assert knob_of(f) is not None
    assert action.dest == name
    default = field_default(f)
    if default is MISSING:
        assert action.required
    else:
        assert action.default == default, f"{action.option_strings[0]}: the flag's default is not its field's"


def test_a_value_default_is_written_once():
    """Two configs that carry the same knob share one Knob object (tandem.knob.shared), so its default, help and
    parser cannot drift apart; a different default in a second config is a stated override."""
    seen: dict[str, list[tuple[type, dataclasses.Field]]] = {}
    for cls in _config_classes():
        for f in dataclasses.fields(cls):
            k = knob_of(f)
            if k is None:
                continue
            seen.setdefault(f.name, []).append((cls, f))
    copies = []
    for name, owners in seen.items():
        valued = [(c, f) for c, f in owners if field_default(f) not in (None, False, 0, "", [], (), MISSING)]
        by_default: dict[str, set[int]] = {}
        for _, f in valued:
            by_default.setdefault(repr(field_default(f)), set()).add(id(knob_of(f)))
        # two knobs of one name and one value default are one knob written twice (knobs of one name with other
        # defaults are other knobs: `out` of the profiler and of the demo)
        copies += [f"{name}={d}: {len(ids)} knobs" for d, ids in by_default.items() if len(ids) > 1]
        for k in {id(knob_of(f)) for _, f in valued}:
            same = [field_default(f) for _, f in valued if id(knob_of(f)) == k and OVERRIDE not in f.metadata]
            if len({repr(d) for d in same}) > 1:
                copies.append(f"{name}: one knob with defaults {same} and no stated override")
    assert copies == []


def test_shared_knob_keeps_its_owner_default():
    from tandem.core.config import SchedulerConfig
    from tandem.sim.config import SimConfig
    for name in ("max_num_seqs", "kv_timeout_s", "session_ttl_s", "dllm_prefill_share", "swap_space"):
        ours = SimConfig.__dataclass_fields__[name]
        owner = SchedulerConfig.__dataclass_fields__[name]
        assert knob_of(ours) is knob_of(owner)
        assert field_default(ours) == field_default(owner)
    chunk = SimConfig.__dataclass_fields__["dllm_chunk"]
    assert chunk.default == "elastic" and chunk.metadata[OVERRIDE]
