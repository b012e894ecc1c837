"""The built-in workload specs' calibrations, solved once and stored (CALIBRATED).

Solving a spec (generators.solve_calibration: root finding with scipy) is cheap, but importing scipy
costs about a second, which every `tandem plan` or `tandem simulate` on a built-in generator paid
at start-up. The values below are what the solver returns, written with `repr` (exact round trip);
tests/test_workload_calibration.py re-solves every built-in spec and requires equality, so a changed
spec or solver fails there (the failure prints the entries to paste here).

Key: generators.calibration_key(spec) (every spec field but name and rationale);
value: (rounds_param, mu_input_first, mu_input_later, mu_output).
"""
from __future__ import annotations

CALIBRATED: dict[tuple, tuple[float, float, float, float]] = {
    # toolbench
    ("agentic", "poisson", 3.96, None, 16, 703.79, 0.6, 3.0, 16384, 50.39, 0.5, 1024, 1.0, 0.8, 0.05, 30.0, "input"):
        (2.9600001252215846, 7.066274985665949, 5.967653561233019, 3.794792742987487),
    ("agentic", "poisson", 3.96, None, 16, 703.79, 0.6, 3.0, 16384, 50.39, 0.5, 1024, 1.0, 0.8, 0.05, 30.0, "prompt"):
        (2.9600001252215846, 5.752945398435138, 4.6543331096728275, 3.794792742987487),
    # gaia
    ("agentic", "negbin", 11.32, 1.5, 100, 6161.02, 1.1, 1.0, 65536, 528.76, 0.9, 8192, 4.0, 1.2, 0.1, 600.0, "input"):
        (10.32004324745865, 8.13979972565936, 8.13979972565936, 5.8665963755870765),
    ("agentic", "negbin", 11.32, 1.5, 100, 6161.02, 1.1, 1.0, 65536, 528.76, 0.9, 8192, 4.0, 1.2, 0.1, 600.0, "prompt"):
        (10.32004324745865, 4.452890616789321, 4.452890616789321, 5.8665963755870765),
    # hotpotqa
    ("rag", "fixed", 3, None, 3, 1569.8, 0.35, 1.0, 8192, 80.03, 0.5, 1024, 0.4, 0.5, 0.05, 5.0, "input"):
        (0.0, 7.297453683414883, 7.297453683414883, 4.257401618992258),
    ("rag", "fixed", 3, None, 3, 1569.8, 0.35, 1.0, 8192, 80.03, 0.5, 1024, 0.4, 0.5, 0.05, 5.0, "prompt"):
        (0.0, 6.551979844046129, 6.551979844046129, 4.257401618992258),
    # dureader
    ("rag", "fixed", 3, None, 3, 3081.23, 0.4, 1.0, 16384, 150.1, 0.5, 2048, 0.6, 0.5, 0.05, 8.0, "input"):
        (0.0, 7.953087051806294, 7.953087051806294, 4.886301766402957),
    ("rag", "fixed", 3, None, 3, 3081.23, 0.4, 1.0, 16384, 150.1, 0.5, 2048, 0.6, 0.5, 0.05, 8.0, "prompt"):
        (0.0, 7.209996112791521, 7.209996112791521, 4.886301766402957),
}

