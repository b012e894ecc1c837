"""The stored calibrations of the built-in workloads equal a fresh solve, and generating them needs no scipy."""
import dataclasses
import subprocess
import sys

from tandem.workload.calibrated import CALIBRATED
from tandem.workload.generators import PREFILL_BASES, WORKLOADS, calibration_key, solve_calibration
from tandem.workload.session import WorkloadError


def _solved() -> dict:
    """Every built-in spec under each prefill basis it admits, solved now."""
    out = {}
    for spec in WORKLOADS.values():
        for basis in PREFILL_BASES:
            s = dataclasses.replace(spec, prefill_basis=basis)
            try:
                out[calibration_key(s)] = dataclasses.astuple(solve_calibration(s))
            except WorkloadError:
                continue
    return out


def test_stored_calibrations_equal_a_fresh_solve():
    """Protects generated sessions: a stored value that drifted from the solver would change every workload."""
    solved = _solved()
    table = "".join(f"    {k!r}:\n        {v!r},\n" for k, v in solved.items())
    assert CALIBRATED == solved, f"paste into tandem/workload/calibrated.py:\n{table}"


def test_generating_a_builtin_workload_imports_no_scipy():
    """Protects CLI start-up: scipy costs about a second to import."""
    code = ("import sys; from tandem.workload.generators import generate; generate('toolbench', 3, 1.0, 0); "
            "print('scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
