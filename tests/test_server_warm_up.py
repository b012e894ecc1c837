"""The serving process loads at startup what first requests would load on the event loop."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_warm_up_loads_lazy_modules_and_compiles_the_chat_templates(tmp_path):
    """Protects the warm-up: in a fresh process, anyio's asyncio backend and pydantic.v1 are imported and both chat
    templates (with and without tools) are compiled, so a first request compiles nothing."""
    from tandem.engine.tiny_model import make_tiny_model
    path = make_tiny_model(tmp_path / "m", "qwen3", "1m", seed=0)
    code = (
        "import sys; from tandem.engine.tokenizer import Tokenizer, _compile; "
        "from tandem.server.process import warm_up; "
        f"tok = Tokenizer.from_pretrained({str(path)!r}); "
        "before = ('anyio._backends._asyncio' in sys.modules, 'pydantic.v1' in sys.modules); "
        "warm_up(tok); "
        "after = ('anyio._backends._asyncio' in sys.modules, 'pydantic.v1' in sys.modules); "
        "n = _compile.cache_info().currsize; "
        "tok.apply_chat_template([{'role': 'user', 'content': 'x'}]); "
        "print(before, after, n, _compile.cache_info().misses)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    fields = out.stdout.split()
    assert out.stdout.startswith("(False, False) (True, True)")
    assert int(fields[-2]) >= 1                      # templates compiled by warm_up
    assert int(fields[-1]) == int(fields[-2])        # the later request compiled nothing new
