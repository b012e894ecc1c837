"""The stored calibrations of the built-in workloads equal a fresh solve, and generating them needs no scipy."""
import subprocess
import sys

from tandem.workload.calibrated import CALIBRATED, solved


def test_stored_calibrations_equal_a_fresh_solve():
    """Protects generated sessions: a stored value that drifted from the solver would change every workload."""
    assert CALIBRATED == solved()


def test_generating_a_builtin_workload_imports_no_scipy():
    """Protects CLI start-up: scipy costs about a second to import."""
    code = ("import sys; from tandem.workload.generators import generate; generate('toolbench', 3, 1.0, 0); "
            "print('scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
