"""The one action vocabulary: every core action is a command, every message to a worker carries one."""
import dataclasses

from tandem.core import actions, commands as c
from tandem.core.types import PrefillTask
from tandem.runtime import messages as m


def test_every_action_type_is_a_command():
    kinds = [t for t in vars(actions).values() if isinstance(t, type) and dataclasses.is_dataclass(t)
             and t.__module__ == actions.__name__]
    assert kinds and set(kinds) == set(c.COMMAND)


def test_commands_name_the_worker_of_each_action():
    task = PrefillTask("s", 0, 0, 16, 0.0)
    acts = [actions.Submit(1, task), actions.Transfer(2, 3, 8, actions.TransferPurpose.HISTORY, task),
            actions.Release(4, "s"), actions.ToolCall("s", 1.0), actions.Timer(2.0)]
    assert [(k, w) for k, w, _ in c.commands(acts)] == [(c.SUBMIT, 1), (c.SEND_KV, 2), (c.RELEASE, 4),
                                                        (c.TOOL_CALL, -1), (c.TIMER, -1)]


def test_runtime_messages_carry_the_commands_and_share_early():
    assert set(m.COMMAND) == {*m.CONTROL, *m.KV}
    assert set(m.EARLY) == {t for t, k in m.COMMAND.items() if k in c.EARLY}
    assert not {m.RunLocal, m.Release, m.Abort} & set(m.EARLY)
    assert {m.BeginRound, m.AddRequest, m.AddPrefill, m.SendKV, m.KVData, m.Audit} <= set(m.EARLY)
